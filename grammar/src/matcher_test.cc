// The pushdown matcher: token masks against a brute-force check of every token, random walks
// that sample only allowed tokens, rollback, stop and special tokens, and the grammar cache.
#include "tandem/grammar/matcher.h"

#include <algorithm>
#include <set>
#include <thread>

#include "automaton.h"
#include "gtest/gtest.h"
#include "tandem/grammar/json_schema.h"
#include "testing/byte_vocab.h"
#include "testing/schema_fuzz.h"

namespace tandem::grammar {
namespace {

using testing::ordered_json;

constexpr int32_t kStop = 0;
constexpr int32_t kSpecial = 1;

// A small vocabulary shaped like a real one: every printable ASCII byte, JSON-ish pieces and
// their concatenations, whole and cut UTF-8 characters, a stop token and a special token.
std::shared_ptr<const TokenVocabulary> SyntheticVocabulary() {
  static const auto vocab = [] {
    std::vector<std::string> tokens = {"</s>", "<|special|>"};
    for (int c = 0x20; c < 0x7F; ++c) tokens.push_back(std::string(1, char(c)));
    tokens.insert(tokens.end(), {"\n", "\t", "\xC3", "\xA9", "\xE6\x97", "\xA5"});
    const std::vector<std::string> pieces = {
        "{\"", "\"}", "\":",  "\", \"", "\": \"", "true",    "false", "null", "nul",  "1",   "23",
        "0.",  "e+",  "\n  ", "  ",     "\\n",    "\\u00e9", "\\\"",  "é",    "日本", "abc", "k0",
        "k1",  "k2",  "red",  "gr",     "een",    "\": ",    ", ",    "[",    "]",    "},",  "],",
        "[\"", "\"]", "-4",   "7.5",    "\\",     "😀",       "date",  " \"",  "\"\n"};
    tokens.insert(tokens.end(), pieces.begin(), pieces.end());
    std::mt19937 rng(5);
    for (int i = 0; i < 1500; ++i) {
      std::string t;
      int n = 2 + rng() % 2;
      for (int k = 0; k < n; ++k) t += pieces[rng() % pieces.size()];
      tokens.push_back(t);
    }
    return *TokenVocabulary::Create(std::move(tokens), {kStop}, {kSpecial});
  }();
  return vocab;
}

std::shared_ptr<const CompiledGrammar> Compile(const std::string& gbnf) {
  auto grammar = ParseGbnf(gbnf);
  EXPECT_TRUE(grammar.ok()) << grammar.status();
  auto compiled = CompiledGrammar::Create(*grammar, SyntheticVocabulary());
  EXPECT_TRUE(compiled.ok()) << compiled.status();
  return *compiled;
}

std::vector<int32_t> Allowed(const TokenMask& mask, int n) {
  std::vector<int32_t> ids;
  for (int32_t id = 0; id < n; ++id) {
    if (MaskAllows(mask, id)) ids.push_back(id);
  }
  return ids;
}

// Every token tried with AcceptToken and rolled back.
std::vector<int32_t> BruteForce(GrammarMatcher& m, int n) {
  std::vector<int32_t> ids;
  for (int32_t id = 0; id < n; ++id) {
    if (m.AcceptToken(id)) {
      ids.push_back(id);
      EXPECT_TRUE(m.Rollback(1).ok());
    }
  }
  return ids;
}

TEST(GrammarMatcherTest, MaskEqualsBruteForceAlongRandomWalks) {
  testing::SchemaFuzzer fuzz(11);
  const int n = SyntheticVocabulary()->size();
  std::vector<std::string> grammars = {JsonObjectGbnf(), *RegexToGbnf("(ab|c)*[0-9]{2,3}\"?")};
  for (int i = 0; i < 40; ++i) grammars.push_back(*JsonSchemaToGbnf(fuzz.Schema()));
  for (const std::string& gbnf : grammars) {
    auto compiled = Compile(gbnf);
    GrammarMatcher m(compiled);
    TokenMask mask;
    for (int step = 0; step < 60 && !m.IsTerminated(); ++step) {
      m.FillNextTokenMask(mask);
      std::vector<int32_t> allowed = Allowed(mask, n);
      ASSERT_EQ(allowed, BruteForce(m, n)) << gbnf << "\nstep " << step;
      ASSERT_FALSE(allowed.empty());
      ASSERT_TRUE(m.AcceptToken(allowed[fuzz.Uniform(0, allowed.size() - 1)]));
    }
  }
}

TEST(CompiledGrammarTest, ThreadsDoNotChangeTheMasks) {
  testing::SchemaFuzzer fuzz(23);
  for (int i = 0; i < 20; ++i) {
    auto grammar = ParseGbnf(*JsonSchemaToGbnf(fuzz.Schema()));
    ASSERT_TRUE(grammar.ok());
    auto one = CompiledGrammar::Create(*grammar, SyntheticVocabulary(), 1);
    auto four = CompiledGrammar::Create(*grammar, SyntheticVocabulary(), 4);
    ASSERT_TRUE(one.ok() && four.ok());
    ASSERT_EQ((*one)->num_positions(), (*four)->num_positions());
    for (size_t pos = 0; pos < (*one)->flat().positions.size(); ++pos) {
      if ((*one)->flat().positions[pos].kind != internal::FlatGrammar::Kind::kBytes ||
          !(*one)->flat().reachable[pos]) {
        continue;
      }
      ASSERT_EQ((*one)->accepted(pos), (*four)->accepted(pos)) << "position " << pos;
      ASSERT_TRUE(std::ranges::equal((*one)->uncertain(pos), (*four)->uncertain(pos)));
    }
  }
}

// The compile's memoized steps over interned stack sets equal Advance's, answered from the
// dense tables and from the hash map that takes the sets past them, and again when asked twice.
TEST(StackArenaTest, SetStepsEqualAdvanceInTheTablesAndPastThem) {
  testing::SchemaFuzzer fuzz(31);
  for (const std::string& gbnf : {JsonObjectGbnf(), *JsonSchemaToGbnf(fuzz.Schema())}) {
    auto grammar = ParseGbnf(gbnf);
    ASSERT_TRUE(grammar.ok()) << grammar.status();
    const internal::FlatGrammar flat = internal::FlatGrammar::Build(*grammar);
    constexpr int32_t kDense = 4;
    internal::StackArena arena(flat, kDense);
    std::vector<int32_t> frontier = {arena.InternSet(arena.Start().tops)};
    std::set<int32_t> seen(frontier.begin(), frontier.end());
    internal::StackArena::Step expected;
    int past_the_tables = 0;
    while (!frontier.empty() && seen.size() < 300) {
      const int32_t set = frontier.back();
      frontier.pop_back();
      for (int byte = 0; byte < 256; ++byte) {
        const std::vector<int32_t> tops = arena.set(set);
        arena.Advance(tops, static_cast<uint8_t>(byte), expected);
        for (int ask = 0; ask < 2; ++ask) {
          const internal::StackArena::SetStep got =
              arena.AdvanceSet(set, static_cast<uint8_t>(byte));
          ASSERT_EQ(got.matched, expected.matched) << gbnf << "\nset " << set << " byte " << byte;
          if (!expected.matched) continue;
          ASSERT_EQ(got.ended, expected.ended);
          ASSERT_EQ(arena.set(got.next), expected.tops);
          if (seen.insert(got.next).second) frontier.push_back(got.next);
        }
        if (set >= kDense) ++past_the_tables;
      }
    }
    EXPECT_GT(past_the_tables, 0) << gbnf;
  }
}

TEST(GrammarMatcherTest, RandomWalksEndInValidDocuments) {
  testing::SchemaFuzzer fuzz(23);
  const auto vocab = SyntheticVocabulary();
  int finished = 0;
  for (int round = 0; round < 200; ++round) {
    ordered_json schema = fuzz.Schema();
    auto compiled = Compile(*JsonSchemaToGbnf(schema));
    GrammarMatcher m(compiled);
    TokenMask mask;
    std::string text;
    for (int step = 0; step < 5000 && !m.IsTerminated(); ++step) {
      m.FillNextTokenMask(mask);
      std::vector<int32_t> allowed = Allowed(mask, vocab->size());
      ASSERT_FALSE(allowed.empty()) << schema.dump() << "\n" << text;
      EXPECT_FALSE(MaskAllows(mask, kSpecial));
      int32_t id =
          m.IsComplete() && fuzz.Coin() ? kStop : allowed[fuzz.Uniform(0, allowed.size() - 1)];
      ASSERT_TRUE(m.AcceptToken(id));
      if (id != kStop) text += vocab->bytes(id);
    }
    ASSERT_TRUE(m.IsTerminated()) << "walk did not end: " << schema.dump() << "\n" << text;
    ++finished;
    ordered_json doc = ordered_json::parse(text, nullptr, false);
    ASSERT_FALSE(doc.is_discarded()) << schema.dump() << "\n" << text;
    EXPECT_TRUE(testing::Validate(schema, schema, doc)) << schema.dump() << "\n" << text;
  }
  EXPECT_EQ(finished, 200);
}

TEST(GrammarMatcherTest, StopOnlyWhenCompleteAndNothingAfterIt) {
  auto compiled = Compile("root ::= \"ab\" \"c\"?");
  GrammarMatcher m(compiled);
  const auto vocab = SyntheticVocabulary();
  EXPECT_FALSE(m.AcceptToken(kStop));
  EXPECT_FALSE(m.AcceptToken(kSpecial));
  EXPECT_TRUE(m.AcceptBytes("ab"));
  EXPECT_TRUE(m.IsComplete());
  TokenMask mask;
  m.FillNextTokenMask(mask);
  EXPECT_TRUE(MaskAllows(mask, kStop));
  EXPECT_EQ(Allowed(mask, vocab->size()).size(), 2u);  // "c" and the stop token
  EXPECT_TRUE(m.AcceptToken(kStop));
  EXPECT_TRUE(m.IsTerminated());
  EXPECT_FALSE(m.AcceptBytes("c"));
  m.FillNextTokenMask(mask);
  EXPECT_TRUE(Allowed(mask, vocab->size()).empty());
}

TEST(GrammarMatcherTest, RollbackRestoresTheMask) {
  auto compiled = Compile(JsonObjectGbnf());
  const auto vocab = SyntheticVocabulary();
  GrammarMatcher m(compiled, /*max_rollback_tokens=*/4);
  ASSERT_TRUE(m.AcceptBytes("{\"k0\": "));
  TokenMask before, after;
  m.FillNextTokenMask(before);
  for (const char* piece : {"[", "\"", "abc", "\""}) ASSERT_TRUE(m.AcceptBytes(piece)) << piece;
  m.FillNextTokenMask(after);
  EXPECT_NE(before, after);
  ASSERT_TRUE(m.Rollback(4).ok());
  m.FillNextTokenMask(after);
  EXPECT_EQ(before, after);
  EXPECT_FALSE(m.Rollback(1).ok());  // only 4 kept, all used
  EXPECT_FALSE(m.AcceptBytes("}"));  // a value is still due
  EXPECT_FALSE(m.IsComplete());
}

TEST(GrammarMatcherTest, RejectedTokenLeavesStateUnchanged) {
  auto compiled = Compile("root ::= \"abc\"");
  GrammarMatcher m(compiled);
  EXPECT_FALSE(m.AcceptBytes("abx"));
  EXPECT_TRUE(m.AcceptBytes("abc"));
  EXPECT_TRUE(m.IsComplete());
}

TEST(GrammarCacheTest, CompilesEachGrammarOnce) {
  GrammarCache cache(/*capacity=*/2);
  const auto vocab = SyntheticVocabulary();
  int builds = 0;
  auto build = [&](std::string gbnf) {
    return [&builds, gbnf]() -> absl::StatusOr<Grammar> {
      ++builds;
      return ParseGbnf(gbnf);
    };
  };
  auto a1 = cache.GetOrCompile("gbnf", "a", vocab, build("root ::= \"a\""));
  auto a2 = cache.GetOrCompile("gbnf", "a", vocab, build("root ::= \"a\""));
  ASSERT_TRUE(a1.ok());
  EXPECT_EQ(*a1, *a2);
  EXPECT_EQ(builds, 1);
  auto bad = cache.GetOrCompile("gbnf", "bad", vocab, build("root ::= ("));
  EXPECT_FALSE(bad.ok());
  EXPECT_EQ(cache.GetOrCompile("gbnf", "bad", vocab, build("root ::= (")).status(), bad.status());
  EXPECT_EQ(builds, 2);
  cache.GetOrCompile("gbnf", "c", vocab, build("root ::= \"c\"")).IgnoreError();
  EXPECT_EQ(cache.size(), 2u);  // "a" evicted
  cache.GetOrCompile("gbnf", "a", vocab, build("root ::= \"a\"")).IgnoreError();
  EXPECT_EQ(builds, 4);
}

TEST(GrammarCacheTest, ConcurrentRequestsShareOneCompilation) {
  GrammarCache cache;
  const auto vocab = SyntheticVocabulary();
  std::vector<std::shared_ptr<const CompiledGrammar>> got(4);
  {
    std::vector<std::jthread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&, t] {
        got[t] = *cache.GetOrCompile("json_object", "", vocab,
                                     [] { return ParseGbnf(JsonObjectGbnf()); });
      });
    }
  }
  EXPECT_EQ(cache.compilations(), 1u);
  for (auto& g : got) EXPECT_EQ(g, got[0]);
}

}  // namespace
}  // namespace tandem::grammar

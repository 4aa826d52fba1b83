// Constrained decoding's grammar engine: compile time and per-token mask time for a 128k-token
// vocabulary (Llama 3's tokenizer.json when found, else a synthetic byte-string vocabulary).
//   TANDEM_BENCH_TOKENIZER=path/to/tokenizer.json tandem_bench_grammar
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <random>

#include "tandem/grammar/json_schema.h"
#include "tandem/grammar/matcher.h"
#include "tandem/text/tokenizer.h"
#include "order_schema.h"

namespace tandem::grammar {
namespace {

constexpr const char* kSchema = R"({
  "type": "object",
  "properties": {
    "name": {"type": "string"},
    "age": {"type": "integer"},
    "email": {"type": "string", "format": "email"},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
    "address": {"type": "object", "properties": {
        "street": {"type": "string"}, "city": {"type": "string"},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
      "required": ["street", "city", "zip"], "additionalProperties": false},
    "role": {"enum": ["admin", "user", "guest"]},
    "score": {"anyOf": [{"type": "number"}, {"type": "null"}]}
  },
  "required": ["name", "age", "email", "tags", "address", "role", "score"],
  "additionalProperties": false})";

constexpr const char* kDocument =
    R"({"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", )"
    R"("engines", "poetry"], "address": {"street": "12 St James's Square", "city": "London", )"
    R"("zip": "10001"}, "role": "admin", "score": 97.5})";

struct Setup {
  std::unique_ptr<text::Tokenizer> tokenizer;  // null for the synthetic vocabulary
  std::shared_ptr<const TokenVocabulary> vocab;
  std::string source;
};

const Setup& GetSetup() {
  static const Setup setup = [] {
    Setup s;
    const char* path = std::getenv("TANDEM_BENCH_TOKENIZER");
    if (path != nullptr) {
      auto tok = text::Tokenizer::FromFile(path);
      if (!tok.ok()) {
        std::fprintf(stderr, "%s\n", std::string(tok.status().message()).c_str());
        std::exit(1);
      }
      s.tokenizer = std::move(*tok);
      std::vector<std::string> bytes;
      std::vector<int32_t> special, stop;
      for (int id = 0; id < s.tokenizer->vocab_size(); ++id) {
        bytes.push_back(s.tokenizer->TokenBytes(id));
        if (s.tokenizer->IsSpecial(id)) special.push_back(id);
      }
      if (auto eot = s.tokenizer->TokenToId("<|eot_id|>")) stop.push_back(*eot);
      s.vocab = *TokenVocabulary::Create(std::move(bytes), stop, special);
      s.source = path;
    } else {
      // 128k distinct strings of 1-12 bytes drawn from text-like bytes, plus one stop token.
      std::mt19937 rng(1);
      const std::string alphabet =
          " abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789\"{}[],:.-_\n\t\\";
      std::vector<std::string> bytes = {"</s>"};
      for (int b = 0; b < 256; ++b) bytes.push_back(std::string(1, char(b)));
      while (bytes.size() < 128256) {
        std::string t;
        int n = 2 + rng() % 11;
        for (int i = 0; i < n; ++i) t += alphabet[rng() % alphabet.size()];
        bytes.push_back(t);
      }
      s.vocab = *TokenVocabulary::Create(std::move(bytes), {0}, {});
      s.source = "synthetic";
    }
    return s;
  }();
  return setup;
}

// The document's tokens: the tokenizer's encoding, or greedy longest-match in the synthetic
// vocabulary.
std::vector<int32_t> DocumentTokens(const Setup& s, std::string_view document) {
  if (s.tokenizer) return s.tokenizer->Encode(document, /*add_special_tokens=*/false);
  std::vector<int32_t> ids;
  std::string_view rest = document;
  while (!rest.empty()) {
    int32_t best = -1;
    size_t best_len = 0;
    for (int32_t id = 1; id < s.vocab->size(); ++id) {
      const std::string& b = s.vocab->bytes(id);
      if (b.size() > best_len && rest.substr(0, b.size()) == b) {
        best = id;
        best_len = b.size();
      }
    }
    ids.push_back(best);
    rest.remove_prefix(best_len);
  }
  return ids;
}

// A schema whose strings and array are bounded (structured_decode_bench's order schema): each
// bounded repetition unrolls into one grammar position per character or item, hundreds of
// byte-set positions, each a walk of the vocabulary's trie at compile time.
constexpr const char* kBoundedSchema = bench::kOrderSchema;

Grammar SchemaGrammar() { return *ParseGbnf(*JsonSchemaToGbnf(std::string_view(kSchema))); }
Grammar BoundedSchemaGrammar() {
  return *ParseGbnf(*JsonSchemaToGbnf(std::string_view(kBoundedSchema)));
}
Grammar ObjectGrammar() { return *ParseGbnf(JsonObjectGbnf()); }

// state.range(0): compile threads (0: one per hardware thread).
void Compile(benchmark::State& state, Grammar (*make)()) {
  const Setup& s = GetSetup();
  Grammar g = make();
  std::shared_ptr<const CompiledGrammar> compiled;
  for (auto _ : state) {
    compiled = *CompiledGrammar::Create(g, s.vocab, static_cast<int>(state.range(0)));
    benchmark::DoNotOptimize(compiled);
  }
  state.counters["vocab"] = s.vocab->size();
  state.counters["positions"] = compiled->num_positions();
  state.counters["uncertain_per_position"] =
      static_cast<double>(compiled->num_uncertain()) / compiled->num_positions();
  state.SetLabel(s.source);
}

// kDocument, or (long) an object holding an array of 20 copies of it: a longer generation
// revisits stacks whose undecided tokens were already checked.
std::string Document(bool long_document) {
  if (!long_document) return kDocument;
  std::string doc = R"({"people": [)";
  for (int i = 0; i < 20; ++i) doc += (i ? ", " : "") + std::string(kDocument);
  return doc + "]}";
}

// One pass over the document: a mask before every token, then the token.
void Masks(benchmark::State& state, Grammar (*make)(), bool long_document) {
  const Setup& s = GetSetup();
  auto compiled = *CompiledGrammar::Create(make(), s.vocab);
  const std::vector<int32_t> ids = DocumentTokens(s, Document(long_document));
  TokenMask mask;
  for (auto _ : state) {
    GrammarMatcher m(compiled);
    for (int32_t id : ids) {
      m.FillNextTokenMask(mask);
      if (!MaskAllows(mask, id) || !m.AcceptToken(id)) {
        state.SkipWithError("the document's token is not allowed");
        return;
      }
    }
    benchmark::DoNotOptimize(mask.data());
  }
  state.counters["tokens"] = ids.size();
  // Rates are per CPU second of the benchmark thread.
  state.counters["per_token"] =
      benchmark::Counter(static_cast<double>(state.iterations() * ids.size()),
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
  state.SetLabel(s.source);
}

// Compile time is wall time (the walks run on several threads): one thread, then all.
BENCHMARK_CAPTURE(Compile, json_schema, SchemaGrammar)
    ->Arg(1)
    ->Arg(0)
    ->Unit(benchmark::kMillisecond)
    ->MinTime(2)
    ->UseRealTime();
BENCHMARK_CAPTURE(Compile, json_object, ObjectGrammar)
    ->Arg(1)
    ->Arg(0)
    ->Unit(benchmark::kMillisecond)
    ->MinTime(2)
    ->UseRealTime();
BENCHMARK_CAPTURE(Compile, bounded_schema, BoundedSchemaGrammar)
    ->Arg(1)
    ->Arg(0)
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3)
    ->UseRealTime();
BENCHMARK_CAPTURE(Masks, json_schema, SchemaGrammar, false)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(Masks, json_object, ObjectGrammar, false)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(Masks, json_object_long, ObjectGrammar, true)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace tandem::grammar

BENCHMARK_MAIN();

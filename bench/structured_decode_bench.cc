// Decode throughput of an LlmEngine with and without a structured-output constraint (a JSON
// schema), at fixed batch sizes: the grammar's cost per token (mask, applying it to the logits,
// advancing the matcher) next to the forward pass it rides on.
//
//   tandem_bench_structured --model=DIR [--batches=1,32] [--max-tokens=128] [--rounds=2]
//                           [--repeats=3] [--threads=2] [--schema=FILE] [--temperature=1]
//                           [--overlap-masks=1]
//
// After one unmeasured run of each mode, each run keeps `batch` requests in flight (a finished
// request is replaced at once), every request with a 4-token prompt, for `rounds` x `batch`
// requests in all, and reports generated tokens per second of wall time (prefill steps
// included, the same short prompt in both modes).
// Unconstrained requests ignore EOS and run to max_tokens; constrained ones follow the schema
// below (or --schema), whose documents with a random-weight model run longer than 128 tokens,
// so they are cut by max_tokens too. At temperature > 0 the sampler's softmax runs over the
// allowed tokens only, so a constrained step can be cheaper than an unconstrained one;
// --temperature=0 (greedy: an argmax either way) isolates the grammar's own cost.
// --overlap-masks=0 computes the masks after the forward pass instead of during it
// (EngineOptions::overlap_grammar_masks).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "tandem/base/status_macros.h"
#include "tandem/engine/llm_engine.h"
#include "order_schema.h"

namespace tandem {
namespace {

constexpr const char* kSchema = bench::kOrderSchema;

struct Result {
  int64_t tokens = 0;
  int requests = 0;
  int finished_by_grammar = 0;
  double seconds = 0;
};

std::string g_schema = kSchema;
float g_temperature = 1.0f;

absl::StatusOr<Result> Run(engine::LlmEngine& engine, int batch, int rounds, int max_tokens,
                           bool constrained, int* next_id) {
  const std::vector<int32_t> prompt = engine.tokenizer().Encode("Order:", true);
  Result result;
  const int total = rounds * batch;
  int submitted = 0;
  auto submit = [&]() -> absl::Status {
    engine::GenerateRequest r;
    r.request_id = absl::StrCat("r", (*next_id)++);
    r.prompt_tokens = prompt;
    r.params.max_tokens = max_tokens;
    r.params.seed = submitted;
    r.params.temperature = g_temperature;
    if (constrained) {
      r.params.structured = {engine::ConstraintKind::kJsonSchema, g_schema};
    } else {
      r.params.ignore_eos = true;
    }
    ++submitted;
    return engine.AddRequest(std::move(r));
  };
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < batch; ++i) TANDEM_RETURN_IF_ERROR(submit());
  while (engine.has_unfinished()) {
    TANDEM_ASSIGN_OR_RETURN(std::vector<engine::RequestOutput> outputs, engine.Step());
    for (const engine::RequestOutput& out : outputs) {
      for (const engine::ChoiceDelta& d : out.choices) {
        result.tokens += static_cast<int64_t>(d.token_ids.size());
        if (d.finish_reason == engine::FinishReason::kStop) ++result.finished_by_grammar;
      }
      if (out.finished) {
        ++result.requests;
        if (submitted < total) TANDEM_RETURN_IF_ERROR(submit());
      }
    }
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

int Main(int argc, char** argv) {
  std::string model;
  std::vector<int> batches = {1, 32};
  int max_tokens = 128, rounds = 2, threads = 2, repeats = 3;
  bool overlap_masks = true;
  for (int i = 1; i < argc; ++i) {
    absl::string_view a = argv[i];
    auto value = [&](absl::string_view flag) -> std::optional<std::string> {
      if (absl::StartsWith(a, absl::StrCat(flag, "=")))
        return std::string(a.substr(flag.size() + 1));
      return std::nullopt;
    };
    if (auto v = value("--model")) {
      model = *v;
    } else if (auto v = value("--batches")) {
      batches.clear();
      for (absl::string_view b : absl::StrSplit(*v, ','))
        batches.push_back(std::stoi(std::string(b)));
    } else if (auto v = value("--max-tokens")) {
      max_tokens = std::stoi(*v);
    } else if (auto v = value("--rounds")) {
      rounds = std::stoi(*v);
    } else if (auto v = value("--schema")) {
      std::ifstream in(*v);
      g_schema.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    } else if (auto v = value("--temperature")) {
      g_temperature = std::stof(*v);
    } else if (auto v = value("--repeats")) {
      repeats = std::stoi(*v);
    } else if (auto v = value("--overlap-masks")) {
      overlap_masks = *v != "0";
    } else if (auto v = value("--threads")) {
      threads = std::stoi(*v);
    } else {
      std::fprintf(stderr, "unknown argument %s\n", argv[i]);
      return 2;
    }
  }
  if (model.empty()) {
    std::fprintf(stderr, "usage: %s --model=DIR [--batches=1,32] [--max-tokens=N] [--rounds=N]\n",
                 argv[0]);
    return 2;
  }
  int next_id = 0;
  std::printf(
      "| batch | mode | requests | tokens | finished by the grammar | seconds | tokens/s (median) "
      "| "
      "constrained / unconstrained |\n|---|---|---|---|---|---|---|---|\n");
  for (int batch : batches) {
    engine::EngineOptions options;
    options.model_dir = model;
    options.num_threads = threads;
    options.max_num_seqs = std::max(batch, 1);
    options.kv_cache_bytes = 256ll << 20;
    options.overlap_grammar_masks = overlap_masks;
    auto engine = engine::LlmEngine::Create(options);
    if (!engine.ok()) {
      std::fprintf(stderr, "%s\n", std::string(engine.status().message()).c_str());
      return 1;
    }
    // Warm-up: the first constrained request compiles the schema (reported separately).
    auto compile_start = std::chrono::steady_clock::now();
    engine::SamplingParams warm;
    warm.structured = {engine::ConstraintKind::kJsonSchema, g_schema};
    if (absl::Status s = (*engine)->PrepareConstraint(warm); !s.ok()) {
      std::fprintf(stderr, "%s\n", std::string(s.message()).c_str());
      return 1;
    }
    const double compile_ms =
        1e3 *
        std::chrono::duration<double>(std::chrono::steady_clock::now() - compile_start).count();
    // The modes alternate, `repeats` runs each, and the median run of each is reported, so
    // that load from other processes on a shared machine hits both alike.
    std::vector<Result> runs[2];
    // One unmeasured run of each mode first: the engine's first steps (page faults, caches)
    // would count against whichever mode ran first.
    for (int rep = -1; rep < repeats; ++rep) {
      for (int constrained = 0; constrained < 2; ++constrained) {
        auto r = Run(**engine, batch, rounds, max_tokens, constrained == 1, &next_id);
        if (!r.ok()) {
          std::fprintf(stderr, "%s\n", std::string(r.status().message()).c_str());
          return 1;
        }
        if (rep >= 0) runs[constrained].push_back(*r);
      }
    }
    double free_rate = 0;
    for (int constrained = 0; constrained < 2; ++constrained) {
      std::vector<Result>& v = runs[constrained];
      std::sort(v.begin(), v.end(), [](const Result& a, const Result& b) {
        return a.tokens / a.seconds < b.tokens / b.seconds;
      });
      const Result& r = v[v.size() / 2];
      const double rate = r.tokens / r.seconds;
      if (constrained == 0) free_rate = rate;
      std::string others;
      for (const Result& o : v)
        absl::StrAppend(&others, others.empty() ? "" : ", ",
                        static_cast<int>(o.tokens / o.seconds + 0.5));
      std::printf(
          "| %d | %s | %d | %lld | %d | %.2f | %.1f (runs: %s) | %s |\n", batch,
          constrained ? "json_schema" : "unconstrained", r.requests,
          static_cast<long long>(r.tokens), r.finished_by_grammar, r.seconds, rate, others.c_str(),
          constrained ? absl::StrCat(static_cast<int>(100 * rate / free_rate + 0.5), " %").c_str()
                      : "");
    }
    std::printf("(batch %d engine: schema compiled for a vocabulary of %d tokens in %.1f ms)\n",
                batch, (*engine)->config().vocab_size, compile_ms);
  }
  return 0;
}

}  // namespace
}  // namespace tandem

int main(int argc, char** argv) { return tandem::Main(argc, argv); }

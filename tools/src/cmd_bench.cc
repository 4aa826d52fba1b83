// `tandem bench`: load generator against any OpenAI-compatible endpoint (see load_generator.h).
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "commands.h"
#include "tandem/base/status_macros.h"
#include "tandem/tools/args.h"
#include "tandem/tools/load_generator.h"

namespace tandem::tools {
namespace {

absl::StatusOr<double> ParseRate(const std::string& text) {
  if (text == "inf" || text == "INF" || text == "Inf") {
    return std::numeric_limits<double>::infinity();
  }
  try {
    size_t used = 0;
    const double rate = std::stod(text, &used);
    if (used == text.size() && rate > 0) return rate;
  } catch (...) {
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--request-rate must be a positive number or inf (got '", text, "')"));
}

absl::Status Run(int argc, char** argv) {
  Args args("bench");
  args.Declare("url", "URL", "server base URL, e.g. http://127.0.0.1:8000 (required)");
  args.Declare("model", "NAME", "model name sent in every request (required)");
  args.Declare("endpoint", "KIND", "completions | chat (default completions)");
  args.Declare("num-requests", "N", "requests to send (default 100)");
  args.Declare("request-rate", "R",
               "mean arrivals per second, or inf for all at once (default inf)");
  args.Declare("burstiness", "B", "gamma shape of inter-arrival gaps; 1 = Poisson (default 1)");
  args.Declare("max-concurrency", "C", "most requests in flight (default unbounded)");
  args.Declare("input-len", "I", "synthetic prompts of I random words (default 32)");
  args.Declare("output-len", "O", "max_tokens per request, sent with ignore_eos (default 32)");
  args.Declare("dataset", "KIND", "sharegpt: prompts from --dataset-path (default synthetic)");
  args.Declare("dataset-path", "FILE", "ShareGPT-format JSON file");
  args.Declare("seed", "S", "seed of prompts and arrival times (default 0)");
  args.Declare("ttft-slo", "SECONDS", "time-to-first-token SLO (with --tpot-slo)");
  args.Declare("tpot-slo", "SECONDS", "time-per-output-token SLO (with --ttft-slo)");
  args.Declare("json", "FILE", "also write the report and per-request records as JSON");
  args.Declare("api-key", "KEY", "sent as Authorization: Bearer KEY");
  args.AllowPositional(1);  // the FILE of `--dataset sharegpt FILE`
  TANDEM_RETURN_IF_ERROR(args.Parse(argc, argv));
  if (args.HandleHelp()) return absl::OkStatus();
  std::optional<std::string> dataset_path = args.Get("dataset-path");
  // Also accept `--dataset sharegpt FILE`.
  if (!dataset_path && args.Has("dataset") && args.positional().size() == 1) {
    dataset_path = args.positional()[0];
  } else if (!args.positional().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("unexpected argument '", args.positional()[0], "'"));
  }
  if (!args.Has("url")) return absl::InvalidArgumentError("--url is required");
  if (!args.Has("model")) return absl::InvalidArgumentError("--model is required");

  LoadConfig config;
  config.url = *args.Get("url");
  config.model = *args.Get("model");
  config.endpoint = args.GetOr("endpoint", "completions");
  config.api_key = args.GetOr("api-key", "");
  TANDEM_ASSIGN_OR_RETURN(config.request_rate, ParseRate(args.GetOr("request-rate", "inf")));
  TANDEM_ASSIGN_OR_RETURN(config.burstiness, args.Double("burstiness", 1.0));
  if (!(config.burstiness > 0)) return absl::InvalidArgumentError("--burstiness must be > 0");
  TANDEM_ASSIGN_OR_RETURN(config.max_concurrency, args.Int("max-concurrency", 0));
  TANDEM_ASSIGN_OR_RETURN(int64_t seed, args.Int("seed", 0));
  config.seed = static_cast<uint64_t>(seed);
  TANDEM_ASSIGN_OR_RETURN(int64_t n, args.Int("num-requests", 100));
  if (n <= 0) return absl::InvalidArgumentError("--num-requests must be positive");
  TANDEM_ASSIGN_OR_RETURN(double ttft_slo, args.Double("ttft-slo", 0));
  TANDEM_ASSIGN_OR_RETURN(double tpot_slo, args.Double("tpot-slo", 0));
  if (args.Has("ttft-slo") != args.Has("tpot-slo")) {
    return absl::InvalidArgumentError("--ttft-slo and --tpot-slo go together");
  }

  std::vector<BenchRequest> requests;
  const std::string dataset = args.GetOr("dataset", "synthetic");
  if (dataset == "sharegpt") {
    if (!dataset_path) return absl::InvalidArgumentError("--dataset sharegpt needs a FILE");
    std::optional<int64_t> output_len;
    if (args.Has("output-len")) {
      TANDEM_ASSIGN_OR_RETURN(output_len, args.Int("output-len", 0));
    }
    TANDEM_ASSIGN_OR_RETURN(requests, ShareGptRequests(*dataset_path, n, output_len));
  } else if (dataset == "synthetic") {
    TANDEM_ASSIGN_OR_RETURN(int64_t input_len, args.Int("input-len", 32));
    TANDEM_ASSIGN_OR_RETURN(int64_t output_len, args.Int("output-len", 32));
    if (input_len <= 0 || output_len <= 0) {
      return absl::InvalidArgumentError("--input-len and --output-len must be positive");
    }
    requests = SyntheticRequests(input_len, output_len, n, config.seed);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--dataset must be sharegpt (got '", dataset, "')"));
  }

  TANDEM_ASSIGN_OR_RETURN(BenchResult result, RunLoad(config, requests));
  const nlohmann::json report = ReportJson(result, ttft_slo, tpot_slo);
  if (args.Has("json")) {
    std::ofstream out(*args.Get("json"));
    out << report.dump(2) << "\n";
    if (!out) return absl::InternalError(absl::StrCat("cannot write ", *args.Get("json")));
  }
  if (report["requests_succeeded"].get<int64_t>() == 0) {
    // Nothing to report: say why in one line (the first request's error).
    return absl::UnavailableError(absl::StrCat(
        "all ", result.records.size(), " requests failed; first: ", result.records.front().error));
  }
  std::fputs(ReportTable(report).c_str(), stdout);
  return absl::OkStatus();
}

}  // namespace

int RunBench(int argc, char** argv) { return ExitCode("bench", Run(argc, argv)); }

}  // namespace tandem::tools

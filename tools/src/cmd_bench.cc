// `tandem bench`: load generator against any OpenAI-compatible endpoint (see load_generator.h).
// One run, a sweep of request rates, and/or several endpoints (`--url` given more than once, or
// `--compare`), each sent the same workload one after the other.
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "commands.h"
#include "tandem/base/status_macros.h"
#include "tandem/tools/args.h"
#include "tandem/tools/load_generator.h"

namespace tandem::tools {
namespace {

absl::StatusOr<double> ParseRate(const std::string& text, const std::string& flag) {
  if (text == "inf" || text == "INF" || text == "Inf") {
    return std::numeric_limits<double>::infinity();
  }
  try {
    size_t used = 0;
    const double rate = std::stod(text, &used);
    if (used == text.size() && rate > 0 && std::isfinite(rate)) return rate;
  } catch (...) {
  }
  return absl::InvalidArgumentError(
      absl::StrCat(flag, " must be a positive number or inf (got '", text, "')"));
}

// Removes every `--name VALUE` and `--name=VALUE` from `argv` (argv[0] excluded) and returns the
// values in order: the flags that may be repeated.
absl::StatusOr<std::vector<std::string>> TakeRepeated(std::vector<std::string>* argv,
                                                      const std::string& name) {
  std::vector<std::string> values;
  std::vector<std::string> rest = {argv->front()};
  const std::string flag = "--" + name;
  for (size_t i = 1; i < argv->size(); ++i) {
    const std::string& arg = (*argv)[i];
    if (arg == flag) {
      if (i + 1 >= argv->size()) {
        return absl::InvalidArgumentError(absl::StrCat("--", name, " needs a value"));
      }
      values.push_back((*argv)[++i]);
    } else if (arg.rfind(flag + "=", 0) == 0) {
      values.push_back(arg.substr(flag.size() + 1));
    } else {
      rest.push_back(arg);
    }
  }
  *argv = std::move(rest);
  return values;
}

// The length distribution of `--NAME-len`, `--NAME-len-dist`, `--NAME-len-range`,
// `--NAME-len-std` (NAME is input or output).
absl::StatusOr<LengthDist> LengthFlags(const Args& args, const std::string& name) {
  const std::string flag = absl::StrCat("--", name, "-len");
  LengthDist dist;
  dist.kind = args.GetOr(name + "-len-dist", "fixed");
  TANDEM_ASSIGN_OR_RETURN(dist.mean, args.Double(name + "-len", 32));
  TANDEM_ASSIGN_OR_RETURN(dist.range, args.Int(name + "-len-range", 0));
  TANDEM_ASSIGN_OR_RETURN(dist.std, args.Double(name + "-len-std", 0));
  if (args.Has(name + "-len-range") && dist.kind != "uniform") {
    return absl::InvalidArgumentError(absl::StrCat(flag, "-range goes with ", flag,
                                                   "-dist uniform"));
  }
  if (args.Has(name + "-len-std") && dist.kind != "normal" && dist.kind != "lognormal") {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, "-std goes with ", flag, "-dist normal or lognormal"));
  }
  if (dist.kind == "fixed" && (dist.mean < 1 || dist.mean != std::floor(dist.mean))) {
    return absl::InvalidArgumentError("--input-len and --output-len must be positive");
  }
  TANDEM_RETURN_IF_ERROR(ValidateLengthDist(dist, flag));
  return dist;
}

std::string RateName(double rate) {
  return std::isinf(rate) ? std::string("all at once") : absl::StrFormat("%g req/s", rate);
}

absl::Status Run(int argc, char** argv) {
  Args args("bench");
  args.Declare("url", "URL",
               "server base URL, e.g. http://127.0.0.1:8000 (required); give it more than once "
               "to run the same workload against each in turn");
  args.Declare("compare", "URL", "another endpoint to run the same workload against");
  args.Declare("label", "NAME", "name of each --url in the report, in order (default the URL)");
  args.Declare("model", "NAME",
               "model name sent in every request (required); once, or once per --url");
  args.Declare("endpoint", "KIND", "completions | chat (default completions)");
  args.Declare("num-requests", "N", "requests per run (default 100)");
  args.Declare("request-rate", "R",
               "mean arrivals per second, or inf for all at once (default inf)");
  args.Declare("request-rate-sweep", "R1,R2,...", "one run at each rate, in turn");
  args.Declare("sweep", "R1,R2,...", "same as --request-rate-sweep");
  args.Declare("burstiness", "B", "gamma shape of inter-arrival gaps; 1 = Poisson (default 1)");
  args.Declare("max-concurrency", "C",
               "most requests in flight; the next is sent when one finishes (default unbounded)");
  args.Declare("input-len", "I", "synthetic prompt length in words, the mean (default 32)");
  args.Declare("input-len-dist", "KIND", "fixed | uniform | normal | lognormal (default fixed)");
  args.Declare("input-len-range", "R", "uniform: lengths in [I-R, I+R]");
  args.Declare("input-len-std", "S", "normal, lognormal: standard deviation");
  args.Declare("output-len", "O", "max_tokens per request, sent with ignore_eos (default 32)");
  args.Declare("output-len-dist", "KIND", "fixed | uniform | normal | lognormal (default fixed)");
  args.Declare("output-len-range", "R", "uniform: lengths in [O-R, O+R]");
  args.Declare("output-len-std", "S", "normal, lognormal: standard deviation");
  args.Declare("workload", "KIND",
               "synthetic (default): independent prompts; multi-turn: --num-requests "
               "conversations of --turns turns, each turn a user message of --input-len words "
               "sent with the conversation so far (earlier prompts and answers) once the "
               "previous turn finished");
  args.Declare("turns", "N", "multi-turn: turns per conversation (default 4)");
  args.Declare("think-time", "SECONDS",
               "multi-turn: a user reads each answer this long before the next turn; "
               "--max-concurrency then counts turns in flight, first come first served, so other "
               "conversations' turns run in between (default: unset, a conversation holds its "
               "slot from its first turn to its last)");
  args.Declare("system-prompt-len", "L",
               "multi-turn: words of a system prompt every conversation starts with (default 0; "
               "with --input-len 0 every first turn is exactly that prompt)");
  args.Declare("dataset", "KIND", "sharegpt: prompts from --dataset-path (default synthetic)");
  args.Declare("dataset-path", "FILE", "ShareGPT-format JSON file");
  args.Declare("seed", "S", "seed of prompts, lengths and arrival times (default 0)");
  args.Declare("ttft-slo", "SECONDS", "time-to-first-token SLO (with --tpot-slo)");
  args.Declare("tpot-slo", "SECONDS", "time-per-output-token SLO (with --ttft-slo)");
  args.Declare("json", "FILE", "also write the report(s) and per-request records as JSON");
  args.Declare("plot-dir", "DIR", "write latency_cdf.svg and attainment_vs_rate.svg there");
  args.DeclareSwitch("no-progress", "no progress line (it is drawn only on a terminal anyway)");
  args.Declare("api-key", "KEY", "sent as Authorization: Bearer KEY");
  args.AllowPositional(1);  // the FILE of `--dataset sharegpt FILE`

  std::vector<std::string> argv_list(argv, argv + argc);
  if (argv_list.empty()) argv_list.push_back("bench");
  TANDEM_ASSIGN_OR_RETURN(std::vector<std::string> urls, TakeRepeated(&argv_list, "url"));
  TANDEM_ASSIGN_OR_RETURN(std::vector<std::string> compare, TakeRepeated(&argv_list, "compare"));
  TANDEM_ASSIGN_OR_RETURN(std::vector<std::string> labels, TakeRepeated(&argv_list, "label"));
  TANDEM_ASSIGN_OR_RETURN(std::vector<std::string> models, TakeRepeated(&argv_list, "model"));
  std::vector<char*> rest;
  for (std::string& a : argv_list) rest.push_back(a.data());
  TANDEM_RETURN_IF_ERROR(args.Parse(static_cast<int>(rest.size()), rest.data()));
  if (args.HandleHelp()) return absl::OkStatus();
  std::optional<std::string> dataset_path = args.Get("dataset-path");
  // Also accept `--dataset sharegpt FILE`.
  if (!dataset_path && args.Has("dataset") && args.positional().size() == 1) {
    dataset_path = args.positional()[0];
  } else if (!args.positional().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("unexpected argument '", args.positional()[0], "'"));
  }
  urls.insert(urls.end(), compare.begin(), compare.end());
  if (urls.empty()) return absl::InvalidArgumentError("--url is required");
  if (models.empty()) return absl::InvalidArgumentError("--model is required");
  if (models.size() != 1 && models.size() != urls.size()) {
    return absl::InvalidArgumentError(absl::StrCat("--model is given ", models.size(),
                                                   " times for ", urls.size(),
                                                   " URLs: give it once or once per URL"));
  }
  if (!labels.empty() && labels.size() != urls.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--label is given ", labels.size(), " times for ", urls.size(), " URLs"));
  }
  if (labels.empty()) {
    if (urls.size() > 1) labels = urls;
  } else {
    for (size_t i = 0; i < labels.size(); ++i) {
      for (size_t j = 0; j < i; ++j) {
        if (labels[i] == labels[j]) {
          return absl::InvalidArgumentError(absl::StrCat("--label '", labels[i], "' repeats"));
        }
      }
    }
  }

  LoadConfig config;
  config.endpoint = args.GetOr("endpoint", "completions");
  config.api_key = args.GetOr("api-key", "");
  if (config.endpoint != "completions" && config.endpoint != "chat") {
    return absl::InvalidArgumentError(
        absl::StrCat("--endpoint must be completions or chat (got '", config.endpoint, "')"));
  }

  std::vector<double> rates;
  if (args.Has("request-rate-sweep") && args.Has("sweep")) {
    return absl::InvalidArgumentError("--request-rate-sweep and --sweep are the same flag");
  }
  std::optional<std::string> sweep = args.Get("request-rate-sweep");
  if (!sweep) sweep = args.Get("sweep");
  if (sweep) {
    if (args.Has("request-rate")) {
      return absl::InvalidArgumentError("--request-rate and --request-rate-sweep exclude each other");
    }
    for (absl::string_view part : absl::StrSplit(*sweep, ',')) {
      TANDEM_ASSIGN_OR_RETURN(double rate,
                              ParseRate(std::string(part), "every --request-rate-sweep rate"));
      rates.push_back(rate);
    }
  } else {
    TANDEM_ASSIGN_OR_RETURN(double rate,
                            ParseRate(args.GetOr("request-rate", "inf"), "--request-rate"));
    rates.push_back(rate);
  }
  TANDEM_ASSIGN_OR_RETURN(config.burstiness, args.Double("burstiness", 1.0));
  if (!(config.burstiness > 0)) return absl::InvalidArgumentError("--burstiness must be > 0");
  TANDEM_ASSIGN_OR_RETURN(config.max_concurrency, args.Int("max-concurrency", 0));
  if (args.Has("max-concurrency") && config.max_concurrency <= 0) {
    return absl::InvalidArgumentError("--max-concurrency must be positive");
  }
  TANDEM_ASSIGN_OR_RETURN(int64_t seed, args.Int("seed", 0));
  config.seed = static_cast<uint64_t>(seed);
  TANDEM_ASSIGN_OR_RETURN(int64_t n, args.Int("num-requests", 100));
  if (n <= 0) return absl::InvalidArgumentError("--num-requests must be positive");
  TANDEM_ASSIGN_OR_RETURN(double ttft_slo, args.Double("ttft-slo", 0));
  TANDEM_ASSIGN_OR_RETURN(double tpot_slo, args.Double("tpot-slo", 0));
  if (args.Has("ttft-slo") != args.Has("tpot-slo")) {
    return absl::InvalidArgumentError("--ttft-slo and --tpot-slo go together");
  }
  if (args.Has("ttft-slo") && !(ttft_slo > 0 && tpot_slo > 0)) {
    return absl::InvalidArgumentError("--ttft-slo and --tpot-slo must be positive");
  }

  std::vector<BenchRequest> requests;
  const std::string dataset = args.GetOr("dataset", "synthetic");
  const std::string workload = args.GetOr("workload", "synthetic");
  if (workload != "synthetic" && workload != "multi-turn") {
    return absl::InvalidArgumentError(
        absl::StrCat("--workload must be synthetic or multi-turn (got '", workload, "')"));
  }
  if (workload != "multi-turn") {
    for (const char* flag : {"turns", "system-prompt-len", "think-time"}) {
      if (args.Has(flag)) {
        return absl::InvalidArgumentError(absl::StrCat("--", flag, " needs --workload multi-turn"));
      }
    }
  }
  if (workload == "multi-turn") {
    if (args.Has("dataset")) {
      return absl::InvalidArgumentError(
          "--workload multi-turn makes its own prompts: no --dataset");
    }
    for (const char* flag : {"input-len-dist", "input-len-range", "input-len-std",
                             "output-len-dist", "output-len-range", "output-len-std"}) {
      if (args.Has(flag)) {
        return absl::InvalidArgumentError(
            absl::StrCat("--", flag, " does not apply to --workload multi-turn"));
      }
    }
    TANDEM_ASSIGN_OR_RETURN(int64_t turns, args.Int("turns", 4));
    if (args.Has("think-time")) {
      TANDEM_ASSIGN_OR_RETURN(double think, args.Double("think-time", 0));
      if (!(think >= 0 && think <= 3600)) {
        return absl::InvalidArgumentError("--think-time must be in [0, 3600] seconds");
      }
      config.think_time = think;
    }
    TANDEM_ASSIGN_OR_RETURN(int64_t system_len, args.Int("system-prompt-len", 0));
    TANDEM_ASSIGN_OR_RETURN(int64_t message_len, args.Int("input-len", 32));
    TANDEM_ASSIGN_OR_RETURN(int64_t output_len, args.Int("output-len", 32));
    if (turns < 1 || turns > 1000)
      return absl::InvalidArgumentError("--turns must be in [1, 1000]");
    if (system_len < 0) return absl::InvalidArgumentError("--system-prompt-len must be >= 0");
    if (message_len < 0 || (message_len == 0 && system_len == 0)) {
      return absl::InvalidArgumentError(
          "--input-len must be positive (0 only with a --system-prompt-len)");
    }
    if (output_len <= 0) return absl::InvalidArgumentError("--output-len must be positive");
    requests = MultiTurnRequests(n, static_cast<int>(turns), system_len, message_len, output_len,
                                 config.seed);
  } else if (dataset == "sharegpt") {
    if (!dataset_path) return absl::InvalidArgumentError("--dataset sharegpt needs a FILE");
    for (const char* flag : {"input-len", "input-len-dist", "input-len-range", "input-len-std",
                             "output-len-dist", "output-len-range", "output-len-std"}) {
      if (args.Has(flag)) {
        return absl::InvalidArgumentError(
            absl::StrCat("--", flag, " applies to synthetic prompts, not --dataset sharegpt"));
      }
    }
    std::optional<int64_t> output_len;
    if (args.Has("output-len")) {
      TANDEM_ASSIGN_OR_RETURN(output_len, args.Int("output-len", 0));
      if (*output_len <= 0) return absl::InvalidArgumentError("--output-len must be positive");
    }
    TANDEM_ASSIGN_OR_RETURN(requests, ShareGptRequests(*dataset_path, n, output_len));
  } else if (dataset == "synthetic") {
    TANDEM_ASSIGN_OR_RETURN(LengthDist input, LengthFlags(args, "input"));
    TANDEM_ASSIGN_OR_RETURN(LengthDist output, LengthFlags(args, "output"));
    // Lengths from their own streams, so a fixed distribution keeps the prompts of older runs.
    requests = SyntheticRequests(SampleLengths(input, n, config.seed * 2 + 1),
                                 SampleLengths(output, n, config.seed * 2 + 2), config.seed);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--dataset must be sharegpt (got '", dataset, "')"));
  }

  std::optional<std::string> plot_dir = args.Get("plot-dir");
  if (plot_dir) {
    std::error_code ec;
    std::filesystem::create_directories(*plot_dir, ec);
    if (ec) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot create --plot-dir ", *plot_dir, ": ", ec.message()));
    }
  }
  config.progress = !args.Switch("no-progress") && ::isatty(STDERR_FILENO);

  // Every endpoint in turn, each at every rate, with the same requests and arrival seed.
  std::vector<nlohmann::json> reports;
  std::vector<BenchResult> results;
  for (size_t e = 0; e < urls.size(); ++e) {
    for (double rate : rates) {
      config.url = urls[e];
      config.model = models.size() == 1 ? models[0] : models[e];
      config.request_rate = rate;
      const std::string label = labels.empty() ? "" : labels[e];
      config.progress_label = label.empty() ? RateName(rate)
                                            : absl::StrCat(label, " @ ", RateName(rate));
      TANDEM_ASSIGN_OR_RETURN(BenchResult result, RunLoad(config, requests));
      nlohmann::json report = ReportJson(result, ttft_slo, tpot_slo);
      if (!label.empty()) report["label"] = label;
      report["url"] = config.url;
      report["model"] = config.model;
      report["request_rate"] = std::isinf(rate) ? nlohmann::json("inf") : nlohmann::json(rate);
      report["burstiness"] = config.burstiness;
      report["max_concurrency"] = config.max_concurrency;
      if (config.think_time) report["think_time"] = *config.think_time;
      report["seed"] = config.seed;
      reports.push_back(std::move(report));
      results.push_back(std::move(result));
    }
  }

  const bool single = reports.size() == 1;
  if (args.Has("json")) {
    nlohmann::json doc;
    if (single) {
      doc = reports.front();
    } else {
      doc = {{"runs", reports}};
      if (ttft_slo > 0) doc["slo"] = {{"ttft_s", ttft_slo}, {"tpot_s", tpot_slo}};
    }
    std::ofstream out(*args.Get("json"));
    out << doc.dump(2) << "\n";
    if (!out) return absl::InternalError(absl::StrCat("cannot write ", *args.Get("json")));
  }
  // A run where every request failed: say why in one line (its first request's error).
  std::optional<absl::Status> all_failed;
  for (size_t i = 0; i < reports.size() && !all_failed; ++i) {
    if (reports[i]["requests_succeeded"].get<int64_t>() == 0) {
      all_failed = absl::UnavailableError(absl::StrCat(
          "all ", results[i].records.size(), " requests ",
          single ? "" : absl::StrCat("to ", reports[i]["url"].get<std::string>(), " "),
          "failed; first: ", results[i].records.front().error));
    }
  }
  if (single && all_failed) return *all_failed;
  std::fputs((single ? ReportTable(reports.front()) : ComparisonTable(reports)).c_str(), stdout);
  if (plot_dir) {
    for (const auto& [name, svg] : BenchPlots(reports)) {
      const std::string path = (std::filesystem::path(*plot_dir) / name).string();
      std::ofstream out(path);
      out << svg;
      if (!out) return absl::InternalError(absl::StrCat("cannot write ", path));
      std::printf("wrote %s\n", path.c_str());
    }
  }
  if (all_failed) return *all_failed;
  return absl::OkStatus();
}

}  // namespace

int RunBench(int argc, char** argv) { return ExitCode("bench", Run(argc, argv)); }

}  // namespace tandem::tools

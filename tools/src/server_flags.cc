#include "server_flags.h"

#include <sys/resource.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <initializer_list>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "device_flag.h"
#include "tandem/base/status_macros.h"
#include "tandem/router/tool_calls.h"
#include "tandem/tools/synth_model.h"

namespace tandem::tools {
namespace {

namespace fs = std::filesystem;

std::string DefaultModelDir() {
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  const char* home = std::getenv("HOME");
  fs::path cache = xdg != nullptr && *xdg != '\0' ? fs::path(xdg)
                   : home != nullptr              ? fs::path(home) / ".cache"
                                                  : fs::temp_directory_path();
  return (cache / "tandem" / "models" / "small-llama").string();
}

// --dtype / --kv-cache-dtype: nullopt for "auto", else one of `allowed`.
absl::StatusOr<std::optional<DType>> DTypeFlag(const Args& args, const std::string& name,
                                               std::initializer_list<DType> allowed) {
  const std::string value = args.GetOr(name, "auto");
  if (value == "auto") return std::nullopt;
  const std::optional<DType> dtype = ParseDTypeFlag(value);
  std::string names = "auto";
  for (DType d : allowed) absl::StrAppend(&names, "|", DTypeFlagName(d));
  if (!dtype.has_value() || std::find(allowed.begin(), allowed.end(), *dtype) == allowed.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat(args.command(), ": --", name, " must be ", names, ", got '", value, "'"));
  }
  return dtype;
}

}  // namespace

absl::StatusOr<int64_t> IntFlag(const Args& args, const std::string& name, int64_t fallback,
                                int64_t lo, int64_t hi) {
  TANDEM_ASSIGN_OR_RETURN(int64_t v, args.Int(name, fallback));
  if (v < lo || v > hi) {
    return absl::InvalidArgumentError(absl::StrCat(args.command(), ": --", name, " must be in [",
                                                   lo, ", ", hi, "], got ", v));
  }
  return v;
}

void DeclareEngineFlags(Args& args) {
  args.Declare("model", "DIR",
               "Hugging Face checkpoint directory (default: the synthetic 'small' model, "
               "written once into ~/.cache/tandem/models/small-llama)");
  args.Declare("max-num-seqs", "N", "sequences in the running batch (default 64)");
  args.Declare("max-num-batched-tokens", "N",
               "tokens per engine step, also the prefill chunk (default 512)");
  args.Declare("kv-cache-bytes", "N", "KV cache budget in bytes, per engine (default 512 MiB)");
  args.Declare("dtype", "TYPE",
               "auto | bfloat16 | float16 | float32: the type weights are held in (auto, the "
               "default: config.json's torch_dtype); activations and sums stay fp32 (on "
               "cuda, Linear inputs are stored in the weights' 16 bits where its tensor cores "
               "round them anyway)");
  args.Declare("kv-cache-dtype", "TYPE",
               "auto | bfloat16 | float16 | float32 | fp8_e4m3 | fp8_e5m2: the KV cache's "
               "element type (auto, the default: the weight type); fp8 with per-layer scales "
               "(self_attn.k_scale / v_scale in the checkpoint, else 1). Prefill and decode "
               "workers must agree");
  args.Declare("max-model-len", "N", "context length (default: the model's)");
  args.DeclareSwitch("enable-prefix-caching",
                     "keep full KV blocks cached after their request, named by their tokens, and "
                     "compute only what a new prompt adds to a cached prefix (the default)");
  args.DeclareSwitch("no-enable-prefix-caching", "compute every prompt from scratch");
  args.Declare("threads", "N", "engine CPU threads (default: all cores)");
  DeclareDeviceFlag(args);
  DeclareSpeculativeFlags(args);
  args.Declare("step-trace", "FILE",
               "write every engine step and each request's in-engine first-token time to FILE "
               "as JSON lines, for `tandem plan calibrate --trace` (default: none)");
  args.Declare("step-delay-ms", "MS",
               "fault injection: sleep MS milliseconds before every engine step, as a slower "
               "device would (tests and drills that must catch work in the middle; default 0)");
}

absl::StatusOr<engine::EngineOptions> EngineFlags(const Args& args) {
  engine::EngineOptions options;
  TANDEM_ASSIGN_OR_RETURN(int64_t seqs, IntFlag(args, "max-num-seqs", 64, 1, 65536));
  options.max_num_seqs = static_cast<int>(seqs);
  TANDEM_ASSIGN_OR_RETURN(int64_t batched,
                          IntFlag(args, "max-num-batched-tokens", 512, 1, 1 << 20));
  options.max_num_batched_tokens = static_cast<int>(batched);
  TANDEM_ASSIGN_OR_RETURN(options.kv_cache_bytes,
                          IntFlag(args, "kv-cache-bytes", 512ll << 20, 1, int64_t{1} << 50));
  TANDEM_ASSIGN_OR_RETURN(int64_t max_len, IntFlag(args, "max-model-len", 0, 0, 1 << 24));
  options.max_model_len = static_cast<int>(max_len);
  if (args.Switch("enable-prefix-caching") && args.Switch("no-enable-prefix-caching")) {
    return absl::InvalidArgumentError(absl::StrCat(
        args.command(), ": --enable-prefix-caching and --no-enable-prefix-caching contradict"));
  }
  options.enable_prefix_caching = !args.Switch("no-enable-prefix-caching");
  TANDEM_ASSIGN_OR_RETURN(int64_t threads, IntFlag(args, "threads", 0, 0, 1024));
  options.num_threads = static_cast<int>(threads);
  TANDEM_ASSIGN_OR_RETURN(options.device, DeviceFlag(args));
  TANDEM_ASSIGN_OR_RETURN(options.cpu_isa, CpuIsaFlag(args));
  TANDEM_ASSIGN_OR_RETURN(options.sampling_device, SamplingDeviceFlag(args));
  options.enforce_eager = args.Switch("enforce-eager");
  TANDEM_ASSIGN_OR_RETURN(options.dtype,
                          DTypeFlag(args, "dtype", {DType::kBF16, DType::kF16, DType::kF32}));
  TANDEM_ASSIGN_OR_RETURN(options.kv_cache_dtype, DTypeFlag(args, "kv-cache-dtype",
                                                            {DType::kBF16, DType::kF16, DType::kF32,
                                                             DType::kF8E4M3, DType::kF8E5M2}));
  if (args.Has("step-trace")) {
    absl::StatusOr<std::shared_ptr<engine::StepTrace>> trace =
        engine::StepTrace::Open(*args.Get("step-trace"));
    if (!trace.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(args.command(), ": --step-trace: ", trace.status().message()));
    }
    options.step_trace = *std::move(trace);
  }

  TANDEM_RETURN_IF_ERROR(SpeculativeFlags(args, options));
  TANDEM_ASSIGN_OR_RETURN(int64_t delay_ms, IntFlag(args, "step-delay-ms", 0, 0, 60000));
  if (delay_ms > 0) {
    options.before_step = [delay = absl::Milliseconds(delay_ms)] {
      absl::SleepFor(delay);
      return true;
    };
  }

  if (args.Has("model")) {
    options.model_dir = *args.Get("model");
  } else {
    options.model_dir = DefaultModelDir();
    // config.json is written last, so its presence means a complete checkpoint.
    if (!fs::exists(fs::path(options.model_dir) / "config.json")) {
      std::fprintf(stderr, "tandem: writing the synthetic 'small' model to %s (once)\n",
                   options.model_dir.c_str());
      SynthModelOptions synth;
      synth.out_dir = options.model_dir;
      synth.preset = "small";
      TANDEM_RETURN_IF_ERROR(WriteSyntheticModel(synth));
    }
  }
  return options;
}

void DeclareSpeculativeFlags(Args& args) {
  args.Declare("speculative-method", "NAME",
               "none | ngram | early-exit | draft-model: speculative decoding; ngram proposes the "
               "tokens that followed the last earlier occurrence of a sequence's last tokens "
               "(prompt lookup), early-exit those the model's first --draft-layers layers "
               "predict, draft-model those a smaller model (--speculative-model) predicts; each "
               "decode step verifies them, keeping the output distribution unchanged (default "
               "none; draft-model with --speculative-model)");
  args.Declare("speculative-model", "DIR",
               "draft-model: the draft's checkpoint directory (Hugging Face layout, the model's "
               "vocabulary); its KV cache takes its share of the KV budget");
  args.Declare("num-speculative-tokens", "K",
               "draft tokens proposed per sequence and step, 1..32 (default 4 with a method)");
  args.Declare("ngram-min", "N", "shortest suffix the ngram method matches (default 1)");
  args.Declare("ngram-max", "N",
               "longest suffix the ngram method matches, tried first (default 3)");
  args.Declare("draft-layers", "L",
               "early-exit: the draft is the model's first L layers with its final norm and LM "
               "head, reading the model's own KV of those layers (fewer than the model has)");
  args.DeclareSwitch("speculative-adaptive",
                     "choose each step's draft length (0: off) from the measured acceptance and "
                     "step times, for the most tokens per second (the default)");
  args.DeclareSwitch("no-speculative-adaptive",
                     "always propose --num-speculative-tokens (seeded sampled outputs then repeat "
                     "run to run)");
}

absl::Status SpeculativeFlags(const Args& args, engine::EngineOptions& options) {
  const std::string method =
      args.GetOr("speculative-method", args.Has("speculative-model") ? "draft-model" : "none");
  engine::SpeculativeOptions& spec = options.speculative;
  if (!engine::ParseSpeculativeMethod(method, &spec.method)) {
    return absl::InvalidArgumentError(
        absl::StrCat(args.command(),
                     ": --speculative-method must be none, ngram, early-exit or draft-model, got '",
                     method, "'"));
  }
  if (spec.method == engine::SpeculativeMethod::kNone) {
    for (const char* flag : {"num-speculative-tokens", "ngram-min", "ngram-max", "draft-layers",
                             "speculative-adaptive", "no-speculative-adaptive"}) {
      if (args.Has(flag) || args.Switch(flag)) {
        return absl::InvalidArgumentError(
            absl::StrCat(args.command(), ": --", flag,
                         " needs --speculative-method ngram, early-exit or draft-model"));
      }
    }
    return absl::OkStatus();
  }
  const bool draft_model = spec.method == engine::SpeculativeMethod::kDraftModel;
  if (draft_model != args.Has("speculative-model")) {
    return absl::InvalidArgumentError(absl::StrCat(
        args.command(), draft_model
                            ? ": --speculative-method draft-model needs --speculative-model DIR"
                            : ": --speculative-model is the draft of --speculative-method "
                              "draft-model"));
  }
  if (draft_model) spec.draft_model = args.GetOr("speculative-model", "");
  if (args.Switch("speculative-adaptive") && args.Switch("no-speculative-adaptive")) {
    return absl::InvalidArgumentError(absl::StrCat(
        args.command(), ": --speculative-adaptive and --no-speculative-adaptive contradict"));
  }
  spec.adaptive = !args.Switch("no-speculative-adaptive");
  const bool early_exit = spec.method == engine::SpeculativeMethod::kEarlyExit;
  for (const char* flag : {"ngram-min", "ngram-max"}) {
    if (spec.method != engine::SpeculativeMethod::kNgram && args.Has(flag)) {
      return absl::InvalidArgumentError(absl::StrCat(
          args.command(), ": --", flag, " is an option of --speculative-method ngram"));
    }
  }
  if (early_exit && !args.Has("draft-layers")) {
    return absl::InvalidArgumentError(
        absl::StrCat(args.command(), ": --speculative-method early-exit needs --draft-layers L"));
  }
  if (!early_exit && args.Has("draft-layers")) {
    return absl::InvalidArgumentError(absl::StrCat(
        args.command(), ": --draft-layers is an option of --speculative-method early-exit"));
  }
  if (early_exit) {
    TANDEM_ASSIGN_OR_RETURN(int64_t layers, IntFlag(args, "draft-layers", 0, 1, 1024));
    spec.draft_layers = static_cast<int>(layers);
  }
  TANDEM_ASSIGN_OR_RETURN(int64_t k, IntFlag(args, "num-speculative-tokens", 4, 1, 32));
  TANDEM_ASSIGN_OR_RETURN(int64_t ngram_min, IntFlag(args, "ngram-min", 1, 1, 64));
  TANDEM_ASSIGN_OR_RETURN(int64_t ngram_max,
                          IntFlag(args, "ngram-max", std::max<int64_t>(3, ngram_min), 1, 64));
  if (ngram_max < ngram_min) {
    return absl::InvalidArgumentError(absl::StrCat(args.command(), ": --ngram-max (", ngram_max,
                                                   ") is below --ngram-min (", ngram_min, ")"));
  }
  spec.num_speculative_tokens = static_cast<int>(k);
  spec.ngram_min = static_cast<int>(ngram_min);
  spec.ngram_max = static_cast<int>(ngram_max);
  return absl::OkStatus();
}

void DeclareSloControllerFlags(Args& args, bool tpot, bool ttft, bool policy) {
  if (tpot) {
    args.Declare("tpot-slo", "SECONDS",
                 "time-per-output-token target: the running batch is capped at the largest size "
                 "whose predicted step time fits 0.9x of it (default: none, max-num-seqs)");
  }
  if (ttft) {
    args.Declare("ttft-slo", "SECONDS",
                 "time-to-first-token target: each step takes at most the tokens predicted to "
                 "run in a quarter of it (default: none, max-num-batched-tokens)");
  }
  if (policy) {
    args.Declare("prefill-policy", "fcfs|spf",
                 "admission order of queued prompts: arrival, or shortest prompt first "
                 "(default fcfs)");
  }
}

absl::Status SloControllerFlags(const Args& args, engine::EngineOptions& options) {
  for (const auto& [name, target] :
       {std::pair<const char*, double*>{"tpot-slo", &options.tpot_slo_seconds},
        {"ttft-slo", &options.ttft_slo_seconds}}) {
    if (!args.Has(name)) continue;
    TANDEM_ASSIGN_OR_RETURN(double seconds, args.Double(name, 0));
    if (!(seconds > 0) || !std::isfinite(seconds)) {
      return absl::InvalidArgumentError(absl::StrCat(args.command(), ": --", name,
                                                     " must be a number of seconds > 0, got ",
                                                     *args.Get(name)));
    }
    *target = seconds;
  }
  const std::string policy = args.GetOr("prefill-policy", "fcfs");
  if (policy == "fcfs") {
    options.queue_policy = engine::QueuePolicy::kFcfs;
  } else if (policy == "spf") {
    options.queue_policy = engine::QueuePolicy::kShortestPromptFirst;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat(args.command(), ": --prefill-policy must be fcfs or spf, got ", policy));
  }
  return absl::OkStatus();
}

void DeclareApiFlags(Args& args) {
  args.Declare("host", "ADDR", "address to listen on (default 127.0.0.1)");
  args.Declare("port", "N", "port to listen on; 0 picks a free one (default 8000)");
  args.Declare("served-model-name", "NAME", "model name clients use (default: the directory name)");
  args.Declare("api-key", "KEY",
               "require 'Authorization: Bearer KEY' on every route but /health and /ready "
               "(default: $TANDEM_API_KEY, else none)");
  args.DeclareSwitch("metrics-public", "serve /metrics without the API key");
  args.Declare("http-threads", "N", "HTTP I/O threads (default 2)");
  args.Declare("max-active-requests", "N",
               "generation requests in flight before new ones are refused (default 1024)");
  args.Declare("overload-status", "529|503", "status for refused requests (default 529)");
  args.Declare("max-body-bytes", "N", "largest request body (default 4 MiB)");
  args.Declare("request-timeout-ms", "N",
               "time for a client to send a whole request, and to idle between requests "
               "(default 30000)");
  args.Declare("ttft-slo", "SECONDS",
               "time-to-first-token objective each finished request is counted against in "
               "/metrics (default: none)");
  args.Declare("tpot-slo", "SECONDS",
               "time-per-output-token objective, (end - first token) / (tokens - 1) (default: "
               "none)");
  args.Declare("tool-call-parser", "auto|hermes|llama3_json",
               "syntax of the model's tool calls: hermes (<tool_call> blocks: Hermes, Qwen2.5, "
               "Qwen3) or llama3_json (Llama 3.1+); auto detects it from the chat template "
               "(default auto)");
}

namespace {

// An optional SLO flag in seconds: unset, or finite and > 0.
absl::StatusOr<std::optional<double>> SloFlag(const Args& args, const std::string& name) {
  if (!args.Has(name)) return std::nullopt;
  TANDEM_ASSIGN_OR_RETURN(double seconds, args.Double(name, 0));
  if (!(seconds > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        args.command(), ": --", name, " must be a number of seconds > 0, got ", *args.Get(name)));
  }
  return seconds;
}

}  // namespace

absl::StatusOr<router::ApiServerOptions> ApiFlags(const Args& args, const std::string& model_dir) {
  router::ApiServerOptions options;
  options.http.host = args.GetOr("host", "127.0.0.1");
  TANDEM_ASSIGN_OR_RETURN(int64_t port, IntFlag(args, "port", 8000, 0, 65535));
  options.http.port = static_cast<int>(port);
  TANDEM_ASSIGN_OR_RETURN(int64_t http_threads, IntFlag(args, "http-threads", 2, 1, 64));
  options.http.num_threads = static_cast<int>(http_threads);
  TANDEM_ASSIGN_OR_RETURN(options.http.max_body_bytes,
                          IntFlag(args, "max-body-bytes", 4 << 20, 1024, int64_t{1} << 32));
  TANDEM_ASSIGN_OR_RETURN(int64_t timeout_ms,
                          IntFlag(args, "request-timeout-ms", 30000, 100, 3600000));
  options.http.request_timeout = std::chrono::milliseconds(timeout_ms);
  TANDEM_ASSIGN_OR_RETURN(int64_t max_active,
                          IntFlag(args, "max-active-requests", 1024, 1, 1000000));
  options.max_active_requests = static_cast<int>(max_active);
  TANDEM_ASSIGN_OR_RETURN(int64_t overload, args.Int("overload-status", 529));
  if (overload != 529 && overload != 503) {
    return absl::InvalidArgumentError(absl::StrCat(
        args.command(), ": --overload-status must be 529 or 503, got ", overload));
  }
  options.overload_status = static_cast<int>(overload);
  options.metrics_public = args.Switch("metrics-public");
  TANDEM_ASSIGN_OR_RETURN(options.ttft_slo_seconds, SloFlag(args, "ttft-slo"));
  TANDEM_ASSIGN_OR_RETURN(options.tpot_slo_seconds, SloFlag(args, "tpot-slo"));
  options.tool_call_parser = args.GetOr("tool-call-parser", "auto");
  if (!router::ParseToolCallFormat(options.tool_call_parser).ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        args.command(), ": --tool-call-parser must be auto, hermes or llama3_json, got '",
        options.tool_call_parser, "'"));
  }
  if (args.Has("api-key")) {
    options.api_key = *args.Get("api-key");
    if (options.api_key.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(args.command(), ": --api-key must not be empty"));
    }
  } else if (const char* env = std::getenv("TANDEM_API_KEY"); env != nullptr && *env != '\0') {
    options.api_key = env;
  }
  std::string name = args.GetOr("served-model-name", "");
  if (name.empty()) name = fs::path(model_dir).lexically_normal().filename().string();
  if (name.empty() || name == ".") {
    name = fs::path(model_dir).lexically_normal().parent_path().filename().string();
  }
  if (name.empty()) name = "model";
  options.served_model_names = {name};
  return options;
}

void DeclareRoutingFlags(Args& args) {
  args.Declare("routing", "kv-aware|load",
               "how workers are chosen: kv-aware (default) sends a request where the workers' "
               "prefix caches already hold most of its prompt, weighed against their queued "
               "work and batch (from each worker's KV events); load by load alone");
  args.Declare("kv-index-max-blocks", "N",
               "with --routing kv-aware: block hashes the router's index keeps per worker "
               "(default 1048576; more are not recorded)");
}

absl::Status RoutingFlags(const Args& args, router::DisaggregatedOptions& options) {
  if (args.Has("routing")) {
    absl::StatusOr<router::Routing> routing = router::ParseRouting(*args.Get("routing"));
    if (!routing.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(args.command(), ": ", routing.status().message()));
    }
    options.routing = *routing;
  }
  if (args.Has("kv-index-max-blocks") && options.routing != router::Routing::kKvAware) {
    return absl::InvalidArgumentError(
        absl::StrCat(args.command(), ": --kv-index-max-blocks needs --routing kv-aware"));
  }
  TANDEM_ASSIGN_OR_RETURN(int64_t max_blocks,
                          IntFlag(args, "kv-index-max-blocks", 1 << 20, 1, int64_t{1} << 32));
  options.kv_index_max_blocks = static_cast<size_t>(max_blocks);
  return absl::OkStatus();
}

void DeclareTlsFlags(Args& args, const std::string& side) {
  args.Declare("tls-ca", "FILE",
               absl::StrCat("mutual TLS for ", side,
                            ": PEM CA that every peer's certificate must chain to (with "
                            "--tls-cert and --tls-key; default: plaintext)"));
  args.Declare("tls-cert", "FILE", "PEM certificate this process presents (with --tls-ca)");
  args.Declare("tls-key", "FILE", "PEM private key of --tls-cert (with --tls-ca)");
  args.Declare("tls-server-name", "NAME",
               "name the dialed servers' certificates carry, when it is not the dialed host "
               "(with --tls-ca)");
}

absl::StatusOr<proto::TlsFiles> TlsFlags(const Args& args) {
  proto::TlsFiles tls;
  tls.ca = args.GetOr("tls-ca", "");
  tls.cert = args.GetOr("tls-cert", "");
  tls.key = args.GetOr("tls-key", "");
  tls.server_name = args.GetOr("tls-server-name", "");
  if (!tls.enabled()) {
    if (args.Has("tls-server-name")) {
      return absl::InvalidArgumentError(
          absl::StrCat(args.command(), ": --tls-server-name needs --tls-ca, --tls-cert and "
                                       "--tls-key"));
    }
    return tls;
  }
  std::string missing;
  for (const auto& [flag, value] : {std::pair<const char*, const std::string*>{"tls-ca", &tls.ca},
                                    {"tls-cert", &tls.cert},
                                    {"tls-key", &tls.key}}) {
    if (value->empty()) absl::StrAppend(&missing, missing.empty() ? "" : ", ", "--", flag);
  }
  if (!missing.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        args.command(), ": --tls-ca, --tls-cert and --tls-key go together (missing ", missing,
        ")"));
  }
  if (absl::Status status = proto::ValidateTlsFiles(tls); !status.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(args.command(), ": ", status.message()));
  }
  return tls;
}

sigset_t BlockStopSignals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  return signals;
}

void WaitForSignal(const sigset_t& signals, const std::string& what) {
  int received = 0;
  sigwait(&signals, &received);
  std::fprintf(stderr, "tandem: %s received, %s\n", received == SIGINT ? "SIGINT" : "SIGTERM",
               what.c_str());
}

void RaiseFileLimit() {
  rlimit files{};
  if (getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < files.rlim_max) {
    files.rlim_cur = files.rlim_max;
    setrlimit(RLIMIT_NOFILE, &files);
  }
}

}  // namespace tandem::tools

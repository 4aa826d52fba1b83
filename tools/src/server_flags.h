// Flags shared by the serving subcommands (`serve`, `router`, `prefill`, `decode`): the engine
// a worker runs, the HTTP API the router serves, and the signal wait they all end with.
#pragma once

#include <csignal>
#include <string>

#include "absl/status/statusor.h"
#include "tandem/engine/llm_engine.h"
#include "tandem/proto/tls.h"
#include "tandem/router/disaggregated_generator.h"
#include "tandem/router/openai_server.h"
#include "tandem/tools/args.h"

namespace tandem::tools {

// A flag's integer value within [lo, hi], or an error "COMMAND: --NAME must be in [lo, hi]".
absl::StatusOr<int64_t> IntFlag(const Args& args, const std::string& name, int64_t fallback,
                                int64_t lo, int64_t hi);

// --model and the engine's batching, KV and thread flags.
void DeclareEngineFlags(Args& args);
// The engine options they give. Without --model: the synthetic 'small' model, written once
// into ~/.cache/tandem/models/small-llama.
absl::StatusOr<engine::EngineOptions> EngineFlags(const Args& args);

// Speculative decoding: --speculative-method none|ngram, --num-speculative-tokens K,
// --ngram-min N, --ngram-max N (part of DeclareEngineFlags; `generate` declares them itself).
void DeclareSpeculativeFlags(Args& args);
// Sets options.speculative from them ("COMMAND: --FLAG ..." errors for bad values).
absl::Status SpeculativeFlags(const Args& args, engine::EngineOptions& options);

// The SLO controllers' flags (docs/architecture.md, "SLO-driven batch sizing"): --tpot-slo on a
// decode worker, --ttft-slo on a prefill worker (`serve` takes both from its API flags), and
// --prefill-policy wherever prefill runs.
void DeclareSloControllerFlags(Args& args, bool tpot, bool ttft, bool policy);
// Sets the engine's targets and queue policy from whichever of them were declared and given.
absl::Status SloControllerFlags(const Args& args, engine::EngineOptions& options);

// The HTTP API flags (--host, --port, --api-key, limits) and --served-model-name.
void DeclareApiFlags(Args& args);
absl::StatusOr<router::ApiServerOptions> ApiFlags(const Args& args, const std::string& model_dir);

// --routing kv-aware|load and --kv-index-max-blocks N: how the router chooses workers (the
// disaggregated router of `router` and `serve`).
void DeclareRoutingFlags(Args& args);
// Sets options.routing and options.kv_index_max_blocks ("COMMAND: ..." errors).
absl::Status RoutingFlags(const Args& args, router::DisaggregatedOptions& options);

// --tls-ca, --tls-cert, --tls-key, --tls-server-name: mutual TLS on the internal plane (gRPC
// between router and workers, and etcd). `side` says what the files secure, for --help.
void DeclareTlsFlags(Args& args, const std::string& side);
// The TLS files: none, or all three readable PEM files ("COMMAND: ..." errors otherwise).
absl::StatusOr<proto::TlsFiles> TlsFlags(const Args& args);

// Blocks SIGINT and SIGTERM in this thread (call before starting any thread, so every thread
// inherits the mask) and returns the set for WaitForSignal.
sigset_t BlockStopSignals();
// Waits for one of `signals` and says on stderr that `what` is shutting down.
void WaitForSignal(const sigset_t& signals, const std::string& what);

// Raises the open-file limit to the hard limit: every stream and connection is a descriptor.
void RaiseFileLimit();

}  // namespace tandem::tools

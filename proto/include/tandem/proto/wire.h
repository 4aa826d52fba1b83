// tandem::wire: the engine API's types <-> control-plane messages (sampling params, finish
// reasons, request tasks, prefilled samples, the KV layout an engine states in the handshake).
// Links only the engine API, so the router converts without the engine. Status conversions:
// status.h.
//
//   tandem::v1::SubmitRequest request;
//   *request.mutable_sampling() = tandem::proto::ToProto(params);
//   ...
//   engine::SamplingParams params = tandem::proto::FromProto(request.sampling());
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tandem/base/half.h"
#include "tandem/engine/handoff.h"
#include "tandem/engine/request.h"
#include "tandem/engine/sampling_params.h"
#include "tandem/proto/status.h"
#include "tandem/text/model_config.h"
#include "tandem/v1/kv_layout.pb.h"
#include "tandem/v1/prefill.pb.h"
#include "tandem/v1/sampling.pb.h"
#include "tandem/v1/worker.pb.h"

namespace tandem::proto {

// Sets every field of the message (an unset seed stays unset), so FromProto(ToProto(p)) == p.
tandem::v1::SamplingParams ToProto(const engine::SamplingParams& params);

// Fields the message leaves unset take engine::SamplingParams' defaults (an empty message gives
// SamplingParams{}), never proto3's zeros. Does not validate: the engine does
// (SamplingParams::Validate), with the vocabulary size this layer does not know.
engine::SamplingParams FromProto(const tandem::v1::SamplingParams& params);

// The handshake's name for a KV cache element type.
tandem::v1::KvDtype ToProto(DType dtype);

// The layout of an engine's KV cache as the handshake states it: its element type
// (--kv-cache-dtype), the engine's block size, layers, KV heads and head size, the
// tensor-parallel rank whose cache it is (its heads [kv_head_begin, + num_kv_heads); 0: the
// model's, one unsharded rank), and the memory order
// "layer[2][blocks][block_size][kv_heads][head_dim]".
tandem::v1::KvLayout EngineKvLayout(const text::ModelConfig& config, int block_size,
                                    DType kv_dtype, int tp_size = 1, int tp_rank = 0,
                                    int kv_head_begin = 0, int num_kv_heads = 0);

// Finish reasons on the wire. kPrefilled never crosses it (it becomes NONE); an unknown value
// from a newer peer becomes kAbort.
tandem::v1::FinishReason ToProto(engine::FinishReason reason);
engine::FinishReason FromProto(tandem::v1::FinishReason reason);

// What a Submit computes. FromProto refuses (InvalidArgument) a task this build does not know (a
// newer router's), so that a worker never runs it as something else.
tandem::v1::Task ToProto(engine::RequestTask task);
absl::StatusOr<engine::RequestTask> FromProto(tandem::v1::Task task);

// A prefilled sample on the wire: first token, its logprobs, and the sampler's RNG state as 32
// little-endian bytes. FromProto reads an empty state as all zeros (greedy sampling draws no
// random numbers) and refuses (InvalidArgument) any other size.
tandem::v1::PrefilledChoice ToProto(int index, const engine::PrefillHandoff& handoff);
// generated_token_ids (a continuation after a KV handoff) become PrefilledChoice::generated.
absl::StatusOr<engine::PrefilledChoice> FromProto(const tandem::v1::PrefilledChoice& choice);
// A sampler RNG state as the 32 little-endian bytes of PrefilledChoice.sampler_state.
std::string SamplerStateBytes(const std::array<uint64_t, 4>& rng_state);

}  // namespace tandem::proto

// The KV layout handshake rule: when two workers may copy KV pages between their caches.
//
// A prefill worker writes raw KV bytes into a decode worker's blocks. Unless both caches have
// the same dtype, block size, layers, model KV heads, head size and memory order, those bytes
// would be read as something else: silent corruption. So every handshake and every reservation
// is checked, and a mismatch is refused with every difference named. Tensor-parallel degrees may
// differ: the sender maps heads between the groups' ranks (engine::KvHeadRuns).
//
//   absl::Status s = tandem::proto::CheckLayoutCompatible(my_layout, endpoint.layout());
//   // FailedPrecondition: "KV layout mismatch (sender vs receiver): dtype BF16 vs F32;
//   //                      head_dim 128 vs 64"
#pragma once

#include <string>

#include "absl/status/status.h"
#include "tandem/v1/kv_layout.pb.h"

namespace tandem::proto {

// "F32", "F16", "BF16", "FP8_E4M3", "UNSPECIFIED", or "KvDtype(N)" for a value this build does
// not know (a newer peer).
std::string KvDtypeName(tandem::v1::KvDtype dtype);

// OK when `layout` describes a usable cache: a known dtype, positive block_size, num_layers,
// num_kv_heads, head_dim, tp_size and total_kv_heads, 0 <= tp_rank < tp_size, the rank's heads
// within the model's, and a layout_name. Otherwise InvalidArgument naming every bad field and
// its value.
absl::Status ValidateLayout(const tandem::v1::KvLayout& layout);

// OK only when pages written in `sender`'s layout can be read as they are in `receiver`'s: both
// layouts are valid (else InvalidArgument, as ValidateLayout, saying which side) and dtype,
// block_size, num_layers, total_kv_heads, head_dim and layout_name all agree (not the
// tensor-parallel degree, rank or heads per rank). Otherwise FailedPrecondition whose message
// names every mismatching field with the sender's value first.
absl::Status CheckLayoutCompatible(const tandem::v1::KvLayout& sender,
                                   const tandem::v1::KvLayout& receiver);

// What a worker that pushes KV (a prefill worker, or a draining decode worker handing a sample
// off) checks of the receiver's endpoint before anything is posted: CheckLayoutCompatible(sender,
// endpoint.layout); the same kvtransfer backend as `sender_backend` (FailedPrecondition); a
// non-empty address, positive num_blocks, and either one region descriptor (all layers) or one
// per layer (InvalidArgument). `name` is how messages call the endpoint (e.g.
// "reservation.endpoint"), `sender_name` the sender ("this prefill worker").
absl::Status CheckTransferEndpoint(const tandem::v1::KvLayout& sender,
                                   const std::string& sender_backend,
                                   const tandem::v1::TransferEndpoint& endpoint,
                                   const std::string& name, const std::string& sender_name);

}  // namespace tandem::proto

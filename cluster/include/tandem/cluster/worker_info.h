// What a worker publishes about itself in etcd, and where.
//
// Key:   /tandem/<cluster>/workers/<role>/<id>          (role: "prefill" or "decode")
// Value: {"id": "...", "role": "decode", "address": "10.0.0.5:7002",
//         "metrics_address": "10.0.0.5:9102", "kv_backend": "ucx",
//         "capacity": {"kv_blocks_total": 4096}}
// The key is attached to the worker's lease, so it disappears when the worker stops renewing.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace tandem::cluster {

struct WorkerInfo {
  std::string id;
  // "prefill" or "decode".
  std::string role;
  // The gRPC control-plane address others use to reach the worker, "host:port".
  std::string address;
  // "host:port" of its /metrics listener; empty when it serves none.
  std::string metrics_address;
  // The kvtransfer backend ("ucx", "local"); a router pairs only workers that share one.
  std::string kv_backend;
  // KV blocks in the worker's cache.
  int64_t kv_blocks_total = 0;

  // Not part of the value: the etcd lease the key is attached to and the revision of its last
  // write (filled in when read from etcd).
  int64_t lease = 0;
  int64_t mod_revision = 0;

  // Compares the published fields only (not lease / mod_revision).
  bool SameAs(const WorkerInfo& other) const;
};

// "prefill" and "decode" are the roles; anything else is refused.
bool IsWorkerRole(const std::string& role);

// "/tandem/<cluster>/workers/"
std::string WorkersPrefix(const std::string& cluster);
// "/tandem/<cluster>/workers/<role>/<id>"
std::string WorkerKey(const std::string& cluster, const std::string& role, const std::string& id);

// The JSON value above.
std::string WorkerInfoToJson(const WorkerInfo& info);
// Parses a value; InvalidArgument on malformed JSON, a missing id/role/address or an unknown
// role. Unknown fields are ignored (newer workers may publish more).
absl::StatusOr<WorkerInfo> WorkerInfoFromJson(const std::string& json);

// Checks a cluster name or worker id for use in a key: non-empty, at most 128 characters of
// [A-Za-z0-9._-].
absl::Status ValidateKeySegment(const std::string& what, const std::string& value);

}  // namespace tandem::cluster

// A small etcd v3 client over gRPC: the KV, Lease and Watch calls Tandem's membership needs.
//
//   TANDEM_ASSIGN_OR_RETURN(auto etcd, EtcdClient::Create({.endpoints = "127.0.0.1:2379"}));
//   TANDEM_ASSIGN_OR_RETURN(int64_t lease, etcd->LeaseGrant(absl::Seconds(10)));
//   TANDEM_ASSIGN_OR_RETURN(bool created, etcd->CreateIfAbsent("/k", "v", lease));
//   auto keeper = etcd->KeepAlive(lease, absl::Seconds(10), absl::Seconds(3),
//                                 [](absl::Status why) { /* the lease is gone */ });
//   auto watcher = etcd->Watch("/prefix/", revision + 1, [](const WatchUpdate& u) { ... });
//
// Every unary call has a deadline (`EtcdClientOptions::timeout`) and fails over: when the
// endpoint in use is unreachable, the call is retried once on each other endpoint, and the one
// that answered is used from then on. The keep-alive and watch runners reconnect on their own
// (to the next endpoint when one is down). Errors are absl::Status with the gRPC code kept
// (Unavailable when no endpoint answers, DeadlineExceeded, NotFound for an unknown lease).
// The client is thread-safe; stop (or destroy) every LeaseKeeper and Watcher before the client.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tandem/proto/tls.h"

namespace tandem::cluster {

struct EtcdClientOptions {
  // Comma-separated etcd client endpoints: "http://HOST:PORT" or "HOST:PORT" without `tls`;
  // "https://HOST:PORT" or "HOST:PORT" with it (every endpoint then uses TLS: "http://" is
  // refused, as is "https://" without `tls`).
  std::string endpoints;
  // Deadline of each unary call on one endpoint.
  absl::Duration timeout = absl::Seconds(5);
  // Mutual TLS (etcd's --client-cert-auth --trusted-ca-file): etcd's certificate is verified
  // against `tls.ca` and `tls.cert` is presented. Empty: plaintext.
  proto::TlsFiles tls;
};

// A key as stored in etcd.
struct KeyValue {
  std::string key;
  std::string value;
  int64_t create_revision = 0;
  int64_t mod_revision = 0;
  int64_t version = 0;
  // The lease the key is attached to; 0 for none.
  int64_t lease = 0;
};

// The keys under a prefix and the store revision they were read at.
struct RangeResult {
  std::vector<KeyValue> kvs;
  int64_t revision = 0;
};

struct WatchEvent {
  enum class Type { kPut, kDelete };
  Type type = Type::kPut;
  // kPut: the new key-value. kDelete: the key (value empty), mod_revision the deletion's.
  KeyValue kv;
};

// What a watch callback receives.
struct WatchUpdate {
  // true: the watch could not resume from where it was (its revision was compacted away) and
  // re-listed the prefix: `snapshot` is now the whole content of the prefix, replacing what the
  // callback knew; `events` is empty.
  bool resync = false;
  std::vector<KeyValue> snapshot;
  // Events in revision order (resync false).
  std::vector<WatchEvent> events;
  // The store revision these events (or this snapshot) bring the watcher to.
  int64_t revision = 0;
};

// Renews one lease until stopped or lost. Stop() (and the destructor) end it without revoking.
class LeaseKeeper {
 public:
  virtual ~LeaseKeeper() = default;
  // Stops renewing and joins the runner thread. Idempotent; never call from `on_lost`.
  virtual void Stop() = 0;
  // The last time etcd confirmed the lease.
  virtual absl::Time last_renewed() const = 0;
};

// Watches a prefix until stopped.
class Watcher {
 public:
  virtual ~Watcher() = default;
  // Cancels the stream and joins the runner thread. Idempotent; never call from the callback.
  virtual void Stop() = 0;
  // The revision the watcher will resume from if its stream breaks (last seen + 1).
  virtual int64_t next_revision() const = 0;
};

class EtcdClient {
 public:
  static absl::StatusOr<std::unique_ptr<EtcdClient>> Create(EtcdClientOptions options);
  ~EtcdClient();

  // The value of `key`, nullopt when absent.
  absl::StatusOr<std::optional<KeyValue>> Get(const std::string& key);
  // Every key starting with `prefix` (sorted by key), with the revision of the read.
  absl::StatusOr<RangeResult> GetPrefix(const std::string& prefix);
  // Sets `key`, attached to `lease` (0: none). Returns the revision of the write.
  absl::StatusOr<int64_t> Put(const std::string& key, const std::string& value,
                              int64_t lease = 0);
  // Deletes `key`; returns how many keys were deleted (0 or 1).
  absl::StatusOr<int64_t> Delete(const std::string& key);
  // Deletes every key starting with `prefix`; returns how many.
  absl::StatusOr<int64_t> DeletePrefix(const std::string& prefix);
  // Writes `key` only if it does not exist (one Txn comparing create_revision with 0). Returns
  // true when this call created it, false when the key was there already (with a different
  // lease: a key already attached to `lease` with this value counts as created, so a retried
  // call that had succeeded is not mistaken for a conflict).
  absl::StatusOr<bool> CreateIfAbsent(const std::string& key, const std::string& value,
                                      int64_t lease = 0);
  // Compacts the history up to `revision` (watches from before it then resync).
  absl::Status Compact(int64_t revision);

  // A lease of `ttl` (whole seconds, at least 1; etcd may raise it to its minimum). Returns its
  // id.
  absl::StatusOr<int64_t> LeaseGrant(absl::Duration ttl);
  // Revokes a lease and deletes its keys. NotFound when etcd does not know it (expired).
  absl::Status LeaseRevoke(int64_t lease);

  // Renews `lease` every `interval` over a LeaseKeepAlive stream, on a thread of its own,
  // reconnecting (to the next endpoint) when the stream breaks. Calls `on_lost` once, from that
  // thread, and stops when etcd says the lease is gone (NotFound) or when no renewal succeeded
  // for `ttl` (Unavailable: the lease has expired, or may have, as far as this process can
  // tell).
  std::unique_ptr<LeaseKeeper> KeepAlive(int64_t lease, absl::Duration ttl,
                                         absl::Duration interval,
                                         std::function<void(absl::Status)> on_lost);

  // Watches every key starting with `prefix` from `start_revision` (inclusive; 0: from now) on
  // a thread of its own, calling `callback` there for each batch of events, in order. When the
  // stream breaks it reconnects (to the next endpoint when one is down, retrying for as long as
  // it takes) and resumes from the revision after the last one it delivered, so no event is
  // lost or repeated; when that revision has been compacted it re-lists the prefix and
  // delivers a `resync` snapshot, then carries on from there.
  std::unique_ptr<Watcher> Watch(const std::string& prefix, int64_t start_revision,
                                 std::function<void(const WatchUpdate&)> callback);

  // The endpoint calls go to first (the last one that answered), as "host:port".
  std::string current_endpoint() const;

  struct Impl;

 private:
  explicit EtcdClient(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The first key after every key that starts with `prefix` (etcd's range_end for a prefix).
std::string PrefixRangeEnd(const std::string& prefix);

// Parses a comma-separated endpoint list into "host:port" targets. With `tls`, "https://" is
// accepted and "http://" refused; without it, the reverse.
absl::StatusOr<std::vector<std::string>> ParseEndpoints(const std::string& endpoints,
                                                        bool tls = false);

}  // namespace tandem::cluster

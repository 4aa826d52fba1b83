#include "tandem/worker/kv_events.h"

#include <deque>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "tandem/base/tsan.h"
#include "tandem/worker/grpc_call.h"

namespace tandem::worker {

// One subscriber's stream: the snapshot's messages queued, then the net change of every hash
// since the last write. Shared by the hub (which pushes) and gRPC's reactor (which writes).
class KvEventStream : public std::enable_shared_from_this<KvEventStream> {
 public:
  static std::shared_ptr<KvEventStream> Create(size_t max_pending);

  grpc::ServerWriteReactor<tandem::v1::KvEventBatch>* reactor();
  // Queues the snapshot: a reset message and as many more as `hashes` takes.
  void Snapshot(const std::vector<uint64_t>& hashes, int block_size);
  void Push(const std::vector<engine::BlockManager::CacheEvent>& events);
  void Fail(grpc::Status status);
  // The call has ended or is ending: nothing more is written.
  bool ended() const;

 private:
  using Reactor = StreamWriteReactor<tandem::v1::KvEventBatch, KvEventStream>;
  friend Reactor;
  explicit KvEventStream(size_t max_pending) : max_pending_(max_pending) {}
  // Starts the next write if none is in flight. Called with `lock` held; releases it.
  void Pump(std::unique_lock<std::mutex> lock);
  // Ends the call with `status` unless it has ended. Called with `lock` held; releases it.
  void Finish(std::unique_lock<std::mutex> lock, grpc::Status status);
  void OnWriteDone(bool ok);
  void OnCancel();

  const size_t max_pending_;
  Reactor* reactor_ = nullptr;  // gRPC's; valid until finished_
  mutable std::mutex mu_;
  int block_size_ = 0;                                // guarded by mu_
  std::deque<tandem::v1::KvEventBatch> queue_;        // guarded by mu_: the snapshot
  absl::flat_hash_map<uint64_t, bool> pending_;       // guarded by mu_: hash -> stored
  tandem::v1::KvEventBatch in_flight_;                // guarded by mu_ while !writing_
  bool writing_ = false;                              // guarded by mu_
  bool finished_ = false;                             // guarded by mu_: Finish was called
  bool failing_ = false;                              // guarded by mu_: Finish once written
  grpc::Status fail_status_;                          // guarded by mu_
};

std::shared_ptr<KvEventStream> KvEventStream::Create(size_t max_pending) {
  std::shared_ptr<KvEventStream> stream(new KvEventStream(max_pending));
  stream->reactor_ = new Reactor(stream);
  return stream;
}

grpc::ServerWriteReactor<tandem::v1::KvEventBatch>* KvEventStream::reactor() { return reactor_; }

void KvEventStream::Snapshot(const std::vector<uint64_t>& hashes, int block_size) {
  std::unique_lock<std::mutex> lock(mu_);
  if (finished_ || failing_) return;
  block_size_ = block_size;
  size_t i = 0;
  do {
    tandem::v1::KvEventBatch& batch = queue_.emplace_back();
    batch.set_reset(i == 0);
    batch.set_block_size(block_size);
    const size_t end = std::min(hashes.size(), i + kKvEventBatchMax);
    batch.mutable_stored()->Add(hashes.begin() + i, hashes.begin() + end);
    i = end;
  } while (i < hashes.size());
  Pump(std::move(lock));
}

void KvEventStream::Push(const std::vector<engine::BlockManager::CacheEvent>& events) {
  std::unique_lock<std::mutex> lock(mu_);
  if (finished_ || failing_) return;
  for (const engine::BlockManager::CacheEvent& e : events) pending_[e.hash] = e.stored;
  if (pending_.size() > max_pending_) {
    // Cut off: the subscriber starts over from a snapshot.
    pending_.clear();
    queue_.clear();
    return Finish(std::move(lock),
                  grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                               absl::StrCat("the subscriber fell more than ", max_pending_,
                                            " KV events behind; subscribe again")));
  }
  Pump(std::move(lock));
}

void KvEventStream::Fail(grpc::Status status) {
  Finish(std::unique_lock<std::mutex>(mu_), std::move(status));
}

bool KvEventStream::ended() const {
  std::lock_guard<std::mutex> lock(mu_);
  return finished_ || failing_;
}

void KvEventStream::Pump(std::unique_lock<std::mutex> lock) {
  if (writing_ || finished_ || failing_) return;
  if (!queue_.empty()) {
    in_flight_ = std::move(queue_.front());
    queue_.pop_front();
  } else if (!pending_.empty()) {
    in_flight_.Clear();
    in_flight_.set_block_size(block_size_);
    size_t n = 0;
    for (auto it = pending_.begin(); it != pending_.end() && n < kKvEventBatchMax; ++n) {
      if (it->second) {
        in_flight_.add_stored(it->first);
      } else {
        in_flight_.add_removed(it->first);
      }
      pending_.erase(it++);
    }
  } else {
    return;
  }
  writing_ = true;
  lock.unlock();
  TsanRelease(reactor_);
  reactor_->StartWrite(&in_flight_);  // nothing else touches in_flight_ until OnWriteDone
}

void KvEventStream::Finish(std::unique_lock<std::mutex> lock, grpc::Status status) {
  if (finished_) return;
  if (writing_) {
    // Finish once the write in flight is done (gRPC allows no Finish before it).
    if (!failing_) {
      failing_ = true;
      fail_status_ = std::move(status);
    }
    return;
  }
  finished_ = true;
  lock.unlock();
  TsanRelease(reactor_);
  reactor_->Finish(std::move(status));
}

void KvEventStream::OnWriteDone(bool ok) {
  std::unique_lock<std::mutex> lock(mu_);
  writing_ = false;
  if (failing_) return Finish(std::move(lock), fail_status_);
  // The client stopped reading or went away.
  if (!ok) {
    return Finish(std::move(lock),
                  grpc::Status(grpc::StatusCode::CANCELLED, "the call was cancelled"));
  }
  Pump(std::move(lock));
}

void KvEventStream::OnCancel() {
  Finish(std::unique_lock<std::mutex>(mu_),
         grpc::Status(grpc::StatusCode::CANCELLED, "the call was cancelled"));
}

KvEventHub::KvEventHub(engine::BlockManager& blocks, size_t max_pending)
    : blocks_(blocks), max_pending_(max_pending) {
  blocks_.RecordEvents(blocks_.prefix_caching());
}

KvEventHub::~KvEventHub() { Close(); }

grpc::ServerWriteReactor<tandem::v1::KvEventBatch>* KvEventHub::Subscribe(EngineLoop& loop) {
  std::shared_ptr<KvEventStream> stream = KvEventStream::Create(max_pending_);
  const grpc::Status refused(grpc::StatusCode::UNAVAILABLE, "the worker is shutting down");
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) {
      stream->Fail(refused);
      return stream->reactor();
    }
  }
  auto* reactor = stream->reactor();
  const bool posted = loop.Post([this, stream, refused] {
    // Everything recorded so far goes to the earlier subscribers; this one starts from the
    // snapshot, and every later event reaches it.
    Publish();
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return stream->Fail(refused);
    stream->Snapshot(blocks_.CachedHashes(), blocks_.block_size());
    streams_.push_back(stream);
  });
  if (!posted) stream->Fail(refused);
  return reactor;
}

void KvEventHub::Publish() {
  std::vector<engine::BlockManager::CacheEvent> events = blocks_.TakeEvents();
  std::lock_guard<std::mutex> lock(mu_);
  std::erase_if(streams_, [](const std::shared_ptr<KvEventStream>& s) { return s->ended(); });
  if (events.empty()) return;
  for (const std::shared_ptr<KvEventStream>& s : streams_) s->Push(events);
}

void KvEventHub::Close() {
  std::vector<std::shared_ptr<KvEventStream>> streams;
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    streams.swap(streams_);
  }
  for (const std::shared_ptr<KvEventStream>& s : streams) {
    s->Fail(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the worker is shutting down"));
  }
}

size_t KvEventHub::subscribers() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const std::shared_ptr<KvEventStream>& s : streams_) n += s->ended() ? 0 : 1;
  return n;
}

}  // namespace tandem::worker

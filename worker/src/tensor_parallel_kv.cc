#include "tandem/worker/tensor_parallel_kv.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <future>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "tandem/base/status_macros.h"
#include "tandem/worker/grpc_call.h"

namespace tandem::worker {
namespace {

// Each rank's endpoint travels in a slot of this many bytes.
constexpr size_t kEndpointSlot = 16 << 10;
// A follower's connect to a decode rank takes at most this (and never past the deadline).
constexpr absl::Duration kFollowerConnectTimeout = absl::Seconds(10);
// Failure messages in a report are cut to this many bytes, so a report of many fits.
constexpr size_t kMaxFailureMessage = 300;

// A follower's pushes: what the leader's orders of the running step ask of this rank.
class KvPushFollower {
 public:
  KvPushFollower(KvEndpoint& kv, int rank, std::vector<engine::KvCacheLayout> group)
      : kv_(kv), rank_(rank), group_(std::move(group)) {}

  // Waits for the connects still running in the background (each bounded by its deadline).
  // Called before the endpoint closes.
  void WaitForConnects() { connecting_.clear(); }

  void Begin(std::string_view attachment) {
    requests_.clear();
    writes_.clear();
    reached_.clear();
    tandem::v1::KvPushOrders orders;
    if (!orders.ParseFromArray(attachment.data(), static_cast<int>(attachment.size()))) {
      failure_all_ = absl::InternalError("malformed KV push orders from rank 0");
      return;
    }
    if (orders.connect_only()) {
      for (const tandem::v1::KvPushOrders::Destination& d : orders.destinations()) Reach(d);
      return;
    }
    for (tandem::v1::KvPushOrders::Destination& d : *orders.mutable_destinations()) {
      Request& request = requests_[d.request_id()];
      request.deadline = FromUnixMillisOrInfinite(d.deadline_unix_ms());
      request.failure = Prepare(d.endpoint(), request);
    }
    bool all_layers = false;
    for (tandem::v1::KvPushOrders::Write& w : *orders.mutable_writes()) {
      all_layers = all_layers || w.all_layers();
      writes_.push_back(std::move(w));
    }
    if (!all_layers) return;
    for (int layer = 0; layer < group_[rank_].num_layers; ++layer) Push(layer, true);
  }

  void LayerWritten(int layer) { Push(layer, false); }

  std::string End() {
    tandem::v1::KvPushReport report;
    for (auto& [id, request] : requests_) {
      for (auto& handle : request.handles) {
        absl::Status status = handle->Wait();  // bounded by the request's deadline
        if (!status.ok() && request.failure.ok()) {
          for (Destination& dst : request.dsts) kv_.DropPeer(dst.address, dst.peer);
          request.failure = status;
        }
      }
      request.handles.clear();
      absl::Status failure = !failure_all_.ok() ? failure_all_ : request.failure;
      if (failure.ok()) continue;
      AddFailure(report, id, failure);
    }
    for (auto& [id, reach] : reached_) {
      if (!failure_all_.ok()) {
        AddFailure(report, id, failure_all_);
      } else if (!reach.ok()) {
        AddFailure(report, id, reach.status());
      } else if (!*reach) {
        report.add_connecting(id);
      }
    }
    failure_all_ = absl::OkStatus();
    requests_.clear();
    writes_.clear();
    reached_.clear();
    return report.SerializeAsString();
  }

 private:
  // Pushes this rank's heads of layer `layer` of the writes of one kind: written by the step
  // (as it writes the layer), or computed already (all_layers).
  void Push(int layer, bool all_layers) {
    for (const tandem::v1::KvPushOrders::Write& w : writes_) {
      if (w.all_layers() != all_layers) continue;
      auto it = requests_.find(w.request_id());
      if (it == requests_.end() || !it->second.failure.ok()) continue;
      Request& request = it->second;
      const engine::KvCacheLayout& from = group_[rank_];
      const int first_block = w.begin() / from.block_size;
      for (const engine::KvHeadRun& run : request.runs) {
        Destination& dst = request.dsts[run.dst_rank];
        const int dst_layer = dst.descriptors.size() > 1 ? 0 : layer;
        std::vector<kvtransfer::Range> ranges;
        AppendTokenRanges(from, dst.layout, run, layer, dst_layer, w.begin(), w.end(), first_block,
                          {w.src_blocks().data(), static_cast<size_t>(w.src_blocks_size())},
                          {w.dst_blocks().data(), static_cast<size_t>(w.dst_blocks_size())},
                          ranges);
        if (ranges.empty()) continue;
        const std::string& descriptor =
            dst.descriptors.size() > 1 ? dst.descriptors[layer] : dst.descriptors[0];
        auto handle = kv_.Push(dst.peer, descriptor, std::move(ranges), request.deadline);
        if (!handle.ok()) {
          Failed(request, dst, handle.status());
          break;
        }
        request.handles.push_back(std::move(handle).value());
      }
    }
  }

  struct Destination {
    std::string address;
    kvtransfer::PeerId peer = 0;
    std::vector<std::string> descriptors;
    engine::KvCacheLayout layout;
  };
  struct Request {
    absl::Time deadline;
    std::vector<Destination> dsts;       // the receiver's ranks
    std::vector<engine::KvHeadRun> runs;  // this rank's
    std::vector<std::unique_ptr<kvtransfer::TransferHandle>> handles;
    absl::Status failure;
  };

  // The receiver's ranks (request.dsts) and this rank's runs to them (request.runs).
  absl::Status MapRanks(const tandem::v1::TransferEndpoint& endpoint, Request& request) const {
    const std::vector<const tandem::v1::TransferEndpoint*> ranks = RankEndpoints(endpoint);
    TANDEM_ASSIGN_OR_RETURN(std::vector<engine::KvCacheLayout> dst_layouts, RankLayouts(ranks));
    for (size_t r = 0; r < ranks.size(); ++r) {
      request.dsts.push_back(
          {ranks[r]->address(),
           0,
           {ranks[r]->region_descriptors().begin(), ranks[r]->region_descriptors().end()},
           dst_layouts[r]});
    }
    TANDEM_ASSIGN_OR_RETURN(std::vector<engine::KvHeadRun> runs,
                            engine::KvHeadRuns(group_, dst_layouts));
    for (const engine::KvHeadRun& run : runs) {
      if (run.src_rank == rank_) request.runs.push_back(run);
    }
    return absl::OkStatus();
  }

  absl::Status Prepare(const tandem::v1::TransferEndpoint& endpoint, Request& request) {
    TANDEM_RETURN_IF_ERROR(MapRanks(endpoint, request));
    for (const engine::KvHeadRun& run : request.runs) {
      Destination& dst = request.dsts[run.dst_rank];
      if (dst.peer != 0) continue;
      // Connected already when rank 0 admitted the request after connect-only orders (Reach);
      // otherwise (the connection was dropped since) this step waits for the connect.
      TANDEM_ASSIGN_OR_RETURN(
          dst.peer,
          kv_.Peer(dst.address, std::min(request.deadline, absl::Now() + kFollowerConnectTimeout)));
    }
    return absl::OkStatus();
  }

  // Connect-only orders: starts a background connect to each rank of `d` this rank sends to
  // that is neither connected nor being connected to, and records in reached_ whether all are
  // connected (or the first failure of a connect that has ended; the next orders try again).
  void Reach(const tandem::v1::KvPushOrders::Destination& d) {
    absl::StatusOr<bool>& reached = reached_[d.request_id()];
    reached = true;
    Request request;
    if (absl::Status mapped = MapRanks(d.endpoint(), request); !mapped.ok()) {
      reached = mapped;
      return;
    }
    const absl::Time deadline =
        std::min(FromUnixMillisOrInfinite(d.deadline_unix_ms()),
                 absl::Now() + kFollowerConnectTimeout);
    for (const engine::KvHeadRun& run : request.runs) {
      const std::string& address = request.dsts[run.dst_rank].address;
      if (kv_.Connected(address)) continue;
      auto it = connecting_.find(address);
      if (it == connecting_.end()) {
        connecting_.emplace(address, std::async(std::launch::async, [this, address, deadline] {
                              return kv_.Peer(address, deadline);
                            }));
        if (reached.ok()) reached = false;
        continue;
      }
      if (it->second.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
        if (reached.ok()) reached = false;
        continue;
      }
      absl::StatusOr<kvtransfer::PeerId> peer = it->second.get();
      connecting_.erase(it);
      if (!peer.ok() && reached.ok()) {
        reached = absl::Status(
            peer.status().code(),
            absl::StrCat("decode rank ", run.dst_rank, ": ", peer.status().message()));
      }
    }
  }

  void AddFailure(tandem::v1::KvPushReport& report, const std::string& id,
                  const absl::Status& failure) const {
    tandem::v1::KvPushReport::Failure* f = report.add_failures();
    f->set_request_id(id);
    f->set_code(static_cast<int>(failure.code()));
    std::string message = absl::StrCat("tensor-parallel rank ", rank_, ": ", failure.message());
    if (message.size() > kMaxFailureMessage) message.resize(kMaxFailureMessage);
    f->set_message(std::move(message));
  }

  void Failed(Request& request, Destination& dst, const absl::Status& status) {
    if (status.code() == absl::StatusCode::kUnavailable ||
        status.code() == absl::StatusCode::kNotFound) {
      kv_.DropPeer(dst.address, dst.peer);
    }
    request.failure = status;
  }

  KvEndpoint& kv_;
  const int rank_;
  const std::vector<engine::KvCacheLayout> group_;
  std::map<std::string, Request> requests_;
  std::vector<tandem::v1::KvPushOrders::Write> writes_;
  absl::Status failure_all_;
  // Connect-only orders: each destination's state (true: every rank this one sends to is
  // connected; false: still connecting), until End reports it.
  std::map<std::string, absl::StatusOr<bool>> reached_;
  // Background connects by address; a finished one stays until orders ask about it again.
  std::map<std::string, std::future<absl::StatusOr<kvtransfer::PeerId>>> connecting_;
};

}  // namespace

absl::StatusOr<std::vector<tandem::v1::TransferEndpoint>> GatherRankEndpoints(
    collective::Communicator& comm, const tandem::v1::TransferEndpoint& mine) {
  const std::string bytes = mine.SerializeAsString();
  if (bytes.size() > kEndpointSlot) {
    return absl::InternalError(absl::StrCat("a KV endpoint of ", bytes.size(),
                                            " bytes does not fit the group's exchange"));
  }
  TANDEM_ASSIGN_OR_RETURN(std::vector<std::string> all, comm.AllGatherBytes(bytes, kEndpointSlot));
  std::vector<tandem::v1::TransferEndpoint> ranks(all.size());
  for (size_t r = 0; r < all.size(); ++r) {
    if (!ranks[r].ParseFromString(all[r])) {
      return absl::InternalError(absl::StrCat("rank ", r, " sent a malformed KV endpoint"));
    }
    ranks[r].clear_tp_ranks();
  }
  return ranks;
}

absl::StatusOr<engine::KvCacheLayout> CacheLayoutOf(const tandem::v1::KvLayout& layout,
                                                    int num_blocks) {
  DType dtype;
  switch (layout.dtype()) {
    case tandem::v1::KV_DTYPE_F32:
      dtype = DType::kF32;
      break;
    case tandem::v1::KV_DTYPE_F16:
      dtype = DType::kF16;
      break;
    case tandem::v1::KV_DTYPE_BF16:
      dtype = DType::kBF16;
      break;
    case tandem::v1::KV_DTYPE_FP8_E4M3:
      dtype = DType::kF8E4M3;
      break;
    case tandem::v1::KV_DTYPE_FP8_E5M2:
      dtype = DType::kF8E5M2;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("KV dtype ", static_cast<int>(layout.dtype()),
                       " is not one this build holds"));
  }
  return engine::KvCacheLayout{.num_layers = layout.num_layers(),
                               .num_blocks = num_blocks,
                               .block_size = layout.block_size(),
                               .num_kv_heads = layout.num_kv_heads(),
                               .head_dim = layout.head_dim(),
                               .dtype = dtype,
                               .kv_head_begin = layout.kv_head_begin(),
                               .tp_size = layout.tp_size()};
}

std::vector<const tandem::v1::TransferEndpoint*> RankEndpoints(
    const tandem::v1::TransferEndpoint& endpoint) {
  std::vector<const tandem::v1::TransferEndpoint*> ranks;
  if (endpoint.tp_ranks_size() == 0) {
    ranks.push_back(&endpoint);
  } else {
    for (const tandem::v1::TransferEndpoint& rank : endpoint.tp_ranks()) ranks.push_back(&rank);
  }
  return ranks;
}

absl::StatusOr<std::vector<engine::KvCacheLayout>> RankLayouts(
    std::span<const tandem::v1::TransferEndpoint* const> ranks) {
  std::vector<engine::KvCacheLayout> layouts;
  for (const tandem::v1::TransferEndpoint* rank : ranks) {
    TANDEM_ASSIGN_OR_RETURN(engine::KvCacheLayout layout,
                            CacheLayoutOf(rank->layout(), rank->num_blocks()));
    layouts.push_back(layout);
  }
  return layouts;
}

absl::StatusOr<std::vector<engine::KvCacheLayout>> RankLayouts(
    const std::vector<tandem::v1::TransferEndpoint>& ranks) {
  std::vector<const tandem::v1::TransferEndpoint*> pointers;
  for (const tandem::v1::TransferEndpoint& rank : ranks) pointers.push_back(&rank);
  return RankLayouts(pointers);
}

void AppendTokenRanges(const engine::KvCacheLayout& from, const engine::KvCacheLayout& to,
                       const engine::KvHeadRun& run, int layer, int dst_layer, int begin, int end,
                       int first_block, std::span<const int32_t> src_blocks,
                       std::span<const int32_t> dst_blocks, std::vector<kvtransfer::Range>& out) {
  const int bs = from.block_size;
  std::vector<engine::KvCopyRange> ranges;
  for (int half = 0; half < 2; ++half) {
    for (int t = begin; t < end;) {
      const int logical = t / bs;
      const int slot = t % bs;
      const int count = std::min(end, (logical + 1) * bs) - t;
      const int i = logical - first_block;
      if (i < 0 || i >= static_cast<int>(src_blocks.size()) ||
          i >= static_cast<int>(dst_blocks.size())) {
        break;
      }
      engine::AppendKvRunRanges(from, to, run, layer, dst_layer, half, src_blocks[i],
                                dst_blocks[i], slot, count, ranges);
      t += count;
    }
  }
  for (const engine::KvCopyRange& r : ranges) out.push_back({r.src_offset, r.dst_offset, r.bytes});
}

uint64_t RunBytes(const engine::KvCacheLayout& from, const engine::KvHeadRun& run, int tokens) {
  return 2 * static_cast<uint64_t>(tokens) * static_cast<uint64_t>(run.head_end - run.head_begin) *
         static_cast<uint64_t>(from.head_dim) * from.element_bytes();
}

absl::Status RunKvFollower(const engine::EngineOptions& options, const KvEndpoint::Options& kv) {
  collective::Communicator* comm = options.tensor_parallel;
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<engine::TensorParallelFollower> follower,
                          engine::TensorParallelFollower::Create(options));
  engine::ModelRunner& runner = follower->runner();
  if (!runner.kv_cache_on_host() && kv.backend != "cuda_ipc" && kv.backend != "nccl") {
    return absl::FailedPreconditionError(absl::StrCat(
        "the KV cache is in device memory; --kv-backend ", kv.backend, " sends host memory only"));
  }
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<KvEndpoint> endpoint,
                          KvEndpoint::Create(kv, runner.config(), runner.cache_layout(),
                                             comm->rank(), runner.kv_cache()));
  TANDEM_ASSIGN_OR_RETURN(std::vector<tandem::v1::TransferEndpoint> ranks,
                          GatherRankEndpoints(*comm, endpoint->Describe()));
  TANDEM_ASSIGN_OR_RETURN(std::vector<engine::KvCacheLayout> group, RankLayouts(ranks));
  KvPushFollower pushes(*endpoint, comm->rank(), std::move(group));
  runner.set_layer_written_hook([&pushes](int layer) { pushes.LayerWritten(layer); });
  runner.set_follower_step_hooks(
      {.begin = [&pushes](std::string_view attachment) { pushes.Begin(attachment); },
       .end = [&pushes] { return pushes.End(); }});
  absl::Status status = follower->Run();
  pushes.WaitForConnects();
  endpoint->Close();  // waits until no transfer reads the cache, before the runner frees it
  return status;
}

}  // namespace tandem::worker

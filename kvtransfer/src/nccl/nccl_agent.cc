#include "kvtransfer/src/nccl/nccl_agent.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <limits>
#include <list>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kvtransfer/src/internal.h"
#include "kvtransfer/src/nccl/control.h"
#include "kvtransfer/src/socket_io.h"
#include "tandem/base/status_macros.h"

namespace tandem::kvtransfer::nccl {
namespace {

using internal::BackendKind;
using internal::ReadFully;
using internal::RegionDescriptor;
using internal::TransferState;
using internal::UniqueFd;
using internal::WriteFully;

// How long a listener waits for a connector's hello and link id.
constexpr absl::Duration kHandshakeTimeout = absl::Seconds(10);
// How often a connection's thread looks at its link while operations are in flight.
constexpr absl::Duration kPollInterval = absl::Microseconds(50);

// One transfer this agent pushes.
struct Outgoing {
  uint64_t seq = 0;
  uint64_t pin = 0;
  std::vector<Span> sources;
  std::string header;                    // the kTransfer frame
  std::shared_ptr<TransferState> state;  // its deadline is the transfer's
  uint64_t ticket = 0;
  bool sent = false;         // our sends have completed
  bool remote_done = false;  // the receiver's receives have completed
};

// One transfer this agent receives.
struct Incoming {
  uint64_t seq = 0;
  uint64_t pin = 0;
  uint64_t ticket = 0;
};

// A region held by a transfer, with the transfer's deadline (for DeregisterMemory).
struct Pin {
  uint64_t region_id = 0;
  absl::Time deadline;
};

// One control connection with its link: made by Connect (this agent sends) or accepted from a
// peer (this agent receives). Its thread owns the socket and the link.
struct Connection {
  Connection() : wake(eventfd(0, EFD_CLOEXEC)) {}

  void Wake() const {
    const uint64_t one = 1;
    (void)!write(wake.get(), &one, sizeof(one));
  }

  // Asks the connection's thread to end it with `status` (the first reason asked wins), also
  // while it is still joining its link. Under the agent's mutex.
  void Kill(absl::Status status) {
    if (!kill) kill = std::move(status);
    cancel_join = true;
    Wake();
  }

  std::string peer_address;
  uint64_t peer_instance = 0;
  UniqueFd fd;
  UniqueFd wake;
  std::unique_ptr<PairLink> link;
  std::thread thread;
  std::atomic<bool> cancel_join{false};
  std::atomic<bool> done{false};  // the thread has returned from everything that locks

  // Under the agent's mutex.
  std::deque<std::shared_ptr<Outgoing>> queued;  // submitted; header not sent yet
  std::optional<absl::Status> kill;              // the thread ends the connection with this
  std::optional<absl::Status> ended;             // why it ended; Submit refuses with it
  std::map<uint64_t, Pin> pins;
  uint64_t last_seq = 0;
};

class NcclAgent : public Agent {
 public:
  NcclAgent(const AgentOptions& options, std::unique_ptr<PairLinkFactory> links, UniqueFd listener,
            int port, uint64_t instance)
      : links_(std::move(links)),
        instance_(instance),
        name_(options.name),
        address_(absl::StrFormat(
            "nccl:%s@%s%s%s:%d#%016x", options.name,
            options.listen_host.find(':') != std::string::npos ? "[" : "", options.listen_host,
            options.listen_host.find(':') != std::string::npos ? "]" : "", port, instance)),
        listener_(std::move(listener)),
        wake_(eventfd(0, EFD_CLOEXEC)) {
    accept_thread_ = std::thread([this] { AcceptLoop(); });
  }

  ~NcclAgent() override {
    const uint64_t one = 1;
    (void)!write(wake_.get(), &one, sizeof(one));
    accept_thread_.join();
    std::vector<std::shared_ptr<Connection>> all;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [id, c] : peers_) all.push_back(c);
      for (auto& c : served_) all.push_back(c);
      for (auto& c : connecting_) c->cancel_join = true;
      for (auto& c : all) c->Kill(absl::CancelledError("the agent was destroyed"));
    }
    for (auto& c : all) {
      if (c->thread.joinable()) c->thread.join();
    }
  }

  absl::StatusOr<std::string> RegisterMemory(uint64_t region_id, void* base,
                                             size_t bytes) override {
    if (base == nullptr || bytes == 0) {
      return absl::InvalidArgumentError("RegisterMemory: a region needs a base and a size");
    }
    TANDEM_RETURN_IF_ERROR(links_->CheckMemory(base, bytes));
    std::lock_guard<std::mutex> lock(mu_);
    if (regions_.count(region_id) != 0) {
      return absl::AlreadyExistsError(absl::StrCat("region ", region_id, " is registered"));
    }
    Region& region = regions_[region_id];
    region.base = static_cast<char*>(base);
    region.bytes = bytes;
    region.generation = ++last_generation_;
    return internal::EncodeDescriptor(RegionDescriptor{.backend = BackendKind::kNccl,
                                                       .owner_instance = instance_,
                                                       .region_id = region_id,
                                                       .generation = region.generation,
                                                       .base = reinterpret_cast<uintptr_t>(base),
                                                       .bytes = bytes,
                                                       .payload = ""});
  }

  // Waits for the transfers that hold the region; one past its deadline has its connection
  // closed (its peer is then Unavailable until connected again).
  absl::Status DeregisterMemory(uint64_t region_id) override {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = regions_.find(region_id);
    if (it == regions_.end() || it->second.closing) {
      return absl::NotFoundError(absl::StrCat("region ", region_id, " is not registered"));
    }
    it->second.closing = true;
    while (it->second.pins > 0) {
      const absl::Time now = absl::Now();
      ForEachConnection([&](Connection& c) {
        for (const auto& [id, pin] : c.pins) {
          if (pin.region_id == region_id && pin.deadline < now && !c.kill) {
            c.Kill(absl::UnavailableError(absl::StrCat(
                "connection to ", c.peer_address, " closed: a transfer on region ", region_id,
                " outlived its deadline while the region was deregistered")));
          }
        }
      });
      cv_.wait_for(lock, std::chrono::milliseconds(10));
    }
    regions_.erase(it);
    return absl::OkStatus();
  }

  std::string address() const override { return address_; }

  absl::StatusOr<PeerId> Connect(const std::string& peer_address, absl::Time deadline) override {
    TANDEM_ASSIGN_OR_RETURN(ParsedAddress to, ParseAddress(peer_address));
    const auto failed = [&](const absl::Status& s) {
      return absl::Status(s.code(), absl::StrCat("connect to ", peer_address, ": ", s.message()));
    };
    if (absl::Now() >= deadline) return failed(absl::DeadlineExceededError("deadline passed"));
    auto c = std::make_shared<Connection>();  // this agent sends on it
    c->peer_address = peer_address;
    c->peer_instance = to.instance;
    absl::StatusOr<UniqueFd> fd = Dial(to, deadline);
    if (!fd.ok()) return failed(fd.status());
    c->fd = std::move(*fd);
    if (absl::Status s = WriteFully(c->fd.get(), Hello(to.instance, instance_), "handshake");
        !s.ok()) {
      return failed(s);
    }
    char reply[kHelloBytes];
    if (absl::Status s = ReadFully(c->fd.get(), reply, kHelloBytes, deadline, "handshake");
        !s.ok()) {
      return failed(s);
    }
    uint64_t words[3];
    std::memcpy(words, reply, sizeof(words));
    if (words[0] != kHelloMagic || words[1] != to.instance) {
      return failed(absl::UnavailableError("another agent incarnation answered"));
    }
    TANDEM_ASSIGN_OR_RETURN(std::string id, links_->NewLinkId());
    std::string body;
    PutU64(&body, MillisecondsLeft(deadline));
    body += id;
    if (absl::Status s = WriteFully(c->fd.get(), EncodeFrame(kLinkId, body), "handshake");
        !s.ok()) {
      return failed(s);
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      connecting_.push_back(c);  // so that destruction cancels the join
    }
    absl::StatusOr<std::unique_ptr<PairLink>> link = links_->Join(id, 0, deadline, c->cancel_join);
    {
      std::lock_guard<std::mutex> lock(mu_);
      connecting_.remove(c);
    }
    if (!link.ok()) {
      // The listener's reason (for example NCCL refusing two ranks on one GPU) is the same or
      // clearer; it comes as kJoinFailed unless the listener is gone.
      uint32_t type = 0;
      std::string why;
      if (ReadFrame(c->fd.get(), absl::Now() + absl::Milliseconds(200), &type, &why).ok() &&
          type == kJoinFailed) {
        return failed(absl::UnavailableError(
            absl::StrCat(link.status().message(), " (the peer: ", why, ")")));
      }
      return failed(link.status());
    }
    c->link = std::move(*link);
    uint32_t type = 0;
    std::string why;
    if (absl::Status s = ReadFrame(c->fd.get(), deadline, &type, &why); !s.ok()) {
      return failed(s);
    }
    if (type != kJoined) {
      return failed(absl::UnavailableError(
          type == kJoinFailed ? why : absl::StrCat("unexpected frame ", type, " in handshake")));
    }
    std::lock_guard<std::mutex> lock(mu_);
    const PeerId peer = ++last_peer_;
    peers_[peer] = c;
    c->thread = std::thread([this, c] { RunSender(*c); });
    return peer;
  }

  absl::Status Disconnect(PeerId peer) override {
    std::shared_ptr<Connection> gone;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = peers_.find(peer);
      if (it == peers_.end()) return absl::NotFoundError(absl::StrCat("no peer ", peer));
      gone = std::move(it->second);
      peers_.erase(it);
      gone->Kill(absl::CancelledError("the peer was disconnected"));
    }
    gone->thread.join();
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<TransferHandle>> Submit(PeerId peer, uint64_t local_region_id,
                                                         const std::string& remote_descriptor,
                                                         std::vector<Range> ranges,
                                                         absl::Time deadline) override {
    TANDEM_ASSIGN_OR_RETURN(RegionDescriptor d,
                            internal::DecodeDescriptor(remote_descriptor, BackendKind::kNccl));
    std::lock_guard<std::mutex> lock(mu_);
    auto p = peers_.find(peer);
    if (p == peers_.end()) return absl::NotFoundError(absl::StrCat("no peer ", peer));
    Connection& c = *p->second;
    if (c.ended) {
      return absl::UnavailableError(
          absl::StrCat("peer ", c.peer_address, " is gone: ", c.ended->message()));
    }
    if (d.owner_instance != c.peer_instance) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "descriptor belongs to agent %016x, not to peer %s", d.owner_instance, c.peer_address));
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError("Submit: the deadline has already passed");
    }
    auto r = regions_.find(local_region_id);
    if (r == regions_.end() || r->second.closing) {
      return absl::NotFoundError(
          absl::StrCat("local region ", local_region_id, " is not registered"));
    }
    Region& region = r->second;
    TANDEM_RETURN_IF_ERROR(internal::CheckRanges(ranges, region.bytes, d.bytes));
    const std::vector<Range> coalesced = internal::CoalesceRanges(ranges);
    if (coalesced.empty()) return internal::FinishedHandle(absl::OkStatus());

    auto o = std::make_shared<Outgoing>();
    o->seq = ++c.last_seq;
    o->state = std::make_shared<TransferState>(deadline);
    std::string body;
    PutU64(&body, o->seq);
    PutU64(&body, d.region_id);
    PutU64(&body, d.generation);
    PutU64(&body, MillisecondsLeft(deadline));
    PutU32(&body, static_cast<uint32_t>(coalesced.size()));
    for (const Range& range : coalesced) {
      PutU64(&body, range.dst_offset);
      PutU64(&body, range.bytes);
      o->sources.push_back({region.base + range.src_offset, range.bytes});
    }
    if (body.size() > kMaxFrameBytes) {
      return absl::InvalidArgumentError(absl::StrCat("Submit: ", coalesced.size(),
                                                     " separate ranges are too many for one "
                                                     "transfer; split it"));
    }
    o->header = EncodeFrame(kTransfer, body);
    o->pin = PinLocked(c, local_region_id, deadline);
    c.queued.push_back(o);
    c.Wake();
    return std::make_unique<internal::StateHandle>(o->state);
  }

 private:
  struct Region {
    char* base = nullptr;
    uint64_t bytes = 0;
    uint64_t generation = 0;
    int pins = 0;  // transfers that may still read or write it
    bool closing = false;
  };

  template <typename Fn>
  void ForEachConnection(Fn fn) {
    for (auto& [id, c] : peers_) fn(*c);
    for (auto& c : served_) fn(*c);
  }

  uint64_t PinLocked(Connection& c, uint64_t region_id, absl::Time deadline) {
    ++regions_.at(region_id).pins;
    const uint64_t id = ++last_pin_;
    c.pins[id] = {region_id, deadline};
    return id;
  }

  void Unpin(Connection& c, uint64_t pin) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = c.pins.find(pin);
      if (it == c.pins.end()) return;
      --regions_.at(it->second.region_id).pins;
      c.pins.erase(it);
    }
    cv_.notify_all();
  }

  // Waits until the socket has bytes or hangs up, the connection is woken, or `timeout`
  // (infinite if nullopt) passes.
  static void WaitForWork(const Connection& c, std::optional<absl::Duration> timeout) {
    pollfd fds[2] = {{c.fd.get(), POLLIN, 0}, {c.wake.get(), POLLIN, 0}};
    timespec ts = absl::ToTimespec(timeout.value_or(absl::ZeroDuration()));
    ppoll(fds, 2, timeout ? &ts : nullptr, nullptr);
    if (fds[1].revents & POLLIN) {
      uint64_t count = 0;
      (void)!read(c.wake.get(), &count, sizeof(count));
    }
  }

  // Appends what the socket has to `buffer`; Unavailable once the peer has closed it.
  static absl::Status Drain(const Connection& c, std::string* buffer) {
    char chunk[64 * 1024];
    for (;;) {
      const ssize_t n = recv(c.fd.get(), chunk, sizeof(chunk), MSG_DONTWAIT);
      if (n > 0) {
        buffer->append(chunk, static_cast<size_t>(n));
        continue;
      }
      if (n == 0) return absl::UnavailableError(absl::StrCat("peer ", c.peer_address, " is gone"));
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return absl::OkStatus();
      return absl::UnavailableError(
          absl::StrCat("peer ", c.peer_address, " is gone: ", std::strerror(errno)));
    }
  }

  // Hands each whole frame in `buffer` to `handle(type, body)`, until the buffer holds no whole
  // frame (OK) or `handle` or a malformed frame returns an error (returned).
  template <typename Handle>
  static absl::Status HandleFrames(std::string* buffer, Handle handle) {
    for (;;) {
      TANDEM_ASSIGN_OR_RETURN(auto frame, TakeFrame(buffer));
      if (!frame.has_value()) return absl::OkStatus();
      TANDEM_RETURN_IF_ERROR(handle(frame->first, frame->second));
    }
  }

  // The kill status if another thread asked this connection to end.
  std::optional<absl::Status> Killed(const Connection& c) {
    std::lock_guard<std::mutex> lock(mu_);
    return c.kill;
  }

  // Ends a connection on its own thread: stops the link's operations, fails every transfer on
  // it with `status`, releases their regions and closes the socket (the peer sees a hang-up).
  void End(Connection& c, const absl::Status& status, std::deque<std::shared_ptr<Outgoing>>* out,
           std::deque<Incoming>* in) {
    if (c.link != nullptr) c.link->Abort();
    std::deque<std::shared_ptr<Outgoing>> queued;
    {
      std::lock_guard<std::mutex> lock(mu_);
      c.ended = status;
      queued.swap(c.queued);
    }
    if (out != nullptr) {
      for (auto& o : queued) out->push_back(o);
      for (auto& o : *out) {
        o->state->Finish(status);
        Unpin(c, o->pin);
      }
    }
    if (in != nullptr) {
      for (const Incoming& i : *in) Unpin(c, i.pin);
    }
    c.fd.Reset();
  }

  // The connecting side: sends headers in submission order, posts the sends of each accepted
  // transfer, finishes transfers when both ends are done.
  void RunSender(Connection& c) {
    std::deque<std::shared_ptr<Outgoing>> awaiting;  // header sent, no answer yet
    std::deque<std::shared_ptr<Outgoing>> posted;    // sends queued on the link
    std::deque<std::shared_ptr<Outgoing>> all;       // for End
    std::string buffer;
    const auto finish = [&](const std::shared_ptr<Outgoing>& o, absl::Status status) {
      o->state->Finish(std::move(status));
      Unpin(c, o->pin);
    };
    absl::Status ending;
    for (;;) {
      if (std::optional<absl::Status> killed = Killed(c)) {
        ending = *killed;
        break;
      }
      std::deque<std::shared_ptr<Outgoing>> fresh;
      {
        std::lock_guard<std::mutex> lock(mu_);
        fresh.swap(c.queued);
      }
      for (auto& o : fresh) {
        if (!ending.ok()) {
          awaiting.push_back(o);  // failed by End with the others
        } else if (absl::Now() >= o->state->deadline()) {
          // Never announced, so nothing to match: drop it here.
          finish(o, absl::DeadlineExceededError("the deadline passed before the transfer began"));
        } else {
          awaiting.push_back(o);
          if (!WriteFully(c.fd.get(), o->header, "transfer header").ok()) {
            ending = absl::UnavailableError(absl::StrCat("peer ", c.peer_address, " is gone"));
          }
        }
      }
      if (!ending.ok()) break;
      const bool busy = !awaiting.empty() || !posted.empty();
      WaitForWork(c, busy ? std::optional(kPollInterval) : std::nullopt);
      absl::Status read = Drain(c, &buffer);
      // Frames that arrived before a hang-up still count.
      ending = HandleFrames(&buffer, [&](uint32_t type, const std::string& body) -> absl::Status {
        BodyReader reader(body);
        uint64_t seq = 0;
        if (!reader.U64(&seq)) {
          return absl::InternalError("malformed control frame from the receiver");
        }
        if (type == kDone) {
          for (auto& o : posted) {
            if (o->seq == seq) o->remote_done = true;
          }
          return absl::OkStatus();
        }
        if (type == kFailed) {
          return absl::UnavailableError(
              absl::StrCat("peer ", c.peer_address, " failed the transfer: ", reader.Rest()));
        }
        if (type != kAccept && type != kRefuse) {
          return absl::InternalError(absl::StrCat("unexpected control frame ", type));
        }
        if (awaiting.empty() || awaiting.front()->seq != seq) {
          return absl::InternalError("the receiver answered a transfer out of order");
        }
        std::shared_ptr<Outgoing> o = awaiting.front();
        awaiting.pop_front();
        if (type == kRefuse) {
          uint32_t code = 0;
          reader.U32(&code);
          const absl::StatusCode status_code =
              code == static_cast<uint32_t>(absl::StatusCode::kNotFound)
                  ? absl::StatusCode::kNotFound
                  : absl::StatusCode::kInvalidArgument;
          finish(o, absl::Status(status_code, absl::StrCat("the receiver refused the transfer: ",
                                                           reader.Rest())));
          return absl::OkStatus();
        }
        absl::StatusOr<uint64_t> ticket = c.link->Post(/*send=*/true, o->sources);
        posted.push_back(o);
        if (!ticket.ok()) {
          return absl::UnavailableError(
              absl::StrCat("link to ", c.peer_address, ": ", ticket.status().message()));
        }
        o->ticket = *ticket;
        return absl::OkStatus();
      });
      if (!ending.ok()) break;
      for (auto it = posted.begin(); it != posted.end();) {
        std::shared_ptr<Outgoing>& o = *it;
        if (!o->sent) {
          std::optional<absl::Status> done = c.link->Poll(o->ticket);
          if (!done.has_value()) break;  // later batches are not done either
          if (!done->ok()) {
            ending = absl::UnavailableError(
                absl::StrCat("link to ", c.peer_address, ": ", done->message()));
            break;
          }
          o->sent = true;
        }
        if (!o->remote_done) {
          ++it;
          continue;
        }
        finish(o, absl::OkStatus());
        it = posted.erase(it);
      }
      if (!ending.ok()) break;
      if (!read.ok()) {
        ending = read;
        break;
      }
    }
    for (auto& o : awaiting) all.push_back(o);
    for (auto& o : posted) all.push_back(o);
    End(c, ending, &all, nullptr);
    c.done = true;
  }

  // The accepting side: answers the handshake, joins the link, then checks each announced
  // transfer against its region as registered now and posts its receives.
  void RunReceiver(Connection& c) {
    std::deque<Incoming> receiving;
    absl::Status ending = Handshake(c);
    std::string buffer;
    const auto send = [&](Frame type, const std::string& body) -> absl::Status {
      if (!WriteFully(c.fd.get(), EncodeFrame(type, body), "control").ok()) {
        return absl::UnavailableError(absl::StrCat("peer ", c.peer_address, " is gone"));
      }
      return absl::OkStatus();
    };
    while (ending.ok()) {
      if (std::optional<absl::Status> killed = Killed(c)) {
        ending = *killed;
        break;
      }
      WaitForWork(c, receiving.empty() ? std::nullopt : std::optional(kPollInterval));
      absl::Status read = Drain(c, &buffer);
      ending = HandleFrames(&buffer, [&](uint32_t type, const std::string& body) -> absl::Status {
        if (type != kTransfer) {
          return absl::InternalError(absl::StrCat("unexpected control frame ", type));
        }
        BodyReader reader(body);
        uint64_t seq = 0;
        if (!reader.U64(&seq)) return absl::InternalError("malformed transfer header");
        absl::StatusOr<std::pair<Incoming, std::vector<Span>>> accepted = Accept(c, seq, reader);
        if (!accepted.ok() && accepted.status().code() == absl::StatusCode::kInternal) {
          return accepted.status();
        }
        std::string answer;
        PutU64(&answer, seq);
        if (!accepted.ok()) {
          PutU32(&answer, static_cast<uint32_t>(accepted.status().code()));
          absl::StrAppend(&answer, accepted.status().message());
          return send(kRefuse, answer);
        }
        receiving.push_back(accepted->first);
        TANDEM_RETURN_IF_ERROR(send(kAccept, answer));
        absl::StatusOr<uint64_t> ticket = c.link->Post(/*send=*/false, accepted->second);
        if (!ticket.ok()) {
          (void)send(kFailed, absl::StrCat(answer, ticket.status().message()));
          return absl::UnavailableError(ticket.status().message());
        }
        receiving.back().ticket = *ticket;
        return absl::OkStatus();
      });
      while (ending.ok() && !receiving.empty()) {
        std::optional<absl::Status> done = c.link->Poll(receiving.front().ticket);
        if (!done.has_value()) break;
        std::string answer;
        PutU64(&answer, receiving.front().seq);
        if (!done->ok()) {
          (void)send(kFailed, absl::StrCat(answer, done->message()));
          ending = absl::UnavailableError(done->message());
          break;
        }
        ending = send(kDone, answer);
        if (!ending.ok()) break;
        Unpin(c, receiving.front().pin);
        receiving.pop_front();
      }
      if (ending.ok() && !read.ok()) ending = read;
    }
    End(c, ending, nullptr, &receiving);
    c.done = true;
  }

  // The listener's half of the handshake, on the connection's thread.
  absl::Status Handshake(Connection& c) {
    const absl::Time hello_deadline = absl::Now() + kHandshakeTimeout;
    char hello[kHelloBytes];
    TANDEM_RETURN_IF_ERROR(ReadFully(c.fd.get(), hello, kHelloBytes, hello_deadline, "handshake"));
    uint64_t words[3];
    std::memcpy(words, hello, sizeof(words));
    TANDEM_RETURN_IF_ERROR(WriteFully(c.fd.get(), Hello(instance_, 0), "handshake"));
    if (words[0] != kHelloMagic || words[1] != instance_) {
      return absl::UnavailableError("a connector looked for another agent incarnation");
    }
    {
      std::lock_guard<std::mutex> lock(mu_);  // DeregisterMemory names it in its message
      c.peer_address = absl::StrFormat("agent %016x", words[2]);
    }
    uint32_t type = 0;
    std::string body;
    TANDEM_RETURN_IF_ERROR(ReadFrame(c.fd.get(), hello_deadline, &type, &body));
    BodyReader reader(body);
    uint64_t ms = 0;
    if (type != kLinkId || !reader.U64(&ms)) {
      return absl::UnavailableError("malformed handshake from a connector");
    }
    absl::StatusOr<std::unique_ptr<PairLink>> link =
        links_->Join(reader.Rest(), 1, DeadlineIn(ms), c.cancel_join);
    if (!link.ok()) {
      (void)WriteFully(c.fd.get(), EncodeFrame(kJoinFailed, std::string(link.status().message())),
                       "handshake");
      return link.status();
    }
    c.link = std::move(*link);
    return WriteFully(c.fd.get(), EncodeFrame(kJoined, ""), "handshake");
  }

  // Checks announced transfer `seq` (the rest of its header in `reader`) against the region as
  // registered now and pins it. NotFound or InvalidArgument refuse this transfer; Internal (a
  // malformed frame) ends the connection.
  absl::StatusOr<std::pair<Incoming, std::vector<Span>>> Accept(Connection& c, uint64_t seq,
                                                                BodyReader& reader) {
    uint64_t region_id = 0, generation = 0, ms = 0;
    uint32_t n = 0;
    if (!reader.U64(&region_id) || !reader.U64(&generation) || !reader.U64(&ms) ||
        !reader.U32(&n)) {
      return absl::InternalError("malformed transfer header");
    }
    std::vector<Range> ranges(n);
    for (Range& r : ranges) {
      if (!reader.U64(&r.dst_offset) || !reader.U64(&r.bytes)) {
        return absl::InternalError("malformed transfer header");
      }
    }
    if (!reader.empty()) return absl::InternalError("malformed transfer header");
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regions_.find(region_id);
    if (it == regions_.end() || it->second.closing) {
      return absl::NotFoundError(
          absl::StrCat("region ", region_id, " of ", name_, " is not registered"));
    }
    if (it->second.generation != generation) {
      return absl::InvalidArgumentError(
          absl::StrCat("the descriptor of region ", region_id, " of ", name_,
                       " is stale: the region was registered again since"));
    }
    TANDEM_RETURN_IF_ERROR(
        internal::CheckRanges(ranges, std::numeric_limits<uint64_t>::max(), it->second.bytes));
    std::vector<Span> spans;
    spans.reserve(ranges.size());
    for (const Range& r : ranges) spans.push_back({it->second.base + r.dst_offset, r.bytes});
    Incoming in{.seq = seq, .pin = PinLocked(c, region_id, DeadlineIn(ms))};
    return std::pair{in, std::move(spans)};
  }

  // Accepts connections; each gets a thread of its own for the handshake and its transfers.
  void AcceptLoop() {
    for (;;) {
      pollfd fds[2] = {{listener_.get(), POLLIN, 0}, {wake_.get(), POLLIN, 0}};
      if (poll(fds, 2, -1) < 0 && errno != EINTR) return;
      if (fds[1].revents != 0) return;  // destruction
      if ((fds[0].revents & POLLIN) == 0) continue;
      UniqueFd fd(accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
      if (fd.get() < 0) continue;
      TuneSocket(fd.get());
      auto c = std::make_shared<Connection>();  // this agent receives on it
      c->peer_address = "a connecting agent";
      c->fd = std::move(fd);
      std::lock_guard<std::mutex> lock(mu_);
      // Connections that have ended are dropped here (their threads are done with them).
      for (auto it = served_.begin(); it != served_.end();) {
        if ((*it)->done) {
          (*it)->thread.join();
          it = served_.erase(it);
        } else {
          ++it;
        }
      }
      served_.push_back(c);
      c->thread = std::thread([this, c] { RunReceiver(*c); });
    }
  }

  const std::unique_ptr<PairLinkFactory> links_;
  const uint64_t instance_;
  const std::string name_;
  const std::string address_;
  UniqueFd listener_;
  UniqueFd wake_;  // written once: stops AcceptLoop

  std::mutex mu_;
  std::condition_variable cv_;  // a pin was released
  uint64_t last_generation_ = 0;
  uint64_t last_pin_ = 0;
  std::map<uint64_t, Region> regions_;
  PeerId last_peer_ = 0;
  std::map<PeerId, std::shared_ptr<Connection>> peers_;
  std::list<std::shared_ptr<Connection>> connecting_;
  std::list<std::shared_ptr<Connection>> served_;

  std::thread accept_thread_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Agent>> CreateNcclAgentWith(const AgentOptions& options,
                                                           std::unique_ptr<PairLinkFactory> links) {
  if (options.listen_port < 0 || options.listen_port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("listen_port ", options.listen_port));
  }
  TANDEM_ASSIGN_OR_RETURN(auto listener, Listen(options.listen_host, options.listen_port));
  auto& [fd, port] = listener;
  return std::make_unique<NcclAgent>(options, std::move(links), std::move(fd), port,
                                     internal::NewInstanceId());
}

absl::StatusOr<std::unique_ptr<Agent>> CreateNcclAgent(const AgentOptions& options) {
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<PairLinkFactory> links, NewNcclLinkFactory());
  return CreateNcclAgentWith(options, std::move(links));
}

}  // namespace tandem::kvtransfer::nccl

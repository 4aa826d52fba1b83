#include "tandem/http/http_server.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdio>
#include <deque>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "boost/asio.hpp"
#include "boost/beast/core.hpp"
#include "boost/beast/http.hpp"

namespace tandem::http {
namespace {

namespace beast = boost::beast;
namespace bhttp = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;

// Bytes read from a client while its response is being produced (pipelined requests) are kept
// for the next request up to this much; past it the connection stops reading until then.
constexpr size_t kMaxPipelinedBytes = 64 << 10;
// After a refusal the rest of the client's upload is read and dropped for a moment, so the
// client sees the response instead of a reset.
constexpr size_t kMaxDrainBytes = 8 << 20;
constexpr std::chrono::milliseconds kDrainTime{1000};

std::string ReasonPhrase(int status) {
  if (status == 529) return "Site Overloaded";
  beast::string_view reason = bhttp::obsolete_reason(bhttp::int_to_status(status));
  if (reason.empty() || reason.front() == '<') return "Unknown";
  return std::string(reason);
}

std::string Lower(beast::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// Shared by the acceptor and every session; outlives them (owned by HttpServerImpl, whose
// Stop() ends all I/O before it goes away).
struct ServerState {
  HttpServerOptions options;
  HttpHandler handler;
  std::atomic<int> connections{0};
  std::atomic<int> responses_in_flight{0};  // requests read whose response is not fully written
  // Once set, no connection runs any more work. Stop() sets it, then waits for `runners` (the
  // threads inside a connection's work, I/O threads or callers of RunHere) to reach zero.
  std::atomic<bool> stopped{false};
  std::atomic<int> runners{0};

  HttpResponse Error(int status, const std::string& message) const {
    if (options.error_response) return options.error_response(status, message);
    return HttpResponse{status, "text/plain", message + "\n", {}};
  }
};

class Session;

class Exchange : public HttpExchange {
 public:
  Exchange(std::shared_ptr<Session> session, uint64_t id, HttpRequest request)
      : session_(std::move(session)), id_(id), request_(std::move(request)) {}
  const HttpRequest& request() const override { return request_; }
  void Reply(HttpResponse response) override;
  void BeginStream(int status, const std::string& content_type, HttpHeaders headers) override;
  void Send(std::string data) override;
  void Send(std::string data, std::function<void()> on_written) override;
  void EndStream() override;
  void OnClientGone(std::function<void()> on_gone) override;
  void Run(std::function<void()> fn) override;
  void RunHere(std::function<void()> fn) override;

 private:
  std::shared_ptr<Session> session_;
  uint64_t id_;
  HttpRequest request_;
};

// One connection. Its work (socket completions, timers, the handler's calls) runs one piece at
// a time, in the order queued: a thread that finds the connection idle runs the queue itself
// (an I/O thread, or a RunHere caller), any other only adds to it. Every member below `mu_`'s
// own is touched only by the thread running the queue.
class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, ServerState& server)
      : socket_(std::move(socket)),
        read_timer_(socket_.get_executor()),
        write_timer_(socket_.get_executor()),
        server_(server) {
    ++server_.connections;
  }
  ~Session() {
    SetBusy(false);
    --server_.connections;
  }

  void Start() {
    // Writes are tried at once on the thread that makes them; only what the socket does not
    // take goes through an asynchronous write.
    beast::error_code ignored;
    socket_.non_blocking(true, ignored);
    Queue([this] { ReadRequest(); }, /*here=*/true);
  }

  // Adds `fn` to this connection's work. If nothing is running it, `here` runs the queue on
  // this thread; otherwise an I/O thread is asked to.
  void Queue(std::function<void()> fn, bool here) {
    std::shared_ptr<Session> self = shared_from_this();
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks_.push_back(std::move(fn));
      if (running_) return;  // the thread running the queue takes it
      if (!here) {
        if (!drain_posted_) {
          drain_posted_ = true;
          net::post(socket_.get_executor(), [self] { self->PostedDrain(); });
        }
        return;
      }
      running_ = true;
    }
    RunQueue();
  }

  // Queues `fn` for exchange `id`; it does nothing unless that exchange is still the current
  // one when it runs.
  template <typename Fn>
  void QueueFor(uint64_t id, Fn fn) {
    Queue(
        [this, id, fn = std::move(fn)]() mutable {
          if (id == exchange_id_) fn(*this);
        },
        /*here=*/false);
  }

  void DoReply(HttpResponse response) {
    if (response_started_ || closed_) return;
    response_started_ = true;
    complete_ = true;
    std::string head =
        absl::StrCat("HTTP/1.1 ", response.status, " ", ReasonPhrase(response.status), "\r\n");
    absl::StrAppend(&head, "Content-Type: ", response.content_type, "\r\n");
    absl::StrAppend(&head, "Content-Length: ", response.body.size(), "\r\n");
    for (const auto& [name, value] : response.headers) {
      absl::StrAppend(&head, name, ": ", value, "\r\n");
    }
    if (!keep_alive_) head += "Connection: close\r\n";
    head += "\r\n";
    if (!head_request_) head += response.body;  // HEAD: the length is told, the body is not sent
    Enqueue(std::move(head));
  }

  void DoBeginStream(int status, const std::string& content_type, const HttpHeaders& headers) {
    if (response_started_ || closed_) return;
    response_started_ = true;
    // HTTP/1.0 has no chunked encoding: the body then ends when the connection closes.
    chunked_ = http11_;
    if (!chunked_) keep_alive_ = false;
    std::string head = absl::StrCat("HTTP/1.1 ", status, " ", ReasonPhrase(status), "\r\n");
    absl::StrAppend(&head, "Content-Type: ", content_type, "\r\n");
    for (const auto& [name, value] : headers) absl::StrAppend(&head, name, ": ", value, "\r\n");
    if (chunked_) head += "Transfer-Encoding: chunked\r\n";
    if (!keep_alive_) head += "Connection: close\r\n";
    head += "\r\n";
    Enqueue(std::move(head));
  }

  void DoSend(std::string data, std::function<void()> on_written = nullptr) {
    if (!response_started_ || complete_ || closed_ || data.empty()) return;
    if (chunked_) {
      char size[32];
      std::snprintf(size, sizeof(size), "%zx\r\n", data.size());
      data.insert(0, size);
      data += "\r\n";
    }
    Enqueue(std::move(data), std::move(on_written));
  }

  void DoEndStream() {
    if (!response_started_ || complete_ || closed_) return;
    complete_ = true;
    if (chunked_) {
      Enqueue("0\r\n\r\n");
    } else if (!writing_ && out_.empty()) {
      ResponseDone();
    }
  }

  void DoOnClientGone(std::function<void()> on_gone) {
    if (gone_) {
      on_gone();
    } else if (!complete_) {
      on_gone_ = std::move(on_gone);
    }
  }

 private:
  void PostedDrain() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      drain_posted_ = false;
      if (running_ || tasks_.empty()) return;
      running_ = true;
    }
    RunQueue();
  }

  // Runs the queue until it is empty; the caller has set running_.
  void RunQueue() {
    ++server_.runners;
    const bool stopped = server_.stopped.load();
    std::unique_lock<std::mutex> lock(mu_);
    while (!tasks_.empty()) {
      std::function<void()> task = std::move(tasks_.front());
      tasks_.pop_front();
      lock.unlock();
      // A throwing piece of work must take neither the connection (left marked running) nor
      // the calling thread (a gRPC thread, under RunHere) down with it.
      try {
        if (!stopped) task();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "tandem: HTTP connection work threw: %s\n", e.what());
      }
      task = nullptr;  // what it holds is released outside the lock
      lock.lock();
    }
    running_ = false;
    lock.unlock();
    --server_.runners;
  }

  // A socket or timer completion: runs on the I/O thread it arrived on unless the connection
  // is busy elsewhere.
  void Complete(std::function<void()> fn) { Queue(std::move(fn), /*here=*/true); }

  // One of the connection's time limits.
  struct Timer {
    explicit Timer(const net::any_io_executor& executor) : timer(executor) {}
    net::steady_timer timer;
    uint64_t armed = 0;  // the current arming; bumped to disarm it
  };
  // Runs `on_expiry` in the connection's work after `timeout`, unless `t` is disarmed or armed
  // again first.
  void Arm(Timer& t, std::chrono::steady_clock::duration timeout, std::function<void()> on_expiry) {
    const uint64_t armed = ++t.armed;
    t.timer.expires_after(timeout);
    t.timer.async_wait([self = shared_from_this(), &t, armed,
                        on_expiry = std::move(on_expiry)](beast::error_code ec) {
      if (ec) return;
      self->Complete([&t, armed, on_expiry] {
        if (armed == t.armed) on_expiry();
      });
    });
  }
  static void Disarm(Timer& t) {
    ++t.armed;
    t.timer.cancel();
  }
  // The time left to read a request (or to drain after a refusal); Close() when it runs out.
  void ArmRead(std::chrono::steady_clock::duration timeout) {
    Arm(read_timer_, timeout, [this] { Close(); });
  }

  void ReadRequest() {
    if (closed_) return;
    response_started_ = false;
    complete_ = false;
    parser_.emplace();
    parser_->header_limit(static_cast<uint32_t>(server_.options.max_header_bytes));
    parser_->body_limit(static_cast<uint64_t>(server_.options.max_body_bytes));
    ArmRead(server_.options.request_timeout);
    bhttp::async_read_header(socket_, buffer_, *parser_,
                             [self = shared_from_this()](beast::error_code ec, size_t) {
                               self->Complete([s = self.get(), ec] { s->OnHeader(ec); });
                             });
  }

  void OnHeader(beast::error_code ec) {
    if (closed_) return;
    if (ec) return OnReadError(ec);
    const auto& req = parser_->get();
    if (std::distance(req.begin(), req.end()) > server_.options.max_header_count) {
      return Refuse(431, absl::StrCat("a request may have at most ",
                                      server_.options.max_header_count, " header fields"));
    }
    if (parser_->is_done()) return Dispatch();
    // Clients that wait for permission before sending a large body (curl does) get it here;
    // a body over the limit was already refused from its Content-Length.
    auto expect = req.find(bhttp::field::expect);
    const bool send_continue = expect != req.end() &&
                               beast::iequals(expect->value(), "100-continue") &&
                               req.version() >= 11;
    bhttp::async_read(socket_, buffer_, *parser_,
                      [self = shared_from_this()](beast::error_code ec, size_t) {
                        self->Complete([s = self.get(), ec] {
                          if (s->closed_) return;
                          if (ec) return s->OnReadError(ec);
                          s->Dispatch();
                        });
                      });
    if (send_continue) Enqueue("HTTP/1.1 100 Continue\r\n\r\n");
  }

  void OnReadError(beast::error_code ec) {
    if (ec == bhttp::error::header_limit) {
      return Refuse(
          431, absl::StrCat("request headers exceed ", server_.options.max_header_bytes, " bytes"));
    }
    if (ec == bhttp::error::body_limit) {
      return Refuse(
          413, absl::StrCat("request body exceeds ", server_.options.max_body_bytes, " bytes"));
    }
    // Anything but a parse error means the client closed, reset or timed out: nobody is left
    // to answer.
    const bool parse_error =
        ec.category() == beast::error_code(bhttp::error::bad_target).category();
    if (!parse_error || ec == bhttp::error::end_of_stream || ec == bhttp::error::partial_message) {
      return Close();
    }
    Refuse(400, absl::StrCat("malformed HTTP request (", ec.message(), ")"));
  }

  // Answers a request that cannot be read any further, then closes the connection.
  void Refuse(int status, const std::string& message) {
    ++exchange_id_;
    response_started_ = false;
    complete_ = false;
    keep_alive_ = false;
    head_request_ = false;
    on_gone_ = nullptr;
    Disarm(read_timer_);  // the refusal's write has its own time limit
    DoReply(server_.Error(status, message));
  }

  void Dispatch() {
    auto& req = parser_->get();
    HttpRequest request;
    request.method = std::string(req.method_string());
    beast::string_view target = req.target();
    size_t q = target.find('?');
    request.path = std::string(target.substr(0, q));
    if (q != beast::string_view::npos) request.query = std::string(target.substr(q + 1));
    for (const auto& field : req) {
      request.headers.emplace_back(Lower(field.name_string()), std::string(field.value()));
    }
    request.body = std::move(req.body());
    http11_ = req.version() >= 11;
    keep_alive_ = http11_ && req.keep_alive();
    head_request_ = req.method() == bhttp::verb::head;
    parser_.reset();

    ++exchange_id_;
    response_started_ = false;
    complete_ = false;
    chunked_ = false;
    on_gone_ = nullptr;
    SetBusy(true);
    // The response takes the time it takes; a client that goes away is noticed by Watch.
    Disarm(read_timer_);
    Watch();
    auto exchange =
        std::make_shared<Exchange>(shared_from_this(), exchange_id_, std::move(request));
    try {
      server_.handler(exchange);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "tandem: request handler failed: %s\n", e.what());
      exchange->Reply(server_.Error(500, "internal error"));
    }
  }

  // Keeps a read pending while a response is produced, so a client that goes away is noticed
  // at once (and its request cancelled) rather than at the next write.
  void Watch() {
    if (watching_ || closed_ || buffer_.size() >= kMaxPipelinedBytes) return;
    watching_ = true;
    socket_.async_read_some(buffer_.prepare(4096),
                            [self = shared_from_this()](beast::error_code ec, size_t n) {
                              self->Complete([s = self.get(), ec, n] { s->OnWatch(ec, n); });
                            });
  }

  void OnWatch(beast::error_code ec, size_t n) {
    watching_ = false;
    if (closed_) return;
    if (draining_) return Drain();
    if (ec == net::error::operation_aborted && cancelled_watch_) {
      cancelled_watch_ = false;
      return ReadRequest();
    }
    cancelled_watch_ = false;
    if (ec) return ClientGone();
    buffer_.commit(n);
    if (complete_ && !writing_ && out_.empty()) return ReadRequest();
    Watch();
  }

  void ClientGone() {
    if (gone_) return;
    gone_ = true;
    auto on_gone = std::move(on_gone_);
    on_gone_ = nullptr;
    Close();
    if (on_gone) on_gone();
  }

  void Enqueue(std::string data, std::function<void()> on_written = nullptr) {
    if (closed_) return;
    out_bytes_ += data.size();
    out_.push_back({std::move(data), 0, std::move(on_written)});
    if (static_cast<int64_t>(out_bytes_) > server_.options.max_pending_write_bytes) {
      return ClientGone();
    }
    if (!writing_) WriteNext();
  }

  // Writes what the socket takes now, on this thread; the rest goes through an asynchronous
  // write whose completion comes back here.
  void WriteNext() {
    while (!out_.empty()) {
      Pending& piece = out_.front();
      beast::error_code ec;
      const size_t n = socket_.write_some(net::buffer(piece.data) + piece.sent, ec);
      if (ec == net::error::would_block || ec == net::error::try_again) break;
      if (ec) return ClientGone();
      piece.sent += n;
      if (piece.sent < piece.data.size()) break;  // the send buffer is full
      if (!FinishPiece()) return;
    }
    if (out_.empty()) {
      if (complete_) ResponseDone();
      return;
    }
    writing_ = true;
    // A client that has not taken one write in this time is not reading.
    Arm(write_timer_, server_.options.write_timeout, [this] { ClientGone(); });
    net::async_write(socket_, net::buffer(out_.front().data) + out_.front().sent,
                     [self = shared_from_this()](beast::error_code ec, size_t) {
                       self->Complete([s = self.get(), ec] { s->OnWrite(ec); });
                     });
  }

  void OnWrite(beast::error_code ec) {
    writing_ = false;
    Disarm(write_timer_);
    if (closed_) return;
    if (ec) return ClientGone();
    if (!FinishPiece()) return;
    WriteNext();
  }

  // Drops the fully written first piece and tells whoever waits for it; false if that closed
  // the connection.
  bool FinishPiece() {
    out_bytes_ -= out_.front().data.size();
    std::function<void()> written = std::move(out_.front().on_written);
    out_.pop_front();
    if (written) written();
    return !closed_;
  }

  void ResponseDone() {
    on_gone_ = nullptr;
    SetBusy(false);
    if (!keep_alive_) return GracefulClose();
    if (watching_) {
      // The pending read completes with operation_aborted and then reads the next request.
      cancelled_watch_ = true;
      beast::error_code ignored;
      socket_.cancel(ignored);
      return;
    }
    ReadRequest();
  }

  // Half-closes, then reads and drops what the client still sends for a moment before closing,
  // so that a response sent before the whole upload was read is not lost to a reset.
  void GracefulClose() {
    if (closed_ || draining_) return;
    draining_ = true;
    beast::error_code ignored;
    socket_.shutdown(tcp::socket::shutdown_send, ignored);
    ArmRead(kDrainTime);
    if (watching_) {
      // OnWatch starts draining once the pending read is done.
      socket_.cancel(ignored);
      return;
    }
    Drain();
  }

  void Drain() {
    if (closed_) return;
    if (drained_ > kMaxDrainBytes) return Close();
    drain_buffer_.consume(drain_buffer_.size());
    socket_.async_read_some(drain_buffer_.prepare(16384),
                            [self = shared_from_this()](beast::error_code ec, size_t n) {
                              self->Complete([s = self.get(), ec, n] {
                                if (ec) return s->Close();
                                s->drained_ += n;
                                s->Drain();
                              });
                            });
  }

  void Close() {
    if (closed_) return;
    closed_ = true;
    beast::error_code ignored;
    socket_.shutdown(tcp::socket::shutdown_both, ignored);
    socket_.close(ignored);
    Disarm(read_timer_);
    Disarm(write_timer_);
    out_.clear();
    out_bytes_ = 0;
    on_gone_ = nullptr;
    SetBusy(false);
  }

  void SetBusy(bool busy) {
    if (busy == busy_) return;
    busy_ = busy;
    server_.responses_in_flight += busy ? 1 : -1;
  }

  std::mutex mu_;
  std::deque<std::function<void()>> tasks_;  // guarded by mu_
  bool running_ = false;                     // guarded by mu_: a thread is running tasks_
  bool drain_posted_ = false;                // guarded by mu_: an I/O thread is asked to

  tcp::socket socket_;
  Timer read_timer_;
  Timer write_timer_;
  ServerState& server_;  // not owned; outlives every session
  beast::flat_buffer buffer_;
  beast::flat_buffer drain_buffer_;
  std::optional<bhttp::request_parser<bhttp::string_body>> parser_;

  uint64_t exchange_id_ = 0;  // the exchange allowed to write; bumped per request
  bool http11_ = true;
  bool head_request_ = false;
  bool keep_alive_ = true;
  bool response_started_ = false;
  bool complete_ = false;  // the whole response is queued
  bool chunked_ = false;
  bool watching_ = false;
  bool cancelled_watch_ = false;
  bool gone_ = false;
  bool closed_ = false;
  bool draining_ = false;
  bool writing_ = false;  // an asynchronous write is pending
  bool busy_ = false;     // counted in ServerState::responses_in_flight
  size_t drained_ = 0;
  struct Pending {
    std::string data;
    size_t sent = 0;                   // bytes of `data` already in the socket
    std::function<void()> on_written;  // run once `data` is written
  };
  std::deque<Pending> out_;
  size_t out_bytes_ = 0;
  std::function<void()> on_gone_;
};

void Exchange::Reply(HttpResponse response) {
  session_->QueueFor(id_,
                     [r = std::move(response)](Session& s) mutable { s.DoReply(std::move(r)); });
}

void Exchange::BeginStream(int status, const std::string& content_type, HttpHeaders headers) {
  session_->QueueFor(id_, [status, content_type, h = std::move(headers)](Session& s) {
    s.DoBeginStream(status, content_type, h);
  });
}

void Exchange::Send(std::string data) {
  session_->QueueFor(id_, [d = std::move(data)](Session& s) mutable { s.DoSend(std::move(d)); });
}

void Exchange::Send(std::string data, std::function<void()> on_written) {
  session_->QueueFor(id_, [d = std::move(data), w = std::move(on_written)](Session& s) mutable {
    s.DoSend(std::move(d), std::move(w));
  });
}

void Exchange::EndStream() {
  session_->QueueFor(id_, [](Session& s) { s.DoEndStream(); });
}

void Exchange::OnClientGone(std::function<void()> on_gone) {
  session_->QueueFor(
      id_, [f = std::move(on_gone)](Session& s) mutable { s.DoOnClientGone(std::move(f)); });
}

void Exchange::Run(std::function<void()> fn) { session_->Queue(std::move(fn), /*here=*/false); }

void Exchange::RunHere(std::function<void()> fn) { session_->Queue(std::move(fn), /*here=*/true); }

class HttpServerImpl : public HttpServer {
 public:
  HttpServerImpl(const HttpServerOptions& options, HttpHandler handler)
      : acceptor_(net::make_strand(ioc_)), work_(net::make_work_guard(ioc_)) {
    state_.options = options;
    state_.handler = std::move(handler);
  }
  ~HttpServerImpl() override { Stop(); }

  absl::Status Listen() {
    beast::error_code ec;
    net::ip::address address = net::ip::make_address(state_.options.host, ec);
    if (ec)
      return absl::InvalidArgumentError(
          absl::StrCat("bad --host '", state_.options.host, "': not an IP address"));
    if (state_.options.port < 0 || state_.options.port > 65535) {
      return absl::InvalidArgumentError(
          absl::StrCat("port must be in [0, 65535], got ", state_.options.port));
    }
    tcp::endpoint endpoint(address, static_cast<uint16_t>(state_.options.port));
    acceptor_.open(endpoint.protocol(), ec);
    if (!ec) acceptor_.set_option(net::socket_base::reuse_address(true), ec);
    if (!ec) acceptor_.bind(endpoint, ec);
    if (!ec) acceptor_.listen(net::socket_base::max_listen_connections, ec);
    if (ec) {
      return absl::UnavailableError(absl::StrCat("cannot listen on ", state_.options.host, ":",
                                                 state_.options.port, ": ", ec.message()));
    }
    port_ = acceptor_.local_endpoint().port();
    Accept();
    int threads = std::max(1, state_.options.num_threads);
    for (int i = 0; i < threads; ++i) {
      threads_.emplace_back([this] {
        // A throwing handler must not take the server down with it.
        for (;;) {
          try {
            ioc_.run();
            return;
          } catch (const std::exception& e) {
            std::fprintf(stderr, "tandem: I/O thread caught: %s\n", e.what());
          }
        }
      });
    }
    return absl::OkStatus();
  }

  int port() const override { return port_; }

  void StopAccepting() override {
    net::post(acceptor_.get_executor(), [this] {
      beast::error_code ignored;
      acceptor_.close(ignored);
    });
  }

  void Stop() override {
    std::lock_guard<std::mutex> lock(stop_mu_);
    if (stopped_) return;
    stopped_ = true;
    // Connections' work can be running on callers' threads (RunHere) as well as on the I/O
    // threads: none starts from now on, and what is running is waited for.
    state_.stopped = true;
    while (state_.runners.load() > 0) std::this_thread::sleep_for(std::chrono::microseconds(100));
    work_.reset();
    ioc_.stop();
    for (std::thread& t : threads_) t.join();
    threads_.clear();
  }

  int num_connections() const override { return state_.connections.load(); }
  int num_responses_in_flight() const override { return state_.responses_in_flight.load(); }

 private:
  void Accept() {
    acceptor_.async_accept(ioc_, [this](beast::error_code ec, tcp::socket socket) {
      if (!acceptor_.is_open()) return;
      if (ec) {
        // Out of descriptors or similar: try again shortly instead of spinning.
        retry_timer_.expires_after(std::chrono::milliseconds(50));
        retry_timer_.async_wait([this](beast::error_code) { Accept(); });
        return;
      }
      beast::error_code ignored;
      socket.set_option(tcp::no_delay(true), ignored);
      std::make_shared<Session>(std::move(socket), state_)->Start();
      Accept();
    });
  }

  // state_ outlives ioc_: sessions still queued in ioc_ refer to it when ioc_ destroys them.
  ServerState state_;
  net::io_context ioc_;
  tcp::acceptor acceptor_;
  net::steady_timer retry_timer_{acceptor_.get_executor()};
  net::executor_work_guard<net::io_context::executor_type> work_;
  std::vector<std::thread> threads_;
  int port_ = 0;
  std::mutex stop_mu_;
  bool stopped_ = false;
};

}  // namespace

std::optional<std::string> HttpRequest::header(const std::string& lower_name) const {
  for (const auto& [name, value] : headers) {
    if (name == lower_name) return value;
  }
  return std::nullopt;
}

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Create(const HttpServerOptions& options,
                                                               HttpHandler handler) {
  auto server = std::make_unique<HttpServerImpl>(options, std::move(handler));
  if (absl::Status s = server->Listen(); !s.ok()) return s;
  return std::unique_ptr<HttpServer>(std::move(server));
}

}  // namespace tandem::http

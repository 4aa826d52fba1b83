#include "tandem/http/http_server.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdio>
#include <deque>
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

 private:
  std::shared_ptr<Session> session_;
  uint64_t id_;
  HttpRequest request_;
};

// One connection. Every member is touched only on the connection's strand.
class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, ServerState& server) : stream_(std::move(socket)), server_(server) {
    ++server_.connections;
  }
  ~Session() {
    SetBusy(false);
    --server_.connections;
  }

  void Start() {
    net::dispatch(stream_.get_executor(), [self = shared_from_this()] { self->ReadRequest(); });
  }

  // Runs `fn` on this connection's strand.
  void PostAlways(std::function<void()> fn) {
    net::post(stream_.get_executor(), [self = shared_from_this(), fn = std::move(fn)] { fn(); });
  }

  // Runs `fn` on this connection's strand if exchange `id` is still the current one.
  template <typename Fn>
  void Post(uint64_t id, Fn fn) {
    net::post(stream_.get_executor(),
              [self = shared_from_this(), id, fn = std::move(fn)]() mutable {
                if (id != self->exchange_id_) return;
                fn(*self);
              });
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
  void ReadRequest() {
    if (closed_) return;
    response_started_ = false;
    complete_ = false;
    parser_.emplace();
    parser_->header_limit(static_cast<uint32_t>(server_.options.max_header_bytes));
    parser_->body_limit(static_cast<uint64_t>(server_.options.max_body_bytes));
    stream_.expires_after(server_.options.request_timeout);
    bhttp::async_read_header(
        stream_, buffer_, *parser_,
        [self = shared_from_this()](beast::error_code ec, size_t) { self->OnHeader(ec); });
  }

  void OnHeader(beast::error_code ec) {
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
    bhttp::async_read(stream_, buffer_, *parser_,
                     [self = shared_from_this()](beast::error_code ec, size_t) {
                       if (ec) return self->OnReadError(ec);
                       self->Dispatch();
                     });
    // Queued after the read started, so the write's timeout does not replace the read's.
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
    const bool parse_error = ec.category() == beast::error_code(bhttp::error::bad_target).category();
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
    stream_.expires_never();
    stream_.async_read_some(
        buffer_.prepare(4096),
        [self = shared_from_this()](beast::error_code ec, size_t n) { self->OnWatch(ec, n); });
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
    out_.push_back({std::move(data), std::move(on_written)});
    if (static_cast<int64_t>(out_bytes_) > server_.options.max_pending_write_bytes) {
      return ClientGone();
    }
    if (!writing_) WriteNext();
  }

  void WriteNext() {
    writing_ = true;
    stream_.expires_after(server_.options.write_timeout);
    net::async_write(
        stream_, net::buffer(out_.front().data),
        [self = shared_from_this()](beast::error_code ec, size_t) { self->OnWrite(ec); });
  }

  void OnWrite(beast::error_code ec) {
    writing_ = false;
    if (closed_) return;
    if (ec) return ClientGone();
    out_bytes_ -= out_.front().data.size();
    std::function<void()> written = std::move(out_.front().on_written);
    out_.pop_front();
    if (written) written();
    if (closed_) return;
    if (!out_.empty()) return WriteNext();
    if (complete_) ResponseDone();
  }

  void ResponseDone() {
    on_gone_ = nullptr;
    SetBusy(false);
    if (!keep_alive_) return GracefulClose();
    if (watching_) {
      // The pending read completes with operation_aborted and then reads the next request.
      cancelled_watch_ = true;
      stream_.socket().cancel();
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
    stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
    drain_deadline_ = std::chrono::steady_clock::now() + kDrainTime;
    if (watching_) {
      // OnWatch starts draining once the pending read is done.
      stream_.socket().cancel();
      return;
    }
    Drain();
  }

  void Drain() {
    if (closed_) return;
    auto left = drain_deadline_ - std::chrono::steady_clock::now();
    if (left <= std::chrono::steady_clock::duration::zero() || drained_ > kMaxDrainBytes) {
      return Close();
    }
    stream_.expires_after(left);
    drain_buffer_.consume(drain_buffer_.size());
    stream_.async_read_some(drain_buffer_.prepare(16384),
                            [self = shared_from_this()](beast::error_code ec, size_t n) {
                              if (ec) return self->Close();
                              self->drained_ += n;
                              self->Drain();
                            });
  }

  void Close() {
    if (closed_) return;
    closed_ = true;
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream_.close();
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

  beast::tcp_stream stream_;
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
  bool writing_ = false;
  bool busy_ = false;  // counted in ServerState::responses_in_flight
  size_t drained_ = 0;
  std::chrono::steady_clock::time_point drain_deadline_;
  struct Pending {
    std::string data;
    std::function<void()> on_written;  // run once `data` is written
  };
  std::deque<Pending> out_;
  size_t out_bytes_ = 0;
  std::function<void()> on_gone_;
};

void Exchange::Reply(HttpResponse response) {
  session_->Post(id_, [r = std::move(response)](Session& s) mutable { s.DoReply(std::move(r)); });
}

void Exchange::BeginStream(int status, const std::string& content_type, HttpHeaders headers) {
  session_->Post(id_, [status, content_type, h = std::move(headers)](Session& s) {
    s.DoBeginStream(status, content_type, h);
  });
}

void Exchange::Send(std::string data) {
  session_->Post(id_, [d = std::move(data)](Session& s) mutable { s.DoSend(std::move(d)); });
}

void Exchange::Send(std::string data, std::function<void()> on_written) {
  session_->Post(id_, [d = std::move(data), w = std::move(on_written)](Session& s) mutable {
    s.DoSend(std::move(d), std::move(w));
  });
}

void Exchange::EndStream() {
  session_->Post(id_, [](Session& s) { s.DoEndStream(); });
}

void Exchange::OnClientGone(std::function<void()> on_gone) {
  session_->Post(id_,
                 [f = std::move(on_gone)](Session& s) mutable { s.DoOnClientGone(std::move(f)); });
}

void Exchange::Run(std::function<void()> fn) { session_->PostAlways(std::move(fn)); }

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
    work_.reset();
    ioc_.stop();
    for (std::thread& t : threads_) t.join();
    threads_.clear();
  }

  int num_connections() const override { return state_.connections.load(); }
  int num_responses_in_flight() const override { return state_.responses_in_flight.load(); }

 private:
  void Accept() {
    acceptor_.async_accept(net::make_strand(ioc_),
                           [this](beast::error_code ec, tcp::socket socket) {
                             if (!acceptor_.is_open()) return;
                             if (ec) {
                               // Out of descriptors or similar: try again shortly instead of
                               // spinning.
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

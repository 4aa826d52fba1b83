// An asynchronous HTTP/1.1 server (Boost.Beast on one io_context and a few threads) that hands
// each request to a handler as an HttpExchange, which the handler answers at once or later,
// with one body or as a stream (server-sent events), from any thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace tandem::http {

using HttpHeaders = std::vector<std::pair<std::string, std::string>>;

struct HttpRequest {
  std::string method;   // as sent, e.g. "POST"
  std::string path;     // the target without its query
  std::string query;    // after '?', or empty
  HttpHeaders headers;  // names lower-cased
  std::string body;

  // The first header with this (lower-case) name.
  std::optional<std::string> header(const std::string& lower_name) const;
};

struct HttpResponse {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  HttpHeaders headers;  // extra headers, e.g. Retry-After
};

// One request and its response. Every method is thread-safe. A connection's work (its socket
// events and what its exchange is asked to do) runs one piece at a time, in call order, on
// whichever thread finds it idle: an I/O thread, or a RunHere caller. Every method but RunHere
// only queues and returns at once. A handler answers with exactly one Reply, or with
// BeginStream, any number of Send, then EndStream.
class HttpExchange {
 public:
  virtual ~HttpExchange() = default;
  virtual const HttpRequest& request() const = 0;

  virtual void Reply(HttpResponse response) = 0;
  // Sends the status line and headers of a response whose body follows in pieces (chunked).
  virtual void BeginStream(int status, const std::string& content_type,
                           HttpHeaders headers = {}) = 0;
  virtual void Send(std::string data) = 0;
  // Send, then `on_written` (in the connection's work) once `data` is in the socket's send
  // buffer (never, if the client goes away first): for measuring when output left the server.
  virtual void Send(std::string data, std::function<void()> on_written) = 0;
  virtual void EndStream() = 0;

  // `on_gone` runs once, in the connection's work, if the client goes away (or stops reading) before
  // the response is complete; it is dropped once the response is complete. Set it before
  // the response starts; if the client is already gone it runs at once.
  virtual void OnClientGone(std::function<void()> on_gone) = 0;

  // Runs `fn` in the connection's work after everything already queued for it, even if the
  // client is gone, never on the calling thread: a handler that gets results on another thread
  // hands them over here, so that its writes and its own state change in one order without
  // locks. For callers that must return at once (an engine thread whose next step waits).
  virtual void Run(std::function<void()> fn) = 0;
  // As Run, but if the connection is idle `fn` runs on this thread before RunHere returns, and
  // so do the writes it asks for (as far as the socket takes them without waiting): an output
  // that arrives on a thread free to do the work reaches the client with no thread hop. If
  // the connection is busy, `fn` is queued and runs on the thread that is running it.
  virtual void RunHere(std::function<void()> fn) = 0;
};

using HttpHandler = std::function<void(std::shared_ptr<HttpExchange>)>;

struct HttpServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;  // 0: the system picks a free port (see HttpServer::port())
  int num_threads = 2;
  int64_t max_body_bytes = 4 << 20;
  int max_header_bytes = 16 << 10;  // request line and all headers
  int max_header_count = 100;
  // A request (headers and body) must arrive within this time, and an idle keep-alive
  // connection is closed after it; this is what stops slowloris clients.
  std::chrono::milliseconds request_timeout{30000};
  // One write to a client that does not read is given up after this time.
  std::chrono::milliseconds write_timeout{60000};
  // A stream whose unsent data grows past this (a client that reads too slowly) is dropped.
  int64_t max_pending_write_bytes = 16 << 20;
  // Answers protocol-level refusals (malformed request, oversized headers or body) with this
  // body builder, given the status and a message; the API layer supplies its error format.
  std::function<HttpResponse(int status, const std::string& message)> error_response;
};

//   TANDEM_ASSIGN_OR_RETURN(auto server, HttpServer::Create(options, handler));
//   int port = server->port();
//   ...
//   server->Stop();
class HttpServer {
 public:
  // Binds and listens, then starts the I/O threads.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Create(const HttpServerOptions& options,
                                                            HttpHandler handler);
  virtual ~HttpServer() = default;

  // The bound port (useful with port 0).
  virtual int port() const = 0;
  // Stops accepting new connections; those already open go on.
  virtual void StopAccepting() = 0;
  // Stops all I/O and joins the threads; pending exchanges become no-ops. Idempotent.
  virtual void Stop() = 0;
  // Open connections, for tests and metrics.
  virtual int num_connections() const = 0;
  // Requests read whose response is not yet fully written to the socket (or abandoned by a
  // client that went away). A graceful shutdown waits for this to reach zero.
  virtual int num_responses_in_flight() const = 0;
};

}  // namespace tandem::http

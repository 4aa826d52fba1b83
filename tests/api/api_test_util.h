// Helpers for the API tests: start `tandem serve` as a child process, and talk raw HTTP/1.1 to
// it over blocking sockets (so tests control every byte, including broken ones).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace tandem::api_test {

// The tiny synthetic checkpoint the api_tiny_model ctest fixture writes.
std::string TinyModelDir();

// `tandem serve --model <tiny> --port 0 <extra>` as a child; the destructor sends SIGTERM and
// waits for it (SIGKILL after 120 s, a bound only a hung shutdown reaches).
class ServerProcess {
 public:
  // Starts the server and waits (up to 120 s) for its "serving ... on http://HOST:PORT" line.
  // Returns nullptr and sets *error when it does not come up.
  static std::unique_ptr<ServerProcess> Start(const std::vector<std::string>& extra_args,
                                              std::string* error);
  ~ServerProcess();

  int port() const { return port_; }
  pid_t pid() const { return pid_; }
  // True while the process has not exited.
  bool Alive();
  // Sends SIGTERM and returns the exit status (as from waitpid), or -1 after a SIGKILL (when it
  // has not exited within 120 s).
  int Terminate();

 private:
  pid_t pid_ = -1;
  int port_ = 0;
  int stdout_fd_ = -1;
  bool reaped_ = false;
};

// Socket timeouts of the helpers below: long enough that only a hung server reaches them, on
// however slow or loaded a machine.
inline constexpr int kHangTimeoutMs = 120000;

// A connected TCP socket to 127.0.0.1:port with send/receive timeouts, or -1.
int Connect(int port, int timeout_ms = kHangTimeoutMs);
bool SendAll(int fd, const std::string& data);

struct HttpResult {
  int status = 0;                              // 0: no (complete) response
  std::map<std::string, std::string> headers;  // names lower-cased
  std::string body;                            // de-chunked
};

// Reads one response (skipping 100 Continue) within the socket's timeout; a response to HEAD
// has no body whatever its Content-Length says. `received`: bytes of it the caller has already
// read from fd.
HttpResult ReadResponse(int fd, bool head = false, std::string received = "");
// One request on a fresh connection (Connection: close).
HttpResult Request(int port, const std::string& method, const std::string& path,
                   const std::string& body = "",
                   const std::vector<std::string>& extra_headers = {});
// Sends `raw` as is and reads one response; status 0 if the server closed without one.
HttpResult RawExchange(int port, const std::string& raw, int timeout_ms = kHangTimeoutMs);

// The `data:` payloads of a server-sent-events body, in order; `event:` names other than the
// default are returned as "event:<name>" entries before their data.
std::vector<std::string> SseEvents(const std::string& body);

// The value of an unlabelled sample (or of `name{labels}` given in full, its labels in any
// order) in a Prometheus text exposition, or nullopt.
std::optional<double> MetricValue(const std::string& exposition, const std::string& series);

// Scrapes GET /metrics until `done` holds for the exposition, or until `limit` has passed (a
// bound only a hang reaches), and returns the last scrape. A request's counters are updated
// just after its response is handed to the connection, and the KV gauges come from the
// workers, so a scrape taken the moment a response arrives may not show it yet: tests wait for
// the values they expect, then assert on them.
std::string WaitForMetrics(int port, const std::function<bool(const std::string&)>& done,
                           const std::vector<std::string>& headers = {},
                           std::chrono::seconds limit = std::chrono::seconds(60));

}  // namespace tandem::api_test

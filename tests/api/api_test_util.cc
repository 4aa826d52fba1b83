#include "api_test_util.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <sstream>
#include <thread>

namespace tandem::api_test {
namespace {

std::string Env(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : fallback;
}

std::string Lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// Reads more bytes into `buf`; false on EOF, error or timeout.
bool ReadMore(int fd, std::string& buf) {
  char chunk[16384];
  ssize_t n = ::recv(fd, chunk, sizeof(chunk), 0);
  if (n <= 0) return false;
  buf.append(chunk, static_cast<size_t>(n));
  return true;
}

}  // namespace

std::string TinyModelDir() {
  return Env("TANDEM_API_TEST_MODEL", Env("TANDEM_BINARY_DIR", ".") + "/tests/api/tiny-model");
}

std::unique_ptr<ServerProcess> ServerProcess::Start(const std::vector<std::string>& extra_args,
                                                    std::string* error) {
  const std::string binary = Env("TANDEM_BINARY_DIR", ".") + "/bin/tandem";
  std::vector<std::string> args = {binary,   "serve", "--model",   TinyModelDir(),
                                   "--port", "0",     "--threads", "1"};
  // TANDEM_API_TEST_SERVE_FLAGS (space-separated) runs a whole suite in another mode, e.g.
  // "--colocated".
  std::istringstream mode(Env("TANDEM_API_TEST_SERVE_FLAGS", ""));
  for (std::string flag; mode >> flag;) args.push_back(flag);
  args.insert(args.end(), extra_args.begin(), extra_args.end());
  int out[2];
  if (pipe(out) != 0) {
    *error = "pipe failed";
    return nullptr;
  }
  pid_t pid = fork();
  if (pid < 0) {
    *error = "fork failed";
    return nullptr;
  }
  if (pid == 0) {
    dup2(out[1], STDOUT_FILENO);
    close(out[0]);
    close(out[1]);
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    std::perror("execv");
    _exit(127);
  }
  close(out[1]);
  auto server = std::unique_ptr<ServerProcess>(new ServerProcess());
  server->pid_ = pid;
  server->stdout_fd_ = out[0];

  // Wait for the line that names the port.
  std::string text;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (std::chrono::steady_clock::now() < deadline) {
    size_t at = text.find(" on http://");
    size_t eol = at == std::string::npos ? std::string::npos : text.find('\n', at);
    if (eol != std::string::npos) {
      std::string url = text.substr(at + 11, eol - at - 11);
      url = url.substr(0, url.find(' '));  // "host:port (prefill ..., decode ...)"
      size_t colon = url.rfind(':');
      server->port_ = std::atoi(url.c_str() + colon + 1);
      if (server->port_ > 0) return server;
      break;
    }
    pollfd p{server->stdout_fd_, POLLIN, 0};
    if (poll(&p, 1, 500) > 0) {
      char buf[4096];
      ssize_t n = read(server->stdout_fd_, buf, sizeof(buf));
      if (n <= 0) break;
      text.append(buf, static_cast<size_t>(n));
    } else if (!server->Alive()) {
      break;
    }
  }
  *error = "tandem serve did not report its port; stdout was: " + text;
  return nullptr;
}

ServerProcess::~ServerProcess() {
  Terminate();
  if (stdout_fd_ >= 0) close(stdout_fd_);
}

bool ServerProcess::Alive() {
  if (reaped_) return false;
  int status = 0;
  pid_t r = waitpid(pid_, &status, WNOHANG);
  if (r == pid_) reaped_ = true;
  return r == 0;
}

int ServerProcess::Terminate() {
  if (reaped_ || pid_ <= 0) return -1;
  kill(pid_, SIGTERM);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (std::chrono::steady_clock::now() < deadline) {
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      reaped_ = true;
      return status;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  kill(pid_, SIGKILL);
  waitpid(pid_, nullptr, 0);
  reaped_ = true;
  return -1;
}

int Connect(int port, int timeout_ms) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  timeval tv{timeout_ms / 1000, (timeout_ms % 1000) * 1000};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

bool SendAll(int fd, const std::string& data) {
  size_t sent = 0;
  while (sent < data.size()) {
    ssize_t n = ::send(fd, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return false;
    sent += static_cast<size_t>(n);
  }
  return true;
}

HttpResult ReadResponse(int fd, bool head, std::string received) {
  HttpResult result;
  std::string buf = std::move(received);
  for (;;) {
    size_t end;
    while ((end = buf.find("\r\n\r\n")) == std::string::npos) {
      if (!ReadMore(fd, buf)) return result;
    }
    std::istringstream lines(buf.substr(0, end));
    std::string line;
    std::getline(lines, line);
    if (line.size() < 12 || line.compare(0, 5, "HTTP/") != 0) return result;
    int status = std::atoi(line.c_str() + 9);
    std::map<std::string, std::string> headers;
    while (std::getline(lines, line)) {
      if (!line.empty() && line.back() == '\r') line.pop_back();
      size_t colon = line.find(':');
      if (colon == std::string::npos) continue;
      std::string value = line.substr(colon + 1);
      while (!value.empty() && value.front() == ' ') value.erase(0, 1);
      headers[Lower(line.substr(0, colon))] = value;
    }
    buf.erase(0, end + 4);
    if (status == 100) continue;
    std::string body;
    if (head) {
    } else if (Lower(headers["transfer-encoding"]) == "chunked") {
      for (;;) {
        size_t eol;
        while ((eol = buf.find("\r\n")) == std::string::npos) {
          if (!ReadMore(fd, buf)) return result;
        }
        size_t size = std::strtoul(buf.substr(0, eol).c_str(), nullptr, 16);
        while (buf.size() < eol + 2 + size + 2) {
          if (!ReadMore(fd, buf)) return result;
        }
        body.append(buf, eol + 2, size);
        buf.erase(0, eol + 2 + size + 2);
        if (size == 0) break;
      }
    } else if (headers.count("content-length")) {
      size_t length = std::strtoul(headers["content-length"].c_str(), nullptr, 10);
      while (buf.size() < length) {
        if (!ReadMore(fd, buf)) return result;
      }
      body = buf.substr(0, length);
    } else {
      while (ReadMore(fd, buf)) {
      }
      body = buf;
    }
    result.status = status;
    result.headers = std::move(headers);
    result.body = std::move(body);
    return result;
  }
}

HttpResult Request(int port, const std::string& method, const std::string& path,
                   const std::string& body, const std::vector<std::string>& extra_headers) {
  std::string raw = method + " " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n";
  for (const std::string& h : extra_headers) raw += h + "\r\n";
  if (!body.empty() || method == "POST") {
    raw +=
        "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) + "\r\n";
  }
  raw += "\r\n" + body;
  return RawExchange(port, raw);
}

HttpResult RawExchange(int port, const std::string& raw, int timeout_ms) {
  int fd = Connect(port, timeout_ms);
  if (fd < 0) return {};
  HttpResult r;
  // A refused upload may be cut short by the server; the response still counts.
  SendAll(fd, raw);
  r = ReadResponse(fd, raw.rfind("HEAD ", 0) == 0);
  close(fd);
  return r;
}

std::vector<std::string> SseEvents(const std::string& body) {
  std::vector<std::string> events;
  size_t pos = 0;
  while (pos < body.size()) {
    size_t end = body.find("\n\n", pos);
    if (end == std::string::npos) end = body.size();
    std::istringstream block(body.substr(pos, end - pos));
    std::string line;
    while (std::getline(block, line)) {
      if (line.rfind("data: ", 0) == 0) {
        events.push_back(line.substr(6));
      } else if (line.rfind("event: ", 0) == 0) {
        events.push_back("event:" + line.substr(7));
      }
    }
    pos = end + 2;
  }
  return events;
}

namespace {

// The end of the series at the start of an exposition line (`name` or `name{labels}`), or npos.
size_t SeriesEnd(const std::string& line) {
  size_t i = line.find_first_of("{ ");
  if (i == std::string::npos || line[i] == ' ') return i;
  bool quoted = false;
  for (++i; i < line.size(); ++i) {
    if (quoted && line[i] == '\\') {
      ++i;
    } else if (line[i] == '"') {
      quoted = !quoted;
    } else if (!quoted && line[i] == '}') {
      return i + 1;
    }
  }
  return std::string::npos;
}

// `name{b="2",a="1"}` as `name{a="1",b="2"}`: the order of labels has no meaning in Prometheus,
// and exporters differ in it.
std::string CanonicalSeries(const std::string& series) {
  const size_t open = series.find('{');
  if (open == std::string::npos || series.back() != '}') return series;
  std::vector<std::string> labels(1);
  bool quoted = false;
  for (size_t i = open + 1; i + 1 < series.size(); ++i) {
    char c = series[i];
    if (quoted && c == '\\') {
      labels.back() += c;
      c = series[++i];
    } else if (c == '"') {
      quoted = !quoted;
    } else if (!quoted && c == ',') {
      labels.emplace_back();
      continue;
    }
    labels.back() += c;
  }
  std::erase_if(labels, [](const std::string& l) { return l.empty(); });
  std::sort(labels.begin(), labels.end());
  std::string out = series.substr(0, open + 1);
  for (size_t i = 0; i < labels.size(); ++i) out += (i ? "," : "") + labels[i];
  return out + "}";
}

}  // namespace

std::optional<double> MetricValue(const std::string& exposition, const std::string& series) {
  const std::string wanted = CanonicalSeries(series);
  std::istringstream in(exposition);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t end = SeriesEnd(line);
    if (end == std::string::npos || end >= line.size() || line[end] != ' ') continue;
    if (CanonicalSeries(line.substr(0, end)) == wanted)
      return std::strtod(line.c_str() + end + 1, nullptr);
  }
  return std::nullopt;
}

std::string WaitForMetrics(int port, const std::function<bool(const std::string&)>& done,
                           const std::vector<std::string>& headers, std::chrono::seconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  std::string body;
  for (;;) {
    HttpResult r = Request(port, "GET", "/metrics", "", headers);
    if (r.status == 200) {
      body = std::move(r.body);
      if (done(body)) return body;
    }
    if (std::chrono::steady_clock::now() >= deadline) return body;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

}  // namespace tandem::api_test

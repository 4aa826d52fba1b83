// Load generator behind `tandem bench` (see load_generator.h): the HTTP client, its streaming
// parser and the run loop. One thread per in-flight request over a plain blocking socket:
// simple and exact enough for the rates a single machine serves.
#include <netdb.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "tandem/tools/load_generator.h"

namespace tandem::tools {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

struct Url {
  std::string host;
  std::string port;
  std::string prefix;  // path before /v1/..., without a trailing slash
};

absl::StatusOr<Url> ParseUrl(const std::string& url) {
  const std::string scheme = "http://";
  if (url.rfind(scheme, 0) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--url must start with http:// (got '", url, "'; https is not supported)"));
  }
  std::string rest = url.substr(scheme.size());
  Url out;
  const size_t slash = rest.find('/');
  if (slash != std::string::npos) {
    out.prefix = rest.substr(slash);
    rest = rest.substr(0, slash);
    while (!out.prefix.empty() && out.prefix.back() == '/') out.prefix.pop_back();
    // Accept both http://h:p and http://h:p/v1.
    if (out.prefix.size() >= 3 && out.prefix.substr(out.prefix.size() - 3) == "/v1") {
      out.prefix.resize(out.prefix.size() - 3);
    }
  }
  const size_t colon = rest.rfind(':');
  if (colon == std::string::npos) {
    out.host = rest;
    out.port = "80";
  } else {
    out.host = rest.substr(0, colon);
    out.port = rest.substr(colon + 1);
  }
  if (out.host.empty() || out.port.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("malformed --url '", url, "'"));
  }
  return out;
}

// A connected socket, closed on destruction.
class Socket {
 public:
  ~Socket() {
    if (fd_ >= 0) ::close(fd_);
  }
  absl::Status Connect(const Url& url) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    const int rc = ::getaddrinfo(url.host.c_str(), url.port.c_str(), &hints, &res);
    if (rc != 0) {
      return absl::UnavailableError(
          absl::StrCat("cannot resolve ", url.host, ": ", gai_strerror(rc)));
    }
    std::string last = "no address";
    for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
      const int fd = ::socket(a->ai_family, a->ai_socktype, a->ai_protocol);
      if (fd < 0) continue;
      if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
        fd_ = fd;
        break;
      }
      last = std::strerror(errno);
      ::close(fd);
    }
    ::freeaddrinfo(res);
    if (fd_ < 0) {
      return absl::UnavailableError(
          absl::StrCat("cannot connect to ", url.host, ":", url.port, ": ", last));
    }
    timeval tv{};
    tv.tv_sec = 600;  // a stalled server fails the request instead of hanging the run
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    return absl::OkStatus();
  }
  absl::Status SendAll(const std::string& data) {
    size_t sent = 0;
    while (sent < data.size()) {
      const ssize_t n = ::send(fd_, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
      if (n < 0) {
        if (errno == EINTR) continue;
        return absl::UnavailableError(absl::StrCat("send: ", std::strerror(errno)));
      }
      sent += static_cast<size_t>(n);
    }
    return absl::OkStatus();
  }
  // Appends what arrives to `*out`; false at end of stream. Errors (timeouts) are statuses.
  absl::StatusOr<bool> Receive(std::string* out) {
    char buf[16384];
    while (true) {
      const ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return absl::UnavailableError(absl::StrCat("recv: ", std::strerror(errno)));
      if (n == 0) return false;
      out->append(buf, static_cast<size_t>(n));
      return true;
    }
  }

 private:
  int fd_ = -1;
};

// Decodes a chunked transfer-encoded body incrementally.
class ChunkDecoder {
 public:
  // Consumes what it can of `*raw` and appends the payload to `*out`.
  absl::Status Feed(std::string* raw, std::string* out) {
    while (!done_) {
      if (remaining_ == 0) {
        const size_t eol = raw->find("\r\n");
        if (eol == std::string::npos) return absl::OkStatus();
        const std::string line = raw->substr(0, eol);
        raw->erase(0, eol + 2);
        if (line.empty()) continue;  // the CRLF after a chunk's data
        size_t size = 0;
        try {
          size = std::stoul(line, nullptr, 16);
        } catch (...) {
          return absl::DataLossError(absl::StrCat("bad chunk size line '", line, "'"));
        }
        if (size == 0) {
          done_ = true;
          return absl::OkStatus();
        }
        remaining_ = size;
      }
      const size_t take = std::min(remaining_, raw->size());
      if (take == 0) return absl::OkStatus();
      out->append(*raw, 0, take);
      raw->erase(0, take);
      remaining_ -= take;
    }
    return absl::OkStatus();
  }
  bool done() const { return done_; }

 private:
  size_t remaining_ = 0;
  bool done_ = false;
};

std::string Lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string RequestBody(const LoadConfig& config, const BenchRequest& request) {
  json body = {{"model", config.model},
               {"max_tokens", request.max_tokens},
               {"stream", true},
               {"stream_options", {{"include_usage", true}}},
               {"temperature", 0.0}};
  if (config.ignore_eos) body["ignore_eos"] = true;
  if (config.endpoint == "chat") {
    body["messages"] = json::array({{{"role", "user"}, {"content", request.prompt}}});
  } else {
    body["prompt"] = request.prompt;
  }
  return body.dump();
}

// Text of one streamed chunk: choices[0].text or choices[0].delta.content.
std::string ChunkText(const json& event) {
  auto choices = event.find("choices");
  if (choices == event.end() || !choices->is_array() || choices->empty()) return "";
  const json& c = (*choices)[0];
  if (auto t = c.find("text"); t != c.end() && t->is_string()) return t->get<std::string>();
  if (auto d = c.find("delta"); d != c.end() && d->is_object()) {
    if (auto t = d->find("content"); t != d->end() && t->is_string()) return t->get<std::string>();
  }
  return "";
}

// Sends one request and measures it. Failures land in the record.
RequestRecord SendOne(const LoadConfig& config, const Url& url, const BenchRequest& request,
                      Clock::time_point run_start) {
  RequestRecord record;
  const Clock::time_point start = Clock::now();
  record.start = Seconds(run_start, start);
  auto fail = [&](std::string message) {
    record.success = false;
    record.error = std::move(message);
    record.e2e = Seconds(start, Clock::now());
    return record;
  };

  const std::string path =
      url.prefix + (config.endpoint == "chat" ? "/v1/chat/completions" : "/v1/completions");
  const std::string body = RequestBody(config, request);
  std::string head = absl::StrCat("POST ", path, " HTTP/1.1\r\nHost: ", url.host, ":", url.port,
                                  "\r\nContent-Type: application/json\r\nAccept: "
                                  "text/event-stream\r\nConnection: close\r\nContent-Length: ",
                                  body.size(), "\r\n");
  if (!config.api_key.empty())
    absl::StrAppend(&head, "Authorization: Bearer ", config.api_key, "\r\n");
  absl::StrAppend(&head, "\r\n");

  Socket socket;
  if (absl::Status s = socket.Connect(url); !s.ok()) return fail(std::string(s.message()));
  if (absl::Status s = socket.SendAll(head + body); !s.ok()) return fail(std::string(s.message()));

  // Response head.
  std::string raw;
  size_t head_end = std::string::npos;
  while ((head_end = raw.find("\r\n\r\n")) == std::string::npos) {
    absl::StatusOr<bool> more = socket.Receive(&raw);
    if (!more.ok()) return fail(std::string(more.status().message()));
    if (!*more) return fail("connection closed before the response head");
  }
  const std::string response_head = Lower(raw.substr(0, head_end));
  raw.erase(0, head_end + 4);
  int status = 0;
  if (std::sscanf(response_head.c_str(), "http/%*s %d", &status) != 1) {
    return fail("malformed response status line");
  }
  const bool chunked = response_head.find("transfer-encoding: chunked") != std::string::npos;

  ChunkDecoder decoder;
  std::string body_text;  // decoded body not yet consumed
  std::string error_body;
  int64_t content_chunks = 0;
  bool saw_usage = false;
  bool stream_done = false;
  Clock::time_point last_token;
  std::string stream_error;

  // Consumes complete SSE lines of body_text at time `now`.
  auto consume = [&](Clock::time_point now) {
    size_t eol;
    while ((eol = body_text.find('\n')) != std::string::npos) {
      std::string line = body_text.substr(0, eol);
      body_text.erase(0, eol + 1);
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line.rfind("data:", 0) != 0) continue;
      std::string data = line.substr(5);
      if (!data.empty() && data[0] == ' ') data.erase(0, 1);
      if (data == "[DONE]") {
        stream_done = true;
        continue;
      }
      json event = json::parse(data, nullptr, /*allow_exceptions=*/false);
      if (event.is_discarded()) continue;
      if (event.contains("error")) {
        stream_error = event["error"].is_object() && event["error"].contains("message")
                           ? event["error"]["message"].dump()
                           : event["error"].dump();
        continue;
      }
      if (record.id.empty()) {
        if (auto id = event.find("id"); id != event.end() && id->is_string()) record.id = *id;
      }
      if (const std::string text = ChunkText(event); !text.empty()) {
        record.text += text;
        if (content_chunks == 0) {
          record.ttft = Seconds(start, now);
        } else {
          record.itls.push_back(Seconds(last_token, now));
        }
        last_token = now;
        ++content_chunks;
      }
      if (auto u = event.find("usage"); u != event.end() && u->is_object()) {
        record.output_tokens = u->value("completion_tokens", int64_t{0});
        record.prompt_tokens = u->value("prompt_tokens", int64_t{0});
        saw_usage = true;
      }
    }
  };

  auto take = [&](Clock::time_point now) -> absl::Status {
    if (status != 200) {
      error_body += raw;
      raw.clear();
      return absl::OkStatus();
    }
    if (chunked) {
      if (absl::Status s = decoder.Feed(&raw, &body_text); !s.ok()) return s;
    } else {
      body_text += raw;
      raw.clear();
    }
    consume(now);
    return absl::OkStatus();
  };

  if (absl::Status s = take(Clock::now()); !s.ok()) return fail(std::string(s.message()));
  while (!stream_done && !(chunked && decoder.done())) {
    absl::StatusOr<bool> more = socket.Receive(&raw);
    if (!more.ok()) return fail(std::string(more.status().message()));
    if (!*more) break;
    if (absl::Status s = take(Clock::now()); !s.ok()) return fail(std::string(s.message()));
  }
  record.e2e = Seconds(start, Clock::now());
  if (status != 200) {
    std::string message = error_body;
    json parsed = json::parse(error_body, nullptr, false);
    if (!parsed.is_discarded() && parsed.contains("error") && parsed["error"].is_object() &&
        parsed["error"].contains("message") && parsed["error"]["message"].is_string()) {
      message = parsed["error"]["message"].get<std::string>();
    }
    if (message.size() > 200) message = message.substr(0, 200) + "...";
    return fail(absl::StrCat("HTTP ", status, ": ", message));
  }
  if (!stream_error.empty()) return fail(absl::StrCat("stream error: ", stream_error));
  if (!stream_done) return fail("stream ended without [DONE]");
  if (content_chunks == 0) return fail("no content in the stream");
  if (!saw_usage) record.output_tokens = content_chunks;
  record.success = true;
  return record;
}

}  // namespace

void FifoGate::Acquire() {
  std::unique_lock<std::mutex> lock(mu_);
  const uint64_t ticket = next_ticket_++;
  cv_.wait(lock, [&] { return ticket == serving_ && (limit_ <= 0 || held_ < limit_); });
  ++serving_;
  ++held_;
  cv_.notify_all();  // the next in line may fit too
}

void FifoGate::Release() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    --held_;
  }
  cv_.notify_all();
}

int64_t FifoGate::waiting() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(next_ticket_ - serving_);
}

absl::StatusOr<BenchResult> RunLoad(const LoadConfig& config,
                                    const std::vector<BenchRequest>& requests) {
  absl::StatusOr<Url> url = ParseUrl(config.url);
  if (!url.ok()) return url.status();
  if (config.endpoint != "completions" && config.endpoint != "chat") {
    return absl::InvalidArgumentError(
        absl::StrCat("--endpoint must be completions or chat (got '", config.endpoint, "')"));
  }
  BenchResult result;
  result.records.resize(requests.size());

  std::atomic<int64_t> sent{0}, finished{0}, failed{0};
  std::vector<std::thread> threads;
  threads.reserve(requests.size());
  const Clock::time_point run_start = Clock::now();
  const int64_t total = static_cast<int64_t>(requests.size());

  // Progress: redrawn on one terminal line until every request has finished.
  std::mutex progress_mu;
  std::condition_variable progress_cv;
  bool progress_done = false;
  std::thread progress_thread;
  auto draw = [&](const char* end) {
    const std::string line = ProgressLine(config.progress_label, total, sent.load(),
                                          finished.load(), failed.load(),
                                          Seconds(run_start, Clock::now()));
    std::fprintf(stderr, "\r%s\033[K%s", line.c_str(), end);
    std::fflush(stderr);
  };
  if (config.progress) {
    progress_thread = std::thread([&] {
      std::unique_lock<std::mutex> lock(progress_mu);
      while (!progress_done) {
        draw("");
        progress_cv.wait_for(lock, std::chrono::milliseconds(200));
      }
    });
  }

  // What is scheduled on the arrival times: each request, or each conversation's turns in order.
  std::vector<std::vector<size_t>> units;
  std::map<int64_t, size_t> unit_of_conversation;
  for (size_t i = 0; i < requests.size(); ++i) {
    if (requests[i].conversation < 0) {
      units.push_back({i});
      continue;
    }
    auto [it, added] = unit_of_conversation.try_emplace(requests[i].conversation, units.size());
    if (added) units.emplace_back();
    units[it->second].push_back(i);
  }
  const std::vector<double> unit_arrivals = ArrivalTimes(
      static_cast<int64_t>(units.size()), config.request_rate, config.burstiness, config.seed);
  // With a think time, each turn takes a slot of its own; else each unit holds one throughout.
  const bool slot_per_turn = config.think_time.has_value();
  FifoGate slots(config.max_concurrency);
  for (size_t u = 0; u < units.size(); ++u) {
    std::this_thread::sleep_until(run_start + std::chrono::duration_cast<Clock::duration>(
                                                  std::chrono::duration<double>(unit_arrivals[u])));
    if (!slot_per_turn) slots.Acquire();
    threads.emplace_back([&, u] {
      std::string history;  // the conversation so far: prompts and answers
      bool broken = false;
      for (size_t n = 0; n < units[u].size(); ++n) {
        const size_t i = units[u][n];
        RequestRecord& record = result.records[i];
        if (broken) {
          ++sent;
          record.error = "an earlier turn of the conversation failed";
          record.start = Seconds(run_start, Clock::now());
        } else {
          if (slot_per_turn) {
            // The user reads the previous answer, then waits for a slot like everyone else.
            if (n > 0 && *config.think_time > 0) {
              std::this_thread::sleep_for(std::chrono::duration_cast<Clock::duration>(
                  std::chrono::duration<double>(*config.think_time)));
            }
            slots.Acquire();
          }
          ++sent;
          if (requests[i].conversation >= 0 && requests[i].turn > 0) {
            BenchRequest turn = requests[i];
            turn.prompt = history + " " + turn.prompt;
            record = SendOne(config, *url, turn, run_start);
            history = turn.prompt + record.text;
          } else {
            record = SendOne(config, *url, requests[i], run_start);
            history = requests[i].prompt + record.text;
          }
          if (slot_per_turn) slots.Release();
        }
        record.turn = requests[i].turn;
        if (!record.success) {
          broken = true;
          ++failed;
        }
        ++finished;
      }
      if (!slot_per_turn) slots.Release();
    });
  }
  for (std::thread& t : threads) t.join();
  if (progress_thread.joinable()) {
    {
      std::lock_guard<std::mutex> lock(progress_mu);
      progress_done = true;
    }
    progress_cv.notify_all();
    progress_thread.join();
    draw("\n");
  }
  double end = 0;
  for (const RequestRecord& r : result.records) end = std::max(end, r.start + r.e2e);
  result.duration = end;
  return result;
}

}  // namespace tandem::tools

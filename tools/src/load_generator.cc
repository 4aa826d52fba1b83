// Load generator behind `tandem bench` (see load_generator.h). One thread per in-flight request
// over a plain blocking socket: simple and exact enough for the rates a single machine serves.
#include "tandem/tools/load_generator.h"

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
#include <mutex>
#include <random>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "tandem/tools/svg_plot.h"

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
      if (!ChunkText(event).empty()) {
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

const char* const kWords[] = {
    "time",    "year",    "people",   "way",     "day",     "man",       "thing",    "woman",
    "life",    "child",   "world",    "school",  "state",   "family",    "student",  "group",
    "country", "problem", "hand",     "part",    "place",   "case",      "week",     "company",
    "system",  "program", "question", "work",    "night",   "point",     "home",     "water",
    "room",    "mother",  "area",     "money",   "story",   "fact",      "month",    "lot",
    "right",   "study",   "book",     "eye",     "job",     "word",      "business", "issue",
    "side",    "kind",    "head",     "house",   "service", "friend",    "father",   "power",
    "hour",    "game",    "line",     "end",     "member",  "law",       "car",      "city",
    "name",    "team",    "minute",   "idea",    "kid",     "body",      "back",     "parent",
    "face",    "level",   "office",   "door",    "health",  "person",    "art",      "war",
    "history", "party",   "result",   "change",  "morning", "reason",    "research", "girl",
    "guy",     "moment",  "air",      "teacher", "force",   "education", "blue",     "green",
    "river",   "stone",   "light",
};

}  // namespace

double RequestRecord::Tpot() const {
  if (output_tokens < 2) return 0;
  return (e2e - ttft) / static_cast<double>(output_tokens - 1);
}

double Percentile(std::vector<double> samples, double p) {
  if (samples.empty()) return 0;
  std::sort(samples.begin(), samples.end());
  const double rank = std::clamp(p, 0.0, 100.0) / 100.0 * static_cast<double>(samples.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(rank));
  const size_t hi = std::min(lo + 1, samples.size() - 1);
  return samples[lo] + (samples[hi] - samples[lo]) * (rank - static_cast<double>(lo));
}

MetricSummary Summarize(const std::vector<double>& samples) {
  MetricSummary s;
  if (samples.empty()) return s;
  double sum = 0;
  for (double v : samples) sum += v;
  s.mean = sum / static_cast<double>(samples.size());
  s.p50 = Percentile(samples, 50);
  s.p90 = Percentile(samples, 90);
  s.p99 = Percentile(samples, 99);
  return s;
}

std::vector<double> ArrivalTimes(int64_t n, double rate, double burstiness, uint64_t seed) {
  std::vector<double> times(static_cast<size_t>(std::max<int64_t>(n, 0)), 0.0);
  if (rate <= 0 || std::isinf(rate) || burstiness <= 0) return times;
  std::mt19937_64 rng(seed);
  // Shape B, scale 1/(rate*B): mean 1/rate, coefficient of variation 1/sqrt(B).
  std::gamma_distribution<double> gap(burstiness, 1.0 / (rate * burstiness));
  double t = 0;
  for (size_t i = 1; i < times.size(); ++i) {
    t += gap(rng);
    times[i] = t;
  }
  return times;
}

namespace {
int64_t MeetingSlos(const std::vector<RequestRecord>& records, double ttft_slo, double tpot_slo) {
  int64_t good = 0;
  for (const RequestRecord& r : records) {
    if (r.success && r.ttft <= ttft_slo && r.Tpot() <= tpot_slo) ++good;
  }
  return good;
}
}  // namespace

double SloAttainment(const std::vector<RequestRecord>& records, double ttft_slo, double tpot_slo) {
  if (records.empty()) return 0;
  return static_cast<double>(MeetingSlos(records, ttft_slo, tpot_slo)) /
         static_cast<double>(records.size());
}

double Goodput(const std::vector<RequestRecord>& records, double duration, double ttft_slo,
               double tpot_slo) {
  if (duration <= 0) return 0;
  return static_cast<double>(MeetingSlos(records, ttft_slo, tpot_slo)) / duration;
}

std::vector<BenchRequest> SyntheticRequests(int64_t input_len, int64_t output_len, int64_t n,
                                            uint64_t seed) {
  const size_t count = static_cast<size_t>(std::max<int64_t>(n, 0));
  return SyntheticRequests(std::vector<int64_t>(count, input_len),
                           std::vector<int64_t>(count, output_len), seed);
}

std::vector<BenchRequest> SyntheticRequests(const std::vector<int64_t>& input_lens,
                                            const std::vector<int64_t>& output_lens,
                                            uint64_t seed) {
  std::mt19937_64 rng(seed);
  constexpr size_t kNumWords = sizeof(kWords) / sizeof(kWords[0]);
  std::uniform_int_distribution<size_t> pick(0, kNumWords - 1);
  std::vector<BenchRequest> out;
  const size_t n = std::min(input_lens.size(), output_lens.size());
  for (size_t i = 0; i < n; ++i) {
    BenchRequest r;
    for (int64_t w = 0; w < input_lens[i]; ++w) {
      if (w > 0) r.prompt += ' ';
      r.prompt += kWords[pick(rng)];
    }
    r.max_tokens = output_lens[i];
    out.push_back(std::move(r));
  }
  return out;
}

absl::Status ValidateLengthDist(const LengthDist& dist, const std::string& flag) {
  if (dist.kind != "fixed" && dist.kind != "uniform" && dist.kind != "normal" &&
      dist.kind != "lognormal") {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, "-dist must be fixed, uniform, normal or lognormal (got '", dist.kind, "')"));
  }
  if (!(dist.mean >= 1)) {
    return absl::InvalidArgumentError(absl::StrCat(flag, " must be at least 1"));
  }
  if (dist.kind == "uniform" && (dist.range < 0 || dist.range >= std::llround(dist.mean))) {
    return absl::InvalidArgumentError(absl::StrCat(flag, "-range must be in [0, ", flag,
                                                   ") for a uniform distribution (got ",
                                                   dist.range, ")"));
  }
  if ((dist.kind == "normal" || dist.kind == "lognormal") && !(dist.std > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, "-dist ", dist.kind, " needs ", flag, "-std > 0"));
  }
  return absl::OkStatus();
}

std::vector<int64_t> SampleLengths(const LengthDist& dist, int64_t n, uint64_t seed) {
  std::vector<int64_t> out(static_cast<size_t>(std::max<int64_t>(n, 0)));
  std::mt19937_64 rng(seed);
  const int64_t mean = std::max<int64_t>(std::llround(dist.mean), 1);
  auto clamp = [](double v) { return std::max<int64_t>(std::llround(v), 1); };
  if (dist.kind == "uniform") {
    std::uniform_int_distribution<int64_t> d(mean - dist.range, mean + dist.range);
    for (int64_t& v : out) v = std::max<int64_t>(d(rng), 1);
  } else if (dist.kind == "normal") {
    std::normal_distribution<double> d(dist.mean, dist.std);
    for (int64_t& v : out) v = clamp(d(rng));
  } else if (dist.kind == "lognormal") {
    // Parameters of the underlying normal for the requested mean and standard deviation.
    const double sigma2 = std::log1p((dist.std * dist.std) / (dist.mean * dist.mean));
    std::lognormal_distribution<double> d(std::log(dist.mean) - sigma2 / 2, std::sqrt(sigma2));
    for (int64_t& v : out) v = clamp(d(rng));
  } else {
    std::fill(out.begin(), out.end(), mean);
  }
  return out;
}

absl::StatusOr<std::vector<BenchRequest>> ShareGptRequests(const std::string& path, int64_t n,
                                                           std::optional<int64_t> output_len) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open dataset ", path));
  json data = json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (data.is_discarded() || !data.is_array()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a JSON array"));
  }
  std::vector<BenchRequest> pool;
  for (const json& entry : data) {
    if (!entry.is_object() || !entry.contains("conversations")) continue;
    const json& turns = entry["conversations"];
    if (!turns.is_array()) continue;
    for (size_t i = 0; i < turns.size(); ++i) {
      const json& t = turns[i];
      if (!t.is_object() || t.value("from", "") != "human" || !t["value"].is_string()) continue;
      BenchRequest r;
      r.prompt = t["value"].get<std::string>();
      if (output_len) {
        r.max_tokens = *output_len;
      } else {
        int64_t words = 0;
        if (i + 1 < turns.size() && turns[i + 1].is_object() &&
            turns[i + 1].value("from", "") == "gpt" && turns[i + 1]["value"].is_string()) {
          std::istringstream ss(turns[i + 1]["value"].get<std::string>());
          std::string w;
          while (ss >> w) ++words;
        }
        r.max_tokens = std::max<int64_t>(words, 1);
      }
      if (!r.prompt.empty()) pool.push_back(std::move(r));
      break;
    }
  }
  if (pool.empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": no human turns"));
  std::vector<BenchRequest> out;
  for (int64_t i = 0; i < n; ++i) out.push_back(pool[static_cast<size_t>(i) % pool.size()]);
  return out;
}

absl::StatusOr<BenchResult> RunLoad(const LoadConfig& config,
                                    const std::vector<BenchRequest>& requests) {
  absl::StatusOr<Url> url = ParseUrl(config.url);
  if (!url.ok()) return url.status();
  if (config.endpoint != "completions" && config.endpoint != "chat") {
    return absl::InvalidArgumentError(
        absl::StrCat("--endpoint must be completions or chat (got '", config.endpoint, "')"));
  }
  const std::vector<double> arrivals = ArrivalTimes(
      static_cast<int64_t>(requests.size()), config.request_rate, config.burstiness, config.seed);
  BenchResult result;
  result.records.resize(requests.size());

  std::mutex mu;
  std::condition_variable cv;
  int64_t in_flight = 0;
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

  for (size_t i = 0; i < requests.size(); ++i) {
    std::this_thread::sleep_until(run_start + std::chrono::duration_cast<Clock::duration>(
                                                  std::chrono::duration<double>(arrivals[i])));
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock,
              [&] { return config.max_concurrency <= 0 || in_flight < config.max_concurrency; });
      ++in_flight;
    }
    ++sent;
    threads.emplace_back([&, i] {
      result.records[i] = SendOne(config, *url, requests[i], run_start);
      if (!result.records[i].success) ++failed;
      ++finished;
      std::lock_guard<std::mutex> lock(mu);
      --in_flight;
      cv.notify_all();
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

json ReportJson(const BenchResult& result, double ttft_slo, double tpot_slo) {
  std::vector<double> ttft, tpot, itl, e2e;
  int64_t succeeded = 0, output_tokens = 0, prompt_tokens = 0;
  json records = json::array();
  for (const RequestRecord& r : result.records) {
    json rec = {{"success", r.success}, {"start_s", r.start}, {"e2e_ms", r.e2e * 1e3}};
    if (r.success) {
      ++succeeded;
      output_tokens += r.output_tokens;
      prompt_tokens += r.prompt_tokens;
      ttft.push_back(r.ttft * 1e3);
      e2e.push_back(r.e2e * 1e3);
      if (r.output_tokens > 1) tpot.push_back(r.Tpot() * 1e3);
      for (double g : r.itls) itl.push_back(g * 1e3);
      json itls_ms = json::array();
      for (double g : r.itls) itls_ms.push_back(g * 1e3);
      rec["ttft_ms"] = r.ttft * 1e3;
      rec["tpot_ms"] = r.Tpot() * 1e3;
      rec["itl_ms"] = itls_ms;
      rec["output_tokens"] = r.output_tokens;
      rec["prompt_tokens"] = r.prompt_tokens;
      if (!r.id.empty()) rec["id"] = r.id;
    } else {
      rec["error"] = r.error;
    }
    records.push_back(std::move(rec));
  }
  auto metric = [](const std::vector<double>& samples) {
    const MetricSummary s = Summarize(samples);
    return json{{"mean", s.mean}, {"p50", s.p50}, {"p90", s.p90}, {"p99", s.p99}};
  };
  const double d = result.duration;
  json report = {
      {"requests_sent", result.records.size()},
      {"requests_succeeded", succeeded},
      {"requests_failed", static_cast<int64_t>(result.records.size()) - succeeded},
      {"duration_s", d},
      {"request_throughput", d > 0 ? succeeded / d : 0.0},
      {"output_tokens", output_tokens},
      {"prompt_tokens", prompt_tokens},
      {"output_token_throughput", d > 0 ? output_tokens / d : 0.0},
      {"ttft_ms", metric(ttft)},
      {"tpot_ms", metric(tpot)},
      {"itl_ms", metric(itl)},
      {"e2e_ms", metric(e2e)},
  };
  if (ttft_slo > 0 && tpot_slo > 0) {
    report["slo"] = {{"ttft_s", ttft_slo},
                     {"tpot_s", tpot_slo},
                     {"attainment", SloAttainment(result.records, ttft_slo, tpot_slo)},
                     {"goodput", Goodput(result.records, d, ttft_slo, tpot_slo)}};
  }
  report["requests"] = std::move(records);
  return report;
}

std::string ReportTable(const json& report) {
  std::string out;
  auto row = [&](const std::string& name, const std::string& value) {
    absl::StrAppendFormat(&out, "%-34s %s\n", name, value);
  };
  row("Requests sent", std::to_string(report["requests_sent"].get<int64_t>()));
  row("Requests succeeded", std::to_string(report["requests_succeeded"].get<int64_t>()));
  row("Requests failed", std::to_string(report["requests_failed"].get<int64_t>()));
  row("Duration (s)", absl::StrFormat("%.3f", report["duration_s"].get<double>()));
  row("Output tokens", std::to_string(report["output_tokens"].get<int64_t>()));
  row("Request throughput (req/s)",
      absl::StrFormat("%.3f", report["request_throughput"].get<double>()));
  row("Output token throughput (tok/s)",
      absl::StrFormat("%.2f", report["output_token_throughput"].get<double>()));
  if (report.contains("slo")) {
    const json& slo = report["slo"];
    row("SLO attainment", absl::StrFormat("%.4f", slo["attainment"].get<double>()));
    row("Goodput (req/s)", absl::StrFormat("%.3f", slo["goodput"].get<double>()));
  }
  absl::StrAppendFormat(&out, "\n%-10s %12s %12s %12s %12s\n", "ms", "mean", "p50", "p90", "p99");
  for (const char* name : {"ttft", "tpot", "itl", "e2e"}) {
    const json& m = report[std::string(name) + "_ms"];
    std::string label = name;
    for (char& c : label) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    absl::StrAppendFormat(&out, "%-10s %12.2f %12.2f %12.2f %12.2f\n", label,
                          m["mean"].get<double>(), m["p50"].get<double>(), m["p90"].get<double>(),
                          m["p99"].get<double>());
  }
  return out;
}

std::string ProgressLine(const std::string& label, int64_t total, int64_t sent, int64_t finished,
                         int64_t failed, double elapsed) {
  constexpr int kBarWidth = 24;
  const int filled =
      total > 0 ? static_cast<int>(kBarWidth * std::clamp<int64_t>(finished, 0, total) / total)
                : kBarWidth;
  std::string bar(static_cast<size_t>(filled), '#');
  bar.resize(kBarWidth, '.');
  return absl::StrFormat("%s%s[%s] %d/%d finished, %d sent, %d failed, %.1fs", label,
                         label.empty() ? "" : " ", bar, finished, total, sent, failed, elapsed);
}

namespace {

// "2 req/s", "inf", or "" when the report has no rate.
std::string RateText(const json& report) {
  auto it = report.find("request_rate");
  if (it == report.end()) return "";
  if (it->is_number()) return absl::StrFormat("%g req/s", it->get<double>());
  if (it->is_string()) return it->get<std::string>() == "inf" ? "all at once" : it->get<std::string>();
  return "";
}

std::string LabelText(const json& report) {
  auto it = report.find("label");
  return it != report.end() && it->is_string() ? it->get<std::string>() : "";
}

}  // namespace

std::string ComparisonTable(const std::vector<json>& reports) {
  size_t width = 14;
  for (const json& r : reports) {
    width = std::max({width, LabelText(r).size() + 2, RateText(r).size() + 2});
  }
  std::string out;
  auto row = [&](const std::string& name, auto&& cell) {
    absl::StrAppendFormat(&out, "%-32s", name);
    for (const json& r : reports) {
      const std::string text = cell(r);
      out += std::string(width > text.size() ? width - text.size() : 1, ' ') + text;
    }
    out += "\n";
  };
  row("", [](const json& r) { return LabelText(r); });
  row("Request rate", [](const json& r) { return RateText(r); });
  bool any_concurrency = false;
  for (const json& r : reports) any_concurrency |= r.value("max_concurrency", int64_t{0}) > 0;
  if (any_concurrency) {
    row("Max concurrency", [](const json& r) {
      const int64_t c = r.value("max_concurrency", int64_t{0});
      return c > 0 ? std::to_string(c) : std::string("unbounded");
    });
  }
  row("Requests succeeded / sent", [](const json& r) {
    return absl::StrCat(r["requests_succeeded"].get<int64_t>(), "/",
                        r["requests_sent"].get<int64_t>());
  });
  row("Duration (s)",
      [](const json& r) { return absl::StrFormat("%.3f", r["duration_s"].get<double>()); });
  row("Request throughput (req/s)", [](const json& r) {
    return absl::StrFormat("%.3f", r["request_throughput"].get<double>());
  });
  row("Output token throughput (tok/s)", [](const json& r) {
    return absl::StrFormat("%.2f", r["output_token_throughput"].get<double>());
  });
  bool any_slo = false;
  for (const json& r : reports) any_slo |= r.contains("slo");
  if (any_slo) {
    row("SLO attainment", [](const json& r) {
      return r.contains("slo") ? absl::StrFormat("%.4f", r["slo"]["attainment"].get<double>())
                               : std::string("-");
    });
    row("Goodput (req/s)", [](const json& r) {
      return r.contains("slo") ? absl::StrFormat("%.3f", r["slo"]["goodput"].get<double>())
                               : std::string("-");
    });
  }
  for (const char* name : {"ttft", "tpot", "itl", "e2e"}) {
    std::string upper = name;
    for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    for (const char* stat : {"mean", "p50", "p90", "p99"}) {
      row(absl::StrCat(upper, " ", stat, " (ms)"), [&](const json& r) {
        return absl::StrFormat("%.2f", r[std::string(name) + "_ms"][stat].get<double>());
      });
    }
  }
  return out;
}

std::map<std::string, std::string> BenchPlots(const std::vector<json>& reports) {
  std::map<std::string, std::string> files;
  // Name each report by what differs between them.
  std::vector<std::string> labels, rates;
  for (const json& r : reports) {
    if (std::find(labels.begin(), labels.end(), LabelText(r)) == labels.end()) {
      labels.push_back(LabelText(r));
    }
    if (std::find(rates.begin(), rates.end(), RateText(r)) == rates.end()) {
      rates.push_back(RateText(r));
    }
  }
  auto series_name = [&](const json& r) {
    std::string label = LabelText(r);
    if (rates.size() > 1 || label.empty()) {
      label = label.empty() ? RateText(r) : absl::StrCat(label, " @ ", RateText(r));
    }
    return label.empty() ? std::string("run") : label;
  };

  auto panel = [](std::string title, std::string x_label, std::string y_label) {
    PlotPanel p;
    p.title = std::move(title);
    p.x_label = std::move(x_label);
    p.y_label = std::move(y_label);
    return p;
  };
  std::vector<PlotPanel> cdfs = {
      panel("TTFT", "time to first token (ms)", "fraction of requests"),
      panel("TPOT", "time per output token (ms)", "fraction of requests"),
      panel("E2E", "end-to-end latency (ms)", "fraction of requests")};
  const char* const keys[] = {"ttft_ms", "tpot_ms", "e2e_ms"};
  for (size_t k = 0; k < cdfs.size(); ++k) {
    cdfs[k].x_min = 0;
    cdfs[k].y_min = 0;
    cdfs[k].y_max = 1;
    for (const json& r : reports) {
      PlotSeries s;
      s.name = series_name(r);
      for (const json& rec : r.value("requests", json::array())) {
        if (!rec.value("success", false) || !rec.contains(keys[k])) continue;
        if (k == 1 && rec.value("output_tokens", int64_t{0}) < 2) continue;  // no TPOT
        s.x.push_back(rec[keys[k]].get<double>());
      }
      std::sort(s.x.begin(), s.x.end());
      for (size_t i = 0; i < s.x.size(); ++i) {
        s.y.push_back(static_cast<double>(i + 1) / static_cast<double>(s.x.size()));
      }
      cdfs[k].series.push_back(std::move(s));
    }
  }
  files["latency_cdf.svg"] = RenderSvg("Latency CDFs", cdfs);

  bool rate_plot = !reports.empty();
  for (const json& r : reports) {
    rate_plot &= r.contains("slo") && r.contains("request_rate") && r["request_rate"].is_number();
  }
  if (rate_plot) {
    const json& slo = reports.front()["slo"];
    PlotPanel attainment = panel("SLO attainment", "request rate (req/s)",
                                 "requests meeting both SLOs (fraction)");
    attainment.x_min = 0;
    attainment.y_min = 0;
    attainment.y_max = 1;
    PlotPanel goodput =
        panel("Goodput (solid) and throughput (dashed)", "request rate (req/s)", "requests/s");
    goodput.x_min = 0;
    goodput.y_min = 0;
    for (const std::string& label : labels) {
      std::vector<const json*> mine;
      for (const json& r : reports) {
        if (LabelText(r) == label) mine.push_back(&r);
      }
      std::stable_sort(mine.begin(), mine.end(), [](const json* a, const json* b) {
        return (*a)["request_rate"].get<double>() < (*b)["request_rate"].get<double>();
      });
      const std::string name = label.empty() ? "run" : label;
      PlotSeries att, good, thr;
      att.name = good.name = name;
      thr.name = absl::StrCat(name, " throughput");
      thr.group = name;
      att.markers = good.markers = thr.markers = true;
      thr.dashed = true;
      for (const json* r : mine) {
        const double rate = (*r)["request_rate"].get<double>();
        att.x.push_back(rate);
        att.y.push_back((*r)["slo"]["attainment"].get<double>());
        good.x.push_back(rate);
        good.y.push_back((*r)["slo"]["goodput"].get<double>());
        thr.x.push_back(rate);
        thr.y.push_back((*r)["request_throughput"].get<double>());
      }
      attainment.series.push_back(std::move(att));
      goodput.series.push_back(std::move(good));
      goodput.series.push_back(std::move(thr));
    }
    files["attainment_vs_rate.svg"] = RenderSvg(
        absl::StrFormat("SLO attainment and goodput vs request rate (TTFT <= %g s, TPOT <= %g s)",
                        slo["ttft_s"].get<double>(), slo["tpot_s"].get<double>()),
        {attainment, goodput});
  }
  return files;
}

}  // namespace tandem::tools

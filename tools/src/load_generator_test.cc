#include "tandem/tools/load_generator.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <map>
#include <mutex>
#include <numeric>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace tandem::tools {
namespace {

size_t Count(const std::string& haystack, const std::string& needle) {
  size_t n = 0;
  for (size_t at = haystack.find(needle); at != std::string::npos;
       at = haystack.find(needle, at + 1)) {
    ++n;
  }
  return n;
}

TEST(PercentileTest, KnownSamples) {
  const std::vector<double> samples = {5, 1, 4, 2, 3};  // unsorted on purpose
  EXPECT_DOUBLE_EQ(Percentile(samples, 0), 1);
  EXPECT_DOUBLE_EQ(Percentile(samples, 50), 3);
  EXPECT_DOUBLE_EQ(Percentile(samples, 100), 5);
  EXPECT_DOUBLE_EQ(Percentile(samples, 90), 4.6);  // rank 3.6: 4 + 0.6 * (5 - 4)
  EXPECT_DOUBLE_EQ(Percentile(samples, 25), 2);
  EXPECT_DOUBLE_EQ(Percentile({}, 50), 0);
  EXPECT_DOUBLE_EQ(Percentile({7}, 99), 7);

  std::vector<double> hundred(101);
  std::iota(hundred.begin(), hundred.end(), 0.0);  // 0..100
  const MetricSummary s = Summarize(hundred);
  EXPECT_DOUBLE_EQ(s.mean, 50);
  EXPECT_DOUBLE_EQ(s.p50, 50);
  EXPECT_DOUBLE_EQ(s.p90, 90);
  EXPECT_DOUBLE_EQ(s.p99, 99);
}

// Mean and coefficient of variation of the gaps between consecutive arrivals.
std::pair<double, double> GapStats(const std::vector<double>& times) {
  std::vector<double> gaps;
  for (size_t i = 1; i < times.size(); ++i) gaps.push_back(times[i] - times[i - 1]);
  double mean = std::accumulate(gaps.begin(), gaps.end(), 0.0) / gaps.size();
  double var = 0;
  for (double g : gaps) var += (g - mean) * (g - mean);
  var /= gaps.size();
  return {mean, std::sqrt(var) / mean};
}

TEST(ArrivalTimesTest, PoissonMeanGapIsInverseRate) {
  const std::vector<double> t = ArrivalTimes(200001, /*rate=*/4.0, /*burstiness=*/1.0, 7);
  ASSERT_EQ(t.size(), 200001u);
  EXPECT_EQ(t[0], 0);
  for (size_t i = 1; i < t.size(); ++i) ASSERT_GE(t[i], t[i - 1]);
  auto [mean, cv] = GapStats(t);
  EXPECT_NEAR(mean, 0.25, 0.25 * 0.01);
  EXPECT_NEAR(cv, 1.0, 0.02);  // exponential gaps
}

TEST(ArrivalTimesTest, GammaCvIsInverseSqrtBurstiness) {
  for (double b : {0.25, 4.0}) {
    auto [mean, cv] = GapStats(ArrivalTimes(200001, 10.0, b, 11));
    EXPECT_NEAR(mean, 0.1, 0.1 * 0.02) << "burstiness " << b;
    EXPECT_NEAR(cv, 1.0 / std::sqrt(b), 0.05 / std::sqrt(b)) << "burstiness " << b;
  }
}

TEST(ArrivalTimesTest, InfiniteRateSendsAllAtOnce) {
  for (double t : ArrivalTimes(10, INFINITY, 1.0, 0)) EXPECT_EQ(t, 0);
  for (double t : ArrivalTimes(10, 0, 1.0, 0)) EXPECT_EQ(t, 0);
  EXPECT_EQ(ArrivalTimes(10, 5, 1.0, 3), ArrivalTimes(10, 5, 1.0, 3));  // seeded
}

RequestRecord Record(bool success, double ttft, double e2e, int64_t tokens) {
  RequestRecord r;
  r.success = success;
  r.ttft = ttft;
  r.e2e = e2e;
  r.output_tokens = tokens;
  return r;
}

TEST(SloTest, AttainmentAndGoodputOnHandMadeSet) {
  const std::vector<RequestRecord> records = {
      Record(true, 0.1, 1.1, 11),  // tpot 0.1: meets both
      Record(true, 0.5, 1.5, 11),  // ttft misses
      Record(true, 0.1, 3.1, 11),  // tpot 0.3 misses
      Record(true, 0.2, 0.2, 1),   // one token: tpot 0, meets both
      Record(false, 0.0, 0.1, 0),  // failed: misses
  };
  EXPECT_DOUBLE_EQ(records[0].Tpot(), 0.1);
  EXPECT_DOUBLE_EQ(SloAttainment(records, 0.3, 0.15), 2.0 / 5.0);
  EXPECT_DOUBLE_EQ(Goodput(records, 4.0, 0.3, 0.15), 0.5);
  EXPECT_DOUBLE_EQ(SloAttainment(records, 1.0, 1.0), 4.0 / 5.0);
  EXPECT_DOUBLE_EQ(SloAttainment({}, 1.0, 1.0), 0);
  EXPECT_DOUBLE_EQ(Goodput(records, 0, 1.0, 1.0), 0);
}

TEST(SyntheticRequestsTest, FixedLengths) {
  const std::vector<BenchRequest> r = SyntheticRequests(16, 8, 3, 1);
  ASSERT_EQ(r.size(), 3u);
  for (const BenchRequest& q : r) {
    EXPECT_EQ(std::count(q.prompt.begin(), q.prompt.end(), ' '), 15);
    EXPECT_EQ(q.max_tokens, 8);
  }
}

TEST(RunLoadTest, ConnectionRefusedIsAFailedRequest) {
  LoadConfig config;
  config.url = "http://127.0.0.1:1";
  config.model = "m";
  absl::StatusOr<BenchResult> result = RunLoad(config, SyntheticRequests(4, 4, 2, 0));
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(result->records.size(), 2u);
  for (const RequestRecord& r : result->records) {
    EXPECT_FALSE(r.success);
    EXPECT_NE(r.error.find("cannot connect"), std::string::npos) << r.error;
  }
  config.url = "https://x";
  EXPECT_FALSE(RunLoad(config, {}).ok());
}

LengthDist Dist(std::string kind, double mean, int64_t range = 0, double std = 0) {
  LengthDist d;
  d.kind = std::move(kind);
  d.mean = mean;
  d.range = range;
  d.std = std;
  return d;
}

TEST(SampleLengthsTest, Distributions) {
  LengthDist fixed = Dist("fixed", 12);
  for (int64_t v : SampleLengths(fixed, 10, 0)) EXPECT_EQ(v, 12);

  LengthDist uniform = Dist("uniform", 100, 20);
  const std::vector<int64_t> u = SampleLengths(uniform, 20000, 1);
  EXPECT_EQ(*std::min_element(u.begin(), u.end()), 80);
  EXPECT_EQ(*std::max_element(u.begin(), u.end()), 120);
  EXPECT_EQ(u, SampleLengths(uniform, 20000, 1));  // seeded
  EXPECT_NE(u, SampleLengths(uniform, 20000, 2));

  auto stats = [](const std::vector<int64_t>& v) {
    double mean = 0, var = 0;
    for (int64_t x : v) mean += static_cast<double>(x);
    mean /= static_cast<double>(v.size());
    for (int64_t x : v) var += (static_cast<double>(x) - mean) * (static_cast<double>(x) - mean);
    return std::pair<double, double>(mean, std::sqrt(var / static_cast<double>(v.size())));
  };
  for (const char* kind : {"normal", "lognormal"}) {
    LengthDist d = Dist(kind, 200, 0, 50);
    const std::vector<int64_t> v = SampleLengths(d, 100000, 3);
    auto [mean, std] = stats(v);
    EXPECT_NEAR(mean, 200, 2) << kind;
    EXPECT_NEAR(std, 50, 2) << kind;
    EXPECT_GE(*std::min_element(v.begin(), v.end()), 1) << kind;
  }
  // Clamped to at least one.
  LengthDist wide = Dist("normal", 2, 0, 50);
  for (int64_t v : SampleLengths(wide, 1000, 4)) EXPECT_GE(v, 1);
}

TEST(SampleLengthsTest, Validation) {
  EXPECT_TRUE(ValidateLengthDist(Dist("fixed", 8), "--input-len").ok());
  EXPECT_FALSE(ValidateLengthDist(Dist("gauss", 8), "--input-len").ok());
  EXPECT_FALSE(ValidateLengthDist(Dist("fixed", 0), "--input-len").ok());
  EXPECT_FALSE(ValidateLengthDist(Dist("uniform", 8, 8), "--input-len").ok());
  EXPECT_TRUE(ValidateLengthDist(Dist("uniform", 8, 7), "--input-len").ok());
  EXPECT_FALSE(ValidateLengthDist(Dist("normal", 8, 0, 0), "--input-len").ok());
  const absl::Status s = ValidateLengthDist(Dist("lognormal", 8, 0, 0), "--output-len");
  EXPECT_NE(s.message().find("--output-len-std"), std::string::npos) << s;
}

TEST(SyntheticRequestsTest, PerRequestLengthsMatchFixedOverload) {
  const std::vector<BenchRequest> a = SyntheticRequests(5, 3, 4, 9);
  const std::vector<BenchRequest> b = SyntheticRequests({5, 5, 5, 5}, {3, 3, 3, 3}, 9);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i].prompt, b[i].prompt);
  const std::vector<BenchRequest> c = SyntheticRequests({1, 7}, {2, 9}, 9);
  EXPECT_EQ(std::count(c[0].prompt.begin(), c[0].prompt.end(), ' '), 0);
  EXPECT_EQ(std::count(c[1].prompt.begin(), c[1].prompt.end(), ' '), 6);
  EXPECT_EQ(c[1].max_tokens, 9);
}

TEST(ProgressLineTest, CountsAndBar) {
  const std::string line = ProgressLine("colocated @ 2 req/s", 8, 6, 4, 1, 3.25);
  EXPECT_EQ(line, "colocated @ 2 req/s [############............] 4/8 finished, 6 sent, "
                  "1 failed, 3.2s");
  EXPECT_EQ(ProgressLine("", 0, 0, 0, 0, 0).rfind("[########################] 0/0", 0), 0u);
}

// A streaming OpenAI-style server on a loopback port: every request gets `tokens` chunks, each
// sent at least `gap_ms` after the previous one (and the first `gap_ms` after the request),
// then usage and [DONE]. It records the most requests in progress at once (counted until just
// before [DONE]: a client may start its next request as soon as it reads it, possibly before
// this thread runs again). Every thread it starts is joined by its destructor.
class FakeServer {
 public:
  FakeServer(int tokens, int gap_ms) : tokens_(tokens), gap_ms_(gap_ms) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    ::listen(fd_, 64);
    socklen_t len = sizeof(addr);
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    accept_thread_ = std::jthread([this] {
      while (true) {
        const int c = ::accept(fd_, nullptr, nullptr);
        if (c < 0) return;
        std::lock_guard lock(mu_);
        connections_.push_back(c);
        serve_threads_.emplace_back([this, c] { Serve(c); });
      }
    });
  }
  ~FakeServer() {
    ::shutdown(fd_, SHUT_RDWR);  // accept() fails: the accept thread ends
    accept_thread_.join();
    ::close(fd_);
    // A connection still waiting for its request (none in a passing test) is woken by the
    // shutdown; sockets are closed only after every thread that uses them has been joined.
    for (int c : connections_) ::shutdown(c, SHUT_RDWR);
    serve_threads_.clear();  // joins
    for (int c : connections_) ::close(c);
  }
  std::string url() const { return absl::StrCat("http://127.0.0.1:", port_); }
  int max_open() const { return max_in_flight_; }
  // Request bodies received, in arrival order.
  std::vector<std::string> bodies() {
    std::lock_guard lock(mu_);
    return bodies_;
  }

 private:
  void Serve(int c) {
    const int now = ++in_flight_;
    for (int m = max_in_flight_; now > m && !max_in_flight_.compare_exchange_weak(m, now);) {
    }
    std::string in;
    char buf[4096];
    while (in.find("\r\n\r\n") == std::string::npos) {
      const ssize_t n = ::recv(c, buf, sizeof(buf), 0);
      if (n <= 0) break;
      in.append(buf, static_cast<size_t>(n));
    }
    // The body, by Content-Length (RunLoad sends it).
    const size_t head_end = in.find("\r\n\r\n");
    const size_t cl = in.find("Content-Length: ");
    if (head_end != std::string::npos && cl != std::string::npos && cl < head_end) {
      const size_t want = std::stoul(in.substr(cl + 16)) + head_end + 4;
      while (in.size() < want) {
        const ssize_t n = ::recv(c, buf, sizeof(buf), 0);
        if (n <= 0) break;
        in.append(buf, static_cast<size_t>(n));
      }
      std::lock_guard lock(mu_);
      bodies_.push_back(in.substr(head_end + 4));
    }
    auto send = [&](const std::string& s) { ::send(c, s.data(), s.size(), MSG_NOSIGNAL); };
    auto chunk = [&](const std::string& data) {
      const std::string event = absl::StrCat("data: ", data, "\n\n");
      char size[32];
      std::snprintf(size, sizeof(size), "%zx\r\n", event.size());
      send(absl::StrCat(size, event, "\r\n"));
    };
    send("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n");
    const int id = ++served_;
    for (int i = 0; i < tokens_; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(gap_ms_));
      chunk(absl::StrCat(R"({"id":"cmpl-)", id, R"(","choices":[{"index":0,"text":"tok "}]})"));
    }
    chunk(absl::StrCat(R"({"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":)",
                       tokens_, "}}"));
    --in_flight_;
    chunk("[DONE]");
    send("0\r\n\r\n");
    ::shutdown(c, SHUT_WR);  // end of the response (Connection: close); closed by ~FakeServer
  }
  int tokens_, gap_ms_;
  int fd_ = -1;
  int port_ = 0;
  std::atomic<int> in_flight_{0}, max_in_flight_{0}, served_{0};
  std::mutex mu_;  // guards connections_ and serve_threads_ while the accept thread runs
  std::vector<int> connections_;
  std::vector<std::string> bodies_;
  std::vector<std::jthread> serve_threads_;
  std::jthread accept_thread_;
};

TEST(RunLoadTest, PerChunkItlsTpotAndMaxConcurrency) {
  FakeServer server(/*tokens=*/5, /*gap_ms=*/30);
  LoadConfig config;
  config.url = server.url();
  config.model = "m";
  config.max_concurrency = 2;
  config.request_rate = 1000;  // arrivals nearly at once: the cap is what limits
  absl::StatusOr<BenchResult> result = RunLoad(config, SyntheticRequests(4, 5, 6, 0));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(server.max_open(), 2);
  // How the chunks were spread out is up to the scheduler of a loaded machine; what holds
  // anyway: the first chunk came at least one gap after the request was sent, the last at
  // least five gaps after it, and the gaps measured add up to the time between them.
  for (const RequestRecord& r : result->records) {
    ASSERT_TRUE(r.success) << r.error;
    EXPECT_EQ(r.output_tokens, 5);
    ASSERT_EQ(r.itls.size(), 4u);  // one gap per chunk after the first
    for (double g : r.itls) EXPECT_GE(g, 0);
    const double last_token = r.ttft + std::accumulate(r.itls.begin(), r.itls.end(), 0.0);
    EXPECT_GE(r.ttft, 0.030 - 1e-6);
    EXPECT_GE(last_token, 5 * 0.030 - 1e-6);
    EXPECT_LE(last_token, r.e2e + 1e-6);
    EXPECT_DOUBLE_EQ(r.Tpot(), (r.e2e - r.ttft) / 4);
  }
  // Six requests, two at a time, each about 150 ms: at least three rounds.
  EXPECT_GE(result->duration, 3 * 0.150 - 0.02);
  // Each record keeps its response's id, which the JSON report carries (calibration pairs it
  // with the server's step trace).
  std::set<std::string> ids;
  for (const RequestRecord& r : result->records) ids.insert(r.id);
  EXPECT_EQ(ids, (std::set<std::string>{"cmpl-1", "cmpl-2", "cmpl-3", "cmpl-4", "cmpl-5",
                                        "cmpl-6"}));
  const nlohmann::json report = ReportJson(*result, 0, 0);
  EXPECT_EQ(report["requests"][0]["id"].get<std::string>().rfind("cmpl-", 0), 0u);
}

TEST(MultiTurnRequestsTest, ConversationsShareTheSystemPrompt) {
  const std::vector<BenchRequest> r = MultiTurnRequests(2, 3, 5, 2, 7, 1);
  ASSERT_EQ(r.size(), 6u);
  const std::string system =
      r[0].prompt.substr(0, r[0].prompt.rfind(' ', r[0].prompt.rfind(' ') - 1));
  EXPECT_EQ(r[3].prompt.rfind(system, 0), 0u);  // conversation 1 starts with it too
  for (size_t i = 0; i < r.size(); ++i) {
    EXPECT_EQ(r[i].conversation, static_cast<int64_t>(i / 3));
    EXPECT_EQ(r[i].turn, static_cast<int>(i % 3));
    EXPECT_EQ(r[i].max_tokens, 7);
    // Later turns are the user's message alone (RunLoad puts the history before it).
    if (i % 3 > 0) EXPECT_EQ(std::count(r[i].prompt.begin(), r[i].prompt.end(), ' '), 1);
  }
  // No message: the first turn is exactly the system prompt.
  const std::vector<BenchRequest> same = MultiTurnRequests(2, 1, 50, 0, 7, 1);
  EXPECT_EQ(same[0].prompt, same[1].prompt);
  EXPECT_EQ(std::count(same[0].prompt.begin(), same[0].prompt.end(), ' '), 49);
}

TEST(RunLoadTest, MultiTurnResendsTheHistoryTurnAfterTurn) {
  FakeServer server(/*tokens=*/3, /*gap_ms=*/1);
  LoadConfig config;
  config.url = server.url();
  config.model = "m";
  config.max_concurrency = 1;  // one conversation at a time: bodies arrive in order
  const std::vector<BenchRequest> requests = MultiTurnRequests(2, 3, 4, 2, 3, 9);
  absl::StatusOr<BenchResult> result = RunLoad(config, requests);
  ASSERT_TRUE(result.ok()) << result.status();
  const std::vector<std::string> bodies = server.bodies();
  ASSERT_EQ(bodies.size(), 6u);
  for (int c = 0; c < 2; ++c) {
    std::string history;
    for (int t = 0; t < 3; ++t) {
      const size_t i = static_cast<size_t>(c * 3 + t);
      const nlohmann::json body = nlohmann::json::parse(bodies[i]);
      const std::string want =
          t == 0 ? requests[i].prompt : absl::StrCat(history, " ", requests[i].prompt);
      EXPECT_EQ(body["prompt"].get<std::string>(), want) << c << "/" << t;
      history = want + "tok tok tok ";  // the fake server's answer
      ASSERT_TRUE(result->records[i].success) << result->records[i].error;
      EXPECT_EQ(result->records[i].turn, t);
      EXPECT_EQ(result->records[i].text, "tok tok tok ");
    }
  }
  const nlohmann::json report = ReportJson(*result, 0, 0);
  ASSERT_EQ(report["ttft_ms_by_turn"].size(), 3u);
  EXPECT_EQ(report["ttft_ms_by_turn"][2]["turn"].get<int>(), 2);
  EXPECT_EQ(report["ttft_ms_by_turn"][2]["count"].get<int>(), 2);
  EXPECT_NE(ReportTable(report).find("TTFT t2"), std::string::npos);
}

// A user who reads between turns holds no slot meanwhile: turns of other conversations go in
// between, each with its own conversation's history, never more than the limit at once.
TEST(RunLoadTest, WithAThinkTimeTheLimitCountsTurns) {
  FakeServer server(/*tokens=*/2, /*gap_ms=*/1);
  LoadConfig config;
  config.url = server.url();
  config.model = "m";
  config.max_concurrency = 2;
  config.think_time = 0;
  const std::vector<BenchRequest> requests = MultiTurnRequests(5, 3, 4, 2, 2, 3);
  absl::StatusOr<BenchResult> result = RunLoad(config, requests);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_LE(server.max_open(), 2);
  // Whatever the order the turns came in, each carries its own conversation's history.
  std::map<std::string, std::string> received;  // prompt -> itself, to look up by prefix
  for (const std::string& body : server.bodies()) {
    const std::string prompt = nlohmann::json::parse(body)["prompt"].get<std::string>();
    received[prompt] = prompt;
  }
  ASSERT_EQ(received.size(), 15u);
  for (int c = 0; c < 5; ++c) {
    std::string history;
    for (int t = 0; t < 3; ++t) {
      const size_t i = static_cast<size_t>(c * 3 + t);
      const std::string want =
          t == 0 ? requests[i].prompt : absl::StrCat(history, " ", requests[i].prompt);
      EXPECT_EQ(received.count(want), 1u) << c << "/" << t;
      ASSERT_TRUE(result->records[i].success) << result->records[i].error;
      history = want + "tok tok ";
    }
  }
}

// First come, first served: a holder that gives its slot back and asks again waits behind
// those already waiting (so one conversation cannot keep the slot turn after turn).
TEST(FifoGateTest, ASlotGoesToTheLongestWaiting) {
  FifoGate gate(1);
  gate.Acquire();
  std::vector<int> order;
  std::mutex order_mu;
  auto take = [&](int who) {
    gate.Acquire();
    {
      std::lock_guard<std::mutex> lock(order_mu);
      order.push_back(who);
    }
    gate.Release();
  };
  std::jthread first(take, 1);
  while (gate.waiting() < 1) std::this_thread::yield();
  std::jthread second(take, 2);
  while (gate.waiting() < 2) std::this_thread::yield();
  gate.Release();
  gate.Acquire();  // in line behind both
  EXPECT_EQ(order, (std::vector<int>{1, 2}));
  gate.Release();
  FifoGate unbounded(0);
  for (int i = 0; i < 3; ++i) unbounded.Acquire();
  EXPECT_EQ(unbounded.waiting(), 0);
}

TEST(RunLoadTest, AFailedTurnEndsItsConversation) {
  LoadConfig config;
  config.url = "http://127.0.0.1:1";  // nothing listens
  config.model = "m";
  absl::StatusOr<BenchResult> result = RunLoad(config, MultiTurnRequests(1, 3, 0, 2, 3, 0));
  ASSERT_TRUE(result.ok());
  ASSERT_EQ(result->records.size(), 3u);
  for (const RequestRecord& r : result->records) EXPECT_FALSE(r.success);
  EXPECT_EQ(result->records[2].error, "an earlier turn of the conversation failed");
}

// Two reports as `tandem bench` labels them, with per-request records.
std::vector<nlohmann::json> TwoReports() {
  std::vector<nlohmann::json> reports;
  for (const char* label : {"colocated", "disaggregated"}) {
    for (double rate : {1.0, 2.0}) {
      BenchResult result;
      for (int i = 0; i < 5; ++i) result.records.push_back(Record(true, 0.1 * (i + 1), 1.0, 11));
      result.records.push_back(Record(false, 0, 0.1, 0));
      result.duration = 4;
      nlohmann::json report = ReportJson(result, 0.35, 0.1);
      report["label"] = label;
      report["request_rate"] = rate;
      reports.push_back(std::move(report));
    }
  }
  return reports;
}

TEST(ComparisonTableTest, OneColumnPerReport) {
  const std::string table = ComparisonTable(TwoReports());
  EXPECT_NE(table.find("colocated"), std::string::npos);
  EXPECT_NE(table.find("disaggregated"), std::string::npos);
  EXPECT_NE(table.find("2 req/s"), std::string::npos);
  EXPECT_NE(table.find("Goodput (req/s)"), std::string::npos);
  EXPECT_NE(table.find("5/6"), std::string::npos);
  EXPECT_NE(table.find("TPOT p99 (ms)"), std::string::npos);
}

TEST(BenchPlotsTest, CdfAndAttainmentFiles) {
  const std::map<std::string, std::string> files = BenchPlots(TwoReports());
  ASSERT_EQ(files.size(), 2u);
  const std::string& cdf = files.at("latency_cdf.svg");
  const std::string& att = files.at("attainment_vs_rate.svg");
  // Three panels, four series each (two labels at two rates).
  EXPECT_EQ(Count(cdf, "<polyline"), 12u);
  EXPECT_NE(cdf.find("data-series=\"colocated @ 2 req/s\""), std::string::npos);
  // Attainment: one line per label; goodput and throughput: two per label; a marker per rate.
  EXPECT_EQ(Count(att, "<polyline"), 6u);
  EXPECT_EQ(Count(att, "<circle"), 12u);
  // No SLOs or an infinite rate: no attainment plot.
  std::vector<nlohmann::json> no_slo = TwoReports();
  no_slo[0].erase("slo");
  EXPECT_EQ(BenchPlots(no_slo).count("attainment_vs_rate.svg"), 0u);
}

}  // namespace
}  // namespace tandem::tools

// `tandem serve` end to end over raw HTTP: many concurrent streams, cancellation freeing KV
// blocks, the Prometheus exposition (checked by promtool), authentication, overload and
// shutdown. Uses the tiny synthetic model written by the api_tiny_model fixture.
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "api_test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace tandem::api_test {
namespace {

using nlohmann::json;
using ::testing::HasSubstr;
using ::testing::Not;

std::unique_ptr<ServerProcess> StartServer(const std::vector<std::string>& args = {}) {
  std::string error;
  auto server = ServerProcess::Start(args, &error);
  EXPECT_NE(server, nullptr) << error;
  return server;
}

std::string Metrics(int port, const std::vector<std::string>& headers = {}) {
  HttpResult r = Request(port, "GET", "/metrics", "", headers);
  EXPECT_EQ(r.status, 200);
  return r.body;
}

// True when `series` is in the exposition with exactly `value`.
bool Has(const std::string& metrics, const std::string& series, double value) {
  return MetricValue(metrics, series) == value;
}

// Fault injection for the tests that must act while a request is still generating: every
// engine step waits this long first, so a request of N steps runs for at least N times this on
// any machine (a slow or loaded one only makes it longer).
constexpr const char* kStepDelayMs = "20";

// Sends a streamed completion on a fresh connection and reads until its first content chunk
// has arrived; returns the socket and appends what was read to *received.
int StartStream(int port, const std::string& body, std::string* received) {
  int fd = Connect(port);
  if (fd < 0) return -1;
  if (!SendAll(fd, "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: " +
                       std::to_string(body.size()) + "\r\n\r\n" + body)) {
    close(fd);
    return -1;
  }
  char buf[4096];
  while (received->find("data: ") == std::string::npos) {
    ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) {
      close(fd);
      return -1;
    }
    received->append(buf, static_cast<size_t>(n));
  }
  return fd;
}

// The text of a streamed completion, checked chunk by chunk: one id throughout, only choice 0,
// a finish reason only on the last content chunk, then a usage chunk with no choices, then
// [DONE]. Returns the text and sets the usage's completion_tokens.
std::string CheckStream(const std::string& body, int* completion_tokens) {
  std::vector<std::string> events = SseEvents(body);
  EXPECT_GE(events.size(), 3u) << body;
  if (events.size() < 3) return "";
  EXPECT_EQ(events.back(), "[DONE]");
  std::string text;
  std::string id;
  bool finished = false;
  for (size_t i = 0; i + 2 < events.size(); ++i) {
    json chunk = json::parse(events[i]);
    if (id.empty()) id = chunk["id"];
    EXPECT_EQ(chunk["id"], id);
    EXPECT_EQ(chunk["object"], "text_completion");
    EXPECT_EQ(chunk["choices"].size(), 1u);
    EXPECT_EQ(chunk["choices"][0]["index"], 0);
    EXPECT_FALSE(finished) << "a chunk after the finish reason";
    text += chunk["choices"][0]["text"].get<std::string>();
    finished = !chunk["choices"][0]["finish_reason"].is_null();
  }
  EXPECT_TRUE(finished);
  json usage = json::parse(events[events.size() - 2]);
  EXPECT_EQ(usage["id"], id);
  EXPECT_TRUE(usage["choices"].is_array() && usage["choices"].empty());
  *completion_tokens = usage["usage"]["completion_tokens"];
  EXPECT_EQ(usage["usage"]["total_tokens"].get<int>(),
            usage["usage"]["prompt_tokens"].get<int>() + *completion_tokens);
  return text;
}

std::string CompletionBody(const std::string& prompt, int max_tokens, bool stream, int n = 1) {
  json body = {{"prompt", prompt},
               {"max_tokens", max_tokens},
               {"temperature", 0},
               {"ignore_eos", true},
               {"n", n}};
  if (stream) {
    body["stream"] = true;
    body["stream_options"] = {{"include_usage", true}};
  }
  return body.dump();
}

TEST(ApiServerTest, TwoHundredConcurrentStreamsAllFinishCorrectly) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  const int port = server->port();
  const std::vector<std::string> prompts = {"Once upon a time", "The cat", "Hello there",
                                            "In the beginning"};
  constexpr int kMaxTokens = 8;
  // Greedy references, one request at a time.
  std::vector<std::string> expected;
  for (const std::string& p : prompts) {
    HttpResult r = Request(port, "POST", "/v1/completions", CompletionBody(p, kMaxTokens, false));
    ASSERT_EQ(r.status, 200) << r.body;
    expected.push_back(json::parse(r.body)["choices"][0]["text"]);
  }

  constexpr int kClients = 200;
  std::vector<HttpResult> results(kClients);
  std::vector<std::jthread> clients;
  std::atomic<int> arrived{0}, connected{0};
  for (int i = 0; i < kClients; ++i) {
    clients.emplace_back([&, i] {
      const std::string body = CompletionBody(prompts[i % prompts.size()], kMaxTokens, true);
      int fd = Connect(port);
      if (fd >= 0) ++connected;
      // Every client has tried to connect before any sends (a failed one counts too, so the
      // others never wait for it).
      ++arrived;
      while (arrived.load() < kClients) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      if (fd < 0) return;
      std::string raw =
          "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
          "Content-Length: " +
          std::to_string(body.size()) + "\r\n\r\n" + body;
      if (SendAll(fd, raw)) results[i] = ReadResponse(fd);
      close(fd);
    });
  }
  for (std::jthread& t : clients) t.join();
  ASSERT_EQ(connected.load(), kClients) << "not every client could connect";
  for (int i = 0; i < kClients; ++i) {
    SCOPED_TRACE("client " + std::to_string(i));
    ASSERT_EQ(results[i].status, 200) << results[i].body;
    EXPECT_EQ(results[i].headers["content-type"], "text/event-stream");
    int completion_tokens = 0;
    std::string text = CheckStream(results[i].body, &completion_tokens);
    EXPECT_EQ(completion_tokens, kMaxTokens);
    EXPECT_EQ(text, expected[i % prompts.size()]);
  }
  // No SLO configured: every request that finished counts as meeting all (none) of them, and
  // there is no per-objective series.
  const int finished = kClients + static_cast<int>(prompts.size());
  // Prompt tokens looked up in the prefix cache: the engine's (colocated) or the prefill
  // pool's, from its Stats (disaggregated).
  const std::string queries = "tandem_prefix_cache_queries_tokens_total";
  std::string metrics = WaitForMetrics(port, [&](const std::string& m) {
    return Has(m, "tandem_kv_cache_blocks_used", 0) &&
           Has(m, "tandem_requests_slo_met_total", finished) &&
           Has(m, "tandem_time_per_output_token_seconds_count", finished) &&
           MetricValue(m, queries).value_or(0) > 0;
  });
  EXPECT_GT(MetricValue(metrics, queries).value_or(0), 0);
  EXPECT_TRUE(MetricValue(metrics, "tandem_prefix_cache_hits_tokens_total").has_value());
  EXPECT_EQ(MetricValue(metrics, "tandem_kv_cache_blocks_used"), 0);
  EXPECT_GE(MetricValue(metrics, "tandem_requests_total{finish_reason=\"length\"}").value_or(0),
            kClients);
  EXPECT_EQ(MetricValue(metrics, "tandem_requests_slo_met_total"), finished);
  EXPECT_EQ(MetricValue(metrics, "tandem_time_per_output_token_seconds_count"), finished);
  EXPECT_THAT(metrics, Not(HasSubstr("tandem_requests_slo_total")));
  EXPECT_THAT(metrics, Not(HasSubstr("tandem_slo_ttft_seconds")));
  EXPECT_TRUE(server->Alive());
}

// Each request that finishes normally is classified against the configured TTFT and TPOT
// objectives; errors are not.
TEST(ApiServerTest, SloAccountingClassifiesEveryFinishedRequest) {
  constexpr int kRequests = 4;
  auto counts = [](const std::string& metrics, const std::string& slo) {
    auto v = [&](const char* result) {
      return MetricValue(metrics, "tandem_requests_slo_total{slo=\"" + slo + "\",result=\"" +
                                      result + "\"}");
    };
    return std::pair{v("met"), v("missed")};
  };
  auto send = [](int port) {
    for (int i = 0; i < kRequests; ++i) {
      HttpResult r = Request(port, "POST", "/v1/completions", CompletionBody("Hi", 8, i % 2 == 0));
      ASSERT_EQ(r.status, 200) << r.body;
    }
    // A refused request is not held to the SLOs.
    ASSERT_EQ(Request(port, "POST", "/v1/completions", R"({"prompt": 1})").status, 400);
  };
  // Waits until the finished requests are all classified (counted just after each response).
  auto classified = [&](int port, int requests) {
    return WaitForMetrics(port, [&](const std::string& m) {
      auto [met, missed] = counts(m, "both");
      return met.has_value() && missed.has_value() && *met + *missed == requests;
    });
  };
  {
    SCOPED_TRACE("objectives every request meets");
    auto server = StartServer({"--ttft-slo", "100", "--tpot-slo", "100"});
    ASSERT_NE(server, nullptr);
    send(server->port());
    const std::string metrics = classified(server->port(), kRequests);
    for (const char* slo : {"ttft", "tpot", "both"}) {
      EXPECT_EQ(counts(metrics, slo), std::pair(std::optional<double>(kRequests),
                                                std::optional<double>(0)))
          << slo;
    }
    EXPECT_EQ(MetricValue(metrics, "tandem_requests_slo_met_total"), kRequests);
    EXPECT_EQ(MetricValue(metrics, "tandem_slo_ttft_seconds"), 100);
    EXPECT_EQ(MetricValue(metrics, "tandem_slo_tpot_seconds"), 100);
    EXPECT_EQ(MetricValue(metrics, "tandem_time_per_output_token_seconds_count"), kRequests);
  }
  {
    SCOPED_TRACE("a TPOT objective no decode meets, TTFT only");
    // Every decode step waits 1 ms first, so no time per output token can be under the 1 us
    // objective, however fast the machine.
    auto server =
        StartServer({"--ttft-slo", "100", "--tpot-slo", "0.000001", "--step-delay-ms", "1"});
    ASSERT_NE(server, nullptr);
    send(server->port());
    // One token: no time per output token, so it meets any TPOT objective.
    ASSERT_EQ(
        Request(server->port(), "POST", "/v1/completions", CompletionBody("Hi", 1, false)).status,
        200);
    const std::string metrics = classified(server->port(), kRequests + 1);
    using P = std::pair<std::optional<double>, std::optional<double>>;
    EXPECT_EQ(counts(metrics, "ttft"), P(kRequests + 1, 0));
    EXPECT_EQ(counts(metrics, "tpot"), P(1, kRequests));
    EXPECT_EQ(counts(metrics, "both"), P(1, kRequests));
    EXPECT_EQ(MetricValue(metrics, "tandem_requests_slo_met_total"), 1);
    EXPECT_EQ(MetricValue(metrics, "tandem_slo_tpot_seconds"), 0.000001);
    // Met and missed add up to the requests that finished normally.
    EXPECT_EQ(MetricValue(metrics, "tandem_requests_total{finish_reason=\"length\"}"),
              kRequests + 1);
    EXPECT_EQ(MetricValue(metrics, "tandem_time_per_output_token_seconds_count"), kRequests);
  }
}

TEST(ApiServerTest, ClientDisconnectMidStreamFreesKvBlocks) {
  // 16 samples of 1900 tokens, each step delayed: at least 38 s of generation on any machine,
  // so it is still generating when the client leaves (the abort counted below proves it).
  auto server = StartServer({"--step-delay-ms", kStepDelayMs});
  ASSERT_NE(server, nullptr);
  const int port = server->port();
  const std::string body = CompletionBody("Once upon a time", 1900, true, 16);
  std::string received;
  int fd = StartStream(port, body, &received);
  ASSERT_GE(fd, 0) << "the stream did not start: " << received;
  // Disaggregated, the router's /metrics shows its last Stats poll (every 100 ms), so wait for
  // the blocks to show; the stream goes on for far longer.
  const std::string streaming = WaitForMetrics(port, [](const std::string& m) {
    return MetricValue(m, "tandem_kv_cache_blocks_used").value_or(0) > 0;
  });
  EXPECT_GT(MetricValue(streaming, "tandem_kv_cache_blocks_used").value_or(0), 0)
      << "the request should hold KV blocks while it streams";
  close(fd);

  std::string metrics = WaitForMetrics(port, [](const std::string& m) {
    return Has(m, "tandem_kv_cache_blocks_used", 0) && Has(m, "tandem_requests_running", 0) &&
           Has(m, "tandem_requests_total{finish_reason=\"abort\"}", 1);
  });
  EXPECT_EQ(MetricValue(metrics, "tandem_kv_cache_blocks_used"), 0) << metrics;
  EXPECT_EQ(MetricValue(metrics, "tandem_requests_running"), 0);
  EXPECT_EQ(MetricValue(metrics, "tandem_requests_total{finish_reason=\"abort\"}"), 1);
  // The server is unharmed.
  HttpResult after = Request(port, "POST", "/v1/completions", CompletionBody("Hi", 2, false));
  EXPECT_EQ(after.status, 200) << after.body;
}

TEST(ApiServerTest, MetricsPassPromtoolOnALiveScrape) {
  // With both objectives, so that every SLO family is in the scrape.
  auto server = StartServer({"--ttft-slo", "30", "--tpot-slo", "0.5"});
  ASSERT_NE(server, nullptr);
  const int port = server->port();
  // Exercise every family: successes, a stream, an error.
  ASSERT_EQ(Request(port, "POST", "/v1/completions", CompletionBody("Hi", 3, false)).status, 200);
  ASSERT_EQ(Request(port, "POST", "/v1/completions", CompletionBody("Hi", 3, true)).status, 200);
  ASSERT_EQ(Request(port, "POST", "/v1/completions", R"({"prompt": 1})").status, 400);
  // The two completions counted (just after their responses), and their six tokens' draws
  // (disaggregated: in the workers' next Stats poll), then the scrape checked.
  WaitForMetrics(port, [](const std::string& m) {
    return MetricValue(m, "tandem_requests_total{finish_reason=\"length\"}") == 2 &&
           MetricValue(m, "tandem_sampled_tokens_total{device=\"host\"}") == 6;
  });
  HttpResult r = Request(port, "GET", "/metrics");
  ASSERT_EQ(r.status, 200);
  EXPECT_EQ(r.headers["content-type"], "text/plain; version=0.0.4; charset=utf-8");
  for (const char* family :
       {"tandem_requests_total", "tandem_prompt_tokens_total", "tandem_generation_tokens_total",
        "tandem_time_to_first_token_seconds", "tandem_inter_token_latency_seconds",
        "tandem_stream_write_seconds", "tandem_e2e_request_latency_seconds",
        "tandem_requests_running", "tandem_requests_waiting",
        "tandem_kv_cache_blocks_used", "tandem_kv_cache_blocks_capacity",
        "tandem_preemptions_total", "tandem_http_responses_total",
        "tandem_time_per_output_token_seconds", "tandem_requests_slo_total",
        "tandem_requests_slo_met_total", "tandem_slo_ttft_seconds", "tandem_slo_tpot_seconds",
        "tandem_sampled_tokens_total", "tandem_graph_steps_total"}) {
    EXPECT_THAT(r.body, HasSubstr(std::string("# TYPE ") + family + " ")) << family;
  }
  EXPECT_EQ(MetricValue(r.body, "tandem_generation_tokens_total"), 6);
  // On the CPU every token is drawn on the host (--sampling-device auto); disaggregated, the
  // prefill workers' first tokens and the decode workers' others, summed.
  EXPECT_EQ(MetricValue(r.body, "tandem_sampled_tokens_total{device=\"host\"}"), 6);
  EXPECT_EQ(MetricValue(r.body, "tandem_sampled_tokens_total{device=\"backend\"}"), 0);
  // The CPU backend has no step graphs.
  EXPECT_EQ(MetricValue(r.body, "tandem_graph_steps_total"), 0);
  // The stream's outputs (3 tokens, one or more per output) were each timed to the socket, once
  // written; the other request was not streamed.
  const double timed = MetricValue(r.body, "tandem_stream_write_seconds_count").value_or(0);
  EXPECT_GE(timed, 1);
  EXPECT_LE(timed, 3);
  EXPECT_EQ(MetricValue(r.body, "tandem_http_responses_total{code=\"400\"}"), 1);
  EXPECT_GT(MetricValue(r.body, "tandem_kv_cache_blocks_capacity").value_or(0), 0);

  const std::string path =
      std::string(::testing::TempDir()) + "/tandem_metrics_" + std::to_string(getpid()) + ".txt";
  std::ofstream(path) << r.body;
  const std::string command = "promtool check metrics < " + path + " 2>&1";
  FILE* p = popen(command.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string output;
  char buf[512];
  while (fgets(buf, sizeof(buf), p) != nullptr) output += buf;
  const int status = pclose(p);
  ASSERT_TRUE(WIFEXITED(status));
  ASSERT_NE(WEXITSTATUS(status), 127) << "promtool is missing: run scripts/install-deps";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "promtool check metrics:\n" << output << "\n" << r.body;
  std::remove(path.c_str());
}

TEST(ApiServerTest, ApiKeyIsRequiredEverywhereButTheProbes) {
  auto server = StartServer({"--api-key", "sekret"});
  ASSERT_NE(server, nullptr);
  const int port = server->port();
  // Kubernetes probes carry no key: liveness and readiness answer without one.
  EXPECT_EQ(Request(port, "GET", "/health").status, 200);
  HttpResult ready = Request(port, "GET", "/ready");
  EXPECT_EQ(ready.status, 200) << ready.body;
  EXPECT_EQ(json::parse(ready.body)["status"], "ready");
  for (const char* path : {"/v1/models", "/metrics", "/no/such/route"}) {
    HttpResult r = Request(port, "GET", path);
    EXPECT_EQ(r.status, 401) << path;
    EXPECT_EQ(json::parse(r.body)["error"]["code"], "invalid_api_key");
    EXPECT_EQ(Request(port, "GET", path, "", {"Authorization: Bearer wrong"}).status, 401);
  }
  EXPECT_EQ(Request(port, "POST", "/v1/completions", CompletionBody("Hi", 1, false)).status, 401);
  EXPECT_EQ(Request(port, "GET", "/v1/models", "", {"Authorization: Bearer sekret"}).status, 200);
  EXPECT_EQ(Request(port, "GET", "/no/such/route", "", {"Authorization: Bearer sekret"}).status,
            404);

  auto open_metrics = StartServer({"--api-key", "sekret", "--metrics-public"});
  ASSERT_NE(open_metrics, nullptr);
  EXPECT_EQ(Request(open_metrics->port(), "GET", "/metrics").status, 200);
  EXPECT_EQ(Request(open_metrics->port(), "GET", "/v1/models").status, 401);
}

TEST(ApiServerTest, OverloadIsRefusedWithRetryAfter) {
  for (const char* status : {"529", "503"}) {
    // The one admitted stream (16 x 1900 tokens, each step delayed: at least 38 s) is still
    // running when the second request comes, on any machine.
    auto server = StartServer({"--max-active-requests", "1", "--overload-status", status,
                               "--step-delay-ms", kStepDelayMs});
    ASSERT_NE(server, nullptr);
    const int port = server->port();
    std::string received;
    int fd = StartStream(port, CompletionBody("Once", 1900, true, 16), &received);
    ASSERT_GE(fd, 0) << "the stream did not start: " << received;
    HttpResult r = Request(port, "POST", "/v1/completions", CompletionBody("Hi", 1, false));
    EXPECT_EQ(r.status, std::atoi(status)) << r.body;
    EXPECT_EQ(r.headers["retry-after"], "1");
    EXPECT_EQ(json::parse(r.body)["error"]["code"], "overloaded");
    close(fd);
    // Once the stream is cancelled the server takes requests again.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    int last = 0;
    while (std::chrono::steady_clock::now() < deadline) {
      last = Request(port, "POST", "/v1/completions", CompletionBody("Hi", 1, false)).status;
      if (last == 200) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    EXPECT_EQ(last, 200);
  }
}

TEST(ApiServerTest, KeepAliveServesSeveralRequestsOnOneConnection) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  int fd = Connect(server->port());
  ASSERT_GE(fd, 0);
  const std::string body = CompletionBody("Hi", 2, false);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(SendAll(fd, "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: " +
                                std::to_string(body.size()) + "\r\n\r\n" + body));
    HttpResult r = ReadResponse(fd);
    EXPECT_EQ(r.status, 200) << "request " << i;
  }
  // A stream, then a plain request, on the same connection.
  const std::string stream = CompletionBody("Hi", 2, true);
  ASSERT_TRUE(SendAll(fd, "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: " +
                              std::to_string(stream.size()) + "\r\n\r\n" + stream));
  HttpResult s = ReadResponse(fd);
  EXPECT_EQ(s.status, 200);
  EXPECT_EQ(SseEvents(s.body).back(), "[DONE]");
  ASSERT_TRUE(SendAll(fd, "GET /health HTTP/1.1\r\nHost: t\r\n\r\n"));
  EXPECT_EQ(ReadResponse(fd).status, 200);
  close(fd);
}

TEST(ApiServerTest, ReadyProvesTheEngineAndTokenizeRoundTrips) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  const int port = server->port();
  HttpResult ready = Request(port, "GET", "/ready");
  EXPECT_EQ(ready.status, 200) << ready.body;
  HttpResult tok = Request(port, "POST", "/tokenize", R"({"prompt": "hello world"})");
  ASSERT_EQ(tok.status, 200) << tok.body;
  json t = json::parse(tok.body);
  EXPECT_EQ(t["count"], t["tokens"].size());
  EXPECT_GT(t["max_model_len"].get<int>(), 0);
  HttpResult chat =
      Request(port, "POST", "/tokenize", R"({"messages": [{"role": "user", "content": "hello"}]})");
  ASSERT_EQ(chat.status, 200) << chat.body;
  EXPECT_GT(json::parse(chat.body)["count"].get<int>(), t["count"].get<int>() - 3);
  // Without the BOS the tokenizer adds, the ids decode back to the text.
  HttpResult plain = Request(port, "POST", "/tokenize",
                             R"({"prompt": "hello world", "add_special_tokens": false})");
  json ids = json::parse(plain.body)["tokens"];
  HttpResult detok = Request(port, "POST", "/detokenize", json{{"tokens", ids}}.dump());
  ASSERT_EQ(detok.status, 200) << detok.body;
  EXPECT_EQ(json::parse(detok.body)["prompt"], "hello world");
  HttpResult bad = Request(port, "POST", "/detokenize", R"({"tokens": [99999999]})");
  EXPECT_EQ(bad.status, 400);
  EXPECT_EQ(json::parse(bad.body)["error"]["param"], "tokens");
}

TEST(ApiServerTest, SigtermFinishesTheStreamInFlightAndExitsZero) {
  // 200 tokens, each step delayed: at least 4 s of generation after the first chunk, so the
  // stream is in flight when SIGTERM comes, on any machine.
  auto server = StartServer({"--step-delay-ms", kStepDelayMs});
  ASSERT_NE(server, nullptr);
  constexpr int kTokens = 200;
  std::string received;
  int fd = StartStream(server->port(), CompletionBody("Once", kTokens, true), &received);
  ASSERT_GE(fd, 0) << "the stream did not start: " << received;
  ASSERT_EQ(received.find("[DONE]"), std::string::npos) << "the stream ended before SIGTERM";
  kill(server->pid(), SIGTERM);
  HttpResult r = ReadResponse(fd, false, std::move(received));
  close(fd);
  ASSERT_EQ(r.status, 200) << "the stream was cut by the shutdown";
  const std::vector<std::string> events = SseEvents(r.body);
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back(), "[DONE]") << "the stream was cut by the shutdown";
  int completion_tokens = 0;
  CheckStream(r.body, &completion_tokens);
  EXPECT_EQ(completion_tokens, kTokens) << "the stream was cut by the shutdown";
  const int status = server->Terminate();
  ASSERT_TRUE(WIFEXITED(status)) << status;
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST(ApiServerTest, BadFlagsExitNonZeroWithOneLineReason) {
  const std::string binary = std::string(std::getenv("TANDEM_BINARY_DIR")) + "/bin/tandem";
  for (const char* flags :
       {"--port 70000", "--overload-status 500", "--no-such-flag", "--max-active-requests 0",
        "--port abc", "--ttft-slo 0", "--tpot-slo -1", "--tpot-slo abc", "--ttft-slo nan"}) {
    const std::string command =
        binary + " serve --model " + TinyModelDir() + " " + flags + " 2>&1 </dev/null";
    FILE* p = popen(command.c_str(), "r");
    ASSERT_NE(p, nullptr);
    std::string output;
    char buf[512];
    while (fgets(buf, sizeof(buf), p) != nullptr) output += buf;
    const int status = pclose(p);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << flags;
    EXPECT_THAT(output, HasSubstr("tandem serve: ")) << flags;
    EXPECT_EQ(std::count(output.begin(), output.end(), '\n'), 1) << output;
  }
}

}  // namespace
}  // namespace tandem::api_test

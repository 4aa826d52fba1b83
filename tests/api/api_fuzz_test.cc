// Negative and edge-case traffic against `tandem serve`: thousands of generated requests with
// broken JSON, wrong types, out-of-range and non-finite values, deep nesting, invalid UTF-8,
// oversized bodies and headers, malformed HTTP, unknown routes and methods, half-closed and
// slowloris connections. The server must answer every one it can read with a 4xx in the OpenAI
// error format (or a 200 for edge cases that are valid), never a 5xx, never crash, and still
// serve a normal request afterwards.
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "api_test_util.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace tandem::api_test {
namespace {

using nlohmann::json;

// The fuzzing server's --request-timeout-ms: the hang bound, so that however loaded the machine,
// every complete request below (up to 4 MiB, sent at once) gets in before it.
constexpr int kFuzzRequestTimeoutMs = kHangTimeoutMs;
// The slowloris server's: short, since its partial requests are dropped only after it.
constexpr int kSlowlorisRequestTimeoutMs = 2000;

struct Case {
  std::string name;
  std::string raw;          // bytes sent as they are
  bool may_close = false;   // the server may close without answering (nothing readable)
  bool half_close = false;  // shut down our sending side after the bytes
};

std::string Post(const std::string& path, const std::string& body,
                 const std::string& extra_headers = "") {
  return "POST " + path + " HTTP/1.1\r\nHost: fuzz\r\nConnection: close\r\n" +
         "Content-Type: application/json\r\n" + extra_headers +
         "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
}

// Values of every JSON type, in and out of every field's range.
std::vector<std::string> ValuePool() {
  std::vector<std::string> v = {"null",
                                "true",
                                "false",
                                "0",
                                "-1",
                                "1",
                                "2",
                                "-2",
                                "3",
                                "20",
                                "21",
                                "-2147483649",
                                "2147483648",
                                "9223372036854775807",
                                "-9223372036854775808",
                                "18446744073709551615",
                                "99999999999999999999999",
                                "1e308",
                                "-1e308",
                                "1e-320",
                                "1.5",
                                "-0",
                                "-0.0",
                                "0.5",
                                "2.0000001",
                                "\"\"",
                                "\"x\"",
                                "\"NaN\"",
                                "\"Infinity\"",
                                "\"1\"",
                                "\"tiny-model\"",
                                "\"text\"",
                                "\"none\"",
                                "\"user\"",
                                "[]",
                                "[1]",
                                "[-1]",
                                "[999999]",
                                "[\"a\"]",
                                "[\"\"]",
                                "[[]]",
                                "[null]",
                                "[[1,2]]",
                                "[1.5]",
                                "{}",
                                "{\"a\":1}",
                                "{\"type\":\"text\"}",
                                "{\"type\":\"json_object\"}",
                                "{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"x\","
                                "\"schema\":{\"type\":\"object\",\"minProperties\":1}}}",
                                "{\"type\":\"json_schema\",\"json_schema\":{\"schema\":"
                                "{\"type\":\"string\",\"maxLength\":3}}}",
                                "{\"json\":{\"type\":\"integer\"},\"regex\":\"a\"}",
                                "{\"type\":\"integer\"}",
                                "\"root ::= [a-z]{1,3}\"",
                                "\"(a|b\"",
                                "\"[0-9]{2,4}\"",
                                "[\"yes\",\"no\"]",
                                "{\"include_usage\":true}",
                                "{\"include_usage\":\"yes\"}",
                                "{\"1\":100}",
                                "[{\"role\":\"user\"}]",
                                "[{\"role\":\"user\",\"content\":5}]",
                                "[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\"}]}]",
                                "[{\"role\":\"tool\",\"content\":\"x\"}]",
                                "[{\"type\":\"function\",\"function\":{\"name\":\"f\","
                                "\"parameters\":{\"type\":\"object\",\"properties\":{\"a\":"
                                "{\"type\":\"string\",\"maxLength\":3}}}}}]",
                                "{\"type\":\"function\",\"function\":{\"name\":\"f\"}}",
                                "\"required\"",
                                "[{\"role\":\"assistant\",\"tool_calls\":[{\"type\":"
                                "\"function\",\"function\":{\"name\":\"f\",\"arguments\":"
                                "\"{}\"}}]},{\"role\":\"tool\",\"content\":\"r\"}]",
                                "[{\"role\":\"user\",\"content\":null}]",
                                "[{\"role\":\"assistant\",\"content\":null}]",
                                "[{\"content\":\"x\"}]",
                                "[{}]",
                                "[1,2,3]",
                                "\"\\u0000\"",
                                "\"\\ud83d\\ude00\"",
                                "\"\\u00e9t\\u00e9\""};
  v.push_back("\"" + std::string(5000, 'a') + "\"");
  v.push_back("\"" + std::string(300, 'b') + "\"");  // longer than a stop string may be
  std::string many = "[";
  for (int i = 0; i < 300; ++i) many += (i ? ",\"s" : "\"s") + std::to_string(i) + "\"";
  v.push_back(many + "]");
  std::string ids = "[";
  for (int i = 0; i < 1000; ++i) ids += (i ? "," : "") + std::to_string(i % 500);
  v.push_back(ids + "]");
  std::string messages = "[";
  for (int i = 0; i < 300; ++i)
    messages += std::string(i ? "," : "") + R"({"role":"user","content":"m"})";
  v.push_back(messages + "]");
  return v;
}

const std::vector<std::string>& Fields() {
  static const std::vector<std::string> fields = {"model",
                                                  "prompt",
                                                  "messages",
                                                  "max_tokens",
                                                  "max_completion_tokens",
                                                  "n",
                                                  "temperature",
                                                  "top_p",
                                                  "top_k",
                                                  "min_p",
                                                  "presence_penalty",
                                                  "frequency_penalty",
                                                  "repetition_penalty",
                                                  "seed",
                                                  "stop",
                                                  "stream",
                                                  "stream_options",
                                                  "logprobs",
                                                  "top_logprobs",
                                                  "echo",
                                                  "suffix",
                                                  "best_of",
                                                  "tools",
                                                  "tool_choice",
                                                  "parallel_tool_calls",
                                                  "functions",
                                                  "logit_bias",
                                                  "response_format",
                                                  "guided_json",
                                                  "guided_regex",
                                                  "guided_grammar",
                                                  "guided_choice",
                                                  "structured_outputs",
                                                  "user",
                                                  "min_tokens",
                                                  "ignore_eos",
                                                  "stop_token_ids",
                                                  "skip_special_tokens",
                                                  "add_special_tokens",
                                                  "add_generation_prompt",
                                                  "include_stop_str_in_output",
                                                  "not_an_openai_field"};
  return fields;
}

// A request body with 1 to 3 fields of a valid base replaced by pool values.
std::string MutatedBody(std::mt19937& rng, bool chat) {
  const std::vector<std::string>& pool = []() -> const std::vector<std::string>& {
    static const std::vector<std::string> p = ValuePool();
    return p;
  }();
  std::vector<std::pair<std::string, std::string>> fields = {
      {"model", "\"tiny-model\""}, {"max_tokens", "2"}, {"temperature", "0"}};
  if (chat) {
    fields.push_back({"messages", R"([{"role":"user","content":"Hi"}])"});
  } else {
    fields.push_back({"prompt", "\"Hello\""});
  }
  const int mutations = 1 + static_cast<int>(rng() % 3);
  for (int m = 0; m < mutations; ++m) {
    const std::string& field = Fields()[rng() % Fields().size()];
    std::string value = pool[rng() % pool.size()];
    // Stay cheap: a valid mutation never asks for a long generation.
    if (field == "max_tokens" || field == "max_completion_tokens" || field == "min_tokens") {
      if (value == "20" || value == "21") value = "3";
    }
    bool replaced = false;
    for (auto& [k, v] : fields) {
      if (k == field) {
        v = value;
        replaced = true;
      }
    }
    if (!replaced) fields.push_back({field, value});
  }
  std::string body = "{";
  for (size_t i = 0; i < fields.size(); ++i) {
    body += (i ? "," : "") + ("\"" + fields[i].first + "\":") + fields[i].second;
  }
  return body + "}";
}

// An embeddings body with 1 to 3 of its fields replaced by pool values (or by input shapes).
std::string MutatedEmbeddingBody(std::mt19937& rng) {
  const std::vector<std::string>& pool = []() -> const std::vector<std::string>& {
    static const std::vector<std::string> p = ValuePool();
    return p;
  }();
  static const std::vector<std::string> kFields = {"model",
                                                   "input",
                                                   "encoding_format",
                                                   "dimensions",
                                                   "user",
                                                   "add_special_tokens",
                                                   "truncate_prompt_tokens",
                                                   "normalize",
                                                   "not_an_openai_field"};
  static const std::vector<std::string> kInputs = {
      R"("")",        R"([])",      R"([[]])",          R"([""])",
      R"(["a",""])",  R"([1,2,3])", R"([[1,2],[3]])",   R"([[1],"a"])",
      R"(["a",[1]])", R"([-1])",    R"([1.5])",         R"([[1e30]])",
      R"([null])",    R"({"a":1})", R"(["x","y","z"])", R"("base64")"};
  std::vector<std::pair<std::string, std::string>> fields = {{"model", "\"tiny-model\""},
                                                             {"input", "\"Hello\""}};
  const int mutations = 1 + static_cast<int>(rng() % 3);
  for (int m = 0; m < mutations; ++m) {
    const std::string& field = kFields[rng() % kFields.size()];
    std::string value =
        field == "input" && rng() % 2 ? kInputs[rng() % kInputs.size()] : pool[rng() % pool.size()];
    bool replaced = false;
    for (auto& [k, v] : fields) {
      if (k == field) {
        v = value;
        replaced = true;
      }
    }
    if (!replaced) fields.push_back({field, value});
  }
  std::string body = "{";
  for (size_t i = 0; i < fields.size(); ++i) {
    body += (i ? "," : "") + ("\"" + fields[i].first + "\":") + fields[i].second;
  }
  return body + "}";
}

std::vector<Case> JsonCases(std::mt19937& rng) {
  std::vector<Case> cases;
  for (int i = 0; i < 400; ++i) {
    cases.push_back(
        {"mutated embeddings field", Post("/v1/embeddings", MutatedEmbeddingBody(rng))});
  }
  // Wrong types and values, field by field.
  for (int i = 0; i < 3200; ++i) {
    const bool chat = i % 2 == 1;
    cases.push_back({"mutated field", Post(chat ? "/v1/chat/completions" : "/v1/completions",
                                           MutatedBody(rng, chat))});
  }
  // Broken JSON: truncations, byte flips, literals JSON does not have.
  const std::string base =
      R"({"model":"tiny-model","prompt":"Hello","max_tokens":2,"temperature":0.5})";
  const std::string flips = std::string("\x00\xff\"{}[],:\\Nn-+.eE\x80\xc3", 19);
  for (int i = 0; i < 600; ++i) {
    std::string body = base;
    if (i % 3 == 0) {
      body = body.substr(0, rng() % body.size());
    } else {
      for (int k = 0, n = 1 + static_cast<int>(rng() % 4); k < n; ++k) {
        body[rng() % body.size()] = flips[rng() % flips.size()];
      }
    }
    const char* path = i % 2 ? "/v1/chat/completions" : "/v1/completions";
    cases.push_back({"broken json", Post(path, body)});
    if (i % 4 == 0) cases.push_back({"broken json tokenize", Post("/tokenize", body)});
  }
  for (const char* literal :
       {"NaN", "-NaN", "Infinity", "-Infinity", "inf", "undefined", "'x'", "0x10", "01", "1.", ".5",
        "+1", "1e", "--1", "1e99999", "-1e99999",
        "1"
        "00000000000000000000000000000000000000000000000000000000000000000"
        "0000000000000000000000000000000000000000000000000000000000000000000"
        "00000000000000000000000000000000000000000000000000000000000000000000"
        "00000000000000000000000000000000000000000000000000000000000000000000"
        "00000000000000000000000000000000000000000000000000000000000000000000"}) {
    for (const char* field : {"temperature", "max_tokens", "n", "top_p", "seed", "top_k"}) {
      cases.push_back({"non-json number",
                       Post("/v1/completions",
                            std::string(R"({"prompt":"x",")") + field + "\":" + literal + "}")});
    }
  }
  for (const std::string& body :
       {std::string(""),
        std::string("   "),
        std::string("null"),
        std::string("[]"),
        std::string("123"),
        std::string("\"s\""),
        std::string("true"),
        base + "xyz",
        base + "}",
        std::string("{}{}"),
        "/*c*/" + base,
        "\xef\xbb\xbf" + base,
        std::string("{\"prompt\":\"x\",}"),
        std::string("{'prompt':'x'}"),
        std::string("{\"prompt\" \"x\"}"),
        std::string("{prompt:\"x\"}"),
        std::string("{\"prompt\":\"\\ud800\"}"),
        std::string("{\"prompt\":\"\\x41\"}"),
        std::string("{\"prompt\":\"a\nb\"}"),
        std::string(100000, '['),
        std::string(100000, '{'),
        std::string(33, '[') + std::string(33, ']'),
        "{\"prompt\":" + std::string(40, '[') + "1" + std::string(40, ']') + "}"}) {
    for (const char* path : {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
                             "/v1/embeddings"}) {
      cases.push_back({"bad body", Post(path, body)});
    }
  }
  std::string deep_objects;
  for (int i = 0; i < 50000; ++i) deep_objects += "{\"a\":";
  cases.push_back({"deep objects", Post("/v1/completions", deep_objects)});
  // Invalid UTF-8 inside strings, and outside them.
  for (const char* bad : {"\xff", "\xc0\x80", "\xed\xa0\x80", "\xf4\x90\x80\x80", "\xe2\x82",
                          "\x80", "\xfe\xfe", "\xc3"}) {
    for (const char* path : {"/v1/completions", "/v1/chat/completions", "/tokenize"}) {
      std::string in_prompt = std::string(R"({"prompt":"a)") + bad + R"(b","max_tokens":1})";
      std::string in_chat =
          std::string(R"({"messages":[{"role":"user","content":"a)") + bad + R"("}]})";
      std::string in_key = std::string("{\"") + bad + "\":1,\"prompt\":\"x\"}";
      cases.push_back({"invalid utf-8", Post(path, in_prompt)});
      cases.push_back({"invalid utf-8", Post(path, in_chat)});
      cases.push_back({"invalid utf-8", Post(path, in_key)});
      cases.push_back({"invalid utf-8", Post(path, std::string("{") + bad + "}")});
    }
  }
  // Valid, but too long for the context.
  std::string prose;
  while (prose.size() < (3u << 20)) prose += "the cat sat on the mat. ";
  cases.push_back(
      {"huge prompt", Post("/v1/completions", R"({"prompt":")" + prose + R"(","max_tokens":1})")});
  return cases;
}

std::vector<Case> HttpCases(std::mt19937& rng) {
  std::vector<Case> cases;
  const std::string body = R"({"prompt":"Hi","max_tokens":1})";
  const std::vector<std::string> paths = {"/",
                                          "/v1",
                                          "/v1/",
                                          "/v2/completions",
                                          "/v1/completions/",
                                          "/v1/completion",
                                          "/V1/COMPLETIONS",
                                          "/v1/models/nope",
                                          "/v1/models/tiny-model",
                                          "/v1/models?x=1",
                                          "/health?x",
                                          "/%00",
                                          "/..%2f..%2fetc/passwd",
                                          "/v1/chat",
                                          "/metrics/",
                                          "/tokenize/x",
                                          "*",
                                          "/" + std::string(8000, 'a'),
                                          "/v1/engines",
                                          "/v1/embeddings/",
                                          "/docs"};
  const std::vector<std::string> methods = {"GET",  "POST",  "PUT", "DELETE", "PATCH",  "OPTIONS",
                                            "HEAD", "TRACE", "FOO", "get",    "CONNECT"};
  const std::vector<std::string> routes = {
      "/v1/completions", "/v1/chat/completions", "/v1/models",    "/health", "/ready", "/metrics",
      "/tokenize",       "/detokenize",          "/v1/embeddings"};
  for (int i = 0; i < 900; ++i) {
    std::vector<std::string> all = paths;
    all.insert(all.end(), routes.begin(), routes.end());
    const std::string& method = methods[rng() % methods.size()];
    const std::string& path = all[rng() % all.size()];
    std::string raw = method + " " + path + " HTTP/1.1\r\nHost: fuzz\r\nConnection: close\r\n";
    if (rng() % 2) {
      raw += "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
    } else {
      raw += "\r\n";
    }
    // CONNECT takes an authority, not a path: the server may refuse the request line.
    cases.push_back({"route/method " + method + " " + path.substr(0, 40), raw});
  }
  // Oversized bodies: declared, sent, chunked.
  const std::string big(5 << 20, 'x');
  cases.push_back({"body over limit", Post("/v1/completions", big)});
  cases.push_back({"body over limit declared",
                   "POST /v1/completions HTTP/1.1\r\nHost: f\r\nContent-Length: 1000000000000\r\n"
                   "\r\n{}"});
  {
    std::string chunked =
        "POST /v1/completions HTTP/1.1\r\nHost: f\r\nTransfer-Encoding: chunked\r\n\r\n";
    for (int i = 0; i < 6; ++i) chunked += "100000\r\n" + std::string(1 << 20, 'y') + "\r\n";
    chunked += "0\r\n\r\n";
    cases.push_back({"chunked body over limit", chunked});
  }
  // Oversized and too many headers, a huge request line.
  cases.push_back({"header over limit", "GET /health HTTP/1.1\r\nHost: f\r\nX-Big: " +
                                            std::string(20000, 'h') + "\r\n\r\n"});
  {
    std::string many = "GET /health HTTP/1.1\r\nHost: f\r\n";
    for (int i = 0; i < 200; ++i) many += "X-H" + std::to_string(i) + ": v\r\n";
    cases.push_back({"too many headers", many + "\r\n"});
  }
  cases.push_back({"request line over limit",
                   "GET /" + std::string(40000, 'p') + " HTTP/1.1\r\nHost: f\r\n\r\n"});
  // Malformed HTTP.
  for (const std::string& raw : std::vector<std::string>{
           "GARBAGE\r\n\r\n",
           "GET\r\n\r\n",
           "GET / HTTP/1.1 extra\r\n\r\n",
           "GET / HTTX/1.1\r\n\r\n",
           "GET / HTTP/9.9\r\n\r\n",
           "\r\n\r\n",
           "GET / HTTP/1.1\r\nNoColon\r\n\r\n",
           "GET / HTTP/1.1\r\nBad Name: v\r\n\r\n",
           std::string("GET / HTTP/1.1\r\nX: a\0b\r\n\r\n", 26),
           "GET / HTTP/1.1\r\nX: a\r\n folded\r\n\r\n",
           "POST /v1/completions HTTP/1.1\r\nContent-Length: abc\r\n\r\n{}",
           "POST /v1/completions HTTP/1.1\r\nContent-Length: -1\r\n\r\n{}",
           "POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
           "POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\nTransfer-Encoding: "
           "chunked\r\n\r\n{}",
           "POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: "
           "chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
           "POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n{}",
           "POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
           "ffffffffffffffffffff\r\n",
           "GET http://example.com/health HTTP/1.1\r\nHost: f\r\n\r\n",
           "GET /health HTTP/1.0\r\n\r\n",
           Post("/v1/completions", body, "Expect: 100-continue\r\n"),
           Post("/v1/completions", body, "Expect: something-else\r\n"),
           "POST /v1/completions HTTP/1.0\r\nContent-Length: " + std::to_string(body.size()) +
               "\r\n\r\n" + body}) {
    cases.push_back({"malformed http", raw});
  }
  // Random bytes: no request at all.
  for (int i = 0; i < 150; ++i) {
    std::string junk(1 + rng() % 400, '\0');
    for (char& c : junk) c = static_cast<char>(rng() % 256);
    if (i % 2) junk = "POST /v1/completions HTTP/1.1\r\n" + junk;
    cases.push_back({"random bytes", junk, /*may_close=*/true, /*half_close=*/true});
  }
  // Half-closed after a whole request; cut off in the middle of one.
  for (int i = 0; i < 30; ++i) {
    cases.push_back({"half-closed request", Post("/v1/completions", body), true, true});
    std::string partial = Post("/v1/completions", body);
    cases.push_back({"cut-off request", partial.substr(0, rng() % partial.size()), true, true});
  }
  return cases;
}

// Checks one answer; returns an error description or "".
std::string Check(const Case& c, const HttpResult& r) {
  if (r.status == 0) return c.may_close ? "" : "no response";
  if (r.status >= 500) return "status " + std::to_string(r.status) + ": " + r.body.substr(0, 300);
  if (r.status >= 400 && c.raw.rfind("HEAD ", 0) != 0) {
    json body = json::parse(r.body, nullptr, /*allow_exceptions=*/false);
    if (body.is_discarded() || !body.is_object() || !body.contains("error")) {
      return "4xx without the OpenAI error body: " + r.body.substr(0, 300);
    }
    const json& e = body["error"];
    if (!e.is_object() || !e.contains("message") || !e["message"].is_string() ||
        e["message"].get<std::string>().empty() || !e.contains("type") || !e["type"].is_string() ||
        !e.contains("param") || !e.contains("code")) {
      return "malformed error object: " + r.body.substr(0, 300);
    }
    if (e["message"].get<std::string>().size() > 1000) return "error message echoes the input";
  }
  return "";
}

TEST(ApiFuzzTest, ThousandsOfBadRequestsNeverGet5xxOrCrashTheServer) {
  std::string error;
  auto server = ServerProcess::Start({"--request-timeout-ms", std::to_string(kFuzzRequestTimeoutMs),
                                      "--max-body-bytes", "4194304"},
                                     &error);
  ASSERT_NE(server, nullptr) << error;
  const int port = server->port();
  const auto started = std::chrono::steady_clock::now();

  std::mt19937 rng(20240601);
  std::vector<Case> cases = JsonCases(rng);
  std::vector<Case> http_cases = HttpCases(rng);
  cases.insert(cases.end(), http_cases.begin(), http_cases.end());
  std::shuffle(cases.begin(), cases.end(), rng);
  ASSERT_GE(cases.size(), 5000u);

  std::atomic<size_t> next{0};
  std::atomic<int> answered{0}, ok{0}, client_errors{0};
  std::mutex mu;
  std::vector<std::string> failures;
  auto worker = [&] {
    for (size_t i; (i = next++) < cases.size();) {
      const Case& c = cases[i];
      int fd = Connect(port);
      if (fd < 0) {
        std::lock_guard<std::mutex> lock(mu);
        failures.push_back(c.name + ": cannot connect");
        continue;
      }
      SendAll(fd, c.raw);
      if (c.half_close) shutdown(fd, SHUT_WR);
      HttpResult r = ReadResponse(fd, c.raw.rfind("HEAD ", 0) == 0);
      close(fd);
      if (r.status != 0) ++answered;
      if (r.status == 200) ++ok;
      if (r.status >= 400 && r.status < 500) ++client_errors;
      std::string problem = Check(c, r);
      if (!problem.empty()) {
        std::lock_guard<std::mutex> lock(mu);
        failures.push_back(c.name + ": " + problem);
      }
    }
  };
  std::vector<std::jthread> workers;
  for (int t = 0; t < 4; ++t) workers.emplace_back(worker);
  for (std::jthread& t : workers) t.join();

  for (size_t i = 0; i < failures.size() && i < 30; ++i) ADD_FAILURE() << failures[i];
  EXPECT_TRUE(failures.empty()) << failures.size() << " of " << cases.size() << " cases failed";
  EXPECT_GT(client_errors.load(), 3000);
  EXPECT_GT(ok.load(), 100) << "valid edge cases should succeed";
  ASSERT_TRUE(server->Alive()) << "the server died";

  // Still healthy: a normal request works and no 5xx was ever sent.
  HttpResult health = Request(port, "GET", "/health");
  EXPECT_EQ(health.status, 200);
  HttpResult normal = Request(port, "POST", "/v1/completions",
                              R"({"model":"tiny-model","prompt":"Hello","max_tokens":4})");
  ASSERT_EQ(normal.status, 200) << normal.body;
  EXPECT_EQ(json::parse(normal.body)["usage"]["completion_tokens"].get<int>() > 0, true);
  // The KV gauge comes from the engines a moment after the last response: wait for it.
  const std::string metrics = WaitForMetrics(port, [](const std::string& m) {
    return MetricValue(m, "tandem_kv_cache_blocks_used") == 0;
  });
  EXPECT_EQ(metrics.find("tandem_http_responses_total{code=\"5"), std::string::npos);
  EXPECT_EQ(MetricValue(metrics, "tandem_kv_cache_blocks_used"), 0) << "a KV block leaked";
  // For the log only: how long the run took is no part of what this test checks.
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  std::printf("%zu cases (%d answered: %d ok, %d 4xx) in %.1f s\n", cases.size(), answered.load(),
              ok.load(), client_errors.load(), seconds);
}

// Partial requests that never finish are dropped by the server's --request-timeout-ms; the
// server goes on serving.
TEST(ApiFuzzTest, SlowlorisConnectionsAreClosedByTheRequestTimeout) {
  std::string error;
  auto server = ServerProcess::Start(
      {"--request-timeout-ms", std::to_string(kSlowlorisRequestTimeoutMs)}, &error);
  ASSERT_NE(server, nullptr) << error;
  const int port = server->port();
  std::atomic<int> slow_closed{0};
  {
    std::vector<std::jthread> slow;
    for (int i = 0; i < 20; ++i) {
      slow.emplace_back([&, i] {
        // Our own receive timeout is a hang bound, far beyond the server's request timeout.
        int fd = Connect(port, kSlowlorisRequestTimeoutMs + kHangTimeoutMs);
        if (fd < 0) return;
        SendAll(fd, i % 2 ? "POST /v1/completions HTTP/1.1\r\nHost: slow\r\nX-A: "
                          : "POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{\"pro");
        char buf[64];
        ssize_t n = recv(fd, buf, sizeof(buf), 0);  // 0: closed by the server; -1: our timeout
        if (n == 0) ++slow_closed;
        close(fd);
      });
    }
  }
  EXPECT_EQ(slow_closed.load(), 20) << "slowloris connections were not closed by the server";
  ASSERT_TRUE(server->Alive()) << "the server died";
  HttpResult normal = Request(port, "POST", "/v1/completions",
                              R"({"model":"tiny-model","prompt":"Hello","max_tokens":4})");
  EXPECT_EQ(normal.status, 200) << normal.body;
}

}  // namespace
}  // namespace tandem::api_test

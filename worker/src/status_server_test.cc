#include "tandem/worker/status_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem::worker {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

// The whole response (status line, headers, body) to one request over a plain socket.
std::string Send(int port, const std::string& method, const std::string& path) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  const timeval limit{.tv_sec = 60, .tv_usec = 0};  // a hang fails the test instead of blocking it
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof(limit));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string response;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string request =
        method + " " + path + " HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n";
    if (write(fd, request.data(), request.size()) == static_cast<ssize_t>(request.size())) {
      char buf[4096];
      for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) response.append(buf, n);
    }
  }
  close(fd);
  return response;
}

TEST(StatusServerTest, HealthFollowsDrainingAndMetricsRender) {
  std::atomic<bool> draining{false};
  auto server = StatusServer::Create(
      "127.0.0.1:0", [&] { return draining.load(); },
      [] { return std::string("tandem_up 1\n"); });
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  ASSERT_GT(port, 0);

  std::string health = Send(port, "GET", "/health");
  EXPECT_THAT(health, StartsWith("HTTP/1.1 200"));
  EXPECT_THAT(health, HasSubstr("\r\n\r\nok\n"));
  std::string metrics = Send(port, "GET", "/metrics");
  EXPECT_THAT(metrics, StartsWith("HTTP/1.1 200"));
  EXPECT_THAT(metrics, HasSubstr("text/plain; version=0.0.4"));
  EXPECT_THAT(metrics, HasSubstr("\r\n\r\ntandem_up 1\n"));

  draining = true;
  health = Send(port, "GET", "/health");
  EXPECT_THAT(health, StartsWith("HTTP/1.1 503"));
  EXPECT_THAT(health, HasSubstr("draining"));
  // Metrics stay available while draining.
  EXPECT_THAT(Send(port, "GET", "/metrics"), StartsWith("HTTP/1.1 200"));
}

TEST(StatusServerTest, OtherPathsAndMethodsAreRefused) {
  auto server = StatusServer::Create(
      "127.0.0.1:0", [] { return false; }, [] { return std::string(); });
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  EXPECT_THAT(Send(port, "GET", "/nope"), StartsWith("HTTP/1.1 404"));
  const std::string post = Send(port, "POST", "/metrics");
  EXPECT_THAT(post, StartsWith("HTTP/1.1 405"));
  EXPECT_THAT(post, HasSubstr("Allow: GET"));
  (*server)->Stop();
  (*server)->Stop();  // idempotent
}

TEST(StatusServerTest, BadAddressesFail) {
  EXPECT_FALSE(StatusServer::Create("no-port", [] { return false; }, [] { return ""; }).ok());
  EXPECT_FALSE(
      StatusServer::Create("127.0.0.1:99999", [] { return false; }, [] { return ""; }).ok());
}

}  // namespace
}  // namespace tandem::worker

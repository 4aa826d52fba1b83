// The HTTP server's contract with its handlers: where a connection's work runs (RunHere on the
// caller's thread when the connection is idle, Run never), the order of what several threads
// send, and what happens to a client that stops reading. The OpenAI API's own tests
// (tests/api) cover request parsing, refusals and slow clients sending requests.
#include "tandem/http/http_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem::http {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

// A one-shot gate: Wait blocks until Open.
class Gate {
 public:
  void Open() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = true;
    cv_.notify_all();
  }
  void Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return open_; });
  }
  bool is_open() {
    std::lock_guard<std::mutex> lock(mu_);
    return open_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
};

// A server whose handler hands every exchange to the test.
class Server {
 public:
  explicit Server(HttpServerOptions options = {}) {
    options.port = 0;
    auto server = HttpServer::Create(options, [this](std::shared_ptr<HttpExchange> ex) {
      std::lock_guard<std::mutex> lock(mu_);
      exchanges_.push_back(std::move(ex));
      cv_.notify_all();
    });
    EXPECT_TRUE(server.ok()) << server.status();
    if (server.ok()) server_ = std::move(*server);
  }
  HttpServer& operator*() { return *server_; }
  HttpServer* operator->() { return server_.get(); }

  std::shared_ptr<HttpExchange> Next() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return !exchanges_.empty(); });
    std::shared_ptr<HttpExchange> ex = std::move(exchanges_.front());
    exchanges_.pop_front();
    return ex;
  }

 private:
  std::unique_ptr<HttpServer> server_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<HttpExchange>> exchanges_;
};

// A plain-socket client; every read gives up after 60 s so that a hang fails the test.
class Client {
 public:
  // `receive_buffer` > 0 shrinks the socket's receive buffer (before connecting), so that a
  // client that does not read holds the server's writes back soon.
  explicit Client(int port, int receive_buffer = 0) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    const timeval limit{.tv_sec = 60, .tv_usec = 0};
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof(limit));
    if (receive_buffer > 0) {
      setsockopt(fd_, SOL_SOCKET, SO_RCVBUF, &receive_buffer, sizeof(receive_buffer));
    }
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  }
  ~Client() { close(fd_); }

  bool Get(const std::string& path) {
    const std::string request = "GET " + path + " HTTP/1.1\r\nHost: t\r\n\r\n";
    return connected_ &&
           write(fd_, request.data(), request.size()) == static_cast<ssize_t>(request.size());
  }

  // Reads until `needle` has arrived (or the server closes, or 60 s pass); returns everything
  // read so far, and keeps what follows the needle's first occurrence for later reads.
  std::string ReadUntil(const std::string& needle) {
    for (;;) {
      if (size_t at = pending_.find(needle); at != std::string::npos) {
        std::string out = pending_.substr(0, at + needle.size());
        pending_.erase(0, at + needle.size());
        return out;
      }
      char buf[65536];
      const ssize_t n = read(fd_, buf, sizeof(buf));
      if (n <= 0) return std::exchange(pending_, "");
      pending_.append(buf, static_cast<size_t>(n));
    }
  }

  // Reads until the server closes the connection (or 60 s pass).
  std::string ReadToEnd() { return ReadUntil(std::string(1, '\0') + "never sent"); }

 private:
  int fd_ = -1;
  bool connected_ = false;
  std::string pending_;
};

// A server, a client, and the exchange of the client's first request.
struct Connection {
  // `receive_buffer` as for Client.
  explicit Connection(HttpServerOptions options = {}, int receive_buffer = 0)
      : server(std::move(options)), client(server->port(), receive_buffer) {
    if (client.Get("/first")) {
      ex = server.Next();
    } else {
      ADD_FAILURE() << "could not connect to the server";
    }
  }
  Server server;
  Client client;
  std::shared_ptr<HttpExchange> ex;
};

// The data of a chunked body, from after the headers to the last chunk.
std::string Unchunk(std::string body) {
  std::string data;
  size_t at = 0;
  for (;;) {
    const size_t eol = body.find("\r\n", at);
    if (eol == std::string::npos) return data;
    uint64_t size = 0;
    if (!absl::SimpleHexAtoi(body.substr(at, eol - at), &size) || size == 0) return data;
    data += body.substr(eol + 2, size);
    at = eol + 2 + size + 2;
  }
}

// Returns once the connection's work is idle: the I/O thread that ran the last of it has let
// go, so that RunHere runs on this thread. (Until then RunHere may find it still held.)
void WaitUntilIdle(HttpExchange& ex) {
  for (int attempt = 0; attempt < 100000; ++attempt) {
    Gate done;
    std::thread::id ran_on;
    ex.RunHere([&] {
      ran_on = std::this_thread::get_id();
      done.Open();
    });
    done.Wait();
    if (ran_on == std::this_thread::get_id()) return;
    std::this_thread::yield();
  }
  ADD_FAILURE() << "RunHere never ran on the calling thread of an idle connection";
}

TEST(HttpServerTest, RunHereOnAnIdleConnectionWritesBeforeItReturns) {
  Connection c;
  auto& [server, client, ex] = c;
  ASSERT_NE(ex, nullptr);
  ex->BeginStream(200, "text/event-stream");
  EXPECT_THAT(client.ReadUntil("\r\n\r\n"), StartsWith("HTTP/1.1 200"));
  WaitUntilIdle(*ex);

  // Nothing is queued for the connection now: RunHere runs on this thread, and so does the
  // write the function asks for.
  const std::thread::id caller = std::this_thread::get_id();
  std::thread::id ran_on;
  bool written = false;
  ex->RunHere([&] {
    ran_on = std::this_thread::get_id();
    ex->Send("data: one\n\n", [&] { written = true; });
  });
  EXPECT_EQ(ran_on, caller);
  EXPECT_TRUE(written) << "the output was not in the socket when RunHere returned";
  EXPECT_THAT(client.ReadUntil("one\n\n"), HasSubstr("data: one\n\n"));

  // Run hands over even when the connection is idle.
  Gate ran;
  std::thread::id run_on;
  ex->Run([&] {
    run_on = std::this_thread::get_id();
    ran.Open();
  });
  ran.Wait();
  EXPECT_NE(run_on, caller);

  // The response ends from this thread too, and the connection takes its next request.
  ex->RunHere([&] { ex->EndStream(); });
  EXPECT_THAT(client.ReadUntil("0\r\n\r\n"), HasSubstr("0\r\n\r\n"));
  ASSERT_TRUE(client.Get("/again"));
  std::shared_ptr<HttpExchange> again = server.Next();
  EXPECT_EQ(again->request().path, "/again");
  again->RunHere([&] { again->Reply({200, "text/plain", "second\n", {}}); });
  EXPECT_THAT(client.ReadUntil("second\n"), HasSubstr("Content-Length: 7"));
}

TEST(HttpServerTest, RunHereOnABusyConnectionQueuesBehindWhatIsRunning) {
  Connection c;
  auto& [server, client, ex] = c;
  ASSERT_NE(ex, nullptr);
  ex->BeginStream(200, "text/event-stream");

  // An I/O thread is held inside the connection's work.
  Gate entered, release;
  ex->Run([&] {
    entered.Open();
    release.Wait();
    ex->Send("first\n");
  });
  entered.Wait();
  std::atomic<bool> second_ran{false};
  std::thread::id second_on;
  ex->RunHere([&] {
    second_on = std::this_thread::get_id();
    ex->Send("second\n");
    ex->EndStream();
    second_ran = true;
  });
  // Queued, not run: the connection is busy on the held thread.
  EXPECT_FALSE(second_ran.load());
  release.Open();
  const std::string body = client.ReadUntil("0\r\n\r\n");
  EXPECT_EQ(Unchunk(body.substr(body.find("\r\n\r\n") + 4)), "first\nsecond\n");
  EXPECT_TRUE(second_ran.load());
  EXPECT_NE(second_on, std::this_thread::get_id());
}

TEST(HttpServerTest, SendsFromManyThreadsArriveWholeAndInEachThreadsOrder) {
  // A small receive buffer and a client that reads only once everything is queued: most
  // writes find the socket full, so the partial and asynchronous writes are exercised.
  Connection c({}, /*receive_buffer=*/16 << 10);
  auto& [server, client, ex] = c;
  ASSERT_NE(ex, nullptr);
  ex->BeginStream(200, "application/octet-stream");

  constexpr int kThreads = 4;
  constexpr int kSends = 1500;
  const std::string pad(1000, '.');
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kSends; ++i) {
        std::string line = absl::StrCat(t, " ", i, " ", pad, "\n");
        // Half the threads send straight away; the others alternately from the connection's
        // work on this thread and handed over. (A Send from a queued function is queued when
        // the function runs, so one thread mixing both would reorder its own lines.)
        if (t % 2 == 0) {
          ex->Send(std::move(line));
        } else if (i % 2 == 0) {
          ex->RunHere([&ex, line = std::move(line)] { ex->Send(line); });
        } else {
          ex->Run([&ex, line = std::move(line)] { ex->Send(line); });
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  ex->Run([&] { ex->EndStream(); });

  std::string body = client.ReadUntil("\r\n0\r\n\r\n");
  ASSERT_THAT(body, StartsWith("HTTP/1.1 200"));
  const std::string data = Unchunk(body.substr(body.find("\r\n\r\n") + 4));
  std::map<int, int> next;  // thread -> the next line expected from it
  int lines = 0;
  for (absl::string_view line : absl::StrSplit(data, '\n', absl::SkipEmpty())) {
    std::vector<absl::string_view> fields = absl::StrSplit(line, ' ');
    ASSERT_EQ(fields.size(), 3u) << "a line arrived cut or mixed with another: " << line;
    int t = 0, i = 0;
    ASSERT_TRUE(absl::SimpleAtoi(fields[0], &t) && absl::SimpleAtoi(fields[1], &i));
    ASSERT_EQ(fields[2], pad);
    ASSERT_EQ(i, next[t]) << "thread " << t << "'s lines out of order";
    next[t] = i + 1;
    ++lines;
  }
  EXPECT_EQ(lines, kThreads * kSends);
}

// Streams 64 KiB chunks from this thread (RunHere) to a client that reads nothing, until the
// server drops the client or `max_chunks` are sent; returns how many were sent once the client
// is gone. A connection that is never dropped fails the test by its timeout.
int StreamUntilDropped(Connection& c, int max_chunks) {
  Gate gone;
  c.ex->OnClientGone([&] { gone.Open(); });
  c.ex->BeginStream(200, "application/octet-stream");
  const std::string chunk(64 << 10, 'x');
  int sent = 0;
  for (; sent < max_chunks && !gone.is_open(); ++sent) c.ex->RunHere([&] { c.ex->Send(chunk); });
  gone.Wait();
  // The response no longer counts as in flight; later sends are dropped.
  c.ex->Send(chunk);
  EXPECT_EQ(c.server->num_responses_in_flight(), 0);
  return sent;
}

TEST(HttpServerTest, AClientThatStopsReadingIsDroppedAfterTheWriteTimeout) {
  HttpServerOptions options;
  options.write_timeout = std::chrono::milliseconds(300);
  Connection c(options, /*receive_buffer=*/4 << 10);
  ASSERT_NE(c.ex, nullptr);
  // 8 MiB: far more than the socket buffers hold, far less than the pending-bytes limit, so
  // the write that cannot finish is what ends it.
  StreamUntilDropped(c, 128);
}

TEST(HttpServerTest, UnsentBytesPastTheLimitDropTheStream) {
  HttpServerOptions options;
  options.max_pending_write_bytes = 1 << 20;
  Connection c(options, /*receive_buffer=*/4 << 10);
  ASSERT_NE(c.ex, nullptr);
  // Up to 64 MiB: once the socket buffers are full, the limit is passed by one of the sends,
  // which drops the client there and then (the write timeout is the default minute).
  const int sent = StreamUntilDropped(c, 1024);
  // The client sees the connection end, short of what was sent.
  EXPECT_LT(c.client.ReadToEnd().size(), (64u << 10) * sent);
}

TEST(HttpServerTest, WorkThatThrowsLeavesTheConnectionAndTheCallerServing) {
  Connection c;
  auto& [server, client, ex] = c;
  ASSERT_NE(ex, nullptr);
  ex->RunHere([] { throw std::runtime_error("from RunHere"); });
  ex->Run([] { throw std::runtime_error("from Run"); });
  ex->RunHere([&] { ex->Reply({200, "text/plain", "still here\n", {}}); });
  EXPECT_THAT(client.ReadUntil("still here\n"), StartsWith("HTTP/1.1 200"));
  // The connection takes its next request, and Stop (at the end) returns.
  ASSERT_TRUE(client.Get("/next"));
  std::shared_ptr<HttpExchange> next = server.Next();
  next->Reply({200, "text/plain", "next\n", {}});
  EXPECT_THAT(client.ReadUntil("next\n"), StartsWith("HTTP/1.1 200"));
  server->Stop();
}

TEST(HttpServerTest, StopWaitsForWorkRunningOnACallersThreadAndRunsNoneAfter) {
  Connection c;
  auto& [server, client, ex] = c;
  ASSERT_NE(ex, nullptr);
  ex->BeginStream(200, "text/event-stream");
  client.ReadUntil("\r\n\r\n");
  WaitUntilIdle(*ex);

  Gate entered, release;
  std::mutex order_mu;
  std::vector<std::string> order;
  auto note = [&](const std::string& what) {
    std::lock_guard<std::mutex> lock(order_mu);
    order.push_back(what);
  };
  std::thread worker([&] {
    ex->RunHere([&] {
      entered.Open();
      release.Wait();
      ex->Send("last\n");
      note("work done");
    });
  });
  entered.Wait();
  Gate stopping;
  std::thread stopper([&] {
    stopping.Open();
    server->Stop();
    note("stopped");
  });
  stopping.Wait();
  release.Open();
  worker.join();
  stopper.join();
  EXPECT_THAT(order, ::testing::ElementsAre("work done", "stopped"));

  std::atomic<int> ran{0};
  ex->RunHere([&] { ++ran; });
  ex->Run([&] { ++ran; });
  EXPECT_EQ(ran.load(), 0) << "work ran after Stop returned";
}

}  // namespace
}  // namespace tandem::http

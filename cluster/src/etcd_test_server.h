// Test helper: a real, single-member etcd (/usr/bin/etcd from Debian's etcd-server) on free
// loopback ports with a temporary data directory, which tests can kill and start again.
#pragma once

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tandem/cluster/etcd_client.h"

namespace tandem::cluster::testing {

inline constexpr char kEtcdBinary[] = "/usr/bin/etcd";

// A loopback port that is free now, below the kernel's ephemeral range
// (net.ipv4.ip_local_port_range): no bind to port 0 and no outgoing connection is given a port
// there, so a server killed and started again on it (EtcdServer::Start after Kill) finds it still
// free while other tests run beside it.
inline int FreeLoopbackPort() {
  int ephemeral_low = 32768;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> ephemeral_low;
  constexpr int kFirst = 10000;
  std::mt19937 rng(std::random_device{}());
  for (int attempt = 0; attempt < 1000 && ephemeral_low > kFirst + 1000; ++attempt) {
    const int port = kFirst + static_cast<int>(rng() % (ephemeral_low - kFirst));
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    address.sin_port = htons(static_cast<uint16_t>(port));
    const bool free = bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0;
    close(fd);
    if (free) return port;
  }
  ADD_FAILURE() << "no free loopback port below the ephemeral range (" << ephemeral_low << ")";
  return 0;
}

class EtcdServer {
 public:
  // With `tls`: https on the client port, client certificates required and verified against
  // tls.ca (etcd's --client-cert-auth), tls.cert/tls.key as etcd's own certificate.
  explicit EtcdServer(proto::TlsFiles tls = {}) : tls_(std::move(tls)) {
    static int counter = 0;
    name_ = absl::StrCat("tandem-test-", getpid(), "-", counter++);
    char dir_template[] = "/tmp/tandem-etcd-XXXXXX";
    data_dir_ = mkdtemp(dir_template);
    client_port_ = FreeLoopbackPort();
    peer_port_ = FreeLoopbackPort();
    while (peer_port_ == client_port_) peer_port_ = FreeLoopbackPort();
  }
  ~EtcdServer() {
    Kill();
    std::error_code ignored;
    std::filesystem::remove_all(data_dir_, ignored);
  }

  // Fails the test (fatally) when etcd is not installed or does not answer within 15 s.
  void Start() {
    ASSERT_TRUE(std::filesystem::exists(kEtcdBinary))
        << kEtcdBinary << " is missing: the cluster tests need a real etcd; run "
        << "scripts/install-deps (it installs Debian's etcd-server package)";
    const std::string client_url = url();
    const std::string peer_url = absl::StrCat("http://127.0.0.1:", peer_port_);
    std::vector<std::string> args = {
        kEtcdBinary,
        "--name",
        name_,
        "--data-dir",
        data_dir_ + "/data",
        "--listen-client-urls",
        client_url,
        "--advertise-client-urls",
        client_url,
        "--listen-peer-urls",
        peer_url,
        "--initial-advertise-peer-urls",
        peer_url,
        "--initial-cluster",
        absl::StrCat(name_, "=", peer_url),
        "--initial-cluster-token",
        name_,
        "--initial-cluster-state",
        "new",
        // A single member elects itself quickly; leases may be as short as 0.75 s.
        "--heartbeat-interval",
        "50",
        "--election-timeout",
        "500",
        "--logger",
        "zap",
        "--log-outputs",
        data_dir_ + "/etcd.log",
        "--log-level",
        "warn",
    };
    if (tls_.enabled()) {
      for (const std::string& arg :
           {"--client-cert-auth", "--trusted-ca-file", tls_.ca.c_str(), "--cert-file",
            tls_.cert.c_str(), "--key-file", tls_.key.c_str()}) {
        args.push_back(arg);
      }
    }
    pid_ = fork();
    if (pid_ == 0) {
      const int null_fd = open("/dev/null", O_WRONLY);
      dup2(null_fd, STDOUT_FILENO);
      dup2(null_fd, STDERR_FILENO);
      std::vector<char*> argv;
      for (auto& arg : args) argv.push_back(arg.data());
      argv.push_back(nullptr);
      execv(kEtcdBinary, argv.data());
      _exit(127);
    }
    ASSERT_GT(pid_, 0) << "fork failed";
    auto client =
        EtcdClient::Create({.endpoints = endpoint(), .timeout = absl::Seconds(1), .tls = tls_});
    ASSERT_TRUE(client.ok()) << client.status();
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(15);
    absl::Status last;
    while (std::chrono::steady_clock::now() < give_up) {
      int status = 0;
      ASSERT_EQ(waitpid(pid_, &status, WNOHANG), 0)
          << "etcd exited at start (status " << status << "); its log:\n"
          << LogTail();
      auto answer = (*client)->Get("/tandem-test-ready");
      if (answer.ok()) return;
      last = answer.status();
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    FAIL() << "etcd did not answer on " << endpoint() << " within 15 s: " << last << "; its log:\n"
           << LogTail();
  }

  // The end of etcd's log (the data directory goes with the server).
  std::string LogTail() const {
    std::ifstream file(data_dir_ + "/etcd.log");
    std::stringstream text;
    text << file.rdbuf();
    const std::string log = text.str();
    return log.size() > 3000 ? log.substr(log.size() - 3000) : log;
  }

  // SIGKILL, as a crash; the data directory is kept for a restart.
  void Kill() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
  }

  std::string endpoint() const { return absl::StrCat("127.0.0.1:", client_port_); }
  std::string url() const {
    return absl::StrCat(tls_.enabled() ? "https" : "http", "://127.0.0.1:", client_port_);
  }
  int client_port() const { return client_port_; }

 private:
  proto::TlsFiles tls_;
  std::string name_;
  std::string data_dir_;
  int client_port_ = 0;
  int peer_port_ = 0;
  pid_t pid_ = -1;
};

// Polls `condition` every 20 ms for up to `timeout`; true as soon as it holds.
template <typename Condition>
bool WaitFor(Condition condition, std::chrono::milliseconds timeout) {
  const auto give_up = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < give_up) {
    if (condition()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return condition();
}

}  // namespace tandem::cluster::testing

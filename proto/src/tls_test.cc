// Mutual TLS on a real gRPC server over loopback: certificates from tests/tls/make-certs.sh
// (openssl), a test-only DecodeWorker serving Stats, and clients with and without the right
// certificates.
#include "tandem/proto/tls.h"

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tandem/v1/decode.grpc.pb.h"

namespace tandem::proto {
namespace {

using ::testing::HasSubstr;

class StatsOnly final : public tandem::v1::DecodeWorker::Service {
 public:
  grpc::Status Stats(grpc::ServerContext*, const tandem::v1::StatsRequest*,
                     tandem::v1::WorkerStats* stats) override {
    stats->set_worker_id("decode-0");
    return grpc::Status::OK;
  }
};

class TlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const char* source = std::getenv("TANDEM_SOURCE_DIR");
    ASSERT_NE(source, nullptr) << "run under ctest (TANDEM_SOURCE_DIR)";
    dir_ = new std::string(
        (std::filesystem::temp_directory_path() / absl::StrCat("tandem-tls-test-", getpid()))
            .string());
    const std::string command =
        absl::StrCat(source, "/tests/tls/make-certs.sh ", *dir_, " >/dev/null");
    ASSERT_EQ(std::system(command.c_str()), 0)
        << "tests/tls/make-certs.sh failed (is openssl installed? scripts/install-deps)";
  }
  static void TearDownTestSuite() {
    std::filesystem::remove_all(*dir_);
    delete dir_;
  }

  static std::string Path(const std::string& name) { return *dir_ + "/" + name; }
  static TlsFiles Files(const std::string& ca, const std::string& leaf) {
    return {.ca = Path(ca + ".pem"), .cert = Path(leaf + ".pem"), .key = Path(leaf + ".key")};
  }

  // Starts the server with `server_tls`; returns its port.
  int Serve(const TlsFiles& server_tls) {
    auto credentials = MakeServerCredentials(server_tls);
    EXPECT_TRUE(credentials.ok()) << credentials.status();
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", *credentials, &port);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    EXPECT_NE(server_, nullptr);
    return port;
  }

  // One Stats call through a channel built from `client_tls` (as the router builds them).
  static grpc::Status Call(int port, const TlsFiles& client_tls) {
    auto credentials = MakeChannelCredentials(client_tls);
    EXPECT_TRUE(credentials.ok()) << credentials.status();
    grpc::ChannelArguments args;
    AddTlsChannelArgs(client_tls, &args);
    auto channel =
        grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", port), *credentials, args);
    return Call(channel);
  }
  static grpc::Status Call(const std::shared_ptr<grpc::Channel>& channel) {
    auto stub = tandem::v1::DecodeWorker::NewStub(channel);
    grpc::ClientContext context;
    // A bound for a hang: a loaded machine may take seconds for a handshake.
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    tandem::v1::WorkerStats stats;
    return stub->Stats(&context, tandem::v1::StatsRequest(), &stats);
  }

  void TearDown() override {
    if (server_) server_->Shutdown(std::chrono::system_clock::now());
  }

  static std::string* dir_;
  StatsOnly service_;
  std::unique_ptr<grpc::Server> server_;
};

std::string* TlsTest::dir_ = nullptr;

TEST_F(TlsTest, MutualTlsServesAClientOfTheSameCa) {
  const int port = Serve(Files("ca", "server"));
  grpc::Status status = Call(port, Files("ca", "client"));
  EXPECT_TRUE(status.ok()) << status.error_message();
  // The node certificate serves as a client certificate too.
  status = Call(port, Files("ca", "server"));
  EXPECT_TRUE(status.ok()) << status.error_message();
}

TEST_F(TlsTest, RefusesAClientWithoutCertificate) {
  const int port = Serve(Files("ca", "server"));
  grpc::SslCredentialsOptions no_cert;
  std::ifstream ca(Path("ca.pem"));
  no_cert.pem_root_certs.assign(std::istreambuf_iterator<char>(ca), {});
  grpc::Status status = Call(grpc::CreateChannel(absl::StrCat("127.0.0.1:", port),
                                                 grpc::SslCredentials(no_cert)));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
}

TEST_F(TlsTest, RefusesAClientCertificateFromAnotherCa) {
  const int port = Serve(Files("ca", "server"));
  // Trusts the right CA but presents a certificate the server's CA did not sign.
  TlsFiles rogue = Files("ca", "rogue");
  grpc::Status status = Call(port, rogue);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
}

TEST_F(TlsTest, RefusesAPlaintextClient) {
  const int port = Serve(Files("ca", "server"));
  grpc::Status status = Call(port, TlsFiles{});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
}

TEST_F(TlsTest, ClientRefusesAServerOfAnotherCa) {
  const int port = Serve(Files("other-ca", "rogue"));
  grpc::Status status = Call(port, Files("ca", "client"));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
}

TEST_F(TlsTest, ServerNameOverrideForCertificatesWithoutTheDialedAddress) {
  const int port = Serve(Files("ca", "named"));
  // named.pem carries only DNS:tandem-internal: dialing 127.0.0.1 fails the name check...
  grpc::Status status = Call(port, Files("ca", "client"));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
  // ...unless the expected name is given.
  TlsFiles named = Files("ca", "client");
  named.server_name = "tandem-internal";
  status = Call(port, named);
  EXPECT_TRUE(status.ok()) << status.error_message();
}

TEST_F(TlsTest, NoFilesIsPlaintext) {
  EXPECT_TRUE(ValidateTlsFiles({}).ok());
  const int port = Serve(TlsFiles{});
  grpc::Status status = Call(port, TlsFiles{});
  EXPECT_TRUE(status.ok()) << status.error_message();
}

TEST_F(TlsTest, FileErrorsNameTheFile) {
  EXPECT_TRUE(ValidateTlsFiles(Files("ca", "server")).ok());

  TlsFiles partial{.ca = Path("ca.pem")};
  absl::Status status = ValidateTlsFiles(partial);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("no certificate or key file given"));

  TlsFiles missing = Files("ca", "server");
  missing.key = Path("nope.key");
  status = ValidateTlsFiles(missing);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr(Path("nope.key")));
  EXPECT_THAT(status.message(), HasSubstr("cannot be read"));
  EXPECT_FALSE(MakeServerCredentials(missing).ok());
  EXPECT_FALSE(MakeChannelCredentials(missing).ok());

  // A key where the certificate should be, and a certificate where the key should be.
  TlsFiles swapped = Files("ca", "server");
  std::swap(swapped.cert, swapped.key);
  status = ValidateTlsFiles(swapped);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("is not a PEM CERTIFICATE"));
  EXPECT_THAT(status.message(), HasSubstr(Path("server.key")));

  const std::string empty = Path("empty.pem");
  std::ofstream(empty).close();
  TlsFiles empty_ca = Files("ca", "server");
  empty_ca.ca = empty;
  status = ValidateTlsFiles(empty_ca);
  EXPECT_THAT(status.message(), HasSubstr("(it is empty)"));
}

}  // namespace
}  // namespace tandem::proto

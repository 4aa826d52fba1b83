#include "tandem/proto/tls.h"

#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "tandem/base/host_port.h"
#include "tandem/base/status_macros.h"

namespace tandem::proto {
namespace {

struct Pems {
  std::string ca, cert, key;
};

// The content of the PEM file `path`, which must hold a block whose label ends with `label`
// ("CERTIFICATE", "PRIVATE KEY").
absl::StatusOr<std::string> ReadPem(const std::string& what, const std::string& path,
                                    const std::string& label) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(absl::StrCat("TLS ", what, " file '", path,
                                                   "' cannot be read: ", std::strerror(errno)));
  }
  std::ostringstream content;
  content << in.rdbuf();
  if (in.bad()) {
    return absl::InvalidArgumentError(
        absl::StrCat("TLS ", what, " file '", path, "' cannot be read"));
  }
  std::string pem = content.str();
  if (!absl::StrContains(pem, "-----BEGIN ") ||
      !absl::StrContains(pem, absl::StrCat(label, "-----"))) {
    return absl::InvalidArgumentError(absl::StrCat("TLS ", what, " file '", path,
                                                   "' is not a PEM ", label,
                                                   pem.empty() ? " (it is empty)" : ""));
  }
  return pem;
}

absl::StatusOr<Pems> ReadAll(const TlsFiles& tls) {
  std::vector<std::string> missing;
  if (tls.ca.empty()) missing.push_back("CA");
  if (tls.cert.empty()) missing.push_back("certificate");
  if (tls.key.empty()) missing.push_back("key");
  if (!missing.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("TLS needs a CA, a certificate and a key file; no ",
                     absl::StrJoin(missing, " or "), " file given"));
  }
  Pems pems;
  auto ca = ReadPem("CA", tls.ca, "CERTIFICATE");
  if (!ca.ok()) return ca.status();
  auto cert = ReadPem("certificate", tls.cert, "CERTIFICATE");
  if (!cert.ok()) return cert.status();
  auto key = ReadPem("key", tls.key, "PRIVATE KEY");
  if (!key.ok()) return key.status();
  pems.ca = *std::move(ca);
  pems.cert = *std::move(cert);
  pems.key = *std::move(key);
  return pems;
}

}  // namespace

absl::Status ValidateTlsFiles(const TlsFiles& tls) {
  if (!tls.enabled()) return absl::OkStatus();
  return ReadAll(tls).status();
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsFiles& tls) {
  if (!tls.enabled()) return grpc::InsecureServerCredentials();
  absl::StatusOr<Pems> pems = ReadAll(tls);
  if (!pems.ok()) return pems.status();
  grpc::SslServerCredentialsOptions options(
      GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  options.pem_root_certs = pems->ca;
  options.pem_key_cert_pairs.push_back({pems->key, pems->cert});
  std::shared_ptr<grpc::ServerCredentials> credentials = grpc::SslServerCredentials(options);
  if (credentials == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("TLS server credentials from '", tls.cert,
                                                   "' and '", tls.key, "' were refused"));
  }
  return credentials;
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const TlsFiles& tls) {
  if (!tls.enabled()) return grpc::InsecureChannelCredentials();
  absl::StatusOr<Pems> pems = ReadAll(tls);
  if (!pems.ok()) return pems.status();
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = pems->ca;
  options.pem_private_key = pems->key;
  options.pem_cert_chain = pems->cert;
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::SslCredentials(options);
  if (credentials == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("TLS channel credentials from '", tls.cert,
                                                   "' and '", tls.key, "' were refused"));
  }
  return credentials;
}

void AddTlsChannelArgs(const TlsFiles& tls, grpc::ChannelArguments* args) {
  if (tls.enabled() && !tls.server_name.empty()) args->SetSslTargetNameOverride(tls.server_name);
}

absl::StatusOr<StartedServer> StartGrpcServer(const std::string& address, grpc::Service* service,
                                              const TlsFiles& tls) {
  TANDEM_ASSIGN_OR_RETURN(auto host_port, SplitHostPort(address));
  TANDEM_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                          MakeServerCredentials(tls));
  grpc::ServerBuilder builder;
  int selected_port = 0;
  builder.AddListeningPort(address, credentials, &selected_port);
  builder.RegisterService(service);
  StartedServer started;
  started.server = builder.BuildAndStart();
  if (started.server == nullptr || selected_port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot serve gRPC on ", address));
  }
  const std::string& host = host_port.first;
  started.address = host.find(':') != std::string::npos
                        ? absl::StrCat("[", host, "]:", selected_port)
                        : absl::StrCat(host, ":", selected_port);
  return started;
}

}  // namespace tandem::proto

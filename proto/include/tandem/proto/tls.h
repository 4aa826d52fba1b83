// Mutual TLS for Tandem's internal plane: the gRPC control plane between router and workers,
// and the etcd client. Every process is given one CA, its own certificate and its key (PEM
// files); servers require a client certificate signed by that CA, clients verify the server's
// certificate against it and present their own. No files: plaintext, as before.
//
//   proto::TlsFiles tls{.ca = "ca.pem", .cert = "node.pem", .key = "node.key"};
//   TANDEM_ASSIGN_OR_RETURN(auto server_creds, proto::MakeServerCredentials(tls));
//   builder.AddListeningPort(address, server_creds, &port);
//
//   TANDEM_ASSIGN_OR_RETURN(auto channel_creds, proto::MakeChannelCredentials(tls));
//   grpc::ChannelArguments args;
//   proto::AddTlsChannelArgs(tls, &args);
//   auto channel = grpc::CreateCustomChannel(address, channel_creds, args);
//
// The KV transfer (kvtransfer, UCX) is not covered: see docs/operations.md.
#pragma once

#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/impl/service_type.h>
#include <grpcpp/server.h>
#include <grpcpp/support/channel_arguments.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tandem::proto {

struct TlsFiles {
  // PEM certificate(s) of the CA that every peer's certificate must chain to.
  std::string ca;
  // PEM certificate (chain) this process presents, as a server and as a client.
  std::string cert;
  // PEM private key of `cert`.
  std::string key;
  // Clients only: the name the servers' certificates must carry instead of the dialed host
  // (for certificates whose subject alternative names do not list the address dialed).
  std::string server_name;

  // Any of the three files given (Validate then requires all three).
  bool enabled() const { return !ca.empty() || !cert.empty() || !key.empty(); }
};

// OK when no file is given or all three are readable PEM files of the right kind;
// InvalidArgument naming the file otherwise (or naming the missing ones).
absl::Status ValidateTlsFiles(const TlsFiles& tls);

// Server credentials requiring and verifying a client certificate against `tls.ca`;
// InsecureServerCredentials when `tls` is not enabled.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsFiles& tls);

// Channel credentials verifying the server against `tls.ca` and presenting `tls.cert`;
// InsecureChannelCredentials when `tls` is not enabled.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const TlsFiles& tls);

// Sets the expected server name on `args` when `tls.server_name` is given (TLS only).
void AddTlsChannelArgs(const TlsFiles& tls, grpc::ChannelArguments* args);

// A started gRPC server and the "host:port" it is bound to (the chosen port when `address`
// asked for port 0; an IPv6 host in brackets).
struct StartedServer {
  std::unique_ptr<grpc::Server> server;
  std::string address;
};

// Serves `service` on `address` ("host:port"), with mutual TLS when `tls` is enabled.
// InvalidArgument for a bad address or TLS file, Unavailable when the port cannot be bound.
absl::StatusOr<StartedServer> StartGrpcServer(const std::string& address, grpc::Service* service,
                                              const TlsFiles& tls);

}  // namespace tandem::proto

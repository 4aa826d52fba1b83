// tandem_kvtransfer_peer: hosts one kvtransfer agent in its own process so that tests (and
// people) can push bytes into another process, check what arrived, and kill the peer.
//
//   tandem_kvtransfer_peer [--backend=ucx] [--bytes=N] [--host=127.0.0.1] [--port=0]
//                          [--transports=UCX_TLS list]
//
// Registers a zero-filled region of N bytes as region 0 and prints, one per line:
//   address <agent address>
//   descriptor <region descriptor, hex>
// then serves until killed or until stdin closes, answering commands read from stdin:
//   checksum <offset> <bytes>   ->  checksum <FNV-1a 64 of those bytes, 16 hex digits>
//   quit                        ->  exits
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "tandem/kvtransfer/agent.h"

namespace {

// Reads bytes that UCX's progress thread wrote, ordered before the checksum command only
// through the sender (another process), which ThreadSanitizer cannot see: left uninstrumented,
// or a TSan build would report (and suppress, tsan.supp) every word, taking minutes.
__attribute__((no_sanitize("thread"))) uint64_t Fnv1a(const unsigned char* data, uint64_t size) {
  uint64_t hash = 14695981039346656037ull;
  for (uint64_t i = 0; i < size; ++i) {
    hash ^= data[i];
    hash *= 1099511628211ull;
  }
  return hash;
}

int Fail(const std::string& message) {
  std::fprintf(stderr, "tandem_kvtransfer_peer: %s\n", message.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  tandem::kvtransfer::AgentOptions options;
  options.backend = "ucx";
  options.name = "peer";
  uint64_t bytes = 1 << 20;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const auto value = [&](const char* flag) -> const char* {
      return absl::StartsWith(arg, flag) ? arg.c_str() + std::string(flag).size() : nullptr;
    };
    if (const char* v = value("--backend=")) {
      options.backend = v;
    } else if (const char* v = value("--bytes=")) {
      if (!absl::SimpleAtoi(v, &bytes) || bytes == 0) return Fail("bad --bytes");
    } else if (const char* v = value("--host=")) {
      options.listen_host = v;
    } else if (const char* v = value("--transports=")) {
      options.ucx_transports = v;
    } else if (const char* v = value("--port=")) {
      if (!absl::SimpleAtoi(v, &options.listen_port)) return Fail("bad --port");
    } else {
      return Fail("unknown flag " + arg);
    }
  }
  auto agent = tandem::kvtransfer::Agent::Create(options);
  if (!agent.ok()) return Fail(agent.status().ToString());
  std::vector<unsigned char> region(bytes, 0);
  auto descriptor = (*agent)->RegisterMemory(0, region.data(), region.size());
  if (!descriptor.ok()) return Fail(descriptor.status().ToString());
  std::cout << "address " << (*agent)->address() << "\n"
            << "descriptor " << absl::BytesToHexString(*descriptor) << std::endl;

  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string command;
    in >> command;
    if (command == "quit") break;
    if (command == "checksum") {
      uint64_t offset = 0, size = 0;
      if (!(in >> offset >> size) || offset > region.size() || size > region.size() - offset) {
        std::cout << "error bad checksum range" << std::endl;
        continue;
      }
      char hex[17];
      std::snprintf(hex, sizeof(hex), "%016llx",
                    static_cast<unsigned long long>(Fnv1a(region.data() + offset, size)));
      std::cout << "checksum " << hex << std::endl;
    } else {
      std::cout << "error unknown command" << std::endl;
    }
  }
  return (*agent)->DeregisterMemory(0).ok() ? 0 : 1;
}

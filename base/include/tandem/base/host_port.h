// "host:port" addresses as the CLI flags and worker options spell them.
#pragma once

#include <string>
#include <utility>

#include "absl/status/statusor.h"

namespace tandem {

// Splits at the last colon: ("127.0.0.1", 7001) from "127.0.0.1:7001", ("::1", 80) from
// "[::1]:80" (brackets dropped). InvalidArgument naming the address when the host is empty or
// the port is not a number in [0, 65535].
absl::StatusOr<std::pair<std::string, int>> SplitHostPort(const std::string& address);

}  // namespace tandem

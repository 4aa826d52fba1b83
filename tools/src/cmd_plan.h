// Helpers shared by the `tandem plan` subcommands (cmd_plan.cc, cmd_plan_calibrate.cc). Nothing
// outside tools/src includes this.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"
#include "tandem/tools/args.h"

namespace tandem::tools::plan_internal {

absl::StatusOr<int64_t> PositiveInt(const Args& args, const std::string& name, int64_t fallback,
                                    int64_t hi = int64_t{1} << 40);
absl::StatusOr<double> PositiveDouble(const Args& args, const std::string& name, double fallback);
absl::Status WriteJson(const std::string& path, const nlohmann::json& j);

// `tandem plan calibrate`.
absl::Status Calibrate(int argc, char** argv);

}  // namespace tandem::tools::plan_internal

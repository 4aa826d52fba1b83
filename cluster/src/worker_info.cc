#include "tandem/cluster/worker_info.h"

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace tandem::cluster {

bool WorkerInfo::SameAs(const WorkerInfo& other) const {
  return id == other.id && role == other.role && address == other.address &&
         metrics_address == other.metrics_address && kv_backend == other.kv_backend &&
         kv_blocks_total == other.kv_blocks_total;
}

bool IsWorkerRole(const std::string& role) { return role == "prefill" || role == "decode"; }

std::string WorkersPrefix(const std::string& cluster) {
  return absl::StrCat("/tandem/", cluster, "/workers/");
}

std::string WorkerKey(const std::string& cluster, const std::string& role,
                      const std::string& id) {
  return absl::StrCat(WorkersPrefix(cluster), role, "/", id);
}

std::string WorkerInfoToJson(const WorkerInfo& info) {
  nlohmann::json json = {
      {"id", info.id},
      {"role", info.role},
      {"address", info.address},
      {"metrics_address", info.metrics_address},
      {"kv_backend", info.kv_backend},
      {"capacity", {{"kv_blocks_total", info.kv_blocks_total}}},
  };
  return json.dump();
}

absl::StatusOr<WorkerInfo> WorkerInfoFromJson(const std::string& text) {
  nlohmann::json json = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!json.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat("worker value is not a JSON object: ", text));
  }
  WorkerInfo info;
  auto string_field = [&](const char* name, std::string& out, bool required) -> absl::Status {
    auto it = json.find(name);
    if (it == json.end() || it->is_null()) {
      if (required) {
        return absl::InvalidArgumentError(absl::StrCat("worker value has no \"", name, "\""));
      }
      return absl::OkStatus();
    }
    if (!it->is_string()) {
      return absl::InvalidArgumentError(absl::StrCat("worker value: \"", name, "\" is not a string"));
    }
    out = it->get<std::string>();
    if (required && out.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("worker value: \"", name, "\" is empty"));
    }
    return absl::OkStatus();
  };
  for (auto status : {string_field("id", info.id, true), string_field("role", info.role, true),
                      string_field("address", info.address, true),
                      string_field("metrics_address", info.metrics_address, false),
                      string_field("kv_backend", info.kv_backend, false)}) {
    if (!status.ok()) return status;
  }
  if (!IsWorkerRole(info.role)) {
    return absl::InvalidArgumentError(absl::StrCat("worker value: unknown role ", info.role));
  }
  if (auto capacity = json.find("capacity"); capacity != json.end() && capacity->is_object()) {
    if (auto blocks = capacity->find("kv_blocks_total");
        blocks != capacity->end() && blocks->is_number_integer()) {
      info.kv_blocks_total = blocks->get<int64_t>();
    }
  }
  return info;
}

absl::Status ValidateKeySegment(const std::string& what, const std::string& value) {
  bool ok = !value.empty() && value.size() <= 128;
  for (char c : value) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') {
      ok = false;
    }
  }
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " must be 1 to 128 characters of [A-Za-z0-9._-], got '", value, "'"));
  }
  return absl::OkStatus();
}

}  // namespace tandem::cluster

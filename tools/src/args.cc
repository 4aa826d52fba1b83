#include "tandem/tools/args.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_cat.h"

namespace tandem::tools {

void Args::Declare(const std::string& name, const std::string& value_name,
                   const std::string& help) {
  declared_[name] = Flag{value_name, help};
  order_.push_back(name);
}

void Args::DeclareSwitch(const std::string& name, const std::string& help) {
  declared_[name] = Flag{"", help};
  order_.push_back(name);
}

absl::Status Args::Parse(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      help_ = true;
      continue;
    }
    if (arg.rfind("--", 0) != 0 || arg.size() == 2) {
      positional_.push_back(arg);
      continue;
    }
    std::string name = arg.substr(2);
    std::optional<std::string> inline_value;
    if (auto eq = name.find('='); eq != std::string::npos) {
      inline_value = name.substr(eq + 1);
      name = name.substr(0, eq);
    }
    auto it = declared_.find(name);
    if (it == declared_.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat(command_, ": unknown flag --", name, " (see --help)"));
    }
    if (it->second.value_name.empty()) {
      if (inline_value) {
        return absl::InvalidArgumentError(absl::StrCat(command_, ": --", name, " takes no value"));
      }
      switches_.insert(name);
      continue;
    }
    if (inline_value) {
      values_[name] = *inline_value;
    } else if (i + 1 < argc) {
      values_[name] = argv[++i];
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(command_, ": --", name, " needs a value ", it->second.value_name));
    }
  }
  if (static_cast<int>(positional_.size()) > max_positional_) {
    return absl::InvalidArgumentError(
        absl::StrCat(command_, ": unexpected argument '", positional_[max_positional_], "'"));
  }
  return absl::OkStatus();
}

bool Args::HandleHelp() const {
  if (help_) std::fputs(Usage().c_str(), stdout);
  return help_;
}

std::string Args::Usage() const {
  std::string out = absl::StrCat("usage: tandem ", command_, " [flags]\n");
  for (const auto& name : order_) {
    const Flag& f = declared_.at(name);
    std::string left = absl::StrCat("  --", name, f.value_name.empty() ? "" : " ", f.value_name);
    if (left.size() < 28) left.resize(28, ' ');
    absl::StrAppend(&out, left, " ", f.help, "\n");
  }
  return out;
}

std::optional<std::string> Args::Get(const std::string& name) const {
  auto it = values_.find(name);
  if (it == values_.end()) return std::nullopt;
  return it->second;
}

std::string Args::GetOr(const std::string& name, const std::string& fallback) const {
  auto v = Get(name);
  return v ? *v : fallback;
}

absl::StatusOr<int64_t> Args::Int(const std::string& name, int64_t fallback) const {
  auto v = Get(name);
  if (!v) return fallback;
  errno = 0;
  char* end = nullptr;
  long long x = std::strtoll(v->c_str(), &end, 10);
  if (v->empty() || *end != '\0' || errno == ERANGE) {
    return absl::InvalidArgumentError(
        absl::StrCat(command_, ": --", name, " must be an integer, got '", *v, "'"));
  }
  return static_cast<int64_t>(x);
}

absl::StatusOr<double> Args::Double(const std::string& name, double fallback) const {
  auto v = Get(name);
  if (!v) return fallback;
  errno = 0;
  char* end = nullptr;
  double x = std::strtod(v->c_str(), &end);
  if (v->empty() || *end != '\0' || errno == ERANGE || !std::isfinite(x)) {
    return absl::InvalidArgumentError(
        absl::StrCat(command_, ": --", name, " must be a finite number, got '", *v, "'"));
  }
  return x;
}

int ExitCode(const std::string& command, const absl::Status& status) {
  if (status.ok()) return 0;
  std::string message(status.message());
  const std::string prefix = command + ": ";
  if (message.rfind(prefix, 0) == 0) message = message.substr(prefix.size());
  std::fprintf(stderr, "tandem %s: %s\n", command.c_str(), message.c_str());
  return 1;
}

}  // namespace tandem::tools

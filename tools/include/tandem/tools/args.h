// Command-line flags of one `tandem` subcommand: `--name value`, `--name=value`, `--switch`.
#pragma once

#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tandem::tools {

// Parses argv against the flags a subcommand declares. Unknown flags, a missing value and a
// malformed number are errors whose message names the flag.
//   Args args;
//   args.Declare("model", "DIR", "checkpoint directory");
//   args.DeclareSwitch("json", "print one JSON object");
//   TANDEM_RETURN_IF_ERROR(args.Parse(argc, argv));
//   int n = args.Int("max-tokens", 16).value();
class Args {
 public:
  explicit Args(std::string command) : command_(std::move(command)) {}
  void Declare(const std::string& name, const std::string& value_name, const std::string& help);
  void DeclareSwitch(const std::string& name, const std::string& help);
  // Accepts up to `max` positional arguments (none by default: Parse refuses them).
  void AllowPositional(int max) { max_positional_ = max; }
  // argv[0] is the subcommand name. `--help` sets help_requested().
  absl::Status Parse(int argc, char** argv);

  bool help_requested() const { return help_; }
  // The subcommand's name, as given to the constructor.
  const std::string& command() const { return command_; }
  // Prints Usage() on stdout when --help was given; true means the command is done.
  bool HandleHelp() const;
  std::string Usage() const;
  bool Has(const std::string& name) const { return values_.count(name) > 0; }
  bool Switch(const std::string& name) const { return switches_.count(name) > 0; }
  std::optional<std::string> Get(const std::string& name) const;
  std::string GetOr(const std::string& name, const std::string& fallback) const;
  absl::StatusOr<int64_t> Int(const std::string& name, int64_t fallback) const;
  absl::StatusOr<double> Double(const std::string& name, double fallback) const;
  // Positional arguments after the flags.
  const std::vector<std::string>& positional() const { return positional_; }

 private:
  struct Flag {
    std::string value_name;  // empty for a switch
    std::string help;
  };
  std::string command_;
  std::map<std::string, Flag> declared_;
  std::vector<std::string> order_;
  std::map<std::string, std::string> values_;
  std::set<std::string> switches_;
  std::vector<std::string> positional_;
  int max_positional_ = 0;
  bool help_ = false;
};

// The exit code of subcommand `command` for `status`: 0 when OK; otherwise prints one line
// "tandem <command>: <reason>" on stderr (without repeating the command when the message already
// starts with it, as Args messages do) and returns 1.
int ExitCode(const std::string& command, const absl::Status& status);

}  // namespace tandem::tools

// `tandem tokenize`: encodes each stdin line to a JSON array of ids, or (--decode) decodes a
// JSON array of ids per line to a JSON string. Lines are split on '\n' only, so '\r' and other
// separators stay part of the text; --json-input reads each line as a JSON string instead, for
// texts that contain '\n'.
#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "commands.h"
#include "nlohmann/json.hpp"
#include "tandem/base/status_macros.h"
#include "tandem/text/tokenizer.h"
#include "tandem/tools/args.h"

namespace tandem::tools {
namespace {

using Json = nlohmann::json;

// Parses one --decode line: a JSON array of ids within the vocabulary.
absl::StatusOr<std::vector<int32_t>> ParseIds(const std::string& line, int vocab_size) {
  Json j = Json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_array()) {
    return absl::InvalidArgumentError("expected a JSON array of token ids");
  }
  std::vector<int32_t> ids;
  ids.reserve(j.size());
  for (const Json& v : j) {
    if (!v.is_number_integer()) {
      return absl::InvalidArgumentError(absl::StrCat("token id ", v.dump(), " is not an integer"));
    }
    int64_t id = v.get<int64_t>();
    if (id < 0 || id >= vocab_size) {
      return absl::OutOfRangeError(
          absl::StrCat("token id ", id, " is outside the vocabulary [0, ", vocab_size, ")"));
    }
    ids.push_back(static_cast<int32_t>(id));
  }
  return ids;
}

// The text of one encode line: the line itself, or the JSON string it holds.
absl::StatusOr<std::string> ParseText(const std::string& line, bool json_input) {
  std::string text = line;
  if (json_input) {
    Json j = Json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_string()) {
      return absl::InvalidArgumentError("expected a JSON string");
    }
    text = j.get<std::string>();
  }
  if (text::ReplaceInvalidUtf8(text) != text) {
    return absl::InvalidArgumentError("text is not valid UTF-8");
  }
  return text;
}

absl::Status Run(int argc, char** argv) {
  Args args("tokenize");
  args.Declare("tokenizer", "FILE", "tokenizer.json to use (required)");
  args.DeclareSwitch("decode", "read a JSON array of ids per line, print the text as JSON");
  args.DeclareSwitch("no-special",
                     "encode: no BOS or other template tokens; decode: drop specials");
  args.DeclareSwitch("json-input", "encode: each line is a JSON string (may hold newlines)");
  TANDEM_RETURN_IF_ERROR(args.Parse(argc, argv));
  if (args.HandleHelp()) return absl::OkStatus();
  std::optional<std::string> path = args.Get("tokenizer");
  if (!path) return absl::InvalidArgumentError("--tokenizer FILE is required");
  TANDEM_ASSIGN_OR_RETURN(auto tokenizer, text::Tokenizer::FromFile(*path));

  const bool decode = args.Switch("decode");
  const bool special = !args.Switch("no-special");
  const bool json_input = args.Switch("json-input");
  // Interactive use sees each answer at once; pipes get full buffering.
  const bool flush_each_line = isatty(STDOUT_FILENO);
  std::ios::sync_with_stdio(false);
  std::string line, out;
  for (int64_t number = 1; std::getline(std::cin, line); ++number) {
    absl::Status status;
    if (decode) {
      auto ids = ParseIds(line, tokenizer->vocab_size());
      if (ids.ok()) {
        out = Json(tokenizer->Decode(*ids, /*skip_special_tokens=*/!special)).dump();
      }
      status = ids.status();
    } else {
      auto text = ParseText(line, json_input);
      if (text.ok()) out = Json(tokenizer->Encode(*text, special)).dump();
      status = text.status();
    }
    if (!status.ok()) {
      return absl::Status(status.code(), absl::StrCat("line ", number, ": ", status.message()));
    }
    out += '\n';
    std::cout << out;
    if (flush_each_line) std::cout.flush();
  }
  std::cout.flush();
  if (!std::cout) return absl::DataLossError("cannot write to stdout");
  if (std::cin.bad()) return absl::DataLossError("cannot read stdin");
  return absl::OkStatus();
}

}  // namespace

int RunTokenize(int argc, char** argv) { return ExitCode("tokenize", Run(argc, argv)); }

}  // namespace tandem::tools

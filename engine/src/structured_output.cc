#include "tandem/engine/structured_output.h"

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "tandem/base/status_macros.h"
#include "tandem/grammar/json_schema.h"

namespace tandem::engine {

const char* ConstraintKindName(ConstraintKind kind) {
  switch (kind) {
    case ConstraintKind::kNone:
      return "none";
    case ConstraintKind::kJsonSchema:
      return "json_schema";
    case ConstraintKind::kJsonObject:
      return "json_object";
    case ConstraintKind::kRegex:
      return "regex";
    case ConstraintKind::kGrammar:
      return "grammar";
  }
  return "unknown";
}

absl::Status StructuredOutput::Validate(int num_prompt_tokens) const {
  if (kind == ConstraintKind::kNone) {
    if (!source.empty() || replay_prompt_tokens != 0) {
      return absl::InvalidArgumentError("structured output: a source without a kind");
    }
    return absl::OkStatus();
  }
  if (static_cast<int>(kind) < 0 ||
      static_cast<int>(kind) > static_cast<int>(ConstraintKind::kGrammar)) {
    return absl::InvalidArgumentError(
        absl::StrCat("structured output: unknown kind ", static_cast<int>(kind)));
  }
  if (source.size() > static_cast<size_t>(kMaxConstraintBytes)) {
    return absl::InvalidArgumentError(absl::StrCat("structured output: the ",
                                                   ConstraintKindName(kind), " is ", source.size(),
                                                   " bytes; at most ", kMaxConstraintBytes));
  }
  if (kind == ConstraintKind::kJsonObject ? !source.empty() : source.empty()) {
    return absl::InvalidArgumentError(kind == ConstraintKind::kJsonObject
                                          ? "structured output: json_object takes no source"
                                          : absl::StrCat("structured output: the ",
                                                         ConstraintKindName(kind),
                                                         " must not be empty"));
  }
  if (replay_prompt_tokens < 0 || replay_prompt_tokens >= num_prompt_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("structured output: replay_prompt_tokens must be in [0, ", num_prompt_tokens,
                     "), got ", replay_prompt_tokens));
  }
  return absl::OkStatus();
}

absl::StatusOr<grammar::Grammar> BuildGrammar(const StructuredOutput& constraint) {
  std::string gbnf;
  switch (constraint.kind) {
    case ConstraintKind::kJsonSchema: {
      nlohmann::ordered_json schema = nlohmann::ordered_json::parse(
          constraint.source, /*cb=*/nullptr, /*allow_exceptions=*/false);
      if (schema.is_discarded()) {
        return absl::InvalidArgumentError("the JSON schema is not valid JSON");
      }
      if (!schema.is_object()) {
        return absl::InvalidArgumentError("the JSON schema must be a JSON object");
      }
      TANDEM_ASSIGN_OR_RETURN(gbnf, grammar::JsonSchemaToGbnf(schema));
      break;
    }
    case ConstraintKind::kJsonObject:
      gbnf = grammar::JsonObjectGbnf();
      break;
    case ConstraintKind::kRegex: {
      TANDEM_ASSIGN_OR_RETURN(gbnf, grammar::RegexToGbnf(constraint.source));
      break;
    }
    case ConstraintKind::kGrammar:
      return grammar::ParseGbnf(constraint.source);
    default:
      return absl::InvalidArgumentError(absl::StrCat("structured output: no grammar for kind ",
                                                     ConstraintKindName(constraint.kind)));
  }
  return grammar::ParseGbnf(gbnf);
}

}  // namespace tandem::engine

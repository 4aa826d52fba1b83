// Structured outputs: a constraint on what a sample may generate (a JSON schema, any JSON
// object, a regular expression or a GBNF grammar), carried in SamplingParams and enforced by the
// engine's sampler through a grammar matcher (tandem::grammar).
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tandem/grammar/grammar.h"

namespace tandem::engine {

enum class ConstraintKind { kNone, kJsonSchema, kJsonObject, kRegex, kGrammar };

// "json_schema", "json_object", "regex", "grammar" ("none" for kNone, "unknown" otherwise).
const char* ConstraintKindName(ConstraintKind kind);

inline constexpr int kMaxConstraintBytes = 64 << 10;  // a schema, regex or grammar's text

// What a request's output must match. Every sample of the request is constrained on its own.
//   params.structured = {ConstraintKind::kJsonSchema, R"({"type":"object", ...})"};
struct StructuredOutput {
  ConstraintKind kind = ConstraintKind::kNone;
  // The JSON schema (JSON text), the regular expression, or the GBNF grammar (root rule
  // "root"); empty for kJsonObject.
  std::string source;
  // The last `replay_prompt_tokens` tokens of the prompt are output the sample already
  // generated under this constraint (a sample continued elsewhere by recomputing its prompt
  // plus its tokens): the matcher accepts them before the first new token.
  int replay_prompt_tokens = 0;

  bool active() const { return kind != ConstraintKind::kNone; }
  bool operator==(const StructuredOutput&) const = default;

  // Checks the kind, the source's size and presence, and replay_prompt_tokens against the
  // prompt's length; does not parse the source (BuildGrammar does).
  absl::Status Validate(int num_prompt_tokens) const;
};

// The grammar of an active constraint, without a vocabulary: what the router checks before it
// submits a request and the engine compiles for its vocabulary. InvalidArgument naming the
// problem (a schema keyword and its JSON pointer, a regex column, a GBNF line and column).
absl::StatusOr<grammar::Grammar> BuildGrammar(const StructuredOutput& constraint);

}  // namespace tandem::engine

// Test-only: compiling a grammar for a vocabulary of the 256 single bytes plus a stop token,
// and matching whole texts with it.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "gtest/gtest.h"
#include "tandem/grammar/grammar.h"
#include "tandem/grammar/matcher.h"

namespace tandem::grammar::testing {

inline std::shared_ptr<const TokenVocabulary> ByteVocabulary() {
  static const auto vocab = [] {
    std::vector<std::string> bytes;
    for (int b = 0; b < 256; ++b) bytes.push_back(std::string(1, static_cast<char>(b)));
    bytes.push_back("</s>");
    return *TokenVocabulary::Create(std::move(bytes), {256}, {});
  }();
  return vocab;
}

inline std::shared_ptr<const CompiledGrammar> CompileGbnf(std::string_view gbnf) {
  auto grammar = ParseGbnf(gbnf);
  EXPECT_TRUE(grammar.ok()) << grammar.status() << "\n" << gbnf;
  if (!grammar.ok()) return nullptr;
  auto compiled = CompiledGrammar::Create(*grammar, ByteVocabulary());
  EXPECT_TRUE(compiled.ok()) << compiled.status();
  return compiled.ok() ? *compiled : nullptr;
}

// The whole text is a sentence of the grammar.
inline bool Matches(const std::shared_ptr<const CompiledGrammar>& compiled, std::string_view text) {
  GrammarMatcher m(compiled);
  return m.AcceptBytes(text) && m.IsComplete();
}

}  // namespace tandem::grammar::testing

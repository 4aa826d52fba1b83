// A small byte-level BPE trainer, for synthetic checkpoints that need a real tokenizer.json.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace tandem::tools {

// Learns byte-level BPE merges on `corpus` and returns the text of a tokenizer.json laid out
// like Llama-3's: the Llama-3 Split regex + ByteLevel pre-tokenizer, a BPE model holding the 256
// byte tokens (ids 0..255, in byte order) and the learned merges, the special tokens appended
// as added tokens (special=true), a ByteLevel decoder, and a TemplateProcessing post-processor
// that puts special_tokens[0] (when there is one) in front as BOS.
//
// The result has exactly `vocab_size` ids, special tokens included. Merges are learned inside
// pre-tokenized words, most frequent pair first, ties broken by the smaller (left id, right id),
// so the output depends only on the inputs. Once every word of the corpus is a single token,
// the remaining ids are filled by merging each token with itself in id order: valid merges that
// keep vocab_size exact, however small the corpus.
//   TANDEM_ASSIGN_OR_RETURN(std::string json,
//                           TrainByteLevelBpe(BuiltinTrainingText(), 512, {"<|begin_of_text|>"}));
//
// Errors: vocab_size < 256 + special_tokens.size(), or an empty, duplicated or non-UTF-8 special
// token.
absl::StatusOr<std::string> TrainByteLevelBpe(std::string_view corpus, int vocab_size,
                                              const std::vector<std::string>& special_tokens);

// A few KB of varied English prose, code and numbers, embedded in the binary, to train on when
// no corpus is given.
std::string_view BuiltinTrainingText();

}  // namespace tandem::tools

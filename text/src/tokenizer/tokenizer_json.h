// Reading a Hugging Face tokenizer.json: typed field access with errors that name the field,
// and a SAX reader that takes the vocabulary and merges straight off the parser.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace tandem::text::bpe {

using Json = nlohmann::json;

// Ids beyond this are rejected as corrupt rather than allocated for.
inline constexpr int64_t kMaxTokenId = int64_t{1} << 24;

// InvalidArgument "<where>: <what>".
absl::Status Invalid(const std::string& where, const std::string& what);

std::string TypeOf(const Json& j);

absl::StatusOr<bool> BoolField(const Json& obj, const char* key, bool fallback,
                               const std::string& where);

absl::StatusOr<std::string> StringField(const Json& obj, const char* key, const std::string& where);

absl::StatusOr<int32_t> IdValue(const Json& value, const std::string& where);

// The two large parts of a tokenizer.json, read straight off the parser instead of through a
// JSON tree: building that tree for a 128k vocabulary and 280k merges costs most of the load.
struct BulkModel {
  bool has_vocab = false;
  bool has_merges = false;
  std::vector<std::pair<std::string, int32_t>> vocab;
  // Each merge as the merged token's text and where the left part ends in it.
  std::vector<std::pair<std::string, uint32_t>> merges;
};

// SAX handler that builds the JSON tree of everything except model.vocab and model.merges, which
// it collects into a BulkModel (leaving an empty object / array in their place).
class TokenizerJsonReader : public nlohmann::json_sax<Json> {
 public:
  explicit TokenizerJsonReader(BulkModel* bulk) : bulk_(bulk) {}

  Json& root() { return root_; }
  // Set when the handler stopped the parse because of a wrongly typed vocab or merge entry.
  const absl::Status& error() const { return error_; }

  bool null() override { return Value(Json(nullptr)); }
  bool boolean(bool v) override { return Value(Json(v)); }
  bool number_integer(number_integer_t v) override {
    if (mode_ == Mode::kVocab) return VocabId(v);
    return Value(Json(v));
  }
  bool number_unsigned(number_unsigned_t v) override {
    if (mode_ == Mode::kVocab) {
      return VocabId(v > static_cast<uint64_t>(kMaxTokenId) ? kMaxTokenId
                                                            : static_cast<int64_t>(v));
    }
    return Value(Json(v));
  }
  bool number_float(number_float_t v, const string_t&) override { return Value(Json(v)); }
  bool binary(binary_t& v) override { return Value(Json(v)); }
  bool string(string_t& v) override {
    if (mode_ == Mode::kMerges) {
      size_t space = v.find(' ');
      if (space == std::string::npos || v.find(' ', space + 1) != std::string::npos) {
        return Fail(MergeWhere(), absl::StrCat("'", v, "' is not two tokens separated by a space"));
      }
      v.erase(space, 1);
      bulk_->merges.emplace_back(std::move(v), static_cast<uint32_t>(space));
      return true;
    }
    if (mode_ == Mode::kMergePair) {
      if (pair_size_ == 0) {
        bulk_->merges.emplace_back(std::move(v), 0);
        bulk_->merges.back().second = static_cast<uint32_t>(bulk_->merges.back().first.size());
      } else if (pair_size_ == 1) {
        bulk_->merges.back().first += v;
      }
      ++pair_size_;
      return true;
    }
    return Value(Json(std::move(v)));
  }
  bool key(string_t& k) override {
    key_ = std::move(k);
    return true;
  }
  bool start_object(std::size_t) override {
    if (mode_ == Mode::kNone && InModel() && key_ == "vocab") {
      mode_ = Mode::kVocab;
      bulk_->has_vocab = true;
      return Value(Json::object());
    }
    if (mode_ != Mode::kNone) return BadEntry();
    return Open(Json::object());
  }
  bool end_object() override {
    if (mode_ == Mode::kVocab) {
      mode_ = Mode::kNone;
      return true;
    }
    return Close();
  }
  bool start_array(std::size_t) override {
    if (mode_ == Mode::kNone && InModel() && key_ == "merges") {
      mode_ = Mode::kMerges;
      bulk_->has_merges = true;
      return Value(Json::array());
    }
    if (mode_ == Mode::kMerges) {
      mode_ = Mode::kMergePair;
      pair_size_ = 0;
      return true;
    }
    if (mode_ != Mode::kNone) return BadEntry();
    return Open(Json::array());
  }
  bool end_array() override {
    if (mode_ == Mode::kMergePair) {
      if (pair_size_ != 2) return BadEntry();
      mode_ = Mode::kMerges;
      return true;
    }
    if (mode_ == Mode::kMerges) {
      mode_ = Mode::kNone;
      return true;
    }
    return Close();
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    error_ = absl::InvalidArgumentError(e.what());
    return false;
  }

 private:
  enum class Mode { kNone, kVocab, kMerges, kMergePair };

  // True when the container being filled is the object under the top-level "model" key.
  bool InModel() const {
    return stack_.size() == 2 && stack_keys_[1] == "model" && stack_[1]->is_object();
  }
  std::string MergeWhere() const {
    return absl::StrCat("model.merges[", bulk_->merges.size() - (mode_ == Mode::kMergePair), "]");
  }
  bool Fail(const std::string& where, const std::string& what) {
    error_ = Invalid(where, what);
    return false;
  }
  bool BadEntry() {
    if (mode_ == Mode::kVocab)
      return Fail("model.vocab", absl::StrCat("id of '", key_, "' must be an integer"));
    return Fail(MergeWhere(), "must be \"a b\" or [\"a\", \"b\"]");
  }
  bool VocabId(int64_t id) {
    if (id < 0 || id >= kMaxTokenId) {
      return Fail("model.vocab",
                  absl::StrCat("id ", id, " of '", key_, "' is not in [0, ", kMaxTokenId, ")"));
    }
    bulk_->vocab.emplace_back(std::move(key_), static_cast<int32_t>(id));
    return true;
  }
  // Adds a scalar (or an empty placeholder) to the container being filled.
  bool Value(Json v) {
    if (mode_ != Mode::kNone && mode_ != Mode::kVocab && mode_ != Mode::kMerges) return BadEntry();
    if (mode_ != Mode::kNone && !(v.is_object() || v.is_array())) return BadEntry();
    Insert(std::move(v));
    return true;
  }
  Json* Insert(Json v) {
    if (stack_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    Json* top = stack_.back();
    if (top->is_array()) {
      top->push_back(std::move(v));
      return &top->back();
    }
    Json& slot = (*top)[key_];
    slot = std::move(v);
    return &slot;
  }
  // Containers are filled in place: a parent is not touched again until its child closes, so
  // the pointers on the stack stay valid.
  bool Open(Json container) {
    std::string key = stack_.empty() || stack_.back()->is_array() ? std::string() : key_;
    stack_.push_back(Insert(std::move(container)));
    stack_keys_.push_back(std::move(key));
    return true;
  }
  bool Close() {
    stack_.pop_back();
    stack_keys_.pop_back();
    return true;
  }

  BulkModel* bulk_;  // not owned
  Json root_;
  std::vector<Json*> stack_;             // containers being filled, innermost last
  std::vector<std::string> stack_keys_;  // key each of them sits under ("" in arrays)
  std::string key_;
  Mode mode_ = Mode::kNone;
  int pair_size_ = 0;
  absl::Status error_;
};

}  // namespace tandem::text::bpe

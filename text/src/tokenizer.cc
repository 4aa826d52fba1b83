// Byte-level BPE read from a Hugging Face tokenizer.json.
//
// Encoding runs the stages in the order the reference implementations do:
//   1. added tokens with normalized=false are cut out of the raw text (leftmost-longest match,
//      honouring lstrip / rstrip / single_word);
//   2. every other section is normalized (NFC and friends, via utf8proc);
//   3. added tokens with normalized=true are cut out of the normalized sections;
//   4. the pre-tokenizer splits the rest into pieces (PCRE2 regex steps, then ByteLevel);
//   5. each piece's bytes are merged by rank (BPE), short pieces through a cache;
//   6. with add_special_tokens, the post-processor templates add BOS and the like.
// Everything the model sees is raw bytes; the ByteLevel byte<->character table is only used
// to read the vocabulary and merges, whose strings are written in that alphabet.
// The stages live in tokenizer/ (unicode, added_tokens, pre_tokenizer, tokenizer_json).
#include "tandem/text/tokenizer.h"

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <shared_mutex>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "tandem/base/status_macros.h"
#include "text/src/tokenizer/added_tokens.h"
#include "text/src/tokenizer/pre_tokenizer.h"
#include "text/src/tokenizer/tokenizer_json.h"
#include "text/src/tokenizer/unicode.h"

namespace tandem::text {
namespace {

using bpe::AddedToken;
using bpe::AddedTokenMatcher;
using bpe::Alphabet;
using bpe::BoolField;
using bpe::BulkModel;
using bpe::ByteLevelAlphabet;
using bpe::ByteLevelStep;
using bpe::FromByteLevel;
using bpe::IdValue;
using bpe::Invalid;
using bpe::IsValidUtf8;
using bpe::Json;
using bpe::kGpt2Pattern;
using bpe::kMaxTokenId;
using bpe::NormalForm;
using bpe::Normalize;
using bpe::PreTokenizerStep;
using bpe::ReadUtf8;
using bpe::Regex;
using bpe::Segment;
using bpe::SplitStep;
using bpe::StringField;
using bpe::ToAbsl;
using bpe::ToByteLevel;
using bpe::TokenizerJsonReader;
using bpe::TypeOf;
using bpe::Utf8Step;

// Pieces up to this many bytes are remembered; longer ones rarely repeat.
constexpr size_t kMaxCachedPieceBytes = 64;
constexpr size_t kPieceCacheCapacity = 1 << 16;

// One post-processor template: the ids of the encoded text ($A) with special tokens around it.
struct Template {
  struct Item {
    bool is_sequence = false;
    std::vector<int32_t> ids;  // special token ids when !is_sequence
  };
  std::vector<Item> items;
};

class ByteLevelBpeTokenizer : public Tokenizer {
 public:
  // `root` is the document without model.vocab and model.merges, which come in `bulk`.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> Load(const Json& root, BulkModel& bulk) {
    if (!root.is_object()) return Invalid("tokenizer.json", "top level must be an object");
    auto tok = std::unique_ptr<ByteLevelBpeTokenizer>(new ByteLevelBpeTokenizer);
    for (const char* key : {"truncation", "padding"}) {
      auto it = root.find(key);
      if (it != root.end() && !it->is_null()) {
        return Invalid(key, "is not supported (must be null); Tandem limits lengths itself");
      }
    }
    TANDEM_RETURN_IF_ERROR(tok->LoadModel(root, bulk));
    TANDEM_RETURN_IF_ERROR(tok->LoadNormalizer(root));
    TANDEM_RETURN_IF_ERROR(tok->LoadAddedTokens(root));
    TANDEM_RETURN_IF_ERROR(tok->LoadPreTokenizer(root));
    TANDEM_RETURN_IF_ERROR(tok->LoadDecoder(root));
    auto post = root.find("post_processor");
    if (post != root.end()) {
      TANDEM_RETURN_IF_ERROR(tok->LoadPostProcessor(*post, "post_processor"));
    }
    return std::unique_ptr<Tokenizer>(std::move(tok));
  }

  std::vector<int32_t> Encode(std::string_view text, bool add_special_tokens) const override {
    std::string sanitized;
    if (!IsValidUtf8(text)) {
      sanitized = ReplaceInvalidUtf8(text);
      text = sanitized;
    }
    std::vector<int32_t> ids;
    Walk(
        text, [&](int32_t id) { ids.push_back(id); },
        [&](std::string_view piece) { EncodePiece(piece, &ids); });
    if (add_special_tokens) {
      for (const Template& t : templates_) {
        std::vector<int32_t> out;
        out.reserve(ids.size() + 4);
        for (const Template::Item& item : t.items) {
          const std::vector<int32_t>& src = item.is_sequence ? ids : item.ids;
          out.insert(out.end(), src.begin(), src.end());
        }
        ids = std::move(out);
      }
    }
    return ids;
  }

  std::vector<std::string> PreTokenize(std::string_view text) const override {
    std::string sanitized;
    if (!IsValidUtf8(text)) {
      sanitized = ReplaceInvalidUtf8(text);
      text = sanitized;
    }
    std::vector<std::string> pieces;
    Walk(
        text, [](int32_t) {}, [&](std::string_view piece) { pieces.emplace_back(piece); });
    return pieces;
  }

  std::string Decode(std::span<const int32_t> ids, bool skip_special_tokens) const override {
    std::string bytes;
    for (int32_t id : ids) {
      // Ids outside the vocabulary stand for nothing; callers validate ids they take as input.
      if (id < 0 || id >= vocab_size()) continue;
      if (skip_special_tokens && special_[id]) continue;
      bytes += id_to_bytes_[id];
    }
    return ReplaceInvalidUtf8(bytes);
  }

  std::string TokenBytes(int32_t id) const override {
    return id >= 0 && id < vocab_size() ? id_to_bytes_[id] : std::string();
  }

  std::optional<int32_t> TokenToId(std::string_view token) const override {
    if (auto it = added_ids_.find(ToAbsl(token)); it != added_ids_.end()) return it->second;
    if (auto it = vocab_.find(ToAbsl(token)); it != vocab_.end()) return it->second;
    return std::nullopt;
  }

  bool IsSpecial(int32_t id) const override { return id >= 0 && id < vocab_size() && special_[id]; }

  int vocab_size() const override { return static_cast<int>(id_to_bytes_.size()); }

 private:
  struct Merge {
    int32_t rank;
    int32_t merged;
  };

  ByteLevelBpeTokenizer() = default;

  static uint64_t PairKey(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) |
           static_cast<uint32_t>(right);
  }

  void GrowTo(int32_t id) {
    if (id >= static_cast<int32_t>(id_to_bytes_.size())) {
      id_to_bytes_.resize(id + 1);
      special_.resize(id + 1, false);
    }
  }

  absl::Status LoadModel(const Json& root, BulkModel& bulk) {
    auto it = root.find("model");
    if (it == root.end() || !it->is_object()) {
      return Invalid("model", "missing (a BPE model with vocab and merges is required)");
    }
    const Json& model = *it;
    std::string type = TypeOf(model);
    if (!type.empty() && type != "BPE") {
      return Invalid("model", absl::StrCat("unsupported type '", type, "' (only BPE)"));
    }
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
      auto f = model.find(key);
      if (f != model.end() && !f->is_null() && !(f->is_string() && f->get<std::string>().empty())) {
        return Invalid("model", absl::StrCat("'", key, "' is not supported"));
      }
    }
    if (auto f = model.find("dropout");
        f != model.end() && !f->is_null() && !(f->is_number() && f->get<double>() == 0.0)) {
      return Invalid("model", "'dropout' is not supported");
    }
    TANDEM_ASSIGN_OR_RETURN(bool byte_fallback, BoolField(model, "byte_fallback", false, "model"));
    if (byte_fallback) return Invalid("model", "'byte_fallback' is not supported");
    TANDEM_ASSIGN_OR_RETURN(ignore_merges_, BoolField(model, "ignore_merges", false, "model"));
    if (!bulk.has_vocab) return Invalid("model", "'vocab' must be an object of token -> id");
    if (!bulk.has_merges) return Invalid("model", "'merges' must be an array");

    int32_t max_id = -1;
    for (const auto& entry : bulk.vocab) max_id = std::max(max_id, entry.second);
    GrowTo(max_id);
    std::vector<bool> seen(max_id + 1, false);
    vocab_.reserve(bulk.vocab.size());
    for (auto& [token, id] : bulk.vocab) {
      if (seen[id]) {
        return Invalid("model.vocab",
                       absl::StrCat("id ", id, " is used twice (again by '", token, "')"));
      }
      seen[id] = true;
      std::optional<std::string> bytes = FromByteLevel(token);
      id_to_bytes_[id] = bytes ? std::move(*bytes) : token;
      vocab_.emplace(std::move(token), id);
    }
    const ByteLevelAlphabet& alphabet = Alphabet();
    for (int b = 0; b < 256; ++b) {
      auto f = vocab_.find(alphabet.byte_to_char[b]);
      byte_ids_[b] = f == vocab_.end() ? -1 : f->second;
    }
    if (auto unk = model.find("unk_token"); unk != model.end() && unk->is_string()) {
      if (auto f = vocab_.find(unk->get<std::string>()); f != vocab_.end()) unk_id_ = f->second;
    }

    merges_.reserve(bulk.merges.size());
    for (size_t rank = 0; rank < bulk.merges.size(); ++rank) {
      absl::string_view merged = bulk.merges[rank].first;
      const size_t split = bulk.merges[rank].second;
      absl::string_view names[3] = {merged.substr(0, split), merged.substr(split), merged};
      int32_t ids[3];
      for (int k = 0; k < 3; ++k) {
        auto f = vocab_.find(names[k]);
        if (f == vocab_.end()) {
          return Invalid(absl::StrCat("model.merges[", rank, "]"),
                         absl::StrCat("'", names[k], "' is not in the vocabulary"));
        }
        ids[k] = f->second;
      }
      // A pair listed twice keeps its first (best) rank.
      merges_.try_emplace(PairKey(ids[0], ids[1]), Merge{static_cast<int32_t>(rank), ids[2]});
    }
    return absl::OkStatus();
  }

  absl::Status ParseNormalizer(const Json& n, const std::string& where) {
    if (n.is_null()) return absl::OkStatus();
    std::string type = TypeOf(n);
    if (type == "NFC") {
      normal_forms_.push_back(NormalForm::kNfc);
    } else if (type == "NFD") {
      normal_forms_.push_back(NormalForm::kNfd);
    } else if (type == "NFKC") {
      normal_forms_.push_back(NormalForm::kNfkc);
    } else if (type == "NFKD") {
      normal_forms_.push_back(NormalForm::kNfkd);
    } else if (type == "Sequence") {
      auto list = n.find("normalizers");
      if (list == n.end() || !list->is_array()) {
        return Invalid(where, "Sequence needs a 'normalizers' array");
      }
      for (size_t i = 0; i < list->size(); ++i) {
        TANDEM_RETURN_IF_ERROR(
            ParseNormalizer((*list)[i], absl::StrCat(where, ".normalizers[", i, "]")));
      }
    } else {
      return Invalid(where, absl::StrCat("unsupported type '", type.empty() ? n.dump() : type,
                                         "' (supported: NFC, NFD, NFKC, NFKD, Sequence)"));
    }
    return absl::OkStatus();
  }

  absl::Status LoadNormalizer(const Json& root) {
    auto it = root.find("normalizer");
    return it == root.end() ? absl::OkStatus() : ParseNormalizer(*it, "normalizer");
  }

  std::string ApplyNormalizer(std::string_view text) const {
    std::string out(text);
    for (NormalForm form : normal_forms_) out = Normalize(out, form);
    return out;
  }

  absl::Status LoadAddedTokens(const Json& root) {
    auto it = root.find("added_tokens");
    if (it == root.end() || it->is_null()) return absl::OkStatus();
    if (!it->is_array()) return Invalid("added_tokens", "must be an array");
    for (size_t i = 0; i < it->size(); ++i) {
      const Json& a = (*it)[i];
      std::string where = absl::StrCat("added_tokens[", i, "]");
      if (!a.is_object()) return Invalid(where, "must be an object");
      AddedToken token;
      auto id = a.find("id");
      if (id == a.end()) return Invalid(where, "'id' is missing");
      TANDEM_ASSIGN_OR_RETURN(token.id, IdValue(*id, where));
      TANDEM_ASSIGN_OR_RETURN(token.content, StringField(a, "content", where));
      if (token.content.empty() || !IsValidUtf8(token.content)) {
        return Invalid(where, "'content' must be non-empty UTF-8");
      }
      TANDEM_ASSIGN_OR_RETURN(token.special, BoolField(a, "special", false, where));
      TANDEM_ASSIGN_OR_RETURN(token.lstrip, BoolField(a, "lstrip", false, where));
      TANDEM_ASSIGN_OR_RETURN(token.rstrip, BoolField(a, "rstrip", false, where));
      TANDEM_ASSIGN_OR_RETURN(token.single_word, BoolField(a, "single_word", false, where));
      TANDEM_ASSIGN_OR_RETURN(token.normalized, BoolField(a, "normalized", !token.special, where));
      if (!added_ids_.emplace(token.content, token.id).second) {
        return Invalid(where, absl::StrCat("'", token.content, "' is listed twice"));
      }
      GrowTo(token.id);
      id_to_bytes_[token.id] = token.content;
      special_[token.id] = token.special;
      int index = static_cast<int>(added_.size());
      if (token.normalized) {
        // Matched against normalized text, so compare with the normalized spelling.
        normalized_matcher_.Add(ApplyNormalizer(token.content), index);
      } else {
        raw_matcher_.Add(token.content, index);
      }
      added_.push_back(std::move(token));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<Regex>> ParsePattern(const Json& step, const std::string& where) {
    auto pattern = step.find("pattern");
    if (pattern != step.end() && pattern->is_object()) {
      if (auto r = pattern->find("Regex"); r != pattern->end() && r->is_string()) {
        return Regex::Compile(r->get<std::string>(), /*literal=*/false, where);
      }
      if (auto s = pattern->find("String"); s != pattern->end() && s->is_string()) {
        return Regex::Compile(s->get<std::string>(), /*literal=*/true, where);
      }
    }
    return Invalid(where, "'pattern' must be {\"Regex\": ...} or {\"String\": ...}");
  }

  absl::Status ParsePreTokenizer(const Json& p, const std::string& where) {
    std::string type = TypeOf(p);
    if (type == "Sequence") {
      auto list = p.find("pretokenizers");
      if (list == p.end() || !list->is_array()) {
        return Invalid(where, "Sequence needs a 'pretokenizers' array");
      }
      for (size_t i = 0; i < list->size(); ++i) {
        TANDEM_RETURN_IF_ERROR(
            ParsePreTokenizer((*list)[i], absl::StrCat(where, ".pretokenizers[", i, "]")));
      }
      return absl::OkStatus();
    }
    if (has_byte_level_) {
      return Invalid(where, "ByteLevel must be the last pre-tokenizer step");
    }
    if (type == "Split") {
      TANDEM_ASSIGN_OR_RETURN(bool invert, BoolField(p, "invert", false, where));
      if (invert) return Invalid(where, "Split with invert=true is not supported");
      auto behavior = p.find("behavior");
      std::string b =
          behavior != p.end() && behavior->is_string() ? behavior->get<std::string>() : "";
      if (b != "Isolated" && b != "Removed") {
        return Invalid(where, absl::StrCat("Split behavior '", b,
                                           "' is not supported (supported: Isolated, Removed)"));
      }
      TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<Regex> regex, ParsePattern(p, where));
      steps_.push_back(std::make_unique<SplitStep>(std::move(regex), b == "Isolated"));
      return absl::OkStatus();
    }
    if (type == "ByteLevel") {
      TANDEM_ASSIGN_OR_RETURN(bool prefix, BoolField(p, "add_prefix_space", true, where));
      TANDEM_ASSIGN_OR_RETURN(bool use_regex, BoolField(p, "use_regex", true, where));
      std::unique_ptr<Regex> regex;
      if (use_regex) {
        TANDEM_ASSIGN_OR_RETURN(regex, Regex::Compile(kGpt2Pattern, false, where));
      }
      steps_.push_back(std::make_unique<ByteLevelStep>(prefix, std::move(regex)));
      has_byte_level_ = true;
      return absl::OkStatus();
    }
    return Invalid(where, absl::StrCat("unsupported type '", type.empty() ? p.dump() : type,
                                       "' (supported: Split, ByteLevel, Sequence)"));
  }

  absl::Status LoadPreTokenizer(const Json& root) {
    auto it = root.find("pre_tokenizer");
    if (it != root.end() && !it->is_null()) {
      TANDEM_RETURN_IF_ERROR(ParsePreTokenizer(*it, "pre_tokenizer"));
    }
    if (!has_byte_level_) {
      return Invalid("pre_tokenizer",
                     "a ByteLevel step is required (only byte-level BPE is supported)");
    }
    return absl::OkStatus();
  }

  absl::Status LoadDecoder(const Json& root) {
    auto it = root.find("decoder");
    std::string type = it == root.end() ? "" : TypeOf(*it);
    if (type != "ByteLevel") {
      return Invalid("decoder",
                     absl::StrCat("unsupported type '",
                                  type.empty() ? (it == root.end() ? "none" : it->dump()) : type,
                                  "' (only ByteLevel)"));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::vector<int32_t>> SpecialTokenIds(const Json& processor,
                                                       const std::string& name,
                                                       const std::string& where) {
    std::vector<int32_t> ids;
    auto specials = processor.find("special_tokens");
    if (specials != processor.end() && specials->is_object()) {
      auto entry = specials->find(name);
      if (entry != specials->end() && entry->is_object()) {
        auto list = entry->find("ids");
        if (list == entry->end() || !list->is_array()) {
          return Invalid(where, absl::StrCat("special_tokens['", name, "'] has no 'ids' array"));
        }
        for (const Json& id : *list) {
          TANDEM_ASSIGN_OR_RETURN(int32_t value, IdValue(id, where));
          if (value >= vocab_size()) {
            return Invalid(where, absl::StrCat("special token id ", value, " is out of range"));
          }
          ids.push_back(value);
        }
        return ids;
      }
    }
    if (std::optional<int32_t> id = TokenToId(name)) return std::vector<int32_t>{*id};
    return Invalid(where, absl::StrCat("special token '", name, "' is not in the vocabulary"));
  }

  absl::Status LoadPostProcessor(const Json& p, const std::string& where) {
    if (p.is_null()) return absl::OkStatus();
    std::string type = TypeOf(p);
    if (type == "ByteLevel") return absl::OkStatus();  // only adjusts offsets, never ids
    if (type == "Sequence") {
      auto list = p.find("processors");
      if (list == p.end() || !list->is_array()) {
        return Invalid(where, "Sequence needs a 'processors' array");
      }
      for (size_t i = 0; i < list->size(); ++i) {
        TANDEM_RETURN_IF_ERROR(
            LoadPostProcessor((*list)[i], absl::StrCat(where, ".processors[", i, "]")));
      }
      return absl::OkStatus();
    }
    if (type == "TemplateProcessing") {
      auto single = p.find("single");
      if (single == p.end() || !single->is_array()) {
        return Invalid(where, "TemplateProcessing needs a 'single' array");
      }
      Template t;
      for (const Json& item : *single) {
        if (auto s = item.find("SpecialToken"); item.is_object() && s != item.end()) {
          TANDEM_ASSIGN_OR_RETURN(std::string name, StringField(*s, "id", where));
          TANDEM_ASSIGN_OR_RETURN(std::vector<int32_t> ids, SpecialTokenIds(p, name, where));
          t.items.push_back({false, std::move(ids)});
        } else if (auto q = item.find("Sequence"); item.is_object() && q != item.end()) {
          TANDEM_ASSIGN_OR_RETURN(std::string seq, StringField(*q, "id", where));
          if (seq != "A") {
            return Invalid(where, absl::StrCat("single template refers to sequence '", seq, "'"));
          }
          t.items.push_back({true, {}});
        } else {
          return Invalid(where, absl::StrCat("unsupported template item ", item.dump()));
        }
      }
      templates_.push_back(std::move(t));
      return absl::OkStatus();
    }
    return Invalid(where, absl::StrCat("unsupported type '", type.empty() ? p.dump() : type,
                                       "' (supported: TemplateProcessing, ByteLevel, Sequence)"));
  }

  // Runs stages 1-4 on valid UTF-8, calling on_token(id) for added tokens and on_piece(bytes)
  // for each pre-tokenized piece, in text order.
  template <typename OnToken, typename OnPiece>
  void Walk(std::string_view text, OnToken on_token, OnPiece on_piece) const {
    std::vector<Segment> raw;
    raw_matcher_.Split(text, added_, &raw);
    std::vector<Segment> normalized;
    std::vector<std::string> pieces, next;
    for (const Segment& segment : raw) {
      if (segment.token >= 0) {
        on_token(added_[segment.token].id);
        continue;
      }
      std::string norm = ApplyNormalizer(segment.text);
      normalized.clear();
      normalized_matcher_.Split(norm, added_, &normalized);
      for (const Segment& sub : normalized) {
        if (sub.token >= 0) {
          on_token(added_[sub.token].id);
          continue;
        }
        pieces.assign(1, std::string(sub.text));
        for (const auto& step : steps_) {
          next.clear();
          for (const std::string& piece : pieces) step->Apply(piece, &next);
          pieces.swap(next);
        }
        for (const std::string& piece : pieces) on_piece(piece);
      }
    }
  }

  void EncodePiece(std::string_view bytes, std::vector<int32_t>* out) const {
    if (bytes.empty()) return;
    if (ignore_merges_) {
      if (auto it = vocab_.find(ToByteLevel(bytes)); it != vocab_.end()) {
        out->push_back(it->second);
        return;
      }
    }
    const bool cacheable = bytes.size() <= kMaxCachedPieceBytes;
    if (cacheable) {
      std::shared_lock lock(cache_mu_);
      if (auto it = cache_.find(ToAbsl(bytes)); it != cache_.end()) {
        out->insert(out->end(), it->second.begin(), it->second.end());
        return;
      }
    }
    size_t first = out->size();
    MergeBytes(bytes, out);
    if (cacheable) {
      std::unique_lock lock(cache_mu_);
      if (cache_.size() >= kPieceCacheCapacity) cache_.clear();
      cache_.try_emplace(std::string(bytes), out->begin() + first, out->end());
    }
  }

  // BPE: repeatedly merges the adjacent pair with the lowest rank, leftmost first on ties.
  // Symbols form a linked list over the byte positions and candidate pairs sit in a min-heap,
  // so a piece of n bytes costs O(n log n).
  void MergeBytes(std::string_view bytes, std::vector<int32_t>* out) const {
    struct Symbol {
      int32_t id;  // -1 once merged into its left neighbour
      int32_t prev;
      int32_t next;
    };
    struct Candidate {
      int32_t rank;
      int32_t pos;  // index of the left symbol
      int32_t left;
      int32_t right;
      int32_t merged;
    };
    auto later = [](const Candidate& a, const Candidate& b) {
      return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
    };
    std::vector<Symbol> symbols;
    symbols.reserve(bytes.size());
    for (unsigned char b : bytes) {
      int32_t id = byte_ids_[b] >= 0 ? byte_ids_[b] : unk_id_.value_or(-1);
      if (id < 0) continue;  // a byte the vocabulary cannot express is dropped, as upstream
      int32_t index = static_cast<int32_t>(symbols.size());
      symbols.push_back({id, index - 1, index + 1});
    }
    if (symbols.empty()) return;
    symbols.back().next = -1;

    std::vector<Candidate> heap;
    auto consider = [&](int32_t pos) {
      const Symbol& left = symbols[pos];
      if (left.next < 0) return;
      int32_t right = symbols[left.next].id;
      auto it = merges_.find(PairKey(left.id, right));
      if (it == merges_.end()) return;
      heap.push_back({it->second.rank, pos, left.id, right, it->second.merged});
      std::push_heap(heap.begin(), heap.end(), later);
    };
    for (int32_t i = 0; i + 1 < static_cast<int32_t>(symbols.size()); ++i) consider(i);
    while (!heap.empty()) {
      std::pop_heap(heap.begin(), heap.end(), later);
      Candidate c = heap.back();
      heap.pop_back();
      Symbol& left = symbols[c.pos];
      // Skip candidates that an earlier merge made stale.
      if (left.id != c.left || left.next < 0 || symbols[left.next].id != c.right) continue;
      Symbol& right = symbols[left.next];
      left.id = c.merged;
      right.id = -1;
      left.next = right.next;
      if (left.next >= 0) symbols[left.next].prev = c.pos;
      if (left.prev >= 0) consider(left.prev);
      consider(c.pos);
    }
    for (int32_t i = 0; i >= 0; i = symbols[i].next) out->push_back(symbols[i].id);
  }

  // Model.
  absl::flat_hash_map<std::string, int32_t> vocab_;  // ByteLevel-alphabet token -> id
  absl::flat_hash_map<uint64_t, Merge> merges_;      // (left id, right id) -> merge
  std::array<int32_t, 256> byte_ids_{};              // id of each single byte, -1 if none
  std::optional<int32_t> unk_id_;
  bool ignore_merges_ = false;
  // Per id: the bytes it decodes to, and whether it is a special added token.
  std::vector<std::string> id_to_bytes_;
  std::vector<bool> special_;
  // Added tokens.
  std::vector<AddedToken> added_;
  absl::flat_hash_map<std::string, int32_t> added_ids_;  // content -> id
  AddedTokenMatcher raw_matcher_;
  AddedTokenMatcher normalized_matcher_;
  // Normalizer, pre-tokenizer, post-processor.
  std::vector<NormalForm> normal_forms_;
  std::vector<std::unique_ptr<PreTokenizerStep>> steps_;
  bool has_byte_level_ = false;
  std::vector<Template> templates_;
  // Piece -> ids for short pieces; Encode is const and may run on several threads.
  mutable std::shared_mutex cache_mu_;
  mutable absl::flat_hash_map<std::string, std::vector<int32_t>> cache_;
};

}  // namespace

std::string ReplaceInvalidUtf8(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  for (size_t i = 0; i < bytes.size();) {
    Utf8Step step = ReadUtf8(bytes, i);
    if (step.valid) {
      out.append(bytes.substr(i, step.length));
    } else {
      out += "\xEF\xBF\xBD";
    }
    i += step.length;
  }
  return out;
}

namespace {

// Errors say which file they concern first: `source` is a path or "tokenizer.json".
absl::StatusOr<std::unique_ptr<Tokenizer>> Parse(std::string_view json, const std::string& source) {
  // nlohmann reports malformed JSON and type mismatches by throwing; nothing escapes this call.
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer;
  try {
    BulkModel bulk;
    TokenizerJsonReader reader(&bulk);
    if (Json::sax_parse(json.begin(), json.end(), &reader)) {
      tokenizer = ByteLevelBpeTokenizer::Load(reader.root(), bulk);
    } else {
      tokenizer = reader.error().ok() ? absl::InvalidArgumentError("invalid JSON") : reader.error();
    }
  } catch (const Json::exception& e) {
    tokenizer = absl::InvalidArgumentError(e.what());
  }
  if (!tokenizer.ok()) {
    return absl::Status(tokenizer.status().code(),
                        absl::StrCat(source, ": ", tokenizer.status().message()));
  }
  return tokenizer;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromJson(std::string_view json) {
  return Parse(json, "tokenizer.json");
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat("cannot open tokenizer file '", path, "': ", std::strerror(errno)));
  }
  std::string contents;
  in.seekg(0, std::ios::end);
  contents.resize(static_cast<size_t>(std::max<std::streamoff>(0, in.tellg())));
  in.seekg(0, std::ios::beg);
  if (!in.read(contents.data(), static_cast<std::streamsize>(contents.size()))) {
    return absl::DataLossError(absl::StrCat("cannot read tokenizer file '", path, "'"));
  }
  return Parse(contents, path);
}

}  // namespace tandem::text

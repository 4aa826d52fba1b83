// Byte-level BPE training (see bpe_trainer.h).
//
// Words come from the same pre-tokenizer the trained tokenizer will use (loaded through
// text::Tokenizer), so merges never cross a boundary that encoding would not cross either.
// Each step merges the most frequent adjacent pair over all words, weighted by word count.
// Pair counts live in a hash map; a max-heap holds (count, pair) entries that are checked
// against the map when popped, and only words that contain the merged pair are rewritten.
#include "tandem/tools/bpe_trainer.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <queue>
#include <tuple>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "tandem/base/status_macros.h"
#include "tandem/text/tokenizer.h"

namespace tandem::tools {
namespace {

using OrderedJson = nlohmann::ordered_json;

constexpr char kLlama3SplitPattern[] =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// The ByteLevel alphabet: the character each byte is written as in vocab and merges. Printable
// Latin-1 bytes stand for themselves, the rest for U+0100 upwards in byte order.
const std::array<std::string, 256>& ByteChars() {
  static const std::array<std::string, 256>* const chars = [] {
    auto* table = new std::array<std::string, 256>;
    int next_extra = 256;
    for (int b = 0; b < 256; ++b) {
      bool printable =
          (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      int cp = printable ? b : next_extra++;
      // Every code point here is below U+0800: one or two UTF-8 bytes.
      if (cp < 0x80) {
        (*table)[b] = std::string(1, static_cast<char>(cp));
      } else {
        (*table)[b] = {static_cast<char>(0xC0 | (cp >> 6)), static_cast<char>(0x80 | (cp & 0x3F))};
      }
    }
    return table;
  }();
  return *chars;
}

std::string ToByteLevel(const std::string& bytes) {
  std::string out;
  for (unsigned char b : bytes) out += ByteChars()[b];
  return out;
}

uint64_t PairKey(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}
int32_t LeftOf(uint64_t key) { return static_cast<int32_t>(key >> 32); }
int32_t RightOf(uint64_t key) { return static_cast<int32_t>(key & 0xFFFFFFFFu); }

OrderedJson PreTokenizerJson() {
  return {{"type", "Sequence"},
          {"pretokenizers",
           {{{"type", "Split"},
             {"pattern", {{"Regex", kLlama3SplitPattern}}},
             {"behavior", "Isolated"},
             {"invert", false}},
            {{"type", "ByteLevel"},
             {"add_prefix_space", false},
             {"trim_offsets", true},
             {"use_regex", false}}}}};
}

// tokens[id] are the bytes of each BPE id; merges are (left id, right id) in rank order.
std::string TokenizerJson(const std::vector<std::string>& tokens,
                          const std::vector<std::pair<int32_t, int32_t>>& merges,
                          const std::vector<std::string>& special_tokens) {
  OrderedJson added = OrderedJson::array();
  for (size_t i = 0; i < special_tokens.size(); ++i) {
    added.push_back({{"id", static_cast<int64_t>(tokens.size() + i)},
                     {"content", special_tokens[i]},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  }
  OrderedJson post = {{"type", "ByteLevel"},
                      {"add_prefix_space", true},
                      {"trim_offsets", false},
                      {"use_regex", true}};
  if (!special_tokens.empty()) {
    const std::string& bos = special_tokens[0];
    auto special = [&](int type_id) {
      return OrderedJson{{"SpecialToken", {{"id", bos}, {"type_id", type_id}}}};
    };
    auto sequence = [](const char* id, int type_id) {
      return OrderedJson{{"Sequence", {{"id", id}, {"type_id", type_id}}}};
    };
    OrderedJson templ = {
        {"type", "TemplateProcessing"},
        {"single", {special(0), sequence("A", 0)}},
        {"pair", {special(0), sequence("A", 0), special(1), sequence("B", 1)}},
        {"special_tokens",
         {{bos,
           {{"id", bos}, {"ids", {static_cast<int64_t>(tokens.size())}}, {"tokens", {bos}}}}}}};
    post = {{"type", "Sequence"}, {"processors", {post, templ}}};
  }
  OrderedJson vocab = OrderedJson::object();
  for (size_t id = 0; id < tokens.size(); ++id) {
    vocab[ToByteLevel(tokens[id])] = static_cast<int64_t>(id);
  }
  OrderedJson merge_list = OrderedJson::array();
  for (auto [left, right] : merges) {
    merge_list.push_back(absl::StrCat(ToByteLevel(tokens[left]), " ", ToByteLevel(tokens[right])));
  }
  OrderedJson root = {{"version", "1.0"},
                      {"truncation", nullptr},
                      {"padding", nullptr},
                      {"added_tokens", added},
                      {"normalizer", nullptr},
                      {"pre_tokenizer", PreTokenizerJson()},
                      {"post_processor", post},
                      {"decoder",
                       {{"type", "ByteLevel"},
                        {"add_prefix_space", true},
                        {"trim_offsets", true},
                        {"use_regex", true}}},
                      {"model",
                       {{"type", "BPE"},
                        {"dropout", nullptr},
                        {"unk_token", nullptr},
                        {"continuing_subword_prefix", nullptr},
                        {"end_of_word_suffix", nullptr},
                        {"fuse_unk", false},
                        {"byte_fallback", false},
                        {"ignore_merges", false},
                        {"vocab", vocab},
                        {"merges", merge_list}}}};
  return root.dump(1);
}

// The merge loop over a corpus's words.
class MergeLearner {
 public:
  MergeLearner(const std::vector<std::pair<std::string, int64_t>>& words) {
    for (int b = 0; b < 256; ++b) {
      std::string token(1, static_cast<char>(b));
      token_ids_.emplace(token, b);
      tokens_.push_back(std::move(token));
    }
    for (const auto& [bytes, count] : words) {
      Word word;
      word.count = count;
      for (unsigned char b : bytes) word.symbols.push_back(b);
      words_.push_back(std::move(word));
    }
    for (int32_t w = 0; w < static_cast<int32_t>(words_.size()); ++w) AddPairs(w);
    for (const auto& [pair, count] : pair_counts_) heap_.push({count, pair});
  }

  // Learns merges until there are `target` tokens or no pair occurs any more.
  void Learn(int target) {
    while (static_cast<int>(tokens_.size()) < target && !heap_.empty()) {
      Entry top = heap_.top();
      heap_.pop();
      auto it = pair_counts_.find(top.pair);
      int64_t current = it == pair_counts_.end() ? 0 : it->second;
      if (current != top.count) {  // stale: the count changed since this entry was pushed
        if (current > 0) heap_.push({current, top.pair});
        continue;
      }
      Merge(top.pair);
    }
  }

  // Adds merges of each token with itself, in id order, until there are `target` tokens.
  void Fill(int target) {
    for (int32_t id = 0; static_cast<int>(tokens_.size()) < target; ++id) {
      if (!token_ids_.contains(tokens_[id] + tokens_[id])) AddMerge(id, id);
    }
  }

  const std::vector<std::string>& tokens() const { return tokens_; }
  const std::vector<std::pair<int32_t, int32_t>>& merges() const { return merges_; }

 private:
  struct Word {
    std::vector<int32_t> symbols;
    int64_t count = 0;
  };
  struct Entry {
    int64_t count;
    uint64_t pair;
    // Highest count first; on ties the smaller (left, right) pair, which is the smaller key.
    bool operator<(const Entry& other) const {
      return count != other.count ? count < other.count : pair > other.pair;
    }
  };

  int32_t AddMerge(int32_t left, int32_t right) {
    merges_.emplace_back(left, right);
    std::string merged = tokens_[left] + tokens_[right];
    // Two different pairs can spell the same bytes ("ab"+"c", "a"+"bc"): one id serves both.
    auto [it, inserted] = token_ids_.try_emplace(merged, static_cast<int32_t>(tokens_.size()));
    if (inserted) tokens_.push_back(std::move(merged));
    return it->second;
  }

  void AddPairs(int32_t w) {
    const Word& word = words_[w];
    for (size_t i = 0; i + 1 < word.symbols.size(); ++i) {
      uint64_t pair = PairKey(word.symbols[i], word.symbols[i + 1]);
      pair_counts_[pair] += word.count;
      pair_words_[pair].push_back(w);
    }
  }

  void RemovePairs(int32_t w) {
    const Word& word = words_[w];
    for (size_t i = 0; i + 1 < word.symbols.size(); ++i) {
      pair_counts_[PairKey(word.symbols[i], word.symbols[i + 1])] -= word.count;
    }
  }

  void Merge(uint64_t pair) {
    const int32_t left = LeftOf(pair), right = RightOf(pair);
    const int32_t merged = AddMerge(left, right);
    std::vector<int32_t> where = std::move(pair_words_[pair]);
    pair_words_.erase(pair);
    std::sort(where.begin(), where.end());
    where.erase(std::unique(where.begin(), where.end()), where.end());
    absl::flat_hash_set<uint64_t> touched;
    for (int32_t w : where) {
      Word& word = words_[w];
      std::vector<int32_t>& s = word.symbols;
      bool found = false;
      for (size_t i = 0; i + 1 < s.size(); ++i) found |= s[i] == left && s[i + 1] == right;
      if (!found) continue;  // listed for an occurrence an earlier merge consumed
      RemovePairs(w);
      std::vector<int32_t> rewritten;
      rewritten.reserve(s.size());
      for (size_t i = 0; i < s.size(); ++i) {
        if (i + 1 < s.size() && s[i] == left && s[i + 1] == right) {
          rewritten.push_back(merged);
          ++i;
        } else {
          rewritten.push_back(s[i]);
        }
      }
      s = std::move(rewritten);
      AddPairs(w);
      for (size_t i = 0; i + 1 < s.size(); ++i) touched.insert(PairKey(s[i], s[i + 1]));
    }
    pair_counts_.erase(pair);
    // Pairs formed or grown by this merge need entries with their new counts; shrunk ones are
    // corrected when their stale entries come up.
    std::vector<uint64_t> order(touched.begin(), touched.end());
    std::sort(order.begin(), order.end());
    for (uint64_t p : order) {
      if (auto it = pair_counts_.find(p); it != pair_counts_.end() && it->second > 0) {
        heap_.push({it->second, p});
      }
    }
  }

  std::vector<std::string> tokens_;                      // id -> bytes
  absl::flat_hash_map<std::string, int32_t> token_ids_;  // bytes -> id
  std::vector<std::pair<int32_t, int32_t>> merges_;
  std::vector<Word> words_;
  absl::flat_hash_map<uint64_t, int64_t> pair_counts_;
  absl::flat_hash_map<uint64_t, std::vector<int32_t>> pair_words_;  // may list a word twice
  std::priority_queue<Entry> heap_;
};

}  // namespace

absl::StatusOr<std::string> TrainByteLevelBpe(std::string_view corpus, int vocab_size,
                                              const std::vector<std::string>& special_tokens) {
  const int bpe_size = vocab_size - static_cast<int>(special_tokens.size());
  if (bpe_size < 256) {
    return absl::InvalidArgumentError(absl::StrCat(
        "vocab_size ", vocab_size, " is too small: 256 byte tokens and ", special_tokens.size(),
        " special tokens need at least ", 256 + special_tokens.size()));
  }
  absl::flat_hash_set<std::string> seen;
  for (const std::string& s : special_tokens) {
    if (s.empty() || text::ReplaceInvalidUtf8(s) != s) {
      return absl::InvalidArgumentError("special tokens must be non-empty UTF-8");
    }
    if (!seen.insert(s).second) {
      return absl::InvalidArgumentError(absl::StrCat("special token '", s, "' is listed twice"));
    }
  }

  // Words as the trained tokenizer will see them: special tokens cut out, then pre-tokenized.
  std::vector<std::string> bytes(256);
  for (int b = 0; b < 256; ++b) bytes[b] = std::string(1, static_cast<char>(b));
  TANDEM_ASSIGN_OR_RETURN(auto splitter,
                          text::Tokenizer::FromJson(TokenizerJson(bytes, {}, special_tokens)));
  absl::flat_hash_map<std::string, int64_t> counts;
  for (std::string& piece : splitter->PreTokenize(corpus)) ++counts[std::move(piece)];
  // Sorted so that the result does not depend on hash iteration order.
  std::vector<std::pair<std::string, int64_t>> words(counts.begin(), counts.end());
  std::sort(words.begin(), words.end());

  MergeLearner learner(words);
  learner.Learn(bpe_size);
  learner.Fill(bpe_size);
  std::string json = TokenizerJson(learner.tokens(), learner.merges(), special_tokens);

  // What we hand out must load; a failure here is a bug in this file, reported rather than hidden.
  auto check = text::Tokenizer::FromJson(json);
  if (!check.ok()) {
    return absl::InternalError(
        absl::StrCat("trained tokenizer does not load: ", check.status().message()));
  }
  if ((*check)->vocab_size() != vocab_size) {
    return absl::InternalError(absl::StrCat("trained tokenizer has ", (*check)->vocab_size(),
                                            " ids instead of ", vocab_size));
  }
  return json;
}

std::string_view BuiltinTrainingText() {
  static constexpr std::string_view kText = R"TEXT(
The lighthouse keeper wrote in her log every evening at half past six. "Wind from the west,
twelve knots. Two fishing boats returned before dark; the third, the Marigold, came in at 7:45
with a torn sail." She had kept the log for 23 years, and the early pages were already yellow.
Visitors often asked why she didn't use a computer. She'd smile and say that paper doesn't crash,
and that a pencil never needs charging. It's a fair point, though we'll admit it's not the whole
story: she simply liked the sound of the nib on the page.

On Tuesday the supply boat brought flour, 40 litres of diesel, three new batteries and a letter
from her brother in Montreal. He wrote about the weather (cold), the hockey (disappointing) and
his plan to visit in June. "I've booked the ferry for the 14th," he said. "If the crossing is
rough, I'll be the green one at the rail."

Recipe for oat bread: mix 500 g of flour, 150 g of rolled oats, 10 g of salt and 7 g of yeast.
Add 350 ml of warm water and 2 tablespoons of honey. Knead for ten minutes, rest for one hour,
shape, rest again for 45 minutes, then bake at 220 degrees for 35 to 40 minutes. The loaf is
done when it sounds hollow underneath. Don't slice it until it has cooled; you'll thank yourself.

Questions people ask about tides: Why are there two high tides a day? Because the Earth turns
under two bulges of water, one facing the Moon and one on the far side. How much does the level
change? In this bay, about 3.2 metres at spring tide and 1.4 metres at neap tide. When is the
next low water? Tomorrow at 04:17, then again at 16:42.

def moving_average(values, window):
    """Returns the mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    total = sum(values[:window])
    result = [total / window]
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        result.append(total / window)
    return result

int CountWords(const std::string& text) {
  int words = 0;
  bool in_word = false;
  for (char c : text) {
    bool space = c == ' ' || c == '\n' || c == '\t';
    if (!space && !in_word) ++words;
    in_word = !space;
  }
  return words;
}

function formatPrice(cents) {
  const euros = Math.floor(cents / 100);
  const rest = String(cents % 100).padStart(2, "0");
  return `${euros}.${rest} EUR`;
}

SELECT name, COUNT(*) AS visits FROM visitors WHERE year = 2024 GROUP BY name ORDER BY visits DESC;

{"id": 1042, "name": "Marigold", "length_m": 11.5, "crew": ["Ana", "Ben", "Chloe"], "active": true}

Inventory, end of March: 12 lamps, 4 spare lenses, 250 metres of rope, 18 tins of paint,
1 radio (working), 1 radio (not working), 96 candles, 3 kettles. Total weight: 1,284.5 kg.
Phone numbers: +44 20 7946 0958, 555-0134, (212) 555-0187. Dates: 2023-11-05, 12/31/1999,
1 January 2000. Version 3.14.159 was released on 2021-06-30 at 09:00 UTC.

The first rule of the workshop is to put every tool back where you found it. The second rule is
that nobody touches the lathe without asking. The third rule, added after an incident that we
don't talk about, is that coffee stays on the shelf by the door. These rules aren't strict
because we're unfriendly; they're strict because the workshop is small and the tools are sharp.

She counted the stars from the gallery: one, two, three, four, five, six, seven, eight, nine,
ten. Then she gave up, because there were thousands, and because the kettle was whistling.
Numbers like 1000000 and 299792458 and 3.14159265358979 look impressive, but the ones that
matter on the island are smaller: 2 boats, 1 road, 0 traffic lights.

Q: What's the difference between weather and climate?
A: Weather is what you get today; climate is what you expect over thirty years.
Q: Isn't that the same thing, measured longer?
A: Not quite. You can't predict next Tuesday's rain from the climate, but you can predict that
   July will be warmer than January.

Error: connection refused (code 111) while contacting 10.0.0.12:8080 after 3 retries.
Warning: disk usage at 91%; consider removing old logs in /var/log/keeper/.
INFO 2024-03-18 06:00:01 lamp=on rotation_s=10.0 fuel_l=38.2 battery_v=12.6
)TEXT";
  return kText;
}

}  // namespace tandem::tools

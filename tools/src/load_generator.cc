// Load generator workloads: arrival times and the requests of synthetic and ShareGPT runs.
#include "tandem/tools/load_generator.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <random>

#include "absl/strings/str_cat.h"

namespace tandem::tools {
namespace {

using json = nlohmann::json;

const char* const kWords[] = {
    "time",    "year",    "people",   "way",     "day",     "man",       "thing",    "woman",
    "life",    "child",   "world",    "school",  "state",   "family",    "student",  "group",
    "country", "problem", "hand",     "part",    "place",   "case",      "week",     "company",
    "system",  "program", "question", "work",    "night",   "point",     "home",     "water",
    "room",    "mother",  "area",     "money",   "story",   "fact",      "month",    "lot",
    "right",   "study",   "book",     "eye",     "job",     "word",      "business", "issue",
    "side",    "kind",    "head",     "house",   "service", "friend",    "father",   "power",
    "hour",    "game",    "line",     "end",     "member",  "law",       "car",      "city",
    "name",    "team",    "minute",   "idea",    "kid",     "body",      "back",     "parent",
    "face",    "level",   "office",   "door",    "health",  "person",    "art",      "war",
    "history", "party",   "result",   "change",  "morning", "reason",    "research", "girl",
    "guy",     "moment",  "air",      "teacher", "force",   "education", "blue",     "green",
    "river",   "stone",   "light",
};

}  // namespace

std::vector<double> ArrivalTimes(int64_t n, double rate, double burstiness, uint64_t seed) {
  std::vector<double> times(static_cast<size_t>(std::max<int64_t>(n, 0)), 0.0);
  if (rate <= 0 || std::isinf(rate) || burstiness <= 0) return times;
  std::mt19937_64 rng(seed);
  // Shape B, scale 1/(rate*B): mean 1/rate, coefficient of variation 1/sqrt(B).
  std::gamma_distribution<double> gap(burstiness, 1.0 / (rate * burstiness));
  double t = 0;
  for (size_t i = 1; i < times.size(); ++i) {
    t += gap(rng);
    times[i] = t;
  }
  return times;
}

std::vector<BenchRequest> SyntheticRequests(int64_t input_len, int64_t output_len, int64_t n,
                                            uint64_t seed) {
  const size_t count = static_cast<size_t>(std::max<int64_t>(n, 0));
  return SyntheticRequests(std::vector<int64_t>(count, input_len),
                           std::vector<int64_t>(count, output_len), seed);
}

std::vector<BenchRequest> SyntheticRequests(const std::vector<int64_t>& input_lens,
                                            const std::vector<int64_t>& output_lens,
                                            uint64_t seed) {
  std::mt19937_64 rng(seed);
  constexpr size_t kNumWords = sizeof(kWords) / sizeof(kWords[0]);
  std::uniform_int_distribution<size_t> pick(0, kNumWords - 1);
  std::vector<BenchRequest> out;
  const size_t n = std::min(input_lens.size(), output_lens.size());
  for (size_t i = 0; i < n; ++i) {
    BenchRequest r;
    for (int64_t w = 0; w < input_lens[i]; ++w) {
      if (w > 0) r.prompt += ' ';
      r.prompt += kWords[pick(rng)];
    }
    r.max_tokens = output_lens[i];
    out.push_back(std::move(r));
  }
  return out;
}

std::vector<BenchRequest> MultiTurnRequests(int64_t conversations, int turns,
                                            int64_t system_prompt_len, int64_t message_len,
                                            int64_t output_len, uint64_t seed) {
  std::mt19937_64 rng(seed);
  constexpr size_t kNumWords = sizeof(kWords) / sizeof(kWords[0]);
  std::uniform_int_distribution<size_t> pick(0, kNumWords - 1);
  auto words = [&](int64_t n) {
    std::string out;
    for (int64_t w = 0; w < n; ++w) {
      if (w > 0) out += ' ';
      out += kWords[pick(rng)];
    }
    return out;
  };
  const std::string system = words(system_prompt_len);
  std::vector<BenchRequest> out;
  for (int64_t c = 0; c < conversations; ++c) {
    for (int t = 0; t < turns; ++t) {
      BenchRequest r;
      r.prompt = words(message_len);
      if (t == 0 && !system.empty()) r.prompt = r.prompt.empty() ? system : system + " " + r.prompt;
      r.max_tokens = output_len;
      r.conversation = c;
      r.turn = t;
      out.push_back(std::move(r));
    }
  }
  return out;
}

absl::Status ValidateLengthDist(const LengthDist& dist, const std::string& flag) {
  if (dist.kind != "fixed" && dist.kind != "uniform" && dist.kind != "normal" &&
      dist.kind != "lognormal") {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, "-dist must be fixed, uniform, normal or lognormal (got '", dist.kind, "')"));
  }
  if (!(dist.mean >= 1)) {
    return absl::InvalidArgumentError(absl::StrCat(flag, " must be at least 1"));
  }
  if (dist.kind == "uniform" && (dist.range < 0 || dist.range >= std::llround(dist.mean))) {
    return absl::InvalidArgumentError(absl::StrCat(flag, "-range must be in [0, ", flag,
                                                   ") for a uniform distribution (got ",
                                                   dist.range, ")"));
  }
  if ((dist.kind == "normal" || dist.kind == "lognormal") && !(dist.std > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, "-dist ", dist.kind, " needs ", flag, "-std > 0"));
  }
  return absl::OkStatus();
}

std::vector<int64_t> SampleLengths(const LengthDist& dist, int64_t n, uint64_t seed) {
  std::vector<int64_t> out(static_cast<size_t>(std::max<int64_t>(n, 0)));
  std::mt19937_64 rng(seed);
  const int64_t mean = std::max<int64_t>(std::llround(dist.mean), 1);
  auto clamp = [](double v) { return std::max<int64_t>(std::llround(v), 1); };
  if (dist.kind == "uniform") {
    std::uniform_int_distribution<int64_t> d(mean - dist.range, mean + dist.range);
    for (int64_t& v : out) v = std::max<int64_t>(d(rng), 1);
  } else if (dist.kind == "normal") {
    std::normal_distribution<double> d(dist.mean, dist.std);
    for (int64_t& v : out) v = clamp(d(rng));
  } else if (dist.kind == "lognormal") {
    // Parameters of the underlying normal for the requested mean and standard deviation.
    const double sigma2 = std::log1p((dist.std * dist.std) / (dist.mean * dist.mean));
    std::lognormal_distribution<double> d(std::log(dist.mean) - sigma2 / 2, std::sqrt(sigma2));
    for (int64_t& v : out) v = clamp(d(rng));
  } else {
    std::fill(out.begin(), out.end(), mean);
  }
  return out;
}

absl::StatusOr<std::vector<BenchRequest>> ShareGptRequests(const std::string& path, int64_t n,
                                                           std::optional<int64_t> output_len) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open dataset ", path));
  json data = json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (data.is_discarded() || !data.is_array()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a JSON array"));
  }
  std::vector<BenchRequest> pool;
  for (const json& entry : data) {
    if (!entry.is_object() || !entry.contains("conversations")) continue;
    const json& turns = entry["conversations"];
    if (!turns.is_array()) continue;
    for (size_t i = 0; i < turns.size(); ++i) {
      const json& t = turns[i];
      if (!t.is_object() || t.value("from", "") != "human" || !t["value"].is_string()) continue;
      BenchRequest r;
      r.prompt = t["value"].get<std::string>();
      if (output_len) {
        r.max_tokens = *output_len;
      } else {
        int64_t words = 0;
        if (i + 1 < turns.size() && turns[i + 1].is_object() &&
            turns[i + 1].value("from", "") == "gpt" && turns[i + 1]["value"].is_string()) {
          std::istringstream ss(turns[i + 1]["value"].get<std::string>());
          std::string w;
          while (ss >> w) ++words;
        }
        r.max_tokens = std::max<int64_t>(words, 1);
      }
      if (!r.prompt.empty()) pool.push_back(std::move(r));
      break;
    }
  }
  if (pool.empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": no human turns"));
  std::vector<BenchRequest> out;
  for (int64_t i = 0; i < n; ++i) out.push_back(pool[static_cast<size_t>(i) % pool.size()]);
  return out;
}

}  // namespace tandem::tools

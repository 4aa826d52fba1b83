#include "tandem/tools/sampling_flags.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "tandem/base/status_macros.h"

namespace tandem::tools {

void DeclareSamplingFlags(Args& args) {
  args.Declare("max-tokens", "N", "tokens to generate (default 16)");
  args.Declare("min-tokens", "N", "tokens before EOS may end the output (default 0)");
  args.Declare("temperature", "T", "0 is greedy (default 1)");
  args.Declare("top-p", "P", "nucleus mass in (0, 1] (default 1)");
  args.Declare("top-k", "K", "keep the K most likely tokens (0: off)");
  args.Declare("min-p", "P", "drop tokens below P x the top probability (default 0)");
  args.Declare("repetition-penalty", "R", "divide logits of seen tokens (default 1)");
  args.Declare("presence-penalty", "X", "in [-2, 2] (default 0)");
  args.Declare("frequency-penalty", "X", "in [-2, 2] (default 0)");
  args.Declare("seed", "N", "per-request seed: the same tokens for the same seed");
  args.Declare("stop", "TEXT", "stop string (not part of the output)");
  args.Declare("stop-token-ids", "A,B", "token ids that end the output");
  args.Declare("n", "N", "number of samples (default 1)");
  args.Declare("logprobs", "K", "report the chosen token's logprob and the top K");
  args.DeclareSwitch("ignore-eos", "keep generating past EOS");
}

absl::StatusOr<engine::SamplingParams> ParseSamplingFlags(const Args& args) {
  engine::SamplingParams p;
  TANDEM_ASSIGN_OR_RETURN(int64_t max_tokens, args.Int("max-tokens", p.max_tokens));
  TANDEM_ASSIGN_OR_RETURN(int64_t min_tokens, args.Int("min-tokens", p.min_tokens));
  TANDEM_ASSIGN_OR_RETURN(double temperature, args.Double("temperature", p.temperature));
  TANDEM_ASSIGN_OR_RETURN(double top_p, args.Double("top-p", p.top_p));
  TANDEM_ASSIGN_OR_RETURN(int64_t top_k, args.Int("top-k", p.top_k));
  TANDEM_ASSIGN_OR_RETURN(double min_p, args.Double("min-p", p.min_p));
  TANDEM_ASSIGN_OR_RETURN(double rep, args.Double("repetition-penalty", p.repetition_penalty));
  TANDEM_ASSIGN_OR_RETURN(double presence, args.Double("presence-penalty", p.presence_penalty));
  TANDEM_ASSIGN_OR_RETURN(double frequency, args.Double("frequency-penalty", p.frequency_penalty));
  TANDEM_ASSIGN_OR_RETURN(int64_t n, args.Int("n", p.n));
  TANDEM_ASSIGN_OR_RETURN(int64_t logprobs, args.Int("logprobs", p.logprobs));
  auto in_int = [](int64_t v) { return v >= INT32_MIN && v <= INT32_MAX; };
  if (!in_int(max_tokens) || !in_int(min_tokens) || !in_int(top_k) || !in_int(n) ||
      !in_int(logprobs)) {
    return absl::InvalidArgumentError("an integer flag is out of range");
  }
  p.max_tokens = static_cast<int>(max_tokens);
  p.min_tokens = static_cast<int>(min_tokens);
  p.temperature = static_cast<float>(temperature);
  p.top_p = static_cast<float>(top_p);
  p.top_k = static_cast<int>(top_k);
  p.min_p = static_cast<float>(min_p);
  p.repetition_penalty = static_cast<float>(rep);
  p.presence_penalty = static_cast<float>(presence);
  p.frequency_penalty = static_cast<float>(frequency);
  p.n = static_cast<int>(n);
  p.logprobs = static_cast<int>(logprobs);
  p.ignore_eos = args.Switch("ignore-eos");
  if (auto seed = args.Get("seed")) {
    uint64_t value;
    if (!absl::SimpleAtoi(*seed, &value)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--seed must be a non-negative integer, got '", *seed, "'"));
    }
    p.seed = value;
  }
  if (auto stop = args.Get("stop")) p.stop.push_back(*stop);
  if (auto ids = args.Get("stop-token-ids")) {
    for (absl::string_view part : absl::StrSplit(*ids, ',')) {
      int32_t id;
      if (!absl::SimpleAtoi(part, &id)) {
        return absl::InvalidArgumentError(
            absl::StrCat("--stop-token-ids must be comma-separated integers, got '", *ids, "'"));
      }
      p.stop_token_ids.push_back(id);
    }
  }
  return p;
}

}  // namespace tandem::tools

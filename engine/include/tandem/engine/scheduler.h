// Iteration-level continuous batching with chunked prefill.
#pragma once

#include <cstdint>
#include <deque>
#include <vector>

#include "tandem/engine/block_manager.h"
#include "tandem/engine/sequence.h"

namespace tandem::engine {

// What an engine instance does with a sequence. colocated: prefill and decode here.
// prefill: compute the prompt and first token, then hold the KV for hand-off (kPrefilled).
// decode: sequences arrive with their prompt KV already in the cache.
enum class EngineRole { kColocated, kPrefill, kDecode };

// The order in which waiting sequences are admitted. kFcfs: arrival order.
// kShortestPromptFirst: fewest tokens left to compute first (arrival order among equals), which
// lowers mean time to first token when prompts differ in length; a long prompt waits while
// shorter ones keep arriving. Preempted sequences go first under both.
enum class QueuePolicy { kFcfs, kShortestPromptFirst };

struct SchedulerOptions {
  int max_num_seqs = 64;              // sequences in one step
  int max_num_batched_tokens = 2048;  // tokens (prefill chunks + decodes) in one step
  EngineRole role = EngineRole::kColocated;
  QueuePolicy queue_policy = QueuePolicy::kFcfs;
};

// One sequence's share of a step: tokens [num_computed_tokens, +num_new_tokens) are run.
struct ScheduledSequence {
  Sequence* seq = nullptr;  // owned by the engine
  int num_new_tokens = 0;
  // The step completes the sequence's known tokens, so its last position yields logits.
  bool samples = false;
  // Speculative decoding: the last num_draft_tokens of the num_new_tokens are the sequence's
  // draft_tokens, run after its real tokens; each of them yields logits too (a sampling
  // sequence has 1 + num_draft_tokens logit rows). Their KV counts as computed only once
  // AcceptDrafts says how many were accepted.
  int num_draft_tokens = 0;
};

struct SchedulerStep {
  std::vector<ScheduledSequence> seqs;
  int num_tokens = 0;
  // Copy-on-write block copies {src, dst} to perform before running the step.
  std::vector<std::pair<int32_t, int32_t>> block_copies;
  bool empty() const { return seqs.empty(); }
};

// Each step first continues running sequences in arrival order (a decode token each, or the
// next prefill chunk), then admits waiting ones, all under max_num_batched_tokens and
// max_num_seqs. When KV blocks run out, the most recently admitted running sequence is
// preempted: its blocks are freed and it re-enters the queue front to be recomputed.
// With prefix caching (BlockManager), a sequence admitted with nothing computed starts after
// the longest cached prefix of its tokens (always leaving its last token to compute, for
// logits), and a sample with a prompt source forks that sample's prompt blocks.
// Plain host code; never touches a device.
class Scheduler {
 public:
  Scheduler(const SchedulerOptions& options, BlockManager* blocks);

  // Queues a sequence (status kWaiting). Not owned.
  void Add(Sequence* seq);
  // Adds a decode-role sequence whose prompt KV is already in `seq->block_table` (its first
  // num_computed_tokens tokens), naming its full blocks in the prefix cache.
  void AddPrefilled(Sequence* seq);
  // Plans the next step and grows block tables for it.
  SchedulerStep Schedule();
  // After the step ran: advances num_computed_tokens of every scheduled sequence past its real
  // tokens (draft tokens wait for AcceptDrafts).
  void Commit(const SchedulerStep& step);
  // After a speculative step was verified and the accepted tokens appended to seq->tokens: the
  // first `accepted` draft tokens' KV counts as computed, the rejected ones' slots are given
  // back (blocks past the computed tokens are freed) and never named in the prefix cache.
  void AcceptDrafts(Sequence* seq, int accepted);
  // Ends a sequence (any state) with `reason` and frees its blocks, except for kPrefilled,
  // whose blocks stay until ReleaseBlocks().
  void Finish(Sequence* seq, FinishReason reason);
  void ReleaseBlocks(Sequence* seq);

  // Dynamic limits below the static ones (set by the SLO controllers before a step): a step
  // runs at most `n` sequences (running ones beyond it wait, in arrival order, and nothing is
  // admitted), and at most `tokens` tokens. Clamped to [1, max_num_seqs] and
  // [1, max_num_batched_tokens].
  void set_max_running(int n);
  void set_token_budget(int tokens);
  int max_running() const { return max_running_; }
  int token_budget() const { return token_budget_; }
  // Running sequences in the order steps continue them.
  const std::vector<Sequence*>& running() const { return running_; }

  bool has_work() const { return !running_.empty() || !waiting_.empty(); }
  int num_running() const { return static_cast<int>(running_.size()); }
  int num_waiting() const { return static_cast<int>(waiting_.size()); }
  int64_t num_preemptions() const { return num_preemptions_; }
  // Prefix cache, in tokens, counted as sequences are admitted: tokens looked up, and tokens
  // found cached (or shared with another sample of the request) and so not computed.
  int64_t prefix_cache_queries_tokens() const { return prefix_cache_queries_tokens_; }
  int64_t prefix_cache_hits_tokens() const { return prefix_cache_hits_tokens_; }
  // Counts a lookup made outside admission (a decode engine's reservation).
  void RecordPrefixCacheLookup(int queried_tokens, int hit_tokens) {
    prefix_cache_queries_tokens_ += queried_tokens;
    prefix_cache_hits_tokens_ += hit_tokens;
  }
  const SchedulerOptions& options() const { return options_; }

 private:
  enum class Admission { kAdmitted, kNotYet, kNoRoom };
  void Preempt(Sequence* seq);
  // Starts a waiting sequence with up to `budget` tokens: shares what is cached or forked, grows
  // its table for the rest. kNotYet: its prompt source is still computing (try later ones);
  // kNoRoom: not enough blocks (admit nothing more).
  Admission Admit(Sequence* seq, int budget, SchedulerStep& step);
  // Names the full blocks of `seq`'s computed tokens from block `first_block` on.
  void CacheComputedBlocks(Sequence& seq, int first_block);
  SchedulerOptions options_;
  BlockManager* blocks_;  // not owned
  std::deque<Sequence*> waiting_;
  std::vector<Sequence*> running_;  // arrival order
  int max_running_ = 0;
  int token_budget_ = 0;
  int64_t num_preemptions_ = 0;
  int64_t prefix_cache_queries_tokens_ = 0;
  int64_t prefix_cache_hits_tokens_ = 0;
};

}  // namespace tandem::engine

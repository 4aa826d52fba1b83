// The grammar masks of a step's constrained samples, computed on a thread of their own while the
// engine thread runs the step's forward pass. A sample's next mask depends only on the tokens its
// matcher has accepted, all known before the step runs, and nothing touches a matcher during the
// forward pass; so on a GPU, where the engine thread only waits for the device, the masks cost
// no step time.
//   prefetch.Start({matcher_a, matcher_b});  // the matchers are the prefetch's until Wait
//   ... run the forward pass ...
//   prefetch.Wait();
//   Use(prefetch.mask(0), prefetch.mask(1));
#pragma once

#include <future>
#include <vector>

#include "tandem/base/job_pool.h"
#include "tandem/grammar/matcher.h"

namespace tandem::engine::internal {

class GrammarMaskPrefetch {
 public:
  GrammarMaskPrefetch() : thread_(1) {}
  // Wait()s for a started fill before the thread stops.
  ~GrammarMaskPrefetch() { Wait(); }

  // Begins filling mask(i) from matchers[i]->FillNextTokenMask, in order. Until Wait returns,
  // nothing else may use the matchers or read the masks.
  void Start(std::vector<grammar::GrammarMatcher*> matchers);
  // Returns once the masks of the last Start are filled; at once when none is pending.
  void Wait();
  const grammar::TokenMask& mask(size_t i) const { return masks_[i]; }

 private:
  base::JobPool thread_;
  std::vector<grammar::GrammarMatcher*> matchers_;
  std::vector<grammar::TokenMask> masks_;  // kept between steps: no allocation per step
  std::promise<void> done_;
  std::future<void> pending_;
};

}  // namespace tandem::engine::internal

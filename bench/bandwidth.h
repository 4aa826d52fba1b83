// Memory bandwidth of this machine, measured the way a decode step uses it.
//
// Decode-step benchmarks report their achieved bandwidth as a fraction of this figure, measured
// in the same run so that both see the same machine state:
//   const double copy_gbs = tandem::bench::MeasureCopyBandwidthGBs();
//   state.counters["of_copy"] = achieved_gbs / copy_gbs;
#pragma once

#include <cstddef>

namespace tandem::bench {

// STREAM-style copy: `threads` threads each copy their share of a `bytes` buffer into another
// (memcpy, which uses non-temporal stores at this size), best of `repetitions` after a warm-up
// pass that also faults the pages in. Returns bytes read plus bytes written per second, in
// GB/s (1e9 bytes). Allocates 2 x `bytes` for the duration of the call.
double MeasureCopyBandwidthGBs(int threads = 2, size_t bytes = size_t{256} << 20,
                               int repetitions = 5);

// Read-only streaming (a sum over a `bytes` buffer, split over `threads`), best of
// `repetitions`; bytes read per second in GB/s. Weight streaming in a decode step is read-only,
// and on many machines reads alone go faster than the reads plus writes of a copy.
double MeasureReadBandwidthGBs(int threads = 2, size_t bytes = size_t{256} << 20,
                               int repetitions = 5);

}  // namespace tandem::bench

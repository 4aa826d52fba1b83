// The GPU's own yardstick for the CUDA benchmarks (built with CUDA only): a device-to-device
// copy, the counterpart of bandwidth.h's host copy.
#pragma once

#include <cstddef>

namespace tandem::bench {

// cudaMemcpy of `bytes` (far over the L2) between two buffers of GPU 0, the median of 20
// event-timed copies after 3 warm-ups; bytes read plus bytes written per second, in GB/s.
// 0 when it cannot run (no device, or the buffers cannot be allocated).
double MeasureCudaCopyGBs(size_t bytes = size_t{1} << 30);

}  // namespace tandem::bench

#include "bench/cuda_bandwidth.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

namespace tandem::bench {

double MeasureCudaCopyGBs(size_t bytes) {
  void* a = nullptr;
  void* b = nullptr;
  if (cudaMalloc(&a, bytes) != cudaSuccess || cudaMalloc(&b, bytes) != cudaSuccess) {
    cudaFree(a);
    return 0;
  }
  cudaMemset(a, 0x5a, bytes);
  cudaEvent_t start, end;
  cudaEventCreate(&start);
  cudaEventCreate(&end);
  std::vector<float> ms;
  for (int i = 0; i < 23; ++i) {
    cudaEventRecord(start);
    cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice);
    cudaEventRecord(end);
    cudaEventSynchronize(end);
    float t = 0;
    cudaEventElapsedTime(&t, start, end);
    if (i >= 3) ms.push_back(t);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(end);
  cudaFree(a);
  cudaFree(b);
  std::sort(ms.begin(), ms.end());
  const float median = ms[ms.size() / 2];
  return median > 0 ? 2.0 * static_cast<double>(bytes) / (median * 1e-3) / 1e9 : 0;
}

}  // namespace tandem::bench

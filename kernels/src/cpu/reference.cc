#include "kernels/src/cpu/reference.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace tandem::kernels::reference {

void Linear(const float* x, int m, const void* w, DType w_dtype, int n, int k, const float* bias,
            float* y) {
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      double acc = 0.0;
      for (int p = 0; p < k; ++p) {
        acc += double{x[int64_t{i} * k + p]} * LoadAsFloat(w, w_dtype, int64_t{j} * k + p);
      }
      if (bias != nullptr) acc += bias[j];
      y[int64_t{i} * n + j] = static_cast<float>(acc);
    }
  }
}

void RmsNorm(const float* x, const float* weight, float eps, int rows, int dim, float* y) {
  for (int r = 0; r < rows; ++r) {
    const float* xr = x + int64_t{r} * dim;
    float* yr = y + int64_t{r} * dim;
    double sum_sq = 0.0;
    for (int i = 0; i < dim; ++i) sum_sq += double{xr[i]} * xr[i];
    const double inv_rms = 1.0 / std::sqrt(sum_sq / dim + eps);
    for (int i = 0; i < dim; ++i) yr[i] = static_cast<float>(xr[i] * inv_rms * weight[i]);
  }
}

void AddRmsNorm(float* residual, const float* x, const float* weight, float eps, int rows, int dim,
                float* y) {
  for (int64_t i = 0; i < int64_t{rows} * dim; ++i) residual[i] += x[i];
  RmsNorm(residual, weight, eps, rows, dim, y);
}

void Rope(float* x, const int32_t* positions, int tokens, int heads, int head_dim,
          const float* inv_freq) {
  const int half = head_dim / 2;
  for (int t = 0; t < tokens; ++t) {
    for (int i = 0; i < half; ++i) {
      const float angle = static_cast<float>(positions[t]) * inv_freq[i];
      const double c = std::cos(double{angle});
      const double s = std::sin(double{angle});
      for (int h = 0; h < heads; ++h) {
        float* xh = x + (int64_t{t} * heads + h) * head_dim;
        const double x1 = xh[i];
        const double x2 = xh[i + half];
        xh[i] = static_cast<float>(x1 * c - x2 * s);
        xh[i + half] = static_cast<float>(x2 * c + x1 * s);
      }
    }
  }
}

void SiluMul(const float* gate_up, int rows, int inter, float* out) {
  for (int r = 0; r < rows; ++r) {
    const float* gate = gate_up + int64_t{r} * 2 * inter;
    const float* up = gate + inter;
    for (int i = 0; i < inter; ++i) {
      const double g = gate[i];
      out[int64_t{r} * inter + i] = static_cast<float>(g / (1.0 + std::exp(-g)) * up[i]);
    }
  }
}

void GatherAdd(const float* a, const float* b, const int32_t* rows, int num_rows, int dim,
               float* out) {
  for (int i = 0; i < num_rows; ++i) {
    for (int j = 0; j < dim; ++j) {
      out[int64_t{i} * dim + j] = a[int64_t{rows[i]} * dim + j] + b[int64_t{rows[i]} * dim + j];
    }
  }
}

void Embedding(const void* table, DType table_dtype, const int32_t* ids, int tokens, int dim,
               float* out) {
  for (int t = 0; t < tokens; ++t) {
    for (int i = 0; i < dim; ++i) {
      out[int64_t{t} * dim + i] = LoadAsFloat(table, table_dtype, int64_t{ids[t]} * dim + i);
    }
  }
}

namespace {

// What an element stores of `value` in a cache of layout.dtype: value / scale for 8-bit caches.
float CacheScale(const KvLayout& layout, float scale) {
  return DTypeSize(layout.dtype) == 1 ? scale : 1.0f;
}

}  // namespace

void WriteKv(const float* k, const float* v, const int32_t* slot_mapping, int tokens,
             const KvLayout& layout, void* layer_cache) {
  const int64_t row = int64_t{layout.num_kv_heads} * layout.head_dim;
  void* v_cache = static_cast<unsigned char*>(layer_cache) + layout.HalfBytes();
  const float k_scale = CacheScale(layout, layout.k_scale);
  const float v_scale = CacheScale(layout, layout.v_scale);
  for (int t = 0; t < tokens; ++t) {
    if (slot_mapping[t] < 0) continue;
    for (int64_t i = 0; i < row; ++i) {
      StoreFromFloat(layer_cache, layout.dtype, slot_mapping[t] * row + i,
                     k[t * row + i] / k_scale);
      StoreFromFloat(v_cache, layout.dtype, slot_mapping[t] * row + i, v[t * row + i] / v_scale);
    }
  }
}

void PagedAttention(const float* q, const void* layer_cache, const KvLayout& layout,
                    const PagedAttentionBatch& batch, int num_heads, float scale, float* out) {
  const int hd = layout.head_dim;
  const int group = num_heads / layout.num_kv_heads;
  const int64_t slot_stride = int64_t{layout.num_kv_heads} * hd;
  // The cache widened to fp32 (scales applied), then read as an fp32 cache.
  std::vector<float> k_cache(layout.HalfElements()), v_cache(layout.HalfElements());
  const void* v_half = static_cast<const unsigned char*>(layer_cache) + layout.HalfBytes();
  for (int64_t i = 0; i < layout.HalfElements(); ++i) {
    k_cache[i] = LoadAsFloat(layer_cache, layout.dtype, i) * CacheScale(layout, layout.k_scale);
    v_cache[i] = LoadAsFloat(v_half, layout.dtype, i) * CacheScale(layout, layout.v_scale);
  }
  // Address of the K (or V) vector of KV head `kvh` at position `pos` of sequence `s`.
  auto at = [&](const std::vector<float>& half, int s, int pos, int kvh) {
    const int32_t block =
        batch.block_table[int64_t{s} * batch.max_blocks_per_seq + pos / layout.block_size];
    const int64_t slot = int64_t{block} * layout.block_size + pos % layout.block_size;
    return half.data() + slot * slot_stride + int64_t{kvh} * hd;
  };
  std::vector<double> scores;
  std::vector<double> acc(hd);
  for (int s = 0; s < batch.num_seqs; ++s) {
    const int q_len = batch.query_start[s + 1] - batch.query_start[s];
    const int ctx = batch.context_len[s];
    for (int r = 0; r < q_len; ++r) {
      const int token = batch.query_start[s] + r;
      const int visible = ctx - q_len + r + 1;
      for (int h = 0; h < num_heads; ++h) {
        const int kvh = h / group;
        const float* qh = q + (int64_t{token} * num_heads + h) * hd;
        scores.assign(visible, 0.0);
        double max_score = -std::numeric_limits<double>::infinity();
        for (int p = 0; p < visible; ++p) {
          const float* kp = at(k_cache, s, p, kvh);
          double dot = 0.0;
          for (int d = 0; d < hd; ++d) dot += double{qh[d]} * kp[d];
          scores[p] = dot * scale;
          max_score = std::max(max_score, scores[p]);
        }
        double denom = 0.0;
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int p = 0; p < visible; ++p) {
          const double weight = std::exp(scores[p] - max_score);
          denom += weight;
          const float* vp = at(v_cache, s, p, kvh);
          for (int d = 0; d < hd; ++d) acc[d] += weight * vp[d];
        }
        float* oh = out + (int64_t{token} * num_heads + h) * hd;
        for (int d = 0; d < hd; ++d) oh[d] = static_cast<float>(acc[d] / denom);
      }
    }
  }
}

}  // namespace tandem::kernels::reference

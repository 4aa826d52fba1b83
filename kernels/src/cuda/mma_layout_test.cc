// Checks mma_layout.h, which the tensor-core prefill kernel (flash_attention.cu) indexes its
// fragments with, against ldmatrix and mma.m16n8k16 emulated on the CPU from the PTX ISA's
// definitions (written out independently below, in the ISA's own terms), by running the
// kernel's two products for one warp, S = Q K^T and O = P V with P taken from S's D fragments,
// and comparing with plain matrix products. Needs no GPU; the instructions' real behaviour
// is confirmed only by the CUDA conformance suite on a device.
#include "kernels/src/cuda/mma_layout.h"

#include <array>
#include <cstdint>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace tandem::kernels::cuda::mma {
namespace {

// A row-major matrix of 16-bit values, held as floats (small integers: every product and sum
// below is exact).
struct Matrix {
  int rows, cols;
  std::vector<float> v;
  Matrix(int r, int c) : rows(r), cols(c), v(static_cast<size_t>(r) * c, 0.0f) {}
  float& at(int r, int c) { return v[static_cast<size_t>(r) * cols + c]; }
  float at(int r, int c) const { return v[static_cast<size_t>(r) * cols + c]; }
};

Matrix RandomMatrix(int rows, int cols, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int> dist(-8, 8);
  Matrix m(rows, cols);
  for (float& x : m.v) x = static_cast<float>(dist(gen));
  return m;
}

// A warp's registers: [lane][register][half] (half 0: low 16 bits, the lower-index element).
using Regs4 = std::array<std::array<std::array<float, 2>, 4>, 32>;
using Accum = std::array<std::array<float, 4>, 32>;  // [lane][c index]

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16, as the PTX ISA defines it: threads
// 8i .. 8i+7 supply the addresses of rows 0..7 of matrix i (8 consecutive elements each);
// afterwards each thread holds in register i a fragment of matrix i: "each thread receives
// two elements of a row" -- row l / 4, elements 2 (l % 4) and 2 (l % 4) + 1 -- or, with
// .trans, the matrix is transposed on the way: elements [2 (l % 4)][l / 4] and
// [2 (l % 4) + 1][l / 4]. `address(lane)` is the {row, column} of m the lane points at.
template <typename Address>
Regs4 Ldmatrix(const Matrix& m, Address address, bool trans) {
  Regs4 r{};
  for (int lane = 0; lane < 32; ++lane) {
    for (int i = 0; i < 4; ++i) {
      for (int h = 0; h < 2; ++h) {
        int src_row, element;
        if (!trans) {
          src_row = lane / 4;
          element = 2 * (lane % 4) + h;
        } else {
          src_row = 2 * (lane % 4) + h;
          element = lane / 4;
        }
        const Coord a = address(8 * i + src_row);
        r[lane][i][h] = m.at(a.row, a.col + element);
      }
    }
  }
  return r;
}

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, D = A B + C, with the fragment layouts in
// the ISA's terms: A's elements a0..a7 (two per .b32 register, a_{2j} low), B's b0..b3, C's
// c0..c3; groupID = lane >> 2, threadID_in_group = lane % 4.
//   A: row = groupID for a0, a1, a4, a5 and groupID + 8 for a2, a3, a6, a7;
//      col = threadID_in_group * 2 + (i & 1) for a0..a3, + 8 for a4..a7.
//   B: row = threadID_in_group * 2 + (i & 1) for b0, b1, + 8 for b2, b3; col = groupID.
//   C: row = groupID for c0, c1, groupID + 8 for c2, c3; col = threadID_in_group * 2 + (i & 1).
void Mma(Accum& d, const Regs4& a, const std::array<std::array<std::array<float, 2>, 2>, 32>& b) {
  float am[16][16] = {}, bm[16][8] = {};
  for (int lane = 0; lane < 32; ++lane) {
    const int group = lane >> 2, tig = lane % 4;
    for (int i = 0; i < 8; ++i) {
      const int row = (i < 2 || (i >= 4 && i < 6)) ? group : group + 8;
      const int col = tig * 2 + (i & 1) + (i >= 4 ? 8 : 0);
      am[row][col] = a[lane][i / 2][i % 2];
    }
    for (int i = 0; i < 4; ++i) {
      const int row = tig * 2 + (i & 1) + (i >= 2 ? 8 : 0);
      bm[row][group] = b[lane][i / 2][i % 2];
    }
  }
  for (int lane = 0; lane < 32; ++lane) {
    const int group = lane >> 2, tig = lane % 4;
    for (int i = 0; i < 4; ++i) {
      const int row = i < 2 ? group : group + 8;
      const int col = tig * 2 + (i & 1);
      float sum = 0.0f;
      for (int k = 0; k < 16; ++k) sum += am[row][k] * bm[k][col];
      d[lane][i] += sum;
    }
  }
}

// Registers (first, first + 1) of an ldmatrix result as a B fragment.
std::array<std::array<std::array<float, 2>, 2>, 32> BPair(const Regs4& r, int first) {
  std::array<std::array<std::array<float, 2>, 2>, 32> b{};
  for (int lane = 0; lane < 32; ++lane) {
    b[lane][0] = r[lane][first];
    b[lane][1] = r[lane][first + 1];
  }
  return b;
}

TEST(MmaLayoutTest, HelpersMatchTheIsaTables) {
  for (int lane = 0; lane < 32; ++lane) {
    const int group = lane >> 2, tig = lane % 4;
    for (int i = 0; i < 8; ++i) {
      const Coord a = AElement(lane, i / 2, i % 2);
      EXPECT_EQ(a.row, (i < 2 || (i >= 4 && i < 6)) ? group : group + 8) << lane << " a" << i;
      EXPECT_EQ(a.col, tig * 2 + (i & 1) + (i >= 4 ? 8 : 0)) << lane << " a" << i;
    }
    for (int i = 0; i < 4; ++i) {
      const Coord b = BElement(lane, i / 2, i % 2);
      EXPECT_EQ(b.row, tig * 2 + (i & 1) + (i >= 2 ? 8 : 0)) << lane << " b" << i;
      EXPECT_EQ(b.col, group) << lane << " b" << i;
      const Coord c = CElement(lane, i);
      EXPECT_EQ(c.row, i < 2 ? group : group + 8) << lane << " c" << i;
      EXPECT_EQ(c.col, tig * 2 + (i & 1)) << lane << " c" << i;
    }
  }
}

// One warp of FlashPrefillKernel: its 16 query rows against a 64-key tile, head_dim 64 and 128,
// with the kernel's loops, shared-memory strides and index helpers.
void CheckWarp(int head_dim, int warp) {
  constexpr int kRows = 64, kKeys = 64;
  const int stride = head_dim + 8;  // the kernel's padded shared rows
  const Matrix q = RandomMatrix(kRows, head_dim, 1 + head_dim + warp);
  const Matrix k = RandomMatrix(kKeys, head_dim, 2 + head_dim + warp);
  const Matrix v = RandomMatrix(kKeys, head_dim, 3 + head_dim + warp);
  // The tiles as shared memory holds them: rows `stride` elements apart.
  Matrix q_s(kRows, stride), k_s(kKeys, stride), v_s(kKeys, stride);
  for (int r = 0; r < kRows; ++r) {
    for (int d = 0; d < head_dim; ++d) {
      q_s.at(r, d) = q.at(r, d);
      k_s.at(r, d) = k.at(r, d);
      v_s.at(r, d) = v.at(r, d);
    }
  }

  // Q fragments: q_frag[s] covers head dims [16 s, 16 s + 16) of rows [16 warp, 16 warp + 16).
  std::vector<Regs4> q_frag(head_dim / 16);
  for (int s = 0; s < head_dim / 16; ++s) {
    q_frag[s] = Ldmatrix(
        q_s,
        [&](int lane) {
          const Coord at = LdmatrixA(lane);
          return Coord{warp * 16 + at.row, s * 16 + at.col};
        },
        false);
  }
  // S = Q K^T: s_acc[n] is the D fragment of keys [8 n, 8 n + 8).
  std::vector<Accum> s_acc(kKeys / 8, Accum{});
  for (int d = 0; d < head_dim / 16; ++d) {
    for (int n = 0; n < kKeys / 8; n += 2) {
      const Regs4 b = Ldmatrix(
          k_s,
          [&](int lane) {
            const Coord at = LdmatrixBFromNk(lane);
            return Coord{n * 8 + at.row, d * 16 + at.col};
          },
          false);
      Mma(s_acc[n], q_frag[d], BPair(b, 0));
      Mma(s_acc[n + 1], q_frag[d], BPair(b, 2));
    }
  }
  Matrix s_want(16, kKeys);
  for (int r = 0; r < 16; ++r) {
    for (int j = 0; j < kKeys; ++j) {
      float sum = 0.0f;
      for (int d = 0; d < head_dim; ++d) sum += q.at(warp * 16 + r, d) * k.at(j, d);
      s_want.at(r, j) = sum;
    }
  }
  for (int n = 0; n < kKeys / 8; ++n) {
    for (int lane = 0; lane < 32; ++lane) {
      for (int e = 0; e < 4; ++e) {
        const Coord at = CElement(lane, e);
        ASSERT_EQ(s_acc[n][lane][e], s_want.at(at.row, n * 8 + at.col))
            << "S head_dim " << head_dim << " n-tile " << n << " lane " << lane << " c" << e;
      }
    }
  }

  // P: a function of S element by element (here S mod 5, small), packed from the D fragments
  // into A fragments as the kernel does (AFromD), then O = P V with V through ldmatrix.trans.
  auto p_of = [](float s) { return static_cast<float>(static_cast<int>(s) % 5); };
  std::vector<Regs4> p_frag(kKeys / 16);
  for (int kk = 0; kk < kKeys / 16; ++kk) {
    for (int lane = 0; lane < 32; ++lane) {
      for (int r = 0; r < 4; ++r) {
        const DSource from = AFromD(r);
        const Accum& c = s_acc[2 * kk + from.tile];
        p_frag[kk][lane][r] = {p_of(c[lane][from.index]), p_of(c[lane][from.index + 1])};
      }
    }
  }
  std::vector<Accum> o(head_dim / 8, Accum{});
  for (int kk = 0; kk < kKeys / 16; ++kk) {
    for (int n = 0; n < head_dim / 8; n += 2) {
      const Regs4 b = Ldmatrix(
          v_s,
          [&](int lane) {
            const Coord at = LdmatrixBFromKnTrans(lane);
            return Coord{kk * 16 + at.row, n * 8 + at.col};
          },
          true);
      Mma(o[n], p_frag[kk], BPair(b, 0));
      Mma(o[n + 1], p_frag[kk], BPair(b, 2));
    }
  }
  for (int n = 0; n < head_dim / 8; ++n) {
    for (int lane = 0; lane < 32; ++lane) {
      for (int e = 0; e < 4; ++e) {
        const Coord at = CElement(lane, e);
        float want = 0.0f;
        for (int j = 0; j < kKeys; ++j) want += p_of(s_want.at(at.row, j)) * v.at(j, n * 8 + at.col);
        ASSERT_EQ(o[n][lane][e], want)
            << "O head_dim " << head_dim << " n-tile " << n << " lane " << lane << " c" << e;
      }
    }
  }
}

TEST(MmaLayoutTest, WarpProductsMatchPlainMatrixProducts) {
  for (int head_dim : {64, 128}) {
    for (int warp = 0; warp < 4; ++warp) CheckWarp(head_dim, warp);
  }
}

// The ldmatrix row addresses the kernel gives are 16-byte aligned and, with its padded rows,
// fall on 8 distinct 4-bank groups within each 8-lane phase (no bank conflicts).
TEST(MmaLayoutTest, LdmatrixAddressesAreAlignedAndConflictFree) {
  for (int head_dim : {64, 128}) {
    const int stride_bytes = (head_dim + 8) * 2;
    for (Coord (*address)(int) : {&LdmatrixA, &LdmatrixBFromNk, &LdmatrixBFromKnTrans}) {
      for (int phase = 0; phase < 4; ++phase) {
        std::vector<bool> used(8, false);
        for (int lane = 8 * phase; lane < 8 * phase + 8; ++lane) {
          const Coord at = address(lane);
          const int bytes = at.row * stride_bytes + at.col * 2;
          EXPECT_EQ(bytes % 16, 0);
          const int group = (bytes / 16) % 8;  // 16-byte bank group of 32 banks x 4 bytes
          EXPECT_FALSE(used[group]) << "head_dim " << head_dim << " lane " << lane;
          used[group] = true;
        }
      }
    }
  }
}

// The skinny GEMM's fragments (SkinnyARow, SkinnyAWord, SkinnyBWord): each lane's 16-byte
// loads of W rows g and g + 8 and of x row g, over two 32-wide k chunks of two k-steps each,
// through the emulated mma, must give D = W x^T exactly (a k element skipped or taken twice
// would change it).
TEST(MmaLayoutTest, SkinnyGemmLoadsGiveTheProduct) {
  constexpr int kK = 64;
  const Matrix w = RandomMatrix(16, kK, 31), x = RandomMatrix(8, kK, 32);
  Accum d{};
  for (int chunk = 0; chunk < kK / 32; ++chunk) {
    for (int step = 0; step < 2; ++step) {
      Regs4 a{};
      std::array<std::array<std::array<float, 2>, 2>, 32> b{};
      for (int lane = 0; lane < 32; ++lane) {
        const int g = lane / 4, t = lane % 4;
        // Word j of a lane's load holds k 8t + 2j (low half) and 8t + 2j + 1 of its chunk.
        for (int reg = 0; reg < 4; ++reg) {
          for (int h = 0; h < 2; ++h) {
            a[lane][reg][h] = w.at(g + 8 * SkinnyARow(reg),
                                   32 * chunk + 8 * t + 2 * SkinnyAWord(step, reg) + h);
          }
        }
        for (int reg = 0; reg < 2; ++reg) {
          for (int h = 0; h < 2; ++h) {
            b[lane][reg][h] = x.at(g, 32 * chunk + 8 * t + 2 * SkinnyBWord(step, reg) + h);
          }
        }
      }
      Mma(d, a, b);
    }
  }
  for (int lane = 0; lane < 32; ++lane) {
    for (int i = 0; i < 4; ++i) {
      const Coord c = CElement(lane, i);  // row: W's row (n), column: x's row (m)
      float want = 0.0f;
      for (int k = 0; k < kK; ++k) want += w.at(c.row, k) * x.at(c.col, k);
      EXPECT_EQ(d[lane][i], want) << "lane " << lane << " c" << i;
    }
  }
}

}  // namespace
}  // namespace tandem::kernels::cuda::mma

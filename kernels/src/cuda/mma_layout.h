// Where the elements of the warp-wide tensor-core instructions live, as plain constexpr
// functions shared by the prefill attention kernel (flash_attention.cu) and a CPU test that
// emulates the instructions (mma_layout_test.cc). Host-includable: no device code.
//
// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32: D[16x8] = A[16x16] B[16x8]
// + C, one warp. With g = lane / 4 (groupID) and t = lane % 4 (threadID_in_group), the PTX ISA
// ("Matrix Fragments for mma.m16n8k16 with floating point type") gives:
//   A: four .b32 registers, each two 16-bit elements, the lower-index element in the low half:
//      a0 = A[g][2t, 2t+1]    a1 = A[g+8][2t, 2t+1]
//      a2 = A[g][2t+8, 2t+9]  a3 = A[g+8][2t+8, 2t+9]
//   B: two .b32 registers:
//      b0 = B[2t, 2t+1][g]    b1 = B[2t+8, 2t+9][g]       (k rows, n column)
//   C, D: four floats:
//      c0, c1 = C[g][2t, 2t+1]  c2, c3 = C[g+8][2t, 2t+1]
//
// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16 loads four 8x8 matrices of 16-bit elements:
// lanes 8i .. 8i+7 give the shared addresses of rows 0..7 of matrix i (each row 8 contiguous
// elements, 16-byte aligned), and register i of lane l then holds
//   without .trans: M_i[l / 4][2 (l % 4)], M_i[l / 4][2 (l % 4) + 1]
//   with .trans:    M_i[2 (l % 4)][l / 4], M_i[2 (l % 4) + 1][l / 4]
// (the lower-index element in the low half). So the non-transposed register of an 8x8 block
// is exactly a C-style fragment (row g, columns 2t, 2t+1), and the transposed one a B-style
// fragment (rows 2t, 2t+1, column g). The Ldmatrix* functions below say which row of which 8x8
// block each lane addresses so that the four registers come out as the fragments above.
#pragma once

#if defined(__CUDACC__)
#define TANDEM_HOST_DEVICE __host__ __device__
#else
#define TANDEM_HOST_DEVICE
#endif

namespace tandem::kernels::cuda::mma {

struct Coord {
  int row, col;
};

// The PTX fragment layouts above, element by element. reg: register index; half: 0 for the
// low 16 bits (lower-index element), 1 for the high.
TANDEM_HOST_DEVICE constexpr Coord AElement(int lane, int reg, int half) {
  return {lane / 4 + 8 * (reg & 1), 2 * (lane % 4) + half + 8 * (reg >> 1)};
}
// {k row, n column} of B.
TANDEM_HOST_DEVICE constexpr Coord BElement(int lane, int reg, int half) {
  return {2 * (lane % 4) + half + 8 * reg, lane / 4};
}
// C and D: index 0..3.
TANDEM_HOST_DEVICE constexpr Coord CElement(int lane, int index) {
  return {lane / 4 + 8 * (index >> 1), 2 * (lane % 4) + (index & 1)};
}

// ldmatrix .x4 (no .trans) of a 16x16 A tile stored row-major (rows = M, 16-bit columns = K):
// the {row, first column} whose 8 elements this lane addresses. Matrix i = lane / 8 is the
// 8x8 block of rows 8 (i & 1), columns 8 (i >> 1): registers come out as a0, a1, a2, a3.
TANDEM_HOST_DEVICE constexpr Coord LdmatrixA(int lane) {
  return {8 * ((lane / 8) & 1) + lane % 8, 8 * ((lane / 8) >> 1)};
}

// ldmatrix .x4 (no .trans) of B for two adjacent n-tiles of 8 from a tile stored [n][k]
// (row n holds k contiguous, as K rows hold head dims): {n row, first k column}. Matrix i is
// rows 8 (i >> 1), columns 8 (i & 1): registers are b0, b1 of n-tile 0, then b0, b1 of n-tile 1.
TANDEM_HOST_DEVICE constexpr Coord LdmatrixBFromNk(int lane) {
  return {8 * ((lane / 8) >> 1) + lane % 8, 8 * ((lane / 8) & 1)};
}

// ldmatrix .x4.trans of B for two adjacent n-tiles from a tile stored [k][n] (row k holds n
// contiguous, as V rows hold head dims): {k row, first n column}. Matrix i is rows 8 (i & 1),
// columns 8 (i >> 1): registers are b0, b1 of n-tile 0, then b0, b1 of n-tile 1.
TANDEM_HOST_DEVICE constexpr Coord LdmatrixBFromKnTrans(int lane) {
  return {8 * ((lane / 8) & 1) + lane % 8, 8 * ((lane / 8) >> 1)};
}

// Reusing D fragments as A: the D fragments of n-tiles 2s and 2s+1 (columns 16s .. 16s+15 of
// a 16-row result) are, packed in pairs, the A fragment of k-step s over those columns.
// Register r of that A fragment packs D[n-tile 2s + (r >> 1)][2 (r & 1)] (low half) and
// [2 (r & 1) + 1] (high half). Returns which of the two n-tiles (0 or 1) and the first D index.
struct DSource {
  int tile, index;
};
TANDEM_HOST_DEVICE constexpr DSource AFromD(int reg) { return {reg >> 1, 2 * (reg & 1)}; }

// The skinny GEMM (linear.cu: y[m, n] = x[m, k] W^T for m <= 16) feeds the mma straight from
// 16-byte global loads, with W as A (16 of its rows, n) and x as B (8 of its rows, m). A dot
// product does not care in which order k is walked, so long as A and B walk it alike: over a
// 32-wide k chunk, lane (g = lane / 4, t = lane % 4) loads the 8 elements at k 8t .. 8t+7 of
// W rows g and g + 8 and of x row g, and k-step s (0 or 1) of the chunk takes the logical k
// columns 2t, 2t+1 from k 8t+4s, 8t+4s+1 and columns 2t+8, 2t+9 from k 8t+4s+2, 8t+4s+3.
// So register r of A is 32-bit word SkinnyAWord(s, r) of the load of W row g + 8 SkinnyARow(r),
// and register r of B word SkinnyBWord(s, r) of the x row's load.
TANDEM_HOST_DEVICE constexpr int SkinnyARow(int reg) { return reg & 1; }
TANDEM_HOST_DEVICE constexpr int SkinnyAWord(int step, int reg) { return 2 * step + (reg >> 1); }
TANDEM_HOST_DEVICE constexpr int SkinnyBWord(int step, int reg) { return 2 * step + reg; }

}  // namespace tandem::kernels::cuda::mma

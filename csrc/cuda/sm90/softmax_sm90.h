// The Hopper forward's online softmax: the running max and sum of a consumer
// thread's query rows, folded with one key tile of scores at a time.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "cuda/utils.h"

namespace jflash::cuda::sm90 {

using namespace cute;

// kRows x kCols: the scores a thread holds per key tile, as a (rows, cols)
// view s_rc of its wgmma accumulator (a quad of lanes holds one row).
// Scores live in the log2 domain: exp(scale * s) = exp2(scale_log2 * s).
template <int kRows, int kCols>
struct SoftmaxSm90 {
  static_assert(kCols % 4 == 0);
  // How far a tile's scores may pass the running max (log2 units) before the
  // max moves: terms up to 2^15 in P, below float16's largest (65504) and far
  // from overflow in the float32 sums and O.
  static constexpr int kRescaleSlack = 15;                   // log2 units
  static constexpr float kRescaleBound = 1 << kRescaleSlack;  // 2^kRescaleSlack

  float row_max[kRows];  // running max of the scaled (log2-domain) scores
  float row_sum[kRows];  // running sum of exp2(score - row_max), this thread's columns
  // The scale, read where it is used (a constant operand in the kernel's
  // parameters) rather than held in a register across the main loop.
  const float& scale_log2;
  // Masked tiles of a zero scale hold the scaled scores (0, NaN or -inf):
  // ScoreMaskSm90 says why.
  const bool zero_scale;

  __device__ __forceinline__ explicit SoftmaxSm90(const float& scale_log2_)
      : scale_log2(scale_log2_), zero_scale(scale_log2_ == 0.f) {}

  // Before a tile's first key tile.
  __device__ __forceinline__ void reset() {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      row_max[r] = -INFINITY;
      row_sum[r] = 0.f;
    }
  }

  // Reduces row r of the score tile with four independent partial results:
  // one serial chain of kCols dependent instructions would leave the warp
  // waiting on each one's latency.
  template <typename ScoresRowCol, typename Op>
  __device__ __forceinline__ static float row_reduce(const ScoresRowCol& s_rc, int r, Op op) {
    float part[4];
    CUTE_UNROLL
    for (int a = 0; a < 4; ++a) part[a] = s_rc(r, a);
    CUTE_UNROLL
    for (int c = 4; c < kCols; ++c) part[c % 4] = op(part[c % 4], s_rc(r, c));
    return op(op(part[0], part[1]), op(part[2], part[3]));
  }

  // Folds the (masked) score tile into the running max and sum with a fresh
  // tile max, and leaves the exponentials in s_rc and each row's O correction
  // factor in `correction`. The row max of scale * s is scale * max(s) (scale *
  // min(s) for a negative scale), and each exponent is one FFMA, scale * s -
  // max, saving a multiply per score. Each phase below handles all rows at
  // once, without branches inside, so that the rows' dependency chains
  // interleave.
  template <typename ScoresRowCol>
  __device__ __forceinline__ void fold_max(ScoresRowCol& s_rc, bool needs_mask,
                                           float (&correction)[kRows]) {
    const float scale = scale_log2;
    const bool prescaled = needs_mask && zero_scale;
    float row_ext[kRows];  // tile_max = ext_scale * row_ext after the quad reduction
    float ext_scale;
    if (scale >= 0.f) {
      ext_scale = prescaled ? 1.f : scale;
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) row_ext[r] = row_reduce(s_rc, r, MaxOp{});
    } else {
      ext_scale = -scale;
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) row_ext[r] = -row_reduce(s_rc, r, MinOp{});
    }
    const float s_scale = prescaled ? 1.f : scale;
    float m_safe[kRows];
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      // Lazy rescaling: the running max moves only when the tile exceeds it
      // by more than kRescaleSlack (log2 units). Otherwise the exponents of
      // this tile are taken against the stale max (values up to 2^slack, far
      // from overflow in P and the float32 sums) and O keeps its scale: the
      // result is the same, since O and the row sum share one reference max
      // and lse = max + log(sum). On most tiles no row moves, and the warp
      // skips the O rescale (rescale_o).
      const float tile_max = quad_allreduce(row_ext[r], MaxOp{}) * ext_scale;
      const float m = tile_max > row_max[r] + kRescaleSlack ? tile_max : row_max[r];
      // A row with no visible key yet keeps m = -inf; subtract 0 instead so
      // that exp2(-inf - -inf) never makes a NaN.
      m_safe[r] = m == -INFINITY ? 0.f : m;
      correction[r] = m == row_max[r] ? 1.f : fast_exp2(row_max[r] - m_safe[r]);
      row_max[r] = m;
    }
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTE_UNROLL
      for (int c = 0; c < kCols; ++c) {
        s_rc(r, c) = fast_exp2(fmaf(s_rc(r, c), s_scale, -m_safe[r]));
      }
    }
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      row_sum[r] = row_sum[r] * correction[r] + row_reduce(s_rc, r, SumOp{});
    }
  }

  // Exponentiates the (masked) score tile against the running max as it
  // stands, without the tile's max: the row max reductions (a third of the
  // softmax's time per step, docs/cuda_kernels.md, Hopper forward: softmax) are skipped. This is what
  // fold_max computes whenever the tile does not raise any row's max by more
  // than kRescaleSlack (fold_max then keeps the max, too), i.e. when every
  // exponential is at most kRescaleBound. Leaves this thread's partial sum of
  // each row in tile_sum, and returns whether all of them are at most
  // kRescaleBound (false for NaN), which implies that bound for every term;
  // where that fails, the caller raises the maxima from these terms
  // (raise_max), or where they are past raisable's bound, computes the tile
  // again with fold_max. Needs a finite running max in every row
  // (has_finite_max).
  template <typename ScoresRowCol>
  __device__ __forceinline__ bool exp_stale(ScoresRowCol& s_rc, bool needs_mask,
                                            float (&tile_sum)[kRows]) const {
    const float s_scale = needs_mask && zero_scale ? 1.f : scale_log2;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTE_UNROLL
      for (int c = 0; c < kCols; ++c) {
        s_rc(r, c) = fast_exp2(fmaf(s_rc(r, c), s_scale, -row_max[r]));
      }
    }
    bool within = true;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      tile_sum[r] = row_reduce(s_rc, r, SumOp{});
      within &= tile_sum[r] <= kRescaleBound;
    }
    return within;
  }

  // The fixed-offset softmax of softcapped scores (jflash/score.h,
  // softcap_fixed_offset_fits): reset_fixed once per tile of rows, exp_fixed
  // per key tile. The row sums come from the tensor cores
  // (FwdMainloopFixedOffsetSm90), so exp_fixed leaves them alone.
  __device__ __forceinline__ void reset_fixed(float offset) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      row_max[r] = offset;
      row_sum[r] = 0.f;
    }
  }
  // The (capped, masked) tile's exponentials against the fixed offset, into
  // s_rc. Masked scores are -inf: P = 0.
  template <typename ScoresRowCol>
  __device__ __forceinline__ void exp_fixed(ScoresRowCol& s_rc) const {
    const float scale = scale_log2;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTE_UNROLL
      for (int c = 0; c < kCols; ++c) {
        s_rc(r, c) = fast_exp2(fmaf(s_rc(r, c), scale, -row_max[r]));
      }
    }
  }

  // Whether every row of the warp has a finite running max (exp_stale's
  // precondition).
  __device__ __forceinline__ bool has_finite_max() const {
    bool finite_max = true;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) finite_max &= row_max[r] != -INFINITY;
    return __all_sync(0xffffffff, finite_max);
  }

  // Takes exp_stale's tile as it is: the max stays, O needs no correction,
  // and (where add) the tile's sums join the running ones.
  __device__ __forceinline__ void keep_max(const float (&tile_sum)[kRows], bool add,
                                           float (&correction)[kRows]) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      if (add) row_sum[r] += tile_sum[r];
      correction[r] = 1.f;
    }
  }

  // Whether raise_max may take exp_stale's tile: every one of this thread's
  // tile sums is at most kRaiseBound (false for inf and NaN). raise_max scales
  // the terms by 1 / (largest term), which must stay a normal float: ex2.approx
  // and the multiplies flush subnormals to zero, so a max that rose by 126 to
  // 128 (log2 units; a term still finite) would zero the tile's terms, and the
  // row's sum and O with them (a row whose later tiles add nothing then gave
  // 0 / 0). A tile past the bound is computed again with fresh maxima.
  static constexpr float kRaiseBound = 0x1p64f;
  __device__ __forceinline__ static bool raisable(const float (&tile_sum)[kRows]) {
    bool ok = true;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) ok &= tile_sum[r] <= kRaiseBound;
    return ok;
  }

  // Where exp_stale's bound failed in some row of the warp and the terms are
  // in raise_max's range (raisable in all of the warp's threads): folds the
  // tile with raised maxima from the exponentials themselves, without S. A
  // finite term exp2(x - m) gives the tile's max as m + log2(largest term),
  // and the tile against a new max m' is each term times exp2(m - m'): what
  // fold_max would compute from S again, up to the rounding of that
  // multiply. Every row whose largest term exceeds 1 moves to the tile's max
  // (not only those past the slack: a tile whose sum, not its max, failed the
  // bound would otherwise fail again on the next tile of the same data).
  // Scales the terms in s_rc, adds this thread's scaled terms to its running
  // sums (after scaling those too), and leaves O's factors in correction.
  // Called by the whole warp (quad shuffles); the rare path, so written for
  // few registers (one serial max per row: head dim 64's 128 per thread leave
  // little).
  template <typename ScoresRowCol>
  __device__ __forceinline__ void raise_max(ScoresRowCol& s_rc, float (&correction)[kRows]) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float p_max = s_rc(r, 0);
      CUTE_UNROLL
      for (int c = 1; c < kCols; ++c) p_max = fmaxf(p_max, s_rc(r, c));
      p_max = quad_allreduce(p_max, MaxOp{});
      const bool raise = p_max > 1.f;
      const float m = raise ? row_max[r] + fast_log2(p_max) : row_max[r];
      correction[r] = raise ? fast_exp2(row_max[r] - m) : 1.f;
      row_max[r] = m;
      float sum = 0.f;
      CUTE_UNROLL
      for (int c = 0; c < kCols; ++c) {
        s_rc(r, c) *= correction[r];
        sum += s_rc(r, c);
      }
      row_sum[r] = row_sum[r] * correction[r] + sum;
    }
  }

  // Keeps the wgmma wait that follows below the softmax. Waiting earlier is
  // always legal, and ptxas schedules WARPGROUP.DEPBAR as early as it can: in
  // the main loop it put the wait for P_{i-1} V_{i-1} before the exponentials
  // (after the row max), so each softmax waited for its own warpgroup's P V
  // product and the intra-warpgroup overlap was lost. ptxas does not move the
  // wait above a branch, so a warp-uniform branch on the row sums (the last
  // values the softmax computes), never taken (the sums are >= 0 or NaN), pins
  // it there. Measured (H200, docs/cuda_kernels.md, Hopper forward: softmax): head dim 256 +4-10% at
  // seq 4k-16k, head dim 128 +0-6% at 16k, within noise at 4k.
  __device__ __forceinline__ void pin_below() const {
    bool negative = false;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) negative |= row_sum[r] < 0.f;
    if (__any_sync(0xffffffff, negative)) asm volatile("nanosleep.u32 0;");
  }

  // O *= correction, o_rc the (rows, cols) view of the output accumulator;
  // skipped when no row of the warp raised its max (exact: the correction is
  // then 1).
  template <typename OutRowCol>
  __device__ __forceinline__ static void rescale_o(OutRowCol& o_rc, const float (&correction)[kRows]) {
    bool changed = false;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) changed |= correction[r] != 1.f;
    if (__any_sync(0xffffffff, changed)) {
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        CUTE_UNROLL
        for (int c = 0; c < size<1>(o_rc); ++c) o_rc(r, c) *= correction[r];
      }
    }
  }

  // P = the exponentials of acc_s in Element, into tOrP, the A operand of the
  // P V product. tOrP and acc_s map each (row, col) to the same register
  // offset; write P through acc_s's layout so that the element order cannot
  // differ.
  template <typename AccS, typename FragP>
  __device__ __forceinline__ static void convert_p(const AccS& acc_s, FragP& tOrP) {
    using Element = typename FragP::value_type;
    Tensor p = convert_fragment<Element>(acc_s);
    Tensor dst = make_tensor(tOrP.data(), acc_s.layout());
    CUTE_UNROLL
    for (int i = 0; i < size(p); ++i) dst(i) = p(i);
  }
};

}  // namespace jflash::cuda::sm90

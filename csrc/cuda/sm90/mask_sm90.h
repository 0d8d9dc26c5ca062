// Masking of the Hopper forward's score tiles: the keys each query row sees
// (the band and the sequence end) and the per-element mask of the key tiles
// that cut them.
#pragma once

#include <cmath>
#include <cstdint>

#include <cute/tensor.hpp>

#include "jflash/params.h"

namespace jflash::cuda::sm90 {

using namespace cute;

// kRows x kCols: the score elements a consumer thread holds per key tile
// (the (rows, cols) view of its wgmma accumulator), of a tile of kBlockN keys.
template <int kBlockN, int kRows, int kCols, typename Mask>
struct ScoreMaskSm90 {
  const FwdParams& params;
  // Masking works on the raw scores, before the scale: a hidden score becomes
  // hidden_score, which the scale sends to -inf (scale > 0) or the min-reduction
  // skips (scale < 0), so masked and unmasked tiles share the one-FFMA
  // exponent of the softmax. A zero scale cannot send anything to -inf; its
  // masked tiles hold the scaled scores (0 * s: 0, or NaN for a NaN or inf
  // score; -inf where hidden) and take the exponent with scale 1. Under a
  // band only the warps with a row that the tile cuts mask
  // per element, with two instructions per score where the band's lower edge
  // is outside the tile. Measured against scaling and masking every score of a
  // cut tile (five instructions each; H200, head dim 64 causal): +13% at seq
  // 512, +9% at 1024, +8% at 2048 (docs/cuda_kernels.md, Hopper forward: softmax).
  const bool zero_scale;
  const float hidden_score;
  // Keys [key_lo, key_hi) each of this thread's rows sees (the band and the
  // sequence end). Rows past seqlen_q, never stored, are never cut (their
  // scores are finite, TMA fills their Q with zeros, unless k holds a NaN or
  // inf: then their sums are NaN, which only costs the stale-max redo).
  int key_lo[kRows];
  int key_hi[kRows];
  // Segment ids (Mask::kHasSegments; SegmentMask): the batch entry and the
  // tile's first row; per row whether [key_lo, key_hi) is exactly its keys
  // (its id's keys contiguous: the range test suffices, as for a band), and
  // whether it has seen a visible key in this thread's columns (the epilogue's
  // no-key test).
  int batch = 0;
  int row_begin = 0;
  bool row_exact[kRows];
  bool row_seen[kRows];

  __device__ __forceinline__ explicit ScoreMaskSm90(const FwdParams& params_)
      : params(params_),
        zero_scale(params_.softmax_scale_log2 == 0.f),
        hidden_score(params_.softmax_scale_log2 >= 0.f ? -INFINITY : INFINITY) {}

  // The key ranges of this thread's rows of the tile that starts at query row
  // row_begin; cS_rc: the (row, col) coordinates of its scores in the tile.
  template <typename CoordRowCol>
  __device__ __forceinline__ void set_rows(int row_begin_, int batch_, const CoordRowCol& cS_rc) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int row = row_begin_ + get<0>(cS_rc(r, 0));
      key_lo[r] = 0;
      key_hi[r] = params.seqlen_k;
      if (row >= params.seqlen_q) {
        key_hi[r] = params.seqlen_k + kBlockN;
      } else if constexpr (Mask::kHasSegments) {
        const auto range = Mask(params.mask, batch_).row_key_range(row, params.seqlen_k);
        key_lo[r] = static_cast<int>(range.keys.begin);
        key_hi[r] = static_cast<int>(range.keys.end);
        row_exact[r] = range.exact;
      } else if constexpr (!Mask::kDense) {
        const IndexRange keys = Mask(params.mask, batch_).row_keys(row, params.seqlen_k);
        key_lo[r] = static_cast<int>(keys.begin);
        key_hi[r] = static_cast<int>(keys.end);
      }
      if constexpr (Mask::kHasSegments) {
        batch = batch_;
        row_begin = row_begin_;
        if (row >= params.seqlen_q) row_exact[r] = true;  // never stored
        row_seen[r] = false;
      }
    }
  }

  // Hides the scores s_rc (kRows x kCols, raw) of key tile n_block that the
  // band or the sequence end cuts, in place; returns whether it touched any.
  template <typename ScoresRowCol, typename CoordRowCol>
  __device__ __forceinline__ bool mask_scores(int n_block, ScoresRowCol& s_rc,
                                              const CoordRowCol& cS_rc) {
    if constexpr (Mask::kHasSegments) {
      return mask_segment_scores(n_block, s_rc, cS_rc);
    }
    const int key0 = n_block * kBlockN;
    bool needs_mask = key0 + kBlockN > params.seqlen_k;  // all rows alike when dense
    if constexpr (!Mask::kDense) {
      bool cut = false;
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) cut |= key_lo[r] > key0 || key_hi[r] < key0 + kBlockN;
      needs_mask = __any_sync(0xffffffff, cut);
    }
    if (needs_mask) {
      // Column c of this thread is key key0 + col0 + dc(c), dc a constant.
      const int col0 = get<1>(cS_rc(0, 0));
      // A causal band never cuts a row's first keys: then one test per score.
      bool lo_cut = false;
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) lo_cut |= key_lo[r] > key0;
      lo_cut = __any_sync(0xffffffff, lo_cut);
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const int lo = key_lo[r] - key0 - col0;
        const int hi = key_hi[r] - key0 - col0;
        if (zero_scale) {
          // The scaled score 0 * s: 0, or NaN where s is NaN or inf.
          CUTE_UNROLL
          for (int c = 0; c < kCols; ++c) {
            const int dc = get<1>(cS_rc(r, c)) - col0;
            s_rc(r, c) = dc >= lo && dc < hi ? s_rc(r, c) * 0.f : -INFINITY;
          }
        } else if (lo_cut) {
          CUTE_UNROLL
          for (int c = 0; c < kCols; ++c) {
            const int dc = get<1>(cS_rc(r, c)) - col0;
            s_rc(r, c) = dc >= lo && dc < hi ? s_rc(r, c) : hidden_score;
          }
        } else {
          CUTE_UNROLL
          for (int c = 0; c < kCols; ++c) {
            const int dc = get<1>(cS_rc(r, c)) - col0;
            s_rc(r, c) = dc < hi ? s_rc(r, c) : hidden_score;
          }
        }
      }
    }
    return needs_mask;
  }

  // mask_scores under segment ids. [key_lo, key_hi) is the band cut to the keys
  // of the row's id: for documents stored contiguously exactly the keys the
  // row sees, so that where every row of the warp is exact, masking is the
  // band's range test and whether a row saw a key in the tile follows from its
  // range; a warp masks only the tiles that a range cuts (against the
  // per-element id path below for those tiles too: +3% to +7% on varlen
  // forwards; docs/cuda_kernels.md, Segment ids, "The range test"). A row
  // whose id's keys are not contiguous (rare) compares ids per element too, in
  // every tile of its range; the keys' ids are read one after the other (each
  // load's address waits for the last one), which keeps the score tile's
  // registers free of them (the block summaries' test for a tile of one id, or
  // the ids loaded together, spilled 160 to 420 bytes).
  template <typename ScoresRowCol, typename CoordRowCol>
  __device__ __forceinline__ bool mask_segment_scores(int n_block, ScoresRowCol& s_rc,
                                                      const CoordRowCol& cS_rc) {
    const int key0 = n_block * kBlockN;
    bool cut = false;
    bool inexact = false;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      cut |= key_lo[r] > key0 || key_hi[r] < key0 + kBlockN;
      inexact |= !row_exact[r];
    }
    if (!__any_sync(0xffffffff, inexact)) {
      if (!__any_sync(0xffffffff, cut)) {
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) row_seen[r] = true;
        return false;
      }
      // Column c of this thread is key key0 + col0 + dc(c), dc a constant.
      const int col0 = get<1>(cS_rc(0, 0));
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        // (An empty range is [end, end): not seen.)
        row_seen[r] |= key_lo[r] < key_hi[r] && key_lo[r] < key0 + kBlockN && key_hi[r] > key0;
        const int lo = key_lo[r] - key0 - col0;
        const int hi = key_hi[r] - key0 - col0;
        CUTE_UNROLL
        for (int c = 0; c < kCols; ++c) {
          const int dc = get<1>(cS_rc(r, c)) - col0;
          // A zero scale: the scaled score 0 * s, as in mask_scores.
          const float kept = zero_scale ? s_rc(r, c) * 0.f : s_rc(r, c);
          s_rc(r, c) = dc >= lo && dc < hi ? kept : (zero_scale ? -INFINITY : hidden_score);
        }
      }
      return true;
    }
    const Mask mask(params.mask, batch);
    int32_t row_id[kRows];
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int row = row_begin + get<0>(cS_rc(r, 0));
      row_id[r] = row_exact[r] ? 0 : mask.row_segment(row);
    }
    // Column c of this thread is key key0 + col0 + dc(c), dc a constant.
    const int col0 = get<1>(cS_rc(0, 0));
    bool seen[kRows];
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) seen[r] = false;
    int chain = 0;
    CUTE_UNROLL
    for (int c = 0; c < kCols; ++c) {
      const int dc = get<1>(cS_rc(0, c)) - col0;
      int key = key0 + col0 + dc;
      asm volatile("" : "+r"(key) : "r"(chain));
      const int32_t key_id = key < params.seqlen_k ? mask.key_segment(key) : 0;
      chain = key_id;
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const int lo = key_lo[r] - key0 - col0;
        const int hi = key_hi[r] - key0 - col0;
        const bool visible = dc >= lo && dc < hi && (row_exact[r] || row_id[r] == key_id);
        // A zero scale: the scaled score 0 * s, as in mask_scores.
        const float kept = zero_scale ? s_rc(r, c) * 0.f : s_rc(r, c);
        s_rc(r, c) = visible ? kept : (zero_scale ? -INFINITY : hidden_score);
        seen[r] |= visible;
      }
    }
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) row_seen[r] |= seen[r];
    return true;
  }
};

}  // namespace jflash::cuda::sm90

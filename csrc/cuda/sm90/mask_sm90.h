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
  // Segment ids (Mask::kHasSegments; SegmentMask): the batch entry, the ids of
  // this thread's rows, and whether each row has seen a visible key in this
  // thread's columns (row_keys is only a hull there: the epilogue's no-key
  // test reads these).
  int batch = 0;
  int32_t row_id[kRows];
  bool row_seen[kRows];

  __device__ __forceinline__ explicit ScoreMaskSm90(const FwdParams& params_)
      : params(params_),
        zero_scale(params_.softmax_scale_log2 == 0.f),
        hidden_score(params_.softmax_scale_log2 >= 0.f ? -INFINITY : INFINITY) {}

  // The key ranges of this thread's rows of the tile that starts at query row
  // row_begin; cS_rc: the (row, col) coordinates of its scores in the tile.
  template <typename CoordRowCol>
  __device__ __forceinline__ void set_rows(int row_begin, int batch_, const CoordRowCol& cS_rc) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int row = row_begin + get<0>(cS_rc(r, 0));
      key_lo[r] = 0;
      key_hi[r] = params.seqlen_k;
      if (row >= params.seqlen_q) {
        key_hi[r] = params.seqlen_k + kBlockN;
      } else if constexpr (!Mask::kDense) {
        const IndexRange keys = Mask(params.mask, batch_).row_keys(row, params.seqlen_k);
        key_lo[r] = static_cast<int>(keys.begin);
        key_hi[r] = static_cast<int>(keys.end);
      }
      if constexpr (Mask::kHasSegments) {
        batch = batch_;
        row_id[r] = row < params.seqlen_q ? Mask(params.mask, batch_).row_segment(row) : 0;
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

  // mask_scores under segment ids: a warp masks per element unless, for all its
  // rows, the band cuts nothing and every key of the tile holds the row's id.
  // A score is hidden outside the row's key range or where the ids differ.
  template <typename ScoresRowCol, typename CoordRowCol>
  __device__ __forceinline__ bool mask_segment_scores(int n_block, ScoresRowCol& s_rc,
                                                      const CoordRowCol& cS_rc) {
    const int key0 = n_block * kBlockN;
    const Mask mask(params.mask, batch);
    const auto keys = mask.key_ids(key0, key0 + kBlockN);
    bool cut = false;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      // Rows past seqlen_q (key_hi past seqlen_k, set_rows) are never stored.
      const bool one_id = (keys.min_id == keys.max_id && row_id[r] == keys.min_id) ||
                          key_hi[r] > params.seqlen_k;
      cut |= key_lo[r] > key0 || key_hi[r] < key0 + kBlockN || !one_id;
    }
    const bool needs_mask = __any_sync(0xffffffff, cut);
    if (!needs_mask) {
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) row_seen[r] = true;
      return false;
    }
    // Column c of this thread is key key0 + col0 + dc(c), dc a constant.
    const int col0 = get<1>(cS_rc(0, 0));
    int32_t key_id[kCols];
    CUTE_UNROLL
    for (int c = 0; c < kCols; ++c) {
      const int key = key0 + get<1>(cS_rc(0, c));
      key_id[c] = key < params.seqlen_k ? mask.key_segment(key) : 0;
    }
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int lo = key_lo[r] - key0 - col0;
      const int hi = key_hi[r] - key0 - col0;
      bool seen = false;
      CUTE_UNROLL
      for (int c = 0; c < kCols; ++c) {
        const int dc = get<1>(cS_rc(r, c)) - col0;
        const bool visible = dc >= lo && dc < hi && row_id[r] == key_id[c];
        // A zero scale: the scaled score 0 * s, as in mask_scores.
        const float kept = zero_scale ? s_rc(r, c) * 0.f : s_rc(r, c);
        s_rc(r, c) = visible ? kept : (zero_scale ? -INFINITY : hidden_score);
        seen |= visible;
      }
      row_seen[r] |= seen;
    }
    return true;
  }
};

}  // namespace jflash::cuda::sm90

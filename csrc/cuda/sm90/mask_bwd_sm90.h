// Masking in the Hopper backward's steps, where it is more than the band's
// per-element test (which the step applies itself): the rows each of a
// consumer thread's keys sees under segment ids.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "jflash/params.h"

namespace jflash::cuda::sm90 {

using namespace cute;

// The rows that see each of the thread's keys (kRows of them, at key0 plus
// the coordinates' rows): the band cut to the rows of the key's id, exact
// where those rows are contiguous; keys past seqlen_k: none. Returns whether
// some key of the warp's has rows that are not contiguous.
template <int kRows, typename Mask, typename CoordsRowCol>
__device__ __forceinline__ bool thread_key_rows(const Mask& mask, const BwdParams& params,
                                                const CoordsRowCol& cS_rc, int key0,
                                                int (&lo)[kRows], int (&hi)[kRows],
                                                bool (&exact)[kRows]) {
  bool inexact = false;
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const int key = key0 + get<0>(cS_rc(r, 0));
    const auto rows = key < params.seqlen_k ? mask.key_row_range(key, params.seqlen_q)
                                            : typename Mask::Range{{0, 0}, true};
    lo[r] = static_cast<int>(rows.keys.begin);
    hi[r] = static_cast<int>(rows.keys.end);
    exact[r] = rows.exact;
    inexact |= !rows.exact;
  }
  return __any_sync(0xffffffff, inexact);
}

// Segment ids (SegmentMask), for a step of the rows from row0 against the
// thread's keys: each key's rows (thread_key_rows: where exact, the range
// test is all) into seg_lo, seg_hi, and whether the warp
// masks this tile (the block summaries' tile class spilled at head dim 64).
// Where a key's rows are not contiguous (rare), the ids are compared too, into
// seg_same (bit r * kCols + c: the same id), the rows' ids read one after the
// other (each load's address waits for the last one) to keep registers free
// (loaded together, or compared after P, they spilled 290 to 380 bytes at head
// dim 64; this spills 190). Returns whether the warp masks the tile.
template <int kBlockM, int kCols, int kRows, typename Mask, typename CoordsRowCol,
          typename IdBits>
__device__ __forceinline__ bool segment_rows(const Mask& mask, const BwdParams& params,
                                             const CoordsRowCol& cS_rc, int key0, int row0,
                                             int (&seg_lo)[kRows], int (&seg_hi)[kRows],
                                             IdBits& seg_same) {
  bool seg_exact[kRows];
  const bool seg_inexact = thread_key_rows(mask, params, cS_rc, key0, seg_lo, seg_hi, seg_exact);
  bool seg_needs_mask = false;
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    seg_needs_mask |= !seg_exact[r] || seg_lo[r] > row0 || seg_hi[r] < row0 + kBlockM;
  }
  seg_needs_mask = __any_sync(0xffffffff, seg_needs_mask);
  if (seg_inexact) {
    int32_t key_id[kRows];
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int key = key0 + get<0>(cS_rc(r, 0));
      key_id[r] = seg_exact[r] || key >= params.seqlen_k ? 0 : mask.key_segment(key);
    }
    int chain = 0;
    CUTE_UNROLL
    for (int c = 0; c < kCols; ++c) {
      int row = row0 + get<1>(cS_rc(0, c));
      asm volatile("" : "+r"(row) : "r"(chain));
      chain = row < params.seqlen_q ? mask.row_segment(row) : 0;
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        if (!seg_exact[r] && chain != key_id[r]) seg_same &= ~(IdBits{1} << (r * kCols + c));
      }
    }
  }
  return seg_needs_mask;
}

// The same for a step whose mask is applied late (kLateMask in the main
// loop: after dS^T, where the 80-row step has registers for it and not
// before), on a step whose tile class is not full: P^T (s_rc) and dS^T
// (dp_rc) set to 0 where the row does not see the key. The keys' row ranges
// are read here (L1 hits) rather than kept through the step; where a key's
// rows are not contiguous the ids are compared, the rows' read one after
// the other as in segment_rows.
template <int kRows, int kCols, typename Mask, typename CoordsRowCol, typename Scores>
__device__ __forceinline__ void segment_hide_late(const Mask& mask, const BwdParams& params,
                                                  const CoordsRowCol& cS_rc, int key0, int row0,
                                                  Scores& s_rc, Scores& dp_rc) {
  int lo[kRows], hi[kRows];
  bool exact[kRows];
  const bool inexact = thread_key_rows(mask, params, cS_rc, key0, lo, hi, exact);
  int32_t key_id[kRows];
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const int key = key0 + get<0>(cS_rc(r, 0));
    key_id[r] = !inexact || exact[r] || key >= params.seqlen_k ? 0 : mask.key_segment(key);
  }
  int chain = 0;
  CUTE_UNROLL
  for (int c = 0; c < kCols; ++c) {
    int row = row0 + get<1>(cS_rc(0, c));
    if (inexact) {
      asm volatile("" : "+r"(row) : "r"(chain));
      chain = row < params.seqlen_q ? mask.row_segment(row) : 0;
    }
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const bool hidden = row < lo[r] || row >= hi[r] || (!exact[r] && chain != key_id[r]);
      if (hidden) s_rc(r, c) = dp_rc(r, c) = 0.f;
    }
  }
}

}  // namespace jflash::cuda::sm90

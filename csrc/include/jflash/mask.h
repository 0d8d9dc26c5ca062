// The attention mask as a policy: one band on the diagonal offset j - i.
//
// Key j is visible from query i iff  diag_lo <= j - i <= diag_hi.
//
//   no mask                    diag_lo = -seqlen_q, diag_hi = seqlen_k
//   causal, bottom-right       diag_hi = seqlen_k - seqlen_q   (FlashAttention >= 2.1)
//   causal, top-left           diag_hi = 0                     (jax.nn.dot_product_attention)
//   sliding window (l, r)      diag_lo = off - l, diag_hi = off + r
//
// The Python layer clamps both bounds to [-seqlen_q, seqlen_k], so no sentinel
// values exist and i + diag_hi never overflows. A row whose band holds no key
// of [0, seqlen_k) is fully masked: the kernels write out = 0, lse = -inf, and
// zero gradients for it.
//
// Kernels ask the policy three questions, never the raw bounds: which key range a
// block of query rows needs (trip counts), whether a (query block, key block)
// tile needs per-element masking at all, and whether one element is visible. A
// new mask (segments, lengths) is a new policy with the same three answers.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define JFLASH_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define JFLASH_HOST_DEVICE inline
#endif

namespace jflash {

struct BandMask {
  int64_t diag_lo;
  int64_t diag_hi;

  // True when the band removes nothing for a seqlen_q x seqlen_k problem, so a
  // kernel may take its unmasked path (sequence-end residual masking still applies).
  JFLASH_HOST_DEVICE bool is_full(int64_t seqlen_q, int64_t seqlen_k) const {
    return diag_lo <= -(seqlen_q - 1) && diag_hi >= seqlen_k - 1;
  }

  JFLASH_HOST_DEVICE bool visible(int64_t i, int64_t j) const {
    const int64_t d = j - i;
    return d >= diag_lo && d <= diag_hi;
  }

  // Keys [key_begin, key_end) that query rows [row_begin, row_end) can see,
  // clipped to [0, seqlen_k). Empty (key_begin >= key_end) when none.
  JFLASH_HOST_DEVICE int64_t key_begin(int64_t row_begin) const {
    const int64_t b = row_begin + diag_lo;
    return b < 0 ? 0 : b;
  }
  JFLASH_HOST_DEVICE int64_t key_end(int64_t row_end, int64_t seqlen_k) const {
    const int64_t e = (row_end - 1) + diag_hi + 1;
    return e > seqlen_k ? seqlen_k : e;
  }

  // Query rows [row_begin, row_end) that keys [key_begin, key_end) are seen by,
  // clipped to [0, seqlen_q) (the backward pass iterates this way round).
  JFLASH_HOST_DEVICE int64_t row_begin(int64_t key_begin) const {
    const int64_t b = key_begin - diag_hi;
    return b < 0 ? 0 : b;
  }
  JFLASH_HOST_DEVICE int64_t row_end(int64_t key_end, int64_t seqlen_q) const {
    const int64_t e = (key_end - 1) - diag_lo + 1;
    return e > seqlen_q ? seqlen_q : e;
  }

  // True when every (i, j) of the tile rows [r0, r1) x keys [c0, c1) is inside
  // the band, so the tile needs no per-element masking (residual masking aside).
  JFLASH_HOST_DEVICE bool tile_all_visible(int64_t r0, int64_t r1, int64_t c0,
                                           int64_t c1) const {
    // Smallest j - i is c0 - (r1 - 1), largest is (c1 - 1) - r0.
    return c0 - (r1 - 1) >= diag_lo && (c1 - 1) - r0 <= diag_hi;
  }
};

}  // namespace jflash


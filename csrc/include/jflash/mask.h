// The attention mask as a policy type: which keys each query row sees.
//
// Every kernel (sm80, Hopper, the CPU twin) is a template on one policy and
// asks it the same questions, never the mask's raw parameters:
//
//   row_keys(i)              the keys row i sees, [begin, end)
//   key_rows(j)              the rows that see key j (the transposed tiles)
//   keys_of_rows(r0, r1)     the keys a block of rows needs: trip counts
//   rows_of_keys(c0, c1)     the rows a block of keys needs: the backward's trip counts
//   tile_class(r0, r1, c0, c1)  empty, full (no per-element masking) or partial
//   visible(i, j)            the per-element test of a partial tile
//   element_test<Index>()    the same test as a value, for loops
//
// A range is empty when begin >= end. Block ranges are clipped on the side
// they can overrun (begin >= 0, end <= seqlen), which is all a trip count
// needs; a single row's or key's range lies in [0, seqlen] at both ends, so
// that it compares with positions directly. The mask ignores the sequence
// ends themselves: the kernels mask keys past seqlen_k in a residual tile, and
// tile classes and visible() say nothing about them.
//
// Policies (a new one adds a MaskKind, a policy type and the kernels'
// instantiations; its runtime data goes into MaskParams):
//   NoMask     every row sees every key; the kernels compile all masking out.
//   BandMask   key j visible from query i iff diag_lo <= j - i <= diag_hi.
//
//     no mask                  diag_lo = -seqlen_q, diag_hi = seqlen_k
//     causal, bottom-right     diag_hi = seqlen_k - seqlen_q   (FlashAttention >= 2.1)
//     causal, top-left         diag_hi = 0                     (jax.nn.dot_product_attention)
//     sliding window (l, r)    diag_lo = off - l, diag_hi = off + r   (off = seqlen_k - seqlen_q)
//
// The Python layer (jflash/_src/masks.py) builds the band and the FFI layer
// clamps both bounds to [-seqlen_q, seqlen_k] again, so no sentinel values
// exist, i + diag_hi never overflows int64 and j - i is compared exactly in
// int. A row that sees no key of [0, seqlen_k) is fully masked: the kernels
// write out = 0, lse = -inf, and zero gradients for it.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define JFLASH_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define JFLASH_HOST_DEVICE inline
#endif

namespace jflash {

// The dispatch key of the kernel registry and the handlers; one instantiation
// of each kernel per kind.
enum class MaskKind : int { kNone = 0, kBand = 1 };
inline constexpr int kNumMaskKinds = 2;

inline const char* MaskKindName(MaskKind kind) {
  return kind == MaskKind::kBand ? "banded" : "unmasked";
}

// What a (rows x keys) tile needs: nothing (no visible element: skip it), no
// per-element masking (every element visible), or per-element masking.
enum class TileClass : int { kEmpty, kPartial, kFull };

// [begin, end); empty when begin >= end.
struct IndexRange {
  int64_t begin;
  int64_t end;
};

// The blocks of kBlock indices that cover a range of int32 indices: blocks
// [first, first + count); count 0 for an empty range. (A band's row or key
// range becomes the kernels' trip counts through it.)
struct BlockSpan {
  int first;
  int count;
};
template <int kBlock>
JFLASH_HOST_DEVICE BlockSpan blocks_covering(IndexRange range) {
  const int begin = static_cast<int>(range.begin);
  const int end = static_cast<int>(range.end);
  const int first = begin / kBlock;
  return {first, begin < end ? (end + kBlock - 1) / kBlock - first : 0};
}

// The mask's runtime data in the params structs; kernels read it only through
// a policy.
struct MaskParams {
  int64_t diag_lo;
  int64_t diag_hi;

  // The policy the handlers dispatch to for a seqlen_q x seqlen_k problem: the
  // cheapest one with the same answers, so a band that removes nothing runs the
  // unmasked kernels.
  MaskKind kind(int64_t seqlen_q, int64_t seqlen_k) const {
    const bool full = diag_lo <= -(seqlen_q - 1) && diag_hi >= seqlen_k - 1;
    return full ? MaskKind::kNone : MaskKind::kBand;
  }
};

// Policies are cheap views of MaskParams, built where a kernel needs them.
//
// kDense: every tile is full, so a kernel may drop its masking code at compile
// time (the per-row and per-warp bookkeeping included), not only at run time.
// kEmptyTilesInRange: whether keys_of_rows / rows_of_keys may contain tiles of
// class kEmpty. Neither current policy's ranges do (a band's rows see one
// contiguous hull of keys), and the kernels static_assert it: a policy that
// sets it (segments with gaps) needs each kernel to skip those tiles first.

struct NoMask {
  static constexpr MaskKind kKind = MaskKind::kNone;
  static constexpr bool kDense = true;
  static constexpr bool kEmptyTilesInRange = false;

  JFLASH_HOST_DEVICE explicit NoMask(const MaskParams&) {}

  JFLASH_HOST_DEVICE IndexRange row_keys(int64_t, int64_t seqlen_k) const { return {0, seqlen_k}; }
  JFLASH_HOST_DEVICE IndexRange key_rows(int64_t, int64_t seqlen_q) const { return {0, seqlen_q}; }
  JFLASH_HOST_DEVICE IndexRange keys_of_rows(int64_t, int64_t, int64_t seqlen_k) const {
    return {0, seqlen_k};
  }
  JFLASH_HOST_DEVICE IndexRange rows_of_keys(int64_t, int64_t, int64_t seqlen_q) const {
    return {0, seqlen_q};
  }
  JFLASH_HOST_DEVICE TileClass tile_class(int64_t, int64_t, int64_t, int64_t) const {
    return TileClass::kFull;
  }
  template <typename Index>
  struct ElementTest {
    JFLASH_HOST_DEVICE bool operator()(Index, Index) const { return true; }
  };
  template <typename Index>
  JFLASH_HOST_DEVICE ElementTest<Index> element_test() const {
    return {};
  }
  template <typename Index>
  JFLASH_HOST_DEVICE bool visible(Index, Index) const {
    return true;
  }
};

class BandMask {
 public:
  static constexpr MaskKind kKind = MaskKind::kBand;
  static constexpr bool kDense = false;
  static constexpr bool kEmptyTilesInRange = false;

  // A reference, not a copy: on the GPU each answer reads the bounds from the
  // kernel's parameter space where it is computed (a copy would hold them in
  // registers for the kernel's life); element_test() is the copy for loops.
  JFLASH_HOST_DEVICE explicit BandMask(const MaskParams& params) : p_(params) {}

  // Keys seen by rows [r0, r1) (r0 < r1): the band is a diagonal strip, so
  // the hull runs from the first row's lowest key to the last row's highest.
  JFLASH_HOST_DEVICE IndexRange keys_of_rows(int64_t r0, int64_t r1, int64_t seqlen_k) const {
    return {at_least_0(r0 + p_.diag_lo), at_most((r1 - 1) + p_.diag_hi + 1, seqlen_k)};
  }
  // Rows that see keys [c0, c1) (c0 < c1).
  JFLASH_HOST_DEVICE IndexRange rows_of_keys(int64_t c0, int64_t c1, int64_t seqlen_q) const {
    return {at_least_0(c0 - p_.diag_hi), at_most((c1 - 1) - p_.diag_lo + 1, seqlen_q)};
  }
  // Both ends within [0, seqlen]: a row's interval is compared with key
  // positions directly, with no range test of its own.
  JFLASH_HOST_DEVICE IndexRange row_keys(int64_t i, int64_t seqlen_k) const {
    return {at_most(at_least_0(i + p_.diag_lo), seqlen_k),
            at_least_0(at_most(i + p_.diag_hi + 1, seqlen_k))};
  }
  JFLASH_HOST_DEVICE IndexRange key_rows(int64_t j, int64_t seqlen_q) const {
    return {at_most(at_least_0(j - p_.diag_hi), seqlen_q),
            at_least_0(at_most(j - p_.diag_lo + 1, seqlen_q))};
  }

  // Rows [r0, r1) x keys [c0, c1): j - i runs from c0 - (r1 - 1) to (c1 - 1) - r0.
  JFLASH_HOST_DEVICE TileClass tile_class(int64_t r0, int64_t r1, int64_t c0, int64_t c1) const {
    const int64_t d_min = c0 - (r1 - 1);
    const int64_t d_max = (c1 - 1) - r0;
    if (d_min >= p_.diag_lo && d_max <= p_.diag_hi) return TileClass::kFull;
    if (d_max < p_.diag_lo || d_min > p_.diag_hi) return TileClass::kEmpty;
    return TileClass::kPartial;
  }

  // The per-element test with the bounds read once, as Index: built before a
  // loop whose barriers and fences would make the compiler reload the bounds
  // per tile (the Hopper backward). int is exact (|j - i| < 2^31 and the
  // bounds are clamped to [-seqlen_q, seqlen_k]) and keeps the test to 32-bit
  // instructions; int64_t is exact as well.
  template <typename Index>
  struct ElementTest {
    Index diag_lo, diag_hi;
    JFLASH_HOST_DEVICE bool operator()(Index i, Index j) const {
      const Index d = j - i;
      return d >= diag_lo && d <= diag_hi;
    }
  };
  template <typename Index>
  JFLASH_HOST_DEVICE ElementTest<Index> element_test() const {
    return {static_cast<Index>(p_.diag_lo), static_cast<Index>(p_.diag_hi)};
  }
  template <typename Index>
  JFLASH_HOST_DEVICE bool visible(Index i, Index j) const {
    return element_test<Index>()(i, j);
  }

 private:
  JFLASH_HOST_DEVICE static int64_t at_least_0(int64_t x) { return x < 0 ? 0 : x; }
  JFLASH_HOST_DEVICE static int64_t at_most(int64_t x, int64_t n) { return x > n ? n : x; }

  const MaskParams& p_;
};

}  // namespace jflash

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
//   in_band(i, j)            its band part (all of it but for segment ids)
//   element_test<Index>()    the band part as a value, for loops
//   row_segment(i), key_segment(j)  the segment ids (kHasSegments): visible(i, j)
//                            is in_band(i, j) && row_segment(i) == key_segment(j)
//   band()                   the policy's band alone (a BandMask, or NoMask)
//
// SegmentMask answers two more: row_key_range(i) and key_row_range(j)
// (row_keys, key_rows and whether they are exact).
//
// A range is empty when begin >= end. Block ranges are clipped on the side
// they can overrun (begin >= 0, end <= seqlen), which is all a trip count
// needs; a single row's or key's range lies in [0, seqlen] at both ends, so
// that it compares with positions directly. The mask ignores the sequence
// ends themselves: the kernels mask keys past seqlen_k in a residual tile, and
// tile classes and visible() say nothing about them.
//
// A policy is built per batch entry (its constructor takes the batch index;
// only SegmentMask reads it).
//
// Policies (a new one adds a MaskKind, a policy type and the kernels'
// instantiations; its runtime data goes into MaskParams):
//   NoMask       every row sees every key; the kernels compile all masking out.
//   BandMask     key j visible from query i iff diag_lo <= j - i <= diag_hi.
//   SegmentMask  a band (possibly unbounded) and segment ids: key j visible
//                from query i iff the band lets it through and q_ids[i] ==
//                kv_ids[j] (packed documents). Below, with its summaries.
//
// The band:
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
#include <limits>

#if defined(__CUDACC__)
#define JFLASH_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define JFLASH_HOST_DEVICE inline
#endif

namespace jflash {

// The dispatch key of the kernel registry and the handlers; one instantiation
// of each kernel per kind.
enum class MaskKind : int { kNone = 0, kBand = 1, kSegments = 2 };
inline constexpr int kNumMaskKinds = 3;

inline const char* MaskKindName(MaskKind kind) {
  switch (kind) {
    case MaskKind::kBand: return "banded";
    case MaskKind::kSegments: return "segment-masked";
    default: return "unmasked";
  }
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

// Segment ids are summarized per kSegmentBlock consecutive rows (keys) of a
// batch entry, once per call before the kernels (jflash/_src/masks.py,
// segment_blocks). The kernels classify tiles from these summaries: a block
// size that divides every kernel's block sizes (cuda/tile_sizes.h asserts it)
// makes the tiles' summaries exact unions of whole blocks. The CPU twin's
// tiles need not align (a tile is then judged by the blocks that cover it: a
// superset, which can only make a tile partial instead of full or empty).
inline constexpr int kSegmentBlock = 32;

constexpr int64_t segment_blocks(int64_t seqlen) {
  return (seqlen + kSegmentBlock - 1) / kSegmentBlock;
}

// One block's summary: the range of its ids, and the hull [begin, end) of the
// other side's positions (keys for a block of rows, rows for a block of keys)
// whose id is one of the block's (begin >= end: none has). The hull is exact
// where each id's positions are contiguous (documents packed one after the
// other, in any order of ids); otherwise it spans the gaps.
struct alignas(16) SegmentBlock {
  int32_t min_id;
  int32_t max_id;
  int32_t begin;
  int32_t end;
};

struct SegmentParams {
  const int32_t* q_ids = nullptr;  // [batch, seqlen_q]; null: no segment ids
  const int32_t* kv_ids = nullptr;  // [batch, seqlen_k]
  const SegmentBlock* q_blocks = nullptr;  // [batch, segment_blocks(seqlen_q)]
  const SegmentBlock* kv_blocks = nullptr;  // [batch, segment_blocks(seqlen_k)]
  // [batch, seqlen_q, 2] and [batch, seqlen_k, 2]: per query row the keys
  // [begin, end) that hold its id, per key the rows; begin stored as -1 - begin
  // where those are not contiguous (then only their hull); [0, 0) where none
  // holds it (segment_ranges in masks.py).
  const int32_t* q_ranges = nullptr;
  const int32_t* kv_ranges = nullptr;
  int seqlen_q = 0;  // the ids' batch strides, and the ends a SegmentMask clips to
  int seqlen_k = 0;

  // The same data from batch entry `batches` on (the launchers' grid chunks).
  SegmentParams from_batch(int64_t batches) const {
    SegmentParams p = *this;
    if (q_ids != nullptr) {
      p.q_ids += batches * seqlen_q;
      p.kv_ids += batches * seqlen_k;
      p.q_blocks += batches * segment_blocks(seqlen_q);
      p.kv_blocks += batches * segment_blocks(seqlen_k);
      p.q_ranges += batches * seqlen_q * 2;
      p.kv_ranges += batches * seqlen_k * 2;
    }
    return p;
  }
};

// The mask's runtime data in the params structs; kernels read it only through
// a policy.
struct MaskParams {
  int64_t diag_lo;
  int64_t diag_hi;
  SegmentParams segments;

  // The policy the handlers dispatch to for a seqlen_q x seqlen_k problem: the
  // cheapest one with the same answers, so a band that removes nothing runs the
  // unmasked kernels. Segment ids always run SegmentMask (its band may be
  // unbounded).
  MaskKind kind(int64_t seqlen_q, int64_t seqlen_k) const {
    if (segments.q_ids != nullptr) return MaskKind::kSegments;
    const bool full = diag_lo <= -(seqlen_q - 1) && diag_hi >= seqlen_k - 1;
    return full ? MaskKind::kNone : MaskKind::kBand;
  }
};

// The band of causal and a (left, right) window aligned bottom-right, for
// lengths known only when a kernel runs (decode: each sequence's cache
// length): query i sees key j iff i + off - left <= j <= i + off + right,
// off = seqlen_k - seqlen_q, -1 leaving a side unbounded (causal is right =
// 0). The rule of jflash/_src/masks.py's window_band, clamped as the FFI layer
// clamps every band.
JFLASH_HOST_DEVICE MaskParams bottom_right_band(int64_t seqlen_q, int64_t seqlen_k, int64_t left,
                                                int64_t right) {
  const int64_t offset = seqlen_k - seqlen_q;
  int64_t lo = left >= 0 ? offset - left : -seqlen_q;
  int64_t hi = right >= 0 ? offset + right : seqlen_k;
  lo = lo < -seqlen_q ? -seqlen_q : (lo > seqlen_k ? seqlen_k : lo);
  hi = hi < -seqlen_q ? -seqlen_q : (hi > seqlen_k ? seqlen_k : hi);
  MaskParams band;
  band.diag_lo = lo;
  band.diag_hi = hi;
  return band;
}

// Policies are cheap views of MaskParams, built where a kernel needs them.
//
// kDense: every tile is full, so a kernel may drop its masking code at compile
// time (the per-row and per-warp bookkeeping included), not only at run time.
// kEmptyTilesInRange: whether keys_of_rows / rows_of_keys may contain tiles of
// class kEmpty. A band's may not (its rows see one contiguous hull of keys);
// SegmentMask's may (ids that are not contiguous, or documents in another
// order on the two sides). The kernels compute such tiles fully masked, or
// skip them where that costs nothing (the CPU twin).
// kHasSegments: visible(i, j) also compares segment ids, which the kernels
// load once per partial tile (row_segment, key_segment); row_keys and
// key_rows are then hulls rather than exact ranges, so that whether a row sees
// any key at all is tracked by the kernels (no other policy needs that).

struct NoMask {
  static constexpr MaskKind kKind = MaskKind::kNone;
  static constexpr bool kDense = true;
  static constexpr bool kEmptyTilesInRange = false;
  static constexpr bool kHasSegments = false;

  JFLASH_HOST_DEVICE NoMask(const MaskParams&, int /*batch*/) {}
  JFLASH_HOST_DEVICE NoMask band() const { return *this; }

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
  template <typename Index>
  JFLASH_HOST_DEVICE bool in_band(Index, Index) const {
    return true;
  }
  JFLASH_HOST_DEVICE int32_t row_segment(int64_t) const { return 0; }
  JFLASH_HOST_DEVICE int32_t key_segment(int64_t) const { return 0; }
};

class BandMask {
 public:
  static constexpr MaskKind kKind = MaskKind::kBand;
  static constexpr bool kDense = false;
  static constexpr bool kEmptyTilesInRange = false;
  static constexpr bool kHasSegments = false;

  // A reference, not a copy: on the GPU each answer reads the bounds from the
  // kernel's parameter space where it is computed (a copy would hold them in
  // registers for the kernel's life); element_test() is the copy for loops.
  JFLASH_HOST_DEVICE BandMask(const MaskParams& params, int /*batch*/) : p_(params) {}
  JFLASH_HOST_DEVICE BandMask band() const { return *this; }

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
  template <typename Index>
  JFLASH_HOST_DEVICE bool in_band(Index i, Index j) const {
    return visible(i, j);
  }
  JFLASH_HOST_DEVICE int32_t row_segment(int64_t) const { return 0; }
  JFLASH_HOST_DEVICE int32_t key_segment(int64_t) const { return 0; }

 private:
  JFLASH_HOST_DEVICE static int64_t at_least_0(int64_t x) { return x < 0 ? 0 : x; }
  JFLASH_HOST_DEVICE static int64_t at_most(int64_t x, int64_t n) { return x > n ? n : x; }

  const MaskParams& p_;
};

// Segment ids and a band: key j visible from query i iff the band lets it
// through and q_ids[i] == kv_ids[j]. The block questions combine the band's
// answer with the summaries of the blocks of kSegmentBlock rows (keys) that
// cover the range, read from memory where they are asked (a few 16-byte loads
// per tile), so that the key range of a block of rows shrinks to its
// documents' keys and tiles between documents are empty, while tiles inside
// one document (one id on both sides) are full: a packed row of short
// documents costs about what the documents cost one by one.
//
// row_keys (key_rows) is the band's range cut to the keys (rows) that hold the
// row's (key's) id: exactly the keys the row sees where those are contiguous
// (row_key_range, key_row_range say so), a hull otherwise. Rows and keys past the sequence ends
// (SegmentParams::seqlen_q, seqlen_k) are never visible: visible() tests
// them first and reads no id there, and the block questions clip to them.
class SegmentMask {
 public:
  static constexpr MaskKind kKind = MaskKind::kSegments;
  static constexpr bool kDense = false;
  static constexpr bool kEmptyTilesInRange = true;
  static constexpr bool kHasSegments = true;

  JFLASH_HOST_DEVICE SegmentMask(const MaskParams& params, int batch)
      : band_(params, batch), s_(params.segments), batch_(batch) {}
  JFLASH_HOST_DEVICE BandMask band() const { return band_; }

  JFLASH_HOST_DEVICE IndexRange keys_of_rows(int64_t r0, int64_t r1, int64_t seqlen_k) const {
    return cut(band_.keys_of_rows(r0, r1, seqlen_k), rows_summary(r0, r1));
  }
  JFLASH_HOST_DEVICE IndexRange rows_of_keys(int64_t c0, int64_t c1, int64_t seqlen_q) const {
    return cut(band_.rows_of_keys(c0, c1, seqlen_q), keys_summary(c0, c1));
  }
  JFLASH_HOST_DEVICE IndexRange row_keys(int64_t i, int64_t seqlen_k) const {
    return row_key_range(i, seqlen_k).keys;
  }
  // row_keys (key_rows), and whether it holds exactly the keys that row i <
  // seqlen_q sees (the rows that see key j < seqlen_k): then no per-element
  // test is needed for them.
  struct Range {
    IndexRange keys;  // the keys of a row, or the rows of a key
    bool exact;
  };
  JFLASH_HOST_DEVICE Range row_key_range(int64_t i, int64_t seqlen_k) const {
    return cut_to_ids(band_.row_keys(i, seqlen_k),
                      s_.q_ranges + (int64_t{batch_} * s_.seqlen_q + i) * 2);
  }
  JFLASH_HOST_DEVICE Range key_row_range(int64_t j, int64_t seqlen_q) const {
    return cut_to_ids(band_.key_rows(j, seqlen_q),
                      s_.kv_ranges + (int64_t{batch_} * s_.seqlen_k + j) * 2);
  }
  JFLASH_HOST_DEVICE IndexRange key_rows(int64_t j, int64_t seqlen_q) const {
    return key_row_range(j, seqlen_q).keys;
  }

  // Empty: the band's tile is, or no row's id can equal a key's (disjoint id
  // ranges, or the keys outside the rows' hull or the rows outside the keys').
  // Full: the band's tile is, and every row and key holds one and the same id.
  JFLASH_HOST_DEVICE TileClass tile_class(int64_t r0, int64_t r1, int64_t c0, int64_t c1) const {
    const TileClass band = band_.tile_class(r0, r1, c0, c1);
    if (band == TileClass::kEmpty) return TileClass::kEmpty;
    r1 = r1 < s_.seqlen_q ? r1 : s_.seqlen_q;
    c1 = c1 < s_.seqlen_k ? c1 : s_.seqlen_k;
    const SegmentBlock q = rows_summary(r0, r1);
    const SegmentBlock k = keys_summary(c0, c1);
    if (q.max_id < k.min_id || k.max_id < q.min_id || q.end <= c0 || q.begin >= c1 ||
        k.end <= r0 || k.begin >= r1) {
      return TileClass::kEmpty;
    }
    const bool one_id = q.min_id == q.max_id && k.min_id == k.max_id && q.min_id == k.min_id;
    return band == TileClass::kFull && one_id ? TileClass::kFull : TileClass::kPartial;
  }

  template <typename Index>
  using ElementTest = BandMask::ElementTest<Index>;
  // The band part (the ids are compared where they were loaded).
  template <typename Index>
  JFLASH_HOST_DEVICE ElementTest<Index> element_test() const {
    return band_.element_test<Index>();
  }
  template <typename Index>
  JFLASH_HOST_DEVICE bool in_band(Index i, Index j) const {
    return band_.visible(i, j);
  }
  template <typename Index>
  JFLASH_HOST_DEVICE bool visible(Index i, Index j) const {
    return i < s_.seqlen_q && j < s_.seqlen_k && band_.visible(i, j) &&
           row_segment(i) == key_segment(j);
  }

  // The ids of row i < seqlen_q and key j < seqlen_k.
  JFLASH_HOST_DEVICE int32_t row_segment(int64_t i) const {
    return load(s_.q_ids + int64_t{batch_} * s_.seqlen_q + i);
  }
  JFLASH_HOST_DEVICE int32_t key_segment(int64_t j) const {
    return load(s_.kv_ids + int64_t{batch_} * s_.seqlen_k + j);
  }

 private:
  JFLASH_HOST_DEVICE static int32_t load(const int32_t* p) {
#if defined(__CUDA_ARCH__)
    return __ldg(p);
#else
    return *p;
#endif
  }
  JFLASH_HOST_DEVICE static SegmentBlock load(const SegmentBlock* p) {
#if defined(__CUDA_ARCH__)
    const int4 v = __ldg(reinterpret_cast<const int4*>(p));
    return {v.x, v.y, v.z, v.w};
#else
    return *p;
#endif
  }

  // The union of the summaries of the blocks that cover positions [p0, p1)
  // (clipped to length); none: an empty range of ids and an empty hull.
  JFLASH_HOST_DEVICE static SegmentBlock summary(const SegmentBlock* blocks, int64_t length,
                                                 int64_t p0, int64_t p1) {
    SegmentBlock u{std::numeric_limits<int32_t>::max(), std::numeric_limits<int32_t>::min(),
                   std::numeric_limits<int32_t>::max(), 0};
    p0 = p0 < 0 ? 0 : p0;
    p1 = p1 < length ? p1 : length;
    if (p0 >= p1) return u;
    const int last = static_cast<int>((p1 - 1) / kSegmentBlock);
    for (int b = static_cast<int>(p0 / kSegmentBlock); b <= last; ++b) {
      const SegmentBlock x = load(blocks + b);
      u.min_id = x.min_id < u.min_id ? x.min_id : u.min_id;
      u.max_id = x.max_id > u.max_id ? x.max_id : u.max_id;
      if (x.begin < x.end) {
        u.begin = x.begin < u.begin ? x.begin : u.begin;
        u.end = x.end > u.end ? x.end : u.end;
      }
    }
    return u;
  }
  JFLASH_HOST_DEVICE SegmentBlock rows_summary(int64_t r0, int64_t r1) const {
    return summary(s_.q_blocks + int64_t{batch_} * segment_blocks(s_.seqlen_q), s_.seqlen_q, r0, r1);
  }
  JFLASH_HOST_DEVICE SegmentBlock keys_summary(int64_t c0, int64_t c1) const {
    return summary(s_.kv_blocks + int64_t{batch_} * segment_blocks(s_.seqlen_k), s_.seqlen_k, c0, c1);
  }
  // A row's (key's) band range cut to its ids' range, stored at ids as in
  // SegmentParams::q_ranges.
  JFLASH_HOST_DEVICE static Range cut_to_ids(IndexRange band, const int32_t* ids) {
    const int32_t begin = load(ids);
    const SegmentBlock hull{0, 0, begin < 0 ? -1 - begin : begin, load(ids + 1)};
    return {cut(band, hull), begin >= 0};
  }
  // A range cut to a summary's hull; an empty result is {end, end}, so that
  // its ends stay where the range's end was bounded (row_keys: in [0, seqlen]).
  JFLASH_HOST_DEVICE static IndexRange cut(IndexRange range, const SegmentBlock& hull) {
    const int64_t begin = range.begin > hull.begin ? range.begin : hull.begin;
    const int64_t end = range.end < hull.end ? range.end : int64_t{hull.end};
    return {begin < end ? begin : end, end};
  }

  BandMask band_;
  const SegmentParams& s_;
  int batch_;
};

}  // namespace jflash

// Register-level helpers shared by the forward and backward kernels: MMA loops
// over shared-memory operands, accumulator layout views, quad reductions and
// predicated tile loads.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

#include "jflash/mask.h"  // IndexRange

namespace jflash::cuda {

using namespace cute;

// float32 operands on the tensor cores (the float32 kernels). TF32 keeps
// float32's 8 exponent bits and 10 of its 23 mantissa bits, and the MMA reads
// only those bits of each 32-bit register: cvt.rna rounds to the nearest TF32
// value first, which halves the error of the MMA's truncation.
__device__ __forceinline__ float round_to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return __uint_as_float(r);
}

// Rounds a register fragment of 32-bit elements to TF32 in place.
template <typename Fragment>
__device__ __forceinline__ void round_fragment_to_tf32(Fragment&& frag) {
  CUTE_UNROLL
  for (int i = 0; i < size(frag); ++i) {
    float& x = reinterpret_cast<float&>(frag(i));
    x = round_to_tf32(x);
  }
}

// Splits a register fragment of 32-bit elements into TF32 high parts (in
// place) and low parts (lo): x = hi + lo + r with |r| about 2^-23 |x|. The
// low part is x - hi rounded to TF32 by the integer add and mask that cvt.rna
// itself compiles to, without cvt.rna's guard for Inf and NaN: where x is
// infinite or NaN, x - hi is the canonical NaN 0x7fffffff, and the add carries
// it to -0, so an Inf's low part is zero, not NaN (a NaN stays NaN through
// hi). An Inf still makes a NaN where the other operand's low part is zero
// (hi(Inf) * 0 in a cross term), as before this form. Two instructions
// instead of cvt.rna's four plus a NaN select: the split is most of 3xTF32's
// instruction count.
template <typename Fragment, typename FragmentLo>
__device__ __forceinline__ void split_fragment_tf32(Fragment&& frag, FragmentLo& lo) {
  CUTE_UNROLL
  for (int i = 0; i < size(frag); ++i) {
    float& x = reinterpret_cast<float&>(frag(i));
    const float hi = round_to_tf32(x);
    const uint32_t rest = __float_as_uint(x - hi);
    reinterpret_cast<float&>(lo(i)) = __uint_as_float((rest + 0x1000u) & 0xffffe000u);
    x = hi;
  }
}

// acc += A B^T for one k-slice of register fragments. 16-bit elements: one
// MMA. 32-bit elements (m16n8k8 TF32): kPasses 1 rounds both operands to TF32;
// 3 is 3xTF32, lo(A) hi(B) + hi(A) lo(B) + hi(A) hi(B), the small terms first
// (lo * lo is below float32's rounding): float32-class products at three times
// the tensor work. The fragments are consumed (rounded in place).
template <int kPasses, typename TiledMma, typename FragA, typename FragB, typename Acc>
__device__ __forceinline__ void mma_slice(TiledMma const& tiled_mma, FragA&& a, FragB&& b,
                                          Acc& acc) {
  using ElementA = typename std::decay_t<FragA>::value_type;
  if constexpr (sizeof(ElementA) == 2) {
    cute::gemm(tiled_mma, a, b, acc);
  } else if constexpr (kPasses == 1) {
    round_fragment_to_tf32(a);
    round_fragment_to_tf32(b);
    cute::gemm(tiled_mma, a, b, acc);
  } else {
    static_assert(kPasses == 3, "float32 products take 1 or 3 TF32 passes");
    // A's low parts for the whole slice (a few registers: MMA_M atoms), B's
    // for kGroup n8 columns at a time: a slice's B is up to 64 registers at
    // head dim 256, too many to hold twice beside the accumulators. The three
    // passes of a group add into a zeroed partial sum, which one rounded
    // float32 add then takes into acc: the MMA's own accumulation truncates
    // (measured: 3-20x XLA's float32 error when the passes added straight
    // into a long row's accumulator), and a partial sum bounds that error by
    // one slice's magnitude. Each pass runs over the group's columns, so that
    // consecutive MMAs add into different sums (they would otherwise wait on
    // each other's latency).
    auto a_lo = make_fragment_like(a);
    split_fragment_tf32(a, a_lo);
    constexpr int kN = decltype(size<1>(b))::value;
    constexpr int kM = decltype(size<1>(a))::value;
    // Up to 4 (m, n) sums in flight: 4 / kM columns where they divide kN.
    constexpr int kWanted = kM >= 4 ? 1 : 4 / kM;
    constexpr int kGroup = kN % kWanted == 0 ? kWanted : 1;
    CUTE_UNROLL
    for (int n0 = 0; n0 < kN; n0 += kGroup) {
      using BLo = decltype(make_fragment_like(b(_, 0)));
      using Sum = decltype(make_fragment_like(acc(_, 0, 0)));
      BLo lo[kGroup];
      Sum sum[kGroup][kM];
      CUTE_UNROLL
      for (int g = 0; g < kGroup; ++g) {
        split_fragment_tf32(b(_, n0 + g), lo[g]);
        CUTE_UNROLL
        for (int m = 0; m < kM; ++m) clear(sum[g][m]);
      }
      CUTE_UNROLL
      for (int pass = 0; pass < 3; ++pass) {
        CUTE_UNROLL
        for (int g = 0; g < kGroup; ++g) {
          CUTE_UNROLL
          for (int m = 0; m < kM; ++m) {
            if (pass == 0) cute::gemm(tiled_mma, a_lo(_, m), b(_, n0 + g), sum[g][m]);
            if (pass == 1) cute::gemm(tiled_mma, a(_, m), lo[g], sum[g][m]);
            if (pass == 2) cute::gemm(tiled_mma, a(_, m), b(_, n0 + g), sum[g][m]);
          }
        }
      }
      CUTE_UNROLL
      for (int g = 0; g < kGroup; ++g) {
        CUTE_UNROLL
        for (int m = 0; m < kM; ++m) {
          auto acc_mn = acc(_, m, n0 + g);
          CUTE_UNROLL
          for (int i = 0; i < size(acc_mn); ++i) acc_mn(i) += sum[g][m](i);
        }
      }
    }
  }
}

// acc += A B^T over the K mode, A and B both read from shared memory with
// ldmatrix (or, for float32 operands that are not K-major, 32-bit loads) one
// k-slice ahead of the MMA that consumes it (software pipelining: the load of
// slice k+1 is in flight while slice k multiplies). kPasses: mma_slice's.
template <int kPasses = 1, typename TensorAcc, typename TensorRA, typename TensorRB,
          typename TensorSA, typename TensorSB, typename TiledMma, typename CopyA,
          typename ThrCopyA, typename CopyB, typename ThrCopyB>
__device__ __forceinline__ void gemm_ss(TensorAcc& acc, TensorRA& rA, TensorRB& rB,
                                        TensorSA const& sA, TensorSB const& sB,
                                        TiledMma const& tiled_mma, CopyA const& copy_a,
                                        ThrCopyA const& thr_copy_a, CopyB const& copy_b,
                                        ThrCopyB const& thr_copy_b) {
  auto rA_view = thr_copy_a.retile_D(rA);
  auto rB_view = thr_copy_b.retile_D(rB);
  copy(copy_a, sA(_, _, 0), rA_view(_, _, 0));
  copy(copy_b, sB(_, _, 0), rB_view(_, _, 0));
  CUTE_UNROLL
  for (int k = 0; k < size<2>(rA); ++k) {
    if (k < size<2>(rA) - 1) {
      copy(copy_a, sA(_, _, k + 1), rA_view(_, _, k + 1));
      copy(copy_b, sB(_, _, k + 1), rB_view(_, _, k + 1));
    }
    mma_slice<kPasses>(tiled_mma, rA(_, _, k), rB(_, _, k), acc);
  }
}

// acc += A B^T with A already in registers (P in the forward's P V; a float32
// A is rounded or split in place).
template <int kPasses = 1, typename TensorAcc, typename TensorRA, typename TensorRB,
          typename TensorSB, typename TiledMma, typename CopyB, typename ThrCopyB>
__device__ __forceinline__ void gemm_rs(TensorAcc& acc, TensorRA& rA, TensorRB& rB,
                                        TensorSB const& sB, TiledMma const& tiled_mma,
                                        CopyB const& copy_b, ThrCopyB const& thr_copy_b) {
  auto rB_view = thr_copy_b.retile_D(rB);
  copy(copy_b, sB(_, _, 0), rB_view(_, _, 0));
  CUTE_UNROLL
  for (int k = 0; k < size<2>(rA); ++k) {
    if (k < size<2>(rA) - 1) copy(copy_b, sB(_, _, k + 1), rB_view(_, _, k + 1));
    mma_slice<kPasses>(tiled_mma, rA(_, _, k), rB(_, _, k), acc);
  }
}

// m16n8 accumulator ((2 cols, 2 rows), MMA_M, MMA_N) viewed as
// (rows = (2, MMA_M), cols = (2, MMA_N)), so softmax code can index row, col.
template <typename Layout>
__device__ __forceinline__ constexpr auto acc_rowcol(Layout l) {
  static_assert(decltype(rank<0>(l))::value == 2 && decltype(size<0, 0>(l))::value == 2);
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)), make_layout(get<0, 0>(l), get<2>(l)));
}

// The accumulator of a (M x N) product viewed as the A operand of a following
// m16n8k16 product with K = N: two adjacent n8 accumulator tiles form one k16
// A fragment, ((2, 2), MMA_M, MMA_N) -> ((2, 2, 2), MMA_M, MMA_N / 2).
template <typename Layout>
__device__ __forceinline__ constexpr auto acc_as_a_operand(Layout l) {
  auto split = logical_divide(l, Shape<Underscore, Underscore, _2>{});
  return make_layout(make_layout(get<0>(split), get<2, 0>(split)), get<1>(split),
                     get<2, 1>(split));
}

// The same for an m16n8k8 TF32 product whose K mode is permuted by
// kTf32KPermutation (kernel_traits_sm80.h): A's values (row, k) and (row, k + 4)
// of a k8 block are then columns 2t and 2t + 1 of the accumulator's n8 tile,
// which this thread already holds. No data moves: the n8 tiles are the k8
// blocks, and each tile's ((2 cols, 2 rows)) values are read as ((2 rows, 2 k)).
template <typename Layout>
__device__ __forceinline__ constexpr auto acc_as_tf32_a_operand(Layout l) {
  return make_layout(make_layout(get<0, 1>(l), get<0, 0>(l)), get<1>(l), get<2>(l));
}

// Float32 fragment -> half-precision fragment of the same layout, two values
// per conversion instruction.
template <typename To, typename Engine, typename Layout>
__device__ __forceinline__ auto convert_fragment(Tensor<Engine, Layout> const& src) {
  using From = typename Engine::value_type;
  constexpr int N = decltype(size(src))::value;
  static_assert(N % 2 == 0);
  Tensor dst = make_tensor<To>(src.layout());
  cutlass::NumericArrayConverter<To, From, 2> convert;
  CUTE_UNROLL
  for (int i = 0; i < N / 2; ++i) {
    cutlass::Array<From, 2> pair{};
    pair[0] = src(2 * i);
    pair[1] = src(2 * i + 1);
    cutlass::Array<To, 2> out = convert(pair);
    dst(2 * i) = out[0];
    dst(2 * i + 1) = out[1];
  }
  return dst;
}

// Two floats as two half-precision values with one conversion instruction.
template <typename To>
__device__ __forceinline__ cutlass::Array<To, 2> convert_pair(float a, float b) {
  cutlass::Array<float, 2> pair{};
  pair[0] = a;
  pair[1] = b;
  return cutlass::NumericArrayConverter<To, float, 2>{}(pair);
}

// Two 16-bit values as one 32-bit word (a in the low half, so that a lands at
// the lower address of a little-endian store).
template <typename Element>
__device__ __forceinline__ uint32_t pack_pair(Element a, Element b) {
  return uint32_t(a.raw()) | (uint32_t(b.raw()) << 16);
}

// Two adjacent values of a row stored with one instruction: 4 bytes for 16-bit
// elements, 8 for float32 (dst aligned to the pair).
template <typename Element>
__device__ __forceinline__ void store_pair(Element* dst, Element a, Element b) {
  if constexpr (sizeof(Element) == 4) {
    *reinterpret_cast<float2*>(dst) = make_float2(a, b);
  } else {
    *reinterpret_cast<uint32_t*>(dst) = pack_pair(a, b);
  }
}

// 2^x with the single MUFU instruction (exp2(-inf) = 0). The softmax works in
// the log2 domain so that exp costs one instruction, not exp's extra multiply.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// min(a, b), NaN if either is NaN (fminf would return the other operand).
__device__ __forceinline__ float min_keep_nan(float a, float b) {
  float y;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
  return y;
}

// Programmatic dependent launch (compute capability 9.0; no-ops in code for
// older GPUs, whose launches never set the attribute: launch.h,
// launch_dependent). A grid lets the next kernel of its stream launch early
// (launch_dependent_grids); that kernel waits at wait_for_prerequisite_grids
// until every grid it depends on has completed and its writes are visible,
// and must not read their results before.
__device__ __forceinline__ void launch_dependent_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_prerequisite_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// log2(x) with the single MUFU instruction (log2(0) = -inf).
__device__ __forceinline__ float fast_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// tanh(x) with the single MUFU instruction (relative error about 2^-11;
// tanh(+-inf) = +-1, NaN stays NaN): the softcap kernels' cap (jflash/score.h),
// one more MUFU per score beside exp2's. The float32 products feed it, and its
// error is below that of the half-precision scores of a plain computation.
__device__ __forceinline__ float fast_tanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The softcap kernels' tanh: the MUFU approximation for 16-bit inputs, whose
// scores carry a larger error; tanhf for float32, where the approximation's
// 2^-11 would be most of a 3xTF32 call's error.
template <typename Element>
__device__ __forceinline__ float softcap_tanh(float x) {
  if constexpr (sizeof(Element) == 4) {
    return tanhf(x);
  } else {
    return fast_tanh(x);
  }
}

// A row of an m16n8 accumulator is spread over the 4 lanes of a quad.
template <typename Op>
__device__ __forceinline__ float quad_allreduce(float x, Op op) {
  x = op(x, __shfl_xor_sync(0xffffffff, x, 2));
  x = op(x, __shfl_xor_sync(0xffffffff, x, 1));
  return x;
}

struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct MinOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fminf(a, b); }
};
struct SumOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};

// The online softmax of one tile (FlashAttention-2, Algorithm 1), for the
// rows this thread holds (a row lives in one quad of lanes): s (rows, cols),
// log2-domain scores, becomes exp2(s - m') with m' the new row max; row_max
// and row_sum advance; O (o_rc, rows, cols) is rescaled by exp2(m - m').
template <int kRows, typename TensorS, typename TensorO>
__device__ __forceinline__ void online_softmax(TensorS& s, TensorO& o_rc, float (&row_max)[kRows],
                                               float (&row_sum)[kRows]) {
  float correction[kRows];
  bool max_changed = false;
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    float m = row_max[r];
    CUTE_UNROLL
    for (int c = 0; c < size<1>(s); ++c) m = fmaxf(m, s(r, c));
    m = quad_allreduce(m, MaxOp{});
    // A row with no visible key yet keeps m = -inf; subtract 0 instead so
    // that exp2(-inf - -inf) never makes a NaN.
    const float m_safe = m == -INFINITY ? 0.f : m;
    correction[r] = m == row_max[r] ? 1.f : fast_exp2(row_max[r] - m_safe);
    max_changed |= m != row_max[r];
    row_max[r] = m;
    float sum = 0.f;
    CUTE_UNROLL
    for (int c = 0; c < size<1>(s); ++c) {
      s(r, c) = fast_exp2(s(r, c) - m_safe);
      sum += s(r, c);
    }
    row_sum[r] = row_sum[r] * correction[r] + sum;
  }
  // O *= correction costs head_dim multiplies per row; skip it when no row of
  // the warp raised its max (exact: the correction is then 1). Past the first
  // few key tiles of a long row, most tiles raise no max.
  if (__any_sync(0xffffffff, max_changed)) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTE_UNROLL
      for (int c = 0; c < size<1>(o_rc); ++c) o_rc(r, c) *= correction[r];
    }
  }
}

// Copies the rows of a (rows x head_dim) global tile that lie below row_limit
// into shared memory with cp.async, and zero-fills the others: rows past the
// sequence end then contribute exactly 0 to every product.
template <typename TiledCopy, typename TensorG, typename TensorS, typename TensorC>
__device__ __forceinline__ void copy_rows(TiledCopy const& tiled_copy, TensorG const& g,
                                          TensorS& s, TensorC const& coords, int row_limit) {
  CUTE_UNROLL
  for (int m = 0; m < size<1>(s); ++m) {
    if (get<0>(coords(0, m, 0)) < row_limit) {
      copy(tiled_copy, g(_, m, _), s(_, m, _));
    } else {
      clear(s(_, m, _));
    }
  }
}

// Which of a thread's scores of a tile are visible under segment ids
// (Mask::kHasSegments), as bits (bit r * kCols + c of the (rows, cols) view):
// the rows' and keys' ids are loaded once and compared here, before the
// products, so that the ids are dead by the time the accumulators of the tile
// are live and only these bits stay (the sm80 kernels). c_rc: the (row, col)
// coordinates of the thread's scores in the tile, whose rows start at row0 and
// keys at key0. Rows at or past row_limit and keys at or past key_limit are not
// visible (their ids are not read).
template <int kRows, int kCols>
struct SegmentVisibility {
  // Bits is named by every kernel of a head dim (a dead variable where there
  // are no ids), so the bound is asserted where the ids are compared: the
  // tiles of head dims without segment kernels may hold more scores (32: 4 x 32).
  using Bits = std::conditional_t<(kRows * kCols <= 32), uint32_t, uint64_t>;
  Bits bits;

  __device__ __forceinline__ explicit SegmentVisibility(Bits bits_) : bits(bits_) {}
  template <typename Mask, typename CoordRowCol>
  __device__ __forceinline__ SegmentVisibility(const Mask& mask, const CoordRowCol& c_rc, int row0,
                                               int key0, int row_limit, int key_limit) {
    static_assert(kRows * kCols <= 64, "a thread's scores of a tile must fit the bits");
    int32_t key_id[kCols];
    CUTE_UNROLL
    for (int c = 0; c < kCols; ++c) {
      const int key = key0 + get<1>(c_rc(0, c));
      key_id[c] = key < key_limit ? mask.key_segment(key) : 0;
    }
    bits = 0;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int row = row0 + get<0>(c_rc(r, 0));
      const int32_t row_id = row < row_limit ? mask.row_segment(row) : 0;
      CUTE_UNROLL
      for (int c = 0; c < kCols; ++c) {
        const int key = key0 + get<1>(c_rc(r, c));
        const bool visible = row < row_limit && key < key_limit && row_id == key_id[c] &&
                             mask.in_band(int64_t{row}, int64_t{key});
        bits |= Bits{visible} << (r * kCols + c);
      }
    }
  }
  __device__ __forceinline__ bool operator()(int r, int c) const {
    return (bits >> (r * kCols + c)) & 1;
  }
  // Whether row r holds a visible score.
  __device__ __forceinline__ bool any_in_row(int r) const {
    return (bits >> (r * kCols)) & ((Bits{1} << kCols) - 1);
  }
};

// The forward epilogue's arithmetic, shared by the sm80 and the Hopper
// kernels: O /= rowsum and lse = max + ln(sum) (natural log; row_max is in the
// log2 domain) for the query rows this thread holds. A row that sees no key
// (asked of the mask: a NaN score makes the sum NaN, not 0) gets O = 0 and
// lse = -inf. A row that sees keys but whose softmax is undefined gets O and
// lse NaN: the sum is NaN (a NaN or +inf score), or 0 (every score -inf: O /
// sum = 0 / 0). o_rc and c_o_rc view the output accumulator and its (row, col)
// coordinates as (rows, cols); rows at or past seqlen_q get no lse;
// writes_lse picks one thread of the quad per row. Under segment ids
// (Mask::kHasSegments) row_keys is only a hull, and row_seen[r] says whether
// row r saw a visible key in this thread's columns of the tiles (the quad's
// four threads together hold the row).
template <int kRows, typename AccORowCol, typename CoordORowCol, typename Mask>
__device__ __forceinline__ void normalize_output(AccORowCol& o_rc, CoordORowCol const& c_o_rc,
                                                 float const (&row_max)[kRows],
                                                 float const (&row_sum)[kRows], int row_begin,
                                                 int seqlen_q, const Mask& mask, int seqlen_k,
                                                 bool writes_lse, float* lse_ptr,
                                                 const bool* row_seen = nullptr) {
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const float sum = quad_allreduce(row_sum[r], SumOp{});
    const int row = row_begin + get<0>(c_o_rc(r, 0));
    bool no_key;
    if constexpr (Mask::kHasSegments) {
      no_key = quad_allreduce(row_seen[r] ? 1.f : 0.f, MaxOp{}) == 0.f;
    } else {
      const IndexRange keys = mask.row_keys(row, seqlen_k);
      no_key = keys.begin >= keys.end;
    }
    const float inv_sum = 1.f / sum;
    // A select, not O * 0: O may hold 0 * NaN from a NaN in v.
    CUTE_UNROLL
    for (int c = 0; c < size<1>(o_rc); ++c) o_rc(r, c) = no_key ? 0.f : o_rc(r, c) * inv_sum;
    if (writes_lse && row < seqlen_q) {
      lse_ptr[row] = no_key ? -INFINITY
                            : (sum == 0.f ? NAN : row_max[r] * float(M_LN2) + logf(sum));
    }
  }
}

// normalize_output, then O stored in the input dtype straight from registers
// (rows at or past seqlen_q are not stored, nor columns at or past out_cols:
// a static out_cols is the tile's width, a dynamic one the call's head dim
// where a wider kernel runs it).
template <typename Element, int kRows, typename AccO, typename AccORowCol, typename CoordO,
          typename CoordORowCol, typename Mask, typename OutCols>
__device__ __forceinline__ void store_output(AccO const& acc_o, AccORowCol& o_rc,
                                             CoordO const& c_o, CoordORowCol const& c_o_rc,
                                             float const (&row_max)[kRows],
                                             float const (&row_sum)[kRows], int row_begin,
                                             int seqlen_q, const Mask& mask, int seqlen_k,
                                             bool writes_lse, float* lse_ptr, Element* out_ptr,
                                             int64_t out_row_stride, OutCols out_cols,
                                             const bool* row_seen = nullptr) {
  normalize_output(o_rc, c_o_rc, row_max, row_sum, row_begin, seqlen_q, mask, seqlen_k,
                   writes_lse, lse_ptr, row_seen);
  Tensor o = convert_fragment<Element>(acc_o);
  // Fragment elements 2i, 2i+1 are adjacent columns of one row: one store
  // (head dims are multiples of 8, so a pair is stored whole or not at all).
  CUTE_UNROLL
  for (int i = 0; i < size(o); i += 2) {
    const int row = row_begin + get<0>(c_o(i));
    bool in_cols = true;
    if constexpr (!is_static<OutCols>::value) in_cols = get<1>(c_o(i)) < out_cols;
    if (row < seqlen_q && in_cols) {
      store_pair(out_ptr + int64_t(row) * out_row_stride + get<1>(c_o(i)), o(i), o(i + 1));
    }
  }
}

}  // namespace jflash::cuda

// Building blocks shared by the CPU forward and backward kernels: the tile-size
// table, float32 vector helpers, a vectorized exp, the register-blocked GEMM
// micro-kernel, and dtype conversion when tiles are loaded and stored.
//
// Vectors are GCC/Clang generic vector types (vector_size), not intrinsics: the
// compiler lowers them to whatever instruction set the enclosing function is
// compiled for. Each kernel is compiled once per entry of the tile table below,
// inside a function carrying that entry's target attribute, and the fastest one
// the CPU supports is picked at run time (cpu_tiles()). Every helper here is
// always_inline so that it is compiled for the caller's instruction set.
//
// Tile layout used by both kernels (why: no tile is ever transposed in the inner
// loops): queries sit along vector lanes. Scores are held transposed,
// s_t[key][query], computed as k_tile [keys, d] x q_t [d, queries], so the
// per-query softmax statistics (max, sum, lse, delta) are plain lane-wise vector
// ops down the key axis, with no horizontal reductions.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "jflash/params.h"

// The helpers return vectors by value, but they are always inlined, so no call
// ever crosses an ABI boundary with a vector in a register.
#pragma GCC diagnostic ignored "-Wpsabi"

#define JFLASH_INLINE inline __attribute__((always_inline))

#if defined(__x86_64__) || defined(__i386__)
#define JFLASH_X86 1
#define JFLASH_TARGET_AVX512 __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma")))
#define JFLASH_TARGET_AVX2 __attribute__((target("avx2,fma")))
#else
#define JFLASH_X86 0
#endif

namespace jflash::cpu {

// ---- Tile-size table ----------------------------------------------------------
//
// kRows x (kColVecs * kLanes) is the micro-kernel's register tile (MR x NR): the
// accumulators plus one row of B and a broadcast must fit the register file.
//   AVX-512: 8 x 32 -> 16 accumulators + 2 + 1 of 32 zmm.
//   AVX2:    6 x 16 -> 12 accumulators + 2 + 1 of 16 ymm (the BLIS Haswell shape).
//   SSE2:    4 x 8  ->  8 accumulators + 2 + 1 of 16 xmm (x86-64 baseline).
// Query and key blocks are multiples of kAlign = lcm(MR, NR) because queries are
// both the NR axis of s_t and the MR axis of the o/dq GEMMs, keys the MR axis of
// s_t and dk/dv.
// Block sizes: the forward working set at d = 64 (q_t, o: block_q x d; k, v:
// block_k x d; s_t: block_k x block_q) is 128 KiB for 128 x 64, inside L2 with
// the micro-panels (d x NR, block_k x NR: 8 KiB) streaming from L1, and each K/V
// tile load and conversion is shared by 128 queries. The backward keeps more
// tiles live (q, q^T, dO, dO^T, k, v, dk, dv, P^T, dS^T): 256 KiB at 64 x 128.
// Measured on a 2-core Zen 4 (AVX-512 row; CPU time, seq 4096 / 2048, d 64,
// float32): forward 128 x 64 beat 64 x 64 and 64 x 128 by 5-7% and was within
// 2% of 128 x 128 and 256 x 64; backward 64 x 128 beat 64 x 64 and 128 x 64 by
// 3-5%. The AVX2 and SSE2 rows use the same working-set budget, not measured.
struct Avx512Tiles {
  typedef float Vec __attribute__((vector_size(64)));
  typedef int32_t IntVec __attribute__((vector_size(64)));
  static constexpr int kLanes = 16;
  static constexpr int kRows = 8;
  static constexpr int kColVecs = 2;
  static constexpr int kAlign = 32;
  static constexpr int kFwdBlockQ = 128;
  static constexpr int kFwdBlockK = 64;
  static constexpr int kBwdBlockQ = 64;
  static constexpr int kBwdBlockK = 128;
};

struct Avx2Tiles {
  typedef float Vec __attribute__((vector_size(32)));
  typedef int32_t IntVec __attribute__((vector_size(32)));
  static constexpr int kLanes = 8;
  static constexpr int kRows = 6;
  static constexpr int kColVecs = 2;
  static constexpr int kAlign = 48;
  static constexpr int kFwdBlockQ = 96;
  static constexpr int kFwdBlockK = 96;
  static constexpr int kBwdBlockQ = 48;
  static constexpr int kBwdBlockK = 96;
};

struct BaselineTiles {
  typedef float Vec __attribute__((vector_size(16)));
  typedef int32_t IntVec __attribute__((vector_size(16)));
  static constexpr int kLanes = 4;
  static constexpr int kRows = 4;
  static constexpr int kColVecs = 2;
  static constexpr int kAlign = 8;
  static constexpr int kFwdBlockQ = 64;
  static constexpr int kFwdBlockK = 64;
  static constexpr int kBwdBlockQ = 64;
  static constexpr int kBwdBlockK = 64;
};

enum class CpuTiles { kBaseline, kAvx2, kAvx512 };

// The widest entry of the table this CPU supports, detected once. The
// environment variable JFLASH_CPU_ISA=avx2|baseline caps it, so that tests can
// exercise the narrower kernels on any machine.
inline CpuTiles cpu_tiles() {
  static const CpuTiles tiles = [] {
    const char* cap = std::getenv("JFLASH_CPU_ISA");
    const bool allow_avx512 = cap == nullptr || std::strcmp(cap, "avx512") == 0;
    const bool allow_avx2 = allow_avx512 || std::strcmp(cap, "avx2") == 0;
#if JFLASH_X86
    if (allow_avx512 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("fma")) {
      return CpuTiles::kAvx512;
    }
    if (allow_avx2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
      return CpuTiles::kAvx2;
    }
#else
    (void)allow_avx2;
#endif
    return CpuTiles::kBaseline;
  }();
  return tiles;
}

// Columns of a float32 tile holding head_dim values: a whole number of register
// tiles, zero-padded. Kernel head dims (multiples of 32) need no padding.
template <class T>
constexpr int padded_head_dim(int head_dim) {
  constexpr int nr = T::kColVecs * T::kLanes;
  return (head_dim + nr - 1) / nr * nr;
}

constexpr int round_up(int x, int multiple) { return (x + multiple - 1) / multiple * multiple; }

// ---- Vector helpers -------------------------------------------------------------

// One (batch, head, query block) work item of the forward and dQ passes.
// Within a (batch, head), the last query block comes first: under a causal mask
// it sees the most keys, and handing out the longest tasks first keeps the
// dynamic schedule balanced.
struct QueryBlockTask {
  int64_t batch, head, kv_head;
  int64_t q0;  // first query row
  int q_rows;  // rows in this block (the last block may be partial)
};

JFLASH_INLINE QueryBlockTask query_block_task(const FwdParams& params, int64_t task,
                                              int block_q) {
  const int num_q_blocks = (params.seqlen_q + block_q - 1) / block_q;
  const int q_block = num_q_blocks - 1 - static_cast<int>(task % num_q_blocks);
  QueryBlockTask t;
  t.head = task / num_q_blocks % params.num_heads;
  t.batch = task / num_q_blocks / params.num_heads;
  t.kv_head = t.head / params.heads_per_kv;
  t.q0 = int64_t{q_block} * block_q;
  t.q_rows = static_cast<int>(std::min<int64_t>(block_q, params.seqlen_q - t.q0));
  return t;
}

template <class V>
JFLASH_INLINE V load_vec(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}

template <class V>
JFLASH_INLINE void store_vec(float* p, const V& v) {
  std::memcpy(p, &v, sizeof(V));
}

template <class V>
JFLASH_INLINE V splat(float x) {
  return V{} + x;
}

template <class V>
JFLASH_INLINE V vmax(const V& a, const V& b) {
  return a > b ? a : b;
}

// exp(x), within ~1 ulp (Cephes expf: Cody-Waite reduction x = n ln2 + r with
// |r| <= ln2 / 2, degree-6 polynomial, times 2^n built in the exponent bits). Below
// ln(FLT_MIN) it returns exactly 0 rather than a subnormal, so exp(-inf) = 0,
// which masking relies on. NaN propagates, whatever its payload: 2^n is applied
// as a float multiply (adding n to y's exponent bits, one instruction as well,
// would turn some NaN payloads into numbers).
template <class T>
JFLASH_INLINE typename T::Vec exp_vec(const typename T::Vec& arg) {
  using V = typename T::Vec;
  using IntVec = typename T::IntVec;
  constexpr float kMinArg = -87.33654475f;  // -126 ln2: 2^n stays a normal float
  constexpr float kMaxArg = 88.37626266f;   // 127.5 ln2: 2^n stays finite
  constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23: x + magic rounds x to an integer
  const IntVec underflow = arg < kMinArg;
  V x = arg < kMinArg ? splat<V>(kMinArg) : arg;
  x = x > kMaxArg ? splat<V>(kMaxArg) : x;
  const V shifted = x * 1.44269504088896341f + kRoundMagic;
  const V n = shifted - kRoundMagic;
  // The integer n sits in the low mantissa bits of `shifted`; n + 127 is the
  // biased exponent of 2^n (n in [-126, 127] after the clamps above).
  const IntVec n_biased = (IntVec)shifted - ((IntVec)splat<V>(kRoundMagic) - 127);
  // ln2 = 0.693359375 - 2.12194440e-4; the first part has 9 bits, so n * it is exact.
  V r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  V y = splat<V>(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  const V result = y * (V)(n_biased << 23);
  return underflow ? V{} : result;
}

// tanh(x), within ~2 ulp (Cephes tanhf): the odd polynomial x + x^3 P(x^2) for
// |x| < 0.625, which keeps the relative precision near 0 that the other form
// loses to cancellation, else 1 - 2 / (exp(2|x|) + 1) with x's sign (exp_vec
// clamps its argument, so +-inf gives +-1). NaN propagates (the second form).
template <class T>
JFLASH_INLINE typename T::Vec tanh_vec(const typename T::Vec& x) {
  using V = typename T::Vec;
  const V z = x * x;
  V poly = splat<V>(-5.70498872745e-3f);
  poly = poly * z + 2.06390887954e-2f;
  poly = poly * z - 5.37397155531e-2f;
  poly = poly * z + 1.33314422036e-1f;
  poly = poly * z - 3.33332819422e-1f;
  poly = poly * z * x + x;
  const V magnitude = vmax(x, -x);
  const V tail = 1.0f - 2.0f / (exp_vec<T>(2.0f * magnitude) + 1.0f);
  const V signed_tail = x < 0.0f ? -tail : tail;
  return magnitude < 0.625f ? poly : signed_tail;
}

// ---- Logit soft-capping (jflash/score.h) --------------------------------------------

// s = softcap * tanh(s / softcap) over n scores (n a multiple of kLanes), in
// place, before masking; where t is given (the backward) also t = tanh(s /
// softcap), for softcap_grad.
template <class T>
JFLASH_INLINE void softcap_scores(float* s, int64_t n, float softcap, float* t = nullptr) {
  using V = typename T::Vec;
  for (int64_t i = 0; i < n; i += T::kLanes) {
    const V capped = tanh_vec<T>(load_vec<V>(s + i) / softcap);
    if (t != nullptr) store_vec(t + i, capped);
    store_vec(s + i, softcap * capped);
  }
}

// ds *= 1 - t^2 over n elements: dS of the capped scores (P (dP - delta)) into
// dS of s = softmax_scale * q.k, which the dK and dQ products take.
template <class T>
JFLASH_INLINE void softcap_grad(float* ds, const float* t, int64_t n) {
  using V = typename T::Vec;
  for (int64_t i = 0; i < n; i += T::kLanes) {
    const V t_i = load_vec<V>(t + i);
    store_vec(ds + i, load_vec<V>(ds + i) * (1.0f - t_i * t_i));
  }
}

// ---- Register-blocked GEMM ---------------------------------------------------------

// How a GEMM combines with what c already holds.
enum class Accumulate {
  kOverwrite,  // c = a b
  kAdd,        // c += a b
  kScaleAdd,   // c = row_scale[r] * c + a b (the online-softmax rescale of o)
};

// c[MR x NR] (op)= a[MR x depth] b[depth x NR] for one register tile.
// a(r, p) = a[r * a_row_stride + p * a_col_stride]: any layout, one broadcast
// per element. b: depth rows of NR contiguous floats, ldb apart. The product is
// summed from zero and added to c at the end: a blocked sum, whose rounding
// error grows with depth + number of tiles rather than with their product.
template <class T, Accumulate mode>
JFLASH_INLINE void micro_tile(const float* a, int64_t a_row_stride, int64_t a_col_stride,
                              const float* b, int64_t ldb, int depth, float* c, int64_t ldc,
                              const float* row_scale) {
  using V = typename T::Vec;
  constexpr int kRows = T::kRows, kColVecs = T::kColVecs, kLanes = T::kLanes;
  V acc[kRows][kColVecs];
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 16
    for (int v = 0; v < kColVecs; ++v) acc[r][v] = V{};
  }
  for (int p = 0; p < depth; ++p) {
    V b_row[kColVecs];
#pragma GCC unroll 16
    for (int v = 0; v < kColVecs; ++v) b_row[v] = load_vec<V>(b + p * ldb + v * kLanes);
#pragma GCC unroll 16
    for (int r = 0; r < kRows; ++r) {
      const float a_rp = a[r * a_row_stride + p * a_col_stride];
#pragma GCC unroll 16
      for (int v = 0; v < kColVecs; ++v) acc[r][v] += a_rp * b_row[v];
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 16
    for (int v = 0; v < kColVecs; ++v) {
      float* c_rv = c + r * ldc + v * kLanes;
      if constexpr (mode == Accumulate::kAdd) {
        acc[r][v] += load_vec<V>(c_rv);
      } else if constexpr (mode == Accumulate::kScaleAdd) {
        acc[r][v] += row_scale[r] * load_vec<V>(c_rv);
      }
      store_vec(c_rv, acc[r][v]);
    }
  }
}

// c[rows x cols] (op)= a[rows x depth] b[depth x cols]; rows a multiple of MR,
// cols of NR. Column panels outermost: the depth x NR panel of b stays in L1
// while every row tile of a passes over it.
template <class T, Accumulate mode>
JFLASH_INLINE void gemm(int rows, int cols, int depth, const float* a, int64_t a_row_stride,
                        int64_t a_col_stride, const float* b, int64_t ldb, float* c, int64_t ldc,
                        const float* row_scale = nullptr) {
  constexpr int kCols = T::kColVecs * T::kLanes;
  for (int c0 = 0; c0 < cols; c0 += kCols) {
    for (int r0 = 0; r0 < rows; r0 += T::kRows) {
      micro_tile<T, mode>(a + r0 * a_row_stride, a_row_stride, a_col_stride, b + c0, ldb, depth,
                          c + r0 * ldc + c0, ldc,
                          mode == Accumulate::kScaleAdd ? row_scale + r0 : nullptr);
    }
  }
}

// ---- Online softmax ------------------------------------------------------------------

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// One thread's working tiles of the online-softmax forward loop (the forward
// and decode share it), carved from one block of floats: rows = the padded
// query rows of the tile.
struct OnlineSoftmaxTiles {
  float* q_t;          // [d_pad, rows] softmax_scale * q, transposed
  float* k_tile;       // [block_k, d_pad]
  float* v_tile;       // [block_k, d_pad]
  float* s_t;          // [block_k, rows] scores, then P
  float* o;            // [rows, d_pad] unnormalized out
  float* row_max;      // [rows]
  float* row_sum;      // [rows]
  float* row_rescale;  // [rows]

  static size_t floats(int rows, int d_pad, int block_k) {
    return 3 * size_t(rows) + 2 * size_t(rows + block_k) * d_pad + size_t(block_k) * rows;
  }
  // scratch: floats(rows, d_pad, block_k) floats.
  OnlineSoftmaxTiles(float* scratch, int rows, int d_pad, int block_k)
      : q_t(scratch),
        k_tile(q_t + size_t(d_pad) * rows),
        v_tile(k_tile + size_t(block_k) * d_pad),
        s_t(v_tile + size_t(block_k) * d_pad),
        o(s_t + size_t(block_k) * rows),
        row_max(o + size_t(rows) * d_pad),
        row_sum(row_max + rows),
        row_rescale(row_sum + rows) {}
};

// Online softmax over one key tile, per query lane (Algorithm 1, lines 8-10):
//   m' = max(m, max_j s_t[j]),  rescale = exp(m - m'),
//   p_t[j] = exp(s_t[j] - m'),  l' = rescale * l + sum_j p_t[j].
// s_t [k_pad, q_pad] is overwritten by p_t; row_max/row_sum/row_rescale: [q_pad].
template <class T>
JFLASH_INLINE void softmax_update(float* s_t, int k_pad, int q_pad, float* row_max,
                                  float* row_sum, float* row_rescale) {
  using V = typename T::Vec;
  for (int i = 0; i < q_pad; i += T::kLanes) {
    V tile_max = splat<V>(kNegInf);
    for (int j = 0; j < k_pad; ++j) tile_max = vmax(tile_max, load_vec<V>(s_t + j * q_pad + i));
    const V max_old = load_vec<V>(row_max + i);
    const V max_new = vmax(max_old, tile_max);
    // A query that has seen no key yet has max -inf; subtract 0 instead, since
    // -inf - -inf = NaN. Its probabilities are exp(-inf) = 0 either way.
    const V max_safe = max_new == kNegInf ? V{} : max_new;
    const V rescale = exp_vec<T>(max_old - max_safe);
    V sum = V{};
    for (int j = 0; j < k_pad; ++j) {
      const V p = exp_vec<T>(load_vec<V>(s_t + j * q_pad + i) - max_safe);
      store_vec(s_t + j * q_pad + i, p);
      sum += p;
    }
    store_vec(row_max + i, max_new);
    store_vec(row_sum + i, rescale * load_vec<V>(row_sum + i) + sum);
    store_vec(row_rescale + i, rescale);
  }
}

// ---- Masking ----------------------------------------------------------------------

// Whether the (query rows x keys) tile needs mask_tile: the policy does not
// classify it as full, or it ends in padding keys.
template <class Mask>
JFLASH_INLINE bool tile_needs_mask(const Mask& mask, int64_t q0, int q_rows, int64_t k0,
                                   int k_rows, int k_pad) {
  return mask.tile_class(q0, q0 + q_rows, k0, k0 + k_rows) != TileClass::kFull || k_rows != k_pad;
}

// t[j][i] = value where query q0 + i cannot see key k0 + j (query rows past the
// key's row range included), and for padding keys k_rows <= j < k_pad. t:
// [k_pad, q_pad]. The forward sets masked scores to -inf before the softmax;
// the backward sets P and dS to 0 after computing them, a select that a NaN
// row (lse NaN, delta NaN) cannot turn into NaN. rows_per_query > 1 (decode):
// lane r holds query r / rows_per_query (a kv head's query heads times the
// queries, query-major), and q0 counts lanes.
template <class Mask>
JFLASH_INLINE void mask_tile(const Mask& mask, int64_t seqlen_q, int64_t q0, int q_pad,
                             int64_t k0, int k_rows, int k_pad, float value, float* t,
                             int rows_per_query = 1) {
  for (int j = 0; j < k_pad; ++j) {
    float* row = t + int64_t{j} * q_pad;
    int visible_begin = q_pad, visible_end = q_pad;  // padding key: nothing visible
    if (j < k_rows) {
      // Queries [row_begin, row_end) see key k0 + j.
      const int64_t key = k0 + j;
      const IndexRange rows = mask.key_rows(key, seqlen_q);
      const int64_t begin = rows.begin * rows_per_query - q0;
      const int64_t end = rows.end * rows_per_query - q0;
      visible_begin = static_cast<int>(begin < 0 ? 0 : (begin > q_pad ? q_pad : begin));
      visible_end = static_cast<int>(end < visible_begin ? visible_begin : (end > q_pad ? q_pad : end));
    }
    for (int i = 0; i < visible_begin; ++i) row[i] = value;
    for (int i = visible_end; i < q_pad; ++i) row[i] = value;
  }
}

// The most query rows of a tile (the largest block_q of the table above).
constexpr int kMaxTileRows = 128;

// mask_tile for a policy with segment ids (kHasSegments), whose visible rows of
// a key are not one range: t[j][i] = value where query q0 + i cannot see key
// k0 + j (the band, the ids), for rows past q_rows and for padding keys
// (k_rows <= j < k_pad). seen[i] (i < q_rows) is set where row i sees a key
// of the tile: whether a row sees any key is not a range question here.
template <class Mask>
JFLASH_INLINE void mask_tile_elements(const Mask& mask, int64_t q0, int q_rows, int q_pad,
                                      int64_t k0, int k_rows, int k_pad, float value, float* t,
                                      uint8_t* seen) {
  static_assert(Mask::kHasSegments);
  int32_t row_ids[kMaxTileRows];
  for (int i = 0; i < q_rows; ++i) row_ids[i] = mask.row_segment(q0 + i);
  for (int j = 0; j < k_pad; ++j) {
    float* row = t + int64_t{j} * q_pad;
    if (j >= k_rows) {
      std::fill(row, row + q_pad, value);
      continue;
    }
    const int64_t key = k0 + j;
    const int32_t key_id = mask.key_segment(key);
    for (int i = 0; i < q_rows; ++i) {
      const bool visible = row_ids[i] == key_id && mask.in_band(q0 + i, key);
      if (visible) {
        if (seen != nullptr) seen[i] = 1;
      } else {
        row[i] = value;
      }
    }
    std::fill(row + q_rows, row + q_pad, value);
  }
}

// Applies the mask to a tile that tile_needs_mask says needs it: mask_tile, or
// mask_tile_elements for segment ids (seen: as there; null where not wanted).
template <class Mask>
JFLASH_INLINE void mask_any_tile(const Mask& mask, int64_t seqlen_q, int64_t q0, int q_rows,
                                 int q_pad, int64_t k0, int k_rows, int k_pad, float value,
                                 float* t, uint8_t* seen = nullptr) {
  if constexpr (Mask::kHasSegments) {
    mask_tile_elements(mask, q0, q_rows, q_pad, k0, k_rows, k_pad, value, t, seen);
  } else {
    (void)q_rows;
    (void)seen;
    mask_tile(mask, seqlen_q, q0, q_pad, k0, k_rows, k_pad, value, t);
  }
}

// Whether a tile inside a block's key (row) range holds no visible element,
// so that the loops skip it: possible only for a policy with kEmptyTilesInRange.
template <class Mask>
JFLASH_INLINE bool tile_is_empty(const Mask& mask, int64_t q0, int q_rows, int64_t k0,
                                 int k_rows) {
  if constexpr (Mask::kEmptyTilesInRange) {
    return mask.tile_class(q0, q0 + q_rows, k0, k0 + k_rows) == TileClass::kEmpty;
  } else {
    (void)mask, (void)q0, (void)q_rows, (void)k0, (void)k_rows;
    return false;
  }
}

// ---- Element formats and tile loads / stores ------------------------------------------

JFLASH_INLINE float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

JFLASH_INLINE uint32_t float_to_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

struct Float32Format {
  using Storage = float;
  static JFLASH_INLINE float to_float(float x) { return x; }
  static JFLASH_INLINE float from_float(float x) { return x; }
};

struct BFloat16Format {
  using Storage = uint16_t;
  static JFLASH_INLINE float to_float(uint16_t x) { return bits_to_float(uint32_t{x} << 16); }
  // Round to nearest even; NaN stays NaN (quieted) instead of rounding to inf.
  static JFLASH_INLINE uint16_t from_float(float f) {
    const uint32_t bits = float_to_bits(f);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
    return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
  }
};

struct Float16Format {
  using Storage = uint16_t;
  static JFLASH_INLINE float to_float(uint16_t h) {
    const uint32_t sign = uint32_t{h & 0x8000u} << 16;
    const uint32_t exponent = (h >> 10) & 0x1fu;
    const uint32_t mantissa = h & 0x3ffu;
    uint32_t magnitude;
    if (exponent == 0x1f) {
      magnitude = 0x7f800000u | (mantissa << 13);  // inf / NaN
    } else if (exponent != 0) {
      magnitude = ((exponent + (127 - 15)) << 23) | (mantissa << 13);
    } else {
      // Zero or subnormal: mantissa * 2^-24 is exact in float32 and normal, so
      // this does not depend on the denormals-are-zero mode of the thread.
      magnitude = float_to_bits(static_cast<float>(mantissa) * 0x1p-24f);
    }
    return bits_to_float(sign | magnitude);
  }
  // Round to nearest even, overflow to inf, NaN to a quiet NaN.
  static JFLASH_INLINE uint16_t from_float(float f) {
    const uint32_t bits = float_to_bits(f);
    const uint32_t sign = (bits >> 16) & 0x8000u;
    const uint32_t magnitude = bits & 0x7fffffffu;
    uint32_t half;
    if (magnitude > 0x7f800000u) {
      half = 0x7e00u;
    } else if (magnitude >= 0x477ff000u) {  // >= 65520 rounds past 65504 to inf
      half = 0x7c00u;
    } else if (magnitude >= 0x38800000u) {  // >= 2^-14: a normal half
      const uint32_t rebiased = magnitude - ((127u - 15u) << 23);
      half = (rebiased + 0xfffu + ((rebiased >> 13) & 1u)) >> 13;
    } else {
      // Subnormal half: adding 0.5 makes the float addition round (to nearest
      // even) at exactly 2^-24, the half subnormal step; the low bits are the result.
      half = float_to_bits(bits_to_float(magnitude) + 0.5f) - 0x3f000000u;
    }
    return static_cast<uint16_t>(sign | half);
  }
};

// dst[r * ld + c] = scale * src[r * src_row_stride + c] for r < rows, c < cols;
// zero for padding (rows <= r < rows_pad or cols <= c < cols_pad).
template <class Format>
JFLASH_INLINE void load_tile_as(const void* src, int64_t src_row_stride, int rows, int cols,
                                int rows_pad, int cols_pad, float scale, float* dst, int64_t ld) {
  const auto* typed = static_cast<const typename Format::Storage*>(src);
  for (int r = 0; r < rows; ++r) {
    const auto* src_row = typed + r * src_row_stride;
    float* dst_row = dst + r * ld;
    for (int c = 0; c < cols; ++c) dst_row[c] = scale * Format::to_float(src_row[c]);
    for (int c = cols; c < cols_pad; ++c) dst_row[c] = 0.0f;
  }
  for (int r = rows; r < rows_pad; ++r) {
    for (int c = 0; c < cols_pad; ++c) dst[r * ld + c] = 0.0f;
  }
}

// The same tile, transposed: dst[c * ld + r].
template <class Format>
JFLASH_INLINE void load_tile_transposed_as(const void* src, int64_t src_row_stride, int rows,
                                           int cols, int rows_pad, int cols_pad, float scale,
                                           float* dst, int64_t ld) {
  const auto* typed = static_cast<const typename Format::Storage*>(src);
  for (int r = 0; r < rows; ++r) {
    const auto* src_row = typed + r * src_row_stride;
    for (int c = 0; c < cols; ++c) dst[c * ld + r] = scale * Format::to_float(src_row[c]);
  }
  for (int c = 0; c < cols_pad; ++c) {
    for (int r = (c < cols ? rows : 0); r < rows_pad; ++r) dst[c * ld + r] = 0.0f;
  }
}

// dst[r * dst_row_stride + c] = scale * src[r * ld + c], rounded to the format.
template <class Format>
JFLASH_INLINE void store_tile_as(const float* src, int64_t ld, int rows, int cols, float scale,
                                 void* dst, int64_t dst_row_stride) {
  auto* typed = static_cast<typename Format::Storage*>(dst);
  for (int r = 0; r < rows; ++r) {
    auto* dst_row = typed + r * dst_row_stride;
    for (int c = 0; c < cols; ++c) dst_row[c] = Format::from_float(scale * src[r * ld + c]);
  }
}

// A [rows, cols] tile of one head of a [batch, seq, heads, head_dim] tensor,
// starting `offset` elements into `base` and rows `row_stride` elements apart.
struct TileRef {
  const void* base;
  DType dtype;
  int64_t offset;
  int64_t row_stride;
};

JFLASH_INLINE const void* tile_address(const TileRef& t) {
  const int64_t bytes = t.dtype == DType::kFloat32 ? 4 : 2;
  return static_cast<const char*>(t.base) + t.offset * bytes;
}

JFLASH_INLINE void load_tile(const TileRef& src, int rows, int cols, int rows_pad, int cols_pad,
                             float scale, float* dst, int64_t ld) {
  const void* p = tile_address(src);
  switch (src.dtype) {
    case DType::kFloat32:
      return load_tile_as<Float32Format>(p, src.row_stride, rows, cols, rows_pad, cols_pad, scale,
                                         dst, ld);
    case DType::kBFloat16:
      return load_tile_as<BFloat16Format>(p, src.row_stride, rows, cols, rows_pad, cols_pad,
                                          scale, dst, ld);
    case DType::kFloat16:
      return load_tile_as<Float16Format>(p, src.row_stride, rows, cols, rows_pad, cols_pad, scale,
                                         dst, ld);
  }
}

JFLASH_INLINE void load_tile_transposed(const TileRef& src, int rows, int cols, int rows_pad,
                                        int cols_pad, float scale, float* dst, int64_t ld) {
  const void* p = tile_address(src);
  switch (src.dtype) {
    case DType::kFloat32:
      return load_tile_transposed_as<Float32Format>(p, src.row_stride, rows, cols, rows_pad,
                                                    cols_pad, scale, dst, ld);
    case DType::kBFloat16:
      return load_tile_transposed_as<BFloat16Format>(p, src.row_stride, rows, cols, rows_pad,
                                                     cols_pad, scale, dst, ld);
    case DType::kFloat16:
      return load_tile_transposed_as<Float16Format>(p, src.row_stride, rows, cols, rows_pad,
                                                    cols_pad, scale, dst, ld);
  }
}

// dst tile (same addressing as TileRef) = scale * src[rows x cols], rounded to dtype.
JFLASH_INLINE void store_tile(const float* src, int64_t ld, int rows, int cols, float scale,
                              DType dtype, void* base, int64_t offset, int64_t row_stride) {
  const int64_t bytes = dtype == DType::kFloat32 ? 4 : 2;
  void* p = static_cast<char*>(base) + offset * bytes;
  switch (dtype) {
    case DType::kFloat32:
      return store_tile_as<Float32Format>(src, ld, rows, cols, scale, p, row_stride);
    case DType::kBFloat16:
      return store_tile_as<BFloat16Format>(src, ld, rows, cols, scale, p, row_stride);
    case DType::kFloat16:
      return store_tile_as<Float16Format>(src, ld, rows, cols, scale, p, row_stride);
  }
}

}  // namespace jflash::cpu

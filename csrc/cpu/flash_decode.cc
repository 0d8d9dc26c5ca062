// CPU decode: a few query rows per sequence against a KV cache, the algorithm
// of the CUDA decode kernel (csrc/cuda/flash_decode_sm80.h).
//
// One task per (sequence, kv head, block of rows, split of the key range).
// Its rows are the kv head's query heads times the queries (jflash/decode.h),
// so each K/V row is converted once per group. It walks its split's key tiles
// with the online softmax of the forward and writes the split's (out, lse); a
// second pass combines the splits of each row by their lse. With one split
// the tasks write out and lse themselves. Cache rows come through the block
// table; the appended keys are read from k_new and v_new, and copied into the
// cache before the tasks run.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "cpu/flash_cpu.h"
#include "cpu/thread_pool.h"
#include "cpu/tile_math.h"
#include "jflash/decode.h"

namespace jflash::cpu {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

int64_t element_bytes(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

// k_new, v_new -> the cache rows at each sequence's clamped cache length.
void append_new_keys(const DecodeParams& p) {
  const int64_t row_bytes = int64_t{p.num_heads_kv} * p.head_dim * element_bytes(p.dtype);
  for (int b = 0; b < p.batch; ++b) {
    const DecodeLengths lens = decode_lengths(p, b);
    for (int t = 0; t < p.seqlen_new; ++t) {
      const int64_t dst = cache_row_offset(p, b, lens.cache + t) * element_bytes(p.dtype);
      const int64_t src = (b * p.new_batch_stride + t * p.new_row_stride) * element_bytes(p.dtype);
      std::memcpy(static_cast<char*>(p.k_cache) + dst, static_cast<const char*>(p.k_new) + src,
                  row_bytes);
      std::memcpy(static_cast<char*>(p.v_cache) + dst, static_cast<const char*>(p.v_new) + src,
                  row_bytes);
    }
  }
}

// Key rows [k0, k0 + rows) of sequence b, kv head kv, as float32 rows of dst
// [rows_pad, d_pad] (zero padding): cache rows below lens.cache, the appended
// ones from `fresh` (k_new or v_new).
JFLASH_INLINE void load_key_rows(const DecodeParams& p, const void* cache, const void* fresh,
                                 int b, int kv, DecodeLengths lens, int64_t k0, int rows,
                                 int rows_pad, int d_pad, float* dst) {
  for (int r = 0; r < rows; ++r) {
    const int key = static_cast<int>(k0) + r;
    const TileRef src =
        key < lens.cache
            ? TileRef{cache, p.dtype, cache_row_offset(p, b, key) + kv * p.cache_head_stride,
                      p.cache_row_stride}
            : TileRef{fresh, p.dtype,
                      b * p.new_batch_stride + (key - lens.cache) * p.new_row_stride +
                          kv * p.new_head_stride,
                      p.new_row_stride};
    load_tile(src, 1, p.head_dim, 1, d_pad, 1.0f, dst + int64_t{r} * d_pad, d_pad);
  }
  std::fill(dst + int64_t{rows} * d_pad, dst + int64_t{rows_pad} * d_pad, 0.0f);
}

// One (sequence, kv head, row block, split) work item.
struct DecodeTask {
  int batch, kv_head, row_block, split;
};

DecodeTask decode_task(const DecodeParams& p, int64_t task, int row_blocks) {
  DecodeTask t;
  t.split = static_cast<int>(task % p.num_splits);
  task /= p.num_splits;
  t.row_block = static_cast<int>(task % row_blocks);
  task /= row_blocks;
  t.kv_head = static_cast<int>(task % p.num_heads_kv);
  t.batch = static_cast<int>(task / p.num_heads_kv);
  return t;
}

template <class T>
int row_blocks(const DecodeParams& p) {
  return (decode_rows(p) + T::kFwdBlockQ - 1) / T::kFwdBlockQ;
}

template <class T>
JFLASH_INLINE void decode_block(const DecodeParams& p, int64_t task_index) {
  constexpr int block_m = T::kFwdBlockQ;
  constexpr int block_k = T::kFwdBlockK;
  const auto [b, kv, row_block, split] = decode_task(p, task_index, row_blocks<T>(p));
  const int group = p.heads_per_kv;
  const int m0 = row_block * block_m;
  const int m_rows = std::min(block_m, decode_rows(p) - m0);
  const int m_pad = round_up(m_rows, T::kAlign);
  const int d_pad = padded_head_dim<T>(p.head_dim);

  // The keys this block's queries see, cut to this split's tiles.
  const DecodeLengths lens = decode_lengths(p, b);
  const MaskParams band = decode_band(p, lens.total);
  const BandMask mask(band, b);
  const int query_first = m0 / group;
  const int queries = (m0 + m_rows - 1) / group + 1 - query_first;
  const IndexRange keys = mask.keys_of_rows(query_first, query_first + queries, lens.total);
  const int first_tile = static_cast<int>(keys.begin / block_k);
  const int end_tile =
      keys.begin < keys.end ? static_cast<int>((keys.end + block_k - 1) / block_k) : first_tile;
  const TileSpan span = split_tiles(first_tile, end_tile, split, p.num_splits);
  const int64_t key_begin = std::max<int64_t>(keys.begin, int64_t{span.begin} * block_k);
  const int64_t key_end = std::min<int64_t>(keys.end, int64_t{span.end} * block_k);

  const OnlineSoftmaxTiles tiles(
      thread_scratch(OnlineSoftmaxTiles::floats(m_pad, d_pad, block_k)), m_pad, d_pad, block_k);
  const auto [q_t, k_tile, v_tile, s_t, o, row_max, row_sum, row_rescale] = tiles;

  // q_t[c][r] = softmax_scale * q of row m0 + r (a query head of kv head kv).
  for (int r = 0; r < m_rows; ++r) {
    const int m = m0 + r;
    const TileRef q_ref{p.q, p.dtype,
                        b * p.q_batch_stride + (m / group) * p.q_row_stride +
                            (int64_t{kv} * group + m % group) * p.q_head_stride,
                        p.q_head_stride};
    load_tile_transposed(q_ref, 1, p.head_dim, 1, d_pad, p.softmax_scale, q_t + r, m_pad);
  }
  for (int c = 0; c < d_pad; ++c) std::fill(q_t + c * m_pad + m_rows, q_t + (c + 1) * m_pad, 0.0f);
  std::fill(o, o + m_pad * d_pad, 0.0f);
  std::fill(row_max, row_max + m_pad, kNegInf);
  std::fill(row_sum, row_sum + m_pad, 0.0f);

  for (int64_t k0 = key_begin; k0 < key_end; k0 += block_k) {
    const int k_rows = static_cast<int>(std::min<int64_t>(block_k, key_end - k0));
    const int k_pad = round_up(k_rows, T::kRows);
    load_key_rows(p, p.k_cache, p.k_new, b, kv, lens, k0, k_rows, k_pad, d_pad, k_tile);
    load_key_rows(p, p.v_cache, p.v_new, b, kv, lens, k0, k_rows, k_pad, d_pad, v_tile);
    // S^T = K (scale Q)^T: [k_pad, m_pad]
    gemm<T, Accumulate::kOverwrite>(k_pad, m_pad, d_pad, k_tile, d_pad, 1, q_t, m_pad, s_t, m_pad);
    if (p.softcap > 0.0f) {
      const float inv_cap = 1.0f / p.softcap;
      for (int64_t e = 0; e < int64_t{k_rows} * m_pad; ++e) {
        s_t[e] = p.softcap * std::tanh(s_t[e] * inv_cap);
      }
    }
    if (tile_needs_mask(mask, query_first, queries, k0, k_rows, k_pad)) {
      mask_tile(mask, p.seqlen_q, m0, m_pad, k0, k_rows, k_pad, kNegInf, s_t, group);
    }
    softmax_update<T>(s_t, k_pad, m_pad, row_max, row_sum, row_rescale);
    // O = rescale * O + P V: [m_pad, d_pad]
    gemm<T, Accumulate::kScaleAdd>(m_pad, d_pad, k_pad, s_t, 1, m_pad, v_tile, d_pad, o, d_pad,
                                   row_rescale);
  }

  // One split: out = O / l and lse = m + log l, with the forward's rules (no
  // key: 0 and -inf; l = 0, every score -inf: NaN). Several: this split's
  // share, lse -inf where it has none (no key here, or every score -inf),
  // which the combine tells apart by the mask.
  const bool direct = p.num_splits == 1;
  for (int r = 0; r < m_rows; ++r) {
    const int m = m0 + r;
    const int query = m / group;
    const int64_t head = int64_t{kv} * group + m % group;
    const int64_t row = (int64_t{b} * p.num_heads + head) * p.seqlen_q + query;
    const IndexRange row_keys = mask.row_keys(query, lens.total);
    const float sum = row_sum[r];
    const bool empty = row_keys.begin >= row_keys.end || (!direct && sum == 0.0f);
    float* o_row = o + int64_t{r} * d_pad;
    float lse;
    if (empty) {
      lse = kNegInf;
      std::fill(o_row, o_row + p.head_dim, 0.0f);  // O may hold 0 * NaN of a NaN in v
    } else {
      lse = sum == 0.0f ? kNaN : row_max[r] + std::log(sum);
      const float inv_sum = 1.0f / sum;
      for (int c = 0; c < p.head_dim; ++c) o_row[c] *= inv_sum;
    }
    if (direct) {
      p.lse[row] = lse;
      store_tile(o_row, d_pad, 1, p.head_dim, 1.0f, p.dtype, p.out,
                 b * p.out_batch_stride + query * p.out_row_stride + head * p.out_head_stride,
                 p.out_row_stride);
    } else {
      const int64_t partial = int64_t{split} * p.batch * p.num_heads * p.seqlen_q + row;
      p.lse_partial[partial] = lse;
      std::copy(o_row, o_row + p.head_dim, p.out_partial + partial * p.head_dim);
    }
  }
}

// out, lse of one row (sequence b, query head, query) from its splits':
// lse = log sum_s exp(lse_s), out = sum_s exp(lse_s - lse) out_s, over the
// splits that hold a share (lse_s > -inf). A row that sees keys but no split
// holds a share had every visible score -inf: NaN, as for one split.
void combine_row(const DecodeParams& p, int64_t row, float* acc) {
  const int64_t rows = int64_t{p.batch} * p.num_heads * p.seqlen_q;
  const int b = static_cast<int>(row / (int64_t{p.num_heads} * p.seqlen_q));
  const int head = static_cast<int>(row / p.seqlen_q % p.num_heads);
  const int query = static_cast<int>(row % p.seqlen_q);
  const DecodeLengths lens = decode_lengths(p, b);
  const MaskParams band = decode_band(p, lens.total);
  const IndexRange keys = BandMask(band, b).row_keys(query, lens.total);
  float lse = kNegInf;
  std::fill(acc, acc + p.head_dim, 0.0f);
  if (keys.begin < keys.end) {
    float max = kNegInf;
    for (int s = 0; s < p.num_splits; ++s) max = std::max(max, p.lse_partial[s * rows + row]);
    if (max == kNegInf) {
      lse = kNaN;
      std::fill(acc, acc + p.head_dim, kNaN);
    } else {
      float sum = 0.0f;
      for (int s = 0; s < p.num_splits; ++s) {
        const float lse_s = p.lse_partial[s * rows + row];
        if (lse_s != kNegInf) sum += std::exp(lse_s - max);  // a NaN share makes the row NaN
      }
      lse = max + std::log(sum);
      for (int s = 0; s < p.num_splits; ++s) {
        const float lse_s = p.lse_partial[s * rows + row];
        if (lse_s == kNegInf) continue;
        const float weight = std::exp(lse_s - lse);
        const float* share = p.out_partial + (s * rows + row) * p.head_dim;
        for (int c = 0; c < p.head_dim; ++c) acc[c] += weight * share[c];
      }
    }
  }
  p.lse[row] = lse;
  store_tile(acc, p.head_dim, 1, p.head_dim, 1.0f, p.dtype, p.out,
             b * p.out_batch_stride + query * p.out_row_stride + head * p.out_head_stride,
             p.out_row_stride);
}

// One non-template entry per row of the tile table, compiled for its instruction set.
#if JFLASH_X86
JFLASH_TARGET_AVX512 void decode_task_avx512(const DecodeParams& p, int64_t task) {
  decode_block<Avx512Tiles>(p, task);
}
JFLASH_TARGET_AVX2 void decode_task_avx2(const DecodeParams& p, int64_t task) {
  decode_block<Avx2Tiles>(p, task);
}
#endif
void decode_task_baseline(const DecodeParams& p, int64_t task) {
  decode_block<BaselineTiles>(p, task);
}

template <class T>
int64_t num_decode_tasks(const DecodeParams& p) {
  return int64_t{p.batch} * p.num_heads_kv * row_blocks<T>(p) * p.num_splits;
}

}  // namespace

void flash_decode(const DecodeParams& p) {
  if (p.seqlen_new > 0) append_new_keys(p);
  switch (cpu_tiles()) {
#if JFLASH_X86
    case CpuTiles::kAvx512:
      parallel_for(num_decode_tasks<Avx512Tiles>(p),
                   [&](int64_t task) { decode_task_avx512(p, task); });
      break;
    case CpuTiles::kAvx2:
      parallel_for(num_decode_tasks<Avx2Tiles>(p), [&](int64_t task) { decode_task_avx2(p, task); });
      break;
#endif
    default:
      parallel_for(num_decode_tasks<BaselineTiles>(p),
                   [&](int64_t task) { decode_task_baseline(p, task); });
  }
  if (p.num_splits == 1) return;
  // Rows in groups, so that each task amortizes the pool's hand-out.
  constexpr int64_t kRowsPerTask = 64;
  const int64_t rows = int64_t{p.batch} * p.num_heads * p.seqlen_q;
  parallel_for((rows + kRowsPerTask - 1) / kRowsPerTask, [&](int64_t task) {
    float* acc = thread_scratch(p.head_dim);
    const int64_t end = std::min(rows, (task + 1) * kRowsPerTask);
    for (int64_t row = task * kRowsPerTask; row < end; ++row) combine_row(p, row, acc);
  });
}

int decode_row_block() {
  switch (cpu_tiles()) {
#if JFLASH_X86
    case CpuTiles::kAvx512: return Avx512Tiles::kFwdBlockQ;
    case CpuTiles::kAvx2: return Avx2Tiles::kFwdBlockQ;
#endif
    default: return BaselineTiles::kFwdBlockQ;
  }
}

int decode_key_block() {
  switch (cpu_tiles()) {
#if JFLASH_X86
    case CpuTiles::kAvx512: return Avx512Tiles::kFwdBlockK;
    case CpuTiles::kAvx2: return Avx2Tiles::kFwdBlockK;
#endif
    default: return BaselineTiles::kFwdBlockK;
  }
}

}  // namespace jflash::cpu

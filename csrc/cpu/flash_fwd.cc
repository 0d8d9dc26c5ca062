// CPU forward: out, lse = attention(q, k, v), FlashAttention-2 Algorithm 1.
//
// One task = one block of queries of one (batch, head). It walks the key range
// that the mask policy gives for the block, one key tile at a time, keeping a
// running max and sum per query and rescaling the output accumulator once per
// tile. Working memory is one set of tiles per thread (thread_scratch), never a
// seqlen_q x seqlen_k buffer; every accumulation is float32.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "cpu/flash_cpu.h"
#include "cpu/thread_pool.h"
#include "cpu/tile_math.h"

namespace jflash::cpu {
namespace {

template <class T, class Mask>
JFLASH_INLINE void fwd_block(const FwdParams& params, int64_t task) {
  constexpr int block_q = T::kFwdBlockQ;
  static_assert(block_q <= kMaxTileRows);
  constexpr int block_k = T::kFwdBlockK;
  const auto [batch, head, kv_head, q0, q_rows] = query_block_task(params, task, block_q);
  const int q_pad = round_up(q_rows, T::kAlign);
  const int head_dim = params.head_dim;
  const int d_pad = padded_head_dim<T>(head_dim);

  const OnlineSoftmaxTiles tiles(
      thread_scratch(OnlineSoftmaxTiles::floats(q_pad, d_pad, block_k)), q_pad, d_pad, block_k);
  const auto [q_t, k_tile, v_tile, s_t, o, row_max, row_sum, row_rescale] = tiles;

  // q_t[c][i] = softmax_scale * q[q0 + i][c]: scaling q once scales every score.
  const TileRef q_ref{params.q, params.dtype,
                      batch * params.q_batch_stride + q0 * params.q_row_stride +
                          head * params.q_head_stride,
                      params.q_row_stride};
  load_tile_transposed(q_ref, q_rows, head_dim, q_pad, d_pad, params.softmax_scale, q_t, q_pad);
  std::fill(o, o + q_pad * d_pad, 0.0f);
  std::fill(row_max, row_max + q_pad, kNegInf);
  std::fill(row_sum, row_sum + q_pad, 0.0f);

  // Keys outside [key_begin, key_end) are masked for every query of the block;
  // tiles inside it that no query sees (segment ids) are skipped.
  const Mask mask(params.mask, static_cast<int>(batch));
  // Segment ids: which rows have seen a key (row_keys is only a hull there).
  uint8_t seen[block_q] = {};
  const auto [key_begin, key_end] = mask.keys_of_rows(q0, q0 + q_rows, params.seqlen_k);
  for (int64_t k0 = key_begin; k0 < key_end; k0 += block_k) {
    const int k_rows = static_cast<int>(std::min<int64_t>(block_k, key_end - k0));
    if (tile_is_empty(mask, q0, q_rows, k0, k_rows)) continue;
    const int k_pad = round_up(k_rows, T::kRows);
    const int64_t k_offset = batch * params.k_batch_stride + k0 * params.k_row_stride +
                             kv_head * params.k_head_stride;
    const int64_t v_offset = batch * params.v_batch_stride + k0 * params.v_row_stride +
                             kv_head * params.v_head_stride;
    load_tile({params.k, params.dtype, k_offset, params.k_row_stride}, k_rows, head_dim, k_pad,
              d_pad, 1.0f, k_tile, d_pad);
    load_tile({params.v, params.dtype, v_offset, params.v_row_stride}, k_rows, head_dim, k_pad,
              d_pad, 1.0f, v_tile, d_pad);

    // S^T = K (scale Q)^T: [k_pad, q_pad]; capped before the mask hides scores.
    gemm<T, Accumulate::kOverwrite>(k_pad, q_pad, d_pad, k_tile, d_pad, 1, q_t, q_pad, s_t,
                                    q_pad);
    if (params.softcap > 0.0f) softcap_scores<T>(s_t, int64_t{k_pad} * q_pad, params.softcap);
    if (tile_needs_mask(mask, q0, q_rows, k0, k_rows, k_pad)) {
      mask_any_tile(mask, params.seqlen_q, q0, q_rows, q_pad, k0, k_rows, k_pad, kNegInf, s_t,
                    seen);
    } else if constexpr (Mask::kHasSegments) {
      std::fill(seen, seen + q_rows, uint8_t{1});
    }
    softmax_update<T>(s_t, k_pad, q_pad, row_max, row_sum, row_rescale);
    // O = rescale * O + P V: [q_pad, d_pad]; a(i, j) = p_t[j][i].
    gemm<T, Accumulate::kScaleAdd>(q_pad, d_pad, k_pad, s_t, 1, q_pad, v_tile, d_pad, o, d_pad,
                                   row_rescale);
  }

  // out = O / l and lse = m + log l. A query that sees no key (a fact of the
  // mask: a NaN score makes l NaN, not 0) gets 0 and -inf; one that sees keys
  // but whose softmax is undefined gets NaN: l NaN (a NaN or +inf score), or
  // l = 0 (every score -inf; then O / l = 0 / 0).
  float* lse = params.lse + (batch * params.num_heads + head) * params.seqlen_q + q0;
  for (int i = 0; i < q_rows; ++i) {
    float* o_row = o + i * d_pad;
    const IndexRange keys = mask.row_keys(q0 + i, params.seqlen_k);
    const bool no_key = Mask::kHasSegments ? !seen[i] : keys.begin >= keys.end;
    if (no_key) {
      lse[i] = kNegInf;
      std::fill(o_row, o_row + head_dim, 0.0f);  // O may hold 0 * NaN of a NaN in v
      continue;
    }
    const float sum = row_sum[i];
    lse[i] = sum == 0.0f ? std::numeric_limits<float>::quiet_NaN() : row_max[i] + std::log(sum);
    const float inv_sum = 1.0f / sum;
    for (int c = 0; c < head_dim; ++c) o_row[c] *= inv_sum;
  }
  store_tile(o, d_pad, q_rows, head_dim, 1.0f, params.dtype, params.out,
             batch * params.out_batch_stride + q0 * params.out_row_stride +
                 head * params.out_head_stride,
             params.out_row_stride);
}

template <class T>
JFLASH_INLINE void fwd_task(const FwdParams& params, MaskKind mask, int64_t task) {
  switch (mask) {
    case MaskKind::kNone: return fwd_block<T, NoMask>(params, task);
    case MaskKind::kBand: return fwd_block<T, BandMask>(params, task);
    case MaskKind::kSegments: return fwd_block<T, SegmentMask>(params, task);
  }
}

// One non-template entry per row of the tile table, compiled for its instruction set.
#if JFLASH_X86
JFLASH_TARGET_AVX512 void fwd_task_avx512(const FwdParams& params, MaskKind mask, int64_t task) {
  fwd_task<Avx512Tiles>(params, mask, task);
}
JFLASH_TARGET_AVX2 void fwd_task_avx2(const FwdParams& params, MaskKind mask, int64_t task) {
  fwd_task<Avx2Tiles>(params, mask, task);
}
#endif
void fwd_task_baseline(const FwdParams& params, MaskKind mask, int64_t task) {
  fwd_task<BaselineTiles>(params, mask, task);
}

template <class T>
int64_t num_fwd_tasks(const FwdParams& params) {
  return int64_t{params.batch} * params.num_heads *
         ((params.seqlen_q + T::kFwdBlockQ - 1) / T::kFwdBlockQ);
}

}  // namespace

void flash_fwd(const FwdParams& params, MaskKind mask) {
  switch (cpu_tiles()) {
#if JFLASH_X86
    case CpuTiles::kAvx512:
      return parallel_for(num_fwd_tasks<Avx512Tiles>(params),
                          [&](int64_t task) { fwd_task_avx512(params, mask, task); });
    case CpuTiles::kAvx2:
      return parallel_for(num_fwd_tasks<Avx2Tiles>(params),
                          [&](int64_t task) { fwd_task_avx2(params, mask, task); });
#endif
    default:
      return parallel_for(num_fwd_tasks<BaselineTiles>(params),
                          [&](int64_t task) { fwd_task_baseline(params, mask, task); });
  }
}

}  // namespace jflash::cpu

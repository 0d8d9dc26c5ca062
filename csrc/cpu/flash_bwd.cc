// CPU backward: dq, dk, dv of flash_fwd, FlashAttention-2 Algorithm 2, which
// recomputes P = exp(S - lse) tile by tile instead of storing it.
//
// Three kinds of task, each owning the rows it writes:
//  1. delta = rowsum(dout * out) - dlse, over (batch, head, query block); first.
//  2. dk, dv over (batch, kv head, key block): the task walks every query block
//     that sees its keys, for each query head of its GQA group, and sums into one
//     float32 dk/dv tile, so no num_heads-sized buffer exists.
//  3. dq over (batch, head, query block), recomputing P and dP for its rows.
// 2 and 3 run as one parallel job. Why dq has tasks of its own: accumulating dq
// in the tasks of 2 means many key-block tasks adding into the same rows, which
// needs atomics (float sums in a run-dependent order) or ordered locking.
// Recomputing costs two of the five GEMMs again but makes every dq row the sum,
// in fixed key order, of one task: the result is deterministic. dq accumulates
// in that task's float32 tile; params.dq_accum (scratch of the GPU kernels) is
// not needed here, except where the caller takes it or adds into it (params.h,
// DqMode; then delta may be the caller's too, and the first pass is skipped).
// Likewise dk, dv: written, or added into the caller's float32 sums (DkvMode).
#include <algorithm>
#include <cstdint>
#include <limits>

#include "cpu/flash_cpu.h"
#include "cpu/thread_pool.h"
#include "cpu/tile_math.h"

namespace jflash::cpu {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// delta[i] = sum_c dout[i][c] * out[i][c] - dlse[i] for one block of queries.
// The dot product runs down c with one FMA per step from zero, the order in
// which the dP GEMM sums dout . v, so that dP - delta cancels exactly where it
// should (a query that sees a single key has out = v and dS = dlse).
template <class T>
JFLASH_INLINE void delta_block(const BwdParams& params, int64_t task) {
  using V = typename T::Vec;
  const auto [batch, head, kv_head, q0, q_rows] = query_block_task(params, task, T::kBwdBlockQ);
  const int q_pad = round_up(q_rows, T::kAlign);
  const int head_dim = params.head_dim;

  float* out_t = thread_scratch(size_t(2 * head_dim + 1) * q_pad);  // [head_dim, q_pad]
  float* dout_t = out_t + head_dim * q_pad;                          // [head_dim, q_pad]
  float* dot = dout_t + head_dim * q_pad;                            // [q_pad]
  load_tile_transposed({params.out, params.dtype,
                        batch * params.out_batch_stride + q0 * params.out_row_stride +
                            head * params.out_head_stride,
                        params.out_row_stride},
                       q_rows, head_dim, q_pad, head_dim, 1.0f, out_t, q_pad);
  load_tile_transposed({params.dout, params.dtype,
                        batch * params.dout_batch_stride + q0 * params.dout_row_stride +
                            head * params.dout_head_stride,
                        params.dout_row_stride},
                       q_rows, head_dim, q_pad, head_dim, 1.0f, dout_t, q_pad);
  for (int i = 0; i < q_pad; i += T::kLanes) {
    V sum = V{};
    for (int c = 0; c < head_dim; ++c) {
      sum += load_vec<V>(out_t + c * q_pad + i) * load_vec<V>(dout_t + c * q_pad + i);
    }
    store_vec(dot + i, sum);
  }
  const int64_t row = (batch * params.num_heads + head) * params.seqlen_q + q0;
  for (int i = 0; i < q_rows; ++i) params.delta[row + i] = dot[i] - params.dlse[row + i];
}

// Per-query statistics of one query block: lse_safe [q_pad] is lse, but +inf
// for a query that sees no key (lse = -inf) and for padding, so that
// exp(s - lse_safe) is 0 there (for finite s) rather than exp(s + inf). delta
// [q_pad] is 0 for padding. A NaN lse (a row whose softmax is undefined) stays
// NaN: its P and dS are NaN on the keys it sees.
JFLASH_INLINE void load_row_stats(const BwdParams& params, int64_t batch, int64_t head,
                                  int64_t q0, int q_rows, int q_pad, float* lse_safe,
                                  float* delta) {
  const int64_t row = (batch * params.num_heads + head) * params.seqlen_q + q0;
  for (int i = 0; i < q_rows; ++i) {
    const float lse = params.lse[row + i];
    lse_safe[i] = lse == -kInf ? kInf : lse;
    delta[i] = params.delta[row + i];
  }
  std::fill(lse_safe + q_rows, lse_safe + q_pad, kInf);
  std::fill(delta + q_rows, delta + q_pad, 0.0f);
}

// p_t[j][i] = exp(s_t[j][i] - lse_safe[i]), in place; s_t: [k_pad, q_pad].
template <class T>
JFLASH_INLINE void recompute_p(float* s_t, int k_pad, int q_pad, const float* lse_safe) {
  using V = typename T::Vec;
  for (int i = 0; i < q_pad; i += T::kLanes) {
    const V lse = load_vec<V>(lse_safe + i);
    for (int j = 0; j < k_pad; ++j) {
      float* s = s_t + j * q_pad + i;
      store_vec(s, exp_vec<T>(load_vec<V>(s) - lse));
    }
  }
}

// ds_t[j][i] = p_t[j][i] * (dp_t[j][i] - delta[i]), in place of dp_t: [k_pad, q_pad].
template <class T>
JFLASH_INLINE void compute_ds(const float* p_t, float* dp_t, int k_pad, int q_pad,
                              const float* delta) {
  using V = typename T::Vec;
  for (int i = 0; i < q_pad; i += T::kLanes) {
    const V delta_i = load_vec<V>(delta + i);
    for (int j = 0; j < k_pad; ++j) {
      float* dp = dp_t + j * q_pad + i;
      store_vec(dp, load_vec<V>(p_t + j * q_pad + i) * (load_vec<V>(dp) - delta_i));
    }
  }
}

// S^T = K (scale Q)^T, then P^T with the mask applied, for one (key tile, query
// tile). k_tile [k_pad, d_pad], q_t [d_pad, q_pad] -> p_t [k_pad, q_pad];
// with softcap also t_t [k_pad, q_pad], the tanh of each capped score
// (softcap_grad). Masked elements get P = 0 after the exponential, so that a
// NaN row's lse (or a NaN score of a key it does not see) leaves them 0.
// Returns whether the tile was masked: then dS needs the same (score_grad).
template <class T, class Mask>
JFLASH_INLINE bool probabilities(const BwdParams& params, const Mask& mask, int64_t q0,
                                 int q_rows, int q_pad, int64_t k0, int k_rows, int k_pad,
                                 int d_pad, const float* k_tile, const float* q_t,
                                 const float* lse_safe, float* p_t, float* t_t) {
  gemm<T, Accumulate::kOverwrite>(k_pad, q_pad, d_pad, k_tile, d_pad, 1, q_t, q_pad, p_t, q_pad);
  if (params.softcap > 0.0f) softcap_scores<T>(p_t, int64_t{k_pad} * q_pad, params.softcap, t_t);
  recompute_p<T>(p_t, k_pad, q_pad, lse_safe);
  const bool masked = tile_needs_mask(mask, q0, q_rows, k0, k_rows, k_pad);
  if (masked) {
    mask_any_tile(mask, params.seqlen_q, q0, q_rows, q_pad, k0, k_rows, k_pad, 0.0f, p_t);
  }
  return masked;
}

// dS^T of s = softmax_scale q.k from dP^T: P^T (dP^T - delta), times 1 - t^2
// with softcap; then 0 on the masked elements of a tile that probabilities()
// masked: P is 0 there, but dP - delta may be NaN (a NaN in v, a NaN row's
// delta), and so may t (a NaN score).
template <class T, class Mask>
JFLASH_INLINE void score_grad(const BwdParams& params, const Mask& mask, bool masked, int64_t q0,
                              int q_rows, int q_pad, int64_t k0, int k_rows, int k_pad,
                              const float* p_t, const float* t_t, const float* delta,
                              float* ds_t) {
  compute_ds<T>(p_t, ds_t, k_pad, q_pad, delta);
  if (params.softcap > 0.0f) softcap_grad<T>(ds_t, t_t, int64_t{k_pad} * q_pad);
  if (masked) mask_any_tile(mask, params.seqlen_q, q0, q_rows, q_pad, k0, k_rows, k_pad, 0.0f, ds_t);
}

JFLASH_INLINE TileRef q_tile_ref(const BwdParams& params, int64_t batch, int64_t head, int64_t q0) {
  return {params.q, params.dtype,
          batch * params.q_batch_stride + q0 * params.q_row_stride + head * params.q_head_stride,
          params.q_row_stride};
}

JFLASH_INLINE TileRef dout_tile_ref(const BwdParams& params, int64_t batch, int64_t head,
                                    int64_t q0) {
  return {params.dout, params.dtype,
          batch * params.dout_batch_stride + q0 * params.dout_row_stride +
              head * params.dout_head_stride,
          params.dout_row_stride};
}

// Loads the key tile [k0, k0 + k_rows) of k and v into k_tile, v_tile [k_pad, d_pad].
JFLASH_INLINE void load_kv(const BwdParams& params, int64_t batch, int64_t kv_head, int64_t k0,
                           int k_rows, int k_pad, int d_pad, float* k_tile, float* v_tile) {
  load_tile({params.k, params.dtype,
             batch * params.k_batch_stride + k0 * params.k_row_stride +
                 kv_head * params.k_head_stride,
             params.k_row_stride},
            k_rows, params.head_dim, k_pad, d_pad, 1.0f, k_tile, d_pad);
  load_tile({params.v, params.dtype,
             batch * params.v_batch_stride + k0 * params.v_row_stride +
                 kv_head * params.v_head_stride,
             params.v_row_stride},
            k_rows, params.head_dim, k_pad, d_pad, 1.0f, v_tile, d_pad);
}

template <class T, class Mask>
JFLASH_INLINE void dkdv_block(const BwdParams& params, int64_t task) {
  constexpr int block_q = T::kBwdBlockQ;
  static_assert(block_q <= kMaxTileRows);
  constexpr int block_k = T::kBwdBlockK;
  // Natural order: under a causal mask the first key blocks are seen by the
  // most queries, so the longest tasks are handed out first.
  const int num_k_blocks = (params.seqlen_k + block_k - 1) / block_k;
  const int64_t k0 = task % num_k_blocks * block_k;
  const int64_t kv_head = task / num_k_blocks % params.num_heads_kv;
  const int64_t batch = task / num_k_blocks / params.num_heads_kv;
  const int k_rows = static_cast<int>(std::min<int64_t>(block_k, params.seqlen_k - k0));
  const int k_pad = round_up(k_rows, T::kRows);
  const int head_dim = params.head_dim;
  const int d_pad = padded_head_dim<T>(head_dim);

  float* k_tile = thread_scratch(size_t{4} * (block_k + block_q) * d_pad +
                                 size_t{3} * block_k * block_q + 2 * block_q);  // [block_k, d_pad]
  float* v_tile = k_tile + block_k * d_pad;    // [block_k, d_pad]
  float* dk = v_tile + block_k * d_pad;        // [block_k, d_pad]
  float* dv = dk + block_k * d_pad;            // [block_k, d_pad]
  float* q_tile = dv + block_k * d_pad;        // [q_pad, d_pad]  softmax_scale * q
  float* q_t = q_tile + block_q * d_pad;       // [d_pad, q_pad]  the same, transposed
  float* do_tile = q_t + block_q * d_pad;      // [q_pad, d_pad]
  float* do_t = do_tile + block_q * d_pad;     // [d_pad, q_pad]
  float* p_t = do_t + block_q * d_pad;         // [k_pad, q_pad]
  float* ds_t = p_t + block_k * block_q;       // [k_pad, q_pad]  dP^T, then dS^T
  float* t_t = ds_t + block_k * block_q;       // [k_pad, q_pad]  tanh of the capped scores
  float* lse_safe = t_t + block_k * block_q;   // [q_pad]
  float* delta = lse_safe + block_q;           // [q_pad]

  load_kv(params, batch, kv_head, k0, k_rows, k_pad, d_pad, k_tile, v_tile);
  std::fill(dk, dk + k_pad * d_pad, 0.0f);
  std::fill(dv, dv + k_pad * d_pad, 0.0f);

  // Queries outside [q_begin, q_end) see none of these keys; blocks inside it
  // that see none (segment ids) are skipped.
  const Mask mask(params.mask, static_cast<int>(batch));
  const auto [q_begin, q_end] = mask.rows_of_keys(k0, k0 + k_rows, params.seqlen_q);
  for (int64_t head = kv_head * params.heads_per_kv; head < (kv_head + 1) * params.heads_per_kv;
       ++head) {
    for (int64_t q0 = q_begin; q0 < q_end; q0 += block_q) {
      const int q_rows = static_cast<int>(std::min<int64_t>(block_q, q_end - q0));
      if (tile_is_empty(mask, q0, q_rows, k0, k_rows)) continue;
      const int q_pad = round_up(q_rows, T::kAlign);
      const TileRef q_ref = q_tile_ref(params, batch, head, q0);
      const TileRef do_ref = dout_tile_ref(params, batch, head, q0);
      load_tile(q_ref, q_rows, head_dim, q_pad, d_pad, params.softmax_scale, q_tile, d_pad);
      load_tile_transposed(q_ref, q_rows, head_dim, q_pad, d_pad, params.softmax_scale, q_t,
                           q_pad);
      load_tile(do_ref, q_rows, head_dim, q_pad, d_pad, 1.0f, do_tile, d_pad);
      load_tile_transposed(do_ref, q_rows, head_dim, q_pad, d_pad, 1.0f, do_t, q_pad);
      load_row_stats(params, batch, head, q0, q_rows, q_pad, lse_safe, delta);

      const bool masked = probabilities<T>(params, mask, q0, q_rows, q_pad, k0, k_rows, k_pad,
                                           d_pad, k_tile, q_t, lse_safe, p_t, t_t);
      // dV += P^T dO: [k_pad, d_pad]
      gemm<T, Accumulate::kAdd>(k_pad, d_pad, q_pad, p_t, q_pad, 1, do_tile, d_pad, dv, d_pad);
      // dP^T = V dO^T: [k_pad, q_pad]
      gemm<T, Accumulate::kOverwrite>(k_pad, q_pad, d_pad, v_tile, d_pad, 1, do_t, q_pad, ds_t,
                                      q_pad);
      score_grad<T>(params, mask, masked, q0, q_rows, q_pad, k0, k_rows, k_pad, p_t, t_t, delta,
                    ds_t);
      // dK += dS^T (scale Q) = scale dS^T Q: [k_pad, d_pad]
      gemm<T, Accumulate::kAdd>(k_pad, d_pad, q_pad, ds_t, q_pad, 1, q_tile, d_pad, dk, d_pad);
    }
  }

  if (params.dkv_mode == DkvMode::kAddToAccum) {
    // The caller's float32 sums (params.h, DkvMode): dK (scaled, as dk), dV.
    float* accum = params.dkv_accum + batch * params.dkv_accum_batch_stride +
                   kv_head * params.dkv_accum_head_stride + k0 * params.dkv_accum_row_stride;
    for (int plane = 0; plane < 2; ++plane) {
      const float* tile = plane == 0 ? dk : dv;
      for (int i = 0; i < k_rows; ++i) {
        float* row = accum + plane * params.dkv_accum_plane_stride +
                     i * params.dkv_accum_row_stride;
        for (int c = 0; c < head_dim; ++c) row[c] += tile[i * d_pad + c];
      }
    }
    return;
  }
  store_tile(dk, d_pad, k_rows, head_dim, 1.0f, params.dtype, params.dk,
             batch * params.dk_batch_stride + k0 * params.dk_row_stride +
                 kv_head * params.dk_head_stride,
             params.dk_row_stride);
  store_tile(dv, d_pad, k_rows, head_dim, 1.0f, params.dtype, params.dv,
             batch * params.dv_batch_stride + k0 * params.dv_row_stride +
                 kv_head * params.dv_head_stride,
             params.dv_row_stride);
}

template <class T, class Mask>
JFLASH_INLINE void dq_block(const BwdParams& params, int64_t task) {
  constexpr int block_q = T::kBwdBlockQ;
  constexpr int block_k = T::kBwdBlockK;
  const auto [batch, head, kv_head, q0, q_rows] = query_block_task(params, task, block_q);
  const int q_pad = round_up(q_rows, T::kAlign);
  const int head_dim = params.head_dim;
  const int d_pad = padded_head_dim<T>(head_dim);

  float* q_t = thread_scratch(size_t{3} * q_pad * d_pad + size_t{2} * block_k * d_pad +
                              size_t{3} * block_k * q_pad + 2 * q_pad);  // [d_pad, q_pad]
  float* do_t = q_t + d_pad * q_pad;          // [d_pad, q_pad]
  float* dq = do_t + d_pad * q_pad;           // [q_pad, d_pad]
  float* k_tile = dq + q_pad * d_pad;         // [block_k, d_pad]
  float* v_tile = k_tile + block_k * d_pad;   // [block_k, d_pad]
  float* p_t = v_tile + block_k * d_pad;      // [block_k, q_pad]
  float* ds_t = p_t + block_k * q_pad;        // [block_k, q_pad]  dP^T, then dS^T
  float* t_t = ds_t + block_k * q_pad;        // [block_k, q_pad]  tanh of the capped scores
  float* lse_safe = t_t + block_k * q_pad;    // [q_pad]
  float* delta = lse_safe + q_pad;            // [q_pad]

  load_tile_transposed(q_tile_ref(params, batch, head, q0), q_rows, head_dim, q_pad, d_pad,
                       params.softmax_scale, q_t, q_pad);
  load_tile_transposed(dout_tile_ref(params, batch, head, q0), q_rows, head_dim, q_pad, d_pad,
                       1.0f, do_t, q_pad);
  load_row_stats(params, batch, head, q0, q_rows, q_pad, lse_safe, delta);
  std::fill(dq, dq + q_pad * d_pad, 0.0f);

  const Mask mask(params.mask, static_cast<int>(batch));
  const auto [key_begin, key_end] = mask.keys_of_rows(q0, q0 + q_rows, params.seqlen_k);
  for (int64_t k0 = key_begin; k0 < key_end; k0 += block_k) {
    const int k_rows = static_cast<int>(std::min<int64_t>(block_k, key_end - k0));
    if (tile_is_empty(mask, q0, q_rows, k0, k_rows)) continue;
    const int k_pad = round_up(k_rows, T::kRows);
    load_kv(params, batch, kv_head, k0, k_rows, k_pad, d_pad, k_tile, v_tile);
    const bool masked = probabilities<T>(params, mask, q0, q_rows, q_pad, k0, k_rows, k_pad,
                                         d_pad, k_tile, q_t, lse_safe, p_t, t_t);
    // dP^T = V dO^T: [k_pad, q_pad]
    gemm<T, Accumulate::kOverwrite>(k_pad, q_pad, d_pad, v_tile, d_pad, 1, do_t, q_pad, ds_t,
                                    q_pad);
    score_grad<T>(params, mask, masked, q0, q_rows, q_pad, k0, k_rows, k_pad, p_t, t_t, delta,
                  ds_t);
    // dQ += dS K: [q_pad, d_pad]; a(i, j) = ds_t[j][i]. softmax_scale at the store.
    gemm<T, Accumulate::kAdd>(q_pad, d_pad, k_pad, ds_t, 1, q_pad, k_tile, d_pad, dq, d_pad);
  }

  if (params.dq_mode == DqMode::kWrite) {
    store_tile(dq, d_pad, q_rows, head_dim, params.softmax_scale, params.dtype, params.dq,
               batch * params.dq_batch_stride + q0 * params.dq_row_stride +
                   head * params.dq_head_stride,
               params.dq_row_stride);
    return;
  }
  // The caller's float32 dq_accum, without softmax_scale (params.h, DqMode).
  float* accum = params.dq_accum + batch * params.dq_accum_batch_stride +
                 head * params.dq_accum_head_stride + q0 * params.dq_accum_row_stride;
  const bool add = params.dq_mode == DqMode::kAddToAccum;
  for (int i = 0; i < q_rows; ++i) {
    float* row = accum + i * params.dq_accum_row_stride;
    for (int c = 0; c < head_dim; ++c) row[c] = (add ? row[c] : 0.0f) + dq[i * d_pad + c];
  }
}

enum class BwdPass { kDelta, kDkDv, kDq };

template <class T, class Mask>
JFLASH_INLINE void bwd_pass(const BwdParams& params, BwdPass pass, int64_t task) {
  switch (pass) {
    case BwdPass::kDelta: return delta_block<T>(params, task);
    case BwdPass::kDkDv: return dkdv_block<T, Mask>(params, task);
    case BwdPass::kDq: return dq_block<T, Mask>(params, task);
  }
}

template <class T>
JFLASH_INLINE void bwd_task(const BwdParams& params, MaskKind mask, BwdPass pass, int64_t task) {
  switch (mask) {
    case MaskKind::kNone: return bwd_pass<T, NoMask>(params, pass, task);
    case MaskKind::kBand: return bwd_pass<T, BandMask>(params, pass, task);
    case MaskKind::kSegments: return bwd_pass<T, SegmentMask>(params, pass, task);
  }
}

// One non-template entry per row of the tile table, compiled for its instruction set.
#if JFLASH_X86
JFLASH_TARGET_AVX512 void bwd_task_avx512(const BwdParams& params, MaskKind mask, BwdPass pass,
                                          int64_t task) {
  bwd_task<Avx512Tiles>(params, mask, pass, task);
}
JFLASH_TARGET_AVX2 void bwd_task_avx2(const BwdParams& params, MaskKind mask, BwdPass pass,
                                      int64_t task) {
  bwd_task<Avx2Tiles>(params, mask, pass, task);
}
#endif
void bwd_task_baseline(const BwdParams& params, MaskKind mask, BwdPass pass, int64_t task) {
  bwd_task<BaselineTiles>(params, mask, pass, task);
}

int64_t ceil_div(int64_t x, int64_t y) { return (x + y - 1) / y; }

template <class T>
void run_bwd(const BwdParams& params, MaskKind mask,
             void (*entry)(const BwdParams&, MaskKind, BwdPass, int64_t)) {
  const int64_t q_tasks = int64_t{params.batch} * params.num_heads *
                          ceil_div(params.seqlen_q, T::kBwdBlockQ);
  const int64_t k_tasks = int64_t{params.batch} * params.num_heads_kv *
                          ceil_div(params.seqlen_k, T::kBwdBlockK);
  if (params.dq_mode != DqMode::kAddToAccum) {  // else delta is the caller's
    parallel_for(q_tasks, [&](int64_t task) { entry(params, mask, BwdPass::kDelta, task); });
  }
  // dk/dv and dq both only read delta, so they share one job: no thread idles
  // at a barrier between them.
  parallel_for(k_tasks + q_tasks, [&](int64_t task) {
    if (task < k_tasks) {
      entry(params, mask, BwdPass::kDkDv, task);
    } else {
      entry(params, mask, BwdPass::kDq, task - k_tasks);
    }
  });
}

}  // namespace

void flash_bwd(const BwdParams& params, MaskKind mask) {
  switch (cpu_tiles()) {
#if JFLASH_X86
    case CpuTiles::kAvx512:
      return run_bwd<Avx512Tiles>(params, mask, bwd_task_avx512);
    case CpuTiles::kAvx2:
      return run_bwd<Avx2Tiles>(params, mask, bwd_task_avx2);
#endif
    default:
      return run_bwd<BaselineTiles>(params, mask, bwd_task_baseline);
  }
}

}  // namespace jflash::cpu

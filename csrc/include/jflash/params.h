// The plain parameter structs every jflash kernel sees (CPU and CUDA alike).
//
// The FFI layer (csrc/ffi/) turns XLA buffers and attributes into one of these
// structs and validates it; kernels never see an XLA type. Tensors are dense
// and row-major in the layout of jax.nn.dot_product_attention:
//
//   q, out, dout, dq : [batch, seqlen_q, num_heads,    head_dim]
//   k, v, dk, dv     : [batch, seqlen_k, num_heads_kv, head_dim]
//   lse, dlse, delta : [batch, num_heads, seqlen_q]          (float32)
//   dq_accum         : [batch, num_heads, seqlen_q, head_dim] (float32 scratch),
//                      or the caller's [batch, rows, num_heads, head_dim]
//                      (BwdParams::dq_mode)
//   dq_semaphore     : [batch, num_heads, dq_semaphore_slots(seqlen_q)] (int32
//                      scratch, deterministic mode only)
//   dkv_accum        : [batch, num_heads_kv, 2, seqlen_k, head_dim] (float32
//                      scratch, GQA only: dK then dV of each kv head), or the
//                      caller's [batch, 2, rows, num_heads_kv, head_dim]
//                      (BwdParams::dkv_mode)
//
// Strides are in elements (not bytes) and int64 so that batch * seq * heads *
// head_dim never overflows; the last (head_dim) stride is always 1.
#pragma once

#include <cstdint>

#include "jflash/mask.h"
#include "jflash/score.h"

namespace jflash {

enum class DType : int { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2 };

struct FwdParams {
  DType dtype;
  // Logit soft-capping (jflash/score.h): > 0 caps the scores at +-softcap, 0
  // leaves them as they are. This field and softcap_scale sit in what were
  // alignment holes, so that no other field moved: the kernels without softcap
  // compile to the same code as before them.
  float softcap;

  const void* q;
  const void* k;
  const void* v;
  void* out;
  float* lse;  // natural log; -inf for a row that sees no key

  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t out_batch_stride, out_row_stride, out_head_stride;

  int batch;
  int seqlen_q;
  int seqlen_k;
  int num_heads;
  int num_heads_kv;  // num_heads % num_heads_kv == 0 (GQA/MQA)
  int head_dim;

  // Query head h reads kv head h / heads_per_kv.
  int heads_per_kv;

  float softmax_scale;  // applied to q.k before the softmax
  // The factor that takes a CUDA kernel's score into the log2 domain of its
  // exp2-based softmax: softmax_scale * log2(e), or softcap * log2(e) with
  // softcap (the score is then tanh(softcap_scale * q.k); jflash/score.h).
  float softmax_scale_log2;
  // softmax_scale / softcap: the factor on q.k inside the tanh (0 without softcap).
  float softcap_scale;

  MaskParams mask;  // read through a policy (jflash/mask.h)

  // The kernels' dispatch key for the score (beside params.mask.kind()).
  ScoreKind score_kind() const { return softcap > 0.f ? ScoreKind::kSoftcap : ScoreKind::kPlain; }

  // float32 inputs on CUDA: tensor-core passes per product, 1 (TF32: operands
  // rounded to 10 mantissa bits) or 3 (3xTF32: each operand split into a TF32
  // high and low part, for float32-class products). Last in the struct, so
  // that no other field moved. The half-precision kernels and the CPU kernels
  // (float32 arithmetic) ignore it.
  int tf32_passes = 1;

  // int32 scratch of the Hopper forward under segment ids: the counter its
  // CTAs take work units from (zeroed by the launcher); null elsewhere.
  int* tile_counter = nullptr;
};

// Counters per (batch, head) in dq_semaphore: two per 32 query rows, enough for
// every backward tile (query blocks of >= 32 rows, at most two dQ column slices
// per block). jflash/_src/kernel_calls.py sizes the scratch by the same rule.
constexpr int64_t kDqSemaphoreRows = 32;
constexpr int64_t dq_semaphore_slots(int64_t seqlen_q) {
  return 2 * ((seqlen_q + kDqSemaphoreRows - 1) / kDqSemaphoreRows);
}

enum class DqMode : int { kWrite = 0, kReturnAccum = 1, kAddToAccum = 2 };
enum class DkvMode : int { kWrite = 0, kAddToAccum = 1 };

struct BwdParams : FwdParams {
  const void* dout;
  const float* dlse;  // gradient flowing into lse (zeros when lse is unused)
  void* dq;
  void* dk;
  void* dv;
  // float32 dq without softmax_scale, at the dq_accum_* strides below: the
  // CUDA kernels' scratch in DqMode::kWrite (null on CPU, whose kernels then
  // do not use it), the caller's otherwise.
  float* dq_accum;
  // rowsum(dout * out) - dlse, [batch, num_heads, seqlen_q]: computed first
  // (float32 scratch), or the caller's in DqMode::kAddToAccum.
  float* delta;
  // Deterministic mode (non-null): one counter per (batch, head, query block,
  // dQ column slice) that orders the CUDA kernels' dQ additions by key block,
  // so that dq is bit-identical from run to run. Null: additions in any order
  // (faster). The CPU kernels are deterministic either way and ignore it.
  int* dq_semaphore;
  // float32 dK and dV sums (dK with softmax_scale, as dk), at the dkv_accum_*
  // strides below. DkvMode::kWrite: the CUDA kernels' scratch for GQA
  // (heads_per_kv > 1; null otherwise, and on CPU), [batch, num_heads_kv, 2,
  // seqlen_k, head_dim]: with it a CUDA launcher may split a kv head's query
  // heads over head_splits CTAs per key block, which add their partial dK, dV
  // here, where one CTA per key block would leave SMs idle or run a long
  // causal key block alone at the end. DkvMode::kAddToAccum: the caller's.
  float* dkv_accum;
  // Set by the launcher (1 from the FFI layer): CTAs per (key block, kv head),
  // each taking heads_per_kv / head_splits query heads. > 1 only with
  // dkv_accum and outside deterministic mode.
  int head_splits;
  // Set by the launcher (1 from the FFI layer): (batch, kv head) rows per
  // group of the Hopper backward's launch order (sm90/tile_scheduler_sm90.h).
  int launch_group;

  int64_t dout_batch_stride, dout_row_stride, dout_head_stride;
  int64_t dq_batch_stride, dq_row_stride, dq_head_stride;
  int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
  int64_t dv_batch_stride, dv_row_stride, dv_head_stride;

  // Where dq goes (DqMode). kWrite: the CUDA kernels zero dq_accum, add dS K
  // into it and write dq = softmax_scale * dq_accum in the input dtype.
  // kReturnAccum: the same, but dq_accum (float32, without softmax_scale) is
  // the caller's result and dq is not written. kAddToAccum: dq_accum is the
  // caller's running sum, which the kernels add into, and delta is the
  // caller's (no preprocess pass): the steps of a context-parallel ring share
  // one accumulator and one delta instead of zeroing, converting and adding
  // per step. The CPU kernels follow the same rules (on CPU dq_accum is used
  // only by the last two modes). Last in the struct, so that no field moved.
  DqMode dq_mode = DqMode::kWrite;
  // dq_accum's strides in elements (its head_dim stride is 1): dense [batch,
  // num_heads, seqlen_q, head_dim] with kWrite; the caller's [batch, rows,
  // num_heads, head_dim] otherwise, q's layout, so that its dq is the sum
  // scaled and rounded, not transposed too (with kAddToAccum, rows may exceed
  // seqlen_q and dq_accum points at this call's first row).
  int64_t dq_accum_batch_stride = 0, dq_accum_row_stride = 0, dq_accum_head_stride = 0;

  // Where dK and dV go (DkvMode). kWrite: dk and dv in the input dtype
  // (through dkv_accum where the launcher splits GQA groups). kAddToAccum:
  // dkv_accum is the caller's running sums, [batch, 2, rows, num_heads_kv,
  // head_dim] (dK then dV, each in k's layout; this call's keys are its first
  // seqlen_k rows), which the kernels add into; dk and dv are not written.
  // The steps of a context-parallel ring add into the sums that travel with
  // their K/V block instead of writing, converting and adding per step.
  DkvMode dkv_mode = DkvMode::kWrite;
  // dkv_accum's strides in elements (head_dim stride 1); plane: dK to dV.
  int64_t dkv_accum_batch_stride = 0, dkv_accum_plane_stride = 0, dkv_accum_row_stride = 0,
          dkv_accum_head_stride = 0;

  // The kernels add float32 dK, dV into dkv_accum (a split group's partial
  // sums, or the caller's running ones) instead of writing dk, dv.
  constexpr bool adds_dkv() const {
    return head_splits > 1 || dkv_mode == DkvMode::kAddToAccum;
  }
};

// Length of dq_semaphore in deterministic mode (the handler checks it, the
// preprocess zeroes it).
constexpr int64_t dq_semaphore_count(const BwdParams& p) {
  return int64_t{p.batch} * p.num_heads * dq_semaphore_slots(p.seqlen_q);
}

// Length of dkv_accum as the CUDA kernels' scratch (GQA, DkvMode::kWrite).
constexpr int64_t dkv_accum_count(const BwdParams& p) {
  return int64_t{p.batch} * p.num_heads_kv * 2 * p.seqlen_k * p.head_dim;
}

// Decode: a few query rows per sequence against a KV cache
// (jflash.flash_attention_with_kvcache; jflash/decode.h has the rules every
// decode kernel shares):
//
//   q, out           : [batch, seqlen_q, num_heads, head_dim]
//   k_cache, v_cache : [num_cache_blocks, block_size, num_heads_kv, head_dim];
//                      a contiguous cache [batch, capacity, ...] is one block
//                      per sequence (block_table null: sequence b is block b)
//   block_table      : [batch, max_blocks_per_seq] int32, or null
//   cache_seqlens    : [batch] int32, the keys held before the append
//   k_new, v_new     : [batch, seqlen_new, num_heads_kv, head_dim], or null
//                      (seqlen_new 0): the keys appended at cache_seqlens[b]
//   lse              : [batch, num_heads, seqlen_q] float32
//   out_partial      : [num_splits, batch, num_heads, seqlen_q, head_dim] and
//   lse_partial      : [num_splits, batch, num_heads, seqlen_q] float32
//                      scratch, each key-range split's result (num_splits > 1)
//
// Sequence b attends over its first cache_seqlens[b] + seqlen_new keys, the
// new ones read from k_new and v_new (and written into the cache), so that no
// kernel reads a cache row that a kernel of the same call writes.
struct DecodeParams {
  DType dtype;

  const void* q;
  void* k_cache;  // the aliased output buffers: read, and the new rows written
  void* v_cache;
  const void* k_new;
  const void* v_new;
  const int32_t* cache_seqlens;
  const int32_t* block_table;
  void* out;
  float* lse;
  float* out_partial;
  float* lse_partial;

  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t out_batch_stride, out_row_stride, out_head_stride;
  // k_cache and v_cache share one shape, hence one set of strides; so do
  // k_new and v_new.
  int64_t cache_block_stride, cache_row_stride, cache_head_stride;
  int64_t new_batch_stride, new_row_stride, new_head_stride;

  int batch;
  int seqlen_q;
  int seqlen_new;
  int num_heads;
  int num_heads_kv;
  int heads_per_kv;  // query head h reads kv head h / heads_per_kv
  int head_dim;
  int block_size;          // cache rows per block
  int num_cache_blocks;    // block ids are clamped to [0, num_cache_blocks)
  int max_blocks_per_seq;  // capacity = max_blocks_per_seq * block_size keys
  int num_splits;          // key-range splits per (batch, kv head, row block)

  float softmax_scale;
  float softmax_scale_log2;
  float softcap;  // > 0: scores become softcap * tanh(score / softcap); 0: none
  // causal and window_size as a band aligned bottom-right to each sequence's
  // length (mask.h, bottom_right_band); -1: unbounded. causal is right = 0.
  int64_t window_left;
  int64_t window_right;
};

}  // namespace jflash

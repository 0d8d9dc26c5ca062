// The plain parameter structs every jflash kernel sees (CPU and CUDA alike).
//
// The FFI layer (csrc/ffi/) turns XLA buffers and attributes into one of these
// structs and validates it; kernels never see an XLA type. Tensors are dense
// and row-major in the layout of jax.nn.dot_product_attention:
//
//   q, out, dout, dq : [batch, seqlen_q, num_heads,    head_dim]
//   k, v, dk, dv     : [batch, seqlen_k, num_heads_kv, head_dim]
//   lse, dlse, delta : [batch, num_heads, seqlen_q]          (float32)
//   dq_accum         : [batch, num_heads, seqlen_q, head_dim] (float32 scratch)
//   dq_semaphore     : [batch, num_heads, dq_semaphore_slots(seqlen_q)] (int32
//                      scratch, deterministic mode only)
//   dkv_accum        : [batch, num_heads_kv, 2, seqlen_k, head_dim] (float32
//                      scratch, GQA only: dK then dV of each kv head)
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
};

// Counters per (batch, head) in dq_semaphore: two per 32 query rows, enough for
// every backward tile (query blocks of >= 32 rows, at most two dQ column slices
// per block). jflash/_src/kernel_calls.py sizes the scratch by the same rule.
constexpr int64_t kDqSemaphoreRows = 32;
constexpr int64_t dq_semaphore_slots(int64_t seqlen_q) {
  return 2 * ((seqlen_q + kDqSemaphoreRows - 1) / kDqSemaphoreRows);
}

struct BwdParams : FwdParams {
  const void* dout;
  const float* dlse;  // gradient flowing into lse (zeros when lse is unused)
  void* dq;
  void* dk;
  void* dv;
  // float32 scratch of the CUDA kernels, [batch, num_heads, seqlen_q, head_dim];
  // null on CPU, whose kernels do not use it.
  float* dq_accum;
  float* delta;     // float32 scratch, rowsum(dout * out) - dlse, [batch, num_heads, seqlen_q]
  // Deterministic mode (non-null): one counter per (batch, head, query block,
  // dQ column slice) that orders the CUDA kernels' dQ additions by key block,
  // so that dq is bit-identical from run to run. Null: additions in any order
  // (faster). The CPU kernels are deterministic either way and ignore it.
  int* dq_semaphore;
  // GQA (heads_per_kv > 1; null otherwise, and on CPU): float32 dK and dV sums
  // of each kv head, [batch, num_heads_kv, 2, seqlen_k, head_dim]. With it a
  // CUDA launcher may split a kv head's query heads over head_splits CTAs per
  // key block, which add their partial dK, dV here, where one CTA per key block
  // would leave SMs idle or run a long causal key block alone at the end.
  float* dkv_accum;
  // Set by the launcher (1 from the FFI layer): CTAs per (key block, kv head),
  // each taking heads_per_kv / head_splits query heads. > 1 only with
  // dkv_accum and outside deterministic mode.
  int head_splits;

  int64_t dout_batch_stride, dout_row_stride, dout_head_stride;
  int64_t dq_batch_stride, dq_row_stride, dq_head_stride;
  int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
  int64_t dv_batch_stride, dv_row_stride, dv_head_stride;
};

// Length of dq_semaphore in deterministic mode (the handler checks it, the
// preprocess zeroes it).
constexpr int64_t dq_semaphore_count(const BwdParams& p) {
  return int64_t{p.batch} * p.num_heads * dq_semaphore_slots(p.seqlen_q);
}

// Length of dkv_accum where it is used (GQA on CUDA).
constexpr int64_t dkv_accum_count(const BwdParams& p) {
  return int64_t{p.batch} * p.num_heads_kv * 2 * p.seqlen_k * p.head_dim;
}

}  // namespace jflash

// XLA FFI handlers for platform "cpu": jflash_fwd_v5, jflash_bwd_v8,
// jflash_decode_v1 and jflash_decode_append_v1.
//
// The CUDA handlers (csrc/ffi/cuda_handlers.cu) bind the same arguments in the
// same order under the same target names, so one jax.ffi.ffi_call lowers for
// either platform.
#include "cpu/flash_cpu.h"
#include "cpu/thread_pool.h"
#include "ffi/bindings.h"
#include "ffi/decode_params_from_ffi.h"
#include "ffi/params_from_ffi.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jflash {
namespace {

ffi::Error FwdCpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer q_segment_ids,
                  ffi::AnyBuffer kv_segment_ids, ffi::AnyBuffer q_segment_blocks,
                  ffi::AnyBuffer kv_segment_blocks, ffi::AnyBuffer q_segment_ranges,
                  ffi::AnyBuffer kv_segment_ranges, ffi::Result<ffi::AnyBuffer> out,
                  ffi::Result<ffi::AnyBuffer> lse,
                  ffi::Result<ffi::AnyBuffer> /*tile_counter: the CUDA kernels' scratch*/,
                  float softmax_scale, int64_t diag_lo, int64_t diag_hi, float softcap,
                  int64_t tf32_passes) {
  FwdParams params;
  const ffi_glue::SegmentBuffers segments{q_segment_ids,    kv_segment_ids,   q_segment_blocks,
                                          kv_segment_blocks, q_segment_ranges, kv_segment_ranges};
  if (auto err = ffi_glue::FillFwdParams(q, k, v, segments, *out, *lse, softmax_scale, diag_lo,
                                         diag_hi, softcap, &params);
      err.failure()) {
    return err;
  }
  if (auto err = ffi_glue::SetTf32Passes(tf32_passes, &params); err.failure()) return err;
  cpu::flash_fwd(params, params.mask.kind(params.seqlen_q, params.seqlen_k));
  return ffi::Error::Success();
}

ffi::Error BwdCpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out,
                  ffi::AnyBuffer dout, ffi::AnyBuffer lse, ffi::AnyBuffer dlse,
                  ffi::AnyBuffer q_segment_ids, ffi::AnyBuffer kv_segment_ids,
                  ffi::AnyBuffer q_segment_blocks, ffi::AnyBuffer kv_segment_blocks,
                  ffi::AnyBuffer q_segment_ranges, ffi::AnyBuffer kv_segment_ranges,
                  ffi::AnyBuffer delta_in, ffi::AnyBuffer dq_accum_in,
                  ffi::AnyBuffer dkv_accum_in,
                  ffi::Result<ffi::AnyBuffer> dq,
                  ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                  ffi::Result<ffi::AnyBuffer> dq_accum, ffi::Result<ffi::AnyBuffer> delta,
                  ffi::Result<ffi::AnyBuffer> dq_semaphore, ffi::Result<ffi::AnyBuffer> dkv_accum,
                  float softmax_scale, int64_t diag_lo, int64_t diag_hi, float softcap,
                  int64_t tf32_passes, int64_t dq_mode, int64_t dq_accum_row_offset,
                  int64_t dkv_mode) {
  BwdParams params;
  const ffi_glue::SegmentBuffers segments{q_segment_ids,    kv_segment_ids,   q_segment_blocks,
                                          kv_segment_blocks, q_segment_ranges, kv_segment_ranges};
  if (auto err = ffi_glue::FillBwdParams(q, k, v, out, dout, lse, dlse, segments, delta_in,
                                         dq_accum_in, dkv_accum_in, *dq, *dk, *dv, *dq_accum,
                                         *delta, *dq_semaphore, *dkv_accum, softmax_scale,
                                         diag_lo, diag_hi, softcap, dq_mode,
                                         dq_accum_row_offset, dkv_mode, &params,
                                         /*uses_dq_accum=*/false);
      err.failure()) {
    return err;
  }
  if (auto err = ffi_glue::SetTf32Passes(tf32_passes, &params); err.failure()) return err;
  cpu::flash_bwd(params, params.mask.kind(params.seqlen_q, params.seqlen_k));
  return ffi::Error::Success();
}

ffi::Error DecodeCpu(const ffi_glue::DecodeBuffers& buffers, const ffi_glue::DecodeAttrs& attrs) {
  DecodeParams params;
  if (auto err = ffi_glue::FillDecodeParams(buffers, attrs, &params); err.failure()) return err;
  cpu::flash_decode(params);
  return ffi::Error::Success();
}

ffi::Error DecodeNoAppendCpu(ffi::AnyBuffer q, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                             ffi::AnyBuffer cache_seqlens, ffi::AnyBuffer block_table,
                             ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse,
                             ffi::Result<ffi::AnyBuffer> out_partial,
                             ffi::Result<ffi::AnyBuffer> lse_partial, float softmax_scale,
                             float softcap, int64_t window_left, int64_t window_right,
                             int64_t num_splits) {
  return DecodeCpu({q, k_cache, v_cache, nullptr, nullptr, cache_seqlens, block_table, *out, *lse,
                    nullptr, nullptr, *out_partial, *lse_partial},
                   {softmax_scale, softcap, window_left, window_right, num_splits});
}

ffi::Error DecodeAppendCpu(ffi::AnyBuffer q, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                           ffi::AnyBuffer k_new, ffi::AnyBuffer v_new, ffi::AnyBuffer cache_seqlens,
                           ffi::AnyBuffer block_table, ffi::Result<ffi::AnyBuffer> out,
                           ffi::Result<ffi::AnyBuffer> lse, ffi::Result<ffi::AnyBuffer> k_cache_out,
                           ffi::Result<ffi::AnyBuffer> v_cache_out,
                           ffi::Result<ffi::AnyBuffer> out_partial,
                           ffi::Result<ffi::AnyBuffer> lse_partial, float softmax_scale,
                           float softcap, int64_t window_left, int64_t window_right,
                           int64_t num_splits) {
  return DecodeCpu({q, k_cache, v_cache, &k_new, &v_new, cache_seqlens, block_table, *out, *lse,
                    &*k_cache_out, &*v_cache_out, *out_partial, *lse_partial},
                   {softmax_scale, softcap, window_left, window_right, num_splits});
}

}  // namespace
}  // namespace jflash

// The decode heuristic's split count on this CPU (jflash/_src/ffi.py), for a
// call of `batch` sequences, num_heads_kv kv heads, rows (query heads per kv
// head times queries) and caches of `capacity` keys: the pool's threads are
// the slots (jflash/decode.h); a task's fixed cost and the combine's are
// taken as one key tile each.
extern "C" __attribute__((visibility("default"))) int jflash_cpu_decode_num_splits(
    int64_t batch, int64_t num_heads_kv, int64_t rows, int64_t capacity) {
  const int64_t row_blocks = (rows + jflash::cpu::decode_row_block() - 1) /
                             jflash::cpu::decode_row_block();
  const int tile = jflash::cpu::decode_key_block();
  return jflash::decode_num_splits(batch * num_heads_kv * row_blocks,
                                   jflash::cpu::pool_threads(), 1, capacity, {tile, tile, tile});
}

// The CUDA kernel's split heuristic for `units` CTAs' work (batch x kv heads
// x row blocks), `sms` SMs of `per_sm` CTAs each and caches of `capacity`
// keys, without a GPU (jflash/_src/ffi.py: decode_num_splits_cuda_model): for
// tests and the design notes' tables (jflash/decode.h, kCudaDecodeSplitCost).
extern "C" __attribute__((visibility("default"))) int jflash_decode_num_splits_cuda_model(
    int64_t units, int64_t sms, int64_t per_sm, int64_t capacity) {
  return jflash::decode_num_splits(units, sms, per_sm, capacity, jflash::kCudaDecodeSplitCost);
}

// The library is built with hidden visibility; export the handler symbols
// that jflash/_src/ffi.py looks up.
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* JflashFwdCpu(XLA_FFI_CallFrame*);
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* JflashBwdCpu(XLA_FFI_CallFrame*);
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* JflashDecodeCpu(XLA_FFI_CallFrame*);
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* JflashDecodeAppendCpu(
    XLA_FFI_CallFrame*);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JflashFwdCpu, jflash::FwdCpu,
                              jflash::ffi_glue::BindFwd(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JflashBwdCpu, jflash::BwdCpu,
                              jflash::ffi_glue::BindBwd(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JflashDecodeCpu, jflash::DecodeNoAppendCpu,
                              jflash::ffi_glue::BindDecode(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JflashDecodeAppendCpu, jflash::DecodeAppendCpu,
                              jflash::ffi_glue::BindDecodeAppend(ffi::Ffi::Bind()));

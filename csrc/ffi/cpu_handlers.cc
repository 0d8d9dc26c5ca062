// XLA FFI handlers for platform "cpu": jflash_fwd_v3 and jflash_bwd_v5.
//
// The CUDA handlers (csrc/ffi/cuda_handlers.cu) bind the same arguments in the
// same order under the same target names, so one jax.ffi.ffi_call lowers for
// either platform.
#include "cpu/flash_cpu.h"
#include "ffi/bindings.h"
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
                  float softmax_scale, int64_t diag_lo, int64_t diag_hi, float softcap) {
  FwdParams params;
  const ffi_glue::SegmentBuffers segments{q_segment_ids,    kv_segment_ids,   q_segment_blocks,
                                          kv_segment_blocks, q_segment_ranges, kv_segment_ranges};
  if (auto err = ffi_glue::FillFwdParams(q, k, v, segments, *out, *lse, softmax_scale, diag_lo,
                                         diag_hi, softcap, &params);
      err.failure()) {
    return err;
  }
  cpu::flash_fwd(params, params.mask.kind(params.seqlen_q, params.seqlen_k));
  return ffi::Error::Success();
}

ffi::Error BwdCpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out,
                  ffi::AnyBuffer dout, ffi::AnyBuffer lse, ffi::AnyBuffer dlse,
                  ffi::AnyBuffer q_segment_ids, ffi::AnyBuffer kv_segment_ids,
                  ffi::AnyBuffer q_segment_blocks, ffi::AnyBuffer kv_segment_blocks,
                  ffi::AnyBuffer q_segment_ranges, ffi::AnyBuffer kv_segment_ranges,
                  ffi::Result<ffi::AnyBuffer> dq,
                  ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                  ffi::Result<ffi::AnyBuffer> dq_accum, ffi::Result<ffi::AnyBuffer> delta,
                  ffi::Result<ffi::AnyBuffer> dq_semaphore, ffi::Result<ffi::AnyBuffer> dkv_accum,
                  float softmax_scale, int64_t diag_lo, int64_t diag_hi, float softcap) {
  BwdParams params;
  const ffi_glue::SegmentBuffers segments{q_segment_ids,    kv_segment_ids,   q_segment_blocks,
                                          kv_segment_blocks, q_segment_ranges, kv_segment_ranges};
  if (auto err = ffi_glue::FillBwdParams(q, k, v, out, dout, lse, dlse, segments, *dq, *dk, *dv,
                                         *dq_accum, *delta, *dq_semaphore, *dkv_accum,
                                         softmax_scale, diag_lo, diag_hi, softcap, &params,
                                         /*uses_dq_accum=*/false);
      err.failure()) {
    return err;
  }
  cpu::flash_bwd(params, params.mask.kind(params.seqlen_q, params.seqlen_k));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jflash

// The library is built with hidden visibility; export the two handler symbols
// that jflash/_src/ffi.py looks up.
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* JflashFwdCpu(XLA_FFI_CallFrame*);
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* JflashBwdCpu(XLA_FFI_CallFrame*);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JflashFwdCpu, jflash::FwdCpu,
                              jflash::ffi_glue::BindFwd(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JflashBwdCpu, jflash::BwdCpu,
                              jflash::ffi_glue::BindBwd(ffi::Ffi::Bind()));

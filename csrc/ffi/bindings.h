// The ABI of jflash_fwd_v3 and jflash_bwd_v5, written once: arguments, results
// and attributes in the order jflash/_src/kernel_calls.py passes them. Each
// platform passes in Ffi::Bind() with its own context (the CUDA stream) already
// bound, so the two platforms cannot drift apart. Changing this list changes
// the ABI: bump the version suffix in jflash/_src/ffi.py.
#pragma once

#include <cstdint>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jflash::ffi_glue {

namespace ffi = xla::ffi;

template <typename Binding>
auto BindFwd(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()  // q    [batch..., seqlen_q, num_heads, head_dim]
      .template Arg<ffi::AnyBuffer>()            // k    [batch..., seqlen_k, num_heads_kv, head_dim]
      .template Arg<ffi::AnyBuffer>()            // v    like k
      .template Arg<ffi::AnyBuffer>()            // q_segment_ids  [batch..., seqlen_q] int32, or empty
      .template Arg<ffi::AnyBuffer>()            // kv_segment_ids [batch..., seqlen_k] int32, or empty
      .template Arg<ffi::AnyBuffer>()            // q_segment_blocks  [batch..., blocks, 4] int32, or empty
      .template Arg<ffi::AnyBuffer>()            // kv_segment_blocks [batch..., blocks, 4] int32, or empty
      .template Arg<ffi::AnyBuffer>()            // q_segment_ranges  [batch..., seqlen_q, 2] int32, or empty
      .template Arg<ffi::AnyBuffer>()            // kv_segment_ranges [batch..., seqlen_k, 2] int32, or empty
      .template Ret<ffi::AnyBuffer>()            // out  like q
      .template Ret<ffi::AnyBuffer>()            // lse  [batch..., num_heads, seqlen_q] float32
      .template Attr<float>("softmax_scale")
      .template Attr<int64_t>("diag_lo")
      .template Attr<int64_t>("diag_hi")
      .template Attr<float>("softcap");  // 0: none (jflash/score.h)
}

template <typename Binding>
auto BindBwd(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()  // q
      .template Arg<ffi::AnyBuffer>()            // k
      .template Arg<ffi::AnyBuffer>()            // v
      .template Arg<ffi::AnyBuffer>()            // out
      .template Arg<ffi::AnyBuffer>()            // dout
      .template Arg<ffi::AnyBuffer>()            // lse
      .template Arg<ffi::AnyBuffer>()            // dlse
      .template Arg<ffi::AnyBuffer>()            // q_segment_ids (as in BindFwd)
      .template Arg<ffi::AnyBuffer>()            // kv_segment_ids
      .template Arg<ffi::AnyBuffer>()            // q_segment_blocks
      .template Arg<ffi::AnyBuffer>()            // kv_segment_blocks
      .template Arg<ffi::AnyBuffer>()            // q_segment_ranges
      .template Arg<ffi::AnyBuffer>()            // kv_segment_ranges
      .template Ret<ffi::AnyBuffer>()            // dq
      .template Ret<ffi::AnyBuffer>()            // dk
      .template Ret<ffi::AnyBuffer>()            // dv
      .template Ret<ffi::AnyBuffer>()            // dq_accum (float32 scratch)
      .template Ret<ffi::AnyBuffer>()            // delta (float32 scratch)
      .template Ret<ffi::AnyBuffer>()            // dq_semaphore (int32 scratch; empty: not deterministic)
      .template Ret<ffi::AnyBuffer>()            // dkv_accum (float32 scratch; empty unless GQA on CUDA)
      .template Attr<float>("softmax_scale")
      .template Attr<int64_t>("diag_lo")
      .template Attr<int64_t>("diag_hi")
      .template Attr<float>("softcap");  // 0: none (jflash/score.h)
}

}  // namespace jflash::ffi_glue

// The ABI of jflash_fwd_v5, jflash_bwd_v8, jflash_decode_v1 and
// jflash_decode_append_v1, written once: arguments, results
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
      .template Ret<ffi::AnyBuffer>()            // tile_counter (int32 scratch, one element with
                                                 // segment ids; empty otherwise)
      .template Attr<float>("softmax_scale")
      .template Attr<int64_t>("diag_lo")
      .template Attr<int64_t>("diag_hi")
      .template Attr<float>("softcap")  // 0: none (jflash/score.h)
      .template Attr<int64_t>("tf32_passes");  // float32 on CUDA: 1 or 3 (jflash/params.h)
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
      .template Arg<ffi::AnyBuffer>()            // delta_in: the caller's delta with
                                                 // dq_mode 2 (jflash/params.h, DqMode); else empty
      .template Arg<ffi::AnyBuffer>()            // dq_accum_in: the caller's float32 dq sum with
                                                 // dq_mode 2, aliased to dq_accum; else empty
      .template Arg<ffi::AnyBuffer>()            // dkv_accum_in: the caller's float32 dK, dV sums
                                                 // with dkv_mode 1, aliased to dkv_accum; else empty
      .template Ret<ffi::AnyBuffer>()            // dq (empty unless dq_mode 0)
      .template Ret<ffi::AnyBuffer>()            // dk (empty with dkv_mode 1)
      .template Ret<ffi::AnyBuffer>()            // dv (empty with dkv_mode 1)
      .template Ret<ffi::AnyBuffer>()            // dq_accum (float32; scratch with dq_mode 0)
      .template Ret<ffi::AnyBuffer>()            // delta (float32 scratch; empty with dq_mode 2)
      .template Ret<ffi::AnyBuffer>()            // dq_semaphore (int32 scratch; empty: not deterministic)
      .template Ret<ffi::AnyBuffer>()            // dkv_accum (float32 scratch, empty unless GQA on
                                                 // CUDA; the caller's sums with dkv_mode 1)
      .template Attr<float>("softmax_scale")
      .template Attr<int64_t>("diag_lo")
      .template Attr<int64_t>("diag_hi")
      .template Attr<float>("softcap")  // 0: none (jflash/score.h)
      .template Attr<int64_t>("tf32_passes")  // float32 on CUDA: 1 or 3 (jflash/params.h)
      .template Attr<int64_t>("dq_mode")      // DqMode (jflash/params.h)
      .template Attr<int64_t>("dq_accum_row_offset")  // dq_mode 2: this call's first row of dq_accum
      .template Attr<int64_t>("dkv_mode");  // DkvMode (jflash/params.h)
}

// The decode call's attributes (jflash/_src/decode.py): window sides -1 for
// unbounded (causal is window_right 0), softcap 0 for none, num_splits >= 1.
template <typename Binding>
auto BindDecodeAttrs(Binding binding) {
  return std::move(binding).template Attr<float>("softmax_scale")
      .template Attr<float>("softcap")
      .template Attr<int64_t>("window_left")
      .template Attr<int64_t>("window_right")
      .template Attr<int64_t>("num_splits");
}

// jflash_decode_v1: attention over a cache, no append (so no cache result,
// which XLA would have to copy the cache into).
template <typename Binding>
auto BindDecode(Binding binding) {
  return BindDecodeAttrs(
      std::move(binding).template Arg<ffi::AnyBuffer>()  // q [batch, seqlen_q, num_heads, head_dim]
          .template Arg<ffi::AnyBuffer>()  // k_cache [batch, capacity, num_heads_kv, head_dim] or
                                           //         [num_blocks, block_size, num_heads_kv, head_dim]
          .template Arg<ffi::AnyBuffer>()  // v_cache like k_cache
          .template Arg<ffi::AnyBuffer>()  // cache_seqlens [batch] int32
          .template Arg<ffi::AnyBuffer>()  // block_table [batch, max_blocks_per_seq] int32, or empty
          .template Ret<ffi::AnyBuffer>()  // out like q
          .template Ret<ffi::AnyBuffer>()  // lse [batch, num_heads, seqlen_q] float32
          .template Ret<ffi::AnyBuffer>()  // out_partial [num_splits, batch, num_heads, seqlen_q, head_dim]
                                           // float32 scratch, empty when num_splits is 1
          .template Ret<ffi::AnyBuffer>());  // lse_partial [num_splits, batch, num_heads, seqlen_q]
}

// jflash_decode_append_v1: k_new and v_new are written into the cache at
// cache_seqlens; the cache results alias k_cache and v_cache
// (input_output_aliases), so that with donated buffers nothing is copied.
template <typename Binding>
auto BindDecodeAppend(Binding binding) {
  return BindDecodeAttrs(
      std::move(binding).template Arg<ffi::AnyBuffer>()  // q
          .template Arg<ffi::AnyBuffer>()  // k_cache
          .template Arg<ffi::AnyBuffer>()  // v_cache
          .template Arg<ffi::AnyBuffer>()  // k_new [batch, seqlen_new, num_heads_kv, head_dim]
          .template Arg<ffi::AnyBuffer>()  // v_new like k_new
          .template Arg<ffi::AnyBuffer>()  // cache_seqlens
          .template Arg<ffi::AnyBuffer>()  // block_table
          .template Ret<ffi::AnyBuffer>()  // out
          .template Ret<ffi::AnyBuffer>()  // lse
          .template Ret<ffi::AnyBuffer>()  // k_cache with the new rows (aliases k_cache)
          .template Ret<ffi::AnyBuffer>()  // v_cache with the new rows (aliases v_cache)
          .template Ret<ffi::AnyBuffer>()  // out_partial
          .template Ret<ffi::AnyBuffer>());  // lse_partial
}

}  // namespace jflash::ffi_glue

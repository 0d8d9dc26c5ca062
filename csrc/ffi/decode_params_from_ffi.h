// XLA FFI buffers and attributes of the decode calls -> jflash::DecodeParams.
//
// Shared by the CPU and CUDA handlers. Python (jflash/_src/decode.py)
// validates every user-facing argument at trace time; these checks guard the
// ABI and return ffi::Error. Unlike the forward's, these buffers have no
// leading axes: a vmapped axis that Python folds into the call is merged into
// the batch before it (jflash/_src/decode.py, _decode_branch).
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include "ffi/params_from_ffi.h"
#include "jflash/decode.h"
#include "jflash/params.h"
#include "xla/ffi/api/ffi.h"

namespace jflash::ffi_glue {

// The buffers of one decode call; k_new, v_new and the cache results are null
// without an append.
struct DecodeBuffers {
  ffi::AnyBuffer q, k_cache, v_cache;
  const ffi::AnyBuffer* k_new;
  const ffi::AnyBuffer* v_new;
  ffi::AnyBuffer cache_seqlens, block_table;
  ffi::AnyBuffer out, lse;
  ffi::AnyBuffer* k_cache_out;
  ffi::AnyBuffer* v_cache_out;
  ffi::AnyBuffer out_partial, lse_partial;
};

struct DecodeAttrs {
  float softmax_scale;
  float softcap;
  int64_t window_left;
  int64_t window_right;
  int64_t num_splits;
};

inline bool SameDims(ffi::AnyBuffer::Dimensions a, ffi::AnyBuffer::Dimensions b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) return false;
  }
  return true;
}

inline ffi::Error DecodeShapeError(const DecodeBuffers& b, const std::string& what) {
  return ffi::Error::InvalidArgument("jflash decode: " + what + "; got q " +
                                     DimsToString(b.q.dimensions()) + ", k_cache " +
                                     DimsToString(b.k_cache.dimensions()) + ", block_table " +
                                     DimsToString(b.block_table.dimensions()));
}

inline ffi::Error FillDecodeParams(const DecodeBuffers& b, const DecodeAttrs& a, DecodeParams* p) {
  auto dtype = ToDType(b.q.element_type());
  if (dtype.has_error()) return dtype.error();
  const ffi::DataType t = b.q.element_type();
  bool same_dtype = b.k_cache.element_type() == t && b.v_cache.element_type() == t &&
                    b.out.element_type() == t;
  for (const ffi::AnyBuffer* x : {b.k_new, b.v_new, static_cast<const ffi::AnyBuffer*>(b.k_cache_out),
                                  static_cast<const ffi::AnyBuffer*>(b.v_cache_out)}) {
    if (x != nullptr) same_dtype &= x->element_type() == t;
  }
  if (!same_dtype) {
    return ffi::Error::InvalidArgument("jflash decode: q, the caches, k_new, v_new and out must "
                                       "share one dtype");
  }
  for (const ffi::AnyBuffer* x : {&b.lse, &b.out_partial, &b.lse_partial}) {
    if (x->element_type() != ffi::DataType::F32) {
      return ffi::Error::InvalidArgument("jflash decode: lse and the partial results must be float32");
    }
  }
  if (b.cache_seqlens.element_type() != ffi::DataType::S32 ||
      b.block_table.element_type() != ffi::DataType::S32) {
    return ffi::Error::InvalidArgument("jflash decode: cache_seqlens and block_table must be int32");
  }
  const auto qd = b.q.dimensions();
  const auto kd = b.k_cache.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || !SameDims(kd, b.v_cache.dimensions()) ||
      !SameDims(qd, b.out.dimensions())) {
    return DecodeShapeError(b, "q and out must be [batch, seqlen_q, num_heads, head_dim], the "
                               "caches one rank-4 shape");
  }
  const int64_t batch = qd[0], seqlen_q = qd[1], num_heads = qd[2], head_dim = qd[3];
  const int64_t num_blocks = kd[0], block_size = kd[1], num_heads_kv = kd[2];
  const bool paged = b.block_table.element_count() > 0;
  const auto bd = b.block_table.dimensions();
  if (paged ? (bd.size() != 2 || bd[0] != batch) : num_blocks != batch) {
    return DecodeShapeError(b, "a contiguous cache must be [batch, capacity, num_heads_kv, "
                               "head_dim], a paged one come with block_table [batch, "
                               "max_blocks_per_seq]");
  }
  const int64_t max_blocks = paged ? bd[1] : 1;
  if (kd[3] != head_dim || head_dim < 1 || head_dim > kMaxHeadDim || num_heads_kv < 1 ||
      num_heads % num_heads_kv != 0 || block_size < 1) {
    return DecodeShapeError(b, "unsupported head_dim, head counts or block size");
  }
  if (paged && block_size % kPagedBlockMultiple != 0) {
    return DecodeShapeError(b, "a paged cache's block_size must be a multiple of " +
                                   std::to_string(kPagedBlockMultiple));
  }
  if (b.cache_seqlens.element_count() != batch) {
    return DecodeShapeError(b, "cache_seqlens must hold batch int32s");
  }
  int64_t seqlen_new = 0;
  if (b.k_new != nullptr) {
    const auto nd = b.k_new->dimensions();
    if (nd.size() != 4 || !SameDims(nd, b.v_new->dimensions()) || nd[0] != batch ||
        nd[2] != num_heads_kv || nd[3] != head_dim || !SameDims(b.k_cache_out->dimensions(), kd) ||
        !SameDims(b.v_cache_out->dimensions(), kd)) {
      return DecodeShapeError(b, "k_new and v_new must be [batch, seqlen_new, num_heads_kv, "
                                 "head_dim], the cache results shaped like the caches");
    }
    seqlen_new = nd[1];
  }
  const int64_t capacity = max_blocks * block_size;
  for (int64_t n : {batch, seqlen_q, num_heads, num_blocks, capacity}) {
    if (n > INT32_MAX) return DecodeShapeError(b, "sizes must be below 2^31");
  }
  if (seqlen_new > capacity) return DecodeShapeError(b, "seqlen_new exceeds the cache's capacity");
  const int64_t rows = batch * num_heads * seqlen_q;
  const int64_t splits = a.num_splits;
  if (splits < 1 || splits > kMaxDecodeSplits) {
    return ffi::Error::InvalidArgument("jflash decode: num_splits must be in [1, " +
                                       std::to_string(kMaxDecodeSplits) + "]");
  }
  const int64_t partial_rows = splits == 1 ? 0 : splits * rows;
  if (b.lse.element_count() != rows || b.out_partial.element_count() != partial_rows * head_dim ||
      b.lse_partial.element_count() != partial_rows) {
    return ffi::Error::InvalidArgument("jflash decode: lse must hold batch * num_heads * seqlen_q "
                                       "floats, the partial results num_splits times that (times "
                                       "head_dim for out_partial), or none for one split");
  }
  if (!std::isfinite(a.softmax_scale) || !std::isfinite(a.softcap) || a.softcap < 0 ||
      a.window_left < -1 || a.window_right < -1) {
    return ffi::Error::InvalidArgument("jflash decode: softmax_scale must be finite, softcap "
                                       "finite and >= 0, window sides >= -1");
  }

  p->dtype = *dtype;
  p->q = b.q.untyped_data();
  p->k_cache = b.k_cache_out != nullptr ? b.k_cache_out->untyped_data() : b.k_cache.untyped_data();
  p->v_cache = b.v_cache_out != nullptr ? b.v_cache_out->untyped_data() : b.v_cache.untyped_data();
  p->k_new = b.k_new != nullptr ? b.k_new->untyped_data() : nullptr;
  p->v_new = b.v_new != nullptr ? b.v_new->untyped_data() : nullptr;
  p->cache_seqlens = static_cast<const int32_t*>(b.cache_seqlens.untyped_data());
  p->block_table = paged ? static_cast<const int32_t*>(b.block_table.untyped_data()) : nullptr;
  p->out = b.out.untyped_data();
  p->lse = static_cast<float*>(b.lse.untyped_data());
  p->out_partial = splits == 1 ? nullptr : static_cast<float*>(b.out_partial.untyped_data());
  p->lse_partial = splits == 1 ? nullptr : static_cast<float*>(b.lse_partial.untyped_data());
  DenseStrides({batch, seqlen_q, num_heads, head_dim}, &p->q_batch_stride, &p->q_row_stride,
               &p->q_head_stride);
  DenseStrides({batch, seqlen_q, num_heads, head_dim}, &p->out_batch_stride, &p->out_row_stride,
               &p->out_head_stride);
  DenseStrides({num_blocks, block_size, num_heads_kv, head_dim}, &p->cache_block_stride,
               &p->cache_row_stride, &p->cache_head_stride);
  DenseStrides({batch, seqlen_new, num_heads_kv, head_dim}, &p->new_batch_stride,
               &p->new_row_stride, &p->new_head_stride);
  p->batch = static_cast<int>(batch);
  p->seqlen_q = static_cast<int>(seqlen_q);
  p->seqlen_new = static_cast<int>(seqlen_new);
  p->num_heads = static_cast<int>(num_heads);
  p->num_heads_kv = static_cast<int>(num_heads_kv);
  p->heads_per_kv = p->num_heads / p->num_heads_kv;
  p->head_dim = static_cast<int>(head_dim);
  p->block_size = static_cast<int>(block_size);
  p->num_cache_blocks = static_cast<int>(num_blocks);
  p->max_blocks_per_seq = static_cast<int>(max_blocks);
  p->num_splits = static_cast<int>(splits);
  p->softmax_scale = a.softmax_scale;
  p->softmax_scale_log2 = a.softmax_scale * 1.4426950408889634f;
  p->softcap = a.softcap;
  p->window_left = a.window_left;
  p->window_right = a.window_right;
  return ffi::Error::Success();
}

}  // namespace jflash::ffi_glue

// The decode's append (flash_decode_sm80.h): the CTAs of split 0 write
// k_new and v_new into the cache, rows that no CTA of the call reads from it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "jflash/decode.h"
#include "jflash/params.h"

namespace jflash::cuda {

// k_new, v_new of (batch, kv head) -> the cache rows at the clamped length.
// Chunk i of the 2 * seqlen_new * kChunks 16-byte chunks (K's rows, then V's)
// is copied by thread i % kThreads. The first pass's loads (the chunk, and a
// paged cache's block id) are issued before the K/V ring's first tiles
// (`load`) and its stores after them (`store`): issued after them, the loads
// would return behind the ring's tiles, and the stores' wait hold up the
// whole CTA (the main loop's first barrier) for that long.
template <typename Element, int kHeadDim, int kThreads>
struct NewRowsAppend {
  static constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row
  uint4 chunk;  // the first pass's
  uint4* dst;

  __device__ __forceinline__ static const uint4* source(const DecodeParams& p, int batch,
                                                        int kv_head, int i) {
    const int row_chunks = p.seqlen_new * kChunks;
    const void* base = i < row_chunks ? p.k_new : p.v_new;
    i = i < row_chunks ? i : i - row_chunks;
    return reinterpret_cast<const uint4*>(
        static_cast<const Element*>(base) + batch * p.new_batch_stride +
        (i / kChunks) * p.new_row_stride + kv_head * p.new_head_stride + (i % kChunks) * 8);
  }
  __device__ __forceinline__ static uint4* target(const DecodeParams& p, int batch, int kv_head,
                                                  int cache_len, int i) {
    const int row_chunks = p.seqlen_new * kChunks;
    void* base = i < row_chunks ? p.k_cache : p.v_cache;
    i = i < row_chunks ? i : i - row_chunks;
    return reinterpret_cast<uint4*>(
        static_cast<Element*>(base) + cache_row_offset(p, batch, cache_len + i / kChunks) +
        kv_head * p.cache_head_stride + (i % kChunks) * 8);
  }

  __device__ __forceinline__ void load(const DecodeParams& p, int batch, int kv_head,
                                       int cache_len) {
    if (threadIdx.x < 2 * p.seqlen_new * kChunks) {
      chunk = *source(p, batch, kv_head, threadIdx.x);
      dst = target(p, batch, kv_head, cache_len, threadIdx.x);
    }
  }
  __device__ __forceinline__ void store(const DecodeParams& p, int batch, int kv_head,
                                        int cache_len) const {
    const int chunks = 2 * p.seqlen_new * kChunks;
    if (threadIdx.x < chunks) *dst = chunk;
    for (int i = threadIdx.x + kThreads; i < chunks; i += kThreads) {
      *target(p, batch, kv_head, cache_len, i) = *source(p, batch, kv_head, i);
    }
  }
};

}  // namespace jflash::cuda

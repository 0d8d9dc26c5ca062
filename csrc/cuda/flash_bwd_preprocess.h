// What the sm80 and the Hopper backward share: the small kernels around the
// main one (delta = rowsum(dO * O) - dlse before it, and the float32 dQ
// accumulator scaled and converted after it; both memory-bound grid-stride
// loops), the main kernels' steps per key block and their dK, dV store.
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include <cute/tensor.hpp>

#include "cuda/launch.h"
#include "cuda/utils.h"
#include "jflash/params.h"

namespace jflash::cuda {

using namespace cute;

constexpr float kLog2e = 1.4426950408889634f;

// The row-wise kernels below walk tiles of rows of one (batch, head), in the
// (batch, head, row) order of delta and dq_accum, so that a tile's index
// costs one division and its rows none, and each thread has several rows'
// loads in flight. Measured (H200, head dim 128, B * S = 16384, 16 heads, in a
// training-step loop): delta alone took 98 us for its 128 MB with a warp per
// row and three 64-bit divisions per row, and the dq_accum memset 30 us more;
// fused and tiled, 68 us for both (256 MB), as long as cuDNN's own pass. The
// dQ conversion (192 MB) went from 59 to 51 us.
constexpr int kPrepThreads = 256;
constexpr int kPrepRowsPerThread = 4;  // rows whose loads a thread has in flight at once

// Threads that share a row of kChunks 16-byte chunks: a power of two (their
// sums meet by shuffles), at most 16.
constexpr int prep_threads_per_row(int chunks) {
  int t = 1;
  while (t < chunks && t < 16) t *= 2;
  return t;
}

struct PrepTile {
  int64_t first_row;  // of the (batch, head) rows, in delta's order
  int64_t batch, head;
  int row0, rows;     // the tile's rows of the head: [row0, row0 + rows)
};

// Row r of the tile in dq_accum, at dq_accum's strides (jflash/params.h).
__device__ __forceinline__ float* prep_dq_accum_row(const BwdParams& params, const PrepTile& tile,
                                                    int r) {
  return params.dq_accum + tile.batch * params.dq_accum_batch_stride +
         tile.head * params.dq_accum_head_stride + (tile.row0 + r) * params.dq_accum_row_stride;
}

template <int kTileRows>
__device__ __forceinline__ int64_t prep_num_tiles(const BwdParams& params) {
  return int64_t{params.batch} * params.num_heads * ((params.seqlen_q + kTileRows - 1) / kTileRows);
}

template <int kTileRows>
__device__ __forceinline__ PrepTile prep_tile(const BwdParams& params, int64_t t) {
  const int tiles_per_head = (params.seqlen_q + kTileRows - 1) / kTileRows;
  const int64_t bh = t / tiles_per_head;
  PrepTile tile;
  tile.row0 = int(t - bh * tiles_per_head) * kTileRows;
  tile.rows = min(kTileRows, params.seqlen_q - tile.row0);
  tile.batch = bh / params.num_heads;
  tile.head = bh - tile.batch * params.num_heads;
  tile.first_row = bh * params.seqlen_q;
  return tile;
}

// delta = rowsum(dO * O) - dlse, and the row's dq_accum zeroed (the main
// kernels add into it): one memory-bound pass that reads dO and O and writes
// the float32 zeros. kThreadsPerRow threads share a row, each reading 16-byte
// chunks of dO and O (the call's head_dim: a Hopper kernel of a wider kHeadDim
// may run it) for kPrepRowsPerThread rows before it sums any.
template <typename Element, int kHeadDim>
__global__ void __launch_bounds__(kPrepThreads)
    flash_bwd_delta_kernel(const __grid_constant__ BwdParams params) {
  constexpr int kChunk = 16 / int(sizeof(Element));  // elements per 16 bytes
  constexpr int kMaxChunks = kHeadDim / kChunk;
  constexpr int kThreadsPerRow = prep_threads_per_row(kMaxChunks);
  constexpr int kChunksPerThread = (kMaxChunks + kThreadsPerRow - 1) / kThreadsPerRow;
  constexpr int kRowGroups = kPrepThreads / kThreadsPerRow;
  constexpr int kTileRows = kRowGroups * kPrepRowsPerThread;
  const int chunks = min(kHeadDim, params.head_dim) / kChunk;
  const int zero_chunks = params.head_dim / 4;  // float4s of a dq_accum row
  const int sub = threadIdx.x % kThreadsPerRow;
  const int group = threadIdx.x / kThreadsPerRow;
  // TF32 (float32 inputs, one pass): the main kernel's dP = dO V^T rounds dO
  // to TF32, and delta takes the same rounded dO, so that dP - delta cancels
  // where the math does. With float32 dO here, a row that sees one key (P = 1,
  // O = V, true dS = 0) kept dS = P (dO_tf32 - dO) V^T, about 2^-11 |dO| |V|:
  // dq off by ~1e-3 where it is 0 (tests/test_dot_product_attention.py). 3xTF32
  // carries dO at float32 precision, so it keeps dO as it is.
  [[maybe_unused]] const bool round_do = std::is_same_v<Element, float> && params.tf32_passes == 1;
  const int64_t num_tiles = prep_num_tiles<kTileRows>(params);
  for (int64_t t = blockIdx.x; t < num_tiles; t += gridDim.x) {
    const PrepTile tile = prep_tile<kTileRows>(params, t);
    const Element* o = static_cast<const Element*>(params.out) +
                       tile.batch * params.out_batch_stride + tile.head * params.out_head_stride;
    const Element* d_o = static_cast<const Element*>(params.dout) +
                         tile.batch * params.dout_batch_stride +
                         tile.head * params.dout_head_stride;
    uint4 o_chunk[kPrepRowsPerThread][kChunksPerThread];
    uint4 do_chunk[kPrepRowsPerThread][kChunksPerThread];
    CUTE_UNROLL
    for (int i = 0; i < kPrepRowsPerThread; ++i) {
      const int r = group + i * kRowGroups;  // consecutive groups, consecutive rows
      const int64_t row = tile.row0 + r;
      CUTE_UNROLL
      for (int j = 0; j < kChunksPerThread; ++j) {
        const int c = sub + j * kThreadsPerRow;
        const bool load = r < tile.rows && c < chunks;
        o_chunk[i][j] = load ? *reinterpret_cast<const uint4*>(o + row * params.out_row_stride +
                                                               c * kChunk)
                             : make_uint4(0, 0, 0, 0);
        do_chunk[i][j] = load ? *reinterpret_cast<const uint4*>(
                                    d_o + row * params.dout_row_stride + c * kChunk)
                              : make_uint4(0, 0, 0, 0);
      }
    }
    CUTE_UNROLL
    for (int i = 0; i < kPrepRowsPerThread; ++i) {
      const int r = group + i * kRowGroups;
      float dot = 0.f;
      CUTE_UNROLL
      for (int j = 0; j < kChunksPerThread; ++j) {
        const Element* o_values = reinterpret_cast<const Element*>(&o_chunk[i][j]);
        const Element* do_values = reinterpret_cast<const Element*>(&do_chunk[i][j]);
        CUTE_UNROLL
        for (int e = 0; e < kChunk; ++e) {
          if constexpr (std::is_same_v<Element, float>) {
            const float d = do_values[e];
            dot += o_values[e] * (round_do ? round_to_tf32(d) : d);
          } else {
            dot += float(o_values[e]) * float(do_values[e]);
          }
        }
      }
      CUTE_UNROLL
      for (int offset = kThreadsPerRow / 2; offset > 0; offset /= 2) {
        dot += __shfl_xor_sync(0xffffffff, dot, offset);
      }
      if (r < tile.rows) {
        const int64_t index = tile.first_row + tile.row0 + r;
        if (sub == 0) params.delta[index] = dot - params.dlse[index];
        float4* acc = reinterpret_cast<float4*>(prep_dq_accum_row(params, tile, r));
        for (int f = sub; f < zero_chunks; f += kThreadsPerRow) {
          acc[f] = make_float4(0.f, 0.f, 0.f, 0.f);
        }
      }
    }
  }
}

// s * acc stored as four Elements (8 bytes, or 16 for float32) at dst: the
// convert kernels' store.
template <typename Element>
__device__ __forceinline__ void store_scaled4(Element* dst, float4 acc, float s) {
  if constexpr (sizeof(Element) == 4) {
    *reinterpret_cast<float4*>(dst) = make_float4(acc.x * s, acc.y * s, acc.z * s, acc.w * s);
  } else {
    uint2 packed;
    packed.x = pack_pair(Element(acc.x * s), Element(acc.y * s));
    packed.y = pack_pair(Element(acc.z * s), Element(acc.w * s));
    *reinterpret_cast<uint2*>(dst) = packed;
  }
}

// dq[b, i, h, :] = softmax_scale * dq_accum[b, h, i, :]: tiles of rows as in
// the delta kernel, each thread four floats of a row at a time, with its
// kPrepRowsPerThread rows' loads issued before their stores.
template <typename Element>
__global__ void __launch_bounds__(kPrepThreads)
    flash_bwd_convert_dq_kernel(const __grid_constant__ BwdParams params) {
  constexpr int kThreadsPerRow = 32;
  constexpr int kRowGroups = kPrepThreads / kThreadsPerRow;
  constexpr int kTileRows = kRowGroups * kPrepRowsPerThread;
  const int quads = params.head_dim / 4;  // float4s of a row
  const int lane = threadIdx.x % kThreadsPerRow;
  const int group = threadIdx.x / kThreadsPerRow;
  const int64_t num_tiles = prep_num_tiles<kTileRows>(params);
  for (int64_t t = blockIdx.x; t < num_tiles; t += gridDim.x) {
    const PrepTile tile = prep_tile<kTileRows>(params, t);
    Element* dq = static_cast<Element*>(params.dq) + tile.batch * params.dq_batch_stride +
                  tile.head * params.dq_head_stride;
    for (int f0 = 0; f0 < quads; f0 += kThreadsPerRow) {
      const int f = f0 + lane;
      float4 acc[kPrepRowsPerThread];
      CUTE_UNROLL
      for (int i = 0; i < kPrepRowsPerThread; ++i) {
        const int r = group + i * kRowGroups;
        acc[i] = r < tile.rows && f < quads
                     ? reinterpret_cast<const float4*>(prep_dq_accum_row(params, tile, r))[f]
                     : make_float4(0.f, 0.f, 0.f, 0.f);
      }
      CUTE_UNROLL
      for (int i = 0; i < kPrepRowsPerThread; ++i) {
        const int r = group + i * kRowGroups;
        if (r < tile.rows && f < quads) {
          store_scaled4(dq + int64_t{tile.row0 + r} * params.dq_row_stride + 4 * f, acc[i],
                        params.softmax_scale);
        }
      }
    }
  }
}

// The work of one backward CTA (a key block of a kv head): the query blocks
// the mask lets see its keys, and the (query head, query block) of each step,
// one step per (query head of the CTA's share of the GQA group, query block).
// The share: split `split` of `splits` equal parts of the group (the Hopper
// backward's head splits, tile_scheduler_sm90.h; the whole group otherwise).
//
// Deterministic mode (params.dq_semaphore set) adds each dQ tile in key-block
// order: the CTA of key block n adds into query block m only after the blocks
// first_key_block(m) .. n - 1 have (dq_semaphore_wait below). Every CTA walks
// its steps in one common order, query blocks from the last down and query
// heads inside: a band's query-block ranges [begin, end) grow with n, so the
// CTA of block n - 1 reaches each (head, query block) at the same step as the
// CTA of block n or an earlier one, and a CTA waits at most about one step for
// its predecessor instead of a chain of waits.
template <int kBlockM, int kBlockN, typename Mask>
struct KeyBlockSteps {

  int m_block_begin;
  int num_m_blocks;
  int num_steps;
  int first_head;
  // The first step's offset into the default order; -1: the deterministic
  // order. (No further members: the sm80 kernel is at its register limit.)
  int step_shift;

  __device__ __forceinline__ KeyBlockSteps(const BwdParams& params, int n_block, int kv_head,
                                           int batch, int split = 0, int splits = 1) {
    const int key0 = n_block * kBlockN;
    const int key_end = min(key0 + kBlockN, params.seqlen_k);
    const Mask mask(params.mask, batch);
    IndexRange rows = mask.rows_of_keys(key0, key_end, params.seqlen_q);
    if constexpr (Mask::kEmptyTilesInRange) {
      // Deterministic mode orders by the band's ranges (first_key_block); the
      // tiles in them that the policy leaves empty are computed fully masked.
      if (params.dq_semaphore != nullptr) rows = mask.band().rows_of_keys(key0, key_end, params.seqlen_q);
    }
    const BlockSpan m_blocks = blocks_covering<kBlockM>(rows);
    m_block_begin = m_blocks.first;
    num_m_blocks = m_blocks.count;
    const int heads = params.heads_per_kv / splits;
    num_steps = num_m_blocks * heads;
    first_head = kv_head * params.heads_per_kv + split * heads;
    // Key blocks start at different query blocks, so that the CTAs of one head
    // do not all add into the same dQ rows at the same time.
    step_shift = params.dq_semaphore != nullptr ? -1 : (num_steps > 0 ? n_block % num_steps : 0);
  }
  // Whether dQ is added in key-block order (deterministic mode).
  __device__ __forceinline__ bool ordered() const { return step_shift < 0; }
  // (query head, query block) of step i.
  __device__ __forceinline__ void unit(int step, int& head, int& m_block) const {
    if (ordered()) {
      const int heads_per_kv = num_steps / num_m_blocks;
      head = first_head + step % heads_per_kv;
      m_block = m_block_begin + num_m_blocks - 1 - step / heads_per_kv;
      return;
    }
    int u = step + step_shift;
    u = u >= num_steps ? u - num_steps : u;
    head = first_head + u / num_m_blocks;
    m_block = m_block_begin + u % num_m_blocks;
  }

  // The same units one step at a time, for loops that walk their steps in
  // order (StepWalk below): unit() divides by the runtime block count at
  // every step, about 40 dependent uniform instructions; next() adds and
  // compares.
  struct Cursor {
    int head;
    int m_block;
    int head_end;  // first_head + the CTA's query heads, kept so that next() need not divide
  };
  __device__ __forceinline__ Cursor first() const {
    if (num_steps == 0) return Cursor{first_head, m_block_begin, first_head};  // no step reads it
    const int heads = num_steps / num_m_blocks;
    Cursor c{first_head, m_block_begin + num_m_blocks - 1, first_head + heads};
    if (!ordered()) {
      c.head = first_head + step_shift / num_m_blocks;
      c.m_block = m_block_begin + step_shift % num_m_blocks;
    }
    return c;
  }
  // The unit after c's: unit(step + 1) for c = unit(step); after the last
  // step, the first step's unit again.
  __device__ __forceinline__ Cursor next(Cursor c) const {
    if (ordered()) {
      // Query heads inside, query blocks from the last down.
      const bool wrap = ++c.head == c.head_end;
      c.head = wrap ? first_head : c.head;
      c.m_block -= wrap;
      c.m_block = c.m_block < m_block_begin ? m_block_begin + num_m_blocks - 1 : c.m_block;
    } else {
      // Query blocks inside, query heads outside, from step_shift on.
      const bool wrap = ++c.m_block == m_block_begin + num_m_blocks;
      c.m_block = wrap ? m_block_begin : c.m_block;
      c.head += wrap;
      c.head = c.head == c.head_end ? first_head : c.head;
    }
    return c;
  }

  // The first key block that visits query block m_block: the one holding the
  // first key that the block's first row sees (rows see keys from further
  // right as they go down). Every key block from it to one that visits
  // m_block visits it too: a key block's row range only grows with it.
  // Under segment ids (kEmptyTilesInRange) the band's: a CTA's steps in
  // deterministic mode are then the band's as well, whose query-block ranges
  // grow with the key block as this needs (the policy's own need not).
  __device__ __forceinline__ static int first_key_block(const BwdParams& params, int m_block,
                                                        int batch) {
    const int64_t row0 = int64_t{m_block} * kBlockM;
    const auto band = Mask(params.mask, batch).band();
    return static_cast<int>(band.keys_of_rows(row0, row0 + 1, params.seqlen_k).begin / kBlockN);
  }
};

// A loop's walk over a CTA's steps, in order: each unit through a
// KeyBlockSteps::Cursor (kCursor) or unit()'s division at every step. The
// Hopper backward's tile table says which (Sm90BwdTile::step_cursor): where
// ptxas placed the division ahead of a step's first product, the cursor
// measured faster; where it hid it, the cursor's loop-carried state measured
// slower.
template <bool kCursor, typename Steps>
struct StepWalk {
  const Steps& steps;
  typename Steps::Cursor cursor;
  __device__ __forceinline__ explicit StepWalk(const Steps& s)
      : steps(s), cursor(kCursor ? s.first() : typename Steps::Cursor{}) {}
  // (query head, query block) of step `step`, which follows the step of the
  // last call (0 at the first); moves the walk on to step + 1.
  __device__ __forceinline__ void unit(int step, int& head, int& m_block) {
    if constexpr (kCursor) {
      head = cursor.head;
      m_block = cursor.m_block;
      cursor = steps.next(cursor);
    } else {
      steps.unit(step, head, m_block);
    }
  }
  // The same for the step the walk is at (`step`: one after the last unit()
  // call's, 0 before it), without moving on.
  __device__ __forceinline__ void peek(int step, int& head, int& m_block) const {
    if constexpr (kCursor) {
      head = cursor.head;
      m_block = cursor.m_block;
    } else {
      steps.unit(step, head, m_block);
    }
  }
};

// Deterministic mode's counters (params.dq_semaphore): slot `slice` of query
// block m_block of (batch, head). A CTA waits until every earlier key block
// that visits the block has added its dQ tile, adds its own, and then counts
// itself in.
__device__ __forceinline__ int* dq_semaphore_at(const BwdParams& params, int batch, int head,
                                                int m_block, int slice, int slices) {
  return params.dq_semaphore +
         (int64_t{batch} * params.num_heads + head) * dq_semaphore_slots(params.seqlen_q) +
         m_block * slices + slice;
}
// Not inlined: the spin loop stays out of the callers' register allocation
// (the sm80 backward is at its register limit), and runs only in deterministic
// mode. static: one copy per translation unit, as the header is in many.
static __device__ __noinline__ void dq_semaphore_wait(const int* semaphore, int count) {
  int value;
  do {
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(value) : "l"(semaphore) : "memory");
  } while (value != count);
}
__device__ __forceinline__ void dq_semaphore_signal(int* semaphore) {
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(semaphore) : "memory");
}

// dK = softmax_scale * sum dS^T Q and dV = sum P^T dO of a key block, from
// their float32 accumulators (acc_dk is scaled in place), written once in the
// input dtype; keys at or past seqlen_k are not stored, nor columns at or
// past out_cols (as store_output's: a static out_cols is the tile's width, a
// dynamic one the call's head dim where a wider kernel runs it). coords: the
// (key, head-dim column) of each accumulator element; elements 2i, 2i+1 are
// adjacent columns (one store_pair each; head dims are multiples of 8).
template <typename Element, typename AccDK, typename AccDV, typename Coords, typename OutCols>
__device__ __forceinline__ void store_dk_dv(AccDK& acc_dk, AccDV const& acc_dv,
                                            Coords const& coords, int key0, int batch,
                                            int kv_head, const BwdParams& params,
                                            OutCols out_cols) {
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dk); ++i) acc_dk(i) *= params.softmax_scale;
  Tensor dk = convert_fragment<Element>(acc_dk);
  Tensor dv = convert_fragment<Element>(acc_dv);
  Element* dk_ptr = static_cast<Element*>(params.dk) + batch * params.dk_batch_stride +
                    kv_head * params.dk_head_stride;
  Element* dv_ptr = static_cast<Element*>(params.dv) + batch * params.dv_batch_stride +
                    kv_head * params.dv_head_stride;
  CUTE_UNROLL
  for (int i = 0; i < size(dk); i += 2) {
    const int key = key0 + get<0>(coords(i));
    const int col = get<1>(coords(i));
    bool in_cols = true;
    if constexpr (!is_static<OutCols>::value) in_cols = col < out_cols;
    if (key < params.seqlen_k && in_cols) {
      store_pair(dk_ptr + key * params.dk_row_stride + col, dk(i), dk(i + 1));
      store_pair(dv_ptr + key * params.dv_row_stride + col, dv(i), dv(i + 1));
    }
  }
}

// The same added into dkv_accum in float32 (params.adds_dkv(): a share of a
// split GQA group's heads, or the caller's sums), dK scaled as dk: 8-byte
// reductions on sm90, two 4-byte ones before; columns at or past head_dim are
// not added (the Hopper kernels may be wider than the call).
template <typename AccDK, typename AccDV, typename Coords>
__device__ __forceinline__ void add_dk_dv(AccDK const& acc_dk, AccDV const& acc_dv,
                                          Coords const& coords, int key0, int batch, int kv_head,
                                          const BwdParams& params) {
  float* dk = params.dkv_accum + batch * params.dkv_accum_batch_stride +
              kv_head * params.dkv_accum_head_stride;
  float* dv = dk + params.dkv_accum_plane_stride;
  const float scale = params.softmax_scale;
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dk); i += 2) {
    const int key = key0 + get<0>(coords(i));
    const int col = get<1>(coords(i));
    if (key < params.seqlen_k && col < params.head_dim) {
      const int64_t offset = key * params.dkv_accum_row_stride + col;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      atomicAdd(reinterpret_cast<float2*>(dk + offset),
                make_float2(scale * acc_dk(i), scale * acc_dk(i + 1)));
      atomicAdd(reinterpret_cast<float2*>(dv + offset), make_float2(acc_dv(i), acc_dv(i + 1)));
#else
      atomicAdd(dk + offset, scale * acc_dk(i));
      atomicAdd(dk + offset + 1, scale * acc_dk(i + 1));
      atomicAdd(dv + offset, acc_dv(i));
      atomicAdd(dv + offset + 1, acc_dv(i + 1));
#endif
    }
  }
}

// dk = dkv_accum[b, h, 0] and dv = dkv_accum[b, h, 1] in the input dtype,
// four values per thread (after a main kernel that split GQA groups into the
// scratch: DkvMode::kWrite).
template <typename Element>
__global__ void flash_bwd_convert_dkv_kernel(const __grid_constant__ BwdParams params) {
  const int64_t num_chunks = dkv_accum_count(params) / 4;
  const int chunks_per_row = params.head_dim / 4;
  for (int64_t c = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; c < num_chunks;
       c += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = c / chunks_per_row;  // (batch, kv head, dk|dv, key) in dkv_accum order
    const int col = int(c % chunks_per_row) * 4;
    const int64_t key = r % params.seqlen_k;
    const bool is_dv = (r / params.seqlen_k) % 2;
    const int64_t head = (r / (2 * int64_t{params.seqlen_k})) % params.num_heads_kv;
    const int64_t batch = r / (2 * int64_t{params.seqlen_k} * params.num_heads_kv);
    Element* dst = is_dv ? static_cast<Element*>(params.dv) + batch * params.dv_batch_stride +
                               key * params.dv_row_stride + head * params.dv_head_stride
                         : static_cast<Element*>(params.dk) + batch * params.dk_batch_stride +
                               key * params.dk_row_stride + head * params.dk_head_stride;
    store_scaled4(dst + col, reinterpret_cast<const float4*>(params.dkv_accum)[c], 1.f);
  }
}

// Before the main kernel: delta computed and dq_accum zeroed (the main
// kernels add into it) in one pass, and the dkv_accum scratch where GQA groups
// are split and the deterministic mode's counters zeroed. Grid-stride kernels:
// a few waves of CTAs saturate bandwidth.
template <typename Element, int kHeadDim>
cudaError_t launch_bwd_preprocess(const BwdParams& params, const LaunchContext& ctx) {
  if (params.head_splits > 1 && params.dkv_mode == DkvMode::kWrite) {
    if (cudaError_t err = cudaMemsetAsync(params.dkv_accum, 0,
                                          dkv_accum_count(params) * sizeof(float), ctx.stream);
        err != cudaSuccess) {
      return err;
    }
  }
  const int64_t rows = int64_t{params.batch} * params.num_heads * params.seqlen_q;
  if (rows == 0) return cudaSuccess;
  if (params.dq_semaphore != nullptr) {
    if (cudaError_t err = cudaMemsetAsync(params.dq_semaphore, 0,
                                          dq_semaphore_count(params) * sizeof(int), ctx.stream);
        err != cudaSuccess) {
      return err;
    }
  }
  // Adding into the caller's dq_accum with the caller's delta: nothing to do.
  if (params.dq_mode == DqMode::kAddToAccum) return cudaSuccess;
  flash_bwd_delta_kernel<Element, kHeadDim><<<ctx.sm_count * 8, kPrepThreads, 0, ctx.stream>>>(
      params);
  return cudaGetLastError();
}

// After the main kernel: dq = softmax_scale * dq_accum in the input dtype
// (unless the caller takes dq_accum: DqMode), and dk, dv from the dkv_accum
// scratch where GQA groups were split.
template <typename Element>
cudaError_t launch_bwd_postprocess(const BwdParams& params, const LaunchContext& ctx) {
  if (params.head_splits > 1 && params.dkv_mode == DkvMode::kWrite) {
    flash_bwd_convert_dkv_kernel<Element><<<ctx.sm_count * 8, 256, 0, ctx.stream>>>(params);
    if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  }
  const int64_t rows = int64_t{params.batch} * params.num_heads * params.seqlen_q;
  if (rows == 0 || params.dq_mode != DqMode::kWrite) return cudaSuccess;
  flash_bwd_convert_dq_kernel<Element><<<ctx.sm_count * 8, kPrepThreads, 0, ctx.stream>>>(
      params);
  return cudaGetLastError();
}

}  // namespace jflash::cuda

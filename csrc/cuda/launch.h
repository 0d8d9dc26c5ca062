// The launcher interface between the FFI handlers and the kernel instantiations.
//
// Each generated instantiation file (csrc/cuda/instantiations/, written by
// generate_kernels.py) compiles one launcher and records it in the registry
// below when the library loads. The handlers look a launcher up by (dtype,
// head_dim, mask kind, score kind); a missing entry means the instantiation was left out of the
// build (JFLASH_CUDA_SUBSET) and becomes an ffi::Error, never a crash.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <utility>

#include "cuda/tile_sizes.h"
#include "jflash/params.h"

namespace jflash::cuda {

// What a launcher needs besides the params; the same on every call for a given
// device, so launches stay CUDA-graph safe.
struct LaunchContext {
  cudaStream_t stream;
  int sm_count;  // sizes the grid-stride grids of the backward's small kernels
  // JFLASH_CUDA_BWD_HEAD_SPLITS (0: the launcher's choice): the Hopper
  // backward's GQA head split (tile_scheduler_sm90.h), forced for measurements.
  int bwd_head_splits = 0;
  // Dynamic shared memory a block may use (the decode launcher sizes its
  // K/V ring to it); 0 where the launcher does not need it.
  int smem_limit = 0;
  // Whether launch_dependent may let a kernel start before the one ahead of
  // it in the stream ends (programmatic dependent launch): set for compute
  // capability 9.0, the one GPU whose code (sm_90a) has the griddepcontrol
  // instructions; other GPUs run code without them (utils.h).
  bool programmatic_launch = false;
};

// Launches `kernel` after the stream's previous kernel, as its programmatic
// dependent where ctx allows: the grid may start while the previous one
// runs, and `kernel` must call wait_for_prerequisite_grids (utils.h) before
// it reads what that grid writes. Elsewhere a plain launch.
template <typename... Params, typename... Args>
cudaError_t launch_dependent(const LaunchContext& ctx, void (*kernel)(Params...), dim3 grid,
                             dim3 block, size_t smem_bytes, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = ctx.stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = ctx.programmatic_launch ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

using FwdLauncher = cudaError_t (*)(const FwdParams&, const LaunchContext&);
using BwdLauncher = cudaError_t (*)(const BwdParams&, const LaunchContext&);

struct FwdKernel {
  FwdLauncher launch = nullptr;
  int smem_bytes = 0;  // dynamic shared memory of the main kernel
  // Whether this kernel takes a given call (nullptr: every call). The handler
  // runs the sm80 kernel for calls that the Hopper kernel refuses.
  bool (*accepts)(const FwdParams&) = nullptr;
};
struct BwdKernel {
  BwdLauncher launch = nullptr;
  int smem_bytes = 0;
  // Whether this kernel takes a given call (nullptr: every call), as for FwdKernel.
  bool (*accepts)(const BwdParams&) = nullptr;
};

// The decode kernels (flash_decode_sm80.h, launched by decode_launch_sm80.h),
// one per (dtype, head dim of kDecodeHeadDims). rows: a kv head's query heads
// times the queries.
using DecodeLauncher = cudaError_t (*)(const DecodeParams&, const LaunchContext&);
struct DecodeKernel {
  DecodeLauncher launch = nullptr;
  // Dynamic shared memory the kernel for `rows` takes under ctx.smem_limit
  // (its shallowest ring where nothing fits: the handler reports it).
  int (*smem_bytes)(int rows, const LaunchContext& ctx) = nullptr;
  // The split heuristic (jflash/decode.h) with this kernel's occupancy.
  int (*num_splits)(int64_t batch, int64_t num_heads_kv, int rows, int64_t capacity,
                    const LaunchContext& ctx) = nullptr;
};
DecodeKernel& decode_kernel_slot(DType dtype, int head_dim);

// Registry slots, keyed by (dtype, head dim, mask kind, score kind) and, for
// float32, the TF32 passes (1 or 3; jflash/params.h, tf32_passes); head_dim
// is one of kKernelHeadDims (jflash/head_dims.h). Return nullptr-launch
// entries for instantiations that were not compiled. SmemClass::kSmall slots
// hold the sm80 kernels of the small-shared-memory tile column (tile_sizes.h),
// filled only for head dims whose kLarge tile needs more than 99 KB (float32
// has none).
FwdKernel& fwd_kernel_slot(DType dtype, int head_dim, MaskKind mask, ScoreKind score,
                           SmemClass smem = SmemClass::kLarge, int tf32_passes = 1);
BwdKernel& bwd_kernel_slot(DType dtype, int head_dim, MaskKind mask, ScoreKind score,
                           SmemClass smem = SmemClass::kLarge, int tf32_passes = 1);

// The Hopper kernels (csrc/cuda/sm90/), chosen on compute capability 9.0.
FwdKernel& sm90_fwd_kernel_slot(DType dtype, int head_dim, MaskKind mask, ScoreKind score);
BwdKernel& sm90_bwd_kernel_slot(DType dtype, int head_dim, MaskKind mask, ScoreKind score);

// ------------------------------------------------------------------------
// Grids of one CTA per (row block, head, batch): the sm80 forward (query
// blocks, query heads, batch) and the sm80 backward (key blocks, kv heads,
// batch), whose kernels read blockIdx.y as the head and blockIdx.z as the
// batch.
//
// CUDA caps gridDim.y and gridDim.z at 65535 (x at 2^31 - 1); a launch past
// that fails (cudaErrorInvalidConfiguration). batch passes it easily: a vmap
// is folded into it (params_from_ffi.h), and so are many short sequences. So
// a grid whose heads or batch pass 65535 is launched in chunks of at most
// 65535 heads and 65535 batches, each with the params' pointers advanced to
// the chunk's first (batch, head) (fwd_params_chunk, bwd_params_chunk).
// Chunks of launches rather than (head, batch) folded into y and z and
// divided back out in the kernel, because:
//   - the kernels stay the same to the instruction. Both sit at the
//     255-register limit; the in-kernel division (tried) moved head and batch
//     out of uniform registers, reshuffled the main loops and took 2 more
//     registers in the head dim 64 backward (-Xptxas -v, sm_80 and sm_90a);
//   - the CTAs start in the order of one launch: row blocks fastest, then
//     heads, then batches (the CTAs resident at one time share a head's K and
//     V in L2), one chunk after the other. Only a call with more than 65535
//     heads (kv heads for the backward) differs: head chunks inside each
//     batch chunk;
//   - every launch but the last holds at least 32768 (head, batch) pairs, so
//     the drain at the end of a launch costs a fraction of a wave in hundreds.
// The launches depend only on the shapes: the handlers stay CUDA-graph safe.
constexpr int kMaxGridYZ = 65535;

// Heads [head0, head0 + heads) x batches [batch0, batch0 + batches) of a grid.
struct GridChunk {
  int head0, heads;
  int batch0, batches;
};

// Calls launch(chunk) for the chunks of a grid of `heads` x `batch` (the row
// blocks along x are never split), batch chunks outside, head chunks inside;
// returns the first error. Head chunks hold whole groups of `head_group` heads
// (the query heads of one kv head) where a group fits in a chunk, and otherwise
// lie inside one group, split into near-equal parts: either way the chunk's
// head h - head0 reads kv head (h - head0) / head_group counted from
// head0 / head_group, as the kernel computes it.
template <typename Launch>
cudaError_t for_each_grid_chunk(int heads, int batch, int head_group, Launch&& launch) {
  // int64_t: b0 + kMaxGridYZ and h0 + chunk_heads may pass INT32_MAX.
  const int64_t parts_per_group = (head_group + int64_t{kMaxGridYZ} - 1) / kMaxGridYZ;
  const int64_t part = (head_group + parts_per_group - 1) / parts_per_group;  // <= kMaxGridYZ
  const int64_t chunk_heads =
      head_group <= kMaxGridYZ ? kMaxGridYZ / head_group * head_group : part;
  for (int64_t b0 = 0; b0 < batch; b0 += kMaxGridYZ) {
    const int64_t b1 = std::min<int64_t>(b0 + kMaxGridYZ, batch);
    for (int64_t h0 = 0; h0 < heads;) {
      int64_t h1 = heads - h0 <= kMaxGridYZ ? heads : h0 + chunk_heads;
      if (head_group > kMaxGridYZ) {
        h1 = std::min(h0 + part, (h0 / head_group + 1) * head_group);  // inside one group
      }
      const GridChunk chunk{static_cast<int>(h0), static_cast<int>(h1 - h0), static_cast<int>(b0),
                            static_cast<int>(b1 - b0)};
      if (cudaError_t err = launch(chunk); err != cudaSuccess) return err;
      h0 = h1;
    }
  }
  return cudaSuccess;
}

// ptr advanced by `elements` elements of the call's dtype.
inline const void* advance(const void* ptr, int64_t elements, DType dtype) {
  return static_cast<const char*>(ptr) + elements * (dtype == DType::kFloat32 ? 4 : 2);
}
inline void* advance(void* ptr, int64_t elements, DType dtype) {
  return static_cast<char*>(ptr) + elements * (dtype == DType::kFloat32 ? 4 : 2);
}

// The forward's params for a chunk of query heads (for_each_grid_chunk with
// head_group = heads_per_kv): q, k, v, out and lse start at the chunk's first
// (batch, head), the segment ids at its first batch, batch is the chunk's. num_heads and heads_per_kv stay the
// call's: the kernel reads num_heads as the batch stride of lse, in heads.
inline FwdParams fwd_params_chunk(const FwdParams& p, const GridChunk& c) {
  FwdParams chunk = p;
  const int64_t b = c.batch0, h = c.head0, kv = c.head0 / p.heads_per_kv;
  chunk.q = advance(p.q, b * p.q_batch_stride + h * p.q_head_stride, p.dtype);
  chunk.k = advance(p.k, b * p.k_batch_stride + kv * p.k_head_stride, p.dtype);
  chunk.v = advance(p.v, b * p.v_batch_stride + kv * p.v_head_stride, p.dtype);
  chunk.out = advance(p.out, b * p.out_batch_stride + h * p.out_head_stride, p.dtype);
  chunk.lse = p.lse + (b * p.num_heads + h) * p.seqlen_q;
  chunk.mask.segments = p.mask.segments.from_batch(b);
  chunk.batch = c.batches;
  return chunk;
}

// The backward's params for a chunk of kv heads (for_each_grid_chunk over
// num_heads_kv, head_group = 1; the query heads are their groups): every
// tensor starts at the chunk's first (batch, kv head) or (batch, query head),
// batch is the chunk's. num_heads, num_heads_kv and heads_per_kv stay the
// call's: the kernel reads num_heads as the batch stride of lse, delta,
// dq_accum and dq_semaphore, in heads.
inline BwdParams bwd_params_chunk(const BwdParams& p, const GridChunk& c) {
  BwdParams chunk = p;
  const int64_t b = c.batch0, kv = c.head0, h = int64_t{c.head0} * p.heads_per_kv;
  chunk.q = advance(p.q, b * p.q_batch_stride + h * p.q_head_stride, p.dtype);
  chunk.k = advance(p.k, b * p.k_batch_stride + kv * p.k_head_stride, p.dtype);
  chunk.v = advance(p.v, b * p.v_batch_stride + kv * p.v_head_stride, p.dtype);
  chunk.out = advance(p.out, b * p.out_batch_stride + h * p.out_head_stride, p.dtype);
  chunk.dout = advance(p.dout, b * p.dout_batch_stride + h * p.dout_head_stride, p.dtype);
  chunk.dq = advance(p.dq, b * p.dq_batch_stride + h * p.dq_head_stride, p.dtype);
  chunk.dk = advance(p.dk, b * p.dk_batch_stride + kv * p.dk_head_stride, p.dtype);
  chunk.dv = advance(p.dv, b * p.dv_batch_stride + kv * p.dv_head_stride, p.dtype);
  const int64_t row = (b * p.num_heads + h) * p.seqlen_q;  // in [batch, heads, seqlen_q]
  chunk.lse = p.lse + row;
  chunk.dlse = p.dlse + row;
  chunk.delta = p.delta + row;
  chunk.dq_accum = p.dq_accum + b * p.dq_accum_batch_stride + h * p.dq_accum_head_stride;
  if (p.dq_semaphore != nullptr) {
    chunk.dq_semaphore = p.dq_semaphore + (b * p.num_heads + h) * dq_semaphore_slots(p.seqlen_q);
  }
  chunk.mask.segments = p.mask.segments.from_batch(b);
  chunk.batch = c.batches;
  return chunk;
}

// TMA reads tensors whose base addresses and strides are 16-byte multiples
// and whose extents are non-zero.
inline bool tma_compatible(const FwdParams& p) {
  const int64_t bytes = p.dtype == DType::kFloat32 ? 4 : 2;
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  auto stride_ok = [bytes](int64_t stride) { return (stride * bytes) % 16 == 0; };
  return p.seqlen_q > 0 && p.seqlen_k > 0 && aligned(p.q) && aligned(p.k) && aligned(p.v) &&
         stride_ok(p.q_row_stride) && stride_ok(p.q_head_stride) && stride_ok(p.q_batch_stride) &&
         stride_ok(p.k_row_stride) && stride_ok(p.k_head_stride) && stride_ok(p.k_batch_stride) &&
         stride_ok(p.v_row_stride) && stride_ok(p.v_head_stride) && stride_ok(p.v_batch_stride);
}

// Whether a Hopper kernel built for kHeadDim runs a call of head_dim: a
// narrower head dim runs on the next Hopper one (head_dims.h,
// sm90_kernel_head_dim) with its columns past head_dim zero-filled by TMA;
// rows of a multiple of 8 elements keep TMA's 16-byte alignment and the
// output's pair stores whole.
template <int kHeadDim>
inline bool sm90_runs_head_dim(int head_dim) {
  return head_dim <= kHeadDim && head_dim % 8 == 0;
}

// The instantiation files' registrations (the score kind last: the plain
// kernels' files predate it).
inline bool register_sm90_fwd_kernel(DType dtype, int head_dim, MaskKind mask, FwdKernel kernel,
                                     ScoreKind score = ScoreKind::kPlain) {
  sm90_fwd_kernel_slot(dtype, head_dim, mask, score) = kernel;
  return true;
}

inline bool register_sm90_bwd_kernel(DType dtype, int head_dim, MaskKind mask, BwdKernel kernel,
                                     ScoreKind score = ScoreKind::kPlain) {
  sm90_bwd_kernel_slot(dtype, head_dim, mask, score) = kernel;
  return true;
}

inline bool register_decode_kernel(DType dtype, int head_dim, DecodeKernel kernel) {
  decode_kernel_slot(dtype, head_dim) = kernel;
  return true;
}

inline bool register_fwd_kernel(DType dtype, int head_dim, MaskKind mask, FwdKernel kernel,
                                SmemClass smem = SmemClass::kLarge,
                                ScoreKind score = ScoreKind::kPlain, int tf32_passes = 1) {
  fwd_kernel_slot(dtype, head_dim, mask, score, smem, tf32_passes) = kernel;
  return true;
}
inline bool register_bwd_kernel(DType dtype, int head_dim, MaskKind mask, BwdKernel kernel,
                                SmemClass smem = SmemClass::kLarge,
                                ScoreKind score = ScoreKind::kPlain, int tf32_passes = 1) {
  bwd_kernel_slot(dtype, head_dim, mask, score, smem, tf32_passes) = kernel;
  return true;
}

}  // namespace jflash::cuda

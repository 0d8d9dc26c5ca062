// The launcher interface between the FFI handlers and the kernel instantiations.
//
// Each generated instantiation file (csrc/cuda/instantiations/, written by
// generate_kernels.py) compiles one launcher and records it in the registry
// below when the library loads. The handlers look a launcher up by (dtype,
// head_dim, mask kind); a missing entry means the instantiation was left out of the
// build (JFLASH_CUDA_SUBSET) and becomes an ffi::Error, never a crash.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

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
};

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

// Registry slots; head_dim is one of kKernelHeadDims (jflash/head_dims.h). Return nullptr-launch
// entries for instantiations that were not compiled. SmemClass::kSmall slots
// hold the sm80 kernels of the small-shared-memory tile column (tile_sizes.h),
// filled only for head dims whose kLarge tile needs more than 99 KB.
FwdKernel& fwd_kernel_slot(DType dtype, int head_dim, MaskKind mask,
                           SmemClass smem = SmemClass::kLarge);
BwdKernel& bwd_kernel_slot(DType dtype, int head_dim, MaskKind mask,
                           SmemClass smem = SmemClass::kLarge);

// The Hopper kernels (csrc/cuda/sm90/), chosen on compute capability 9.0.
FwdKernel& sm90_fwd_kernel_slot(DType dtype, int head_dim, MaskKind mask);
BwdKernel& sm90_bwd_kernel_slot(DType dtype, int head_dim, MaskKind mask);

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

inline bool register_sm90_fwd_kernel(DType dtype, int head_dim, MaskKind mask, FwdKernel kernel) {
  sm90_fwd_kernel_slot(dtype, head_dim, mask) = kernel;
  return true;
}

inline bool register_sm90_bwd_kernel(DType dtype, int head_dim, MaskKind mask, BwdKernel kernel) {
  sm90_bwd_kernel_slot(dtype, head_dim, mask) = kernel;
  return true;
}

inline bool register_fwd_kernel(DType dtype, int head_dim, MaskKind mask, FwdKernel kernel,
                                SmemClass smem = SmemClass::kLarge) {
  fwd_kernel_slot(dtype, head_dim, mask, smem) = kernel;
  return true;
}
inline bool register_bwd_kernel(DType dtype, int head_dim, MaskKind mask, BwdKernel kernel,
                                SmemClass smem = SmemClass::kLarge) {
  bwd_kernel_slot(dtype, head_dim, mask, smem) = kernel;
  return true;
}

}  // namespace jflash::cuda

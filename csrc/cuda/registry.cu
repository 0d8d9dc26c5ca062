// Storage for the launcher registry of launch.h. Function-local statics, so
// that the instantiation files may register from their static initializers in
// any order.
#include "cuda/launch.h"
#include "jflash/head_dims.h"

namespace jflash::cuda {
namespace {

constexpr int kNumHeadDims = kNumKernelHeadDims;

// Callers pass one of kKernelHeadDims (the handlers check KernelHeadDim first).
int slot_index(DType dtype, int head_dim, bool banded) {
  const int dtype_index = dtype == DType::kBFloat16 ? 1 : 0;
  return (dtype_index * kNumHeadDims + kernel_head_dim_index(head_dim)) * 2 + (banded ? 1 : 0);
}

}  // namespace

FwdKernel& fwd_kernel_slot(DType dtype, int head_dim, bool banded, SmemClass smem) {
  static FwdKernel large[2 * kNumHeadDims * 2];
  static FwdKernel small[2 * kNumHeadDims * 2];
  return (smem == SmemClass::kSmall ? small : large)[slot_index(dtype, head_dim, banded)];
}

FwdKernel& sm90_fwd_kernel_slot(DType dtype, int head_dim, bool banded) {
  static FwdKernel table[2 * kNumHeadDims * 2];
  return table[slot_index(dtype, head_dim, banded)];
}

BwdKernel& sm90_bwd_kernel_slot(DType dtype, int head_dim, bool banded) {
  static BwdKernel table[2 * kNumHeadDims * 2];
  return table[slot_index(dtype, head_dim, banded)];
}

BwdKernel& bwd_kernel_slot(DType dtype, int head_dim, bool banded, SmemClass smem) {
  static BwdKernel large[2 * kNumHeadDims * 2];
  static BwdKernel small[2 * kNumHeadDims * 2];
  return (smem == SmemClass::kSmall ? small : large)[slot_index(dtype, head_dim, banded)];
}

}  // namespace jflash::cuda

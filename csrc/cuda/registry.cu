// Storage for the launcher registry of launch.h. Function-local statics, so
// that the instantiation files may register from their static initializers in
// any order.
#include "cuda/launch.h"
#include "jflash/head_dims.h"

namespace jflash::cuda {
namespace {

constexpr int kNumHeadDims = kNumKernelHeadDims;

// Callers pass one of kKernelHeadDims (the handlers check KernelHeadDim first)
// and a MaskKind.
constexpr int kNumSlots = 2 * kNumHeadDims * kNumMaskKinds;

int slot_index(DType dtype, int head_dim, MaskKind mask) {
  const int dtype_index = dtype == DType::kBFloat16 ? 1 : 0;
  return (dtype_index * kNumHeadDims + kernel_head_dim_index(head_dim)) * kNumMaskKinds +
         static_cast<int>(mask);
}

}  // namespace

FwdKernel& fwd_kernel_slot(DType dtype, int head_dim, MaskKind mask, SmemClass smem) {
  static FwdKernel large[kNumSlots];
  static FwdKernel small[kNumSlots];
  return (smem == SmemClass::kSmall ? small : large)[slot_index(dtype, head_dim, mask)];
}

FwdKernel& sm90_fwd_kernel_slot(DType dtype, int head_dim, MaskKind mask) {
  static FwdKernel table[kNumSlots];
  return table[slot_index(dtype, head_dim, mask)];
}

BwdKernel& sm90_bwd_kernel_slot(DType dtype, int head_dim, MaskKind mask) {
  static BwdKernel table[kNumSlots];
  return table[slot_index(dtype, head_dim, mask)];
}

BwdKernel& bwd_kernel_slot(DType dtype, int head_dim, MaskKind mask, SmemClass smem) {
  static BwdKernel large[kNumSlots];
  static BwdKernel small[kNumSlots];
  return (smem == SmemClass::kSmall ? small : large)[slot_index(dtype, head_dim, mask)];
}

DecodeKernel& decode_kernel_slot(DType dtype, int head_dim) {
  static DecodeKernel table[2 * kNumKernelHeadDims];
  const int dtype_index = dtype == DType::kBFloat16 ? 1 : 0;
  return table[dtype_index * kNumKernelHeadDims + kernel_head_dim_index(head_dim)];
}

}  // namespace jflash::cuda

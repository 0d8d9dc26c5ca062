// Storage for the launcher registry of launch.h. Function-local statics, so
// that the instantiation files may register from their static initializers in
// any order.
#include "cuda/launch.h"
#include "jflash/head_dims.h"

namespace jflash::cuda {
namespace {

constexpr int kNumHeadDims = kNumKernelHeadDims;

// Callers pass one of kKernelHeadDims (the handlers check KernelHeadDim first),
// a MaskKind and a ScoreKind. Four element kinds: float16, bfloat16, and
// float32 with one or three TF32 passes.
constexpr int kNumElementKinds = 4;
constexpr int kNumSlots = kNumElementKinds * kNumHeadDims * kNumMaskKinds * kNumScoreKinds;

int slot_index(DType dtype, int head_dim, MaskKind mask, ScoreKind score, int tf32_passes = 1) {
  const int dtype_index = dtype == DType::kFloat32 ? (tf32_passes == 3 ? 3 : 2)
                          : dtype == DType::kBFloat16 ? 1
                                                      : 0;
  const int kind = static_cast<int>(mask) * kNumScoreKinds + static_cast<int>(score);
  return (dtype_index * kNumHeadDims + kernel_head_dim_index(head_dim)) * kNumMaskKinds *
             kNumScoreKinds +
         kind;
}

}  // namespace

FwdKernel& fwd_kernel_slot(DType dtype, int head_dim, MaskKind mask, ScoreKind score,
                           SmemClass smem, int tf32_passes) {
  static FwdKernel large[kNumSlots];
  static FwdKernel small[kNumSlots];
  return (smem == SmemClass::kSmall ? small
                                    : large)[slot_index(dtype, head_dim, mask, score, tf32_passes)];
}

FwdKernel& sm90_fwd_kernel_slot(DType dtype, int head_dim, MaskKind mask, ScoreKind score) {
  static FwdKernel table[kNumSlots];
  return table[slot_index(dtype, head_dim, mask, score)];
}

BwdKernel& sm90_bwd_kernel_slot(DType dtype, int head_dim, MaskKind mask, ScoreKind score) {
  static BwdKernel table[kNumSlots];
  return table[slot_index(dtype, head_dim, mask, score)];
}

BwdKernel& bwd_kernel_slot(DType dtype, int head_dim, MaskKind mask, ScoreKind score,
                           SmemClass smem, int tf32_passes) {
  static BwdKernel large[kNumSlots];
  static BwdKernel small[kNumSlots];
  return (smem == SmemClass::kSmall ? small
                                    : large)[slot_index(dtype, head_dim, mask, score, tf32_passes)];
}

DecodeKernel& decode_kernel_slot(DType dtype, int head_dim) {
  static DecodeKernel table[2 * kNumKernelHeadDims];
  const int dtype_index = dtype == DType::kBFloat16 ? 1 : 0;
  return table[dtype_index * kNumKernelHeadDims + kernel_head_dim_index(head_dim)];
}

}  // namespace jflash::cuda

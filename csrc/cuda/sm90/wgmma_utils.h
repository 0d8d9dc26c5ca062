// Warpgroup-level helpers of the Hopper kernels: issuing wgmma products and
// viewing their accumulators.
//
// wgmma runs asynchronously: an issued product writes its accumulator (and
// reads a register A operand) until the matching warpgroup_wait. The compiler
// does not know that, so every register fragment an in-flight product touches
// is fenced (warpgroup_fence_operand) after the wait that completes it, which
// keeps the compiler from moving reads or writes of it above the wait.
#pragma once

#include <cute/tensor.hpp>

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "csrc/cuda/sm90 is compiled for sm_90a only (cuda.cmake: the flash_sm90_* units)"
#endif

namespace jflash::cuda::sm90 {

using namespace cute;

// acc (+)= A B^T over the K mode, issued as one wgmma group (not waited for).
// kZeroInit: the first k-step overwrites acc instead of accumulating, so the
// caller never clears it.
template <bool kZeroInit, typename TiledMma, typename TensorA, typename TensorB,
          typename TensorAcc>
__device__ __forceinline__ void wgmma_issue(TiledMma& tiled_mma, TensorA const& a,
                                            TensorB const& b, TensorAcc& acc) {
  warpgroup_fence_operand(acc);
  warpgroup_arrive();
  if constexpr (kZeroInit) tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    cute::gemm(tiled_mma, a(_, _, k), b(_, _, k), acc);
    tiled_mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
}

// Whether pred holds in any thread of the calling warpgroup (all 128 threads
// must call it, with the same named barrier).
__device__ __forceinline__ bool warpgroup_any(bool pred, uint32_t barrier) {
  uint32_t any;
  asm volatile(
      "{\n"
      ".reg .pred p, q;\n"
      "setp.ne.u32 p, %1, 0;\n"
      "bar.red.or.pred q, %2, 128, p;\n"
      "selp.u32 %0, 1, 0, q;\n"
      "}\n"
      : "=r"(any)
      : "r"(static_cast<uint32_t>(pred)), "r"(barrier));
  return any != 0;
}

// wgmma accumulator ((2 cols, 2 rows, N / 8), MMA_M, MMA_N) viewed as
// (rows, cols). As with mma.sync, the 4 lanes of a quad hold one row.
template <typename Layout>
__device__ __forceinline__ constexpr auto acc_rowcol(Layout l) {
  static_assert(decltype(rank<0>(l))::value == 3 && decltype(size<0, 0>(l))::value == 2);
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)),
                     make_layout(get<0, 0>(l), get<0, 2>(l), get<2>(l)));
}

// The accumulator of S (M x N) as the register A operand of O += P V, whose K
// is N: a k16 A fragment holds two adjacent n8 accumulator column blocks, in
// the same (2 cols, 2 rows) order, so only the view changes:
// ((2, 2, N / 8), MMA_M, MMA_N) -> ((2, 2, 2), MMA_M, (N / 16, MMA_N)).
template <typename Layout>
__device__ __forceinline__ constexpr auto acc_as_a_operand(Layout l) {
  auto split = logical_divide(l, Shape<Shape<Underscore, Underscore, _2>, Underscore, Underscore>{});
  return make_layout(make_layout(get<0, 0>(split), get<0, 1>(split), get<0, 2, 0>(split)),
                     get<1>(split), make_layout(get<0, 2, 1>(split), get<2>(split)));
}

}  // namespace jflash::cuda::sm90

// The Hopper backward's per-step row statistics (lse, delta) as a consumer
// thread's S^T accumulator needs them: one value per query column it holds,
// read from the step's shared-memory buffer (mainloop_bwd_sm90.h says who
// fills it when).
#pragma once

#include <cute/tensor.hpp>

namespace jflash::cuda::sm90 {

using namespace cute;

// A step's lse or delta for the query columns of a thread's S^T accumulator,
// spread over the lanes that share them (Traits::kTightRegisters). The kCols
// columns of a thread are a pair of adjacent ones in each 8-column block,
// the same pairs for the 8 lanes of a warp with equal lane % 4 (the wgmma
// accumulator layout). Each of those lanes reads the pairs of every 8th
// block, starting at block lane / 4, and a use fetches its value from the
// lane that read it: ceil(kCols / 16) register pairs instead of kCols
// registers, for a shuffle per use.
template <int kCols>
struct SharedColumnStat {
  static constexpr int kBlocks = kCols / 2;
  static constexpr int kHeld = (kBlocks + 7) / 8;
  float2 held[kHeld];

  // stat: the step's buffer (one value per query row of the tile); cols:
  // the (key, query row) coordinates of the thread's accumulator as (rows,
  // cols).
  template <typename Coords>
  __device__ __forceinline__ void load(const float* stat, const Coords& cols, int lane) {
    CUTE_UNROLL
    for (int k = 0; k < kHeld; ++k) {
      const int block = lane / 4 + 8 * k;
      held[k] = block < kBlocks
                    ? *reinterpret_cast<const float2*>(stat + get<1>(cols(0, 2 * block)))
                    : make_float2(0.f, 0.f);
    }
  }
  // The value of the thread's column kC, from lane kC / 2 % 8 * 4 + lane % 4:
  // shfl's segment mask (bits 8-12 of its third operand) keeps the two low
  // bits of the lane, so the source is an immediate.
  template <int kC>
  __device__ __forceinline__ float at() const {
    constexpr int kBlock = kC / 2;
    const float2 v = held[kBlock / 8];
    float out;
    asm volatile("shfl.sync.idx.b32 %0, %1, %2, 0x31f, 0xffffffff;"
                 : "=f"(out)
                 : "f"(kC % 2 ? v.y : v.x), "n"(kBlock % 8 * 4));
    return out;
  }
};

// out[c] = stat[query row of the thread's column c], for a step's lse or
// delta: spread over the lanes (SharedColumnStat) where kShared, else kCols
// loads.
template <bool kShared, int kCols, typename Coords>
__device__ __forceinline__ void load_column_stat(float (&out)[kCols], const float* stat,
                                                 const Coords& cols, int lane) {
  if constexpr (kShared) {
    SharedColumnStat<kCols> shared;
    shared.load(stat, cols, lane);
    for_each(make_int_sequence<kCols>{}, [&](auto c) { out[c] = shared.template at<c>(); });
  } else {
    CUTE_UNROLL
    for (int c = 0; c < kCols; ++c) out[c] = stat[get<1>(cols(0, c))];
  }
}

}  // namespace jflash::cuda::sm90

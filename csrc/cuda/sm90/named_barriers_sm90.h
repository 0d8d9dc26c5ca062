// The named barriers of the Hopper forward's consumer warpgroups. Ids are in
// CUTLASS's numbering, past its reserved ones: cutlass::arch::NamedBarrier
// adds ReservedNamedBarrierCount to each, and so does vote_any below.
#pragma once

#include <cstdint>

#include <cute/config.hpp>
#include <cutlass/arch/barrier.h>

#include "cuda/sm90/wgmma_utils.h"

namespace jflash::cuda::sm90 {

template <int kConsumers, bool kPingPong>
struct FwdNamedBarriersSm90 {
  // Each kind has one barrier per consumer warpgroup c, at id kKind + c.
  enum Id : uint32_t {
    // Ping-pong (two consumers): consumer c may issue its products once
    // kTurn + c completes (the mainloop's begin_issue / end_issue).
    kTurn = 1,
    // The epilogue: the consumer's 128 threads around the stmatrix of its slab.
    kEpilogue = kTurn + (kPingPong ? 2 : 0),
    // The stale-max softmax's vote of the consumer's 128 threads.
    kVote = kEpilogue + kConsumers,
    kEnd = kVote + kConsumers,
  };
  static_assert(cutlass::arch::NamedBarrier::ReservedNamedBarrierCount + kEnd <=
                cutlass::arch::NamedBarrier::HardwareMaxNumNamedBarriers);

  CUTE_DEVICE static void sync(uint32_t num_threads, uint32_t id) {
    cutlass::arch::NamedBarrier::sync(num_threads, id);
  }
  CUTE_DEVICE static void arrive(uint32_t num_threads, uint32_t id) {
    cutlass::arch::NamedBarrier::arrive(num_threads, id);
  }
  // Whether pred holds in any thread of the consumer's warpgroup.
  CUTE_DEVICE static bool vote_any(bool pred, int consumer) {
    return warpgroup_any(pred, cutlass::arch::NamedBarrier::ReservedNamedBarrierCount + kVote + consumer);
  }
};

}  // namespace jflash::cuda::sm90

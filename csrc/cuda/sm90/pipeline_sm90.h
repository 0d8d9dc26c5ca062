// Shared-memory buffers handed from a TMA producer to wgmma consumers on
// Hopper: a single buffer (the forward's Q) or a ring of kStages buffers (its
// K and V tiles) that runs on across tiles. Each buffer is guarded by two
// mbarriers:
//   full:  the producer's one arrival with the bytes it expects, completed
//          when the TMA copies have landed;
//   empty: one arrival per consumer warp, once the warp is done reading it.
// Independent of any kernel's traits: the helpers take the barriers' addresses.
#pragma once

#include <cstdint>

#include <cute/config.hpp>
#include <cute/arch/util.hpp>
#include <cutlass/arch/barrier.h>

namespace jflash::cuda::sm90 {

using FullBarrier = cutlass::arch::ClusterTransactionBarrier;
using EmptyBarrier = cutlass::arch::ClusterBarrier;

// Ring position of the i-th K/V tile: buffer and the mbarrier phase parity
// that its n-th fill completes. A single buffer is a ring of one stage.
template <int kStages>
struct RingSlot {
  int stage;
  uint32_t phase;
  __device__ __forceinline__ explicit RingSlot(int i) : stage(i % kStages), phase((i / kStages) & 1) {}
};

// One thread, before any use (then fence_barrier_init and a CTA barrier).
CUTE_DEVICE void init_buffer_barriers(uint64_t* full, uint64_t* empty, uint32_t consumer_warps) {
  FullBarrier::init(full, 1);
  EmptyBarrier::init(empty, consumer_warps);
}

// Producer: waits until the consumers have freed the buffer of fill `phase`,
// then arms its full barrier for `bytes` of TMA copies. A fresh mbarrier
// counts as having completed the phase before phase 0, so the first wait on
// each "empty" barrier passes at once.
// `publish()` runs once the buffer is free and before the full barrier is
// armed: shared-memory stores it makes reach the consumers with the buffer
// (the arrival releases them, the consumers' wait acquires them).
template <typename Publish>
CUTE_DEVICE void producer_acquire(uint64_t* empty, uint64_t* full, uint32_t phase, uint32_t bytes,
                                  Publish&& publish) {
  EmptyBarrier::wait(empty, phase ^ 1);
  publish();
  FullBarrier::arrive_and_expect_tx(full, bytes);
}
CUTE_DEVICE void producer_acquire(uint64_t* empty, uint64_t* full, uint32_t phase, uint32_t bytes) {
  producer_acquire(empty, full, phase, bytes, [] {});
}

// Consumer: waits until fill `phase` of the buffer has landed.
CUTE_DEVICE void consumer_wait(uint64_t* full, uint32_t phase) { FullBarrier::wait(full, phase); }

// Consumer: one arrival per warp, after the wgmma wait that completes its
// reads of the buffer (the wait is warp-synchronous, so lane 0 speaks for all).
CUTE_DEVICE void consumer_release(uint64_t* empty, bool warp_leader) {
  if (warp_leader) EmptyBarrier::arrive(empty);
}

// A two-entry ring of int values handed from one producer thread to the
// consumer threads (the forward's work units under a dynamic schedule):
// entry i of the sequence lives in value[i % 2]; full counts the producer's
// arrival, empty every consumer thread's, each after its own read, so that
// the read is ordered before the producer's next write of the entry (one
// arrival per warp would leave the other lanes' reads unordered). The value
// moves through asm volatile shared-memory accesses, which the compiler keeps
// on their side of the barriers' asm volatile waits and arrivals (those have
// no memory clobber).
struct IntRingSm90 {
  int value[2];
  uint64_t full[2];
  uint64_t empty[2];

  // One thread, before any use (then fence_barrier_init and a CTA barrier).
  CUTE_DEVICE void init(uint32_t consumer_threads) {
    CUTE_UNROLL
    for (int s = 0; s < 2; ++s) {
      EmptyBarrier::init(&full[s], 1);
      EmptyBarrier::init(&empty[s], consumer_threads);
    }
  }
  // Producer: entry i, once every consumer thread has read entry i - 2.
  CUTE_DEVICE void push(int i, int v) {
    const int s = i & 1;
    EmptyBarrier::wait(&empty[s], ((i >> 1) & 1) ^ 1);
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(cute::cast_smem_ptr_to_uint(&value[s])), "r"(v));
    EmptyBarrier::arrive(&full[s]);
  }
  // Every consumer thread: entry i.
  CUTE_DEVICE int pop(int i) {
    const int s = i & 1;
    EmptyBarrier::wait(&full[s], (i >> 1) & 1);
    int v;
    asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(cute::cast_smem_ptr_to_uint(&value[s])));
    EmptyBarrier::arrive(&empty[s]);
    return v;
  }
};

}  // namespace jflash::cuda::sm90

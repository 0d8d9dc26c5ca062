// The Hopper backward's outputs: dQ every step (a consumer stages its slice
// in shared memory, its writer thread adds it into dq_accum with a TMA
// reduce-add) and dK, dV once per CTA.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "cuda/flash_bwd_preprocess.h"
#include "cuda/sm90/pipeline_sm90.h"
#include "cuda/sm90/traits_bwd_sm90.h"
#include "jflash/params.h"

namespace jflash::cuda::sm90 {

using namespace cute;

// Orders this thread's generic-proxy accesses of global memory against its
// async-proxy (TMA) ones, both ways.
__device__ __forceinline__ void fence_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// Waits until this thread's bulk async groups but the newest `kPending` have
// completed, their writes included (CuTe's tma_store_wait waits for their
// shared-memory reads only).
template <int kPending>
__device__ __forceinline__ void bulk_wait_complete() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(kPending) : "memory");
}

// The dQ writer of consumer warpgroup `consumer` (one thread of producer warp
// 1 + consumer). Each step, once the consumer has staged its slice of the dQ
// tile (with kDqOwnKeys its whole tile over its own keys) in shared memory
// (dq_full), one TMA reduce-add of it into dq_accum;
// the buffer is the consumer's again (dq_empty) once the TMA has read it. In
// deterministic mode it first waits for the earlier key blocks' additions to
// the slice and, once its own has landed, counts itself in: global-memory
// latencies that the consumers never wait for (they stage into the other
// buffer meanwhile).
template <typename Traits, typename Steps>
__device__ __forceinline__ void write_dq(const BwdArgsSm90<Traits>& args,
                                         typename Traits::SharedStorage& smem, const Steps& steps,
                                         int consumer, int n_block, int batch) {
  const BwdParams& params = args.params;
  Tensor sdQ = make_tensor(make_smem_ptr(smem.dq.begin()), typename Traits::SmemLayoutdQ{});
  Tensor mdQ = args.tma_dq.get_tma_tensor(Traits::shape_q(params));
  StepWalk<Traits::kStepCursor, Steps> walk(steps);
  for (int step = 0; step < steps.num_steps; ++step) {
    int head, m_block;
    walk.unit(step, head, m_block);
    const RingSlot<Traits::kDqBuffers> slot(step);
    EmptyBarrier::wait(&smem.dq_full[consumer][slot.stage], slot.phase);
    int* semaphore = nullptr;
    if (steps.ordered()) {
      // A counter per consumer's column slice, or with kDqOwnKeys one for
      // the tile, which both consumers of a key block add into, 0 then 1.
      const int earlier = n_block - steps.first_key_block(params, m_block, batch);
      if constexpr (Traits::kDqOwnKeys) {
        semaphore = dq_semaphore_at(params, batch, head, m_block, 0, 1);
        dq_semaphore_wait(semaphore, Traits::kConsumerWarpgroups * earlier + consumer);
      } else {
        semaphore =
            dq_semaphore_at(params, batch, head, m_block, consumer, Traits::kConsumerWarpgroups);
        dq_semaphore_wait(semaphore, earlier);
      }
      fence_async_global();  // the acquire, before this reduce-add
    }
    // The consumer's slice of query block m_block: its rows (kDqSplitRows),
    // its columns, or (kDqOwnKeys) the whole tile.
    constexpr int kSlices = Traits::kConsumerWarpgroups;
    Tensor gdQ = local_tile(
        mdQ(_, _, head, batch), Shape<Int<Traits::kDqRows>, Int<Traits::kDqCols>>{},
        Traits::kDqSplitRows ? make_coord(m_block * kSlices + consumer, 0)
                             : make_coord(m_block, Traits::kDqOwnKeys ? 0 : consumer));
    auto [tdQgdQ, tdQsdQ] =
        tma_partition(args.tma_dq, Int<0>{}, Layout<_1>{},
                      group_modes<0, 2>(sdQ(_, _, consumer, slot.stage)), group_modes<0, 2>(gdQ));
    copy(args.tma_dq, tdQsdQ, tdQgdQ);
    tma_store_arrive();
    tma_store_wait<0>();  // read out of shared memory
    EmptyBarrier::arrive(&smem.dq_empty[consumer][slot.stage]);
    if (steps.ordered()) {
      bulk_wait_complete<0>();  // added into dq_accum
      fence_async_global();
      dq_semaphore_signal(semaphore);
    }
  }
}

// dQ_accum += dS K (scaled in the convert kernel): registers -> this
// consumer's staging buffer -> its writer's TMA reduce-add (write_dq),
// which clips rows past seqlen_q. The buffer is free again once the
// reduce of kDqBuffers steps ago has read it. 8-byte shared stores:
// CuTe's element copy compiles to generic stores here (the swizzled
// address hides the state space).
// tdQsdQ: the staging buffers as acc_dq's partition sees them (MMA, MMA_M,
// MMA_N, buffer); step: the consumer's step, whose buffer it takes.
template <typename Traits, typename AccDq, typename StagingDq>
__device__ __forceinline__ void stage_dq(typename Traits::SharedStorage& smem, const AccDq& acc_dq,
                                         const StagingDq& tdQsdQ, int consumer, int step,
                                         bool warp_leader) {
  const RingSlot<Traits::kDqBuffers> dq_slot(step);
  EmptyBarrier::wait(&smem.dq_empty[consumer][dq_slot.stage], dq_slot.phase ^ 1);
  if constexpr (Traits::kDqTransposed) {
    // Transposed into the [rows, head_dim] buffer: a thread's two adjacent
    // accumulator columns are two query rows, so one float per store
    // (traits: SmemLayoutdQt). Its values come in blocks of 8 query rows
    // (columns), each (2 columns, 2 rows), and the buffer's swizzle repeats
    // every 8 rows: the addresses of the first block plus an immediate per
    // block. (Each address computed alone, the compiler hoisted all 40 out
    // of the loop, 40 registers.)
    // The swizzle acts on byte addresses (bits [num_base, num_base +
    // num_bits) ^= the num_bits bits num_shft above them).
    using DqSwizzle = decltype(get_swizzle_portion(typename Traits::SmemLayoutdQ{}));
    constexpr auto dq_plain = get_nonswizzle_portion(typename Traits::SmemLayoutdQ{});
    constexpr int kBlockBytes = (dq_plain(8, 0, 0, 0) - dq_plain(0, 0, 0, 0)) * sizeof(float);
    static_assert(kBlockBytes % (1 << (DqSwizzle::num_bits + DqSwizzle::num_base +
                                       DqSwizzle::num_shft)) ==
                  0);
    static_assert(decltype(size<0, 0>(acc_dq))::value == 2 &&
                  decltype(size<0, 1>(acc_dq))::value == 2);
    uint32_t dq_addr[4];
    CUTE_UNROLL
    for (int r = 0; r < 4; ++r) {
      dq_addr[r] = cast_smem_ptr_to_uint(&tdQsdQ(_, _, _, dq_slot.stage)(r));
    }
    for_each(make_int_sequence<decltype(size(acc_dq))::value>{}, [&](auto i) {
      asm volatile("st.shared.f32 [%0+%2], %1;" ::"r"(dq_addr[i % 4]), "f"(acc_dq(i)),
                   "n"(decltype(i)::value / 4 * kBlockBytes)
                   : "memory");
    });
  } else {
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dq); i += 2) {
      asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(
                       cast_smem_ptr_to_uint(&tdQsdQ(_, _, _, dq_slot.stage)(i))),
                   "f"(acc_dq(i)), "f"(acc_dq(i + 1))
                   : "memory");
    }
  }
  tma_store_fence();  // this thread's generic-proxy writes, visible to TMA
  __syncwarp();
  if (warp_leader) EmptyBarrier::arrive(&smem.dq_full[consumer][dq_slot.stage]);
}

// dK and dV of the key block, written once through shared memory: each
// consumer's accumulators (dK scaled) go by stmatrix into the K and V
// buffers, which nothing reads once both consumers' last products are done
// (a named barrier joins them; the K and V loads landed before the first
// step, or never came where there are no steps), and the first dQ writer
// thread stores both tiles with TMA (store_dk_dv_tma), which clips rows
// past seqlen_k and columns past the call's head dim. Against each
// thread's direct 4-byte stores of its accumulator pairs (two per 32-byte
// sector, an address and a bounds branch per pair), the consumers are done
// after a few shared stores, and the CTA, alone on its SM, ends sooner.
// (The writer issues the TMA store so that no consumer thread waits for it.)
// Where the kernel adds into dkv_accum (params.adds_dkv(): split GQA groups,
// or the caller's sums) it stages float32 tiles instead, dK over the K and V
// buffers and dV over the Q and dO ring (also read out by then, and no load is
// left to come), which the writer reduce-adds there.
// kBarrier: a named barrier of the consumer threads, free at this point.
template <typename Traits, uint32_t kBarrier, typename AccDK, typename AccDV, typename ThrMmadKV>
__device__ __forceinline__ void stage_dk_dv(typename Traits::SharedStorage& smem, AccDK& acc_dk,
                                            const AccDV& acc_dv, const ThrMmadKV& thr_dkv,
                                            int tidx, const BwdParams& params) {
  using Element = typename Traits::Element;
  Tensor sK = make_tensor(make_smem_ptr(smem.k.begin()), typename Traits::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(smem.v.begin()), typename Traits::SmemLayoutK{});
  typename Traits::SmemCopydKV smem_copy;
  auto thr_copy = smem_copy.get_thread_slice(tidx);
  cutlass::arch::NamedBarrier::sync(Traits::kConsumerThreads, kBarrier);  // K, V, Q, dO read out
  if (params.adds_dkv()) {
    // float32 sums (dK scaled, as dk), dK over the K and V buffers and dV
    // over the Q and dO ring; a thread's
    // accumulator pairs are adjacent columns, 8 bytes in these layouts.
    // Addresses: four bases plus immediates per thread (the traits'
    // dkv_accum_base and dkv_accum_offset say why). (One address per pair,
    // the compiler kept them all in registers: 48 bytes of spill at head
    // dim 128.)
    using Layout = typename Traits::SmemLayoutdKVAccum;
    Tensor sdK = make_tensor(make_smem_ptr(reinterpret_cast<float*>(smem.k.begin())), Layout{});
    Tensor cdKV = thr_dkv.partition_C(make_identity_tensor(
        Shape<Int<Traits::kBlockN>, Int<Traits::kHeadDim>>{}));
    const int row0 = get<0>(cdKV(0)), col0 = get<1>(cdKV(0));
    uint32_t k_addr[4];
    CUTE_UNROLL
    for (int c = 0; c < 4; ++c) k_addr[c] = cast_smem_ptr_to_uint(&sdK(row0, col0 + 8 * c));
    const uint32_t v_minus_k = cast_smem_ptr_to_uint(smem.q.begin()) -
                               cast_smem_ptr_to_uint(smem.k.begin());
    const float scale = params.softmax_scale;
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dk); i += 2) {
      const int dr = get<0>(cdKV(i)) - row0, dc = get<1>(cdKV(i)) - col0;
      const int c = Traits::dkv_accum_base(dc);
      const uint32_t offset = Traits::dkv_accum_offset(dr, dc) * sizeof(float);
      asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(k_addr[c] + offset),
                   "f"(scale * acc_dk(i)), "f"(scale * acc_dk(i + 1))
                   : "memory");
      asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(k_addr[c] + v_minus_k + offset),
                   "f"(acc_dv(i)), "f"(acc_dv(i + 1))
                   : "memory");
    }
  } else {
    // One tile at a time: dV's 16-bit copy never lives beside dK's.
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dk); ++i) acc_dk(i) *= params.softmax_scale;
    copy(smem_copy, thr_copy.retile_S(convert_fragment<Element>(acc_dk)), thr_copy.partition_D(sK));
    copy(smem_copy, thr_copy.retile_S(convert_fragment<Element>(acc_dv)), thr_copy.partition_D(sV));
  }
  tma_store_fence();  // this thread's shared stores, visible to TMA
  __syncwarp();
  if (tidx % 32 == 0) EmptyBarrier::arrive(&smem.dkv_full);
}

// The TMA stores of the staged dK and dV tiles (one thread: the first dQ
// writer, after its last reduce-add).
template <typename Traits>
__device__ __forceinline__ void store_dk_dv_tma(const BwdArgsSm90<Traits>& args,
                                                typename Traits::SharedStorage& smem,
                                                int n_block, int kv_head, int batch) {
  const BwdParams& params = args.params;
  EmptyBarrier::wait(&smem.dkv_full, 0);
  if (params.adds_dkv()) {
    Tensor sdK = make_tensor(make_smem_ptr(reinterpret_cast<float*>(smem.k.begin())),
                             typename Traits::SmemLayoutdKVAccum{});
    Tensor sdV = make_tensor(make_smem_ptr(reinterpret_cast<float*>(smem.q.begin())),
                             typename Traits::SmemLayoutdKVAccum{});
    auto [tdKgA, tdKsA] = key_block_tma_partition<Traits>(args.tma_dk_accum, sdK, params,
                                                          n_block, kv_head, batch);
    auto [tdVgA, tdVsA] = key_block_tma_partition<Traits>(args.tma_dv_accum, sdV, params,
                                                          n_block, kv_head, batch);
    copy(args.tma_dk_accum, tdKsA, tdKgA);
    copy(args.tma_dv_accum, tdVsA, tdVgA);
  } else {
    Tensor sK = make_tensor(make_smem_ptr(smem.k.begin()), typename Traits::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(smem.v.begin()), typename Traits::SmemLayoutK{});
    auto [tdKgdK, tdKsdK] =
        key_block_tma_partition<Traits>(args.tma_dk, sK, params, n_block, kv_head, batch);
    auto [tdVgdV, tdVsdV] =
        key_block_tma_partition<Traits>(args.tma_dv, sV, params, n_block, kv_head, batch);
    copy(args.tma_dk, tdKsdK, tdKgdK);
    copy(args.tma_dv, tdVsdV, tdVgdV);
  }
  tma_store_arrive();
  tma_store_wait<0>();  // read out of shared memory before the CTA ends
}

// dK and dV of the key block from key0, written once (stage_dk_dv, then the
// writer's store_dk_dv_tma; with Traits::kDkvThroughSmem false, each thread's
// stores), or added in float32 into dkv_accum (params.adds_dkv(): to the
// other shares' of a split group, converted after the kernel, or to the
// caller's sums).
template <typename Traits, uint32_t kBarrier, typename AccDK, typename AccDV, typename ThrMmadKV>
__device__ __forceinline__ void write_dk_dv(typename Traits::SharedStorage& smem, AccDK& acc_dk,
                                            AccDV& acc_dv, const ThrMmadKV& thr_dkv, int tidx,
                                            int key0, int batch, int kv_head,
                                            const BwdParams& params) {
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  // Each accumulator element's (key, column): built only on the paths that
  // take it.
  auto dkv_coords = [&] {
    return thr_dkv.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  };
  if constexpr (Traits::kDkvThroughSmem) {
    stage_dk_dv<Traits, kBarrier>(smem, acc_dk, acc_dv, thr_dkv, tidx, params);
  } else if (params.adds_dkv()) {
    add_dk_dv(acc_dk, acc_dv, dkv_coords(), key0, batch, kv_head, params);
  } else {
    store_dk_dv<typename Traits::Element>(acc_dk, acc_dv, dkv_coords(), key0, batch, kv_head,
                                          params, params.head_dim);
  }
}

}  // namespace jflash::cuda::sm90

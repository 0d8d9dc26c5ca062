// Hopper backward (sm90a): dq, dk, dv of the forward, recomputing P from lse,
// with TMA loads, wgmma products and warp specialization (FlashAttention-3's
// design, section 3 of its paper; our own code).
//
// One CTA per (key block, kv head, batch), or per share of the kv head's query
// heads where a GQA group is split (BwdSchedulerSm90, tile_scheduler_sm90.h).
// It keeps its block_n keys' K and V tiles and their dK, dV accumulators on
// chip, and walks every (query head of its share of the GQA group, query
// block) pair whose rows the band lets see the keys:
//
//   S^T  = K Q^T                    (wgmma, both from shared memory)
//   dP^T = V dO^T
//   P^T  = exp2(S^T * scale_log2 - lse_log2)          (registers)
//   dV  += P^T dO                   (wgmma, P^T from registers)
//   dS^T = P^T * (dP^T - delta)
//   (softcap, kScore: P^T of t = tanh(S^T * softcap_scale), and dS^T times
//   1 - t^2; jflash/score.h)
//   dK  += dS^T Q                   (wgmma, dS^T from registers)
//   dQ   = dS K                     (wgmma, dS from shared memory), added into
//                                    the float32 dq_accum by a TMA reduce-add
//                                    (dQ^T = K^T dS^T where block_m is not a
//                                    multiple of wgmma's M: kDqTransposed)
//
// Computing S^T and dP^T (keys along M) rather than S and dP leaves P^T and
// dS^T in the accumulator layout that is the register A operand of the dV and
// dK products, so only dS goes through shared memory (for dQ, whose M is the
// query block).
//
// Roles (warpgroups of 128 threads):
//   warpgroup 0, the producer: in warp 0 one thread loads K and V once, then
//     each step's Q and dO tiles into a ring of q_stages buffers
//     (pipeline_sm90.h), each guarded by a "full" mbarrier (TMA bytes landed)
//     and an "empty" one (every consumer warp is done reading it); in warp
//     1 + w one thread writes consumer w's dQ (write_dq). It gives most of its
//     registers away (setmaxnreg).
//   warpgroups 1..: the consumers, 64 keys each (S^T, dP^T, dV, dK rows).
//     The dQ product needs all of dS: each consumer writes its dS^T rows into
//     shared memory, a named barrier joins them, and consumer w computes dQ's
//     head-dim columns [w, w + 1) * head_dim / consumers. Each step's lse and
//     delta come through shared memory too, loaded a step ahead by consumer
//     threads and ordered by the same barrier. Each consumer stages its dQ
//     slice in one of two shared-memory buffers for its writer.
//   With Traits::kPdSShared (head dim 256) both consumers share the CTA's 64
//     keys: S^T and dP^T split by query columns, dV and dK by head-dim
//     columns, so P^T and dS^T both go through shared memory (a named barrier
//     after each) and are the A operands of dV and dK from there.
// docs/hopper_backward.md gives the measurement behind each choice.
//
// Deterministic mode (params.dq_semaphore set): each dQ reduce-add waits for
// the earlier key blocks' (KeyBlockSteps, flash_bwd_preprocess.h); the
// writers wait and count, so that the consumers see no global-memory latency.
//
// Before the main kernel, delta = rowsum(dO * O) - dlse and dq_accum = 0
// (flash_bwd_preprocess.h); after it, dq = softmax_scale * dq_accum.
//
// Masking: the band decides which query blocks a key block visits (block
// ranges of jflash/mask.h), and only tiles the band cuts, or the last key
// block, are masked per element. Rows past seqlen_q arrive as zeros (TMA's
// out-of-bounds fill) and get lse = +inf, so P = 0 there.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include <cute/arch/cluster_sm90.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_types.h>

#include "cuda/flash_bwd_preprocess.h"
#include "cuda/launch.h"
#include "cuda/sm90/pipeline_sm90.h"
#include "cuda/sm90/tile_scheduler_sm90.h"
#include "cuda/sm90/traits_bwd_sm90.h"
#include "cuda/sm90/wgmma_utils.h"
#include "cuda/utils.h"
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
// tile in shared memory (dq_full), one TMA reduce-add of it into dq_accum;
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
  for (int step = 0; step < steps.num_steps; ++step) {
    int head, m_block;
    steps.unit(step, head, m_block);
    const RingSlot<Traits::kDqBuffers> slot(step);
    EmptyBarrier::wait(&smem.dq_full[consumer][slot.stage], slot.phase);
    int* semaphore = nullptr;
    if (steps.ordered()) {
      semaphore =
          dq_semaphore_at(params, batch, head, m_block, consumer, Traits::kConsumerWarpgroups);
      dq_semaphore_wait(semaphore, n_block - steps.first_key_block(params, m_block, batch));
      fence_async_global();  // the acquire, before this reduce-add
    }
    Tensor gdQ = local_tile(mdQ(_, _, head, batch),
                            Shape<Int<Traits::kBlockM>, Int<Traits::kDqCols>>{},
                            make_coord(m_block, consumer));
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

template <typename Traits, typename Mask, ScoreKind kScore>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    flash_bwd_sm90_kernel(const __grid_constant__ BwdArgsSm90<Traits> args) {
  using Element = typename Traits::Element;
  using SharedStorage = typename Traits::SharedStorage;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kStages = Traits::kStages;

  const BwdParams& params = args.params;
  extern __shared__ __align__(1024) char smem_raw[];
  SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);

  const auto unit = BwdSchedulerSm90<kBlockM, kBlockN, Mask>::unit(params);
  const int n_block = unit.n_block;
  const int kv_head = unit.kv_head;
  const int batch = unit.batch;
  const KeyBlockSteps<kBlockM, kBlockN, Mask> steps(params, n_block, kv_head, batch, unit.split,
                                                    params.head_splits);

  const int warpgroup = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    FullBarrier::init(&smem.kv_full, 1);
    CUTE_UNROLL
    for (int s = 0; s < kStages; ++s) {
      init_buffer_barriers(&smem.qdo_full[s], &smem.qdo_empty[s], Traits::kConsumerThreads / 32);
    }
    CUTE_UNROLL
    for (int c = 0; c < Traits::kConsumerWarpgroups; ++c) {
      CUTE_UNROLL
      for (int b = 0; b < Traits::kDqBuffers; ++b) {
        EmptyBarrier::init(&smem.dq_full[c][b], 4);  // the consumer's four warps
        EmptyBarrier::init(&smem.dq_empty[c][b], 1);  // its writer
      }
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  Tensor sQ = make_tensor(make_smem_ptr(smem.q.begin()), typename Traits::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(smem.dout.begin()), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(smem.k.begin()), typename Traits::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(smem.v.begin()), typename Traits::SmemLayoutK{});

  if (warpgroup == 0) {
    // ---------------------------------------------------------------- producer
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegisters>();
    const int warp = threadIdx.x / 32;
    if (warp > Traits::kConsumerWarpgroups || !cute::elect_one_sync() || steps.num_steps == 0) {
      return;
    }
    if (warp > 0) {
      write_dq(args, smem, steps, warp - 1, n_block, batch);
      return;
    }

    Tensor mQ = args.tma_q.get_tma_tensor(Traits::shape_q(params));
    Tensor mdO = args.tma_dout.get_tma_tensor(Traits::shape_q(params));
    Tensor mK = args.tma_k.get_tma_tensor(Traits::shape_k(params));
    Tensor mV = args.tma_v.get_tma_tensor(Traits::shape_k(params));
    auto kv_tile = [&](auto& m) {
      return local_tile(m(_, _, kv_head, batch), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                        make_coord(n_block, 0));
    };
    auto [tKgK, tKsK] = tma_partition(args.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK),
                                      group_modes<0, 2>(kv_tile(mK)));
    auto [tVgV, tVsV] = tma_partition(args.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV),
                                      group_modes<0, 2>(kv_tile(mV)));
    FullBarrier::arrive_and_expect_tx(&smem.kv_full, 2 * Traits::kKBytes);
    copy(args.tma_k.with(smem.kv_full), tKgK, tKsK);
    copy(args.tma_v.with(smem.kv_full), tVgV, tVsV);

    for (int step = 0; step < steps.num_steps; ++step) {
      int head, m_block;
      steps.unit(step, head, m_block);
      auto q_tile = [&](auto& m) {
        return local_tile(m(_, _, head, batch), Shape<Int<kBlockM>, Int<kHeadDim>>{},
                          make_coord(m_block, 0));
      };
      auto [tQgQ, tQsQ] = tma_partition(args.tma_q, Int<0>{}, Layout<_1>{},
                                        group_modes<0, 2>(sQ), group_modes<0, 2>(q_tile(mQ)));
      auto [tdOgdO, tdOsdO] = tma_partition(args.tma_dout, Int<0>{}, Layout<_1>{},
                                            group_modes<0, 2>(sdO), group_modes<0, 2>(q_tile(mdO)));
      const RingSlot<kStages> slot(step);
      producer_acquire(&smem.qdo_empty[slot.stage], &smem.qdo_full[slot.stage], slot.phase,
                       2 * Traits::kQBytes);
      copy(args.tma_q.with(smem.qdo_full[slot.stage]), tQgQ, tQsQ(_, slot.stage));
      copy(args.tma_dout.with(smem.qdo_full[slot.stage]), tdOgdO, tdOsdO(_, slot.stage));
    }
    return;
  }

  // ------------------------------------------------------------------ consumers
  cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegisters>();
  const int tidx = threadIdx.x - 128;  // 0 .. kConsumerThreads - 1

  Tensor sQt = make_tensor(make_smem_ptr(smem.q.begin()), typename Traits::SmemLayoutQt{});
  Tensor sdOt = make_tensor(make_smem_ptr(smem.dout.begin()), typename Traits::SmemLayoutQt{});
  Tensor sKt = make_tensor(make_smem_ptr(smem.k.begin()), typename Traits::SmemLayoutKt{});
  Tensor sdS = make_tensor(make_smem_ptr(smem.ds.begin()), typename Traits::SmemLayoutdS{});
  Tensor sdSt = make_tensor(make_smem_ptr(smem.ds.begin()), typename Traits::SmemLayoutdSt{});

  typename Traits::TiledMmaSdP mma_sdp;
  typename Traits::TiledMmadKV mma_dkv;
  typename Traits::TiledMmadQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(tidx);
  auto thr_dkv = mma_dkv.get_thread_slice(tidx);
  auto thr_dq = mma_dq.get_thread_slice(tidx);
  // Shared-memory descriptors of the operands; the ones with a last mode of
  // stages (Q, dO) or buffers (dS) are indexed by it.
  Tensor tSrK = thr_sdp.partition_fragment_A(sK);      // (MMA, MMA_M, MMA_K)
  Tensor tSrQ = thr_sdp.partition_fragment_B(sQ);      // (MMA, MMA_N, MMA_K, stage)
  Tensor tdPrV = thr_sdp.partition_fragment_A(sV);
  Tensor tdPrdO = thr_sdp.partition_fragment_B(sdO);
  Tensor tdVrdO = thr_dkv.partition_fragment_B(sdOt);  // (MMA, MMA_N, MMA_K, stage)
  Tensor tdKrQ = thr_dkv.partition_fragment_B(sQt);
  // dQ = dS K: dS is A, K^T B; dQ^T = K^T dS^T: the other way round.
  // (MMA, MMA_M or MMA_N, MMA_K, buffer) and (MMA, MMA_N or MMA_M, MMA_K)
  Tensor tdQrdS = [&] {
    if constexpr (Traits::kDqTransposed) return thr_dq.partition_fragment_B(sdS);
    else return thr_dq.partition_fragment_A(sdS);
  }();
  Tensor tdQrK = [&] {
    if constexpr (Traits::kDqTransposed) return thr_dq.partition_fragment_A(sKt);
    else return thr_dq.partition_fragment_B(sKt);
  }();

  typename Traits::SmemCopydS smem_copy_ds;
  auto thr_copy_ds = smem_copy_ds.get_thread_slice(tidx);
  Tensor tdSsdS = thr_copy_ds.partition_D(sdSt);  // (CPY, CPY_M, CPY_N, buffer)

  // This consumer's dQ staging buffers, and its slice of the (block_m x
  // head_dim) dQ tile as the dQ product's accumulator partition sees it.
  const int consumer = tidx / 128;
  // (MMA, MMA_M, MMA_N, buffer), as acc_dq
  Tensor tdQsdQ = [&] {
    if constexpr (Traits::kDqTransposed) {
      return thr_dq.partition_C(
          make_tensor(make_smem_ptr(smem.dq.begin()), typename Traits::SmemLayoutdQt{}));
    } else {
      Tensor sdQ = make_tensor(make_smem_ptr(smem.dq.begin()), typename Traits::SmemLayoutdQ{});
      return thr_dq.partition_C(group_modes<1, 3>(sdQ));
    }
  }();

  // dK and dV of this consumer's 64 keys, summed over every step.
  Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  clear(acc_dk);
  clear(acc_dv);

  // (key, query row) of each S^T accumulator element, as (rows, cols).
  Tensor cS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{}));
  Tensor cS_rc = make_tensor(cS.data(), acc_rowcol(cS.layout()));
  constexpr int kRows = decltype(size<0>(cS_rc))::value;  // keys this thread holds (2)
  constexpr int kCols = decltype(size<1>(cS_rc))::value;  // query rows it holds

  const int key0 = n_block * kBlockN;
  const Mask mask(params.mask, batch);
  // The per-element test, built before the loop: its barriers and fences
  // would make the compiler reload the bounds per step.
  const auto visible = mask.template element_test<int>();
  // Where a band's per-element mask is applied. In the exponent loop (P = -0
  // where hidden, which the dS^T loop then finds by its sign), dP^T's product
  // is in flight and S^T, dP^T, dK and dV hold 208 of the 240 registers; with
  // Traits::kTightRegisters (80 query rows) the mask's coordinates did not fit
  // beside them there (ptxas: a 48-byte spill). kLateMask: after the dS^T
  // loop instead, where no product is in flight and lse and delta are dead,
  // P^T and dS^T are set to 0 where hidden (no spill). Either way a hidden
  // score's P and dS are exact zeros whatever the score was (inf, NaN).
  constexpr bool kLateMask = Traits::kTightRegisters && !Mask::kDense && !Mask::kHasSegments;
  const int lane = tidx % 32;
  const bool warp_leader = lane == 0;
  // Named barrier (CUTLASS numbering, past its reserved ones): both
  // consumers' dS^T rows are in shared memory.
  constexpr uint32_t kDsBarrier = 1;
  // With kPdSShared: both consumers' P^T columns are in shared memory.
  constexpr uint32_t kPBarrier = 2;
  // Counters of deterministic mode: params.h gives each query block of >= 32
  // rows two.
  static_assert(Traits::kConsumerWarpgroups <= 2 && kBlockM >= kDqSemaphoreRows);

  // lse (log2 domain) and delta of a step's query rows go through shared
  // memory, buffer step % 2: consumer threads 0 .. block_m - 1 load lse,
  // block_m .. 2 block_m - 1 delta, one row each, a step ahead. The loads are
  // issued early in the step before (their latency hidden under its products)
  // and stored right before its dS barrier, which also orders them: every
  // read of that buffer two steps back came before the last dS barrier, and
  // every read of the new values comes after this one. Rows past the end and
  // rows that saw no key in the forward (lse = -inf) get lse = +inf, so that
  // P = 0 there.
  auto load_row_stat = [&](int step) {
    int head, m_block;
    steps.unit(step, head, m_block);
    const int row = m_block * kBlockM + tidx % kBlockM;
    const int64_t index = (int64_t{batch} * params.num_heads + head) * params.seqlen_q + row;
    if (row >= params.seqlen_q) return tidx < kBlockM ? INFINITY : 0.f;
    if (tidx >= kBlockM) return params.delta[index];
    const float lse = params.lse[index];
    return lse == -INFINITY ? INFINITY : lse * kLog2e;
  };
  auto store_row_stat = [&](int step, float value) {
    (tidx < kBlockM ? smem.lse_log2 : smem.delta)[step % 2][tidx % kBlockM] = value;
  };
  const bool loads_row_stat = tidx < 2 * kBlockM;
  if (steps.num_steps > 0) {
    if (loads_row_stat) store_row_stat(0, load_row_stat(0));
    cutlass::arch::NamedBarrier::sync(Traits::kConsumerThreads, kDsBarrier);
    FullBarrier::wait(&smem.kv_full, 0);
  }
  for (int step = 0; step < steps.num_steps; ++step) {
    int head, m_block;
    steps.unit(step, head, m_block);
    const int row0 = m_block * kBlockM;
    const RingSlot<kStages> slot(step);
    const int stage = slot.stage;
    const int buffer = step % 2;

    // S^T = K Q^T and dP^T = V dO^T   (block_n x block_m)
    consumer_wait(&smem.qdo_full[stage], slot.phase);
    Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
    Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
    wgmma_issue</*kZeroInit=*/true>(mma_sdp, tSrK, tSrQ(_, _, _, stage), acc_s);
    wgmma_issue<true>(mma_sdp, tdPrV, tdPrdO(_, _, _, stage), acc_dp);
    const bool next_row_stat = loads_row_stat && step + 1 < steps.num_steps;
    const float row_stat = next_row_stat ? load_row_stat(step + 1) : 0.f;
    // Segment ids, while the products run: each of this thread's keys' rows
    // (the band cut to the rows of the key's id: exactly the rows that see it
    // where those are contiguous, then the range test is all; keys past
    // seqlen_k: none), and from them whether the warp masks this tile (the
    // block summaries' tile class spilled at head dim 64). Where a key's rows
    // are not contiguous (rare), the ids are compared too, into bits (bit r *
    // kCols + c: the same id), the rows' ids read one after the other (each
    // load's address waits for the last one) to keep registers free (loaded
    // together, or compared after P, they spilled 290 to 380 bytes at head dim
    // 64; this spills 190).
    using IdBits = std::conditional_t<(kRows * kCols <= 32), uint32_t, uint64_t>;
    bool seg_needs_mask = false, seg_inexact = false;
    int seg_lo[kRows], seg_hi[kRows];
    IdBits seg_same = ~IdBits{0};
    if constexpr (Mask::kHasSegments) {
      bool seg_exact[kRows];
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const int key = key0 + get<0>(cS_rc(r, 0));
        const auto rows = key < params.seqlen_k ? mask.key_row_range(key, params.seqlen_q)
                                                : typename Mask::Range{{0, 0}, true};
        seg_lo[r] = static_cast<int>(rows.keys.begin);
        seg_hi[r] = static_cast<int>(rows.keys.end);
        seg_exact[r] = rows.exact;
        seg_inexact |= !rows.exact;
        seg_needs_mask |= !rows.exact || seg_lo[r] > row0 || seg_hi[r] < row0 + kBlockM;
      }
      seg_inexact = __any_sync(0xffffffff, seg_inexact);
      seg_needs_mask = __any_sync(0xffffffff, seg_needs_mask);
      if (seg_inexact) {
        int32_t key_id[kRows];
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
          const int key = key0 + get<0>(cS_rc(r, 0));
          key_id[r] = seg_exact[r] || key >= params.seqlen_k ? 0 : mask.key_segment(key);
        }
        int chain = 0;
        CUTE_UNROLL
        for (int c = 0; c < kCols; ++c) {
          int row = row0 + get<1>(cS_rc(0, c));
          asm volatile("" : "+r"(row) : "r"(chain));
          chain = row < params.seqlen_q ? mask.row_segment(row) : 0;
          CUTE_UNROLL
          for (int r = 0; r < kRows; ++r) {
            if (!seg_exact[r] && chain != key_id[r]) seg_same &= ~(IdBits{1} << (r * kCols + c));
          }
        }
      }
    }

    // P^T = exp2(S^T * scale_log2 - lse_log2); keys outside the band or past
    // the last key get P = 0, by a select that a NaN lse or score cannot turn
    // into NaN (with kLateMask after the dS^T loop, below). The last key here
    // is the last one that some row sees (key_limit): a band may let rows past
    // seqlen_q (zeros, lse = +inf) see keys that no row sees, and their scores
    // are NaN where k is. Masked P is -0, which exp2 never gives: the dS^T
    // loop below finds them by it.
    warpgroup_wait<1>();
    warpgroup_fence_operand(acc_s);
    Tensor s_rc = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));
    const bool needs_mask =
        Mask::kHasSegments
            ? seg_needs_mask
            : key0 + kBlockN > params.seqlen_k ||
                  mask.tile_class(row0, min(row0 + kBlockM, params.seqlen_q), key0,
                                  key0 + kBlockN) != TileClass::kFull;
    float lse_log2[kCols];  // of this thread's query rows (columns)
    load_column_stat<Traits::kTightRegisters>(lse_log2, smem.lse_log2[buffer], cS_rc, lane);
    const int key_limit =
        static_cast<int>(mask.band().keys_of_rows(0, params.seqlen_q, params.seqlen_k).end);
    // Softcap: P^T of the capped score t (recomputed from S^T here rather than
    // kept: registers are what this kernel lacks) goes to p_cap in Element for
    // the dV product at once, and acc_s keeps P^T (1 - t^2) for dS^T (-0
    // where masked, as P).
    constexpr bool kSoftcap = kScore == ScoreKind::kSoftcap;
    // The register-tight order converts acc_s to P^T after dS^T: it holds P^T
    // itself only without softcap (softcap calls run the band or segment masks,
    // whose tiles sm90_bwd_tile keeps at 64 rows for softcap).
    static_assert(!(kSoftcap && Traits::kTightRegisters));
    Tensor p_cap = make_tensor<Element>(acc_s.layout());
    Tensor p_cap_rc = make_tensor(p_cap.data(), acc_rowcol(acc_s.layout()));
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float p_pair[2];
      CUTE_UNROLL
      for (int c = 0; c < kCols; ++c) {
        const float score = kSoftcap ? fast_tanh(s_rc(r, c) * params.softcap_scale) : s_rc(r, c);
        float p = fast_exp2(fmaf(score, params.softmax_scale_log2, -lse_log2[c]));
        float ds_factor = kSoftcap ? p * (1.f - score * score) : p;
        if (!kLateMask && needs_mask) {
          const int key = key0 + get<0>(cS_rc(r, c));
          const int row = row0 + get<1>(cS_rc(r, c));
          const bool hidden = Mask::kHasSegments
                                  ? row < seg_lo[r] || row >= seg_hi[r] ||
                                        !((seg_same >> (r * kCols + c)) & 1)
                                  : key >= key_limit || !visible(row, key);
          if (hidden) p = ds_factor = -0.f;
        }
        s_rc(r, c) = ds_factor;
        if constexpr (kSoftcap) {
          // Columns 2j and 2j + 1 are neighbours in the fragment: one conversion.
          p_pair[c % 2] = p;
          if (c % 2 == 1) {
            const auto pair = convert_pair<Element>(p_pair[0], p_pair[1]);
            p_cap_rc(r, c - 1) = pair[0];
            p_cap_rc(r, c) = pair[1];
          }
        }
      }
    }
    // P^T in Element, the A operand of the dV product.
    auto p_elements = [&] {
      if constexpr (kSoftcap) {
        return p_cap;
      } else {
        return convert_fragment<Element>(acc_s);
      }
    };
    // dV += P^T dO   (block_n x head_dim), issued while dS^T is computed
    // (with Traits::kTightRegisters after dK's product instead, below).
    if constexpr (Traits::kPdSShared) {
      // This consumer's P^T columns into shared memory; once both are there,
      // the product over all of them for this consumer's head-dim columns.
      Tensor sPt = make_tensor(make_smem_ptr(smem.p.begin()), typename Traits::SmemLayoutdSt{});
      copy(smem_copy_ds, thr_copy_ds.retile_S(p_elements()),
           thr_copy_ds.partition_D(sPt)(_, _, _, buffer));
      cutlass::arch::fence_view_async_shared();
      cutlass::arch::NamedBarrier::sync(Traits::kConsumerThreads, kPBarrier);
      Tensor tdVsPt = thr_dkv.partition_fragment_A(sPt);  // (MMA, MMA_M, MMA_K, buffer)
      wgmma_issue<false>(mma_dkv, tdVsPt(_, _, _, buffer), tdVrdO(_, _, _, stage), acc_dv);
    } else if constexpr (!Traits::kTightRegisters) {
      Tensor tdVrP = make_tensor<Element>(acc_as_a_operand(acc_s.layout()));
      Tensor p = p_elements();
      Tensor dst = make_tensor(tdVrP.data(), acc_s.layout());
      CUTE_UNROLL
      for (int i = 0; i < size(p); ++i) dst(i) = p(i);
      warpgroup_fence_operand(tdVrP);
      wgmma_issue<false>(mma_dkv, tdVrP, tdVrdO(_, _, _, stage), acc_dv);
    }

    // dS^T = P^T * (dP^T - delta); 0 where P was masked (dP - delta may be
    // NaN there: a NaN in v, or a NaN row's delta).
    warpgroup_wait<Traits::kTightRegisters ? 0 : 1>();  // dP^T done; dV may still run
    warpgroup_fence_operand(acc_dp);
    Tensor dp_rc = make_tensor(acc_dp.data(), acc_rowcol(acc_dp.layout()));
    float delta[kCols];
    load_column_stat<Traits::kTightRegisters>(delta, smem.delta[buffer], cS_rc, lane);
    // P's sign bit (that of P (1 - t^2) with softcap) is set only where masked
    // (-0; exp2 gives +0 and positive NaNs): spread into a mask, it clears dS
    // there. Unmasked tiles have no -0, so the mask is all ones; the two
    // integer operations cost less than a second copy of the loop for masked
    // tiles (which made ptxas spill).
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTE_UNROLL
      for (int c = 0; c < kCols; ++c) {
        const uint32_t keep =
            ~static_cast<uint32_t>(static_cast<int32_t>(__float_as_uint(s_rc(r, c))) >> 31);
        dp_rc(r, c) =
            __uint_as_float(__float_as_uint(s_rc(r, c) * (dp_rc(r, c) - delta[c])) & keep);
      }
    }
    // kLateMask: the band's mask, on P^T (the dV product's operand, converted
    // below) and dS^T alike.
    if constexpr (kLateMask) {
      if (needs_mask) {
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
          CUTE_UNROLL
          for (int c = 0; c < kCols; ++c) {
            const int key = key0 + get<0>(cS_rc(r, c));
            const int row = row0 + get<1>(cS_rc(r, c));
            if (key >= key_limit || !visible(row, key)) s_rc(r, c) = dp_rc(r, c) = 0.f;
          }
        }
      }
    }
    Tensor ds = convert_fragment<Element>(acc_dp);
    // dS^T rows into shared memory for the dQ product, then dK += dS^T Q.
    copy(smem_copy_ds, thr_copy_ds.retile_S(ds), tdSsdS(_, _, _, buffer));
    if constexpr (!Traits::kPdSShared) {
      Tensor tdKrdS = make_tensor<Element>(acc_as_a_operand(acc_dp.layout()));
      Tensor dst = make_tensor(tdKrdS.data(), acc_dp.layout());
      CUTE_UNROLL
      for (int i = 0; i < size(ds); ++i) dst(i) = ds(i);
      warpgroup_fence_operand(tdKrdS);
      wgmma_issue<false>(mma_dkv, tdKrdS, tdKrQ(_, _, _, stage), acc_dk);
    }
    if constexpr (Traits::kTightRegisters) {
      // dV += P^T dO, P^T converted only now: its 16-bit copy (the product's
      // register operand) then never lives beside dP^T in float32.
      Tensor tdVrP = make_tensor<Element>(acc_as_a_operand(acc_s.layout()));
      Tensor p = convert_fragment<Element>(acc_s);
      Tensor dst = make_tensor(tdVrP.data(), acc_s.layout());
      CUTE_UNROLL
      for (int i = 0; i < size(p); ++i) dst(i) = p(i);
      warpgroup_fence_operand(tdVrP);
      wgmma_issue<false>(mma_dkv, tdVrP, tdVrdO(_, _, _, stage), acc_dv);
    }

    // dQ = dS K   (block_m x this consumer's head-dim columns; with
    // kDqTransposed its transpose, K^T dS^T), once both consumers' dS^T rows
    // are visible to the tensor cores (and, with kPdSShared, dK += dS^T Q for
    // its head-dim columns).
    if (next_row_stat) store_row_stat(step + 1, row_stat);
    cutlass::arch::fence_view_async_shared();
    cutlass::arch::NamedBarrier::sync(Traits::kConsumerThreads, kDsBarrier);
    if constexpr (Traits::kPdSShared) {
      Tensor tdKsdSt = thr_dkv.partition_fragment_A(sdSt);  // (MMA, MMA_M, MMA_K, buffer)
      wgmma_issue<false>(mma_dkv, tdKsdSt(_, _, _, buffer), tdKrQ(_, _, _, stage), acc_dk);
    }
    Tensor acc_dq = partition_fragment_C(mma_dq, typename Traits::dQAccShape{});
    if constexpr (Traits::kDqTransposed) {
      wgmma_issue<true>(mma_dq, tdQrK, tdQrdS(_, _, _, buffer), acc_dq);
    } else {
      wgmma_issue<true>(mma_dq, tdQrdS(_, _, _, buffer), tdQrK, acc_dq);
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_dv);
    warpgroup_fence_operand(acc_dk);
    warpgroup_fence_operand(acc_dq);
    // Q and dO of this stage are read; the other consumer may still read this
    // dS buffer, which is written again two steps later, past its next barrier.
    consumer_release(&smem.qdo_empty[stage], warp_leader);

    // dQ_accum += dS K (scaled in the convert kernel): registers -> this
    // consumer's staging buffer -> its writer's TMA reduce-add (write_dq),
    // which clips rows past seqlen_q. The buffer is free again once the
    // reduce of kDqBuffers steps ago has read it. 8-byte shared stores:
    // CuTe's element copy compiles to generic stores here (the swizzled
    // address hides the state space).
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

  // dK and dV of the key block, written once, or added to the other shares'.
  const auto dkv_coords =
      thr_dkv.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  if (params.head_splits > 1) {
    add_dk_dv(acc_dk, acc_dv, dkv_coords, key0, batch, kv_head, params);
  } else {
    store_dk_dv<Element>(acc_dk, acc_dv, dkv_coords, key0, batch, kv_head, params);
  }
}

// TMA reads the four input tiles: 16-byte aligned bases and strides, and
// non-empty sequences (seqlen_q == 0 still needs dK = dV = 0: the sm80
// backward writes them).
inline bool tma_compatible_bwd(const BwdParams& p) {
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  auto stride_ok = [](int64_t stride) { return (stride * 2) % 16 == 0; };
  return tma_compatible(p) && aligned(p.dout) && stride_ok(p.dout_row_stride) &&
         stride_ok(p.dout_head_stride) && stride_ok(p.dout_batch_stride);
}

template <typename Element, int kHeadDim, typename Mask, ScoreKind kScore = ScoreKind::kPlain>
cudaError_t run_flash_bwd_sm90(const BwdParams& call_params, const LaunchContext& ctx) {
  using Traits = BwdTraitsSm90<Element, kHeadDim, Mask::kKind, kScore>;
  using Scheduler = BwdSchedulerSm90<Traits::kBlockM, Traits::kBlockN, Mask>;
  BwdParams params = call_params;
  params.head_splits = Scheduler::head_splits(params, ctx.sm_count, ctx.bwd_head_splits);
  const int64_t num_ctas = Scheduler::grid_size(params);
  if (num_ctas < 0) return cudaErrorInvalidConfiguration;
  if (cudaError_t err = launch_bwd_preprocess<Element, kHeadDim>(params, ctx); err != cudaSuccess) {
    return err;
  }
  auto tma = [](const void* ptr, auto shape, int64_t row, int64_t head, int64_t batch,
                auto smem_layout, auto tile) {
    return make_tma_atom(
        SM90_TMA_LOAD{},
        make_tensor(make_gmem_ptr(static_cast<Element const*>(ptr)), shape,
                    make_stride(row, _1{}, head, batch)),
        smem_layout, tile);
  };
  const auto q_tile = Shape<Int<Traits::kBlockM>, Int<kHeadDim>>{};
  const auto k_tile = Shape<Int<Traits::kBlockN>, Int<kHeadDim>>{};
  const auto q_layout = take<0, 2>(typename Traits::SmemLayoutQ{});
  const auto k_layout = typename Traits::SmemLayoutK{};
  const BwdArgsSm90<Traits> args{
      params,
      tma(params.q, Traits::shape_q(params), params.q_row_stride, params.q_head_stride,
          params.q_batch_stride, q_layout, q_tile),
      tma(params.dout, Traits::shape_q(params), params.dout_row_stride, params.dout_head_stride,
          params.dout_batch_stride, q_layout, q_tile),
      tma(params.k, Traits::shape_k(params), params.k_row_stride, params.k_head_stride,
          params.k_batch_stride, k_layout, k_tile),
      tma(params.v, Traits::shape_k(params), params.v_row_stride, params.v_head_stride,
          params.v_batch_stride, k_layout, k_tile),
      // dq_accum is [batch, heads, seqlen_q, head_dim], dense.
      make_tma_atom(SM90_TMA_REDUCE_ADD{},
                    make_tensor(make_gmem_ptr(params.dq_accum), Traits::shape_q(params),
                                make_stride(int64_t{kHeadDim}, _1{},
                                            int64_t{params.seqlen_q} * kHeadDim,
                                            int64_t{params.num_heads} * params.seqlen_q * kHeadDim)),
                    take<0, 2>(typename Traits::SmemLayoutdQ{}),
                    Shape<Int<Traits::kBlockM>, Int<Traits::kDqCols>>{}),
  };
  auto kernel = &flash_bwd_sm90_kernel<Traits, Mask, kScore>;
  constexpr int kSmemBytes = Traits::kSmemBytes;
  if (cudaError_t err =
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
      err != cudaSuccess) {
    return err;
  }
  kernel<<<static_cast<unsigned>(num_ctas), Traits::kNThreads, kSmemBytes, ctx.stream>>>(args);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  return launch_bwd_postprocess<Element>(params, ctx);
}

}  // namespace jflash::cuda::sm90

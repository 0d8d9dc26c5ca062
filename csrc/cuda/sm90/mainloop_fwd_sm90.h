// The Hopper forward's main loop: the producer's TMA loads of Q and the K/V
// rings, and the consumers' products and online softmax over the key tiles of
// one tile of query rows (the kernel's header comment describes both).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "cuda/sm90/mask_sm90.h"
#include "cuda/sm90/named_barriers_sm90.h"
#include "cuda/sm90/pipeline_sm90.h"
#include "cuda/sm90/softmax_sm90.h"
#include "cuda/sm90/tile_scheduler_sm90.h"
#include "cuda/sm90/traits_fwd_sm90.h"
#include "cuda/sm90/wgmma_utils.h"
#include "cuda/utils.h"

namespace jflash::cuda::sm90 {

using namespace cute;

// ---------------------------------------------------------------- producer
// One thread of the producer warpgroup issues every TMA copy: each tile's Q
// (once its buffer is free again), then its K and V tiles into the rings.
template <typename Traits, typename Mask>
struct FwdProducerSm90 {
  using SharedStorage = typename Traits::SharedStorage;
  using Scheduler = TileSchedulerSm90<Traits::kBlockM, Traits::kBlockN, Mask>;
  using Tile = typename Scheduler::Tile;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  using KSlot = RingSlot<Traits::kKStages>;
  using VSlot = RingSlot<Traits::kVStages>;
  using QSlot = RingSlot<1>;

  const FwdArgsSm90<Traits>& args;
  SharedStorage& smem;
  const Scheduler& scheduler;

  // Before any use, by one thread.
  __device__ __forceinline__ static void init_barriers(SharedStorage& smem) {
    constexpr uint32_t kConsumerWarps = Traits::kConsumerThreads / 32;
    init_buffer_barriers(&smem.q_full, &smem.q_empty, kConsumerWarps);
    CUTE_UNROLL
    for (int s = 0; s < Traits::kKStages; ++s) {
      init_buffer_barriers(&smem.k_full[s], &smem.k_empty[s], kConsumerWarps);
    }
    CUTE_UNROLL
    for (int s = 0; s < Traits::kVStages; ++s) {
      init_buffer_barriers(&smem.v_full[s], &smem.v_empty[s], kConsumerWarps);
    }
    if constexpr (Scheduler::kDynamic) smem.units.init(Traits::kConsumerThreads);
    cutlass::arch::fence_barrier_init();
  }

  // (TMA) for Q; (TMA, n_block) and (TMA, stage) for K and V.
  __device__ __forceinline__ auto partition(const Tile& tile) const {
    const FwdParams& params = args.params;
    Tensor sQ = make_tensor(make_smem_ptr(smem.q.begin()), typename Traits::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(smem.k.begin()), typename Traits::SmemLayoutK{});
    Tensor sVt = make_tensor(make_smem_ptr(smem.v.begin()), typename Traits::SmemLayoutVt{});
    Tensor mQ = args.tma_q.get_tma_tensor(Traits::shape_q(params));
    Tensor mK = args.tma_k.get_tma_tensor(Traits::shape_k(params));
    Tensor mVt = args.tma_v.get_tma_tensor(Traits::shape_vt(params));
    const int kv_head = tile.head / params.heads_per_kv;
    Tensor gQ = local_tile(mQ(_, _, tile.head, tile.batch), Shape<Int<kBlockM>, Int<kHeadDim>>{},
                           make_coord(tile.m_block, 0));
    Tensor gK = local_tile(mK(_, _, kv_head, tile.batch), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                           make_coord(_, 0));
    Tensor gVt = local_tile(mVt(_, _, kv_head, tile.batch), Shape<Int<kHeadDim>, Int<kBlockN>>{},
                            make_coord(0, _));
    return make_tuple(tma_partition(args.tma_q, Int<0>{}, Layout<_1>{},
                                    group_modes<0, 2>(sQ), group_modes<0, 2>(gQ)),
                      tma_partition(args.tma_k, Int<0>{}, Layout<_1>{},
                                    group_modes<0, 2>(sK), group_modes<0, 2>(gK)),
                      tma_partition(args.tma_v, Int<0>{}, Layout<_1>{},
                                    group_modes<0, 2>(sVt), group_modes<0, 2>(gVt)));
  }

  // An L2 prefetch of the next unit's Q and first K/V tiles, issued
  // kPrefetchTiles tiles before this unit ends. Their real loads start only
  // when the Q buffer and ring slots free up, right before the consumers need
  // them, and Q (read once per unit) and a new head's K/V come from HBM.
  // Only units of more than kPrefetchMinTiles tiles issue it (H200, bf16,
  // docs/cuda_kernels.md, Hopper forward: loads and epilogue): head dim 256 at seq 16k gained 5%, while at seq
  // 512-1024 the producer's extra work per short unit cost up to 6-8%.
  static constexpr int kPrefetchTiles = 4;
  static constexpr int kPrefetchMinTiles = 16;
  __device__ __forceinline__ void prefetch_tile(const Tile& tile) const {
    auto [q, k, v] = partition(tile);
    cute::prefetch(args.tma_q, get<0>(q));
    for (int i = 0; i < min(Traits::kKStages, tile.n_tiles); ++i) {
      cute::prefetch(args.tma_k, get<0>(k)(_, tile.n_block_begin + i));
    }
    for (int i = 0; i < min(Traits::kVStages, tile.n_tiles); ++i) {
      cute::prefetch(args.tma_v, get<0>(v)(_, tile.n_block_begin + i));
    }
  }
  // The static schedule's next tile after slot t.
  __device__ __forceinline__ void prefetch_next(int t) const {
    const int t_next = scheduler.next_work(t);
    if (t_next >= scheduler.num_slots()) return;
    prefetch_tile(scheduler.tile_at(t_next));
  }

  // What load_tile prefetches (functors, not lambdas: a lambda the compiler
  // does not inline puts its captures in local memory). The static schedule:
  // the tile of the next slot with work.
  struct PrefetchNextSlot {
    const FwdProducerSm90& producer;
    int t;
    __device__ __forceinline__ void operator()() const { producer.prefetch_next(t); }
  };
  // The dynamic schedule: the unit's other tile, else the next unit's first.
  struct PrefetchNextUnit {
    const FwdProducerSm90& producer;
    int unit, half, next;
    __device__ __forceinline__ void operator()() const {
      constexpr int kPer = Scheduler::kTilesPerUnit;
      const Scheduler& scheduler = producer.scheduler;
      if (half + 1 < kPer) {
        const Tile after = scheduler.tile_at(unit * kPer + half + 1);
        if (after.valid && after.n_tiles > 0) {
          producer.prefetch_tile(after);
          return;
        }
      }
      if (next < scheduler.num_units()) {
        const Tile first = scheduler.tile_at(next * kPer);
        if (first.n_tiles > 0) producer.prefetch_tile(first);
      }
    }
  };

  // One tile (with work): its Q, then its K and V tiles into the rings;
  // prefetch() runs kPrefetchTiles tiles before the end of a long one.
  template <typename Prefetch>
  __device__ __forceinline__ void load_tile(const Tile& tile, int& q_iter, int& kv_iter,
                                            const Prefetch& prefetch) const {
    auto [q, k, v] = partition(tile);
    auto [tQgQ, tQsQ] = q;
    auto [tKgK, tKsK] = k;
    auto [tVgV, tVsV] = v;

    producer_acquire(&smem.q_empty, &smem.q_full, QSlot(q_iter).phase, Traits::kQBytes);
    copy(args.tma_q.with(smem.q_full), tQgQ, tQsQ);
    ++q_iter;
    const int prefetch_at =
        tile.n_tiles > kPrefetchMinTiles ? tile.n_tiles - kPrefetchTiles : -1;
    for (int i = 0; i < tile.n_tiles; ++i, ++kv_iter) {
      if (i == prefetch_at) prefetch();
      const KSlot ks(kv_iter);
      const VSlot vs(kv_iter);
      const int n_block = tile.n_block_begin + i;
      producer_acquire(&smem.k_empty[ks.stage], &smem.k_full[ks.stage], ks.phase, Traits::kKVBytes);
      copy(args.tma_k.with(smem.k_full[ks.stage]), tKgK(_, n_block), tKsK(_, ks.stage));
      producer_acquire(&smem.v_empty[vs.stage], &smem.v_full[vs.stage], vs.phase, Traits::kKVBytes);
      copy(args.tma_v.with(smem.v_full[vs.stage]), tVgV(_, n_block), tVsV(_, vs.stage));
    }
  }

  // Every tile of this CTA. The next tile's Q and first K/V tiles load while
  // the consumers finish this one.
  __device__ __forceinline__ void run() const {
    int kv_iter = 0;  // K/V tiles loaded so far: position in the ring
    int q_iter = 0;   // Q tiles loaded so far
    if constexpr (Scheduler::kDynamic) {
      // Each unit goes to the consumers (smem.units) before its loads; the
      // number of units ends them. The next unit is taken from the counter
      // as this one starts, its latency under this unit's loads.
      constexpr int kPer = Scheduler::kTilesPerUnit;
      const int num_units = scheduler.num_units();
      int unit = blockIdx.x;
      for (int i = 0;; ++i) {
        smem.units.push(i, unit);
        if (unit >= num_units) break;
        const int next = min(int(gridDim.x) + atomicAdd(args.params.tile_counter, 1), num_units);
        for (int half = 0; half < kPer; ++half) {
          const Tile tile = scheduler.tile_at(unit * kPer + half);
          if (!tile.valid || tile.n_tiles == 0) continue;
          load_tile(tile, q_iter, kv_iter, PrefetchNextUnit{*this, unit, half, next});
        }
        unit = next;
      }
    } else {
      for (int t = scheduler.first_slot(); t < scheduler.num_slots(); t = scheduler.next_slot(t)) {
        const Tile tile = scheduler.tile_at(t);
        if (!tile.valid || tile.n_tiles == 0) continue;
        load_tile(tile, q_iter, kv_iter, PrefetchNextSlot{*this, t});
      }
    }
  }
};

// ---------------------------------------------------------------- consumers
// One consumer warpgroup's 64 query rows of a tile: per key tile S = Q K^T,
// the online softmax of S (of tanh(softcap_scale * S) with softcap: kScore,
// jflash/score.h), and O = O * correction + P V.
template <typename Traits, typename Mask, ScoreKind kScore>
struct FwdMainloopSm90 {
  using Element = typename Traits::Element;
  using SharedStorage = typename Traits::SharedStorage;
  using Tile = typename TileSchedulerSm90<Traits::kBlockM, Traits::kBlockN, Mask>::Tile;
  using Barriers = FwdNamedBarriersSm90<Traits::kConsumerWarpgroups, Traits::kPingPong>;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  using KSlot = RingSlot<Traits::kKStages>;
  using VSlot = RingSlot<Traits::kVStages>;
  using QSlot = RingSlot<1>;

  using TiledMmaQK = typename Traits::TiledMmaQK;
  using TiledMmaPV = typename Traits::TiledMmaPV;
  using ThrMmaQK = decltype(TiledMmaQK{}.get_thread_slice(0));
  using ThrMmaPV = decltype(TiledMmaPV{}.get_thread_slice(0));
  template <typename Layout>
  using SmemTensor = decltype(make_tensor(make_smem_ptr(static_cast<Element*>(nullptr)), Layout{}));
  using SmemQ = SmemTensor<typename Traits::SmemLayoutQ>;
  // kQInRegisters: the ldmatrix copy of this thread's Q fragment.
  using SmemCopyQ = decltype(make_tiled_copy_A(Copy_Atom<SM75_U32x4_LDSM_N, Element>{}, TiledMmaQK{}));
  using ThrCopyQ = decltype(SmemCopyQ{}.get_thread_slice(0));
  using AccS = decltype(partition_fragment_C(TiledMmaQK{}, Shape<Int<kBlockM>, Int<kBlockN>>{}));
  using SRowColLayout = decltype(acc_rowcol(typename AccS::layout_type{}));
  static constexpr int kRows = decltype(size<0>(SRowColLayout{}))::value;  // query rows this thread holds (2)
  static constexpr int kCols = decltype(size<1>(SRowColLayout{}))::value;  // columns per row and thread
  using Softmax = SoftmaxSm90<kRows, kCols>;
  using ScoreMask = ScoreMaskSm90<kBlockN, kRows, kCols, Mask>;

  // Ping-pong: consumer c may issue products once barrier (Barriers::kTurn +
  // c) completes, and hands the turn to the other consumer after issuing. Each
  // consumer issues n_tiles + 1 times per tile; the first turn of each tile
  // goes to consumer 0, and consumer 1 skips its last hand-over of the tile, so
  // that every tile leaves both barriers as it found them.
  static constexpr uint32_t kPairThreads = 256;
  // Where a warp's verdict on its stale-max softmax is settled: at the next
  // turn (unmasked ping-pong kernels), or by a vote of the warpgroup right
  // after the exponentials. Measured in cycles per launch (ncu, H200, head
  // dim 128; docs/cuda_kernels.md, Hopper forward: softmax): unmasked, the turn took 0.7% (4k) and
  // 1.5% (16k) fewer than the vote; causal 4k, 3% more.
  static constexpr bool kSettleAtTurn = Traits::kStaleMax && Traits::kPingPong && Mask::kDense;

  const FwdParams& params;
  SharedStorage& smem;
  const int consumer;  // which 64 rows of the tile
  TiledMmaQK mma_qk;
  TiledMmaPV mma_pv;
  ThrMmaQK thr_qk;
  ThrMmaPV thr_pv;
  decltype(std::declval<ThrMmaQK&>().partition_fragment_A(SmemQ{})) tSrQ;  // smem descriptors, or registers
  // (MMA, MMA_N, MMA_K, stage)
  decltype(std::declval<ThrMmaQK&>().partition_fragment_B(
      SmemTensor<typename Traits::SmemLayoutK>{})) tSrK;
  decltype(std::declval<ThrMmaPV&>().partition_fragment_B(
      SmemTensor<typename Traits::SmemLayoutVt>{})) tOrV;
  SmemCopyQ smem_copy_q;
  ThrCopyQ smem_thr_copy_q;
  decltype(std::declval<ThrCopyQ&>().partition_S(SmemQ{})) tQsQ;
  AccS acc_s;
  // P = softmax numerators in the A-operand layout of the P V product.
  decltype(make_tensor<Element>(acc_as_a_operand(typename AccS::layout_type{}))) tOrP;
  // The (row, col) coordinates of this thread's scores in the tile.
  decltype(std::declval<ThrMmaQK&>().partition_C(
      make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}))) cS;
  const bool warp_leader;
  ScoreMask mask;
  // kStaleMax with ping-pong: each warp's verdict on its softmax of a key
  // tile (redo: terms past raise_max's range, S must be computed again),
  // published in shared memory and read by the whole warpgroup after the
  // next turn's barrier. The accesses are asm volatile so that the compiler
  // keeps them on their side of that barrier (also asm volatile, without a
  // memory clobber).
  const int lane;
  const int warp_in_group;
  bool redo = false;  // this warp's verdict on the last key tile
  int kv_iter = 0;    // K/V tiles consumed so far: position in the ring
  int q_iter = 0;     // Q tiles consumed so far

  // tidx: 0 .. kConsumerThreads - 1, in warpgroup `consumer_`.
  __device__ __forceinline__ FwdMainloopSm90(const FwdParams& params_, SharedStorage& smem_, int tidx,
                                             int consumer_)
      : params(params_),
        smem(smem_),
        consumer(consumer_),
        thr_qk(mma_qk.get_thread_slice(tidx)),
        thr_pv(mma_pv.get_thread_slice(tidx)),
        tSrQ(thr_qk.partition_fragment_A(smem_q())),
        tSrK(thr_qk.partition_fragment_B(make_tensor(make_smem_ptr(smem_.k.begin()),
                                                     typename Traits::SmemLayoutK{}))),
        tOrV(thr_pv.partition_fragment_B(make_tensor(make_smem_ptr(smem_.v.begin()),
                                                     typename Traits::SmemLayoutVt{}))),
        smem_copy_q(make_tiled_copy_A(Copy_Atom<SM75_U32x4_LDSM_N, Element>{}, mma_qk)),
        smem_thr_copy_q(smem_copy_q.get_thread_slice(tidx)),
        tQsQ(smem_thr_copy_q.partition_S(smem_q())),
        acc_s(partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{})),
        tOrP(make_tensor<Element>(acc_as_a_operand(acc_s.layout()))),
        cS(thr_qk.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}))),
        warp_leader(tidx % 32 == 0),
        mask(params_),
        lane(tidx % 32),
        warp_in_group(tidx % 128 / 32) {}

  __device__ __forceinline__ SmemQ smem_q() const {
    return make_tensor(make_smem_ptr(smem.q.begin()), typename Traits::SmemLayoutQ{});
  }
  // acc_s and cS viewed as (rows, cols).
  __device__ __forceinline__ auto s_rc() { return make_tensor(acc_s.data(), acc_rowcol(acc_s.layout())); }
  __device__ __forceinline__ auto cS_rc() const { return make_tensor(cS.data(), acc_rowcol(cS.layout())); }

  __device__ __forceinline__ void release(uint64_t* barrier) const { consumer_release(barrier, warp_leader); }
  // Once a Q K^T's scores are final: its K buffer, and after the tile's last
  // Q K^T also Q where the products read it from shared memory.
  __device__ __forceinline__ void release_qk_operands(int k_stage, bool last_q_k) const {
    release(&smem.k_empty[k_stage]);
    if (!Traits::kQInRegisters && last_q_k) release(&smem.q_empty);
  }

  __device__ __forceinline__ void begin_issue() const {
    if constexpr (Traits::kPingPong) Barriers::sync(kPairThreads, Barriers::kTurn + consumer);
  }
  __device__ __forceinline__ void end_issue(bool last) const {
    if constexpr (Traits::kPingPong) {
      if (!(last && consumer == 1)) Barriers::arrive(kPairThreads, Barriers::kTurn + 1 - consumer);
    }
  }

  // Readies a freshly computed S for the softmax: capped (softcap), then
  // masked; returns whether the mask touched it. Every S (the redo's too)
  // passes here once.
  __device__ __forceinline__ bool mask_scores(int n_block) {
    if constexpr (kScore == ScoreKind::kSoftcap) {
      CUTE_UNROLL
      for (int i = 0; i < size(acc_s); ++i) acc_s(i) = fast_tanh(acc_s(i) * params.softcap_scale);
    }
    auto s = s_rc();
    return mask.mask_scores(n_block, s, cS_rc());
  }
  __device__ __forceinline__ void softmax_step(Softmax& softmax, int n_block, float (&correction)[kRows]) {
    auto s = s_rc();
    softmax.fold_max(s, mask_scores(n_block), correction);
  }

  // S again from the K tile in ring buffer `stage` (see mma). The operands'
  // shared-memory descriptors are rebuilt here from an address the compiler
  // cannot see through: otherwise it keeps those of the step's first Q K^T
  // alive across the softmax for this rare path (at head dim 256, 32
  // registers, and the kernel spilled).
  __device__ __forceinline__ void recompute_s(int stage) {
    SharedStorage* base = &smem;
    asm volatile("" : "+l"(base));
    Tensor sQ_ = make_tensor(make_smem_ptr(base->q.begin()), typename Traits::SmemLayoutQ{});
    Tensor sK_ = make_tensor(make_smem_ptr(base->k.begin()), typename Traits::SmemLayoutK{});
    Tensor tSrK_ = thr_qk.partition_fragment_B(sK_);
    if constexpr (Traits::kQInRegisters) {
      wgmma_issue<true>(mma_qk, tSrQ, tSrK_(_, _, _, stage), acc_s);
    } else {
      wgmma_issue<true>(mma_qk, thr_qk.partition_fragment_A(sQ_), tSrK_(_, _, _, stage), acc_s);
    }
  }

  __device__ __forceinline__ void publish_redo(int step) const {
    if (lane == 0) {
      asm volatile("st.shared.u8 [%0], %1;" ::"r"(cast_smem_ptr_to_uint(
                       &smem.redo[step & 1][consumer][warp_in_group])),
                   "r"(static_cast<uint32_t>(redo)));
    }
  }
  __device__ __forceinline__ bool any_redo(int step) const {
    uint32_t verdicts;
    asm volatile("ld.shared.u32 %0, [%1];"
                 : "=r"(verdicts)
                 : "r"(cast_smem_ptr_to_uint(&smem.redo[step & 1][consumer][0])));
    return verdicts != 0;
  }
  // Settles key tile j (>= 1) of the current unit right after this
  // consumer's next turn began: where some warp's terms were past
  // raise_max's range (Softmax::raisable), the warpgroup computes S_j again
  // and those warps fold it with fresh maxima, rescale O (which holds the
  // products up to P_{j-1} V_{j-1}) and convert P_j again. Then K_j (and
  // after the unit's last Q K^T, Q) leaves shared memory.
  template <typename OutRowCol>
  __device__ __forceinline__ void settle(Softmax& softmax, OutRowCol& o_rc, int j, int n_block,
                                         int k_stage, bool last_q_k) {
    if (any_redo(j)) {
      recompute_s(k_stage);
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_s);
      if (redo) {
        float correction[kRows];
        softmax_step(softmax, n_block, correction);
        Softmax::rescale_o(o_rc, correction);
        Softmax::convert_p(acc_s, tOrP);
      }
    }
    release_qk_operands(k_stage, last_q_k);
  }

  // A tile's start (one with key tiles): consumer 1's first hand-over of the
  // turn, and Q, into registers where the products read it there.
  __device__ __forceinline__ void begin_tile() {
    if constexpr (Traits::kPingPong) {
      if (consumer == 1) Barriers::arrive(kPairThreads, Barriers::kTurn);
    }
    consumer_wait(&smem.q_full, QSlot(q_iter).phase);
    if constexpr (Traits::kQInRegisters) {
      // The previous tile's Q K^T products are complete (warpgroup_wait<0>
      // of its last step), so its Q registers may be overwritten.
      warpgroup_fence_operand(tSrQ);
      copy(smem_copy_q, tQsQ, smem_thr_copy_q.retile_D(tSrQ));
      warpgroup_fence_operand(tSrQ);
      release(&smem.q_empty);
    }
  }
  // A tile's first product, S_0 = Q K_0^T, waited for; K_0 (and where it is
  // the tile's only key tile, Q) released.
  __device__ __forceinline__ void first_qk(int n_tiles) {
    const KSlot slot(kv_iter);
    begin_issue();
    consumer_wait(&smem.k_full[slot.stage], slot.phase);
    wgmma_issue</*kZeroInit=*/true>(mma_qk, tSrQ, tSrK(_, _, _, slot.stage), acc_s);
    end_issue(false);
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_s);
    release_qk_operands(slot.stage, n_tiles == 1);
  }

  // The key tiles of one tile of query rows, into acc_o (the P V products'
  // accumulator) and softmax, both reset here.
  template <typename AccO>
  __device__ __forceinline__ void mma(const Tile& tile, AccO& acc_o, Softmax& softmax) {
    Tensor o_rc = make_tensor(acc_o.data(), acc_rowcol(acc_o.layout()));
    const int n_tiles = tile.n_tiles;
    const int n_block_begin = tile.n_block_begin;
    mask.set_rows(tile.row_begin, tile.batch, cS_rc());
    softmax.reset();
    clear(acc_o);
    if (n_tiles <= 0) return;
    begin_tile();

    // Step 0: S_0 only.
    {
      first_qk(n_tiles);
      float correction[kRows];
      softmax_step(softmax, n_block_begin, correction);
      Softmax::convert_p(acc_s, tOrP);
    }
    for (int i = 1; i < n_tiles; ++i) {
      const KSlot slot(kv_iter + i);
      const VSlot prev(kv_iter + i - 1);
      begin_issue();
      if constexpr (kSettleAtTurn) {
        if (i >= 2) {
          settle(softmax, o_rc, i - 1, n_block_begin + i - 1, KSlot(kv_iter + i - 1).stage, false);
        }
      }
      consumer_wait(&smem.k_full[slot.stage], slot.phase);
      wgmma_issue<true>(mma_qk, tSrQ, tSrK(_, _, _, slot.stage), acc_s);
      consumer_wait(&smem.v_full[prev.stage], prev.phase);
      warpgroup_fence_operand(tOrP);
      wgmma_issue<false>(mma_pv, tOrP, tOrV(_, _, _, prev.stage), acc_o);
      end_issue(false);
      warpgroup_wait<1>();  // S_i done; P_{i-1} V_{i-1} may still run
      warpgroup_fence_operand(acc_s);
      const int n_block = n_block_begin + i;
      float correction[kRows];
      if constexpr (!Traits::kStaleMax) {
        release_qk_operands(slot.stage, i == n_tiles - 1);
        softmax_step(softmax, n_block, correction);
        softmax.pin_below();
        warpgroup_wait<0>();
      } else {
        // The softmax first exponentiates S_i against the running max
        // (exp_stale), where every row of the warp has one. Where a row's
        // max rose too far, the warp raises it from those exponentials
        // (raise_max). Only where the terms are past its range (a max that
        // rose by more than 64 in log2 units, or a NaN) is S_i computed
        // again (exp_stale overwrote it) and folded with fresh maxima; as
        // wgmma is warpgroup-wide, so is that product, and K_i (and Q) stay
        // in shared memory until the tile is settled.
        const bool needs_mask = mask_scores(n_block);
        const bool stale = softmax.has_finite_max();
        float tile_sum[kRows];
        auto s = s_rc();
        const bool over = stale && !softmax.exp_stale(s, needs_mask, tile_sum);
        // Warp-uniform: some row's bound failed; some row is past raise_max's range.
        const bool raise = __any_sync(0xffffffff, over);
        const bool past_range = __any_sync(0xffffffff, over && !Softmax::raisable(tile_sum));
        if constexpr (kSettleAtTurn) {
          // A tile past the range is settled at the next turn (settle): the
          // warps publish their verdict through shared memory, and the
          // turn's barrier, which they pass anyway, makes it visible to all.
          // A raise is the warp's own, after the wait (outside the turn).
          redo = past_range;
          if (stale) {
            softmax.keep_max(tile_sum, /*add=*/!raise, correction);
          } else {
            softmax.fold_max(s, needs_mask, correction);  // rows with no visible key yet
          }
          publish_redo(i);
          softmax.pin_below();
          warpgroup_wait<0>();
          if (raise && !redo) softmax.raise_max(s, correction);
        } else {
          // No turns to piggyback on: a vote of the warpgroup's threads.
          const bool recompute = Barriers::vote_any(past_range, consumer);
          // Both paths leave no product in flight (C7515, docs/cuda_kernels.md, Compiler pitfalls).
          warpgroup_wait<0>();
          if (recompute) {
            recompute_s(slot.stage);
            warpgroup_wait<0>();
            warpgroup_fence_operand(acc_s);
            mask_scores(n_block);
          }
          if (recompute || !stale) {
            softmax.fold_max(s, needs_mask, correction);  // also rows with no visible key yet
          } else if (raise) {
            softmax.raise_max(s, correction);
          } else {
            softmax.keep_max(tile_sum, /*add=*/true, correction);
          }
          release_qk_operands(slot.stage, i == n_tiles - 1);
        }
      }
      warpgroup_fence_operand(acc_o);
      warpgroup_fence_operand(tOrP);
      release(&smem.v_empty[prev.stage]);
      Softmax::rescale_o(o_rc, correction);
      Softmax::convert_p(acc_s, tOrP);
    }
    // Last step: P_{n-1} V_{n-1}.
    {
      const VSlot prev(kv_iter + n_tiles - 1);
      begin_issue();
      if constexpr (kSettleAtTurn) {
        if (n_tiles >= 2) {
          settle(softmax, o_rc, n_tiles - 1, n_block_begin + n_tiles - 1,
                 KSlot(kv_iter + n_tiles - 1).stage, true);
        }
      }
      consumer_wait(&smem.v_full[prev.stage], prev.phase);
      warpgroup_fence_operand(tOrP);
      wgmma_issue<false>(mma_pv, tOrP, tOrV(_, _, _, prev.stage), acc_o);
      end_issue(true);
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_o);
      release(&smem.v_empty[prev.stage]);
    }
    kv_iter += n_tiles;
    ++q_iter;
  }
};

}  // namespace jflash::cuda::sm90

// Hopper forward (sm90a): out, lse <- softmax(scale * Q K^T) V with TMA loads,
// wgmma products and warp specialization. Persistent: one CTA per SM walks a
// static sequence of work units (one query block of a head, or under a band a
// pair of them; the comment above kTilesPerUnit says why).
//
// Roles (warpgroups of 128 threads):
//   warpgroup 0, the producer: one thread issues TMA copies: each tile's Q
//     (once its buffer is free again: the q_empty mbarrier), then K and V
//     tiles into two rings of shared-memory buffers (kKStages, kVStages)
//     that run on across tiles, each buffer guarded by a "full" mbarrier (TMA
//     bytes landed) and an "empty" mbarrier (every consumer warp is done
//     reading it). It gives
//     most of its registers away (setmaxnreg), and loads the next tile while
//     the consumers finish the current one; in long units it also prefetches
//     the next unit's first tiles into L2.
//   warpgroups 1.., the consumers: 64 query rows each; per key tile
//       S = Q K^T                 (wgmma, K from shared memory, Q too or, where
//                                  the tile table says so, from registers)
//       online softmax of S       (registers; exp2 with the scale folded in;
//                                  where the tile table says stale_max,
//                                  against the running max first)
//       O = O * correction + P V  (wgmma, P from registers, V from shared memory)
//     and at the end of a tile O / rowsum goes through shared memory to a
//     TMA store (head dims 64, 128) while the next tile starts.
//
// Two overlaps keep the tensor cores busy while the (slower) exp unit works:
//   intra-warpgroup: step j issues S_j = Q K_j^T and O += P_{j-1} V_{j-1}
//     together, then runs softmax(S_j) while the P V product is still running;
//   ping-pong (kPingPong, two consumer warpgroups): a pair of named barriers
//     lets the consumers issue their products in turn, so one warpgroup's
//     softmax runs under the other's products. With three consumers (head dim
//     64) the warp schedulers interleave them without it.
//
// Masking follows the same policy as the sm80 kernels (jflash/mask.h): the band
// decides the key-tile range, and only tiles it cuts (or the sequence end) are
// masked per element. Rows and keys past the sequence ends arrive as zeros
// from TMA's out-of-bounds fill; their scores are masked and their rows never
// stored.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <numeric>

#include <cute/arch/cluster_sm90.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_types.h>

#include "cuda/launch.h"
#include "cuda/sm90/wgmma_utils.h"
#include "cuda/tile_sizes.h"
#include "cuda/utils.h"
#include "jflash/params.h"

namespace jflash::cuda::sm90 {

using namespace cute;

// kShortBand: the tile of sm90_fwd_tile_short_band (banded calls on short rows).
template <typename Element_, int kHeadDim_, bool kPingPong_ = true, bool kShortBand = false>
struct FwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr Sm90FwdTile kTile =
      kShortBand ? sm90_fwd_tile_short_band(kHeadDim) : sm90_fwd_tile(kHeadDim);
  static_assert(kTile.block_m > 0, "no sm90 forward tile for this head dim");
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kKStages = kTile.k_stages;
  static constexpr int kVStages = kTile.v_stages;
  static constexpr int kConsumerWarpgroups = kBlockM / 64;
  static constexpr int kConsumerThreads = 128 * kConsumerWarpgroups;
  static constexpr int kNThreads = 128 + kConsumerThreads;
  static constexpr bool kPingPong = kPingPong_ && kConsumerWarpgroups == 2;
  // setmaxnreg: the producer keeps 24 registers per thread, the consumers get
  // 240 (24 * 128 + 240 * 256 <= 64K registers of the SM).
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = kConsumerWarpgroups == 2 ? 240 : 160;

  // Consumer warpgroups tile the M mode: warpgroup w owns rows [64 w, 64 w + 64).
  using WarpgroupLayout = Layout<Shape<Int<kConsumerWarpgroups>, _1, _1>>;
  // S = Q K^T: M = block_m, N = block_n, K = head_dim; both operands K-major.
  // kQInRegisters (the tile table's q_in_registers): each consumer loads its
  // 64 Q rows into registers once per tile (ldmatrix) and the products read
  // them there, so shared memory serves only K to the Q K^T products, and the
  // Q buffer is free for the next tile's load as soon as every consumer has
  // its copy.
  static constexpr bool kQInRegisters = kTile.q_in_registers;
  static constexpr bool kStaleMax = kTile.stale_max;
  using MmaQKShape = Shape<_64, Int<kBlockN>, Int<kHeadDim>>;
  using TiledMmaQK = decltype(make_tiled_mma(
      std::conditional_t<kQInRegisters,
                         decltype(GMMA::rs_op_selector<Element, Element, float, MmaQKShape>()),
                         decltype(GMMA::ss_op_selector<Element, Element, float, MmaQKShape>())>{},
      WarpgroupLayout{}));
  // O += P V: M = block_m, N = head_dim, K = block_n; P from registers, V^T
  // read MN-major (head_dim contiguous, as V is stored).
  using MmaPVAtom = decltype(
      GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim>, Int<kBlockN>>,
                           GMMA::Major::K, GMMA::Major::MN>());
  using TiledMmaPV = decltype(make_tiled_mma(MmaPVAtom{}, WarpgroupLayout{}));

  // 128-byte swizzled layouts that both TMA and wgmma understand.
  using SmemLayoutQ = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                             Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutK = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                             Shape<Int<kBlockN>, Int<kHeadDim>, Int<kKStages>>{}));
  // V stored as V^T tiles (head_dim x block_n), head_dim contiguous. The
  // swizzle atoms (64 head-dim columns x 8 keys) run along the keys first, so
  // that each 64-column slice of a tile is one contiguous TMA box (two copies
  // per tile at head dim 128, instead of one per 8 keys and slice: 32).
  using SmemLayoutVt = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Element>{},
                                              Shape<Int<kHeadDim>, Int<kBlockN>, Int<kVStages>>{},
                                              Step<_2, _1, _3>{}));

  // Global views that the TMA descriptors are built from, [seq, head_dim, heads,
  // batch] (and [head_dim, seq, heads, batch] for V^T); strides in elements.
  using GmemShape = Shape<int32_t, int32_t, int32_t, int32_t>;
  using GmemStrideRowMajor = Stride<int64_t, _1, int64_t, int64_t>;
  using GmemStrideTransposed = Stride<_1, int64_t, int64_t, int64_t>;
  template <typename Stride_, typename SmemLayout, typename TileShape>
  using Tma = decltype(make_tma_atom(
      SM90_TMA_LOAD{},
      make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemShape{}, Stride_{}),
      SmemLayout{}, TileShape{}));
  using TmaQ = Tma<GmemStrideRowMajor, SmemLayoutQ, Shape<Int<kBlockM>, Int<kHeadDim>>>;
  using TmaK = Tma<GmemStrideRowMajor, decltype(take<0, 2>(SmemLayoutK{})),
                   Shape<Int<kBlockN>, Int<kHeadDim>>>;
  using TmaV = Tma<GmemStrideTransposed, decltype(take<0, 2>(SmemLayoutVt{})),
                   Shape<Int<kHeadDim>, Int<kBlockN>>>;

  // The global shapes the TMA descriptors are built for (host) and indexed
  // with (device).
  CUTE_HOST_DEVICE static auto shape_q(const FwdParams& p) {
    return make_shape(p.seqlen_q, int32_t{kHeadDim}, p.num_heads, p.batch);
  }
  CUTE_HOST_DEVICE static auto shape_k(const FwdParams& p) {
    return make_shape(p.seqlen_k, int32_t{kHeadDim}, p.num_heads_kv, p.batch);
  }
  CUTE_HOST_DEVICE static auto shape_vt(const FwdParams& p) {
    return make_shape(int32_t{kHeadDim}, p.seqlen_k, p.num_heads_kv, p.batch);
  }

  static constexpr uint32_t kQBytes = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kKVBytes = kBlockN * kHeadDim * sizeof(Element);

  // The epilogue stages O in shared memory, one 64-row slab per consumer
  // warpgroup (stmatrix from registers), and stores each slab with one TMA
  // copy, where the slabs fit beside Q and the ring (head dims 64 and 128;
  // head dim 256 stores from registers). Measured against 4-byte stores from
  // registers (H200, docs/cuda_kernels.md, Hopper forward: loads and epilogue): head dim 128 +20% at seq 512,
  // +2-5% at 4k-16k; head dim 64 +5-11% up to seq 2048.
  using SmemLayoutO = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                             Shape<_64, Int<kHeadDim>, Int<kConsumerWarpgroups>>{}));
  static constexpr uint32_t kOBytes = kBlockM * kHeadDim * sizeof(Element);
  static constexpr bool kSmemEpilogue =
      kQBytes + (kKStages + kVStages) * kKVBytes + kOBytes + 1024 <= 227 * 1024;
  using TmaO = decltype(make_tma_atom(
      SM90_TMA_STORE{},
      make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)), GmemShape{}, GmemStrideRowMajor{}),
      take<0, 2>(SmemLayoutO{}), Shape<_64, Int<kHeadDim>>{}));
  // stmatrix of one warpgroup's 64 x head_dim accumulator.
  using SmemCopyO = decltype(make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{},
                                               make_tiled_mma(MmaPVAtom{})));

  struct SharedStorage {
    // 1024-byte alignment: the period of the 128-byte swizzle.
    alignas(1024) cute::ArrayEngine<Element, cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::ArrayEngine<Element, cosize_v<SmemLayoutK>> k;
    alignas(1024) cute::ArrayEngine<Element, cosize_v<SmemLayoutVt>> v;
    alignas(1024) cute::ArrayEngine<Element, kSmemEpilogue ? cosize_v<SmemLayoutO> : 1> o;
    // kStaleMax with ping-pong: per consumer warp, whether its softmax of the
    // last key tile must be redone (by the parity of the step).
    alignas(4) uint8_t redo[2][kConsumerWarpgroups][4];
    alignas(8) uint64_t q_full;
    uint64_t q_empty;
    uint64_t k_full[kKStages];
    uint64_t v_full[kVStages];
    uint64_t k_empty[kKStages];
    uint64_t v_empty[kVStages];
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= 227 * 1024);
};

// The kernel's parameters: the plain FwdParams plus the four TMA descriptors
// built from them on the host (passed by value, as __grid_constant__).
template <typename Traits>
struct FwdArgs {
  FwdParams params;
  typename Traits::TmaQ tma_q;
  typename Traits::TmaK tma_k;
  typename Traits::TmaV tma_v;
  typename Traits::TmaO tma_o;  // used where Traits::kSmemEpilogue
};

// Ring position of the i-th K/V tile: buffer and the mbarrier phase parity
// that its n-th fill completes.
template <int kStages>
struct RingSlot {
  int stage;
  uint32_t phase;
  __device__ __forceinline__ explicit RingSlot(int i) : stage(i % kStages), phase((i / kStages) & 1) {}
};

template <typename Traits, bool kBanded>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    flash_fwd_sm90_kernel(const __grid_constant__ FwdArgs<Traits> args) {
  using Element = typename Traits::Element;
  using SharedStorage = typename Traits::SharedStorage;
  using FullBarrier = cutlass::arch::ClusterTransactionBarrier;
  using EmptyBarrier = cutlass::arch::ClusterBarrier;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  using KSlot = RingSlot<Traits::kKStages>;
  using VSlot = RingSlot<Traits::kVStages>;

  const FwdParams& params = args.params;
  extern __shared__ __align__(1024) char smem_raw[];
  SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);

  // Persistent CTAs walk one static sequence of work units, CTA c taking units
  // c, c + gridDim.x, ...; units run head-major (query blocks fastest, then
  // head, then batch), so the CTAs running at one time share heads and their
  // K/V stay in L2.
  //   Unmasked: a unit is one query block; all take the same time.
  //   Banded: tiles differ in length (causal: later query blocks see more
  //     keys), so a unit is a pair of query blocks, the p-th longest and the
  //     p-th shortest of a head, and units take about the same time again.
  //     Measured on the way (H200, causal, head dim 128): one tile per unit
  //     gave 0.77x cuDNN at seq 16k, because a stride of gridDim.x over
  //     query-block-fastest tiles hands each CTA one residue class of blocks,
  //     all long or all short; longest-first across heads gave 0.93-0.94x.
  constexpr int kTilesPerUnit = kBanded ? 2 : 1;
  const int num_m_blocks = ceil_div(params.seqlen_q, kBlockM);
  const int blocks_per_head = ceil_div(num_m_blocks, kTilesPerUnit);  // units per head
  const int num_slots = blocks_per_head * kTilesPerUnit * params.num_heads * params.batch;
  // The slot after t for this CTA: the unit's next tile, else the first tile
  // of its next unit.
  auto next_slot = [&](int t) {
    return t % kTilesPerUnit == kTilesPerUnit - 1 ? t + 1 + (gridDim.x - 1) * kTilesPerUnit
                                                  : t + 1;
  };
  const int first_slot = blockIdx.x * kTilesPerUnit;
  struct Tile {
    bool valid;  // false for the unused second half of an odd head's middle unit
    int m_block, head, batch;
    int row_begin, row_end;     // query rows
    int n_block_begin, n_tiles;  // key tiles the band lets these rows see
  };
  auto tile_at = [&](int t) {
    Tile tile;
    const int unit = t / kTilesPerUnit;
    const int p = unit % blocks_per_head;
    tile.head = (unit / blocks_per_head) % params.num_heads;
    tile.batch = unit / (blocks_per_head * params.num_heads);
    if constexpr (kBanded) {
      const int longest = num_m_blocks - 1 - p;
      tile.m_block = t % 2 == 0 ? longest : p;
      tile.valid = t % 2 == 0 || p != longest;
    } else {
      tile.m_block = p;
      tile.valid = true;
    }
    tile.row_begin = tile.m_block * kBlockM;
    tile.row_end = min(tile.row_begin + kBlockM, params.seqlen_q);
    int key_begin = 0;
    int key_end = params.seqlen_k;
    if constexpr (kBanded) {
      key_begin = static_cast<int>(params.mask.key_begin(tile.row_begin));
      key_end = static_cast<int>(params.mask.key_end(tile.row_end, params.seqlen_k));
    }
    tile.n_block_begin = key_begin / kBlockN;
    tile.n_tiles = key_begin < key_end ? ceil_div(key_end, kBlockN) - tile.n_block_begin : 0;
    return tile;
  };
  // The first slot after t whose tile has work (num_slots if none).
  auto next_work = [&](int t) {
    for (t = next_slot(t); t < num_slots; t = next_slot(t)) {
      const Tile tile = tile_at(t);
      if (tile.valid && tile.n_tiles > 0) break;
    }
    return t;
  };

  const int warpgroup = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    FullBarrier::init(&smem.q_full, 1);
    EmptyBarrier::init(&smem.q_empty, Traits::kConsumerThreads / 32);
    CUTE_UNROLL
    for (int s = 0; s < Traits::kKStages; ++s) {
      FullBarrier::init(&smem.k_full[s], 1);
      EmptyBarrier::init(&smem.k_empty[s], Traits::kConsumerThreads / 32);
    }
    CUTE_UNROLL
    for (int s = 0; s < Traits::kVStages; ++s) {
      FullBarrier::init(&smem.v_full[s], 1);
      EmptyBarrier::init(&smem.v_empty[s], Traits::kConsumerThreads / 32);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  Tensor sQ = make_tensor(make_smem_ptr(smem.q.begin()), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(smem.k.begin()), typename Traits::SmemLayoutK{});
  Tensor sVt = make_tensor(make_smem_ptr(smem.v.begin()), typename Traits::SmemLayoutVt{});

  if (warpgroup == 0) {
    // ---------------------------------------------------------------- producer
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegisters>();
    if (threadIdx.x / 32 != 0 || !cute::elect_one_sync()) return;

    Tensor mQ = args.tma_q.get_tma_tensor(Traits::shape_q(params));
    Tensor mK = args.tma_k.get_tma_tensor(Traits::shape_k(params));
    Tensor mVt = args.tma_v.get_tma_tensor(Traits::shape_vt(params));
    // (TMA) for Q; (TMA, n_block) and (TMA, stage) for K and V.
    auto partition = [&](const Tile& tile) {
      const int kv_head = tile.head / params.heads_per_kv;
      Tensor gQ = local_tile(mQ(_, _, tile.head, tile.batch), Shape<Int<kBlockM>, Int<kHeadDim>>{},
                             make_coord(tile.m_block, 0));
      Tensor gK = local_tile(mK(_, _, kv_head, tile.batch), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                             make_coord(_, 0));
      Tensor gVt = local_tile(mVt(_, _, kv_head, tile.batch),
                              Shape<Int<kHeadDim>, Int<kBlockN>>{}, make_coord(0, _));
      return make_tuple(tma_partition(args.tma_q, Int<0>{}, Layout<_1>{},
                                      group_modes<0, 2>(sQ), group_modes<0, 2>(gQ)),
                        tma_partition(args.tma_k, Int<0>{}, Layout<_1>{},
                                      group_modes<0, 2>(sK), group_modes<0, 2>(gK)),
                        tma_partition(args.tma_v, Int<0>{}, Layout<_1>{},
                                      group_modes<0, 2>(sVt), group_modes<0, 2>(gVt)));
    };
    // An L2 prefetch of the next unit's Q and first K/V tiles, issued
    // kPrefetchTiles tiles before this unit ends. Their real loads start only
    // when the Q buffer and ring slots free up, right before the consumers need
    // them, and Q (read once per unit) and a new head's K/V come from HBM.
    // Only units of more than kPrefetchMinTiles tiles issue it (H200, bf16,
    // docs/cuda_kernels.md, Hopper forward: loads and epilogue): head dim 256 at seq 16k gained 5%, while at seq
    // 512-1024 the producer's extra work per short unit cost up to 6-8%.
    constexpr int kPrefetchTiles = 4;
    constexpr int kPrefetchMinTiles = 16;
    auto prefetch_next = [&](int t) {
      const int t_next = next_work(t);
      if (t_next >= num_slots) return;
      const Tile tile = tile_at(t_next);
      auto [q, k, v] = partition(tile);
      cute::prefetch(args.tma_q, get<0>(q));
      for (int i = 0; i < min(Traits::kKStages, tile.n_tiles); ++i) {
        cute::prefetch(args.tma_k, get<0>(k)(_, tile.n_block_begin + i));
      }
      for (int i = 0; i < min(Traits::kVStages, tile.n_tiles); ++i) {
        cute::prefetch(args.tma_v, get<0>(v)(_, tile.n_block_begin + i));
      }
    };
    int kv_iter = 0;  // K/V tiles loaded so far: position in the ring
    int q_iter = 0;   // Q tiles loaded so far
    for (int t = first_slot; t < num_slots; t = next_slot(t)) {
      const Tile tile = tile_at(t);
      if (!tile.valid || tile.n_tiles == 0) continue;
      auto [q, k, v] = partition(tile);
      auto [tQgQ, tQsQ] = q;
      auto [tKgK, tKsK] = k;
      auto [tVgV, tVsV] = v;

      // A fresh mbarrier counts as having completed the phase before phase 0,
      // so the first wait on each "empty" barrier passes at once. The next
      // tile's Q and first K/V tiles load while the consumers finish this one.
      EmptyBarrier::wait(&smem.q_empty, (q_iter & 1) ^ 1);
      FullBarrier::arrive_and_expect_tx(&smem.q_full, Traits::kQBytes);
      copy(args.tma_q.with(smem.q_full), tQgQ, tQsQ);
      ++q_iter;
      const int prefetch_at =
          tile.n_tiles > kPrefetchMinTiles ? tile.n_tiles - kPrefetchTiles : -1;
      for (int i = 0; i < tile.n_tiles; ++i, ++kv_iter) {
        if (i == prefetch_at) prefetch_next(t);
        const KSlot ks(kv_iter);
        const VSlot vs(kv_iter);
        const int n_block = tile.n_block_begin + i;
        EmptyBarrier::wait(&smem.k_empty[ks.stage], ks.phase ^ 1);
        FullBarrier::arrive_and_expect_tx(&smem.k_full[ks.stage], Traits::kKVBytes);
        copy(args.tma_k.with(smem.k_full[ks.stage]), tKgK(_, n_block), tKsK(_, ks.stage));
        EmptyBarrier::wait(&smem.v_empty[vs.stage], vs.phase ^ 1);
        FullBarrier::arrive_and_expect_tx(&smem.v_full[vs.stage], Traits::kKVBytes);
        copy(args.tma_v.with(smem.v_full[vs.stage]), tVgV(_, n_block), tVsV(_, vs.stage));
      }
    }
    return;
  }

  // ------------------------------------------------------------------ consumers
  cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegisters>();
  const int tidx = threadIdx.x - 128;  // 0 .. kConsumerThreads - 1
  const int consumer = warpgroup - 1;  // which 64 rows of the tile

  typename Traits::TiledMmaQK mma_qk;
  typename Traits::TiledMmaPV mma_pv;
  auto thr_qk = mma_qk.get_thread_slice(tidx);
  auto thr_pv = mma_pv.get_thread_slice(tidx);
  Tensor tSrQ = thr_qk.partition_fragment_A(sQ);   // smem descriptors, or registers
  Tensor tSrK = thr_qk.partition_fragment_B(sK);   // (MMA, MMA_N, MMA_K, stage)
  Tensor tOrV = thr_pv.partition_fragment_B(sVt);  // (MMA, MMA_N, MMA_K, stage)
  // kQInRegisters: the ldmatrix copy of this thread's Q fragment.
  auto smem_copy_q = make_tiled_copy_A(Copy_Atom<SM75_U32x4_LDSM_N, Element>{}, mma_qk);
  auto smem_thr_copy_q = smem_copy_q.get_thread_slice(tidx);
  Tensor tQsQ = smem_thr_copy_q.partition_S(sQ);

  Tensor acc_s = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});
  Tensor acc_o = partition_fragment_C(mma_pv, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  Tensor s_rc = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));
  Tensor o_rc = make_tensor(acc_o.data(), acc_rowcol(acc_o.layout()));
  // P = softmax numerators in the A-operand layout of the P V product.
  Tensor tOrP = make_tensor<Element>(acc_as_a_operand(acc_s.layout()));
  Tensor cS = thr_qk.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor cS_rc = make_tensor(cS.data(), acc_rowcol(cS.layout()));

  // One arrival per consumer warp, after the wgmma wait that completes its
  // reads of the buffer (the wait is warp-synchronous, so lane 0 speaks for all).
  const bool warp_leader = tidx % 32 == 0;
  auto release = [&](uint64_t* barrier) {
    if (warp_leader) EmptyBarrier::arrive(barrier);
  };
  // Once a Q K^T's scores are final: its K buffer, and after the tile's last
  // Q K^T also Q where the products read it from shared memory.
  auto release_qk_operands = [&](int k_stage, bool last_q_k) {
    release(&smem.k_empty[k_stage]);
    if (!Traits::kQInRegisters && last_q_k) release(&smem.q_empty);
  };

  constexpr int kRows = decltype(size<0>(s_rc))::value;  // query rows this thread holds (2)
  float row_max[kRows];  // running max of the scaled (log2-domain) scores
  float row_sum[kRows];  // running sum of exp2(score - row_max), this thread's columns
  int row_begin = 0;     // the current tile's first query row
  // Keys [key_lo, key_hi) each of this thread's rows sees (the band and the
  // sequence end). Rows past seqlen_q, never stored, are never cut (their
  // scores are finite: TMA fills their Q with zeros).
  int key_lo[kRows];
  int key_hi[kRows];

  // Ping-pong: consumer c may issue products once barrier (kFirstBarrier + c)
  // completes, and hands the turn to the other consumer after issuing. Each
  // consumer issues n_tiles + 1 times per tile; the first turn of each tile
  // goes to consumer 0, and consumer 1 skips its last hand-over of the tile, so
  // that every tile leaves both barriers as it found them.
  constexpr uint32_t kFirstBarrier = 1;
  constexpr uint32_t kPairThreads = 256;
  // Named barriers (CUTLASS numbering, past its reserved ones): the ping-pong
  // pair kFirstBarrier + {0, 1}, then per consumer one for the epilogue
  // (kEpilogueBarrier, defined with it) and one for the softmax's vote.
  constexpr uint32_t kVoteBarrier =
      kFirstBarrier + (Traits::kPingPong ? 2 : 0) + Traits::kConsumerWarpgroups;  // + consumer
  static_assert(cutlass::arch::NamedBarrier::ReservedNamedBarrierCount + kVoteBarrier +
                        Traits::kConsumerWarpgroups <=
                    cutlass::arch::NamedBarrier::HardwareMaxNumNamedBarriers);
  auto begin_issue = [&] {
    if constexpr (Traits::kPingPong) {
      cutlass::arch::NamedBarrier::sync(kPairThreads, kFirstBarrier + consumer);
    }
  };
  auto end_issue = [&](bool last) {
    if constexpr (Traits::kPingPong) {
      if (!(last && consumer == 1)) {
        cutlass::arch::NamedBarrier::arrive(kPairThreads, kFirstBarrier + 1 - consumer);
      }
    }
  };

  // Folds the score tile S into the running max / sum and leaves the
  // exponentials in acc_s and each row's O correction factor in `correction`.
  // Scores live in the log2 domain: exp(scale * s) = exp2(scale_log2 * s).
  constexpr int kCols = decltype(size<1>(s_rc))::value;  // columns per row and thread
  static_assert(kCols % 4 == 0);
  // Reduces row r of the score tile with four independent partial results:
  // one serial chain of kCols dependent instructions would leave the warp
  // waiting on each one's latency.
  auto row_reduce = [&](int r, auto op) {
    float part[4];
    CUTE_UNROLL
    for (int a = 0; a < 4; ++a) part[a] = s_rc(r, a);
    CUTE_UNROLL
    for (int c = 4; c < kCols; ++c) part[c % 4] = op(part[c % 4], s_rc(r, c));
    return op(op(part[0], part[1]), op(part[2], part[3]));
  };
  constexpr int kRescaleSlack = 8;                    // log2 units
  constexpr float kRescaleBound = 1 << kRescaleSlack;  // 2^kRescaleSlack
  // Masking works on the raw scores, before the scale: a hidden score becomes
  // hidden_score, which the scale sends to -inf (scale > 0) or the min-reduction
  // skips (scale < 0), so masked and unmasked tiles share the one-FFMA
  // exponent below. A zero scale cannot send anything to -inf; its masked
  // tiles hold the scaled scores (0 or -inf) and take the exponent with scale 1.
  // Under a band only the warps with a row that the tile cuts mask per
  // element, with two instructions per score where the band's lower edge is
  // outside the tile. Measured against scaling and masking every score of a
  // cut tile (five instructions each; H200, head dim 64 causal): +13% at seq
  // 512, +9% at 1024, +8% at 2048 (docs/cuda_kernels.md, Hopper forward: softmax).
  const bool zero_scale = params.softmax_scale_log2 == 0.f;
  const float hidden_score = params.softmax_scale_log2 >= 0.f ? -INFINITY : INFINITY;
  // Hides the scores of key tile n_block that the band or the sequence end
  // cuts (in place, raw scores); returns whether it touched any.
  auto mask_scores = [&](int n_block) __attribute__((always_inline)) {
    const int key0 = n_block * kBlockN;
    bool needs_mask = key0 + kBlockN > params.seqlen_k;  // all rows alike without a band
    if constexpr (kBanded) {
      bool cut = false;
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) cut |= key_lo[r] > key0 || key_hi[r] < key0 + kBlockN;
      needs_mask = __any_sync(0xffffffff, cut);
    }
    if (needs_mask) {
      // Column c of this thread is key key0 + col0 + dc(c), dc a constant.
      const int col0 = get<1>(cS_rc(0, 0));
      // A causal band never cuts a row's first keys: then one test per score.
      bool lo_cut = false;
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) lo_cut |= key_lo[r] > key0;
      lo_cut = __any_sync(0xffffffff, lo_cut);
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const int lo = key_lo[r] - key0 - col0;
        const int hi = key_hi[r] - key0 - col0;
        if (zero_scale) {
          CUTE_UNROLL
          for (int c = 0; c < kCols; ++c) {
            const int dc = get<1>(cS_rc(r, c)) - col0;
            s_rc(r, c) = dc >= lo && dc < hi ? 0.f : -INFINITY;
          }
        } else if (lo_cut) {
          CUTE_UNROLL
          for (int c = 0; c < kCols; ++c) {
            const int dc = get<1>(cS_rc(r, c)) - col0;
            s_rc(r, c) = dc >= lo && dc < hi ? s_rc(r, c) : hidden_score;
          }
        } else {
          CUTE_UNROLL
          for (int c = 0; c < kCols; ++c) {
            const int dc = get<1>(cS_rc(r, c)) - col0;
            s_rc(r, c) = dc < hi ? s_rc(r, c) : hidden_score;
          }
        }
      }
    }
    return needs_mask;
  };
  // Folds the (masked) score tile into the running max and sum with a fresh
  // tile max. The row max of scale * s is scale * max(s) (scale * min(s) for a
  // negative scale), and each exponent is one FFMA, scale * s - max, saving a
  // multiply per score. Each phase below handles all rows at once, without
  // branches inside, so that the rows' dependency chains interleave.
  auto fold_max = [&](bool needs_mask, float (&correction)[kRows]) __attribute__((always_inline)) {
    const float scale = params.softmax_scale_log2;
    const bool prescaled = needs_mask && zero_scale;
    float row_ext[kRows];  // tile_max = ext_scale * row_ext after the quad reduction
    float ext_scale;
    if (scale >= 0.f) {
      ext_scale = prescaled ? 1.f : scale;
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) row_ext[r] = row_reduce(r, MaxOp{});
    } else {
      ext_scale = -scale;
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) row_ext[r] = -row_reduce(r, MinOp{});
    }
    const float s_scale = prescaled ? 1.f : scale;
    float m_safe[kRows];
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      // Lazy rescaling: the running max moves only when the tile exceeds it
      // by more than kRescaleSlack (log2 units). Otherwise the exponents of
      // this tile are taken against the stale max (values up to 2^slack, far
      // from overflow in P and the float32 sums) and O keeps its scale: the
      // result is the same, since O and the row sum share one reference max
      // and lse = max + log(sum). On most tiles no row moves, and the warp
      // skips the O rescale below.
      const float tile_max = quad_allreduce(row_ext[r], MaxOp{}) * ext_scale;
      const float m = tile_max > row_max[r] + kRescaleSlack ? tile_max : row_max[r];
      // A row with no visible key yet keeps m = -inf; subtract 0 instead so
      // that exp2(-inf - -inf) never makes a NaN.
      m_safe[r] = m == -INFINITY ? 0.f : m;
      correction[r] = m == row_max[r] ? 1.f : fast_exp2(row_max[r] - m_safe[r]);
      row_max[r] = m;
    }
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTE_UNROLL
      for (int c = 0; c < kCols; ++c) {
        s_rc(r, c) = fast_exp2(fmaf(s_rc(r, c), s_scale, -m_safe[r]));
      }
    }
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      row_sum[r] = row_sum[r] * correction[r] + row_reduce(r, SumOp{});
    }
  };
  auto softmax_step = [&](int n_block, float (&correction)[kRows]) {
    fold_max(mask_scores(n_block), correction);
  };
  // Exponentiates the (masked) score tile against the running max as it
  // stands, without the tile's max: the row max reductions (a third of the
  // softmax's time per step, docs/cuda_kernels.md, Hopper forward: softmax) are skipped. This is what
  // fold_max computes whenever the tile does not raise any row's max by more
  // than kRescaleSlack (fold_max then keeps the max, too), i.e. when every
  // exponential is at most kRescaleBound. Leaves this thread's partial sum of
  // each row in tile_sum, and returns whether all of them are at most
  // kRescaleBound (false for NaN), which implies that bound for every term;
  // where that fails, the caller computes the tile again with fold_max. Needs a
  // finite running max in every row.
  auto exp_stale = [&](bool needs_mask, float (&tile_sum)[kRows]) {
    const float s_scale = needs_mask && zero_scale ? 1.f : params.softmax_scale_log2;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTE_UNROLL
      for (int c = 0; c < kCols; ++c) {
        s_rc(r, c) = fast_exp2(fmaf(s_rc(r, c), s_scale, -row_max[r]));
      }
    }
    bool within = true;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      tile_sum[r] = row_reduce(r, SumOp{});
      within &= tile_sum[r] <= kRescaleBound;
    }
    return within;
  };
  // S again from the K tile in ring buffer `stage` (see the main loop). The
  // operands' shared-memory descriptors are rebuilt here from an address the
  // compiler cannot see through: otherwise it keeps those of the step's first
  // Q K^T alive across the softmax for this rare path (at head dim 256, 32
  // registers, and the kernel spilled).
  auto recompute_s = [&](int stage) __attribute__((always_inline)) {
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
  };
  // Keeps the wgmma wait that follows below the softmax. Waiting earlier is
  // always legal, and ptxas schedules WARPGROUP.DEPBAR as early as it can: in
  // the main loop it put the wait for P_{i-1} V_{i-1} before the exponentials
  // (after the row max), so each softmax waited for its own warpgroup's P V
  // product and the intra-warpgroup overlap was lost. ptxas does not move the
  // wait above a branch, so a warp-uniform branch on the row sums (the last
  // values the softmax computes), never taken (the sums are >= 0 or NaN), pins
  // it there. Measured (H200, docs/cuda_kernels.md, Hopper forward: softmax): head dim 256 +4-10% at
  // seq 4k-16k, head dim 128 +0-6% at 16k, within noise at 4k.
  auto pin_below = [&](const float (&sums)[kRows]) {
    bool negative = false;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) negative |= sums[r] < 0.f;
    if (__any_sync(0xffffffff, negative)) asm volatile("nanosleep.u32 0;");
  };
  // O *= correction; skipped when no row of the warp raised its max (exact:
  // the correction is then 1).
  auto rescale_o = [&](const float (&correction)[kRows]) {
    bool changed = false;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) changed |= correction[r] != 1.f;
    if (__any_sync(0xffffffff, changed)) {
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        CUTE_UNROLL
        for (int c = 0; c < size<1>(o_rc); ++c) o_rc(r, c) *= correction[r];
      }
    }
  };
  // tOrP and acc_s map each (row, col) to the same register offset; write P
  // through acc_s's layout so that the element order cannot differ.
  auto convert_p = [&] {
    Tensor p = convert_fragment<Element>(acc_s);
    Tensor dst = make_tensor(tOrP.data(), acc_s.layout());
    CUTE_UNROLL
    for (int i = 0; i < size(p); ++i) dst(i) = p(i);
  };
  // Where a warp's verdict on its stale-max softmax is settled: at the next
  // turn (unmasked ping-pong kernels), or by a vote of the warpgroup right
  // after the exponentials. Measured in cycles per launch (ncu, H200, head
  // dim 128; docs/cuda_kernels.md, Hopper forward: softmax): unmasked, the turn took 0.7% (4k) and
  // 1.5% (16k) fewer than the vote; causal 4k, 3% more.
  constexpr bool kSettleAtTurn = Traits::kStaleMax && Traits::kPingPong && !kBanded;
  // kStaleMax with ping-pong: each warp's verdict on its softmax of a key tile
  // (redo: some row's max rose too far), published in shared memory and read
  // by the whole warpgroup after the next turn's barrier. The accesses are
  // asm volatile so that the compiler keeps them on their side of that
  // barrier (also asm volatile, without a memory clobber).
  const int lane = tidx % 32;
  const int warp_in_group = tidx % 128 / 32;
  bool redo = false;  // this warp's verdict on the last key tile
  auto publish_redo = [&](int step) {
    if (lane == 0) {
      asm volatile("st.shared.u8 [%0], %1;" ::"r"(cast_smem_ptr_to_uint(
                       &smem.redo[step & 1][consumer][warp_in_group])),
                   "r"(static_cast<uint32_t>(redo)));
    }
  };
  auto any_redo = [&](int step) {
    uint32_t verdicts;
    asm volatile("ld.shared.u32 %0, [%1];"
                 : "=r"(verdicts)
                 : "r"(cast_smem_ptr_to_uint(&smem.redo[step & 1][consumer][0])));
    return verdicts != 0;
  };
  // Settles key tile j (>= 1) of the current unit right after this
  // consumer's next turn began: where some warp's verdict was redo, the
  // warpgroup computes S_j again and those warps fold it with fresh maxima,
  // rescale O (which holds the products up to P_{j-1} V_{j-1}) and convert
  // P_j again. Then K_j (and after the unit's last Q K^T, Q) leaves shared
  // memory.
  auto settle = [&](int j, int n_block, int k_stage, bool last_q_k) __attribute__((always_inline)) {
    if (any_redo(j)) {
      recompute_s(k_stage);
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_s);
      if (redo) {
        float correction[kRows];
        fold_max(mask_scores(n_block), correction);
        rescale_o(correction);
        convert_p();
      }
    }
    release_qk_operands(k_stage, last_q_k);
  };

  Tensor cO = thr_pv.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor cO_rc = make_tensor(cO.data(), acc_rowcol(cO.layout()));
  // The epilogue's slab of this warpgroup, its stmatrix partition, and the
  // global output (kSmemEpilogue).
  constexpr uint32_t kEpilogueBarrier = kFirstBarrier + (Traits::kPingPong ? 2 : 0);  // + consumer
  const bool store_leader = tidx % 128 == 0;
  Tensor sO = make_tensor(make_smem_ptr(smem.o.begin()), typename Traits::SmemLayoutO{})(_, _, consumer);
  typename Traits::SmemCopyO smem_copy_o;
  auto thr_copy_o = smem_copy_o.get_thread_slice(tidx % 128);
  Tensor tOsO = thr_copy_o.partition_D(sO);
  Tensor mO = args.tma_o.get_tma_tensor(Traits::shape_q(params));
  int kv_iter = 0;  // K/V tiles consumed so far: position in the ring
  int q_iter = 0;   // Q tiles consumed so far
  for (int t = first_slot; t < num_slots; t = next_slot(t)) {
    const Tile tile = tile_at(t);
    if (!tile.valid) continue;
    const int n_tiles = tile.n_tiles;
    const int n_block_begin = tile.n_block_begin;
    row_begin = tile.row_begin;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int row = row_begin + get<0>(cS_rc(r, 0));
      key_lo[r] = 0;
      key_hi[r] = params.seqlen_k;
      if (row >= params.seqlen_q) {
        key_hi[r] = params.seqlen_k + kBlockN;
      } else if constexpr (kBanded) {
        key_lo[r] = static_cast<int>(min<int64_t>(params.mask.key_begin(row), params.seqlen_k));
        key_hi[r] = static_cast<int>(max<int64_t>(params.mask.key_end(row + 1, params.seqlen_k), 0));
      }
    }
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      row_max[r] = -INFINITY;
      row_sum[r] = 0.f;
    }
    clear(acc_o);
    if (n_tiles > 0) {
      if constexpr (Traits::kPingPong) {
        if (consumer == 1) cutlass::arch::NamedBarrier::arrive(kPairThreads, kFirstBarrier);
      }
      FullBarrier::wait(&smem.q_full, q_iter & 1);
      if constexpr (Traits::kQInRegisters) {
        // The previous tile's Q K^T products are complete (warpgroup_wait<0>
        // of its last step), so its Q registers may be overwritten.
        warpgroup_fence_operand(tSrQ);
        copy(smem_copy_q, tQsQ, smem_thr_copy_q.retile_D(tSrQ));
        warpgroup_fence_operand(tSrQ);
        release(&smem.q_empty);
      }

      // Step 0: S_0 only.
      {
        const KSlot slot(kv_iter);
        begin_issue();
        FullBarrier::wait(&smem.k_full[slot.stage], slot.phase);
        wgmma_issue</*kZeroInit=*/true>(mma_qk, tSrQ, tSrK(_, _, _, slot.stage), acc_s);
        end_issue(false);
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc_s);
        release_qk_operands(slot.stage, n_tiles == 1);
        float correction[kRows];
        softmax_step(n_block_begin, correction);
        convert_p();
      }
      for (int i = 1; i < n_tiles; ++i) {
        const KSlot slot(kv_iter + i);
        const VSlot prev(kv_iter + i - 1);
        begin_issue();
        if constexpr (kSettleAtTurn) {
          if (i >= 2) settle(i - 1, n_block_begin + i - 1, KSlot(kv_iter + i - 1).stage, false);
        }
        FullBarrier::wait(&smem.k_full[slot.stage], slot.phase);
        wgmma_issue<true>(mma_qk, tSrQ, tSrK(_, _, _, slot.stage), acc_s);
        FullBarrier::wait(&smem.v_full[prev.stage], prev.phase);
        warpgroup_fence_operand(tOrP);
        wgmma_issue<false>(mma_pv, tOrP, tOrV(_, _, _, prev.stage), acc_o);
        end_issue(false);
        warpgroup_wait<1>();  // S_i done; P_{i-1} V_{i-1} may still run
        warpgroup_fence_operand(acc_s);
        const int n_block = n_block_begin + i;
        float correction[kRows];
        if constexpr (!Traits::kStaleMax) {
          release_qk_operands(slot.stage, i == n_tiles - 1);
          softmax_step(n_block, correction);
          pin_below(row_sum);
          warpgroup_wait<0>();
        } else {
          // The softmax first exponentiates S_i against the running max
          // (exp_stale), where every row of the warp has one. A warp that
          // finds a row whose max the tile raises too far folds the tile
          // again with fresh maxima, from S_i computed again (exp_stale
          // overwrote it); as wgmma is warpgroup-wide, so is that product, and
          // K_i (and Q) stay in shared memory until it is settled.
          const bool needs_mask = mask_scores(n_block);
          bool finite_max = true;
          CUTE_UNROLL
          for (int r = 0; r < kRows; ++r) finite_max &= row_max[r] != -INFINITY;
          const bool stale = __all_sync(0xffffffff, finite_max);
          float tile_sum[kRows];
          const bool over = stale && !exp_stale(needs_mask, tile_sum);
          if constexpr (kSettleAtTurn) {
            // Settled at the next turn (settle): the warps publish
            // their verdict through shared memory, and the turn's barrier,
            // which they pass anyway, makes it visible to all.
            redo = __any_sync(0xffffffff, over);
            if (stale) {
              CUTE_UNROLL
              for (int r = 0; r < kRows; ++r) {
                if (!redo) row_sum[r] += tile_sum[r];
                correction[r] = 1.f;
              }
            } else {
              fold_max(needs_mask, correction);  // rows with no visible key yet
            }
            publish_redo(i);
            pin_below(row_sum);
            warpgroup_wait<0>();
          } else {
            // No turns to piggyback on: a vote of the warpgroup's threads.
            const bool redo_any = warpgroup_any(
                over, cutlass::arch::NamedBarrier::ReservedNamedBarrierCount + kVoteBarrier + consumer);
            // Both paths leave no product in flight (C7515, docs/cuda_kernels.md, Compiler pitfalls).
            warpgroup_wait<0>();
            if (redo_any) {
              recompute_s(slot.stage);
              warpgroup_wait<0>();
              warpgroup_fence_operand(acc_s);
              mask_scores(n_block);
            }
            if (redo_any || !stale) {
              fold_max(needs_mask, correction);  // also rows with no visible key yet
            } else {
              CUTE_UNROLL
              for (int r = 0; r < kRows; ++r) {
                row_sum[r] += tile_sum[r];
                correction[r] = 1.f;
              }
            }
            release_qk_operands(slot.stage, i == n_tiles - 1);
          }
        }
        warpgroup_fence_operand(acc_o);
        warpgroup_fence_operand(tOrP);
        release(&smem.v_empty[prev.stage]);
        rescale_o(correction);
        convert_p();
      }
      // Last step: P_{n-1} V_{n-1}.
      {
        const VSlot prev(kv_iter + n_tiles - 1);
        begin_issue();
        if constexpr (kSettleAtTurn) {
          if (n_tiles >= 2) {
            settle(n_tiles - 1, n_block_begin + n_tiles - 1, KSlot(kv_iter + n_tiles - 1).stage, true);
          }
        }
        FullBarrier::wait(&smem.v_full[prev.stage], prev.phase);
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

    // Epilogue: O /= rowsum and lse, then O stored (the producer is already
    // loading the next tile).
    float* lse_ptr = params.lse + (int64_t(tile.batch) * params.num_heads + tile.head) * params.seqlen_q;
    if constexpr (Traits::kSmemEpilogue) {
      normalize_output(o_rc, cO_rc, row_max, row_sum, row_begin, params.seqlen_q, tidx % 4 == 0,
                       lse_ptr);
      Tensor o = convert_fragment<Element>(acc_o);
      // The warpgroup's previous TMA store must have read the slab before it
      // is overwritten; TMA clips the rows past seqlen_q.
      if (store_leader) tma_store_wait<0>();
      cutlass::arch::NamedBarrier::sync(128, kEpilogueBarrier + consumer);
      copy(smem_copy_o, thr_copy_o.retile_S(o), tOsO);
      tma_store_fence();  // the slab's generic-proxy writes, visible to TMA
      cutlass::arch::NamedBarrier::sync(128, kEpilogueBarrier + consumer);
      if (store_leader) {
        Tensor gO = local_tile(mO(_, _, tile.head, tile.batch), Shape<_64, Int<kHeadDim>>{},
                               make_coord(row_begin / 64 + consumer, 0));
        auto [tOgO, tOsO_tma] = tma_partition(args.tma_o, Int<0>{}, Layout<_1>{},
                                              group_modes<0, 2>(sO), group_modes<0, 2>(gO));
        copy(args.tma_o, tOsO_tma, tOgO);
        tma_store_arrive();
      }
    } else {
      store_output<Element>(acc_o, o_rc, cO, cO_rc, row_max, row_sum, row_begin, params.seqlen_q,
                            tidx % 4 == 0, lse_ptr,
                            static_cast<Element*>(params.out) + tile.batch * params.out_batch_stride +
                                tile.head * params.out_head_stride,
                            params.out_row_stride);
    }
  }  // tile loop
  if constexpr (Traits::kSmemEpilogue) {
    if (store_leader) tma_store_wait<0>();  // shared memory must outlive the last store's reads
  }
}

template <typename Traits, bool kBanded>
cudaError_t launch_flash_fwd_sm90(const FwdParams& params, const LaunchContext& ctx) {
  using Element = typename Traits::Element;
  constexpr int kHeadDim = Traits::kHeadDim;
  auto gmem = [](const void* ptr, auto shape, auto stride) {
    return make_tensor(make_gmem_ptr(static_cast<Element const*>(ptr)), shape, stride);
  };
  const auto shape_q = Traits::shape_q(params);
  const auto shape_k = Traits::shape_k(params);
  const auto shape_vt = Traits::shape_vt(params);
  FwdArgs<Traits> args{
      params,
      make_tma_atom(SM90_TMA_LOAD{},
                    gmem(params.q, shape_q,
                         make_stride(params.q_row_stride, _1{}, params.q_head_stride,
                                     params.q_batch_stride)),
                    typename Traits::SmemLayoutQ{}, Shape<Int<Traits::kBlockM>, Int<kHeadDim>>{}),
      make_tma_atom(SM90_TMA_LOAD{},
                    gmem(params.k, shape_k,
                         make_stride(params.k_row_stride, _1{}, params.k_head_stride,
                                     params.k_batch_stride)),
                    take<0, 2>(typename Traits::SmemLayoutK{}),
                    Shape<Int<Traits::kBlockN>, Int<kHeadDim>>{}),
      make_tma_atom(SM90_TMA_LOAD{},
                    gmem(params.v, shape_vt,
                         make_stride(_1{}, params.v_row_stride, params.v_head_stride,
                                     params.v_batch_stride)),
                    take<0, 2>(typename Traits::SmemLayoutVt{}),
                    Shape<Int<kHeadDim>, Int<Traits::kBlockN>>{}),
      {},  // the output's, below where the epilogue stores through shared memory
  };
  if constexpr (Traits::kSmemEpilogue) {
    args.tma_o = make_tma_atom(
        SM90_TMA_STORE{},
        make_tensor(make_gmem_ptr(static_cast<Element*>(params.out)), shape_q,
                    make_stride(params.out_row_stride, _1{}, params.out_head_stride,
                                params.out_batch_stride)),
        take<0, 2>(typename Traits::SmemLayoutO{}), Shape<_64, Int<kHeadDim>>{});
  }
  auto kernel = &flash_fwd_sm90_kernel<Traits, kBanded>;
  constexpr int kSmemBytes = Traits::kSmemBytes;
  if (cudaError_t err = cudaFuncSetAttribute(
          kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
      err != cudaSuccess) {
    return err;
  }
  // Persistent: one CTA per SM (the shared memory allows no more), or fewer
  // when there are fewer work units (pairs of query blocks under a band).
  const int64_t tiles_per_unit = kBanded ? 2 : 1;
  const int64_t num_units = (ceil_div(params.seqlen_q, Traits::kBlockM) + tiles_per_unit - 1) /
                            tiles_per_unit * params.num_heads * params.batch;
  if (num_units * tiles_per_unit > INT32_MAX) return cudaErrorInvalidValue;
  int64_t num_ctas = std::min<int64_t>(num_units, ctx.sm_count);
  if constexpr (kBanded) {
    // CTA c runs units c + i * num_ctas, i.e. query-block pairs p = (c + i *
    // num_ctas) mod blocks_per_head. Pairs differ in length when a head has an
    // odd number of query blocks (the middle one runs alone) or a partial last
    // block; with a common factor between num_ctas and blocks_per_head each CTA
    // would see only some p (e.g. 132 CTAs, 2 pairs per head: even CTAs all
    // long, odd all short). Coprime, every CTA cycles through all p, for the
    // price of a few idle SMs (H200, head dim 64, seq 512, causal: 0.59x ->
    // 0.76x cuDNN; 1024: 0.73x -> 0.77x; 2048: 0.81x -> 0.89x).
    const int64_t blocks_per_head = (ceil_div(params.seqlen_q, Traits::kBlockM) + 1) / 2;
    while (num_ctas > 1 && std::gcd(num_ctas, blocks_per_head) != 1) --num_ctas;
  }
  const dim3 grid(static_cast<unsigned>(num_ctas));
  kernel<<<grid, Traits::kNThreads, kSmemBytes, ctx.stream>>>(args);
  return cudaGetLastError();
}

// The entry point of the registry: the head dim's tile, or under a band on
// short rows the short-band tile where the head dim has one.
template <typename Element, int kHeadDim, bool kBanded, bool kPingPong = true>
cudaError_t run_flash_fwd_sm90(const FwdParams& params, const LaunchContext& ctx) {
  if constexpr (kBanded && sm90_fwd_tile_short_band(kHeadDim).block_m > 0) {
    using Short = FwdTraits<Element, kHeadDim, kPingPong, /*kShortBand=*/true>;
    static_assert(Short::kSmemBytes <= FwdTraits<Element, kHeadDim, kPingPong>::kSmemBytes,
                  "the registry reports the main tile's shared memory");
    if (params.seqlen_q <= kSm90ShortBandMaxLen && params.seqlen_k <= kSm90ShortBandMaxLen) {
      return launch_flash_fwd_sm90<Short, kBanded>(params, ctx);
    }
  }
  return launch_flash_fwd_sm90<FwdTraits<Element, kHeadDim, kPingPong>, kBanded>(params, ctx);
}

}  // namespace jflash::cuda::sm90

// The Hopper forward's compile-time configuration: the tile of the head dim
// (tile_sizes.h), the consumer warpgroups and their wgmma products, the
// shared-memory layouts and TMA copies of Q, K, V and O, and the shared
// storage; and the kernel's parameters, FwdArgsSm90.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "cuda/sm90/band_units_sm90.h"
#include "cuda/sm90/pipeline_sm90.h"
#include "cuda/tile_sizes.h"
#include "jflash/params.h"

namespace jflash::cuda::sm90 {

using namespace cute;

// kShortBand: the tile of sm90_fwd_tile_short_band (banded calls on short rows).
template <typename Element_, int kHeadDim_, bool kPingPong_ = true, bool kShortBand = false>
struct FwdTraitsSm90 {
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
  // 240 (160 with three consumers), within what the launch allocates
  // (tile_sizes.h, sm90_register_split_fits).
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = kConsumerWarpgroups == 2 ? 240 : 160;
  static_assert(
      sm90_register_split_fits(kProducerRegisters, kConsumerRegisters, kConsumerThreads));

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
  // The fixed-offset softmax's row sums (jflash/score.h): P times a block of
  // ones, N = 8, beside each P V product (mainloop_fwd_fixed_sm90.h).
  using TiledMmaRowSum = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<_64, _8, Int<kBlockN>>>(),
      WarpgroupLayout{}));
  using SmemLayoutOnes =
      decltype(tile_to_shape(GMMA::Layout_K_INTER_Atom<Element>{}, Shape<_8, Int<kBlockN>>{}));

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
  // with (device). The call's head dim may be below kHeadDim (head_dims.h,
  // sm90_kernel_head_dim): the loads fill the columns past it with zeros and
  // the O store clips them.
  CUTE_HOST_DEVICE static auto shape_q(const FwdParams& p) {
    return make_shape(p.seqlen_q, int32_t{p.head_dim}, p.num_heads, p.batch);
  }
  CUTE_HOST_DEVICE static auto shape_k(const FwdParams& p) {
    return make_shape(p.seqlen_k, int32_t{p.head_dim}, p.num_heads_kv, p.batch);
  }
  CUTE_HOST_DEVICE static auto shape_vt(const FwdParams& p) {
    return make_shape(int32_t{p.head_dim}, p.seqlen_k, p.num_heads_kv, p.batch);
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
    // The dynamic schedule's work units (TileSchedulerSm90::kDynamic); last,
    // so that the other kernels' layout did not move.
    IntRingSm90 units;
    // Ones, the B operand of TiledMmaRowSum (16 bytes per key of a tile),
    // written at the kernel's start where the fixed-offset main loop runs;
    // the other kernels leave them unused.
    alignas(128) cute::ArrayEngine<Element, cosize_v<SmemLayoutOnes>> ones;
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= 227 * 1024);
};

// The kernel's parameters: the plain FwdParams plus the four TMA descriptors
// built from them on the host (passed by value, as __grid_constant__).
template <typename Traits>
struct FwdArgsSm90 {
  FwdParams params;
  typename Traits::TmaQ tma_q;
  typename Traits::TmaK tma_k;
  typename Traits::TmaV tma_v;
  typename Traits::TmaO tma_o;  // used where Traits::kSmemEpilogue
  BandUnits band_units;         // the work units under a band (tile_scheduler_sm90.h)
};

}  // namespace jflash::cuda::sm90

// Kernel traits: every compile-time shape and layout a kernel uses, derived
// from one entry of the tile table (tile_sizes.h).
//
// MMA: mma.sync m16n8k16 with float32 accumulation (sm80 and later).
// Shared memory: K-major tiles (head_dim contiguous) with an XOR swizzle of
// 16-byte chunks, so ldmatrix reads of 8 rows x 16 bytes hit 8 different bank
// groups (no conflicts) for both the plain and the transposed reads.
// Global -> shared: cp.async 16 bytes per thread, coalesced along head_dim.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "cuda/tile_sizes.h"

namespace jflash::cuda {

using namespace cute;

template <typename Element>
using MmaAtom16816 =
    std::conditional_t<std::is_same_v<Element, cutlass::half_t>,
                       MMA_Atom<SM80_16x8x16_F32F16F16F32_TN>,
                       MMA_Atom<SM80_16x8x16_F32BF16BF16F32_TN>>;

// Layouts shared by the forward and the backward traits.
template <typename Element_, int kHeadDim_, int kNThreads_>
struct BaseTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kNThreads = kNThreads_;

  // Swizzle unit: 64 columns (128 bytes, one full bank sweep) when head_dim
  // allows it, else 32 columns (head dims 96, 160, 224).
  static constexpr int kBlockKSmem = kHeadDim % 64 == 0 ? 64 : 32;
  static constexpr int kSwizzle = kBlockKSmem == 64 ? 3 : 2;
  using SmemLayoutAtom = decltype(composition(
      Swizzle<kSwizzle, 3, 3>{},
      Layout<Shape<_8, Int<kBlockKSmem>>, Stride<Int<kBlockKSmem>, _1>>{}));

  // ldmatrix: plain for K-major operands, transposed for M/N-major ones.
  using SmemCopyAtom = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomTransposed = Copy_Atom<SM75_U16x8_LDSM_T, Element>;

  // cp.async of 8 elements (16 bytes) per thread, kBlockKSmem / 8 threads per row.
  static constexpr int kGmemThreadsPerRow = kBlockKSmem / 8;
  static_assert(kNThreads % kGmemThreadsPerRow == 0);
  using GmemLayoutAtom = Layout<Shape<Int<kNThreads / kGmemThreadsPerRow>, Int<kGmemThreadsPerRow>>,
                                Stride<Int<kGmemThreadsPerRow>, _1>>;
  using GmemTiledCopy =
      decltype(make_tiled_copy(Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL<cute::uint128_t>, Element>{},
                               GmemLayoutAtom{}, Layout<Shape<_1, _8>>{}));
};

// kSmem picks the column of the tile table (tile_sizes.h).
template <typename Element_, int kHeadDim_, SmemClass kSmem = SmemClass::kLarge>
struct FwdTraitsSm80
    : BaseTraits<Element_, kHeadDim_, fwd_tile(kHeadDim_, kSmem).num_warps * 32> {
  using Base = BaseTraits<Element_, kHeadDim_, fwd_tile(kHeadDim_, kSmem).num_warps * 32>;
  using typename Base::Element;
  using typename Base::SmemLayoutAtom;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr FwdTile kTile = fwd_tile(kHeadDim, kSmem);
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kNWarps = kTile.num_warps;
  static constexpr int kNThreads = kNWarps * 32;

  // Warps stack along M: each warp owns whole query rows, so the softmax row
  // reductions stay inside a quad of lanes (no shared memory).
  using TiledMma = TiledMMA<MmaAtom16816<Element>, Layout<Shape<Int<kNWarps>, _1, _1>>,
                            Tile<Int<16 * kNWarps>, _16, _16>>;

  using SmemLayoutQ =
      decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutKV =
      decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // V^T (head_dim x block_n) as the B operand of P V, read with transposed ldmatrix.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, GenRowMajor{})));
  using SmemLayoutVtNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutVt{}));

  static constexpr int kSmemBytes =
      (size(SmemLayoutQ{}) + 2 * size(SmemLayoutKV{})) * int(sizeof(Element));
  static_assert(kSmemBytes == fwd_smem_bytes(kTile, kHeadDim));
  static_assert(kSmem == SmemClass::kLarge || kSmemBytes <= kSmallSmemBytes);
};

template <typename Element_, int kHeadDim_, SmemClass kSmem = SmemClass::kLarge>
struct BwdTraitsSm80
    : BaseTraits<Element_, kHeadDim_, bwd_tile(kHeadDim_, kSmem).num_warps * 32> {
  using Base = BaseTraits<Element_, kHeadDim_, bwd_tile(kHeadDim_, kSmem).num_warps * 32>;
  using typename Base::Element;
  using typename Base::SmemLayoutAtom;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr BwdTile kTile = bwd_tile(kHeadDim, kSmem);
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kNWarps = kTile.num_warps;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kQStages = kTile.q_stages;

  // The three products' warp grids (tile_sizes.h); each warp repeat is 16 x 16
  // (two m16n8 atoms side by side, so a B fragment is one ldmatrix.x4).
  static constexpr int kSdPWarpsM = kTile.sdp_warps_m, kSdPWarpsN = kNWarps / kSdPWarpsM;
  static constexpr int kdKVWarpsN = kTile.dkv_warps_n, kdKVWarpsD = kNWarps / kdKVWarpsN;
  static constexpr int kdQWarpsM = kTile.dq_warps_m, kdQWarpsD = kNWarps / kdQWarpsM;
  static_assert(kBlockM % (16 * kSdPWarpsM) == 0 && kBlockN % (16 * kSdPWarpsN) == 0);
  static_assert(kBlockN % (16 * kdKVWarpsN) == 0 && kHeadDim % (16 * kdKVWarpsD) == 0);
  static_assert(kBlockM % (16 * kdQWarpsM) == 0 && kHeadDim % (16 * kdQWarpsD) == 0);

  // S = Q K^T and dP = dO V^T: (block_m x block_n).
  using TiledMmaSdP =
      TiledMMA<MmaAtom16816<Element>, Layout<Shape<Int<kSdPWarpsM>, Int<kSdPWarpsN>, _1>>,
               Tile<Int<16 * kSdPWarpsM>, Int<16 * kSdPWarpsN>, _16>>;
  // dK += dS^T Q and dV += P^T dO: (block_n x head_dim).
  using TiledMmadKV =
      TiledMMA<MmaAtom16816<Element>, Layout<Shape<Int<kdKVWarpsN>, Int<kdKVWarpsD>, _1>>,
               Tile<Int<16 * kdKVWarpsN>, Int<16 * kdKVWarpsD>, _16>>;
  // dQ = dS K: (block_m x head_dim).
  using TiledMmadQ =
      TiledMMA<MmaAtom16816<Element>, Layout<Shape<Int<kdQWarpsM>, Int<kdQWarpsD>, _1>>,
               Tile<Int<16 * kdQWarpsM>, Int<16 * kdQWarpsD>, _16>>;

  using SmemLayoutQ =
      decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutKV =
      decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // Q^T and dO^T (head_dim x block_m): B operands of dK and dV.
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockM>>{}, GenRowMajor{})));
  using SmemLayoutQtNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutQt{}));
  // K^T (head_dim x block_n): B operand of dQ.
  using SmemLayoutKt = decltype(composition(
      SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, GenRowMajor{})));
  using SmemLayoutKtNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutKt{}));

  // P and dS (block_m x block_n), written from the S/dP accumulators.
  static constexpr int kBlockNSmemPdS = kBlockN % 64 == 0 ? 64 : 32;
  using SmemLayoutAtomPdS = decltype(composition(
      Swizzle<kBlockNSmemPdS == 64 ? 3 : 2, 3, 3>{},
      Layout<Shape<_8, Int<kBlockNSmemPdS>>, Stride<Int<kBlockNSmemPdS>, _1>>{}));
  using SmemLayoutPdS =
      decltype(tile_to_shape(SmemLayoutAtomPdS{}, Shape<Int<kBlockM>, Int<kBlockN>>{}));
  // P^T and dS^T (block_n x block_m): A operands of dV and dK.
  using SmemLayoutPdSt = decltype(composition(
      SmemLayoutPdS{}, make_layout(Shape<Int<kBlockN>, Int<kBlockM>>{}, GenRowMajor{})));
  using SmemLayoutPdStNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutPdSt{}));
  using SmemCopyAtomPdS = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<32>, Element>;

  static constexpr int kSmemBytes =
      (2 * kQStages * size(SmemLayoutQ{}) + 2 * size(SmemLayoutKV{}) +
       2 * size(SmemLayoutPdS{})) *
      int(sizeof(Element));
  static_assert(kSmemBytes == bwd_smem_bytes(kTile, kHeadDim));
  static_assert(kSmem == SmemClass::kLarge || kSmemBytes <= kSmallSmemBytes);
};

}  // namespace jflash::cuda

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

template <typename Element_, int kHeadDim_>
struct FwdTraits
    : BaseTraits<Element_, kHeadDim_, fwd_tile(kHeadDim_).num_warps * 32> {
  using Base = BaseTraits<Element_, kHeadDim_, fwd_tile(kHeadDim_).num_warps * 32>;
  using typename Base::Element;
  using typename Base::SmemLayoutAtom;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = fwd_tile(kHeadDim).block_m;
  static constexpr int kBlockN = fwd_tile(kHeadDim).block_n;
  static constexpr int kNWarps = fwd_tile(kHeadDim).num_warps;
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
};

template <typename Element_, int kHeadDim_>
struct BwdTraits
    : BaseTraits<Element_, kHeadDim_, bwd_tile(kHeadDim_).num_warps * 32> {
  using Base = BaseTraits<Element_, kHeadDim_, bwd_tile(kHeadDim_).num_warps * 32>;
  using typename Base::Element;
  using typename Base::SmemLayoutAtom;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = bwd_tile(kHeadDim).block_m;
  static constexpr int kBlockN = bwd_tile(kHeadDim).block_n;
  static constexpr int kNWarps = bwd_tile(kHeadDim).num_warps;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kQStages = bwd_tile(kHeadDim).q_stages;
  static_assert(kNWarps == 8 && kBlockM == 64, "the warp layouts below assume 8 warps, block_m 64");

  // S = Q K^T and dP = dO V^T: (block_m x block_n), warps 2 (M) x 4 (N).
  using TiledMmaSdP = TiledMMA<MmaAtom16816<Element>, Layout<Shape<_2, _4, _1>>,
                               Tile<Int<16 * 2>, Int<16 * 4>, _16>>;
  // dK += dS^T Q and dV += P^T dO: (block_n x head_dim), warps 4 (N) x 2 (D).
  using TiledMmadKV = TiledMMA<MmaAtom16816<Element>, Layout<Shape<_4, _2, _1>>,
                               Tile<Int<16 * 4>, Int<16 * 2>, _16>>;
  // dQ = dS K: (block_m x head_dim). Warps 2 (M) x 4 (D) give each warp a
  // 32 x 32 tile (256 B of smem per MMA, against 320 for 16 x 64) but need
  // head_dim % 64 == 0; other head dims use 4 (M) x 2 (D).
  static constexpr int kdQWarpsM = kHeadDim % 64 == 0 ? 2 : 4;
  static constexpr int kdQWarpsN = kNWarps / kdQWarpsM;
  using TiledMmadQ =
      TiledMMA<MmaAtom16816<Element>, Layout<Shape<Int<kdQWarpsM>, Int<kdQWarpsN>, _1>>,
               Tile<Int<16 * kdQWarpsM>, Int<16 * kdQWarpsN>, _16>>;

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
};

}  // namespace jflash::cuda

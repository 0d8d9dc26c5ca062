// Kernel traits: every compile-time shape and layout a kernel uses, derived
// from one entry of the tile table (tile_sizes.h).
//
// MMA: mma.sync m16n8k16 with float32 accumulation (sm80 and later); float32
// inputs: m16n8k8 TF32, one or three passes (kTf32Passes; utils.h, mma_slice).
// Shared memory: K-major tiles (head_dim contiguous) with an XOR swizzle of
// 16-byte chunks, so ldmatrix reads of 8 rows x 16 bytes hit 8 different bank
// groups (no conflicts) for both the plain and the transposed reads. There is
// no transposed ldmatrix for 32-bit elements: float32 operands that are not
// K-major are read with 32-bit loads.
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

// The float32 kernels' TF32 MMA.
using MmaAtomTf32 = MMA_Atom<SM80_16x8x8_F32TF32TF32F32_TN>;
template <typename Element>
using MmaAtomFor = std::conditional_t<sizeof(Element) == 4, MmaAtomTf32, MmaAtom16816<Element>>;

// A TF32 product's K mode permuted within each k8 block: the atom's k and k + 4
// become columns 2k and 2k + 1. The A fragment of such a product is then what
// a thread holds of an m16n8 accumulator (utils.h, acc_as_tf32_a_operand), and
// operands read with 32-bit loads (not K-major) come from rows 0, 2, 4, 6 and
// 1, 3, 5, 7, which the swizzle puts in different banks. Both operands of a
// product use it, so the sum is the same.
using Tf32KPermutation = Layout<Shape<_4, _2>, Stride<_2, _1>>;

// The K tile of a TiledMMA: the atom's K (16, or 8 for TF32), or the permuted
// TF32 block where kPermuted.
template <typename Element, bool kPermuted = false>
using MmaTileK = std::conditional_t<sizeof(Element) == 4,
                                    std::conditional_t<kPermuted, Tf32KPermutation, _8>, _16>;

// Layouts shared by the forward and the backward traits.
template <typename Element_, int kHeadDim_, int kNThreads_>
struct BaseTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kNThreads = kNThreads_;
  static constexpr bool kIsFloat32 = sizeof(Element) == 4;
  static constexpr int kElementsPer16B = 16 / int(sizeof(Element));

  // Swizzle unit: 128-byte rows (one full bank sweep: 64 16-bit columns, 32
  // float32 ones) when head_dim allows it, else 32 16-bit columns (head dims
  // 96, 160, 224). The swizzle permutes the 16-byte chunks of a row by the
  // row's index among 8.
  static constexpr int kBlockKSmem = kIsFloat32 ? 32 : (kHeadDim % 64 == 0 ? 64 : 32);
  static constexpr int kSwizzle = kIsFloat32 || kBlockKSmem == 64 ? 3 : 2;
  static constexpr int kSwizzleBase = kIsFloat32 ? 2 : 3;  // log2(elements per 16 bytes)
  using SmemLayoutAtom = decltype(composition(
      Swizzle<kSwizzle, kSwizzleBase, 3>{},
      Layout<Shape<_8, Int<kBlockKSmem>>, Stride<Int<kBlockKSmem>, _1>>{}));

  // ldmatrix: plain for K-major operands, transposed for M/N-major ones
  // (float32: 32-bit loads).
  using SmemCopyAtom = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomTransposed =
      std::conditional_t<kIsFloat32, Copy_Atom<UniversalCopy<uint32_t>, Element>,
                         Copy_Atom<SM75_U16x8_LDSM_T, Element>>;

  // cp.async of 16 bytes per thread, kBlockKSmem / kElementsPer16B threads per row.
  static constexpr int kGmemThreadsPerRow = kBlockKSmem / kElementsPer16B;
  static_assert(kNThreads % kGmemThreadsPerRow == 0);
  using GmemLayoutAtom = Layout<Shape<Int<kNThreads / kGmemThreadsPerRow>, Int<kGmemThreadsPerRow>>,
                                Stride<Int<kGmemThreadsPerRow>, _1>>;
  using GmemTiledCopy =
      decltype(make_tiled_copy(Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL<cute::uint128_t>, Element>{},
                               GmemLayoutAtom{}, Layout<Shape<_1, Int<kElementsPer16B>>>{}));
};

// kSmem picks the column of the tile table (tile_sizes.h); float32 has one.
// kTf32Passes: float32's MMA passes (1 TF32, 3 3xTF32; ignored otherwise).
template <typename Element_, int kHeadDim_, SmemClass kSmem = SmemClass::kLarge,
          int kTf32Passes_ = 1>
struct FwdTraitsSm80
    : BaseTraits<Element_, kHeadDim_,
                 fwd_tile(kHeadDim_, kSmem, sizeof(Element_)).num_warps * 32> {
  using Base =
      BaseTraits<Element_, kHeadDim_, fwd_tile(kHeadDim_, kSmem, sizeof(Element_)).num_warps * 32>;
  using typename Base::Element;
  using typename Base::SmemLayoutAtom;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kTf32Passes = kTf32Passes_;
  static_assert(kSmem == SmemClass::kLarge || !Base::kIsFloat32);
  static constexpr FwdTile kTile = fwd_tile(kHeadDim, kSmem, sizeof(Element));
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kNWarps = kTile.num_warps;
  static constexpr int kNThreads = kNWarps * 32;

  // Warps stack along M: each warp owns whole query rows, so the softmax row
  // reductions stay inside a quad of lanes (no shared memory).
  using TiledMma = TiledMMA<MmaAtomFor<Element>, Layout<Shape<Int<kNWarps>, _1, _1>>,
                            Tile<Int<16 * kNWarps>, _16, MmaTileK<Element>>>;
  // O += P V: float32 permutes K, so that P is read in place (MmaTileK).
  using TiledMmaPV = TiledMMA<MmaAtomFor<Element>, Layout<Shape<Int<kNWarps>, _1, _1>>,
                              Tile<Int<16 * kNWarps>, _16, MmaTileK<Element, true>>>;

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
  static_assert(kSmemBytes == fwd_smem_bytes(kTile, kHeadDim, sizeof(Element)));
  static_assert(kSmem == SmemClass::kLarge || kSmemBytes <= kSmallSmemBytes);
};

template <typename Element_, int kHeadDim_, SmemClass kSmem = SmemClass::kLarge,
          int kTf32Passes_ = 1>
struct BwdTraitsSm80
    : BaseTraits<Element_, kHeadDim_,
                 bwd_tile(kHeadDim_, kSmem, sizeof(Element_)).num_warps * 32> {
  using Base =
      BaseTraits<Element_, kHeadDim_, bwd_tile(kHeadDim_, kSmem, sizeof(Element_)).num_warps * 32>;
  using typename Base::Element;
  using typename Base::SmemLayoutAtom;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kTf32Passes = kTf32Passes_;
  static_assert(kSmem == SmemClass::kLarge || !Base::kIsFloat32);
  static constexpr BwdTile kTile = bwd_tile(kHeadDim, kSmem, sizeof(Element));
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
      TiledMMA<MmaAtomFor<Element>, Layout<Shape<Int<kSdPWarpsM>, Int<kSdPWarpsN>, _1>>,
               Tile<Int<16 * kSdPWarpsM>, Int<16 * kSdPWarpsN>, MmaTileK<Element>>>;
  // dK += dS^T Q and dV += P^T dO: (block_n x head_dim). Float32 reads both
  // operands with 32-bit loads, and permutes K to spread them over the banks.
  using TiledMmadKV =
      TiledMMA<MmaAtomFor<Element>, Layout<Shape<Int<kdKVWarpsN>, Int<kdKVWarpsD>, _1>>,
               Tile<Int<16 * kdKVWarpsN>, Int<16 * kdKVWarpsD>, MmaTileK<Element, true>>>;
  // dQ = dS K: (block_m x head_dim).
  using TiledMmadQ =
      TiledMMA<MmaAtomFor<Element>, Layout<Shape<Int<kdQWarpsM>, Int<kdQWarpsD>, _1>>,
               Tile<Int<16 * kdQWarpsM>, Int<16 * kdQWarpsD>, MmaTileK<Element>>>;

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

  // P and dS (block_m x block_n), written from the S/dP accumulators
  // (float32: 128-byte rows of 32 columns, like the other tiles).
  static constexpr int kBlockNSmemPdS = Base::kIsFloat32 ? 32 : (kBlockN % 64 == 0 ? 64 : 32);
  using SmemLayoutAtomPdS = decltype(composition(
      Swizzle<Base::kIsFloat32 || kBlockNSmemPdS == 64 ? 3 : 2, Base::kSwizzleBase, 3>{},
      Layout<Shape<_8, Int<kBlockNSmemPdS>>, Stride<Int<kBlockNSmemPdS>, _1>>{}));
  using SmemLayoutPdS =
      decltype(tile_to_shape(SmemLayoutAtomPdS{}, Shape<Int<kBlockM>, Int<kBlockN>>{}));
  // P^T and dS^T (block_n x block_m): A operands of dV and dK.
  using SmemLayoutPdSt = decltype(composition(
      SmemLayoutPdS{}, make_layout(Shape<Int<kBlockN>, Int<kBlockM>>{}, GenRowMajor{})));
  using SmemLayoutPdStNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutPdSt{}));
  // Two adjacent columns per store.
  using SmemCopyAtomPdS =
      Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<2 * 8 * int(sizeof(Element))>, Element>;

  static constexpr int kSmemBytes =
      (2 * kQStages * size(SmemLayoutQ{}) + 2 * size(SmemLayoutKV{}) +
       2 * size(SmemLayoutPdS{})) *
      int(sizeof(Element));
  static_assert(kSmemBytes == bwd_smem_bytes(kTile, kHeadDim, sizeof(Element)));
  static_assert(kSmem == SmemClass::kLarge || kSmemBytes <= kSmallSmemBytes);
};

}  // namespace jflash::cuda

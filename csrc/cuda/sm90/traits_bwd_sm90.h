// The Hopper backward's compile-time shapes: tile, wgmma atoms, shared-memory
// layouts (and their transposed views), TMA types and shared storage, all
// derived from one entry of the tile table (tile_sizes.h: sm90_bwd_tile, per
// head dim, mask kind and score kind), and the kernel's arguments.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>
// CuTe's wgmma shapes whose N is not a power of two or 96 / 192 (here N =
// 80). Its op selectors offer them only when CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
// is defined for the whole translation unit; ss_op below picks them alone.
// (About 5 s of parsing per translation unit: here, not in the forward's.)
#include <cute/arch/mma_sm90_gmma_ext.hpp>
#include <cute/atom/mma_traits_sm90_gmma_ext.hpp>

#include "cuda/tile_sizes.h"
#include "jflash/mask.h"
#include "jflash/params.h"
#include "jflash/score.h"

namespace jflash::cuda::sm90 {

using namespace cute;

// The wgmma atom of a product with both operands in shared memory and a
// float32 accumulator: CuTe's selector, except for N = 80, which it would
// split into five 64 x 16 atoms (five instructions, each reading A again).
template <typename Element, typename TileShape, GMMA::Major kMajorA = GMMA::Major::K,
          GMMA::Major kMajorB = GMMA::Major::K>
constexpr auto ss_op() {
  if constexpr (size<1>(TileShape{}) == 80) {
    static_assert(size<2>(TileShape{}) % 16 == 0);
    if constexpr (std::is_same_v<Element, cutlass::bfloat16_t>) {
      return SM90::GMMA::MMA_64x80x16_F32BF16BF16_SS<kMajorA, kMajorB>{};
    } else {
      static_assert(std::is_same_v<Element, cutlass::half_t>);
      return SM90::GMMA::MMA_64x80x16_F32F16F16_SS<kMajorA, kMajorB>{};
    }
  } else {
    return GMMA::ss_op_selector<Element, Element, float, TileShape, kMajorA, kMajorB>();
  }
}

// kOrdered: the variant that deterministic calls launch (sm90_bwd_tile's
// `ordered`), for instantiations whose default tile has kDqOwnKeys.
template <typename Element_, int kHeadDim_, MaskKind kMaskKind,
          ScoreKind kScoreKind = ScoreKind::kPlain, bool kOrdered = false>
struct BwdTraitsSm90 {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr Sm90BwdTile kTile = sm90_bwd_tile(kHeadDim, kMaskKind, kScoreKind, kOrdered);
  static_assert(kTile.block_m > 0, "no sm90 backward tile for this head dim");
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kStages = kTile.q_stages;
  // The consumers split the columns of every product (P^T and dS^T through
  // shared memory) rather than the keys (tile_sizes.h, Sm90BwdTile).
  static constexpr bool kPdSShared = kTile.p_ds_shared;
  static constexpr int kDqBuffers = kTile.dq_buffers;
  // dQ^T = K^T dS^T rather than dQ = dS K (tile_sizes.h, Sm90BwdTile).
  static constexpr bool kDqTransposed = kTile.dq_transposed;
  static_assert(kDqTransposed ? kBlockM % 16 == 0 : kBlockM % 64 == 0,
                "block_m: wgmma's M (64) for dQ = dS K, its K step (16) for dV and dK");
  static_assert(!(kDqTransposed && kPdSShared), "dQ^T is written for the key split only");
  // dQ over each consumer's own keys (tile_sizes.h, Sm90BwdTile): the
  // consumers share no dS, and take turns at the tensor cores.
  static constexpr bool kDqOwnKeys = kTile.dq_own_keys;
  // Steps' units through a cursor (tile_sizes.h, Sm90BwdTile::step_cursor).
  static constexpr bool kStepCursor = kTile.step_cursor;
  static_assert(!(kDqOwnKeys && (kPdSShared || kDqTransposed)),
                "dQ over own keys: dQ = dS K with the key split");
  static_assert(!(kDqOwnKeys && kOrdered),
                "deterministic calls: both consumers' dQ of a key block in one ordered add");
  static_assert(!kDqOwnKeys || kHeadDim * sizeof(Element) == 128,
                "dQ over own keys reads a consumer's keys as a K tile of their own: "
                "rows of one 128-byte swizzle atom");
  // Two consumers: the register budget below assumes them.
  static constexpr int kConsumerWarpgroups = 2;
  static_assert(kBlockN == (kPdSShared ? 64 : 64 * kConsumerWarpgroups),
                "64 keys per consumer, or 64 shared by both");
  static constexpr int kConsumerThreads = 128 * kConsumerWarpgroups;
  static constexpr int kNThreads = 128 + kConsumerThreads;
  // setmaxnreg: 24 * 128 + 240 * 256 is all the launch allocates at 384
  // threads (168 per thread; tile_sizes.h, sm90_register_split_fits).
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = 240;
  static_assert(
      sm90_register_split_fits(kProducerRegisters, kConsumerRegisters, kConsumerThreads));
  // The threads that share a dS tile (and a barrier before the dQ product):
  // one consumer with kDqOwnKeys, else all of them. They load a step's lse
  // and delta together, kRowStatLoads values each; with kDqOwnKeys each
  // consumer keeps its own copy of them.
  static constexpr int kDsThreads = kDqOwnKeys ? 128 : kConsumerThreads;
  static constexpr int kRowStatLoads = (2 * kBlockM + kDsThreads - 1) / kDsThreads;
  static constexpr int kRowStatCopies = kDqOwnKeys ? kConsumerWarpgroups : 1;
  static_assert(kDqOwnKeys || kRowStatLoads == 1, "a consumer thread per row loads lse or delta");
  // Keys of a dS tile, the dS tiles and the buffers of each: two, so that
  // one consumer may write the next step's dS while the other still reads
  // this one; one with kDqOwnKeys, where a consumer writes its next dS only
  // after its own dQ product has read this one.
  static constexpr int kDsKeys = kDqOwnKeys ? 64 : kBlockN;
  static constexpr int kDsTiles = kDqOwnKeys ? kConsumerWarpgroups : 1;
  static constexpr int kDsBuffers = kDqOwnKeys ? 1 : 2;

  // Consumer warpgroups along M (keys) or N (query or head-dim columns).
  using AlongM = Layout<Shape<Int<kConsumerWarpgroups>, _1, _1>>;
  using AlongN = Layout<Shape<_1, Int<kConsumerWarpgroups>, _1>>;
  // How the consumers share S^T, dP^T, dV and dK: by keys, or by columns.
  using ConsumerSplit = std::conditional_t<kPdSShared, AlongN, AlongM>;
  // Each consumer's share of N in the S^T, dP^T and the dV, dK products.
  static constexpr int kSdPCols = kPdSShared ? kBlockM / kConsumerWarpgroups : kBlockM;
  static constexpr int kdKVCols = kPdSShared ? kHeadDim / kConsumerWarpgroups : kHeadDim;
  // Registers per consumer thread at the peak of a step, besides the row
  // statistics and the loop's own state: dK and dV (kdKVCols floats), S^T
  // and dP^T (kSdPCols / 2 floats each; one is in flight while the other is
  // used) and kSdPCols / 4 more, P^T's 16-bit copy, which dV += P^T dO reads
  // while dS^T is computed. 208 at head dim 128 and block_m 64, 224 at head
  // dim 64 and block_m 128, 228 at head dim 128 and block_m 80. (With
  // kPdSShared, P^T goes through shared memory.)
  static constexpr int kPeakRegisters = kdKVCols + kSdPCols + kSdPCols / 4;
  // Past 240 - 16 (16 for addresses, indices and the next step's row
  // statistic), a step is ordered for registers rather than overlap: dV +=
  // P^T dO is issued after dK += dS^T Q instead of before dS^T is computed,
  // and the lse and delta of a thread's query columns are spread over the 8
  // lanes that share them (SharedColumnStat in the kernel: a shuffle per use
  // instead of kSdPCols / 4 registers each). ptxas at block_m 80: 24 bytes
  // of spill with dV issued between dS^T and dK, 12 to 16 with the shared lse
  // and delta as well, 8 with dV after dK alone, none with both.
  static constexpr bool kTightRegisters =
      !kPdSShared && kPeakRegisters > kConsumerRegisters - 16;
  // Segment ids on the register-tight step, masked late (kLateMask in the
  // main loop): whether a step's tile needs the mask at all (its class from
  // the ids' block summaries) is found by the producer as it loads the step's
  // Q and dO and handed over in shared memory (step_masked below). Asked by
  // the consumers themselves, the summaries' dependent loads and 64-bit
  // arithmetic ran 38% more instructions than the unmasked kernel. Head dim
  // 64's segment kernels (not masked late) skip their keys' row ranges on
  // full tiles by the same flag, except with softcap (its own P^T operand
  // left no registers for it there).
  static constexpr bool kStepMaskFlags =
      kMaskKind == MaskKind::kSegments && !kPdSShared &&
      (kScoreKind != ScoreKind::kSoftcap || kTightRegisters);
  // S^T = K Q^T, dP^T = V dO^T: M = block_n, N = block_m, K = head_dim; both K-major.
  using TiledMmaSdP = decltype(make_tiled_mma(
      ss_op<Element, Shape<_64, Int<kSdPCols>, Int<kHeadDim>>>(), ConsumerSplit{}));
  // One consumer's part of it (its threads' accumulators are the same): the
  // shape of its dS tile with kDqOwnKeys.
  using TiledMmaSdPOwn =
      decltype(make_tiled_mma(ss_op<Element, Shape<_64, Int<kSdPCols>, Int<kHeadDim>>>()));
  // dV += P^T dO, dK += dS^T Q: M = block_n, N = head_dim, K = block_m; B (dO,
  // Q as head_dim x block_m) MN-major: head_dim is contiguous. A from
  // registers, or with kPdSShared from the P^T and dS^T buffers (K-major: the
  // query rows are contiguous there).
  using dKVAtomShape = Shape<_64, Int<kdKVCols>, Int<kBlockM>>;
  using TiledMmadKV = decltype(make_tiled_mma(
      std::conditional_t<
          kPdSShared,
          decltype(GMMA::ss_op_selector<Element, Element, float, dKVAtomShape, GMMA::Major::K,
                                        GMMA::Major::MN>()),
          decltype(GMMA::rs_op_selector<Element, Element, float, dKVAtomShape, GMMA::Major::K,
                                        GMMA::Major::MN>())>{},
      ConsumerSplit{}));
  // dQ = dS K: M = block_m, N = head_dim, K = block_n; dS stored with the
  // query rows contiguous and K read as head_dim x block_n: both MN-major.
  // The consumers split N (head-dim columns), or with kDqSplitRows M (query
  // rows): where each consumer's rows are still wgmma's M of 64 (block_m
  // 128), a consumer's instructions then read K once per k-step instead of
  // once per 64 rows, 32 KB of dS and K per consumer and step against 48 KB
  // at head dim 64 (docs/hopper_backward.md, Floors and Next), for the same
  // accumulator floats per thread.
  // dQ^T = K^T dS^T: M = head_dim, N = block_m, K = block_n; the same two
  // views of K and dS as A and B, both MN-major still (wgmma transposes
  // 16-bit operands in shared memory). The consumers split M (head-dim rows).
  // With kDqOwnKeys: dQ = dS_c K_c, M = block_m, N = head_dim, K = the
  // consumer's 64 keys, one warpgroup's product.
  static constexpr bool kDqSplitRows =
      !kDqOwnKeys && !kDqTransposed && !kPdSShared && kBlockM == 64 * kConsumerWarpgroups;
  static constexpr auto make_tiled_mma_dq() {
    if constexpr (kDqSplitRows) {
      return make_tiled_mma(
          GMMA::ss_op_selector<Element, Element, float,
                               Shape<_64, Int<kHeadDim>, Int<kBlockN>>, GMMA::Major::MN,
                               GMMA::Major::MN>(),
          AlongM{});
    } else if constexpr (kDqOwnKeys) {
      return make_tiled_mma(
          GMMA::ss_op_selector<Element, Element, float,
                               Shape<Int<kBlockM>, Int<kHeadDim>, Int<kDsKeys>>,
                               GMMA::Major::MN, GMMA::Major::MN>());
    } else if constexpr (kDqTransposed) {
      return make_tiled_mma(
          ss_op<Element, Shape<_64, Int<kBlockM>, Int<kBlockN>>, GMMA::Major::MN,
                GMMA::Major::MN>(),
          AlongM{});
    } else {
      return make_tiled_mma(
          GMMA::ss_op_selector<Element, Element, float,
                               Shape<Int<kBlockM>, Int<kHeadDim / kConsumerWarpgroups>,
                                     Int<kBlockN>>,
                               GMMA::Major::MN, GMMA::Major::MN>(),
          AlongN{});
    }
  }
  using TiledMmadQ = decltype(make_tiled_mma_dq());
  // The dQ accumulator's (M, N): (block_m, head_dim), or its transpose.
  using dQAccShape = std::conditional_t<kDqTransposed, Shape<Int<kHeadDim>, Int<kBlockM>>,
                                        Shape<Int<kBlockM>, Int<kHeadDim>>>;

  // 128-byte swizzled layouts that both TMA and wgmma understand.
  using SmemLayoutQ = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                             Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutK = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                             Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // dS (block_m x block_n), query rows contiguous, as the stmatrix of dS^T
  // from its accumulator layout writes it, kDsBuffers buffers. P^T with
  // kPdSShared alike (two buffers). The widest swizzle whose span of query rows (64,
  // 32 or 16 of them) divides block_m: every one keeps stmatrix's eight
  // 16-byte rows (keys) of a matrix in distinct banks.
  using SmemLayoutdSAtom = std::conditional_t<
      kBlockM % 64 == 0, GMMA::Layout_MN_SW128_Atom<Element>,
      std::conditional_t<kBlockM % 32 == 0, GMMA::Layout_MN_SW64_Atom<Element>,
                         GMMA::Layout_MN_SW32_Atom<Element>>>;
  // With kDqOwnKeys, one such tile (of its 64 keys) per consumer.
  using SmemLayoutdS =
      decltype(tile_to_shape(SmemLayoutdSAtom{},
                             Shape<Int<kBlockM>, Int<kDsKeys>, Int<kDsBuffers>>{}));
  // Transposed views of the same memory (element (d, m) of Q^T is (m, d) of Q).
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kStages>>{},
                                 Stride<Int<kBlockM>, _1, Int<kBlockM * kHeadDim>>{})));
  // K^T as the dQ product reads it: the dS tile's keys (with kDqOwnKeys the
  // consumer's 64, a K tile of their own from row 64 c: K's rows are one
  // swizzle atom wide, so its row blocks follow each other).
  using SmemLayoutKt = decltype(composition(
      tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{}, Shape<Int<kDsKeys>, Int<kHeadDim>>{}),
      make_layout(Shape<Int<kHeadDim>, Int<kDsKeys>>{}, Stride<Int<kDsKeys>, _1>{})));
  using SmemLayoutdSt = decltype(composition(
      SmemLayoutdS{}, make_layout(Shape<Int<kDsKeys>, Int<kBlockM>, Int<kDsBuffers>>{},
                                  Stride<Int<kBlockM>, _1, Int<kBlockM * kDsKeys>>{})));
  // stmatrix of a consumer's dS^T accumulator rows into the dS buffer.
  using SmemCopydS =
      decltype(make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{},
                                 std::conditional_t<kDqOwnKeys, TiledMmaSdPOwn, TiledMmaSdP>{}));

  // Each consumer's dQ tile (block_m x head_dim / consumers floats, or with
  // kDqOwnKeys the whole block_m x head_dim of its keys) goes through shared
  // memory to a TMA reduce-add into dq_accum: the tensor-memory unit does the
  // float32 additions in L2 asynchronously, in place of 8-byte atomics from
  // every consumer thread.
  // With two buffers per consumer, a step writes one while the previous
  // step's reduce may still be reading the other.
  // A consumer's slice: kDqRows x kDqCols (with kDqSplitRows its rows of the
  // tile, all head-dim columns).
  static constexpr int kDqRows = kDqSplitRows ? kBlockM / kConsumerWarpgroups : kBlockM;
  static constexpr int kDqCols =
      kDqOwnKeys || kDqSplitRows ? kHeadDim : kHeadDim / kConsumerWarpgroups;
  using SmemLayoutdQ = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<float>{},
                                              Shape<Int<kDqRows>, Int<kDqCols>,
                                                    Int<kConsumerWarpgroups>, Int<kDqBuffers>>{}));
  // With kDqSplitRows, the staging buffers as the block_m x head_dim tile:
  // element ((r, c), d, buffer) is (r, d, c, buffer) of SmemLayoutdQ, so
  // consumer c's rows land in its own slice.
  using SmemLayoutdQRows = decltype(composition(
      SmemLayoutdQ{},
      make_layout(Shape<Shape<Int<kDqRows>, Int<kConsumerWarpgroups>>, Int<kDqCols>,
                        Int<kDqBuffers>>{},
                  Stride<Stride<_1, Int<kDqRows * kDqCols>>, Int<kDqRows>,
                         Int<kDqRows * kDqCols * kConsumerWarpgroups>>{})));
  // The staging buffers as the transposed dQ^T accumulator sees them: element
  // (d, m, buffer) is (m, d % kDqCols, d / kDqCols, buffer) of SmemLayoutdQ,
  // so each consumer's head-dim rows land in its own slice. A thread's
  // accumulator pairs are adjacent query rows, 128 bytes apart here, so they
  // are stored one float at a time; a warp's store then covers 4 query rows
  // (one per lane % 4) by 8 head-dim columns (one per lane / 4), and the
  // swizzle (16-byte chunk ^= row % 8) spreads those over all 32 banks.
  using SmemLayoutdQt = decltype(composition(
      SmemLayoutdQ{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kDqBuffers>>{},
                                  Stride<Int<kBlockM>, _1, Int<kBlockM * kHeadDim>>{})));

  // Global views the TMA descriptors are built from, [seq, head_dim, heads, batch].
  using GmemShape = Shape<int32_t, int32_t, int32_t, int32_t>;
  using GmemStride = Stride<int64_t, _1, int64_t, int64_t>;
  template <typename SmemLayout, typename TileShape>
  using Tma = decltype(make_tma_atom(
      SM90_TMA_LOAD{},
      make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemShape{}, GmemStride{}),
      SmemLayout{}, TileShape{}));
  using TmaQ = Tma<decltype(take<0, 2>(SmemLayoutQ{})), Shape<Int<kBlockM>, Int<kHeadDim>>>;
  using TmaK = Tma<SmemLayoutK, Shape<Int<kBlockN>, Int<kHeadDim>>>;
  // dK and dV leave through the K and V buffers, free once both consumers'
  // last products have read them: stmatrix from the accumulators, then one
  // TMA store per tile (epilogue_bwd_sm90.h, stage_dk_dv). Head dim 256
  // (kPdSShared) under a mask keeps each thread's direct stores: there the
  // staging measured 2.8% slower at causal 4k (docs/hopper_backward.md).
  static constexpr bool kDkvThroughSmem = !kPdSShared || kMaskKind == MaskKind::kNone;
  using SmemCopydKV =
      decltype(make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, TiledMmadKV{}));
  using TmaStoreK = decltype(make_tma_atom(
      SM90_TMA_STORE{},
      make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)), GmemShape{}, GmemStride{}),
      SmemLayoutK{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // Where the kernel adds float32 dK and dV into dkv_accum instead
  // (BwdParams::adds_dkv: split GQA groups, the caller's sums): dK's tile
  // staged over the K and V buffers, dV's over the Q and dO ring, each added
  // by one TMA reduce-add.
  using SmemLayoutdKVAccum = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<float>{},
                                                    Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  static_assert(cosize_v<SmemLayoutdKVAccum> * sizeof(float) <=
                    2 * cosize_v<SmemLayoutK> * sizeof(Element) &&
                cosize_v<SmemLayoutdKVAccum> * sizeof(float) <=
                    2 * cosize_v<SmemLayoutQ> * sizeof(Element));
  // A thread's float32 pair dr rows and dc columns past its first element
  // (stage_dk_dv): at dkv_accum_offset floats from the address of its first
  // row and column + 8 * dkv_accum_base. The swizzle XORs a row's 16-byte
  // chunk index with row % 8, the same for all of a thread's rows (8 apart),
  // so only the chunk of the first 32 columns (four bases) varies; rows 8
  // apart and columns 32 apart are whole swizzle periods.
  // tools/check_dkv_addresses.cu checks both against CuTe's partition.
  CUTE_HOST_DEVICE static constexpr int dkv_accum_base(int dc) { return dc / 8 % 4; }
  CUTE_HOST_DEVICE static constexpr int dkv_accum_offset(int dr, int dc) {
    constexpr auto plain = get_nonswizzle_portion(SmemLayoutdKVAccum{});
    return plain(dr, dc - 8 * dkv_accum_base(dc)) - plain(0, 0);
  }
  using TmadKVAccum = decltype(make_tma_atom(
      SM90_TMA_REDUCE_ADD{},
      make_tensor(make_gmem_ptr(static_cast<float*>(nullptr)), GmemShape{}, GmemStride{}),
      SmemLayoutdKVAccum{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using TmadQ = decltype(make_tma_atom(
      SM90_TMA_REDUCE_ADD{},
      make_tensor(make_gmem_ptr(static_cast<float*>(nullptr)), GmemShape{}, GmemStride{}),
      take<0, 2>(SmemLayoutdQ{}), Shape<Int<kDqRows>, Int<kDqCols>>{}));

  // The call's head dim may be below kHeadDim (head_dims.h,
  // sm90_kernel_head_dim): the loads fill the columns past it with zeros, the
  // dQ reduce-add clips them, and the dK, dV writes bound them.
  CUTE_HOST_DEVICE static auto shape_q(const BwdParams& p) {
    return make_shape(p.seqlen_q, int32_t{p.head_dim}, p.num_heads, p.batch);
  }
  CUTE_HOST_DEVICE static auto shape_k(const BwdParams& p) {
    return make_shape(p.seqlen_k, int32_t{p.head_dim}, p.num_heads_kv, p.batch);
  }

  static constexpr uint32_t kQBytes = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kKBytes = kBlockN * kHeadDim * sizeof(Element);

  // P^T's buffers: only with kPdSShared (an empty member otherwise, after the
  // rest, so the other buffers keep their offsets).
  struct alignas(1024) PBuffers {
    cute::ArrayEngine<Element, cosize_v<SmemLayoutdS>> data;
    CUTE_DEVICE Element* begin() { return data.begin(); }
  };
  struct NoPBuffers {
    CUTE_DEVICE Element* begin() { return nullptr; }
  };
  // kStepMaskFlags: per Q/dO buffer, whether its step's tile is masked.
  struct StepMasks {
    int32_t at[kStages];
  };
  struct NoStepMasks {};


  struct SharedStorage {
    // 1024-byte alignment: the period of the 128-byte swizzle.
    alignas(1024) cute::ArrayEngine<Element, cosize_v<SmemLayoutK>> k;
    alignas(1024) cute::ArrayEngine<Element, cosize_v<SmemLayoutK>> v;
    alignas(1024) cute::ArrayEngine<Element, cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::ArrayEngine<Element, cosize_v<SmemLayoutQ>> dout;
    alignas(1024) cute::ArrayEngine<Element, kDsTiles * cosize_v<SmemLayoutdS>> ds;
    alignas(1024) cute::ArrayEngine<float, cosize_v<SmemLayoutdQ>> dq;
    // lse in the log2 domain and delta of a step's query rows, two buffers
    // (the consumer section of the kernel says who writes them when).
    alignas(16) float lse_log2[kRowStatCopies][2][kBlockM];
    alignas(16) float delta[kRowStatCopies][2][kBlockM];
    alignas(8) uint64_t kv_full;
    uint64_t qdo_full[kStages];
    uint64_t qdo_empty[kStages];
    // Per consumer and dQ staging buffer: staged (its four warps arrive) and
    // read out by the TMA (its writer arrives).
    uint64_t dq_full[kConsumerWarpgroups][kDqBuffers];
    uint64_t dq_empty[kConsumerWarpgroups][kDqBuffers];
    // dK and dV staged in the K and V buffers (every consumer warp arrives).
    uint64_t dkv_full;
    std::conditional_t<kPdSShared, PBuffers, NoPBuffers> p;
    std::conditional_t<kStepMaskFlags, StepMasks, NoStepMasks> step_masked;
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= 227 * 1024);
};

// The shared memory that a launch of an instantiation may take: with
// kDqOwnKeys its deterministic calls run the kOrdered variant.
template <typename Element, int kHeadDim, MaskKind kMaskKind,
          ScoreKind kScoreKind = ScoreKind::kPlain>
constexpr int bwd_launch_smem_bytes_sm90() {
  using Default = BwdTraitsSm90<Element, kHeadDim, kMaskKind, kScoreKind>;
  if constexpr (Default::kDqOwnKeys) {
    constexpr int kOrdered =
        BwdTraitsSm90<Element, kHeadDim, kMaskKind, kScoreKind, true>::kSmemBytes;
    return Default::kSmemBytes > kOrdered ? Default::kSmemBytes : kOrdered;
  } else {
    return Default::kSmemBytes;
  }
}

// The kernel's parameters: the plain BwdParams plus the TMA descriptors built
// from them on the host (passed by value, as __grid_constant__).
template <typename Traits>
struct BwdArgsSm90 {
  BwdParams params;
  typename Traits::TmaQ tma_q;
  typename Traits::TmaQ tma_dout;
  typename Traits::TmaK tma_k;
  typename Traits::TmaK tma_v;
  typename Traits::TmadQ tma_dq;  // reduce-add into dq_accum, [seqlen_q, head_dim, heads, batch]
  typename Traits::TmaStoreK tma_dk;  // stores into dk and dv, [seqlen_k, head_dim, heads_kv, batch]
  typename Traits::TmaStoreK tma_dv;
  // reduce-adds into dkv_accum's dK and dV planes (BwdParams::adds_dkv)
  typename Traits::TmadKVAccum tma_dk_accum;
  typename Traits::TmadKVAccum tma_dv_accum;
};

// The TMA partitions (global, shared) of a key block's block_n x head_dim
// tile of a [seqlen_k, head_dim, heads_kv, batch] tensor and its shared
// tile: the K and V loads, the dK and dV stores.
template <typename Traits, typename TmaAtom, typename SmemTile>
CUTE_DEVICE auto key_block_tma_partition(const TmaAtom& tma, const SmemTile& smem_tile,
                                         const BwdParams& params, int n_block, int kv_head,
                                         int batch) {
  Tensor m = tma.get_tma_tensor(Traits::shape_k(params));
  Tensor g = local_tile(m(_, _, kv_head, batch),
                        Shape<Int<Traits::kBlockN>, Int<Traits::kHeadDim>>{},
                        make_coord(n_block, 0));
  return tma_partition(tma, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(smem_tile),
                       group_modes<0, 2>(g));
}

}  // namespace jflash::cuda::sm90

// The Hopper forward's epilogue: O /= rowsum and lse, then O stored, by each
// consumer warpgroup for its 64 rows of a tile (the producer is already
// loading the next tile).
#pragma once

#include <cstdint>
#include <utility>

#include <cute/tensor.hpp>

#include "cuda/sm90/named_barriers_sm90.h"
#include "cuda/sm90/traits_fwd_sm90.h"
#include "cuda/sm90/wgmma_utils.h"
#include "cuda/utils.h"

namespace jflash::cuda::sm90 {

using namespace cute;

// Where Traits::kSmemEpilogue, O goes through this warpgroup's slab of shared
// memory (stmatrix) to a TMA store (the traits say why); otherwise (head dim
// 256) it is stored from registers. Either way only the call's head_dim
// columns are stored (the TMA clips them; the register store bounds them).
template <typename Traits>
struct FwdEpilogueSm90 {
  using Element = typename Traits::Element;
  using SharedStorage = typename Traits::SharedStorage;
  using Barriers = FwdNamedBarriersSm90<Traits::kConsumerWarpgroups, Traits::kPingPong>;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kHeadDim = Traits::kHeadDim;
  using ThrMmaPV = decltype(typename Traits::TiledMmaPV{}.get_thread_slice(0));
  using SmemO = decltype(make_tensor(make_smem_ptr(static_cast<Element*>(nullptr)),
                                     typename Traits::SmemLayoutO{})(_, _, 0));
  using ThrCopyO = decltype(typename Traits::SmemCopyO{}.get_thread_slice(0));

  const FwdArgsSm90<Traits>& args;
  const int tidx;      // 0 .. kConsumerThreads - 1
  const int consumer;  // which 64 rows of the tile
  // The (row, col) coordinates of this thread's output elements in the tile.
  decltype(std::declval<ThrMmaPV&>().partition_C(
      make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}))) cO;
  // The slab of this warpgroup, its stmatrix partition, and the global output
  // (kSmemEpilogue).
  const bool store_leader;
  SmemO sO;
  typename Traits::SmemCopyO smem_copy_o;
  ThrCopyO thr_copy_o;
  decltype(std::declval<ThrCopyO&>().partition_D(std::declval<SmemO&>())) tOsO;
  decltype(std::declval<typename Traits::TmaO const&>().get_tma_tensor(
      Traits::shape_q(std::declval<const FwdParams&>()))) mO;

  __device__ __forceinline__ FwdEpilogueSm90(const FwdArgsSm90<Traits>& args_, SharedStorage& smem,
                                             int tidx_, int consumer_)
      : args(args_),
        tidx(tidx_),
        consumer(consumer_),
        cO(typename Traits::TiledMmaPV{}.get_thread_slice(tidx_).partition_C(
            make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}))),
        store_leader(tidx_ % 128 == 0),
        sO(make_tensor(make_smem_ptr(smem.o.begin()), typename Traits::SmemLayoutO{})(_, _, consumer)),
        thr_copy_o(smem_copy_o.get_thread_slice(tidx_ % 128)),
        tOsO(thr_copy_o.partition_D(sO)),
        mO(args_.tma_o.get_tma_tensor(Traits::shape_q(args_.params))) {}

  // acc_o: the P V products' accumulator of the tile; softmax: its row max
  // and sum; Mask: the kernel's mask policy (which rows see no key; under
  // segment ids, row_seen: whether each row saw a visible key, ScoreMaskSm90).
  template <typename Mask, typename Tile, typename AccO, typename Softmax>
  __device__ __forceinline__ void store(const Tile& tile, AccO& acc_o, const Softmax& softmax,
                                        const bool* row_seen = nullptr) {
    const FwdParams& params = args.params;
    Tensor o_rc = make_tensor(acc_o.data(), acc_rowcol(acc_o.layout()));
    Tensor cO_rc = make_tensor(cO.data(), acc_rowcol(cO.layout()));
    float* lse_ptr = params.lse + (int64_t(tile.batch) * params.num_heads + tile.head) * params.seqlen_q;
    if constexpr (Traits::kSmemEpilogue) {
      normalize_output(o_rc, cO_rc, softmax.row_max, softmax.row_sum, tile.row_begin,
                       params.seqlen_q, Mask(params.mask, tile.batch), params.seqlen_k, tidx % 4 == 0,
                       lse_ptr, row_seen);
      Tensor o = convert_fragment<Element>(acc_o);
      // The warpgroup's previous TMA store must have read the slab before it
      // is overwritten; TMA clips the rows past seqlen_q.
      if (store_leader) tma_store_wait<0>();
      Barriers::sync(128, Barriers::kEpilogue + consumer);
      copy(smem_copy_o, thr_copy_o.retile_S(o), tOsO);
      tma_store_fence();  // the slab's generic-proxy writes, visible to TMA
      Barriers::sync(128, Barriers::kEpilogue + consumer);
      if (store_leader) {
        Tensor gO = local_tile(mO(_, _, tile.head, tile.batch), Shape<_64, Int<kHeadDim>>{},
                               make_coord(tile.row_begin / 64 + consumer, 0));
        auto [tOgO, tOsO_tma] = tma_partition(args.tma_o, Int<0>{}, Layout<_1>{},
                                              group_modes<0, 2>(sO), group_modes<0, 2>(gO));
        copy(args.tma_o, tOsO_tma, tOgO);
        tma_store_arrive();
      }
    } else {
      store_output<Element>(acc_o, o_rc, cO, cO_rc, softmax.row_max, softmax.row_sum,
                            tile.row_begin, params.seqlen_q, Mask(params.mask, tile.batch),
                            params.seqlen_k, tidx % 4 == 0, lse_ptr,
                            static_cast<Element*>(params.out) + tile.batch * params.out_batch_stride +
                                tile.head * params.out_head_stride,
                            params.out_row_stride, params.head_dim, row_seen);
    }
  }

  // After the last tile: shared memory must outlive the last store's reads.
  __device__ __forceinline__ void finish() const {
    if constexpr (Traits::kSmemEpilogue) {
      if (store_leader) tma_store_wait<0>();
    }
  }
};

}  // namespace jflash::cuda::sm90

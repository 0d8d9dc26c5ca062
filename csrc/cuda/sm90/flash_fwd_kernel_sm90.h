// Hopper forward (sm90a): out, lse <- softmax(scale * Q K^T) V with TMA loads,
// wgmma products and warp specialization. Persistent: one CTA per SM walks a
// static sequence of work units (one query block of a head, or under a band
// one or a pair of them), or under segment ids takes them from a counter
// (tile_scheduler_sm90.h says why).
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
//                                  against the running max first; of
//                                  tanh(softcap_scale * S) with softcap,
//                                  against a fixed offset where the cap
//                                  allows it: mainloop_fwd_fixed_sm90.h)
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

#include <cstdint>
#include <type_traits>

#include <cute/arch/cluster_sm90.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/reg_reconfig.h>

#include "cuda/launch.h"
#include "cuda/sm90/epilogue_fwd_sm90.h"
#include "cuda/sm90/mainloop_fwd_fixed_sm90.h"
#include "cuda/sm90/mainloop_fwd_sm90.h"
#include "cuda/sm90/softmax_sm90.h"
#include "cuda/sm90/tile_scheduler_sm90.h"
#include "cuda/sm90/traits_fwd_sm90.h"
#include "cuda/tile_sizes.h"
#include "jflash/params.h"

namespace jflash::cuda::sm90 {

using namespace cute;

template <typename Traits, typename Mask, ScoreKind kScore, bool kFixedOffset>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    flash_fwd_sm90_kernel(const __grid_constant__ FwdArgsSm90<Traits> args) {
  using Scheduler = TileSchedulerSm90<Traits::kBlockM, Traits::kBlockN, Mask>;
  using Producer = FwdProducerSm90<Traits, Mask>;
  static_assert(!kFixedOffset || kScore == ScoreKind::kSoftcap);
  using Mainloop = std::conditional_t<kFixedOffset, FwdMainloopFixedOffsetSm90<Traits, Mask>,
                                      FwdMainloopSm90<Traits, Mask, kScore>>;
  using Epilogue = FwdEpilogueSm90<Traits>;
  const FwdParams& params = args.params;
  extern __shared__ __align__(1024) char smem_raw[];
  auto& smem = *reinterpret_cast<typename Traits::SharedStorage*>(smem_raw);
  const Scheduler scheduler(params, args.band_units);

  const int warpgroup = threadIdx.x / 128;
  if (threadIdx.x == 0) Producer::init_barriers(smem);
  if constexpr (kFixedOffset) {
    // The row sums' ones, seen by the async proxy (wgmma) after the barrier.
    constexpr int kOnes = cosize_v<typename Traits::SmemLayoutOnes>;
    for (int i = threadIdx.x; i < kOnes; i += Traits::kNThreads) {
      smem.ones.begin()[i] = typename Traits::Element(1.f);
    }
    cutlass::arch::fence_view_async_shared();
  }
  __syncthreads();

  if (warpgroup == 0) {
    // The producer gives most of its registers to the consumers; one thread
    // issues the copies.
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegisters>();
    if (threadIdx.x / 32 != 0 || !cute::elect_one_sync()) return;
    Producer{args, smem, scheduler}.run();
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegisters>();
  const int tidx = threadIdx.x - 128;  // 0 .. kConsumerThreads - 1
  const int consumer = warpgroup - 1;  // which 64 rows of the tile
  Mainloop mainloop(params, smem, tidx, consumer);
  Tensor acc_o = partition_fragment_C(typename Traits::TiledMmaPV{},
                                      Shape<Int<Traits::kBlockM>, Int<Traits::kHeadDim>>{});
  typename Mainloop::Softmax softmax(params.softmax_scale_log2);
  Epilogue epilogue(args, smem, tidx, consumer);
  int popped = 0;  // units taken from the producer (dynamic schedule)
  for (int t = scheduler.consumer_first(smem.units, popped); t < scheduler.num_slots();
       t = scheduler.consumer_next(t, smem.units, popped)) {
    const auto tile = scheduler.tile_at(t);
    if (!tile.valid) continue;
    mainloop.mma(tile, acc_o, softmax);
    if constexpr (Mask::kHasSegments) {
      epilogue.template store<Mask>(tile, acc_o, softmax, mainloop.mask.row_seen);
    } else {
      epilogue.template store<Mask>(tile, acc_o, softmax);
    }
  }
  epilogue.finish();
}

template <typename Traits, typename Mask, ScoreKind kScore>
cudaError_t launch_flash_fwd_sm90(const FwdParams& params, const LaunchContext& ctx) {
  using Element = typename Traits::Element;
  constexpr int kHeadDim = Traits::kHeadDim;
  if (!sm90_runs_head_dim<kHeadDim>(params.head_dim)) return cudaErrorInvalidValue;
  auto gmem = [](const void* ptr, auto shape, auto stride) {
    return make_tensor(make_gmem_ptr(static_cast<Element const*>(ptr)), shape, stride);
  };
  const auto shape_q = Traits::shape_q(params);
  const auto shape_k = Traits::shape_k(params);
  const auto shape_vt = Traits::shape_vt(params);
  FwdArgsSm90<Traits> args{
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
      {},  // the band's units, below
  };
  if constexpr (Traits::kSmemEpilogue) {
    args.tma_o = make_tma_atom(
        SM90_TMA_STORE{},
        make_tensor(make_gmem_ptr(static_cast<Element*>(params.out)), shape_q,
                    make_stride(params.out_row_stride, _1{}, params.out_head_stride,
                                params.out_batch_stride)),
        take<0, 2>(typename Traits::SmemLayoutO{}), Shape<_64, Int<kHeadDim>>{});
  }
  auto kernel = &flash_fwd_sm90_kernel<Traits, Mask, kScore, false>;
  // Softcap in bfloat16 takes the fixed-offset softmax where the cap allows
  // it (jflash/score.h; float16's P cannot hold its range), at head dims 128
  // and 256. Head dim 64's tile of three consumers measured level to 3%
  // slower with it (docs/cuda_kernels.md, "Softcap").
  if constexpr (kScore == ScoreKind::kSoftcap && std::is_same_v<Element, cutlass::bfloat16_t> &&
                kHeadDim >= 128) {
    if (softcap_fixed_offset_fits(params.softmax_scale_log2)) {
      kernel = &flash_fwd_sm90_kernel<Traits, Mask, kScore, true>;
    }
  }
  constexpr int kSmemBytes = Traits::kSmemBytes;
  if (cudaError_t err = cudaFuncSetAttribute(
          kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
      err != cudaSuccess) {
    return err;
  }
  const BandSchedule schedule =
      TileSchedulerSm90<Traits::kBlockM, Traits::kBlockN, Mask>::schedule(params, ctx.sm_count);
  if (schedule.num_ctas < 0) return cudaErrorInvalidValue;
  args.band_units = schedule.units;
  if constexpr (TileSchedulerSm90<Traits::kBlockM, Traits::kBlockN, Mask>::kDynamic) {
    // The dynamic schedule's counter starts at 0 in every launch.
    if (params.tile_counter == nullptr) return cudaErrorInvalidValue;
    if (cudaError_t err = cudaMemsetAsync(params.tile_counter, 0, sizeof(int), ctx.stream);
        err != cudaSuccess) {
      return err;
    }
  }
  const dim3 grid(static_cast<unsigned>(schedule.num_ctas));
  kernel<<<grid, Traits::kNThreads, kSmemBytes, ctx.stream>>>(args);
  return cudaGetLastError();
}

// The entry point of the registry: the head dim's tile, or under a band on
// short rows the short-band tile where the head dim has one. Under segment ids
// always the short-band tile where there is one: the head dim 64 tile of 192
// rows on three consumers (160 registers each) has no room for the segment
// masking (it spilled 116-164 bytes), and packed documents are short rows.
template <typename Element, int kHeadDim, typename Mask, ScoreKind kScore = ScoreKind::kPlain,
          bool kPingPong = true>
cudaError_t run_flash_fwd_sm90(const FwdParams& params, const LaunchContext& ctx) {
  using Main = FwdTraitsSm90<Element, kHeadDim, kPingPong>;
  if constexpr (!Mask::kDense && sm90_fwd_tile_short_band(kHeadDim).block_m > 0) {
    using Short = FwdTraitsSm90<Element, kHeadDim, kPingPong, /*kShortBand=*/true>;
    static_assert(Short::kSmemBytes <= Main::kSmemBytes,
                  "the registry reports the main tile's shared memory");
    if constexpr (Mask::kHasSegments) {
      return launch_flash_fwd_sm90<Short, Mask, kScore>(params, ctx);
    } else {
      if (params.seqlen_q <= kSm90ShortBandMaxLen && params.seqlen_k <= kSm90ShortBandMaxLen) {
        return launch_flash_fwd_sm90<Short, Mask, kScore>(params, ctx);
      }
      return launch_flash_fwd_sm90<Main, Mask, kScore>(params, ctx);
    }
  } else {
    return launch_flash_fwd_sm90<Main, Mask, kScore>(params, ctx);
  }
}

}  // namespace jflash::cuda::sm90

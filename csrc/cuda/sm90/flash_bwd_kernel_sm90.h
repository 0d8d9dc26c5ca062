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
//     1 + w one thread writes consumer w's dQ (write_dq), and warp 1's then
//     stores the dK and dV tiles that the consumers staged in the K and V
//     buffers (store_dk_dv_tma; Traits::kDkvThroughSmem). It gives most of
//     its registers away (setmaxnreg).
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
// Files: this one sets up a CTA (its unit, the barriers) and hands each role
// its part; mainloop_bwd_sm90.h holds the producer's loads and the consumers'
// steps, epilogue_bwd_sm90.h the dQ staging, the dQ writer and the dK, dV
// store, column_stat_sm90.h the per-column lse and delta, mask_bwd_sm90.h the
// segment ids' rows per key; traits_bwd_sm90.h the shapes and layouts.
//
// Deterministic mode (params.dq_semaphore set): each dQ reduce-add waits for
// the earlier key blocks' (KeyBlockSteps, flash_bwd_preprocess.h); the
// writers wait and count, so that the consumers see no global-memory latency.
//
// Before the main kernel, delta = rowsum(dO * O) - dlse and dq_accum = 0
// (flash_bwd_preprocess.h); after it, dq = softmax_scale * dq_accum (or the
// caller keeps dq_accum, or adds into its own with its own delta: params.h,
// DqMode).
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
#include "cuda/sm90/epilogue_bwd_sm90.h"
#include "cuda/sm90/mainloop_bwd_sm90.h"
#include "cuda/sm90/pipeline_sm90.h"
#include "cuda/sm90/tile_scheduler_sm90.h"
#include "cuda/sm90/traits_bwd_sm90.h"
#include "cuda/sm90/wgmma_utils.h"
#include "cuda/utils.h"
#include "jflash/params.h"

namespace jflash::cuda::sm90 {

using namespace cute;

template <typename Traits, typename Mask, ScoreKind kScore>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    flash_bwd_sm90_kernel(const __grid_constant__ BwdArgsSm90<Traits> args) {
  using SharedStorage = typename Traits::SharedStorage;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
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
      // Released per consumer warp, or per thread with step flags (consume).
      init_buffer_barriers(&smem.qdo_full[s], &smem.qdo_empty[s],
                           Traits::kStepMaskFlags ? Traits::kConsumerThreads
                                                  : Traits::kConsumerThreads / 32);
    }
    CUTE_UNROLL
    for (int c = 0; c < Traits::kConsumerWarpgroups; ++c) {
      CUTE_UNROLL
      for (int b = 0; b < Traits::kDqBuffers; ++b) {
        EmptyBarrier::init(&smem.dq_full[c][b], 4);  // the consumer's four warps
        EmptyBarrier::init(&smem.dq_empty[c][b], 1);  // its writer
      }
    }
    EmptyBarrier::init(&smem.dkv_full, Traits::kConsumerThreads / 32);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  Tensor sQ = make_tensor(make_smem_ptr(smem.q.begin()), typename Traits::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(smem.dout.begin()), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(smem.k.begin()), typename Traits::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(smem.v.begin()), typename Traits::SmemLayoutK{});
  const auto tiles = cute::make_tuple(sQ, sdO, sK, sV);

  if (warpgroup == 0) {
    // ---------------------------------------------------------------- producer
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegisters>();
    const int warp = threadIdx.x / 32;
    if (warp > Traits::kConsumerWarpgroups || !cute::elect_one_sync()) return;
    if (warp > 0) {
      write_dq(args, smem, steps, warp - 1, n_block, batch);
      // dK and dV, also of a key block without steps (zeros).
      if (Traits::kDkvThroughSmem && warp == 1) {
        store_dk_dv_tma(args, smem, n_block, kv_head, batch);
      }
      return;
    }
    if (steps.num_steps > 0) load_kv_qdo<Traits, Mask>(args, smem, tiles, steps, n_block, kv_head, batch);
    return;
  }

  // ------------------------------------------------------------------ consumers
  cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegisters>();
  consume<Traits, Mask, kScore>(args, smem, tiles, steps, n_block, kv_head, batch);
}

// TMA reads the four input tiles and writes dK and dV: 16-byte aligned
// bases and strides, and non-empty sequences (seqlen_q == 0 still needs dK =
// dV = 0: the sm80 backward writes them).
inline bool tma_compatible_bwd(const BwdParams& p) {
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  auto stride_ok = [](int64_t stride) { return (stride * 2) % 16 == 0; };
  auto tensor_ok = [&](const void* ptr, int64_t row, int64_t head, int64_t batch) {
    return aligned(ptr) && stride_ok(row) && stride_ok(head) && stride_ok(batch);
  };
  return tma_compatible(p) &&
         tensor_ok(p.dout, p.dout_row_stride, p.dout_head_stride, p.dout_batch_stride) &&
         tensor_ok(p.dk, p.dk_row_stride, p.dk_head_stride, p.dk_batch_stride) &&
         tensor_ok(p.dv, p.dv_row_stride, p.dv_head_stride, p.dv_batch_stride);
}

// One launch of the kernel of Traits (the default tile, or the kOrdered one:
// run_flash_bwd_sm90 below picks).
template <typename Traits, typename Mask, ScoreKind kScore>
cudaError_t launch_flash_bwd_sm90(const BwdParams& call_params, const LaunchContext& ctx) {
  using Element = typename Traits::Element;
  constexpr int kHeadDim = Traits::kHeadDim;
  using Scheduler = BwdSchedulerSm90<Traits::kBlockM, Traits::kBlockN, Mask>;
  if (!sm90_runs_head_dim<kHeadDim>(call_params.head_dim)) return cudaErrorInvalidValue;
  BwdParams params = call_params;
  const typename Scheduler::Plan plan = Scheduler::plan(params, ctx.sm_count, ctx.bwd_head_splits);
  params.head_splits = plan.head_splits;
  params.launch_group = plan.launch_group;
  const int64_t num_ctas = Scheduler::grid_size(params);
  if (num_ctas < 0) return cudaErrorInvalidConfiguration;
  if (cudaError_t err = launch_bwd_preprocess<Element, kHeadDim>(params, ctx); err != cudaSuccess) {
    return err;
  }
  // The loads of Q, dO, K, V (SM90_TMA_LOAD) and the stores of dK, dV
  // (SM90_TMA_STORE, which clip rows past seqlen_k and columns past the
  // call's head dim).
  auto tma = [](auto op, const void* ptr, auto shape, int64_t row, int64_t head, int64_t batch,
                auto smem_layout, auto tile) {
    return make_tma_atom(
        op,
        make_tensor(make_gmem_ptr(static_cast<Element const*>(ptr)), shape,
                    make_stride(row, _1{}, head, batch)),
        smem_layout, tile);
  };
  // dkv_accum at its strides (params.h, DkvMode); plane 0 dK, 1 dV. Without
  // it the descriptors, never used, are built over dq_accum so that their
  // address is a valid one.
  auto accum = [&](int plane) {
    float* base = params.dkv_accum != nullptr
                      ? params.dkv_accum + plane * params.dkv_accum_plane_stride
                      : params.dq_accum;
    return make_tma_atom(SM90_TMA_REDUCE_ADD{},
                         make_tensor(make_gmem_ptr(base), Traits::shape_k(params),
                                     make_stride(params.dkv_accum_row_stride, _1{},
                                                 params.dkv_accum_head_stride,
                                                 params.dkv_accum_batch_stride)),
                         typename Traits::SmemLayoutdKVAccum{},
                         Shape<Int<Traits::kBlockN>, Int<kHeadDim>>{});
  };
  const auto q_tile = Shape<Int<Traits::kBlockM>, Int<kHeadDim>>{};
  const auto k_tile = Shape<Int<Traits::kBlockN>, Int<kHeadDim>>{};
  const auto q_layout = take<0, 2>(typename Traits::SmemLayoutQ{});
  const auto k_layout = typename Traits::SmemLayoutK{};
  const BwdArgsSm90<Traits> args{
      params,
      tma(SM90_TMA_LOAD{}, params.q, Traits::shape_q(params), params.q_row_stride,
          params.q_head_stride, params.q_batch_stride, q_layout, q_tile),
      tma(SM90_TMA_LOAD{}, params.dout, Traits::shape_q(params), params.dout_row_stride,
          params.dout_head_stride, params.dout_batch_stride, q_layout, q_tile),
      tma(SM90_TMA_LOAD{}, params.k, Traits::shape_k(params), params.k_row_stride,
          params.k_head_stride, params.k_batch_stride, k_layout, k_tile),
      tma(SM90_TMA_LOAD{}, params.v, Traits::shape_k(params), params.v_row_stride,
          params.v_head_stride, params.v_batch_stride, k_layout, k_tile),
      // dq_accum at its strides (params.h, DqMode).
      make_tma_atom(SM90_TMA_REDUCE_ADD{},
                    make_tensor(make_gmem_ptr(params.dq_accum), Traits::shape_q(params),
                                make_stride(params.dq_accum_row_stride, _1{},
                                            params.dq_accum_head_stride,
                                            params.dq_accum_batch_stride)),
                    take<0, 2>(typename Traits::SmemLayoutdQ{}),
                    Shape<Int<Traits::kDqRows>, Int<Traits::kDqCols>>{}),
      tma(SM90_TMA_STORE{}, params.dk, Traits::shape_k(params), params.dk_row_stride,
          params.dk_head_stride, params.dk_batch_stride, k_layout, k_tile),
      tma(SM90_TMA_STORE{}, params.dv, Traits::shape_k(params), params.dv_row_stride,
          params.dv_head_stride, params.dv_batch_stride, k_layout, k_tile),
      accum(0),
      accum(1),
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

// Deterministic calls (params.dq_semaphore set) of an instantiation whose
// tile computes dQ over own keys run its kOrdered tile (tile_sizes.h,
// sm90_bwd_tile): a second kernel in those instantiations only.
template <typename Element, int kHeadDim, typename Mask, ScoreKind kScore = ScoreKind::kPlain>
cudaError_t run_flash_bwd_sm90(const BwdParams& params, const LaunchContext& ctx) {
  using Traits = BwdTraitsSm90<Element, kHeadDim, Mask::kKind, kScore>;
  if constexpr (Traits::kDqOwnKeys) {
    if (params.dq_semaphore != nullptr) {
      return launch_flash_bwd_sm90<BwdTraitsSm90<Element, kHeadDim, Mask::kKind, kScore, true>,
                                   Mask, kScore>(params, ctx);
    }
  }
  return launch_flash_bwd_sm90<Traits, Mask, kScore>(params, ctx);
}

}  // namespace jflash::cuda::sm90

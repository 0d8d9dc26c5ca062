// Backward: dq, dk, dv of flash_fwd, recomputing P from lse (FlashAttention-2,
// Algorithm 2). Three kernels on the XLA stream, after zeroing dq_accum:
//
//   1. delta[b, h, i] = sum_d dO * O - dlse        (the lse cotangent enters here:
//      dS = P * (dP - delta) is the gradient of both out and lse)
//   2. one CTA per (key block, kv head, batch); for every query head of the
//      GQA group and every query block the band lets the key block see:
//        S  = Q K^T,  P = exp2(S * scale_log2 - lse * log2 e)
//        dP = dO V^T, dS = P * (dP - delta)
//        (softcap, kScore: P of t = tanh(S * softcap_scale), dS times 1 - t^2;
//        jflash/score.h)
//        dV += P^T dO,  dK += dS^T Q      (registers, summed over the group)
//        dQ_accum += dS K                 (float32 atomics; in key-block
//                                          order in deterministic mode)
//      dK (times softmax_scale) and dV written once per kv head.
//   3. dq = softmax_scale * dQ_accum, cast and transposed to [b, s, h, d].
//
// Shared memory holds K, V (whole CTA), the Q and dO tiles of the current step
// (two buffers where the tile table allows: the next step's tiles stream in
// during the whole step), and P, dS as operands in the input dtype. float32
// inputs run the same kernel on TF32 MMAs (kernel_traits_sm80.h).
#pragma once

#include <cuda_runtime.h>

#include <cute/tensor.hpp>

#include "cuda/flash_bwd_preprocess.h"
#include "cuda/kernel_traits_sm80.h"
#include "cuda/launch.h"
#include "cuda/utils.h"
#include "jflash/params.h"

namespace jflash::cuda {

using namespace cute;

template <typename Traits, typename Mask, ScoreKind kScore>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    flash_bwd_kernel(const __grid_constant__ BwdParams params) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kQStages = Traits::kQStages;

  extern __shared__ __align__(128) char smem[];
  const int n_block = blockIdx.x;
  const int kv_head = blockIdx.y;
  const int batch = blockIdx.z;
  const int tidx = threadIdx.x;

  const int key0 = n_block * kBlockN;
  // The (query head, query block) pairs whose rows see this CTA's keys.
  const Mask mask(params.mask, batch);
  const KeyBlockSteps<kBlockM, kBlockN, Mask> steps(params, n_block, kv_head, batch);
  const int num_steps = steps.num_steps;
  static_assert(kBlockM >= kDqSemaphoreRows);  // deterministic mode's counters fit

  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)),
                          typename Traits::SmemLayoutQ{});
  // Q and dO have kQStages buffers each; the tensors below address stage 0 and
  // at_stage() shifts a view of them to another stage.
  Tensor sdO = make_tensor(sQ.data() + kQStages * size(sQ), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(sdO.data() + kQStages * size(sdO), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(sK.data() + size(sK), typename Traits::SmemLayoutKV{});
  Tensor sP = make_tensor(sV.data() + size(sV), typename Traits::SmemLayoutPdS{});
  Tensor sdS = make_tensor(sP.data() + size(sP), typename Traits::SmemLayoutPdS{});
  Tensor sQt = make_tensor(sQ.data(), typename Traits::SmemLayoutQt{});
  Tensor sQtNoSwizzle = make_tensor(sQ.data(), typename Traits::SmemLayoutQtNoSwizzle{});
  Tensor sdOt = make_tensor(sdO.data(), typename Traits::SmemLayoutQt{});
  Tensor sdOtNoSwizzle = make_tensor(sdO.data(), typename Traits::SmemLayoutQtNoSwizzle{});
  Tensor sKt = make_tensor(sK.data(), typename Traits::SmemLayoutKt{});
  Tensor sKtNoSwizzle = make_tensor(sK.data(), typename Traits::SmemLayoutKtNoSwizzle{});
  Tensor sPt = make_tensor(sP.data(), typename Traits::SmemLayoutPdSt{});
  Tensor sPtNoSwizzle = make_tensor(sP.data(), typename Traits::SmemLayoutPdStNoSwizzle{});
  Tensor sdSt = make_tensor(sdS.data(), typename Traits::SmemLayoutPdSt{});
  Tensor sdStNoSwizzle = make_tensor(sdS.data(), typename Traits::SmemLayoutPdStNoSwizzle{});

  // Global -> shared.
  typename Traits::GmemTiledCopy gmem_tiled_copy;
  auto gmem_thr_copy = gmem_tiled_copy.get_thread_slice(tidx);
  Tensor tQsQ = gmem_thr_copy.partition_D(sQ);
  Tensor tdOsdO = gmem_thr_copy.partition_D(sdO);
  Tensor tKsK = gmem_thr_copy.partition_D(sK);
  Tensor tVsV = gmem_thr_copy.partition_D(sV);
  Tensor tQcQ =
      gmem_thr_copy.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tKVcKV =
      gmem_thr_copy.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));

  // The same view of Q or dO smem, in stage `stage` (stage buffers are
  // size(sQ) elements apart, a multiple of the swizzle period).
  auto at_stage = [&](auto const& t, int stage) {
    return make_tensor(t.data() + stage * int(size(sQ)), t.layout());
  };

  // Loads the Q or dO tile of step `step` (query head, query block).
  auto load_rows = [&](const void* base, int64_t batch_stride, int64_t row_stride,
                       int64_t head_stride, int step, auto dst) {
    int head, m_block;
    steps.unit(step, head, m_block);
    const Element* ptr = static_cast<const Element*>(base) + batch * batch_stride +
                         head * head_stride + int64_t{m_block} * kBlockM * row_stride;
    Tensor g = make_tensor(make_gmem_ptr(ptr), Shape<Int<kBlockM>, Int<kHeadDim>>{},
                           make_stride(row_stride, _1{}));
    copy_rows(gmem_tiled_copy, gmem_thr_copy.partition_S(g), dst, tQcQ,
              params.seqlen_q - m_block * kBlockM);
  };
  auto load_q_do = [&](int step, int stage) {
    load_rows(params.q, params.q_batch_stride, params.q_row_stride, params.q_head_stride, step,
              at_stage(tQsQ, stage));
    load_rows(params.dout, params.dout_batch_stride, params.dout_row_stride,
              params.dout_head_stride, step, at_stage(tdOsdO, stage));
  };

  // S = Q K^T and dP = dO V^T.
  typename Traits::TiledMmaSdP tiled_mma_sdp;
  auto thr_mma_sdp = tiled_mma_sdp.get_thread_slice(tidx);
  Tensor tSrQ = thr_mma_sdp.partition_fragment_A(sQ);
  Tensor tSrK = thr_mma_sdp.partition_fragment_B(sK);
  Tensor tdPrdO = thr_mma_sdp.partition_fragment_A(sdO);
  Tensor tdPrV = thr_mma_sdp.partition_fragment_B(sV);
  auto smem_tiled_copy_QdO = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, tiled_mma_sdp);
  auto smem_thr_copy_QdO = smem_tiled_copy_QdO.get_thread_slice(tidx);
  Tensor tSsQ = smem_thr_copy_QdO.partition_S(sQ);
  Tensor tdPsdO = smem_thr_copy_QdO.partition_S(sdO);
  auto smem_tiled_copy_KV = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, tiled_mma_sdp);
  auto smem_thr_copy_KV = smem_tiled_copy_KV.get_thread_slice(tidx);
  Tensor tSsK = smem_thr_copy_KV.partition_S(sK);
  Tensor tdPsV = smem_thr_copy_KV.partition_S(sV);
  auto smem_tiled_copy_PdS = make_tiled_copy_C(typename Traits::SmemCopyAtomPdS{}, tiled_mma_sdp);
  auto smem_thr_copy_PdS = smem_tiled_copy_PdS.get_thread_slice(tidx);
  Tensor tPsP = smem_thr_copy_PdS.partition_D(sP);
  Tensor tdSsdS = smem_thr_copy_PdS.partition_D(sdS);
  Tensor tScS = thr_mma_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor tScS_rc = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));

  // dV += P^T dO and dK += dS^T Q.
  typename Traits::TiledMmadKV tiled_mma_dkv;
  auto thr_mma_dkv = tiled_mma_dkv.get_thread_slice(tidx);
  Tensor tdVrPt = thr_mma_dkv.partition_fragment_A(sPtNoSwizzle);
  Tensor tdVrdOt = thr_mma_dkv.partition_fragment_B(sdOtNoSwizzle);
  Tensor tdKrdSt = thr_mma_dkv.partition_fragment_A(sdStNoSwizzle);
  Tensor tdKrQt = thr_mma_dkv.partition_fragment_B(sQtNoSwizzle);
  auto smem_tiled_copy_PdSt =
      make_tiled_copy_A(typename Traits::SmemCopyAtomTransposed{}, tiled_mma_dkv);
  auto smem_thr_copy_PdSt = smem_tiled_copy_PdSt.get_thread_slice(tidx);
  Tensor tdVsPt = smem_thr_copy_PdSt.partition_S(sPt);
  Tensor tdKsdSt = smem_thr_copy_PdSt.partition_S(sdSt);
  auto smem_tiled_copy_QdOt =
      make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, tiled_mma_dkv);
  auto smem_thr_copy_QdOt = smem_tiled_copy_QdOt.get_thread_slice(tidx);
  Tensor tdVsdOt = smem_thr_copy_QdOt.partition_S(sdOt);
  Tensor tdKsQt = smem_thr_copy_QdOt.partition_S(sQt);
  Tensor acc_dk = partition_fragment_C(tiled_mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor acc_dv = partition_fragment_C(tiled_mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  clear(acc_dk);
  clear(acc_dv);

  // dQ = dS K.
  typename Traits::TiledMmadQ tiled_mma_dq;
  auto thr_mma_dq = tiled_mma_dq.get_thread_slice(tidx);
  Tensor tdQrdS = thr_mma_dq.partition_fragment_A(sdS);
  Tensor tdQrKt = thr_mma_dq.partition_fragment_B(sKtNoSwizzle);
  auto smem_tiled_copy_dS = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, tiled_mma_dq);
  auto smem_thr_copy_dS = smem_tiled_copy_dS.get_thread_slice(tidx);
  Tensor tdQsdS = smem_thr_copy_dS.partition_S(sdS);
  auto smem_tiled_copy_Kt =
      make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, tiled_mma_dq);
  auto smem_thr_copy_Kt = smem_tiled_copy_Kt.get_thread_slice(tidx);
  Tensor tdQsKt = smem_thr_copy_Kt.partition_S(sKt);
  Tensor tdQcdQ =
      thr_mma_dq.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));

  if (num_steps > 0) {
    auto k_tile = [&](const void* base, int64_t batch_stride, int64_t row_stride,
                      int64_t head_stride) {
      const Element* ptr = static_cast<const Element*>(base) + batch * batch_stride +
                           kv_head * head_stride + int64_t{key0} * row_stride;
      return gmem_thr_copy.partition_S(make_tensor(
          make_gmem_ptr(ptr), Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_stride(row_stride, _1{})));
    };
    copy_rows(gmem_tiled_copy,
              k_tile(params.k, params.k_batch_stride, params.k_row_stride, params.k_head_stride),
              tKsK, tKVcKV, params.seqlen_k - key0);
    copy_rows(gmem_tiled_copy,
              k_tile(params.v, params.v_batch_stride, params.v_row_stride, params.v_head_stride),
              tVsV, tKVcKV, params.seqlen_k - key0);
    load_q_do(0, 0);
    cp_async_fence();
  }

  constexpr int kRows = decltype(size<0>(tScS_rc))::value;  // query rows this thread holds
  // Deterministic mode's counter of a step's dQ tile, recomputed where used
  // rather than kept live through the step (the kernel is at its register limit).
  auto step_dq_semaphore = [&](int step) {
    int head, m_block;
    steps.unit(step, head, m_block);
    return dq_semaphore_at(params, batch, head, m_block, 0, 1);
  };
  using Visibility = SegmentVisibility<kRows, decltype(size<1>(tScS_rc))::value>;
  for (int step = 0; step < num_steps; ++step) {
    int head, m_block;
    steps.unit(step, head, m_block);
    const int row0 = m_block * kBlockM;
    const int64_t row_offset = (int64_t{batch} * params.num_heads + head) * params.seqlen_q;
    // Segment ids: the tile's class and its visible elements, before the
    // products (the ids are dead by the time S and dP are live). Rows past
    // seqlen_q and keys past the band's last (key_limit, below) are masked.
    bool seg_needs_mask = false;
    typename Visibility::Bits seg_visible = 0;
    if constexpr (Mask::kHasSegments) {
      seg_needs_mask = key0 + kBlockN > params.seqlen_k ||
                       mask.tile_class(row0, min(row0 + kBlockM, params.seqlen_q), key0,
                                       key0 + kBlockN) != TileClass::kFull;
      if (seg_needs_mask) {
        const int key_limit =
            static_cast<int>(mask.band().keys_of_rows(0, params.seqlen_q, params.seqlen_k).end);
        seg_visible = Visibility(mask, tScS_rc, row0, key0, params.seqlen_q, key_limit).bits;
      }
    }

    // lse (log2 domain) and delta of this thread's rows. Rows past the end and
    // rows that saw no key in the forward (lse = -inf) get lse = +inf: P = 0
    // for finite scores (and the mask zeroes the rest: such rows are never in
    // a full tile). A NaN lse (a row whose softmax is undefined) stays NaN.
    float lse_log2[kRows];
    float delta[kRows];
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int row = row0 + get<0>(tScS_rc(r, 0));
      const float lse = row < params.seqlen_q ? params.lse[row_offset + row] : INFINITY;
      lse_log2[r] = lse == -INFINITY ? INFINITY : lse * kLog2e;
      delta[r] = row < params.seqlen_q ? params.delta[row_offset + row] : 0.f;
    }

    cp_async_wait<0>();
    __syncthreads();  // Q, dO (and K, V) tiles visible; every warp is done with the last step
    const int stage = kQStages == 2 ? step % 2 : 0;
    if constexpr (kQStages == 2) {
      if (step + 1 < num_steps) {
        load_q_do(step + 1, stage ^ 1);
        cp_async_fence();
      }
    }

    // S = Q K^T and dP = dO V^T   (block_m x block_n)
    Tensor acc_s = partition_fragment_C(tiled_mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
    clear(acc_s);
    gemm_ss<Traits::kTf32Passes>(acc_s, tSrQ, tSrK, at_stage(tSsQ, stage), tSsK, tiled_mma_sdp, smem_tiled_copy_QdO,
            smem_thr_copy_QdO, smem_tiled_copy_KV, smem_thr_copy_KV);
    Tensor acc_dp = partition_fragment_C(tiled_mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
    clear(acc_dp);
    gemm_ss<Traits::kTf32Passes>(acc_dp, tdPrdO, tdPrV, at_stage(tdPsdO, stage), tdPsV, tiled_mma_sdp,
            smem_tiled_copy_QdO, smem_thr_copy_QdO, smem_tiled_copy_KV, smem_thr_copy_KV);

    // P = exp2(S * scale_log2 - lse_log2), dS = P * (dP - delta); masked
    // elements (outside the band or past the last key) get P = dS = 0 by a
    // select after the arithmetic, which a NaN row (lse, delta NaN) or a NaN in
    // v (dP NaN) cannot turn into NaN. The last key here is the last one that
    // some row sees (key_limit): a band may let rows past seqlen_q (zeros, lse
    // = +inf) see keys that no row sees, and their scores are NaN where k is.
    // (Segment ids: computed above, with the band's limit, rows past seqlen_q
    // masked too.)
    Tensor s = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));
    Tensor dp = make_tensor(acc_dp.data(), acc_rowcol(acc_dp.layout()));
    const bool needs_mask =
        Mask::kHasSegments
            ? seg_needs_mask
            : key0 + kBlockN > params.seqlen_k ||
                  mask.tile_class(row0, min(row0 + kBlockM, params.seqlen_q), key0,
                                  key0 + kBlockN) != TileClass::kFull;
    const int key_limit =
        static_cast<int>(mask.band().keys_of_rows(0, params.seqlen_q, params.seqlen_k).end);
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTE_UNROLL
      for (int c = 0; c < size<1>(s); ++c) {
        // Softcap: the capped score t, recomputed from S here rather than kept.
        const float score = kScore == ScoreKind::kSoftcap
                                ? softcap_tanh<Element>(s(r, c) * params.softcap_scale)
                                : s(r, c);
        float p = fast_exp2(score * params.softmax_scale_log2 - lse_log2[r]);
        float ds = p * (dp(r, c) - delta[r]);
        if constexpr (kScore == ScoreKind::kSoftcap) ds *= 1.f - score * score;
        if (needs_mask) {
          const int row = row0 + get<0>(tScS_rc(r, c));
          const int col = key0 + get<1>(tScS_rc(r, c));
          const bool visible = Mask::kHasSegments
                                   ? Visibility(seg_visible)(r, c)
                                   : col < key_limit && mask.visible(int64_t{row}, int64_t{col});
          if (!visible) {
            p = 0.f;
            ds = 0.f;
          }
        }
        s(r, c) = p;
        dp(r, c) = ds;
      }
    }
    Tensor p_operand = convert_fragment<Element>(acc_s);
    copy(smem_tiled_copy_PdS, smem_thr_copy_PdS.retile_S(p_operand), tPsP);
    Tensor ds_operand = convert_fragment<Element>(acc_dp);
    copy(smem_tiled_copy_PdS, smem_thr_copy_PdS.retile_S(ds_operand), tdSsdS);
    __syncthreads();  // P, dS visible

    // dV += P^T dO   (block_n x head_dim)
    gemm_ss<Traits::kTf32Passes>(acc_dv, tdVrPt, tdVrdOt, tdVsPt, at_stage(tdVsdOt, stage), tiled_mma_dkv,
            smem_tiled_copy_PdSt, smem_thr_copy_PdSt, smem_tiled_copy_QdOt, smem_thr_copy_QdOt);

    // dK += dS^T Q   (block_n x head_dim)
    gemm_ss<Traits::kTf32Passes>(acc_dk, tdKrdSt, tdKrQt, tdKsdSt, at_stage(tdKsQt, stage), tiled_mma_dkv,
            smem_tiled_copy_PdSt, smem_thr_copy_PdSt, smem_tiled_copy_QdOt, smem_thr_copy_QdOt);
    if constexpr (kQStages == 1) {
      // One buffer: the next Q and dO load only once every warp is done with
      // them, and stream in during the dQ product.
      __syncthreads();
      if (step + 1 < num_steps) {
        load_q_do(step + 1, 0);
        cp_async_fence();
      }
    }

    // dQ_accum += dS K   (block_m x head_dim, float32 atomics; scaled in kernel 3)
    Tensor acc_dq = partition_fragment_C(tiled_mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
    clear(acc_dq);
    gemm_ss<Traits::kTf32Passes>(acc_dq, tdQrdS, tdQrKt, tdQsdS, tdQsKt, tiled_mma_dq, smem_tiled_copy_dS,
            smem_thr_copy_dS, smem_tiled_copy_Kt, smem_thr_copy_Kt);
    float* dq_accum = params.dq_accum + batch * params.dq_accum_batch_stride +
                      head * params.dq_accum_head_stride;
    // Deterministic mode: the earlier key blocks of this query block add first.
    if (steps.ordered()) {
      if (tidx == 0) {
        dq_semaphore_wait(step_dq_semaphore(step), n_block - steps.first_key_block(params, m_block, batch));
      }
      __syncthreads();
    }
    // Fragment elements 2i, 2i+1 are adjacent columns: one 8-byte atomic on sm90.
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dq); i += 2) {
      const int row = row0 + get<0>(tdQcdQ(i));
      if (row < params.seqlen_q) {
        float* dst = dq_accum + row * params.dq_accum_row_stride + get<1>(tdQcdQ(i));
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        atomicAdd(reinterpret_cast<float2*>(dst), make_float2(acc_dq(i), acc_dq(i + 1)));
#else
        atomicAdd(dst, acc_dq(i));
        atomicAdd(dst + 1, acc_dq(i + 1));
#endif
      }
    }
    if (steps.ordered()) {
      __threadfence();  // this thread's additions, visible on the GPU
      __syncthreads();  // ... for every thread
      if (tidx == 0) dq_semaphore_signal(step_dq_semaphore(step));
    }
  }

  // dK and dV of the key block, written once (or added into the caller's sums).
  const auto dkv_coords =
      thr_mma_dkv.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  if (params.dkv_mode == DkvMode::kAddToAccum) {
    add_dk_dv(acc_dk, acc_dv, dkv_coords, key0, batch, kv_head, params);
  } else {
    store_dk_dv<Element>(acc_dk, acc_dv, dkv_coords, key0, batch, kv_head, params,
                         Int<kHeadDim>{});
  }
}

// The score kind comes last but one: the plain kernels' instantiation files
// predate it; the float32 kernels' passes (kernel_traits_sm80.h) last.
template <typename Element, int kHeadDim, typename Mask, SmemClass kSmem = SmemClass::kLarge,
          ScoreKind kScore = ScoreKind::kPlain, int kTf32Passes = 1>
cudaError_t run_flash_bwd(const BwdParams& params, const LaunchContext& ctx) {
  using Traits = BwdTraitsSm80<Element, kHeadDim, kSmem, kTf32Passes>;
  if (cudaError_t err = launch_bwd_preprocess<Element, kHeadDim>(params, ctx); err != cudaSuccess) {
    return err;
  }

  auto kernel = &flash_bwd_kernel<Traits, Mask, kScore>;
  constexpr int kSmemBytes = Traits::kSmemBytes;
  if constexpr (kSmemBytes > 48 * 1024) {
    if (cudaError_t err = cudaFuncSetAttribute(
            kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
        err != cudaSuccess) {
      return err;
    }
  }
  // Runs even with no query rows: it then writes dK = dV = 0.
  if (params.seqlen_k > 0) {
    // (key blocks, kv heads, batch), in chunks of <= 65535 kv heads and batches (launch.h).
    const int num_n_blocks = ceil_div(params.seqlen_k, Traits::kBlockN);
    if (cudaError_t err = for_each_grid_chunk(
            params.num_heads_kv, params.batch, 1,
            [&](const GridChunk& chunk) {
              const dim3 grid(num_n_blocks, chunk.heads, chunk.batches);
              kernel<<<grid, Traits::kNThreads, kSmemBytes, ctx.stream>>>(
                  bwd_params_chunk(params, chunk));
              return cudaGetLastError();
            });
        err != cudaSuccess) {
      return err;
    }
  }

  return launch_bwd_postprocess<Element>(params, ctx);
}

}  // namespace jflash::cuda

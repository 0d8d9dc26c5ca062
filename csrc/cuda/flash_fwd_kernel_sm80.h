// Forward: out, lse <- softmax(scale * Q K^T) V, one CTA per (query block, head, batch).
// With softcap (kScore, jflash/score.h) the scores are capped first. float32
// inputs run the same kernel on TF32 MMAs (kernel_traits_sm80.h).
//
// Per CTA (FlashAttention-2, Algorithm 1):
//   load the Q tile (block_m x head_dim) once;
//   for each key tile the band lets this query block see:
//     S = Q K^T                                   (tensor cores, K tile in smem)
//     online softmax of S in registers (exp2, scale folded in)
//     O = O * correction + P V                   (P never leaves registers)
//   O /= rowsum; lse = rowmax + log(rowsum), written once.
// K and V use one smem buffer each, loaded with cp.async one phase ahead: the V
// tile streams in while Q K^T runs, and the next K tile while softmax and P V run.
#pragma once

#include <cuda_runtime.h>

#include <cute/tensor.hpp>

#include "cuda/kernel_traits_sm80.h"
#include "cuda/launch.h"
#include "cuda/utils.h"
#include "jflash/params.h"

namespace jflash::cuda {

using namespace cute;

template <typename Traits, typename Mask, ScoreKind kScore>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    flash_fwd_kernel(const __grid_constant__ FwdParams params) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  // Tiles of the key range that the policy finds empty (segment ids) are
  // computed fully masked: they add nothing.

  extern __shared__ __align__(128) char smem[];
  const int m_block = blockIdx.x;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const int kv_head = head / params.heads_per_kv;
  const int tidx = threadIdx.x;

  // Query rows [row_begin, row_end) of this CTA and the key blocks they can see.
  const int row_begin = m_block * kBlockM;
  const int row_end = min(row_begin + kBlockM, params.seqlen_q);
  const Mask mask(params.mask, batch);
  const IndexRange keys = mask.keys_of_rows(row_begin, row_end, params.seqlen_k);
  const int key_begin = static_cast<int>(keys.begin);
  const int key_end = static_cast<int>(keys.end);
  const int n_block_begin = key_begin / kBlockN;
  const int n_block_end = key_begin < key_end ? ceil_div(key_end, kBlockN) : n_block_begin;

  // Global tiles (block x head_dim). The row stride inside a tile is 32-bit
  // (the handlers check that block rows * stride fits), so only the tile base
  // needs 64-bit arithmetic, not each thread's cp.async addresses: fewer
  // registers in a kernel that sits at the 255-register limit.
  const Element* q_ptr = static_cast<const Element*>(params.q) + batch * params.q_batch_stride +
                         head * params.q_head_stride;
  const Element* k_ptr = static_cast<const Element*>(params.k) + batch * params.k_batch_stride +
                         kv_head * params.k_head_stride;
  const Element* v_ptr = static_cast<const Element*>(params.v) + batch * params.v_batch_stride +
                         kv_head * params.v_head_stride;
  auto tile = [](const Element* base, int64_t row_stride, int first_row, auto rows) {
    return make_tensor(make_gmem_ptr(base + first_row * row_stride),
                       make_shape(rows, Int<kHeadDim>{}),
                       make_stride(static_cast<int>(row_stride), _1{}));
  };
  Tensor gQ = tile(q_ptr, params.q_row_stride, row_begin, Int<kBlockM>{});

  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)),
                          typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(sQ.data() + size(sQ), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(sK.data() + size(sK), typename Traits::SmemLayoutKV{});
  Tensor sVt = make_tensor(sV.data(), typename Traits::SmemLayoutVt{});
  Tensor sVtNoSwizzle = make_tensor(sV.data(), typename Traits::SmemLayoutVtNoSwizzle{});

  // Global -> shared copies, with row coordinates for the sequence-end predicate.
  typename Traits::GmemTiledCopy gmem_tiled_copy;
  auto gmem_thr_copy = gmem_tiled_copy.get_thread_slice(tidx);
  Tensor tQgQ = gmem_thr_copy.partition_S(gQ);
  Tensor tQsQ = gmem_thr_copy.partition_D(sQ);
  Tensor tKsK = gmem_thr_copy.partition_D(sK);
  Tensor tVsV = gmem_thr_copy.partition_D(sV);
  Tensor tQcQ =
      gmem_thr_copy.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tKVcKV =
      gmem_thr_copy.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  auto load_kv = [&](const Element* base, int64_t row_stride, int n_block, auto& dst) {
    const int key0 = n_block * kBlockN;
    copy_rows(gmem_tiled_copy,
              gmem_thr_copy.partition_S(tile(base, row_stride, key0, Int<kBlockN>{})), dst,
              tKVcKV, params.seqlen_k - key0);
  };

  // Shared -> register operands of the two products.
  typename Traits::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tidx);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);
  Tensor tSrK = thr_mma.partition_fragment_B(sK);
  typename Traits::TiledMmaPV tiled_mma_pv;
  auto thr_mma_pv = tiled_mma_pv.get_thread_slice(tidx);
  Tensor tOrVt = thr_mma_pv.partition_fragment_B(sVtNoSwizzle);
  auto smem_tiled_copy_Q = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_copy_Q = smem_tiled_copy_Q.get_thread_slice(tidx);
  Tensor tSsQ = smem_thr_copy_Q.partition_S(sQ);
  auto smem_tiled_copy_K = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_copy_K = smem_tiled_copy_K.get_thread_slice(tidx);
  Tensor tSsK = smem_thr_copy_K.partition_S(sK);
  auto smem_tiled_copy_V =
      make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, tiled_mma_pv);
  auto smem_thr_copy_V = smem_tiled_copy_V.get_thread_slice(tidx);
  Tensor tOsVt = smem_thr_copy_V.partition_S(sVt);

  // (row, col) of each score-accumulator element, for masking.
  Tensor tScS = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor tScS_rc = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));

  Tensor acc_o = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  Tensor o_rc = make_tensor(acc_o.data(), acc_rowcol(acc_o.layout()));
  constexpr int kRows = decltype(size<0>(o_rc))::value;  // query rows this thread holds
  float row_max[kRows];  // running max of the scaled (log2-domain) scores
  float row_sum[kRows];  // running sum of exp2(score - row_max), this thread's columns only
  // Segment ids: whether the row saw a visible key in this thread's columns.
  bool row_seen[Mask::kHasSegments ? kRows : 1];
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    row_max[r] = -INFINITY;
    row_sum[r] = 0.f;
    if constexpr (Mask::kHasSegments) row_seen[r] = false;
  }
  clear(acc_o);

  if (n_block_begin < n_block_end) {
    copy_rows(gmem_tiled_copy, tQgQ, tQsQ, tQcQ, params.seqlen_q - row_begin);
    load_kv(k_ptr, params.k_row_stride, n_block_begin, tKsK);
    cp_async_fence();
  }

  using Visibility = SegmentVisibility<kRows, decltype(size<1>(tScS_rc))::value>;
  for (int n_block = n_block_begin; n_block < n_block_end; ++n_block) {
    const int key0 = n_block * kBlockN;
    // Segment ids: the tile's class and its visible scores, before the product
    // (the ids are dead by the time S is live).
    bool seg_needs_mask = false;
    typename Visibility::Bits seg_visible = 0;
    if constexpr (Mask::kHasSegments) {
      seg_needs_mask = key0 + kBlockN > params.seqlen_k ||
                       mask.tile_class(row_begin, row_end, key0, key0 + kBlockN) != TileClass::kFull;
      if (seg_needs_mask) {
        seg_visible = Visibility(mask, tScS_rc, row_begin, key0, params.seqlen_q, params.seqlen_k).bits;
      }
    }
    Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
    clear(acc_s);
    cp_async_wait<0>();
    __syncthreads();  // K tile visible to all warps; every warp is done with the old V tile
    load_kv(v_ptr, params.v_row_stride, n_block, tVsV);
    cp_async_fence();

    // S = Q K^T   (block_m x block_n)
    gemm_ss<Traits::kTf32Passes>(acc_s, tSrQ, tSrK, tSsQ, tSsK, tiled_mma, smem_tiled_copy_Q, smem_thr_copy_Q,
            smem_tiled_copy_K, smem_thr_copy_K);

    // Scale into the log2 domain first, then mask: this is correct for any sign
    // of softmax_scale (a negative scale turns the row max into a row min).
    // Softcap: the score is tanh(softcap_scale * S) first, and the factor
    // softcap * log2(e).
    Tensor s = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));
    CUTE_UNROLL
    for (int i = 0; i < size(s); ++i) {
      if constexpr (kScore == ScoreKind::kSoftcap) s(i) = softcap_tanh<Element>(s(i) * params.softcap_scale);
      s(i) *= params.softmax_scale_log2;
    }
    if constexpr (Mask::kHasSegments) {
      if (seg_needs_mask) {
        const Visibility visible{seg_visible};
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
          CUTE_UNROLL
          for (int c = 0; c < size<1>(s); ++c) {
            if (!visible(r, c)) s(r, c) = -INFINITY;
          }
          row_seen[r] |= visible.any_in_row(r);
        }
      } else {
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) row_seen[r] = true;
      }
    } else if (key0 + kBlockN > params.seqlen_k ||
               mask.tile_class(row_begin, row_end, key0, key0 + kBlockN) != TileClass::kFull) {
      CUTE_UNROLL
      for (int i = 0; i < size(s); ++i) {
        const int row = row_begin + get<0>(tScS_rc(i));
        const int col = key0 + get<1>(tScS_rc(i));
        const bool visible =
            col < params.seqlen_k && mask.visible(int64_t{row}, int64_t{col});
        if (!visible) s(i) = -INFINITY;
      }
    }

    cp_async_wait<0>();
    __syncthreads();  // V tile visible; every warp is done reading this K tile
    if (n_block + 1 < n_block_end) {
      load_kv(k_ptr, params.k_row_stride, n_block + 1, tKsK);
      cp_async_fence();
    }

    // Online softmax (rows live in one quad of lanes), O rescaled.
    online_softmax(s, o_rc, row_max, row_sum);

    // O += P V   (P converted in registers to the A-operand layout; float32
    // reads the accumulator in place)
    if constexpr (Traits::kIsFloat32) {
      Tensor tOrP = make_tensor(acc_s.data(), acc_as_tf32_a_operand(acc_s.layout()));
      gemm_rs<Traits::kTf32Passes>(acc_o, tOrP, tOrVt, tOsVt, tiled_mma_pv, smem_tiled_copy_V,
                                   smem_thr_copy_V);
    } else {
      Tensor p = convert_fragment<Element>(acc_s);
      Tensor tOrP = make_tensor(p.data(), acc_as_a_operand(p.layout()));
      gemm_rs(acc_o, tOrP, tOrVt, tOsVt, tiled_mma_pv, smem_tiled_copy_V, smem_thr_copy_V);
    }
  }

  // Epilogue: O /= rowsum, lse, O stored.
  Tensor tOcO = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tOcO_rc = make_tensor(tOcO.data(), acc_rowcol(tOcO.layout()));
  store_output<Element>(
      acc_o, o_rc, tOcO, tOcO_rc, row_max, row_sum, row_begin, params.seqlen_q, mask,
      params.seqlen_k, tidx % 4 == 0,
      params.lse + (int64_t(batch) * params.num_heads + head) * params.seqlen_q,
      static_cast<Element*>(params.out) + batch * params.out_batch_stride +
          head * params.out_head_stride,
      params.out_row_stride, Int<kHeadDim>{}, row_seen);
}

// The score kind comes last but one: the plain kernels' instantiation files
// predate it; the float32 kernels' passes (kernel_traits_sm80.h) last.
template <typename Element, int kHeadDim, typename Mask, SmemClass kSmem = SmemClass::kLarge,
          ScoreKind kScore = ScoreKind::kPlain, int kTf32Passes = 1>
cudaError_t run_flash_fwd(const FwdParams& params, const LaunchContext& ctx) {
  using Traits = FwdTraitsSm80<Element, kHeadDim, kSmem, kTf32Passes>;
  auto kernel = &flash_fwd_kernel<Traits, Mask, kScore>;
  constexpr int kSmemBytes = Traits::kSmemBytes;
  if constexpr (kSmemBytes > 48 * 1024) {
    if (cudaError_t err = cudaFuncSetAttribute(
            kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
        err != cudaSuccess) {
      return err;
    }
  }
  // (query blocks, heads, batch), in chunks of <= 65535 heads and batches (launch.h).
  const int num_m_blocks = ceil_div(params.seqlen_q, Traits::kBlockM);
  return for_each_grid_chunk(
      params.num_heads, params.batch, params.heads_per_kv, [&](const GridChunk& chunk) {
        const dim3 grid(num_m_blocks, chunk.heads, chunk.batches);
        kernel<<<grid, Traits::kNThreads, kSmemBytes, ctx.stream>>>(
            fwd_params_chunk(params, chunk));
        return cudaGetLastError();
      });
}

}  // namespace jflash::cuda

// The decode's host side: which kernel of flash_decode_sm80.h a call runs
// (by its rows per kv head), its ring depth and shared memory, the split
// count with the kernel's occupancy, and the launches of the main kernel and
// of the combine (decode_combine.h). The instantiation files
// (csrc/cuda/instantiations/flash_decode_*.cu) register these functions.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/decode_combine.h"
#include "cuda/flash_decode_sm80.h"
#include "cuda/launch.h"
#include "cuda/tile_sizes.h"
#include "jflash/decode.h"
#include "jflash/params.h"

namespace jflash::cuda {

// The kernel for `rows` rows per kv head: 4 warps across the keys of a tile
// for up to 16 rows, across 64 rows otherwise.
template <typename Element, int kHeadDim, typename Body>
auto with_decode_traits(int rows, Body&& body) {
  if (rows <= 16) return body(DecodeTraitsSm80<Element, kHeadDim, 4>{});
  return body(DecodeTraitsSm80<Element, kHeadDim, 1>{});
}

template <typename Element, int kHeadDim>
int decode_smem_bytes_sm80(int rows, const LaunchContext& ctx) {
  return with_decode_traits<Element, kHeadDim>(rows, [&](auto traits) {
    using Traits = decltype(traits);
    return Traits::smem_bytes(Traits::stages_for(ctx.smem_limit));
  });
}

template <typename Traits>
cudaError_t set_decode_smem(int smem_bytes) {
  if (smem_bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(&flash_decode_kernel<Traits>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
}

// The kernel's CTAs that fit on an SM with `smem_bytes` of dynamic shared
// memory; -1 where the device refuses that much or the query fails.
template <typename Traits>
int decode_ctas_per_sm(int smem_bytes) {
  int fit = 0;
  if (set_decode_smem<Traits>(smem_bytes) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, &flash_decode_kernel<Traits>,
                                                    Traits::kNThreads, smem_bytes) != cudaSuccess) {
    return -1;
  }
  return fit;
}

// The split heuristic (jflash/decode.h) with the kernel's occupancy: its CTAs
// per SM at the shared memory it takes here are the slots of an SM (at least
// one: decode_num_splits counts fewer as one).
template <typename Element, int kHeadDim>
int decode_num_splits_sm80(int64_t batch, int64_t num_heads_kv, int rows, int64_t capacity,
                           const LaunchContext& ctx) {
  return with_decode_traits<Element, kHeadDim>(rows, [&](auto traits) {
    using Traits = decltype(traits);
    const int smem = Traits::smem_bytes(Traits::stages_for(ctx.smem_limit));
    const int64_t units = batch * num_heads_kv * ceil_div(rows, Traits::kBlockM);
    const DecodeSplitCost cost{Traits::kBlockN, kCudaDecodeSplitCost.unit_overhead_keys,
                               kCudaDecodeSplitCost.combine_keys};
    return decode_num_splits(units, ctx.sm_count, decode_ctas_per_sm<Traits>(smem), capacity,
                             cost);
  });
}

// The ring depth of a launch of `ctas` CTAs: the table's where the launch
// fills the SMs' slots. A short call leaves slots empty (batch 1 and an 8k
// cache: 264 CTAs of 4 tiles for 396 slots at head dim 128), and its CTAs
// spend their few tiles mostly waiting for loads with one tile in flight:
// there the empty slots' shared memory deepens the ring, so that more of a
// CTA's tiles are in flight at once.
template <typename Traits>
int decode_launch_stages(int64_t ctas, const LaunchContext& ctx) {
  const int table = Traits::stages_for(ctx.smem_limit);
  const int64_t per_sm = ceil_div(ctas, int64_t{ctx.sm_count});
  if (per_sm >= Traits::kMinBlocksPerSm) return table;
  for (int stages = kMaxDecodeStages; stages > table; --stages) {
    const int smem = Traits::smem_bytes(stages);
    if (smem <= ctx.smem_limit && decode_ctas_per_sm<Traits>(smem) >= per_sm) return stages;
  }
  return table;
}

template <typename Element, int kHeadDim>
cudaError_t run_flash_decode(const DecodeParams& params, const LaunchContext& ctx) {
  const int rows = decode_rows(params);
  return with_decode_traits<Element, kHeadDim>(rows, [&](auto traits) {
    using Traits = decltype(traits);
    // The handler checks that the grid fits gridDim.x (2^31 - 1).
    const int64_t ctas = int64_t{params.batch} * params.num_heads_kv * params.num_splits *
                         ceil_div(rows, Traits::kBlockM);
    const int stages = decode_launch_stages<Traits>(ctas, ctx);
    const int smem = Traits::smem_bytes(stages);
    if (cudaError_t err = set_decode_smem<Traits>(smem); err != cudaSuccess) return err;
    // A programmatic dependent launch where the device takes it: the CTAs
    // start as the previous kernel's last ones end, and wait for its writes.
    if (cudaError_t err = launch_dependent(ctx, &flash_decode_kernel<Traits>,
                                           dim3(static_cast<unsigned>(ctas)),
                                           dim3(Traits::kNThreads), smem, params, stages);
        err != cudaSuccess || params.num_splits == 1) {
      return err;
    }
    const int64_t rows_total = int64_t{params.batch} * params.num_heads * params.seqlen_q;
    const int64_t rows_per_cta = kCombineWarps / combine_warps_per_row(params.num_splits);
    // A sequence attends over at most the capacity (appended keys included).
    const int64_t tiles = ceil_div(int64_t{decode_capacity(params)}, int64_t{Traits::kBlockN});
    LaunchContext combine_ctx = ctx;
    combine_ctx.programmatic_launch &=
        ceil_div(tiles, int64_t{params.num_splits}) <= kDecodeEarlyCombineMaxTiles;
    return launch_dependent(combine_ctx, &flash_decode_combine_kernel<Element, kHeadDim>,
                            dim3(static_cast<unsigned>(ceil_div(rows_total, rows_per_cta))),
                            dim3(32 * kCombineWarps), 0, params);
  });
}

}  // namespace jflash::cuda

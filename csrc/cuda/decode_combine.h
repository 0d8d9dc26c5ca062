// The decode's second kernel (decode_launch_sm80.h launches it after the
// main one of flash_decode_sm80.h where a call has several splits of the key range): each row's
// out and lse from the splits' float32 shares.
#pragma once

#include <cuda_runtime.h>

#include <cute/tensor.hpp>

#include "cuda/utils.h"
#include "jflash/decode.h"
#include "jflash/params.h"

namespace jflash::cuda {

// out, lse of each row (sequence, query head, query) from its splits':
// lse = log sum_s exp(lse_s), out = sum_s exp(lse_s - lse) out_s over the
// splits with a share (lse_s > -inf; a split without one wrote zeros). A row
// that sees keys but has no share in any split had every visible score -inf:
// NaN, as with one split.
//
// Latency, not bandwidth, bounds this kernel (a few MB at most; 5.4 us of a
// 23 us call at batch 1 and an 8k cache, H100, when a warp took a whole row
// and 8 splits per round trip). A row takes W = combine_warps_per_row(splits)
// warps (1 to 8) of a CTA's kCombineWarps, which take its splits in turn
// (warp w: w, w + W, ...), kCombineBatch each per round trip: up to 64
// splits in one. Fewer warps where there are few splits, so that a call of
// many rows and few splits keeps a warp per row. A lane holds head_dim / 32
// columns. The shares' addresses depend on nothing but the split index: a
// warp's first batch of share loads goes out with its lse loads. Every warp
// reads every lse of its row (a lane per split; L2 hits) for the row's lse
// and the weights; the warps of a row meet in shared memory, and a row of
// one warp is written by that warp.
//
// Launched as a programmatic dependent of the main kernel where the device
// takes it (LaunchContext::programmatic_launch) and the main kernel is short
// (kDecodeEarlyCombineMaxTiles, tile_sizes.h): its CTAs start while the main
// kernel runs, read the call's lengths, and wait for the main kernel's
// shares at griddepcontrol.wait rather than at a launch.
inline constexpr int kCombineWarps = 8;
inline constexpr int kCombineBatch = 8;
static_assert(32 % kCombineWarps == 0, "a warp's splits of a round stay within a lane slot");

__host__ __device__ constexpr int combine_warps_per_row(int splits) {
  int warps = 1;
  while (warps < kCombineWarps && warps * kCombineBatch < splits) warps *= 2;
  return warps;
}

template <typename Element, int kHeadDim>
__global__ void __launch_bounds__(32 * kCombineWarps) flash_decode_combine_kernel(
    const __grid_constant__ DecodeParams params) {
  constexpr int kPerLane = kHeadDim / 32;
  static_assert(kPerLane % 2 == 0);
  constexpr int kSlots = (kMaxDecodeSplits + 31) / 32;  // splits per lane
  __shared__ float partial[kCombineWarps][kHeadDim];
  const int splits = params.num_splits;
  const int warps_per_row = combine_warps_per_row(splits);
  const int rows_per_cta = kCombineWarps / warps_per_row;
  const int round = warps_per_row * kCombineBatch;  // splits per round trip
  const int64_t rows_total = int64_t{params.batch} * params.num_heads * params.seqlen_q;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int part = warp % warps_per_row;  // this warp's place among its row's
  const int64_t row = int64_t{blockIdx.x} * rows_per_cta + warp / warps_per_row;
  const bool in_range = row < rows_total;  // no return: every warp meets __syncthreads
  // Row r is (batch, query head, query), query fastest.
  auto batch_of = [&](int64_t r) {
    return static_cast<int>(r / (int64_t{params.num_heads} * params.seqlen_q));
  };
  auto head_of = [&](int64_t r) { return static_cast<int>(r / params.seqlen_q % params.num_heads); };
  auto query_of = [&](int64_t r) { return static_cast<int>(r % params.seqlen_q); };
  const int64_t row_safe = in_range ? row : 0;
  const int batch = batch_of(row_safe);
  const int query = query_of(row_safe);
  // The call's own inputs, written before the main kernel began.
  const DecodeLengths lens = decode_lengths(params, batch);
  const MaskParams band = decode_band(params, lens.total);
  const IndexRange keys = BandMask(band, batch).row_keys(query, lens.total);
  wait_for_prerequisite_grids();

  float o[kPerLane] = {};
  float lse = -INFINITY;
  if (in_range && keys.begin < keys.end) {
    // Split s of round b, u: s = b * round + u * warps_per_row + part.
    const float* shares = params.out_partial + row * kHeadDim + lane * kPerLane;
    float2 x[kCombineBatch][kPerLane / 2];
    auto load_round = [&](int b) {
      CUTE_UNROLL
      for (int u = 0; u < kCombineBatch; ++u) {
        const int s = b * round + u * warps_per_row + part;
        const float* share = shares + int64_t{s} * rows_total * kHeadDim;
        CUTE_UNROLL
        for (int c = 0; c < kPerLane / 2; ++c) {
          x[u][c] = s < splits ? *reinterpret_cast<const float2*>(share + 2 * c)
                               : make_float2(0.f, 0.f);
        }
      }
    };
    load_round(0);
    float weight[kSlots];  // the lse of split j * 32 + lane, then its weight
    float max = -INFINITY;
    CUTE_UNROLL
    for (int j = 0; j < kSlots; ++j) {
      const int s = j * 32 + lane;
      weight[j] = s < splits ? params.lse_partial[s * rows_total + row] : -INFINITY;
      max = fmaxf(max, weight[j]);
    }
    for (int offset = 16; offset > 0; offset /= 2) {
      max = fmaxf(max, __shfl_xor_sync(0xffffffff, max, offset));
    }
    if (max == -INFINITY) {
      lse = NAN;
      for (float& v : o) v = NAN;
    } else {
      float sum = 0.f;
      CUTE_UNROLL
      for (int j = 0; j < kSlots; ++j) {
        if (weight[j] != -INFINITY) sum += expf(weight[j] - max);  // a NaN share makes the row NaN
      }
      for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffff, sum, offset);
      lse = max + logf(sum);
      CUTE_UNROLL
      for (int j = 0; j < kSlots; ++j) {
        weight[j] = weight[j] == -INFINITY ? 0.f : expf(weight[j] - lse);
      }
      for (int b = 0; b * round < splits; ++b) {
        if (b > 0) load_round(b);
        CUTE_UNROLL
        for (int u = 0; u < kCombineBatch; ++u) {
          const int s = b * round + u * warps_per_row + part;
          // Split s's weight is in lane s % 32, slot s / 32, the same slot
          // for every part (warps_per_row divides 32); chosen by comparisons
          // rather than an index, which would put weight[] in local memory.
          const int slot = (b * round + u * warps_per_row) / 32;
          float lane_weight = weight[0];
          CUTE_UNROLL
          for (int j = 1; j < kSlots; ++j) lane_weight = slot == j ? weight[j] : lane_weight;
          const float w = __shfl_sync(0xffffffff, lane_weight, s % 32);
          CUTE_UNROLL
          for (int c = 0; c < kPerLane / 2; ++c) {
            o[2 * c] += w * x[u][c].x;
            o[2 * c + 1] += w * x[u][c].y;
          }
        }
      }
    }
  }
  auto out_row_ptr = [&](int64_t r) {
    return static_cast<Element*>(params.out) + batch_of(r) * params.out_batch_stride +
           query_of(r) * params.out_row_stride + head_of(r) * params.out_head_stride;
  };
  if (warps_per_row == 1) {
    // The row is this warp's alone (uniform over the CTA, as the splits
    // are): its lanes write their columns, no pass through shared memory.
    if (in_range) {
      Element* dst = out_row_ptr(row) + lane * kPerLane;
      CUTE_UNROLL
      for (int c = 0; c < kPerLane; c += 2) {
        *reinterpret_cast<uint32_t*>(dst + c) = pack_pair(Element(o[c]), Element(o[c + 1]));
      }
      if (lane == 0) params.lse[row] = lse;
    }
    return;
  }
  CUTE_UNROLL
  for (int c = 0; c < kPerLane; ++c) partial[warp][lane * kPerLane + c] = o[c];
  __syncthreads();
  // A row's parts summed, two columns per thread.
  constexpr int kPairs = kHeadDim / 2;
  for (int i = threadIdx.x; i < rows_per_cta * kPairs; i += 32 * kCombineWarps) {
    const int r = i / kPairs, c = 2 * (i % kPairs);
    const int64_t out_row = int64_t{blockIdx.x} * rows_per_cta + r;
    if (out_row >= rows_total) break;
    float a = 0.f, b = 0.f;
    for (int w = r * warps_per_row; w < (r + 1) * warps_per_row; ++w) {
      a += partial[w][c];
      b += partial[w][c + 1];
    }
    Element* dst = out_row_ptr(out_row) + c;
    *reinterpret_cast<uint32_t*>(dst) = pack_pair(Element(a), Element(b));
  }
  if (in_range && part == 0 && lane == 0) params.lse[row] = lse;
}

}  // namespace jflash::cuda

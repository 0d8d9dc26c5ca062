// Decode: out = softmax(scale * Q K^T) V for a few query rows per sequence
// against a KV cache (jflash.flash_attention_with_kvcache), split over the key
// range ("flash decoding") where the batch alone would leave SMs idle.
//
// One CTA per (sequence, kv head, split of the key range, block of rows). Its
// rows are the kv head's query heads times the queries (jflash/decode.h):
// every row reads the same K and V, so each cache byte is read once per kv
// head, and the work is bound by those reads, not by the tensor cores.
//
// 4 warps, each with a 16-row slice of the rows and its own online softmax
// (max, sum and O in registers):
//   kWarpsN = 4 (at most 16 rows): the warps share the rows and take a
//     quarter of each key tile each, so that the MMAs of one tile run on 4 warps;
//   kWarpsN = 1 (more rows): each warp takes 16 of 64 rows and every key.
// K and V tiles of 64 keys stream through a ring of `stages` shared-memory
// buffers with 16-byte cp.async, stages - 1 tiles ahead of the one computed.
// Key rows are gathered one by one: a paged cache through its block table
// (blocks of any multiple of 16 rows), the appended keys from k_new and
// v_new, and rows past the sequence zero-filled without a read.
//
// Epilogue: the warps' (max, sum, O) combine through shared memory. One split
// writes out and lse; several write their share (O over their own sum, and
// their lse) to XLA's float32 scratch, and flash_decode_combine_kernel
// (decode_combine.h) merges them by lse. The CTAs of split 0 also write k_new
// and v_new into the cache (decode_append_sm80.h), rows that no CTA of the
// call reads from the cache. The host side (which kernel, ring depth, split
// count, the launches): decode_launch_sm80.h.
#pragma once

#include <cuda_runtime.h>

#include <cute/tensor.hpp>

#include "cuda/decode_append_sm80.h"
#include "cuda/kernel_traits_sm80.h"
#include "cuda/tile_sizes.h"
#include "cuda/utils.h"
#include "jflash/decode.h"
#include "jflash/params.h"

namespace jflash::cuda {

using namespace cute;

template <typename Element_, int kHeadDim_, int kWarpsN_>
struct DecodeTraitsSm80 : BaseTraits<Element_, kHeadDim_, 128> {
  using Base = BaseTraits<Element_, kHeadDim_, 128>;
  using typename Base::Element;
  using typename Base::SmemLayoutAtom;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kNWarps = 4;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kWarpsN = kWarpsN_;  // warps that split a key tile
  static constexpr int kWarpsM = kNWarps / kWarpsN;
  static constexpr int kBlockM = 16 * kWarpsM;  // rows per CTA
  static constexpr DecodeTile kTile = decode_tile(kHeadDim);
  static constexpr int kBlockN = kTile.block_n;
  static_assert(kTile.stages >= 1 && kTile.stages <= kMaxDecodeStages);
  static constexpr int kWarpKeys = kBlockN / kWarpsN;  // keys of a tile per warp
  static_assert(kWarpKeys % 16 == 0, "P V takes a warp's keys 16 at a time");
  // Q stays in registers across the tiles (head_dim / 4 words per thread) up
  // to head dim 128; at 256 the output accumulator needs them, and Q's
  // fragments are read from shared memory per tile.
  static constexpr bool kQInRegisters = kHeadDim <= 128;
  // CTAs per SM the registers must allow (the launch bound): the work is
  // latency-bound per warp, so the SM needs several CTAs' warps (tile_sizes.h).
  static constexpr int kMinBlocksPerSm = kWarpsN == 4 ? kTile.ctas_per_sm : 1;

  // One warp's products: S (16 x warp keys) = Q K^T and O (16 x head_dim) += P V.
  using TiledMma = TiledMMA<MmaAtom16816<Element>, Layout<Shape<_1, _1, _1>>, Tile<_16, _16, _16>>;

  // Shared memory, in slices of one warp's share (swizzled like the forward's
  // tiles): Q as kWarpsM slices of 16 rows, then per stage kWarpsN K slices
  // and kWarpsN V slices of kWarpKeys keys.
  using SmemLayoutQ = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<_16, Int<kHeadDim>>{}));
  using SmemLayoutKV =
      decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kWarpKeys>, Int<kHeadDim>>{}));
  using SmemLayoutVt = decltype(composition(
      SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kWarpKeys>>{}, GenRowMajor{})));
  using SmemLayoutVtNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutVt{}));
  static constexpr int kQElements = kBlockM * kHeadDim;
  static constexpr int kTileElements = kBlockN * kHeadDim;  // one K (or V) tile
  static constexpr int kSliceElements = kWarpKeys * kHeadDim;

  static constexpr int smem_bytes(int stages) {
    return decode_smem_bytes(kHeadDim, kBlockM, stages);
  }
  static_assert(smem_bytes(1) >= int(sizeof(float)) * kWarpsN * kBlockM * (kHeadDim + 2),
                "the epilogue's float32 outputs fit in the ring");
  // The ring depth under a shared-memory limit: the table's, or what fits
  // (at least 1; the handler reports a device that fits none).
  static constexpr int stages_for(int smem_limit) {
    int stages = kTile.stages;
    while (stages > 1 && smem_bytes(stages) > smem_limit) --stages;
    return stages;
  }
};

// Where row r (< kBlockN) and column c of a K (or V) tile lie in a stage:
// the warp's key slice, then the swizzled slice layout.
template <typename Traits>
__host__ __device__ constexpr int decode_kv_offset(int r, int c) {
  return (r / Traits::kWarpKeys) * Traits::kSliceElements +
         typename Traits::SmemLayoutKV{}(r % Traits::kWarpKeys, c);
}

// Rows 16 apart lie a fixed distance apart, whatever the column: a thread's
// row of a 16-row group lands at its row's offset in the first group plus
// the group's (swizzles act within 8-row atoms). The load path relies on it.
template <typename Traits>
constexpr bool decode_kv_groups_shift() {
  for (int g = 16; g < Traits::kBlockN; g += 16) {
    for (int r = 0; r < 16; ++r) {
      for (int c = 0; c < Traits::kHeadDim; c += 8) {
        if (decode_kv_offset<Traits>(g + r, c) !=
            decode_kv_offset<Traits>(r, c) + decode_kv_offset<Traits>(g, 0)) {
          return false;
        }
      }
    }
  }
  return true;
}

// 16 bytes global -> shared; zero-filled without a read where !valid (src must
// still be a mapped address).
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src),
               "r"(valid ? 16 : 0));
}

// Waits until at most `pending` cp.async groups are in flight (an immediate in
// PTX, hence the branches).
__device__ __forceinline__ void cp_async_wait_pending(int pending) {
  static_assert(kMaxDecodeStages - 2 == 2, "one case per pending count");
  switch (pending) {
    case 2: cp_async_wait<2>(); break;
    case 1: cp_async_wait<1>(); break;
    default: cp_async_wait<0>(); break;
  }
}

// One CTA's work unit: blockIdx.x is (((batch * num_heads_kv + kv_head) *
// num_splits + split) * row_blocks + row_block), so that the row blocks of one
// kv head and split run side by side and find its K/V tiles in L2.
struct DecodeUnit {
  int batch, kv_head, split, row_block;
};

__device__ __forceinline__ DecodeUnit decode_unit(const DecodeParams& p, int row_blocks) {
  int unit = blockIdx.x;
  DecodeUnit u;
  u.row_block = unit % row_blocks;
  unit /= row_blocks;
  u.split = unit % p.num_splits;
  unit /= p.num_splits;
  u.kv_head = unit % p.num_heads_kv;
  u.batch = unit / p.num_heads_kv;
  return u;
}

template <typename Traits>
__global__ void __launch_bounds__(Traits::kNThreads, Traits::kMinBlocksPerSm)
    flash_decode_kernel(const __grid_constant__ DecodeParams params, const int stages) {
  using Element = typename Traits::Element;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kWarpsN = Traits::kWarpsN;
  constexpr int kWarpKeys = Traits::kWarpKeys;
  constexpr int kThreads = Traits::kNThreads;

  extern __shared__ __align__(128) char smem_raw[];
  Element* smem = reinterpret_cast<Element*>(smem_raw);
  const int tidx = threadIdx.x;
  const int warp = tidx / 32, lane = tidx % 32;
  const int warp_m = warp / kWarpsN, warp_n = warp % kWarpsN;
  // Launched as a programmatic dependent of the stream's previous kernel
  // (sm_90a): nothing above reads memory, and nothing below may before that
  // kernel's writes are visible. Then the combine may launch: its CTAs wait
  // for this grid's shares at griddepcontrol.wait, which covers the whole
  // grid and its writes, and read the call's inputs before it, which the wait
  // above has made visible.
  wait_for_prerequisite_grids();
  launch_dependent_grids();

  const int group = params.heads_per_kv;
  const int rows = decode_rows(params);
  const int row_blocks = ceil_div(rows, kBlockM);
  const DecodeUnit unit = decode_unit(params, row_blocks);
  const int batch = unit.batch, kv_head = unit.kv_head, split = unit.split;
  const int row_block = unit.row_block;
  const int m_begin = row_block * kBlockM;
  const int m_end = min(m_begin + kBlockM, rows);

  // The keys this block's queries see, and this split's tiles of them.
  const DecodeLengths lens = decode_lengths(params, batch);
  const MaskParams band = decode_band(params, lens.total);
  const BandMask mask(band, batch);
  const int query_first = m_begin / group;
  const int query_end = (m_end - 1) / group + 1;
  const IndexRange keys = mask.keys_of_rows(query_first, query_end, lens.total);
  const int first_tile = static_cast<int>(keys.begin) / kBlockN;
  const int end_tile =
      keys.begin < keys.end ? ceil_div(static_cast<int>(keys.end), kBlockN) : first_tile;
  const TileSpan span = split_tiles(first_tile, end_tile, split, params.num_splits);
  // Keys that every row of the block sees: the band's bounds rise with the
  // row, so they run from the last row's first key to the first row's end.
  // Tiles inside need no per-element mask (tested once here, not per tile).
  const int full_begin = static_cast<int>(mask.row_keys(query_end - 1, lens.total).begin);
  const int full_end = static_cast<int>(mask.row_keys(query_first, lens.total).end);

  // ---- Loads: 16-byte chunks, kRowsPerPass rows per pass of the CTA.
  constexpr int kChunks = kHeadDim / 8;
  constexpr int kRowsPerPass = kThreads / kChunks;
  static_assert(kBlockN % kRowsPerPass == 0 && 16 % kRowsPerPass == 0);
  const int chunk = tidx % kChunks;
  const int pass_row = tidx / kChunks;
  const Element* q_base = static_cast<const Element*>(params.q) + batch * params.q_batch_stride +
                          int64_t{kv_head} * group * params.q_head_stride + chunk * 8;
  CUTE_UNROLL
  for (int r = pass_row; r < kBlockM; r += kRowsPerPass) {
    const int m = m_begin + r;
    const bool valid = m < m_end;
    const Element* src = valid ? q_base + (m / group) * params.q_row_stride +
                                     (m % group) * params.q_head_stride
                               : q_base;
    cp_async_16(smem + (r / 16) * 16 * kHeadDim + typename Traits::SmemLayoutQ{}(r % 16, chunk * 8),
                src, valid);
  }
  const Element* k_cache = static_cast<const Element*>(params.k_cache);
  const Element* v_cache = static_cast<const Element*>(params.v_cache);
  const int64_t cache_head = kv_head * params.cache_head_stride + chunk * 8;
  const int64_t new_head = batch * params.new_batch_stride + kv_head * params.new_head_stride +
                           chunk * 8;
  Element* ring = smem + Traits::kQElements;
  const bool paged = params.block_table != nullptr;
  // A contiguous cache is one block per sequence: row `key` (< lens.cache <=
  // capacity) lies at key * row_stride within it, no division needed.
  const int64_t sequence_rows = int64_t{batch} * params.cache_block_stride + cache_head;
  // This thread's rows of a 16-row group (pass_row + j) in a stage, the same
  // for every group and tile; a group adds a constant (decode_kv_groups_shift).
  static_assert(decode_kv_groups_shift<Traits>());
  constexpr int kGroupRows = 16 / kRowsPerPass;  // a thread's rows per group
  int row_slot[kGroupRows];
  CUTE_UNROLL
  for (int j = 0; j < kGroupRows; ++j) {
    row_slot[j] = decode_kv_offset<Traits>(pass_row + j * kRowsPerPass, chunk * 8);
  }
  auto load_tile = [&](int tile, int stage) {
    Element* k_stage = ring + stage * 2 * Traits::kTileElements;
    const int key0 = tile * kBlockN;
    if (key0 + kBlockN <= lens.cache) {
      // The common case, every row from the cache: no per-row tests, one
      // address per 16-row group, whose rows share a block of a paged cache
      // (block_size is a multiple of 16), and the next row's a stride on;
      // the shared-memory places are this thread's row_slot plus a constant.
      // A quarter of the instructions the per-row places took: paged caches
      // read 2-5% faster, contiguous ones as fast (docs/decode.md).
      const int64_t row_step = int64_t{kRowsPerPass} * params.cache_row_stride;
      int64_t offset = 0;
      CUTE_UNROLL
      for (int g = 0; g < kBlockN; g += 16) {
        const int first = key0 + g + pass_row;  // pass_row < kRowsPerPass <= 16
        if (paged) {
          offset = cache_row_offset(params, batch, first) + cache_head;
        } else if (g == 0) {
          offset = sequence_rows + int64_t{first} * params.cache_row_stride;
        }
        CUTE_UNROLL
        for (int j = 0; j < kGroupRows; ++j) {
          Element* dst = k_stage + row_slot[j] + decode_kv_offset<Traits>(g, 0);
          cp_async_16(dst, k_cache + offset, true);
          cp_async_16(dst + Traits::kTileElements, v_cache + offset, true);
          offset += row_step;
        }
      }
      return;
    }
    CUTE_UNROLL
    for (int r = pass_row; r < kBlockN; r += kRowsPerPass) {
      const int key = tile * kBlockN + r;
      const Element* k_src = k_cache;  // zero-filled, not read
      const Element* v_src = v_cache;
      if (key < lens.cache) {
        const int64_t offset = cache_row_offset(params, batch, key) + cache_head;
        k_src = k_cache + offset;
        v_src = v_cache + offset;
      } else if (key < lens.total) {
        const int64_t offset = new_head + (key - lens.cache) * params.new_row_stride;
        k_src = static_cast<const Element*>(params.k_new) + offset;
        v_src = static_cast<const Element*>(params.v_new) + offset;
      }
      Element* dst = k_stage + decode_kv_offset<Traits>(r, chunk * 8);
      cp_async_16(dst, k_src, key < lens.total);
      cp_async_16(dst + Traits::kTileElements, v_src, key < lens.total);
    }
  };

  // Split 0's first row block writes k_new, v_new into the cache.
  const bool appends = split == 0 && row_block == 0 && params.seqlen_new > 0;
  NewRowsAppend<Element, kHeadDim, kThreads> append;
  if (appends) append.load(params, batch, kv_head, lens.cache);
  // Prologue: Q with the first tile in the first cp.async group, then one
  // group per tile up to stages - 1 tiles ahead (empty groups keep the count).
  for (int s = 0; s < max(stages - 1, 1); ++s) {
    if (span.begin + s < span.end) load_tile(span.begin + s, s);
    cp_async_fence();
  }
  if (appends) append.store(params, batch, kv_head, lens.cache);

  // ---- One warp's operands.
  typename Traits::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(lane);
  Tensor sQ = make_tensor(make_smem_ptr(smem + warp_m * 16 * kHeadDim), typename Traits::SmemLayoutQ{});
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);
  auto smem_tiled_copy_Q = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_copy_Q = smem_tiled_copy_Q.get_thread_slice(lane);
  Tensor tSsQ = smem_thr_copy_Q.partition_S(sQ);
  auto smem_tiled_copy_K = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_copy_K = smem_tiled_copy_K.get_thread_slice(lane);
  auto smem_tiled_copy_V =
      make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, tiled_mma);
  auto smem_thr_copy_V = smem_tiled_copy_V.get_thread_slice(lane);
  Tensor tSrK = thr_mma.partition_fragment_B(
      make_tensor(make_smem_ptr(ring), typename Traits::SmemLayoutKV{}));
  Tensor tOrVt = thr_mma.partition_fragment_B(
      make_tensor(make_smem_ptr(ring), typename Traits::SmemLayoutVtNoSwizzle{}));

  // (row, col) of each score and output element in the warp's 16-row slice.
  Tensor tScS = thr_mma.partition_C(make_identity_tensor(Shape<_16, Int<kWarpKeys>>{}));
  Tensor tScS_rc = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));
  Tensor acc_o = partition_fragment_C(tiled_mma, Shape<_16, Int<kHeadDim>>{});
  Tensor o_rc = make_tensor(acc_o.data(), acc_rowcol(acc_o.layout()));
  constexpr int kRows = decltype(size<0>(o_rc))::value;  // rows this thread holds
  float row_max[kRows];  // running max of the log2-domain scores
  float row_sum[kRows];  // running sum of exp2(score - row_max), this thread's columns
  int row_query[kRows];  // the query of each row
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    row_max[r] = -INFINITY;
    row_sum[r] = 0.f;
    row_query[r] = (m_begin + warp_m * 16 + get<0>(tScS_rc(r, 0))) / group;
  }
  clear(acc_o);
  // softcap: s2 = softcap * log2(e) * tanh(scale * q.k / softcap), else scale * log2(e) * q.k.
  const bool softcap = params.softcap > 0.f;
  const float score_scale = softcap ? params.softmax_scale / params.softcap
                                    : params.softmax_scale_log2;
  const float cap_log2 = params.softcap * float(M_LOG2E);

  for (int tile = span.begin; tile < span.end; ++tile) {
    const int step = tile - span.begin;
    const int stage = step % stages;
    cp_async_wait_pending(stages - 2);
    __syncthreads();  // this tile visible to all warps; all are done with the stage refilled next
    if (stages > 1) {
      if (tile + stages - 1 < span.end) load_tile(tile + stages - 1, (step + stages - 1) % stages);
      cp_async_fence();
    }
    if constexpr (Traits::kQInRegisters) {
      if (step == 0) copy(smem_tiled_copy_Q, tSsQ, smem_thr_copy_Q.retile_D(tSrQ));
    }
    Element* k_slice = ring + stage * 2 * Traits::kTileElements + warp_n * Traits::kSliceElements;
    Tensor tSsK = smem_thr_copy_K.partition_S(
        make_tensor(make_smem_ptr(k_slice), typename Traits::SmemLayoutKV{}));
    Tensor tOsVt = smem_thr_copy_V.partition_S(make_tensor(
        make_smem_ptr(k_slice + Traits::kTileElements), typename Traits::SmemLayoutVt{}));

    // S = Q K^T   (16 x warp keys)
    Tensor acc_s = partition_fragment_C(tiled_mma, Shape<_16, Int<kWarpKeys>>{});
    clear(acc_s);
    if constexpr (Traits::kQInRegisters) {
      gemm_rs(acc_s, tSrQ, tSrK, tSsK, tiled_mma, smem_tiled_copy_K, smem_thr_copy_K);
    } else {
      gemm_ss(acc_s, tSrQ, tSrK, tSsQ, tSsK, tiled_mma, smem_tiled_copy_Q, smem_thr_copy_Q,
              smem_tiled_copy_K, smem_thr_copy_K);
    }

    // Scores in the log2 domain, then the mask (any sign of the scale).
    Tensor s = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));
    CUTE_UNROLL
    for (int i = 0; i < size(s); ++i) {
      s(i) = softcap ? cap_log2 * fast_tanh(s(i) * score_scale) : s(i) * score_scale;
    }
    const int tile_key0 = tile * kBlockN;
    if (tile_key0 < full_begin || tile_key0 + kBlockN > full_end) {
      const int key0 = tile_key0 + warp_n * kWarpKeys;
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        CUTE_UNROLL
        for (int c = 0; c < size<1>(s); ++c) {
          const int key = key0 + get<1>(tScS_rc(r, c));
          if (key >= lens.total || !mask.visible(int64_t{row_query[r]}, int64_t{key})) {
            s(r, c) = -INFINITY;
          }
        }
      }
    }

    // Online softmax (a row lives in one quad of lanes), O rescaled.
    online_softmax(s, o_rc, row_max, row_sum);

    // O += P V   (P converted in registers to the A-operand layout)
    Tensor p = convert_fragment<Element>(acc_s);
    Tensor tOrP = make_tensor(p.data(), acc_as_a_operand(p.layout()));
    gemm_rs(acc_o, tOrP, tOrVt, tOsVt, tiled_mma, smem_tiled_copy_V, smem_thr_copy_V);

    if (stages == 1) {
      __syncthreads();  // every warp is done with the only stage
      if (tile + 1 < span.end) load_tile(tile + 1, 0);
      cp_async_fence();
    }
  }

  // ---- Epilogue: the warps' states through shared memory (the ring is free).
  cp_async_wait<0>();
  __syncthreads();
  float* o_smem = reinterpret_cast<float*>(smem_raw);  // [kWarpsN][kBlockM][kHeadDim]
  float* max_smem = o_smem + kWarpsN * kBlockM * kHeadDim;  // [kWarpsN][kBlockM], log2 domain
  float* sum_smem = max_smem + kWarpsN * kBlockM;
  Tensor tOcO = thr_mma.partition_C(make_identity_tensor(Shape<_16, Int<kHeadDim>>{}));
  Tensor tOcO_rc = make_tensor(tOcO.data(), acc_rowcol(tOcO.layout()));
  const int slot0 = warp_n * kBlockM + warp_m * 16;
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const int row = get<0>(tOcO_rc(r, 0));
    CUTE_UNROLL
    for (int c = 0; c < size<1>(o_rc); ++c) {
      o_smem[(slot0 + row) * kHeadDim + get<1>(tOcO_rc(r, c))] = o_rc(r, c);
    }
    const float sum = quad_allreduce(row_sum[r], SumOp{});
    if (lane % 4 == 0) {
      max_smem[slot0 + row] = row_max[r];
      sum_smem[slot0 + row] = sum;
    }
  }
  __syncthreads();

  // out = O / l, lse = max + ln l over the warps' combined state. One split:
  // the forward's rules (no key: 0 and -inf; l = 0, every score -inf: NaN).
  // Several: this split's share, lse -inf where it has none (no key here, or
  // every score -inf), which the combine tells apart by the mask.
  const bool direct = params.num_splits == 1;
  const int64_t rows_total = int64_t{params.batch} * params.num_heads * params.seqlen_q;
  constexpr int kVecs = kHeadDim / 4;  // 4 columns per thread and step
  for (int i = tidx; i < kBlockM * kVecs; i += kThreads) {
    const int row = i / kVecs, col = i % kVecs * 4;
    const int m = m_begin + row;
    if (m >= m_end) continue;
    float max = -INFINITY;
    CUTE_UNROLL
    for (int w = 0; w < kWarpsN; ++w) max = fmaxf(max, max_smem[w * kBlockM + row]);
    const float max_safe = max == -INFINITY ? 0.f : max;
    float sum = 0.f;
    float o[4] = {0.f, 0.f, 0.f, 0.f};
    CUTE_UNROLL
    for (int w = 0; w < kWarpsN; ++w) {
      const float weight = fast_exp2(max_smem[w * kBlockM + row] - max_safe);
      sum += weight * sum_smem[w * kBlockM + row];
      const float4 part = *reinterpret_cast<const float4*>(o_smem + (w * kBlockM + row) * kHeadDim + col);
      o[0] += weight * part.x;
      o[1] += weight * part.y;
      o[2] += weight * part.z;
      o[3] += weight * part.w;
    }
    const int query = m / group;
    const int head = kv_head * group + m % group;
    const IndexRange row_keys = mask.row_keys(query, lens.total);
    const bool empty = row_keys.begin >= row_keys.end || (!direct && sum == 0.f);
    float lse = -INFINITY;
    if (empty) {
      o[0] = o[1] = o[2] = o[3] = 0.f;  // a select: O may hold 0 * NaN of a NaN in v
    } else {
      lse = sum == 0.f ? NAN : max * float(M_LN2) + logf(sum);
      const float inv_sum = 1.f / sum;
      for (float& x : o) x *= inv_sum;
    }
    const int64_t row_index = (int64_t{batch} * params.num_heads + head) * params.seqlen_q + query;
    if (direct) {
      Element* dst = static_cast<Element*>(params.out) + batch * params.out_batch_stride +
                     query * params.out_row_stride + head * params.out_head_stride + col;
      *reinterpret_cast<uint2*>(dst) = make_uint2(pack_pair(Element(o[0]), Element(o[1])),
                                                  pack_pair(Element(o[2]), Element(o[3])));
      if (col == 0) params.lse[row_index] = lse;
    } else {
      const int64_t partial = split * rows_total + row_index;
      *reinterpret_cast<float4*>(params.out_partial + partial * kHeadDim + col) =
          make_float4(o[0], o[1], o[2], o[3]);
      if (col == 0) params.lse_partial[partial] = lse;
    }
  }
}

}  // namespace jflash::cuda

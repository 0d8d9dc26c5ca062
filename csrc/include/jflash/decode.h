// The rules every decode kernel (the CUDA kernels and the CPU twin) follows
// alike: each sequence's lengths, where a key row lives, which query rows a
// kv head's tile holds, which key tiles a split takes, and how many splits a
// call gets. DecodeParams (params.h) holds the tensors.
#pragma once

#include <cstdint>

#include "jflash/mask.h"
#include "jflash/params.h"

namespace jflash {

// Splits of a key range: at most kMaxDecodeSplits, and the heuristic gives
// each at least kMinDecodeSplitKeys keys of the cache's capacity, so that a
// split's loads fill its pipeline before it ends.
inline constexpr int kMaxDecodeSplits = 128;
inline constexpr int kMinDecodeSplitKeys = 256;
// A paged cache's blocks hold a multiple of this many rows: a key tile's rows
// come in 16-row runs that lie in one block (the CUDA kernel addresses a run
// once).
inline constexpr int kPagedBlockMultiple = 16;

JFLASH_HOST_DEVICE int load_int32(const int32_t* p) {
#if defined(__CUDA_ARCH__)
  return __ldg(p);
#else
  return *p;
#endif
}

JFLASH_HOST_DEVICE int decode_capacity(const DecodeParams& p) {
  return p.max_blocks_per_seq * p.block_size;
}

// Sequence b's keys: cache_seqlens[b] clamped to [0, capacity - seqlen_new],
// so that neither the append nor a read leaves the cache, then the
// seqlen_new appended ones.
struct DecodeLengths {
  int cache;  // keys read from the cache
  int total;  // keys attended: cache + seqlen_new
};

JFLASH_HOST_DEVICE DecodeLengths decode_lengths(const DecodeParams& p, int batch) {
  const int most = decode_capacity(p) - p.seqlen_new;
  int cache = load_int32(p.cache_seqlens + batch);
  cache = cache < 0 ? 0 : (cache > most ? most : cache);
  return {cache, cache + p.seqlen_new};
}

// The band of sequence b: causal and the window aligned to its own length.
JFLASH_HOST_DEVICE MaskParams decode_band(const DecodeParams& p, int seqlen_k) {
  return bottom_right_band(p.seqlen_q, seqlen_k, p.window_left, p.window_right);
}

// Element offset of cache row `position` (< capacity) of sequence b at kv
// head 0: its block through the block table, whose ids are clamped to the
// cache's blocks.
JFLASH_HOST_DEVICE int64_t cache_row_offset(const DecodeParams& p, int batch, int position) {
  const int index = position / p.block_size;
  int block = batch;
  if (p.block_table != nullptr) {
    block = load_int32(p.block_table + int64_t{batch} * p.max_blocks_per_seq + index);
    block = block < 0 ? 0 : (block >= p.num_cache_blocks ? p.num_cache_blocks - 1 : block);
  }
  return block * p.cache_block_stride + int64_t{position - index * p.block_size} * p.cache_row_stride;
}

// The rows of a kv head's tile are its group's query heads times the queries,
// query-major: row m is query m / heads_per_kv of query head
// kv_head * heads_per_kv + m % heads_per_kv. Every row of the tile reads the
// same K and V, so each byte of the cache is read once per kv head.
JFLASH_HOST_DEVICE int decode_rows(const DecodeParams& p) { return p.heads_per_kv * p.seqlen_q; }

// Tiles [first, end) of a key range, cut into num_splits runs of equal length
// (the last ones may be short or empty): split `split`'s run.
struct TileSpan {
  int begin;
  int end;  // empty when begin >= end
};

JFLASH_HOST_DEVICE TileSpan split_tiles(int first, int end, int split, int num_splits) {
  const int per = (end - first + num_splits - 1) / num_splits;
  const int begin = first + split * per;
  const int last = begin + per < end ? begin + per : end;
  return {begin < last ? begin : last, last};
}

// What a split costs besides its keys, in keys' worth of one slot's
// streaming time (docs/decode.md, "Split-KV"): every CTA (task) pays a fixed
// start and drain (launch, the first tile's latency, the epilogue), and more
// than one split pays the combine (a second launch and a pass over the
// partial results). tile_keys: the kernel's key tile, the unit in which a
// split's run is cut.
struct DecodeSplitCost {
  int tile_keys;
  int unit_overhead_keys;
  int combine_keys;
};

// The CUDA kernel's (decode_launch_sm80.h), fitted to the H100 measurements of
// docs/decode.md: a slot streams a 64-key tile in ~3 us when the GPU reads at
// full bandwidth, and a CTA's fixed cost is ~100 keys (~4.7 us: a wave's
// ramp and drain).
inline constexpr DecodeSplitCost kCudaDecodeSplitCost{64, 100, 64};

// num_splits for `units` work units (batch x kv heads x row blocks) on
// `processors` (SMs, or CPU threads) that each run up to `per_processor` units
// at once, over caches of `capacity` keys. 1 where the units fill most of the
// slots (processors x per_processor). Otherwise the split count of least
// predicted time: the units a processor runs, ceil(units x splits /
// processors), times a split's keys plus a unit's fixed cost, plus the
// combine's; a processor's bandwidth is shared by the units on it, so the
// model counts its keys, not its waves. Two rules from the H200 measurements
// of docs/decode.md ("Choosing the split count"):
//   - Counts that leave most processors with one unit are not considered
//     where the capacity allows two: an SM with one CTA streams slowly (a
//     CTA's loads wait on its own warps' work).
//   - Where the least time splits at all, the most splits in one wave whose
//     time is within 3% of it are taken: more CTAs per SM hide more latency,
//     which the model does not see.
// Each split holds at least kMinDecodeSplitKeys keys, and a split's keys are
// whole tiles, so only counts that shorten a run's tile count are candidates.
// The capacity, not each sequence's length (device data), bounds the splits:
// the kernels cut each sequence's own key range into num_splits.
inline int decode_num_splits(int64_t units, int64_t processors, int64_t per_processor,
                             int64_t capacity, const DecodeSplitCost& cost) {
  if (per_processor < 1) per_processor = 1;
  const int64_t slots = processors * per_processor;
  if (units <= 0 || processors <= 0 || units * 5 >= slots * 4) return 1;
  int64_t most = (capacity + kMinDecodeSplitKeys - 1) / kMinDecodeSplitKeys;
  most = most < 1 ? 1 : (most > kMaxDecodeSplits ? kMaxDecodeSplits : most);
  const int64_t tile = cost.tile_keys > 0 ? cost.tile_keys : 1;
  const int64_t tiles = (capacity + tile - 1) / tile;
  const auto run_tiles = [&](int64_t splits) { return (tiles + splits - 1) / splits; };
  const auto time = [&](int64_t splits) {
    const int64_t per = (units * splits + processors - 1) / processors;
    return per * (run_tiles(splits) * tile + cost.unit_overhead_keys) +
           (splits > 1 ? cost.combine_keys : 0);
  };
  // The fewest splits that give most processors two units, where possible.
  const int64_t fill = processors * (per_processor < 2 ? per_processor : 2) * 4 / 5;
  int64_t least = (fill + units - 1) / units;
  if (least < 1 || least > most) least = 1;
  while (least > 1 && run_tiles(least - 1) == run_tiles(least)) --least;  // same runs, fewer CTAs
  const auto candidate = [&](int64_t splits) {
    return splits == least || run_tiles(splits) < run_tiles(splits - 1);
  };
  int64_t best_splits = least;
  for (int64_t splits = least + 1; splits <= most; ++splits) {
    if (candidate(splits) && time(splits) < time(best_splits)) best_splits = splits;
  }
  if (best_splits > 1) {
    const int64_t limit = time(best_splits) * 103 / 100;
    for (int64_t splits = most; splits > best_splits; --splits) {
      if (candidate(splits) && units * splits <= slots && time(splits) <= limit) {
        return static_cast<int>(splits);
      }
    }
  }
  return static_cast<int>(best_splits);
}

}  // namespace jflash

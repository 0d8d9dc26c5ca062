// The Hopper kernels' schedules: for the forward, a static persistent one
// (the host's grid size and each CTA's sequence of tiles, query blocks of a
// head); for the backward, one CTA per (key block, head split, kv head, batch)
// unit, whose steps KeyBlockSteps (flash_bwd_preprocess.h) gives.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <numeric>
#include <queue>
#include <vector>

#include <cute/config.hpp>
#include <cute/int_tuple.hpp>

#include "cuda/sm90/band_units_sm90.h"
#include "jflash/params.h"

namespace jflash::cuda::sm90 {

// Persistent CTAs walk one static sequence of work units, CTA c taking units
// c, c + gridDim.x, ...; units run head-major (a head's units fastest, then
// head, then batch), so the CTAs running at one time share heads and their
// K/V stay in L2.
//   Dense mask (NoMask): a unit is one query block; all take the same time.
//   Otherwise (a band): query blocks differ in length (causal: later query
//     blocks see more keys; a window: a rising run, then a plateau), so a unit
//     is one block or a pair of them (BandUnits, band_units_sm90.h), chosen on
//     the host so that units take about the same time.
//     Measured on the way (H200, causal, head dim 128): one block per unit
//     gave 0.77x cuDNN at seq 16k, because a stride of gridDim.x over
//     query-block-fastest tiles hands each CTA one residue class of blocks,
//     all long or all short; longest-first across heads gave 0.93-0.94x; the
//     p-th longest block of a head paired with its p-th shortest, more.
//     Under a window (4096, 0) at seq 16k that pairing left CTAs 0.85 of the
//     way to an even split (the plateau's blocks paired with each other make
//     units twice the rising pairs' length); the plateau one per unit, 0.97.
// Slot t is tile t % kTilesPerUnit of unit t / kTilesPerUnit.
template <int kBlockM, int kBlockN, typename Mask>
class TileSchedulerSm90 {
 public:
  // The producer loads every key tile of a query block's key range; those
  // that the policy finds empty (segment ids) are computed fully masked.
  static constexpr int kTilesPerUnit = Mask::kDense ? 1 : 2;

  // Query blocks of a head.
  CUTE_HOST_DEVICE static int num_m_blocks(const FwdParams& params) {
    return cute::ceil_div(params.seqlen_q, kBlockM);
  }

  // ---------------------------------------------------------------- host
  // Persistent: one CTA per SM (the shared memory allows no more), or fewer
  // when there are fewer work units; under a band, the units and CTA count of
  // choose_band_schedule. num_ctas is -1 where the slots would overflow the
  // device's int32 count.
  static BandSchedule schedule(const FwdParams& params, int sm_count) {
    const int m_blocks = num_m_blocks(params);
    const int64_t copies = int64_t{params.num_heads} * params.batch;
    if constexpr (Mask::kDense) {
      const int64_t num_units = int64_t{m_blocks} * copies;
      return {BandUnits{}, num_units > INT32_MAX ? -1 : std::min<int64_t>(num_units, sm_count)};
    } else {
      // Calls with one shape and mask come back every training step: remember.
      static std::mutex mutex;
      static std::map<std::array<int64_t, 6>, BandSchedule> chosen;
      const std::array<int64_t, 6> key{params.seqlen_q,    params.seqlen_k,    copies,
                                       params.mask.diag_lo, params.mask.diag_hi, sm_count};
      std::lock_guard<std::mutex> lock(mutex);
      auto it = chosen.find(key);
      if (it == chosen.end()) {
        // Key tiles per query block, by the band (segment ids live on the device).
        std::vector<int> tiles(m_blocks);
        const auto band = Mask(params.mask, 0).band();
        for (int m = 0; m < m_blocks; ++m) {
          const int row0 = m * kBlockM;
          tiles[m] = blocks_covering<kBlockN>(
                         band.keys_of_rows(row0, std::min(row0 + kBlockM, params.seqlen_q),
                                           params.seqlen_k))
                         .count;
        }
        it = chosen.emplace(key, choose_band_schedule(tiles, copies, sm_count)).first;
      }
      BandSchedule result = it->second;
      if (int64_t{result.units.units_per_head()} * copies * kTilesPerUnit > INT32_MAX) {
        result.num_ctas = -1;
      }
      return result;
    }
  }

  // -------------------------------------------------------------- device
  struct Tile {
    bool valid;  // false for the unused second half of a one-block unit
    int m_block, head, batch;
    int row_begin, row_end;      // query rows
    int n_block_begin, n_tiles;  // key tiles the band lets these rows see
  };

  // units: the band's unit plan (schedule()); unused when dense.
  __device__ __forceinline__ TileSchedulerSm90(const FwdParams& params, const BandUnits& units)
      : params_(params),
        units_(units),
        units_per_head_(Mask::kDense ? num_m_blocks(params) : units.units_per_head()),
        num_slots_(units_per_head_ * kTilesPerUnit * params.num_heads * params.batch),
        first_slot_(blockIdx.x * kTilesPerUnit) {}

  __device__ __forceinline__ int num_slots() const { return num_slots_; }
  __device__ __forceinline__ int first_slot() const { return first_slot_; }
  // The slot after t for this CTA: the unit's next tile, else the first tile
  // of its next unit.
  __device__ __forceinline__ int next_slot(int t) const {
    return t % kTilesPerUnit == kTilesPerUnit - 1 ? t + 1 + (gridDim.x - 1) * kTilesPerUnit
                                                  : t + 1;
  }

  __device__ __forceinline__ Tile tile_at(int t) const {
    Tile tile;
    const int unit = t / kTilesPerUnit;
    const int p = unit % units_per_head_;
    tile.head = (unit / units_per_head_) % params_.num_heads;
    tile.batch = unit / (units_per_head_ * params_.num_heads);
    if constexpr (!Mask::kDense) {
      const BandUnits::Unit blocks = units_.unit(p);
      tile.valid = t % 2 == 0 || blocks.second >= 0;
      tile.m_block = t % 2 == 0 || !tile.valid ? blocks.first : blocks.second;
    } else {
      tile.m_block = p;
      tile.valid = true;
    }
    tile.row_begin = tile.m_block * kBlockM;
    tile.row_end = min(tile.row_begin + kBlockM, params_.seqlen_q);
    const BlockSpan n_blocks = blocks_covering<kBlockN>(
        Mask(params_.mask, tile.batch).keys_of_rows(tile.row_begin, tile.row_end, params_.seqlen_k));
    tile.n_block_begin = n_blocks.first;
    tile.n_tiles = n_blocks.count;
    return tile;
  }

  // The first slot after t whose tile has work (num_slots() if none).
  __device__ __forceinline__ int next_work(int t) const {
    for (t = next_slot(t); t < num_slots_; t = next_slot(t)) {
      const Tile tile = tile_at(t);
      if (tile.valid && tile.n_tiles > 0) break;
    }
    return t;
  }

 private:
  const FwdParams& params_;
  const BandUnits& units_;
  int units_per_head_;
  int num_slots_;
  int first_slot_;
};

// The Hopper backward's units, one CTA each (its shared memory allows one per
// SM): a key block of a kv head and batch, and a share of the kv head's query
// heads. Units run key block and head split fastest (unit = n_block *
// head_splits + split), then kv head, then batch: under a causal band the key
// blocks that visit the most query blocks start first.
//
// GQA with head_splits > 1: the group's heads_per_kv query heads are split
// over head_splits CTAs per key block, which add their partial dK, dV into
// params.dkv_accum. One CTA per key block, summing the whole group, leaves SMs
// idle where the units are few (B * kv heads * key blocks near the SM count)
// and, under a causal band, runs the first key block, which sees every query
// block of every head of the group, alone at the end.
template <int kBlockM, int kBlockN, typename Mask>
class BwdSchedulerSm90 {
 public:
  // ---------------------------------------------------------------- host
  // The split of the query heads for a call: the divisor s of heads_per_kv
  // whose units finish first when they go, in launch order, each to the SM
  // that frees first (a list-scheduling simulation; time in steps, one step =
  // one query block of one head against the key block, plus kUnitSteps per
  // unit: K and V loaded again, dK and dV added in float32). A larger split
  // must win by 0.5%. 1 without dkv_accum (MHA, CPU) or in deterministic mode
  // (the partial sums would arrive in any order), and where the unsplit units
  // already fill kEnoughWaves waves. forced > 0 (JFLASH_CUDA_BWD_HEAD_SPLITS)
  // takes that split where it divides the group.
  //
  // Measured (H100, bfloat16, head dim 128, 16 query heads per kv head, B * S =
  // 16384, forward+backward TFLOP/s for split 1 / 2 / 4 / 8 / 16): causal 4k
  // 255 / 323 / 422 / 424 / 414, causal 16k 291 / 499 / 515 / 517 / 508;
  // unmasked 4k 509 / 512 / 503 / 502 / 493, 16k 563 / 561 / 558 / 554 / 546.
  // The simulation's times relative to its best, for the same splits: causal
  // 4k 1.97 / 1.49 / 1.00 / 1.02 / 1.05, causal 16k 2.02 / 1.01 / 1.00 / 1.00 /
  // 1.01, unmasked 1.00 / 1.00 / 1.01 / 1.01 / 1.03: it picks 4, 4, 1, 1. (A
  // rule on the mean and the longest unit alone picked 2 at causal 4k, where
  // the batches run one after the other.)
  static constexpr int kUnitSteps = 2;      // K, V loads and the dK, dV write of a unit
  static constexpr int kEnoughWaves = 8;    // unsplit units past this many waves: no split
  static constexpr int kMaxSimulated = 64;  // waves of units simulated at most

  static int head_splits(const BwdParams& params, int sm_count, int forced) {
    const int group = params.heads_per_kv;
    if (params.dkv_accum == nullptr || params.dq_semaphore != nullptr || group == 1) return 1;
    if (forced > 0) return group % forced == 0 ? forced : 1;
    const int n_blocks = cute::ceil_div(params.seqlen_k, kBlockN);
    const int64_t heads_kv = int64_t{params.num_heads_kv} * params.batch;
    if (n_blocks == 0 || n_blocks * heads_kv >= int64_t{kEnoughWaves} * sm_count) return 1;
    // Calls with one shape and mask come back every training step: remember.
    static std::mutex mutex;
    static std::map<std::array<int64_t, 7>, int> chosen;
    const std::array<int64_t, 7> key{params.seqlen_q,      params.seqlen_k, heads_kv,
                                     group,                params.mask.diag_lo,
                                     params.mask.diag_hi, sm_count};
    std::lock_guard<std::mutex> lock(mutex);
    if (auto it = chosen.find(key); it != chosen.end()) return it->second;
    // Query blocks each key block visits (by the band: segment ids live on the device).
    std::vector<int64_t> visits(n_blocks);
    const auto mask = Mask(params.mask, 0).band();
    for (int n = 0; n < n_blocks; ++n) {
      const int key0 = n * kBlockN;
      visits[n] = blocks_covering<kBlockM>(
                      mask.rows_of_keys(key0, std::min(key0 + kBlockN, params.seqlen_k),
                                        params.seqlen_q))
                      .count;
    }
    int best = 1;
    double best_time = 0;
    for (int s = 1; s <= group; ++s) {
      if (group % s) continue;
      if (s > 1 && n_blocks * s * heads_kv > int64_t{kMaxSimulated} * sm_count) break;
      // Finish times of the SMs, a min-heap; units in launch order.
      std::priority_queue<double, std::vector<double>, std::greater<double>> free_at;
      for (int i = 0; i < sm_count; ++i) free_at.push(0.0);
      double end = 0;
      for (int64_t h = 0; h < heads_kv; ++h) {
        for (int n = 0; n < n_blocks; ++n) {
          const double steps = double(visits[n] * group) / s + kUnitSteps;
          for (int split = 0; split < s; ++split) {
            const double done = free_at.top() + steps;
            free_at.pop();
            free_at.push(done);
            end = std::max(end, done);
          }
        }
      }
      if (s == 1 || end < 0.995 * best_time) {
        best = s;
        best_time = end;
      }
    }
    chosen.emplace(key, best);
    return best;
  }

  // CTAs of the launch (params.head_splits set), -1 past the int32 grid.
  static int64_t grid_size(const BwdParams& params) {
    const int64_t units = int64_t{cute::ceil_div(params.seqlen_k, kBlockN)} *
                          params.head_splits * params.num_heads_kv * params.batch;
    return units > INT32_MAX ? -1 : units;
  }

  // -------------------------------------------------------------- device
  struct Unit {
    int n_block, split, kv_head, batch;
  };
  __device__ __forceinline__ static Unit unit(const BwdParams& params) {
    const int per_head = cute::ceil_div(params.seqlen_k, kBlockN) * params.head_splits;
    const int u = blockIdx.x % per_head;
    const int rest = blockIdx.x / per_head;
    return {u / params.head_splits, u % params.head_splits, rest % params.num_heads_kv,
            rest / params.num_heads_kv};
  }
};

}  // namespace jflash::cuda::sm90

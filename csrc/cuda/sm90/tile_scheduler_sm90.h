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
#include "cuda/sm90/pipeline_sm90.h"
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
//   Segment ids (kDynamic): the units' lengths are device data (documents of
//     any length), so a fixed stride hands some CTAs more work than others
//     (simulated for 32 documents of 128..8192 tokens, 16 heads, 131 CTAs:
//     the busiest CTA 3% over the mean unmasked, 7% causal, 18% causal with
//     documents on tile borders). The CTAs take units from a counter in
//     order instead (params.tile_counter, zeroed before the launch): the
//     first unit of CTA c is c, each next one gridDim.x + the counter's old
//     value, taken by the producer one unit ahead and handed to the
//     consumers through shared memory (IntRingSm90). Units still run
//     head-major, so the CTAs running at one time share K/V in L2.
// Slot t is tile t % kTilesPerUnit of unit t / kTilesPerUnit.
template <int kBlockM, int kBlockN, typename Mask>
class TileSchedulerSm90 {
 public:
  // The producer loads every key tile of a query block's key range; those
  // that the policy finds empty (segment ids) are computed fully masked.
  static constexpr int kTilesPerUnit = Mask::kDense ? 1 : 2;
  static constexpr bool kDynamic = Mask::kHasSegments;

  // Query blocks of a head.
  CUTE_HOST_DEVICE static int num_m_blocks(const FwdParams& params) {
    return cute::ceil_div(params.seqlen_q, kBlockM);
  }

  // ---------------------------------------------------------------- host
  // Persistent: one CTA per SM (the shared memory allows no more), or fewer
  // when there are fewer work units; under a band, the units and CTA count of
  // choose_band_schedule (with segment ids, the all-paired units). num_ctas
  // is -1 where the slots would overflow the device's int32 count.
  static BandSchedule schedule(const FwdParams& params, int sm_count) {
    const int m_blocks = num_m_blocks(params);
    const int64_t copies = int64_t{params.num_heads} * params.batch;
    if constexpr (Mask::kDense) {
      const int64_t num_units = int64_t{m_blocks} * copies;
      return {BandUnits{}, num_units > INT32_MAX ? -1 : std::min<int64_t>(num_units, sm_count)};
    } else {
      BandSchedule result;
      if constexpr (Mask::kHasSegments) {
        // The band's lengths say little about a packed row's tiles, which the
        // ids cut on the device: these keep the all-paired units (the plans
        // above were measured without ids). One CTA per unit up to the SM
        // count, not a coprime count: the dynamic schedule hands units out in
        // order, so no CTA is tied to some residues of the units per head.
        const BandUnits units = BandUnits::all_paired(m_blocks);
        result = {units, band_ctas(units, copies, sm_count, /*coprime=*/false)};
      } else {
        // Calls with one shape and mask come back every training step: remember.
        static std::mutex mutex;
        static std::map<std::array<int64_t, 6>, BandSchedule> chosen;
        const std::array<int64_t, 6> key{params.seqlen_q,    params.seqlen_k,    copies,
                                         params.mask.diag_lo, params.mask.diag_hi, sm_count};
        std::lock_guard<std::mutex> lock(mutex);
        auto it = chosen.find(key);
        if (it == chosen.end()) {
          // Key tiles per query block, by the band.
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
        result = it->second;
      }
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
  __device__ __forceinline__ int num_units() const { return num_slots_ / kTilesPerUnit; }
  __device__ __forceinline__ int first_slot() const { return first_slot_; }
  // The slot after t for this CTA: the unit's next tile, else the first tile
  // of its next unit.
  __device__ __forceinline__ int next_slot(int t) const {
    return t % kTilesPerUnit == kTilesPerUnit - 1 ? t + 1 + (gridDim.x - 1) * kTilesPerUnit
                                                  : t + 1;
  }

  // The consumers' first slot, and the slot after t; num_slots() past their
  // last. Dynamic: a unit's tiles in turn, then the producer's next unit from
  // `units` (`popped`: entries read so far).
  __device__ __forceinline__ int consumer_first(IntRingSm90& units, int& popped) const {
    if constexpr (kDynamic) {
      const int unit = units.pop(popped++);
      return unit < num_units() ? unit * kTilesPerUnit : num_slots_;
    } else {
      return first_slot_;
    }
  }
  __device__ __forceinline__ int consumer_next(int t, IntRingSm90& units, int& popped) const {
    if constexpr (kDynamic) {
      return t % kTilesPerUnit != kTilesPerUnit - 1 ? t + 1 : consumer_first(units, popped);
    } else {
      return next_slot(t);
    }
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
// heads. The hardware starts CTAs in launch order as SMs free up, so the
// order decides how the launch ends. A row is a (batch, kv head); rows go in
// groups of launch_group (params.launch_group), a group's units key block
// first, then row, then head split (launch_group 1: a row's key blocks in
// order, then the next row). Under a causal band the key blocks that visit
// the most query blocks start first within a group.
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
  // Both choices come from a list-scheduling simulation of the launch: units
  // in launch order, each to the SM that frees first; time in steps, one step
  // = one query block of one head against the key block, plus kUnitSteps per
  // unit (K and V loaded again, dK and dV added in float32).
  //
  // head_splits: the divisor s of heads_per_kv whose units finish first
  // (launch_group 1). A larger split must win by 0.5%. 1 without dkv_accum
  // (MHA, CPU) or in deterministic mode (the partial sums would arrive in any
  // order), and where the unsplit units already fill kEnoughWaves waves. forced
  // > 0 (JFLASH_CUDA_BWD_HEAD_SPLITS) takes that split where it divides the
  // group.
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
  //
  // launch_group: under a band, the smallest of 1, 2, 4, 8 rows per group
  // within 0.5% of the best simulated time, where it wins by 1% over 1. One
  // row at a time, a row's long first key blocks start while the previous
  // rows' short last ones run, and the last rows' long blocks end the launch
  // alone: causal, head dim 128, seq 4k (64 rows of 32 key blocks) simulates
  // at 0.94 of an even split, at 0.99 with 4 rows per group; a window (4096,
  // 0) at 16k at 0.98, 0.995. Groups stay small because the rows of a group run
  // at once and their Q, dO and dQ share L2. 1 in deterministic mode (its dQ
  // order was measured with one row at a time), without a band, and with
  // segment ids (the band's visits say little about a packed row's). Measured
  // (H100, bfloat16, causal forward+backward, A/B in one run): head dim 128
  // +1.3% / +2.0% / +2.9% at seq 2k / 4k / 8k (groups of 8, 4, 2), head dim 64
  // +1.5% / +0.9% / +2.2%; the window above level (the simulated gain did not
  // show).
  static constexpr int kUnitSteps = 2;      // K, V loads and the dK, dV write of a unit
  static constexpr int kEnoughWaves = 8;    // unsplit units past this many waves: no split
  static constexpr int kMaxSimulated = 64;  // waves of units simulated at most (splits)
  static constexpr int kMaxGroupSimulated = 256;  // waves simulated at most (groups)
  static constexpr int kMaxLaunchGroup = 8;

  struct Plan {
    int head_splits = 1;
    int launch_group = 1;
  };

  static Plan plan(const BwdParams& params, int sm_count, int forced) {
    const int group = params.heads_per_kv;
    const bool may_split = params.dkv_accum != nullptr && params.dq_semaphore == nullptr &&
                           group > 1;
    const bool may_group =
        !Mask::kDense && !Mask::kHasSegments && params.dq_semaphore == nullptr;
    const int n_blocks = cute::ceil_div(params.seqlen_k, kBlockN);
    const int64_t rows = int64_t{params.num_heads_kv} * params.batch;
    Plan plan;
    if (n_blocks == 0 || (!may_split && !may_group)) return plan;
    if (may_split && forced > 0) {
      plan.head_splits = group % forced == 0 ? forced : 1;
      if (!may_group) return plan;
    }
    // Calls with one shape and mask come back every training step: remember.
    static std::mutex mutex;
    static std::map<std::array<int64_t, 9>, Plan> chosen;
    const std::array<int64_t, 9> key{params.seqlen_q,      params.seqlen_k,
                                     rows,                 group,
                                     params.mask.diag_lo,  params.mask.diag_hi,
                                     sm_count,             may_split ? forced : -1,
                                     may_group};
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
    auto simulate = [&](int splits, int launch_group) {
      std::priority_queue<double, std::vector<double>, std::greater<double>> free_at;
      for (int i = 0; i < sm_count; ++i) free_at.push(0.0);
      double end = 0;
      for (int64_t g0 = 0; g0 < rows; g0 += launch_group) {
        const int64_t rows_in = std::min<int64_t>(launch_group, rows - g0);
        for (int n = 0; n < n_blocks; ++n) {
          const double steps = double(visits[n] * group) / splits + kUnitSteps;
          for (int64_t u = 0; u < rows_in * splits; ++u) {
            const double done = free_at.top() + steps;
            free_at.pop();
            free_at.push(done);
            end = std::max(end, done);
          }
        }
      }
      return end;
    };
    if (may_split && forced <= 0 && n_blocks * rows < int64_t{kEnoughWaves} * sm_count) {
      double best_time = 0;
      for (int s = 1; s <= group; ++s) {
        if (group % s) continue;
        if (s > 1 && n_blocks * s * rows > int64_t{kMaxSimulated} * sm_count) break;
        const double time = simulate(s, 1);
        if (s == 1 || time < 0.995 * best_time) {
          plan.head_splits = s;
          best_time = time;
        }
      }
    }
    if (may_group &&
        n_blocks * plan.head_splits * rows <= int64_t{kMaxGroupSimulated} * sm_count) {
      double times[kMaxLaunchGroup + 1] = {};
      double best_time = 0;
      for (int g = 1; g <= kMaxLaunchGroup && (g == 1 || g / 2 < rows); g *= 2) {
        times[g] = simulate(plan.head_splits, g);
        best_time = g == 1 ? times[g] : std::min(best_time, times[g]);
      }
      for (int g = 2; g <= kMaxLaunchGroup && g / 2 < rows; g *= 2) {
        if (times[g] <= 1.005 * best_time && times[g] < 0.99 * times[1]) {
          plan.launch_group = g;
          break;
        }
      }
    }
    chosen.emplace(key, plan);
    return plan;
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
    const BwdLaunchOrder order{cute::ceil_div(params.seqlen_k, kBlockN), params.head_splits,
                               params.num_heads_kv * params.batch, params.launch_group};
    const BwdLaunchOrder::Unit u = order.at(blockIdx.x);
    return {u.n_block, u.split, u.row % params.num_heads_kv, u.row / params.num_heads_kv};
  }
};

}  // namespace jflash::cuda::sm90

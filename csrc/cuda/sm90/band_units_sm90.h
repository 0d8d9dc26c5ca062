// The Hopper forward's work units under a band (tile_scheduler_sm90.h): which
// query blocks of a head share a unit. The host picks them per call shape so
// that units take about the same time; the device maps a unit index to its
// blocks. And the Hopper backward's launch order. Plain integer code, no
// CuTe: tests/band_units_check.cc checks it on the host.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "jflash/mask.h"

namespace jflash::cuda::sm90 {

// The query blocks of a head, [0, num_blocks), in four runs of units:
//   [lo, pair_end)          paired, the p-th block with the p-th from the run's
//                           end: where later blocks see more keys (causal), each
//                           pair sees about as many keys as the longest block;
//   [pair_end, fall_begin)  one block per unit (a window's plateau of blocks that
//                           all see the same number of keys);
//   [fall_begin, hi)        paired likewise, where later blocks see fewer keys;
//   [0, lo) and [hi, num_blocks)  one block per unit, last: blocks that see no
//                           key (rows before a bottom-right band reaches the
//                           keys). They still store their rows (output 0).
// A unit is (first, second), computed in that order (in a rising or falling
// run the longer block first); second < 0 where the unit holds one block.
struct BandUnits {
  int num_blocks = 0;
  int lo = 0, pair_end = 0, fall_begin = 0, hi = 0;

  struct Unit {
    int first, second;
  };

  JFLASH_HOST_DEVICE int rising_units() const { return (pair_end - lo + 1) / 2; }
  JFLASH_HOST_DEVICE int falling_units() const { return (hi - fall_begin + 1) / 2; }
  JFLASH_HOST_DEVICE int units_per_head() const {
    return rising_units() + (fall_begin - pair_end) + falling_units() + lo + (num_blocks - hi);
  }

  JFLASH_HOST_DEVICE Unit unit(int u) const {
    const int rising = rising_units();
    if (u < rising) {
      const int shorter = lo + u, longer = pair_end - 1 - u;
      return {longer, shorter < longer ? shorter : -1};
    }
    u -= rising;
    if (u < fall_begin - pair_end) return {pair_end + u, -1};
    u -= fall_begin - pair_end;
    if (u < falling_units()) {
      const int longer = fall_begin + u, shorter = hi - 1 - u;
      return {longer, shorter > longer ? shorter : -1};
    }
    u -= falling_units();
    return {u < lo ? u : hi + (u - lo), -1};
  }

  // Every block paired with its mirror image: the schedule for rows whose key
  // count grows (causal), and the fallback.
  static BandUnits all_paired(int num_blocks) {
    return {num_blocks, 0, num_blocks, num_blocks, num_blocks};
  }
};

// The Hopper backward's launch order (tile_scheduler_sm90.h, BwdSchedulerSm90):
// CTA block of a launch of n_blocks key blocks x splits head splits x rows
// (batch, kv head) rows, rows in groups of `group`, a group's units key block
// first, then row, then split.
struct BwdLaunchOrder {
  int n_blocks, splits, rows, group;

  struct Unit {
    int n_block, split, row;
  };
  JFLASH_HOST_DEVICE Unit at(int block) const {
    const int per_group = group * n_blocks * splits;
    const int g = block / per_group;
    const int in_group = block % per_group;
    const int rows_in = rows - g * group < group ? rows - g * group : group;
    const int in_block = in_group % (rows_in * splits);
    return {in_group / (rows_in * splits), in_block % splits, g * group + in_block / splits};
  }
};

// ------------------------------------------------------------------- host
// Persistent CTAs take units in a static round robin (CTA c: units c, c +
// num_ctas, ... of the head-major list), so a CTA's time is the sum of its
// units and the launch ends with the slowest CTA. The host simulates that sum
// for a few unit plans and CTA counts and keeps the fastest.
struct BandSchedule {
  BandUnits units;
  int64_t num_ctas;
};

// Time of a query block in key tiles: its tiles, plus one for its Q load and
// its output store.
constexpr int64_t kBandBlockCost = 1;
// Unit lists longer than this (heads * units per head) are not simulated:
// they keep the all-paired plan.
constexpr int64_t kBandMaxSimulated = int64_t{1} << 20;

// The CTAs for a plan: one per unit up to the SM count, or (coprime) the
// largest count coprime with the units per head. A common factor would hand
// each CTA the units of some residues only (e.g. 132 CTAs and 2 units per
// head: all long ones on even CTAs); coprime, every CTA cycles through all of
// them, for a few idle SMs (all-paired units, H200, head dim 64, causal: 0.59x
// -> 0.76x cuDNN at seq 512, 0.73x -> 0.77x at 1024, 0.81x -> 0.89x at 2048).
inline int64_t band_ctas(const BandUnits& units, int64_t copies, int sm_count, bool coprime) {
  const int64_t per_head = units.units_per_head();
  int64_t n = std::min<int64_t>(per_head * copies, sm_count);
  if (coprime) {
    while (n > 1 && std::gcd(n, per_head) != 1) --n;
  }
  return std::max<int64_t>(n, 1);
}

// The simulated time of a schedule, in key tiles: its slowest CTA's. tiles[m]:
// the key tiles query block m sees; copies: heads * batch (each a copy of the
// per-head unit list).
inline int64_t band_schedule_time(const std::vector<int>& tiles, int64_t copies,
                                  const BandSchedule& schedule) {
  const BandUnits& units = schedule.units;
  auto cost = [&](int m) { return m < 0 ? 0 : tiles[m] + kBandBlockCost; };
  const int per_head = units.units_per_head();
  std::vector<int64_t> unit_cost(per_head);
  for (int u = 0; u < per_head; ++u) {
    const BandUnits::Unit unit = units.unit(u);
    unit_cost[u] = cost(unit.first) + cost(unit.second);
  }
  std::vector<int64_t> load(schedule.num_ctas, 0);
  const int64_t total = per_head * copies;
  for (int64_t i = 0; i < total; ++i) load[i % schedule.num_ctas] += unit_cost[i % per_head];
  return *std::max_element(load.begin(), load.end());
}

// The schedule of a call: the all-paired plan on coprime CTAs unless another
// plan (below) or CTA count is simulated at least 1% faster (the model leaves
// out memory traffic and the masked tiles' extra work).
inline BandSchedule choose_band_schedule(const std::vector<int>& tiles, int64_t copies,
                                         int sm_count) {
  const int num_blocks = static_cast<int>(tiles.size());
  const BandUnits paired = BandUnits::all_paired(num_blocks);
  BandSchedule best{paired, band_ctas(paired, copies, sm_count, true)};
  if (num_blocks == 0 || paired.units_per_head() * copies > kBandMaxSimulated) return best;

  // Blocks that see keys, [lo, hi) (contiguous under a band), and the run of
  // the longest ones, [peak_begin, peak_end).
  int lo = 0, hi = num_blocks;
  while (lo < hi && tiles[lo] == 0) ++lo;
  while (hi > lo && tiles[hi - 1] == 0) --hi;
  if (lo == hi) return best;
  const int longest = *std::max_element(tiles.begin() + lo, tiles.begin() + hi);
  int peak_begin = lo, peak_end = hi;
  while (tiles[peak_begin] != longest) ++peak_begin;
  while (tiles[peak_end - 1] != longest) --peak_end;
  const BandUnits candidates[] = {
      {num_blocks, lo, hi, hi, hi},                // pairs over the blocks that see keys
      {num_blocks, lo, lo, hi, hi},                // one block per unit
      {num_blocks, lo, peak_begin, peak_end, hi},  // rising pairs, plateau, falling pairs
  };
  const int64_t base = band_schedule_time(tiles, copies, best);
  int64_t best_time = base;
  for (const BandUnits& units : candidates) {
    for (bool coprime : {true, false}) {
      const BandSchedule schedule{units, band_ctas(units, copies, sm_count, coprime)};
      const int64_t time = band_schedule_time(tiles, copies, schedule);
      if (time < best_time && 100 * time < 99 * base) {
        best = schedule;
        best_time = time;
      }
    }
  }
  return best;
}

}  // namespace jflash::cuda::sm90

// Host-side check of csrc/cuda/sm90/band_units_sm90.h, no GPU needed. The
// Hopper forward's work units under a band: for causal and window calls of
// several shapes and tile sizes, every query block of a head is in exactly
// one unit, the CTA count fits the SMs, and the chosen schedule is simulated
// no slower than the all-paired one (prints the simulated balance, the even
// split's time over the slowest CTA's, of a few calls). The Hopper backward's
// launch order (BwdLaunchOrder): every unit starts once. Compiled and run by
// tests/test_cuda_library.py; prints "ok".
#include <cstdint>
#include <cstdio>
#include <vector>

#include "host_check.h"
#include "cuda/sm90/band_units_sm90.h"

using namespace jflash;
using namespace jflash::cuda::sm90;

namespace {

// Key tiles of each query block under a bottom-right (left, right) window
// (-1: unbounded), as the scheduler's host code counts them.
std::vector<int> band_tiles(int seq_q, int seq_k, int left, int right, int block_m, int block_n) {
  MaskParams mask{};
  const int64_t off = int64_t{seq_k} - seq_q;
  mask.diag_lo = left < 0 ? -int64_t{seq_q} : off - left;
  mask.diag_hi = right < 0 ? int64_t{seq_k} : off + right;
  const BandMask band(mask, 0);
  std::vector<int> tiles((seq_q + block_m - 1) / block_m);
  for (int m = 0; m < static_cast<int>(tiles.size()); ++m) {
    const int row0 = m * block_m;
    const IndexRange keys = band.keys_of_rows(row0, std::min(row0 + block_m, seq_q), seq_k);
    const int begin = static_cast<int>(keys.begin), end = static_cast<int>(keys.end);
    tiles[m] = begin < end ? (end + block_n - 1) / block_n - begin / block_n : 0;
  }
  return tiles;
}

// The even split's time over the slowest CTA's, at sm_count SMs.
double balance(const std::vector<int>& tiles, int64_t copies, int sm_count,
               const BandSchedule& schedule) {
  int64_t total = 0;
  for (int t : tiles) total += t + kBandBlockCost;
  return double(total * copies) / sm_count / band_schedule_time(tiles, copies, schedule);
}

void check_units(const std::vector<int>& tiles, const BandUnits& units) {
  const int n = static_cast<int>(tiles.size());
  CHECK(units.num_blocks == n);
  std::vector<int> seen(n, 0);
  for (int u = 0; u < units.units_per_head(); ++u) {
    const BandUnits::Unit unit = units.unit(u);
    CHECK(unit.first >= 0 && unit.first < n);
    CHECK(unit.second >= -1 && unit.second < n);
    if (unit.first >= 0 && unit.first < n) ++seen[unit.first];
    if (unit.second >= 0 && unit.second < n) ++seen[unit.second];
  }
  for (int m = 0; m < n; ++m) CHECK(seen[m] == 1);
}

BandSchedule check_call(int seq_q, int seq_k, int left, int right, int block_m, int block_n,
                        int64_t copies, int sm_count, bool print = false) {
  const std::vector<int> tiles = band_tiles(seq_q, seq_k, left, right, block_m, block_n);
  const BandSchedule chosen = choose_band_schedule(tiles, copies, sm_count);
  check_units(tiles, chosen.units);
  CHECK(chosen.num_ctas >= 1 && chosen.num_ctas <= sm_count);
  CHECK(chosen.num_ctas <= int64_t{chosen.units.units_per_head()} * copies);
  const BandUnits paired = BandUnits::all_paired(static_cast<int>(tiles.size()));
  check_units(tiles, paired);
  const BandSchedule old{paired, band_ctas(paired, copies, sm_count, true)};
  CHECK(band_schedule_time(tiles, copies, chosen) <= band_schedule_time(tiles, copies, old));
  if (print) {
    std::printf("seq %d/%d window (%d, %d) block %dx%d x%lld: balance %.3f (all-paired %.3f)\n",
                seq_q, seq_k, left, right, block_m, block_n, static_cast<long long>(copies),
                balance(tiles, copies, sm_count, chosen), balance(tiles, copies, sm_count, old));
  }
  return chosen;
}

// The backward's launch order: every (key block, split, row) once; group 1
// is the order of a row's key blocks, then the next row.
void check_launch_order(int n_blocks, int splits, int rows, int group) {
  const BwdLaunchOrder order{n_blocks, splits, rows, group};
  const int total = n_blocks * splits * rows;
  std::vector<int> seen(total, 0);
  for (int block = 0; block < total; ++block) {
    const BwdLaunchOrder::Unit u = order.at(block);
    const bool in_range = u.n_block >= 0 && u.n_block < n_blocks && u.split >= 0 &&
                          u.split < splits && u.row >= 0 && u.row < rows;
    CHECK(in_range);
    if (in_range) ++seen[(u.row * n_blocks + u.n_block) * splits + u.split];
    if (group == 1) CHECK((u.row * n_blocks + u.n_block) * splits + u.split == block);
    // A group's rows start their key block n only after every row of the
    // group started n - 1 (rows of one group run side by side).
    if (in_range && u.n_block > 0 && block > 0) {
      const BwdLaunchOrder::Unit prev = order.at(block - 1);
      CHECK(prev.n_block == u.n_block || prev.n_block == u.n_block - 1);
    }
  }
  for (int i = 0; i < total; ++i) CHECK(seen[i] == 1);
}

}  // namespace

int main() {
  for (int group : {1, 2, 4, 8}) {
    for (int rows : {1, 3, 4, 7, 64}) {
      for (int splits : {1, 2, 4}) {
        for (int n_blocks : {1, 5, 32}) check_launch_order(n_blocks, splits, rows, group);
      }
    }
  }
  const int blocks[][2] = {{128, 128}, {192, 128}, {128, 64}};  // head dims 128, 64, 256
  const int seqs[][2] = {{1, 1},       {100, 70},    {512, 512},   {1000, 3000}, {2048, 2048},
                         {4096, 8192}, {8192, 4096}, {8192, 8192}, {16384, 16384}};
  const int windows[][2] = {{-1, 0}, {4096, 0}, {1024, 0}, {1024, 1024}, {0, 0}, {-1, 256}};
  for (const auto& b : blocks) {
    for (const auto& s : seqs) {
      for (const auto& w : windows) {
        for (int64_t copies : {1, 3, 16, 64}) {
          check_call(s[0], s[1], w[0], w[1], b[0], b[1], copies, 132);
        }
      }
    }
  }
  check_call(5, 5, 0, 0, 128, 128, 1, 1);  // one SM

  // A causal call keeps the all-paired units (no other plan is 1% faster).
  const BandSchedule causal = check_call(16384, 16384, -1, 0, 128, 128, 16, 132, true);
  CHECK(causal.units.pair_end == causal.units.num_blocks);
  // A window (4096, 0) at seq 16k: the plateau one block per unit.
  const BandSchedule window = check_call(16384, 16384, 4096, 0, 128, 128, 16, 132, true);
  const std::vector<int> tiles = band_tiles(16384, 16384, 4096, 0, 128, 128);
  CHECK(window.units.fall_begin - window.units.pair_end > 64);
  CHECK(balance(tiles, 16, 132, window) > 0.95);
  check_call(8192, 4096, -1, 0, 128, 128, 32, 132, true);  // rows that see no key
  check_call(16384, 16384, 4096, 0, 192, 128, 32, 132, true);
  return host_check::report();
}

// The one table of tile sizes: which (block_m, block_n, warps) each head dim runs.
//
// Everything else (shared-memory layouts, MMA warp layouts, grid shapes) is
// derived from these entries in kernel_traits.h. A change of tile size is a
// change of one line here, with its reason and measurement beside it
// (csrc/cuda/NOTES.md holds the measurements).
//
// Budgets that bound every entry (sm80 and sm90; sm86/sm89 allow only 99 KB of
// shared memory per block, and the handlers refuse, with an ffi::Error, the
// entries below that need more: forward head dim >= 224, backward >= 96):
//   registers: 255 per thread. The forward keeps an output accumulator of
//     block_m * head_dim / threads floats per thread; the backward keeps dK and
//     dV accumulators of 2 * block_n * head_dim / threads floats.
//   shared memory: 163 KB per block on sm80, 227 KB on sm90.
#pragma once

namespace jflash::cuda {

struct FwdTile {
  int block_m;    // query rows per CTA
  int block_n;    // key rows per main-loop step
  int num_warps;  // warps split block_m; each owns block_m / num_warps query rows
};

// smem = (block_m + 2 * block_n) * head_dim * 2 bytes (Q, one K and one V tile).
constexpr FwdTile fwd_tile(int head_dim) {
  switch (head_dim) {
    // Head dim 32: wide key tiles amortize the softmax over more MMAs; the
    // output accumulator is only 32 floats per thread.
    case 32: return {128, 128, 4};
    // Head dim 64: 64-key tiles measured 292 TFLOP/s against 283 for 128-key
    // tiles (H200, seq 16k; NOTES.md).
    case 64: return {128, 64, 4};
    // 128 rows x 4 warps = 32 rows per warp: each K/V fragment read from smem
    // feeds two MMAs (halves smem traffic vs 16 rows per warp); score tile 64
    // floats, output tile 96 / 128 floats per thread. Measured at head dim 128
    // (H200, seq 16k): 128x64x4 337, 128x32x4 320, 128x128x8 290, 64x64x4 276.
    case 96: return {128, 64, 4};
    case 128: return {128, 64, 4};
    // From 160 on, 4 warps would need > 160 accumulator floats per thread: use
    // 8 warps (16 rows each) and a 64-key tile; smem 96..128 KB. Measured at
    // head dim 256: 128x64x8 314, 64x64x4 308.
    case 160: return {128, 64, 8};
    case 192: return {128, 64, 8};
    case 224: return {128, 64, 8};
    case 256: return {128, 64, 8};
    default: return {0, 0, 0};
  }
}

struct BwdTile {
  int block_m;     // query rows per inner-loop step
  int block_n;     // key rows per CTA (dK, dV accumulated in registers)
  int num_warps;   // 8: the three MMA shapes of kernel_traits.h tile evenly on 8
  int q_stages;    // smem buffers for the Q and dO tiles: 2 = next step's tiles
                   // load during this step (the CTA is alone on its SM, so
                   // nothing else hides the load latency)
};

// smem = (2 * block_n + 2 * q_stages * block_m) * head_dim * 2
//        + 2 * block_m * block_n * 2 bytes
// (K, V, Q and dO tiles, then P and dS as half-precision operands of the dV, dK
// and dQ products).
constexpr BwdTile bwd_tile(int head_dim) {
  switch (head_dim) {
    // 128 keys per CTA halve the passes over Q and dO relative to 64; dK + dV
    // accumulators are head_dim floats per thread (<= 128). Two Q/dO stages:
    // 160 KB at head dim 128.
    case 32: return {64, 128, 8, 2};
    case 64: return {64, 128, 8, 2};
    case 96: return {64, 128, 8, 2};
    case 128: return {64, 128, 8, 2};
    // Larger head dims: 128 keys would need > 128 dK/dV floats per thread; 64
    // keys keep registers in budget. Two stages fit sm80's 163 KB up to head
    // dim 192 (160 KB); 224 and 256 single-buffer Q/dO (128 / 144 KB).
    case 160: return {64, 64, 8, 2};
    case 192: return {64, 64, 8, 2};
    case 224: return {64, 64, 8, 1};
    case 256: return {64, 64, 8, 1};
    default: return {0, 0, 0, 0};
  }
}

// Hopper forward (csrc/cuda/sm90/): TMA + wgmma, one producer warpgroup and
// block_m / 64 consumer warpgroups (64 query rows each), K and V tiles in a
// ring of `stages` shared-memory buffers. Head dims without an entry run the
// sm80 kernel on Hopper too.
struct Sm90FwdTile {
  int block_m;  // query rows per CTA: 64 per consumer warpgroup
  int block_n;  // key rows per step (the N of S = Q K^T, the K of O += P V)
  int stages;   // K/V ring depth
};

// smem = (block_m + 2 * stages * block_n) * head_dim * 2 bytes (<= 227 KB).
// registers per consumer thread: block_n / 2 score floats + head_dim / 2
// output floats + block_n / 4 words of P, under the setmaxnreg budget (240
// with two consumer warpgroups, 160 with three).
constexpr Sm90FwdTile sm90_fwd_tile(int head_dim) {
  switch (head_dim) {
    // Head dim 64: the products are half as long as at 128 while the softmax
    // is not, so two warpgroups cannot hide each other's softmax; three
    // (192 rows, no ping-pong) measured 436 / 493 TFLOP/s at seq 4k / 16k
    // against 390 / 443 for 128 x 128 (H200; csrc/cuda/NOTES.md).
    case 64: return {192, 128, 2};   // 88 KB
    // Head dim 128 (H200, unmasked, seq 4k / 16k): 128x128 with 2 stages
    // 560 / 604 TFLOP/s; 3 stages 563 / 602 (the loads are not what limits);
    // 128x192 535 / 593; 128x176 419 / 468.
    case 128: return {128, 128, 2};  // 160 KB
    // Head dim 256: 128 output floats per thread leave room for a 64-key
    // score tile only; 2 stages 596 / 673, 3 stages 600 / 667.
    case 256: return {128, 64, 2};   // 192 KB
    default: return {0, 0, 0};
  }
}

}  // namespace jflash::cuda

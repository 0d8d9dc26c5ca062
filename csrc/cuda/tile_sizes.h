// The one table of tile sizes: which (block_m, block_n, warps) each head dim runs.
//
// Everything else (shared-memory layouts, MMA warp layouts, grid shapes) is
// derived from these entries in kernel_traits_sm80.h. A change of tile size is a
// change of one line here, with its reason and measurement beside it
// (docs/cuda_kernels.md holds the measurements).
//
// Budgets that bound every entry:
//   registers: 255 per thread. The forward keeps an output accumulator of
//     block_m * head_dim / threads floats per thread; the backward keeps dK and
//     dV accumulators of 2 * block_n * head_dim / threads floats.
//   shared memory per block: 163 KB on sm80 and sm87, 227 KB on sm90, but
//     99 KB (101376 bytes) on sm86, sm89 and sm120. Hence two columns of the
//     sm80-kernel table (SmemClass): kLarge, for GPUs with >= 163 KB, and
//     kSmall, for 99 KB. A head dim whose kLarge tile fits in 99 KB has the
//     same kSmall entry and no second instantiation; the others get a
//     "small" instantiation (generate_kernels.py), which the handlers pick
//     when the device's limit is below the kLarge kernel's need.
#pragma once

#include "jflash/head_dims.h"
#include "jflash/mask.h"
#include "jflash/score.h"

namespace jflash::cuda {

enum class SmemClass { kLarge, kSmall };

// The per-block shared memory of the kSmall column (sm86 / sm89 opt-in limit).
constexpr int kSmallSmemBytes = 99 * 1024;

struct FwdTile {
  int block_m;    // query rows per CTA
  int block_n;    // key rows per main-loop step
  int num_warps;  // warps split block_m; each owns block_m / num_warps query rows

  constexpr bool operator==(const FwdTile& o) const {
    return block_m == o.block_m && block_n == o.block_n && num_warps == o.num_warps;
  }
};

// smem = (block_m + 2 * block_n) * head_dim * element bytes (Q, one K and one V
// tile; fwd_smem_bytes below).
//
// float32 (element_bytes 4; TF32 MMAs, m16n8k8): one column, for GPUs with
// >= 163 KB per block (the float32 kernels have no kSmall entry), head dims
// 64, 128 and 256 (head_dims.h, kFloat32HeadDims). Twice the bytes per
// element and, with 3xTF32, high and low operand fragments: 16 query rows per
// warp from head dim 128 on, where 32 would need more than 255 registers.
constexpr FwdTile fwd_tile_float32(int head_dim) {
  switch (head_dim) {
    case 64: return {128, 64, 4};   // 64 KB
    case 128: return {64, 64, 4};   // 96 KB: two CTAs per SM on sm90
    case 256: return {64, 32, 4};   // 128 KB
    default: return {0, 0, 0};
  }
}

constexpr FwdTile fwd_tile(int head_dim, SmemClass smem = SmemClass::kLarge,
                           int element_bytes = 2) {
  if (element_bytes == 4) return fwd_tile_float32(head_dim);
  if (smem == SmemClass::kSmall) {
    switch (head_dim) {
      // 128 + 2 * 64 rows would need 112 / 128 KB: 64 query rows and 4 warps
      // (the output accumulator stays at head_dim / 2 floats per thread); 84 /
      // 96 KB. At head dim 256 this tile measured 308 TFLOP/s against 314 for
      // the kLarge 128x64x8 (H200, seq 16k).
      case 224: return {64, 64, 4};
      case 256: return {64, 64, 4};
      default: break;  // the kLarge entry fits
    }
  }
  switch (head_dim) {
    // Head dim 32: wide key tiles amortize the softmax over more MMAs; the
    // output accumulator is only 32 floats per thread.
    case 32: return {128, 128, 4};
    // Head dim 64: 64-key tiles measured 292 TFLOP/s against 283 for 128-key
    // tiles (H200, seq 16k; docs/cuda_kernels.md, sm80 forward).
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
  int num_warps;
  int q_stages;    // smem buffers for the Q and dO tiles: 2 = next step's tiles
                   // load during this step (the CTA is alone on its SM, so
                   // nothing else hides the load latency)
  // Warp grids of the three products, as warps along their first mode (the
  // other num_warps / w go along the second; each warp repeat covers 16 x 16):
  //   S, dP (block_m x block_n), dK, dV (block_n x head_dim), dQ (block_m x head_dim).
  // A warp tile of m x n with k = 16 reads (m + n) * 32 bytes of smem per
  // m * n / 128 MMAs: square warp tiles read the least.
  int sdp_warps_m;
  int dkv_warps_n;
  int dq_warps_m;

  constexpr bool operator==(const BwdTile& o) const {
    return block_m == o.block_m && block_n == o.block_n && num_warps == o.num_warps &&
           q_stages == o.q_stages && sdp_warps_m == o.sdp_warps_m &&
           dkv_warps_n == o.dkv_warps_n && dq_warps_m == o.dq_warps_m;
  }
};

// smem = ((2 * block_n + 2 * q_stages * block_m) * head_dim
//         + 2 * block_m * block_n) * element bytes
// (K, V, Q and dO tiles, then P and dS as operands of the dV, dK and dQ
// products, in the input dtype; bwd_smem_bytes below).
//
// float32 (as for the forward): one Q/dO stage, and fewer keys per CTA than
// the 16-bit tiles, to fit 163 KB (160 / 160 / 136 KB).
constexpr BwdTile bwd_tile_float32(int head_dim) {
  switch (head_dim) {
    case 64: return {64, 128, 8, 1, 2, 4, 2};
    case 128: return {64, 64, 8, 1, 2, 4, 2};
    case 256: return {32, 32, 4, 1, 2, 2, 2};
    default: return {0, 0, 0, 0, 0, 0, 0};
  }
}

constexpr BwdTile bwd_tile(int head_dim, SmemClass smem = SmemClass::kLarge,
                           int element_bytes = 2) {
  if (element_bytes == 4) return bwd_tile_float32(head_dim);
  if (smem == SmemClass::kSmall) {
    switch (head_dim) {
      // 64 keys per CTA (two Q/dO stages: 88 KB; one stage from head dim 128 on:
      // 80 / 96 KB).
      case 96: return {64, 64, 8, 2, 2, 4, 4};
      case 128: return {64, 64, 8, 1, 2, 4, 2};
      case 160: return {64, 64, 8, 1, 2, 4, 4};
      // 32 keys per CTA: 80 KB. S/dP warps 4 x 2 (block_n is 32), dK/dV 2 x 4.
      case 192: return {64, 32, 8, 1, 4, 2, 2};
      // 64 x 32 would need 92 / 104 KB; 32 x 32 on 4 warps: 60 / 68 KB, dK and
      // dV 112 / 128 floats per thread.
      case 224: return {32, 32, 4, 1, 2, 2, 2};
      case 256: return {32, 32, 4, 1, 2, 2, 2};
      default: break;  // the kLarge entry fits
    }
  }
  switch (head_dim) {
    // 128 keys per CTA halve the passes over Q and dO relative to 64; dK + dV
    // accumulators are head_dim floats per thread (<= 128). Two Q/dO stages:
    // 160 KB at head dim 128. Warps: S/dP 2 x 4 (32 x 32 each), dK/dV 4 x 2;
    // dQ 2 x 4 (32 x 32 each) where head_dim % 64 == 0, else 4 x 2 (2 x 4
    // has each warp read a quarter of K^T per step, 4 x 2 half; docs/cuda_kernels.md, sm80 backward).
    case 32: return {64, 128, 8, 2, 2, 4, 4};
    case 64: return {64, 128, 8, 2, 2, 4, 2};
    case 96: return {64, 128, 8, 2, 2, 4, 4};
    case 128: return {64, 128, 8, 2, 2, 4, 2};
    // Larger head dims: 128 keys would need > 128 dK/dV floats per thread; 64
    // keys keep registers in budget. Two stages fit sm80's 163 KB up to head
    // dim 192 (160 KB); 224 and 256 single-buffer Q/dO (128 / 144 KB).
    case 160: return {64, 64, 8, 2, 2, 4, 4};
    case 192: return {64, 64, 8, 2, 2, 4, 2};
    case 224: return {64, 64, 8, 1, 2, 4, 4};
    case 256: return {64, 64, 8, 1, 2, 4, 2};
    default: return {0, 0, 0, 0, 0, 0, 0};
  }
}

// Dynamic shared memory of the sm80 kernels for a tile, in bytes
// (kernel_traits_sm80.h asserts that its layouts add up to the same).
constexpr int fwd_smem_bytes(const FwdTile& t, int head_dim, int element_bytes = 2) {
  return (t.block_m + 2 * t.block_n) * head_dim * element_bytes;
}
constexpr int bwd_smem_bytes(const BwdTile& t, int head_dim, int element_bytes = 2) {
  return ((2 * t.block_n + 2 * t.q_stages * t.block_m) * head_dim +
          2 * t.block_m * t.block_n) *
         element_bytes;
}

// Whether a head dim has a distinct kSmall tile (and so a "small" instantiation).
constexpr bool has_small_fwd_tile(int head_dim) {
  return !(fwd_tile(head_dim, SmemClass::kSmall) == fwd_tile(head_dim));
}
constexpr bool has_small_bwd_tile(int head_dim) {
  return !(bwd_tile(head_dim, SmemClass::kSmall) == bwd_tile(head_dim));
}

// The most rows of any sm80 forward tile (both columns, float32 too). That
// kernel steps between a tile's rows with a 32-bit stride
// (flash_fwd_kernel_sm80.h), so the handlers require this many rows times a
// row stride to stay below 2^31 elements.
constexpr int max_fwd_tile_rows() {
  int rows = 0;
  for (int d : kKernelHeadDims) {
    for (const FwdTile& t :
         {fwd_tile(d), fwd_tile(d, SmemClass::kSmall), fwd_tile(d, SmemClass::kLarge, 4)}) {
      rows = t.block_m > rows ? t.block_m : rows;
      rows = t.block_n > rows ? t.block_n : rows;
    }
  }
  return rows;
}

// Hopper forward (csrc/cuda/sm90/): TMA + wgmma, one producer warpgroup and
// block_m / 64 consumer warpgroups (64 query rows each), K and V tiles in
// rings of shared-memory buffers. Head dims without an entry run the entry of
// the next head dim that has one (head_dims.h, sm90_kernel_head_dim).
struct Sm90FwdTile {
  int block_m;   // query rows per CTA: 64 per consumer warpgroup
  int block_n;   // key rows per step (the N of S = Q K^T, the K of O += P V)
  int k_stages;  // K ring depth
  int v_stages;  // V ring depth
  bool q_in_registers = false;  // Q K^T reads Q from registers, not shared memory
  // The softmax takes each key tile against the running max first and
  // computes the tile again where a row's max rose too far (see the kernel).
  // Cycles per launch against the full max on every tile (H200, ncu,
  // docs/cuda_kernels.md, Hopper forward: softmax): head dim 64 -12% causal 16k, -5% unmasked 16k,
  // -3% causal 512; head dim 128 -5% / -6% unmasked 4k / 16k, -6% causal 4k.
  // Not at head dim 256, whose tensor pipe is already 97% busy: +5% to +9%
  // cycles with it (the redo path's registers spilled there).
  bool stale_max = false;
};

// setmaxnreg, by which the Hopper kernels' producer warpgroup gives registers
// away and the consumers take them, only moves registers within what the
// launch allocated: 64K / threads per thread (at most 255), in steps of 8.
// A consumer's increase past that waits for ever (a 32-register producer
// beside two 240-register consumers hung the backward). Both traits assert it.
constexpr bool sm90_register_split_fits(int producer, int consumer, int consumer_threads) {
  const int threads = 128 + consumer_threads;
  const int per_thread = (65536 / threads > 255 ? 255 : 65536 / threads) / 8 * 8;
  return producer * 128 + consumer * consumer_threads <= per_thread * threads;
}

// Ring depths: with stale_max a K tile stays until the softmax of its step
// has accepted its scores (they may be computed again), about a step longer
// than its product needs. A third K buffer, to load a step further ahead,
// measured no better: cycles per launch +0.5% to +2.3% at head dim 128,
// -0.3% to +0.6% at head dim 64 (H200, ncu; docs/cuda_kernels.md, Hopper forward: tiles).
//
// smem = (block_m + (k_stages + v_stages) * block_n) * head_dim * 2 bytes
// (<= 227 KB),
// plus the output slabs where they fit (sm90/traits_fwd_sm90.h).
// registers per consumer thread: block_n / 2 score floats + head_dim / 2
// output floats + block_n / 4 words of P (+ head_dim / 4 words of Q with
// q_in_registers), under the setmaxnreg budget (240 with two consumer
// warpgroups, 160 with three).
constexpr Sm90FwdTile sm90_fwd_tile(int head_dim) {
  switch (head_dim) {
    // Head dim 64: the products are half as long as at 128 while the softmax
    // is not, so two warpgroups cannot hide each other's softmax; three
    // (192 rows, no ping-pong) measured 436 / 493 TFLOP/s at seq 4k / 16k
    // against 390 / 443 for 128 x 128 (H200; docs/cuda_kernels.md, Hopper forward: tiles).
    case 64: return {192, 128, 2, 2, false, true};  // 88 KB + 24 KB of output slabs
    // Head dim 128 (H200, unmasked, seq 4k / 16k; before the softmax held K
    // tiles for a step): 128x128 with 2 K and 2 V buffers 560 / 604 TFLOP/s,
    // 3 and 3: 563 / 602 (the loads were not what limits);
    // 128x192 535 / 593. 128x176 (needs CuTe's extended wgmma shapes, else
    // it runs 64x16 atoms at -25%) measured level with 128x128 at 16k (per
    // round -4% to +3%) and -7% at 4k, where a 176-key grid wastes 3% on its
    // last tile. Q in registers: +1-2% (146ae08; docs/cuda_kernels.md, Hopper forward: loads and epilogue).
    case 128: return {128, 128, 2, 2, true, true};  // 160 KB + 32 KB of output slabs
    // Head dim 256: 128 output floats per thread leave room for a 64-key
    // score tile only; (as above) 2 and 2 buffers 596 / 673, 3 and 3 600 / 667.
    case 256: return {128, 64, 2, 2};  // 192 KB
    default: return {0, 0, 0, 0};
  }
}

// Banded calls with short rows (seqlen_q and seqlen_k at most
// kSm90ShortBandMaxLen) of a head dim with an entry here take this tile
// instead. Head dim 64 on 128 x 128 tiles with two ping-pong consumers wastes
// less of the diagonal and ends units sooner than 192 x 128 on three (H200,
// causal, against 192 x 128: +5% at seq 512, +9% at 1024, -1% at 2048, -8% at
// 16k; docs/cuda_kernels.md, Hopper forward: tiles). Its shared memory must not exceed the main
// tile's (the launcher asserts it), which is the size a build reports.
constexpr int kSm90ShortBandMaxLen = 1024;
constexpr Sm90FwdTile sm90_fwd_tile_short_band(int head_dim) {
  switch (head_dim) {
    case 64: return {128, 128, 2, 2, false, true};  // 80 KB + 16 KB of output slabs
    default: return {0, 0, 0, 0};
  }
}

// Hopper backward (csrc/cuda/sm90/flash_bwd_kernel_sm90.h): a CTA keeps
// block_n keys' K, V and dK, dV accumulators on chip and walks the query
// blocks, with one producer warpgroup and two consumer warpgroups. Head dims
// without an entry run the sm80 backward on Hopper too.
//
// Two ways to share the work between the consumers:
//   keys (p_ds_shared false): 64 keys each (block_n = 128). P^T and dS^T stay
//     in registers as the A operands of dV += P^T dO and dK += dS^T Q; only dS
//     goes through shared memory, for dQ. dK and dV take 2 * 64 * head_dim /
//     128 floats per thread: head dims up to 128.
//   columns (p_ds_shared true): both consumers work on the same 64 keys
//     (block_n = 64); S^T and dP^T are split by query columns, dK and dV by
//     head-dim columns, so P^T and dS^T go through shared memory for the
//     products that need all of them. dK and dV take 2 * 64 * head_dim / 256
//     floats per thread: head dim 256 in 128.
struct Sm90BwdTile {
  int block_m;   // query rows per step (the N of S^T = K Q^T, the K of dV, dK)
  int block_n;   // keys per CTA
  int q_stages;  // buffers of the Q and dO tiles (the next steps' load ahead)
  bool p_ds_shared = false;  // the column split above
  int dq_buffers = 2;        // dQ staging buffers per consumer
  // The dQ product's orientation. false: dQ = dS K, M = block_m (a multiple
  // of 64, wgmma's M), the consumers split its head-dim columns. true: dQ^T =
  // K^T dS^T, M = the head-dim rows (64 per consumer), N = block_m, so that
  // block_m need only be a multiple of 16; each consumer's dQ^T slice is
  // stored transposed into its staging buffer, which keeps the [rows,
  // head_dim] layout that the TMA reduce-add reads.
  bool dq_transposed = false;
  // Each consumer computes dQ over its own 64 keys (dQ = dS_c K_c, the whole
  // block_m x head_dim tile) and its writer adds that into dq_accum: no
  // barrier between the consumers, which then take turns at the tensor cores
  // (one issues its products while the other does its element work), for
  // twice the dQ reduce-add traffic. Needs K rows of 128 bytes (head dim 64
  // in 16 bits), so that a consumer's keys are one contiguous K tile.
  bool dq_own_keys = false;
  // Each loop's (query head, query block) advanced step by step
  // (StepWalk, flash_bwd_preprocess.h) rather than divided out of the step
  // index at every step.
  bool step_cursor = false;
};

// registers per consumer thread: dK and dV accumulators (above), S^T and dP^T
// block_n * block_m / 256 floats each, dQ block_m * head_dim / 256 floats,
// under the setmaxnreg budget of 240.
// smem = (2 * block_n + 2 * q_stages * block_m) * head_dim * 2 bytes (K, V,
// Q and dO) + 2 * block_m * block_n * 2 bytes (dS, two buffers; P^T as well
// with p_ds_shared) + dq_buffers * block_m * head_dim * 4 bytes (the float32
// dQ tile on its way to L2; twice that with dq_own_keys).
//
// Keyed by mask and score kind as well (each instantiation reads the entry of
// its own kinds): under a band the blocks the diagonal cuts are computed
// whole, so larger query blocks waste more there, and the masks and softcap
// need registers of their own.
//
// ordered: the tile of deterministic calls (dQ added in key-block order). It
// differs only where the default tile computes dQ over own keys, which
// ordered tiles never do (head dim 64 under a band: below).
constexpr Sm90BwdTile sm90_bwd_tile(int head_dim, MaskKind mask,
                                    ScoreKind score = ScoreKind::kPlain, bool ordered = false) {
  switch (head_dim) {
    // 224 KB. block_m 128 against 64: forward+backward +13-16% unmasked, +9%
    // causal (H100, seq 4k and 16k), for a 20-byte spill.
    // Band calls (causal, windows): dQ over each consumer's own keys, one dQ
    // staging buffer of the whole tile per consumer (64 KB) and one dS buffer
    // each (32 KB): 192 KB, a 28-byte spill. Causal forward+backward +5% to
    // +6% at seq 4k and 16k, unmasked -2% (H100; docs/hopper_backward.md,
    // "Head dim 64 under a band"). Segment ids and softcap keep the shared
    // dS: with their per-key state or softcap's own P^T operand beside the
    // late dV product they spilled more (segments 220 bytes against 176,
    // softcap 128 and 380 against 80 and 296).
    // Deterministic calls keep the shared dS too: with dQ over own keys the
    // two consumers of a key block add into the same dQ tile one after the
    // other, which doubles the ordered chain of reduce-adds per query block
    // (causal forward+backward 0.71-0.75x of the default mode at seq 1k-16k,
    // against 0.87-0.95x with the shared dS; H100, docs/hopper_backward.md).
    case 64:
      return mask == MaskKind::kBand && score == ScoreKind::kPlain && !ordered
                 ? Sm90BwdTile{128, 128, 2, false, 1, false, true}
                 : Sm90BwdTile{128, 128, 2};
    // Unmasked and band calls: 80 query rows per step do 25% more tensor
    // work than 64 for about the same fixed costs per step (unmasked
    // forward+backward +7.6% at seq 4k, +10.7% at 16k, H100; bands predicted
    // +4% to +9%: docs/hopper_backward.md, "80 query rows"). wgmma's M is 64,
    // so dQ is computed transposed; one dQ staging buffer per consumer is
    // what fits: K, V 64 KB, Q, dO 80 KB, dS 40 KB, dQ 40 KB = 224 KB.
    // Segment ids too, masked after dS^T like a band (their keys' row ranges
    // read there; the producer says which steps need it): segment backward
    // -17% to -21% time (H200). Softcap too, its P^T computed where dS^T is
    // (mainloop_bwd_sm90.h, kCapLate): forward+backward +13% against 64 rows.
    // The step cursor under a band: ptxas had put the division of the step
    // index ahead of each step's first product (causal forward+backward
    // +2.1% to +2.4% at seq 1k-16k, H200; unmasked, whose kernel hides the
    // division, -1.5% with it: docs/hopper_backward.md, "The step's unit").
    case 128: return {80, 128, 2, false, 1, true, false,
                      mask == MaskKind::kBand && score == ScoreKind::kPlain};
    // 225 KB: one Q/dO stage and one dQ buffer are what fit beside 64 keys'
    // K and V and the P^T and dS buffers.
    case 256: return {64, 64, 1, true, 1};
    default: return {0, 0, 0};
  }
}

// Decode (flash_decode_sm80.h): 4 warps per CTA, whose rows are a kv head's
// query heads times the queries; key tiles of block_n keys (K and V) stream
// through a ring of shared-memory stages with cp.async. Each K and V byte is
// read once, but what feeds HBM is the warps resident on an SM more than the
// bytes in flight: a warp's work per tile is a chain of dependent
// instructions (load addresses, two small products, the online softmax).
// Measured on an H200 (head dim 128, batch 8, 128k cache, commit 03ea879,
// 2026-11-29): at 3 stages and two CTAs per SM the kernel issued an
// instruction every 4.8 cycles per warp, 44% of them waiting on a
// fixed-latency dependency, with DRAM at 59% of its peak; one CTA per SM with
// 4-6 stages read at ~0.6x that rate, three CTAs with 2 stages 19-25% faster. So an
// entry fixes the CTAs per SM first (ctas_per_sm: the launch bound, which
// caps the registers so that they allow that many) and then the deepest ring
// that fits beside them in sm90's 227 KB (a stage is 2 * block_n * head_dim *
// 2 bytes: 16 / 32 / 64 KB). Head dim 256 has the registers for two CTAs, and
// two fit only with one stage: each CTA then loads and computes in turn, and
// the other CTA's loads fill the gaps (measured level with, or up to 3% above,
// one CTA of 2 stages). The launcher lowers the depth where a device allows
// less shared memory per block (1 stage always fits 99 KB); on sm80 (163 KB)
// fewer CTAs fit. Measurements: docs/decode.md, "CTAs per SM".
struct DecodeTile {
  int block_n;      // keys per tile, split among the warps that share a row block
  int stages;       // preferred depth of the K/V ring
  int ctas_per_sm;  // CTAs per SM that the registers must allow (<= 16 rows)
};

constexpr DecodeTile decode_tile(int head_dim) {
  switch (head_dim) {
    case 64: return {64, 4, 3};
    case 128: return {64, 2, 3};
    case 256: return {64, 1, 2};
    default: return {0, 0, 0};
  }
}

// The decode combine starts early (a programmatic dependent launch on sm_90a,
// decode_combine.h) only where a CTA of the main kernel streams at most
// this many key tiles. Measured (H100, bfloat16, head dim 128, 64 query heads
// over 8 kv heads, one call with both, GB/s against no early start): batch 1,
// 8k cache (4 tiles per CTA) 1614 against 1557; batch 1, 128k (63 tiles)
// 2690 against 2690; batch 8, 8k (33 tiles) 2458 against 2478; batch 8, 128k
// (512 tiles) 2677 against 2731. Its CTAs wait beside a long main kernel's
// and cost it up to 2%; a short call saves the launch.
constexpr int kDecodeEarlyCombineMaxTiles = 16;

// Deepest ring any entry asks for (the kernel's cp.async wait takes its depth
// as an immediate, so it branches over 0 .. kMaxDecodeStages - 2).
constexpr int kMaxDecodeStages = 4;

// smem = (block_m + stages * 2 * block_n) * head_dim * 2 bytes: the query rows,
// then the ring; the epilogue reuses it all for the warps' float32 outputs.
constexpr int decode_smem_bytes(int head_dim, int block_m, int stages) {
  return (block_m + stages * 2 * decode_tile(head_dim).block_n) * head_dim * 2;
}

// Segment ids are summarized per kSegmentBlock rows and keys (jflash/mask.h):
// the block divides the rows and keys of every tile above of the head dims
// with segment kernels, so that a tile's summary is exactly that of its
// blocks. The Hopper backward's query rows are the exception: its 80-row
// steps' tile class comes from the blocks that cover the rows, a superset
// where a step cuts a block (then partial where it could have been full,
// never wrongly full or empty), and its masked steps test the keys' row
// ranges element by element.
constexpr bool segment_block_divides_tiles() {
  for (int d : kSegmentHeadDims) {
    for (SmemClass c : {SmemClass::kLarge, SmemClass::kSmall}) {
      for (int bytes : {2, 4}) {
        const FwdTile f = fwd_tile(d, c, bytes);
        const BwdTile b = bwd_tile(d, c, bytes);
        if (f.block_m % kSegmentBlock || f.block_n % kSegmentBlock) return false;
        if (b.block_m % kSegmentBlock || b.block_n % kSegmentBlock) return false;
      }
    }
    for (const Sm90FwdTile& t : {sm90_fwd_tile(d), sm90_fwd_tile_short_band(d)}) {
      if (t.block_m % kSegmentBlock || t.block_n % kSegmentBlock) return false;
    }
    if (sm90_bwd_tile(d, MaskKind::kSegments).block_n % kSegmentBlock) return false;
  }
  return true;
}
static_assert(segment_block_divides_tiles(),
              "kSegmentBlock must divide the tiles of the segment head dims");

}  // namespace jflash::cuda

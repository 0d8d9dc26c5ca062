// The Hopper backward's main loop (flash_bwd_kernel_sm90.h): the producer's
// loads and the consumers' steps, each step the five products of one query
// block against the CTA's keys, P^T and dS^T between them (the kernel's
// header comment lists them; docs/hopper_backward.md the measurements behind
// the choices here).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>

#include "cuda/flash_bwd_preprocess.h"
#include "cuda/sm90/column_stat_sm90.h"
#include "cuda/sm90/epilogue_bwd_sm90.h"
#include "cuda/sm90/mask_bwd_sm90.h"
#include "cuda/sm90/pipeline_sm90.h"
#include "cuda/sm90/traits_bwd_sm90.h"
#include "cuda/sm90/wgmma_utils.h"
#include "cuda/utils.h"
#include "jflash/params.h"
#include "jflash/score.h"

namespace jflash::cuda::sm90 {

using namespace cute;

// tiles (both roles): the shared-memory tensors sQ, sdO (stages), sK, sV, as
// the kernel built them.
//
// The producer's loads (one thread of warp 0): the key block's K and V once,
// then each step's Q and dO tiles into the ring of q_stages buffers, a buffer
// refilled once every consumer warp has released it (qdo_empty); with
// Traits::kStepMaskFlags also whether the step's tile is masked (and every
// consumer thread releases the buffer, consume says why).
template <typename Traits, typename Mask, typename Steps, typename SmemTensors>
__device__ __forceinline__ void load_kv_qdo(const BwdArgsSm90<Traits>& args,
                                            typename Traits::SharedStorage& smem,
                                            const SmemTensors& tiles, const Steps& steps,
                                            int n_block, int kv_head, int batch) {
  const auto& [sQ, sdO, sK, sV] = tiles;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kStages = Traits::kStages;
  const BwdParams& params = args.params;

  Tensor mQ = args.tma_q.get_tma_tensor(Traits::shape_q(params));
  Tensor mdO = args.tma_dout.get_tma_tensor(Traits::shape_q(params));
  auto [tKgK, tKsK] =
      key_block_tma_partition<Traits>(args.tma_k, sK, params, n_block, kv_head, batch);
  auto [tVgV, tVsV] =
      key_block_tma_partition<Traits>(args.tma_v, sV, params, n_block, kv_head, batch);
  FullBarrier::arrive_and_expect_tx(&smem.kv_full, 2 * Traits::kKBytes);
  copy(args.tma_k.with(smem.kv_full), tKgK, tKsK);
  copy(args.tma_v.with(smem.kv_full), tVgV, tVsV);
  // Traits::kStepMaskFlags: the CTA's keys, against each step's rows below.
  constexpr int kBlockN = Traits::kBlockN;
  const int key0 = n_block * kBlockN;
  const Mask mask(params.mask, batch);

  StepWalk<Traits::kStepCursor, Steps> walk(steps);
  for (int step = 0; step < steps.num_steps; ++step) {
    int head, m_block;
    walk.unit(step, head, m_block);
    auto q_tile = [&](auto& m) {
      return local_tile(m(_, _, head, batch), Shape<Int<kBlockM>, Int<kHeadDim>>{},
                        make_coord(m_block, 0));
    };
    auto [tQgQ, tQsQ] = tma_partition(args.tma_q, Int<0>{}, Layout<_1>{},
                                      group_modes<0, 2>(sQ), group_modes<0, 2>(q_tile(mQ)));
    auto [tdOgdO, tdOsdO] = tma_partition(args.tma_dout, Int<0>{}, Layout<_1>{},
                                          group_modes<0, 2>(sdO), group_modes<0, 2>(q_tile(mdO)));
    const RingSlot<kStages> slot(step);
    // The tile's class, asked before the wait for the buffer.
    int32_t masked = 0;
    if constexpr (Traits::kStepMaskFlags) {
      const int row0 = m_block * kBlockM;
      masked = key0 + kBlockN > params.seqlen_k ||
               mask.tile_class(row0, min(row0 + kBlockM, params.seqlen_q), key0,
                               key0 + kBlockN) != TileClass::kFull;
    }
    producer_acquire(&smem.qdo_empty[slot.stage], &smem.qdo_full[slot.stage], slot.phase,
                     2 * Traits::kQBytes, [&] {
                       if constexpr (Traits::kStepMaskFlags) smem.step_masked.at[slot.stage] = masked;
                     });
    copy(args.tma_q.with(smem.qdo_full[slot.stage]), tQgQ, tQsQ(_, slot.stage));
    copy(args.tma_dout.with(smem.qdo_full[slot.stage]), tdOgdO, tdOsdO(_, slot.stage));
  }
}

// The consumers (warpgroups 1 ..): every step of the CTA (the kernel's
// header comment gives the products and who computes which part), then the
// key block's dK and dV.
template <typename Traits, typename Mask, ScoreKind kScore, typename Steps, typename SmemTensors>
__device__ __forceinline__ void consume(const BwdArgsSm90<Traits>& args,
                                        typename Traits::SharedStorage& smem,
                                        const SmemTensors& tiles, const Steps& steps, int n_block,
                                        int kv_head, int batch) {
  const auto& [sQ, sdO, sK, sV] = tiles;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kStages = Traits::kStages;
  const BwdParams& params = args.params;
  const int tidx = threadIdx.x - 128;  // 0 .. kConsumerThreads - 1
  const int consumer = tidx / 128;
  // Traits::kDqOwnKeys: this consumer's dS tile, dQ product and lse, delta
  // are its own, and its thread index among the threads sharing them is
  // tidx % 128.
  constexpr bool kOwnKeys = Traits::kDqOwnKeys;
  const int ds_tidx = kOwnKeys ? tidx % 128 : tidx;
  const int own = kOwnKeys ? consumer : 0;

  Tensor sQt = make_tensor(make_smem_ptr(smem.q.begin()), typename Traits::SmemLayoutQt{});
  Tensor sdOt = make_tensor(make_smem_ptr(smem.dout.begin()), typename Traits::SmemLayoutQt{});
  // K^T of the dS tile's keys (of this consumer's 64 with kOwnKeys).
  Tensor sKt = make_tensor(make_smem_ptr(smem.k.begin() + own * Traits::kDsKeys * kHeadDim),
                           typename Traits::SmemLayoutKt{});
  Element* const ds_tile = smem.ds.begin() + own * cosize_v<typename Traits::SmemLayoutdS>;
  Tensor sdS = make_tensor(make_smem_ptr(ds_tile), typename Traits::SmemLayoutdS{});
  Tensor sdSt = make_tensor(make_smem_ptr(ds_tile), typename Traits::SmemLayoutdSt{});

  typename Traits::TiledMmaSdP mma_sdp;
  typename Traits::TiledMmadKV mma_dkv;
  typename Traits::TiledMmadQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(tidx);
  auto thr_dkv = mma_dkv.get_thread_slice(tidx);
  auto thr_dq = mma_dq.get_thread_slice(ds_tidx);
  // Shared-memory descriptors of the operands; the ones with a last mode of
  // stages (Q, dO) or buffers (dS) are indexed by it.
  Tensor tSrK = thr_sdp.partition_fragment_A(sK);      // (MMA, MMA_M, MMA_K)
  Tensor tSrQ = thr_sdp.partition_fragment_B(sQ);      // (MMA, MMA_N, MMA_K, stage)
  Tensor tdPrV = thr_sdp.partition_fragment_A(sV);
  Tensor tdPrdO = thr_sdp.partition_fragment_B(sdO);
  Tensor tdVrdO = thr_dkv.partition_fragment_B(sdOt);  // (MMA, MMA_N, MMA_K, stage)
  Tensor tdKrQ = thr_dkv.partition_fragment_B(sQt);
  // dQ = dS K: dS is A, K^T B; dQ^T = K^T dS^T: the other way round.
  // (MMA, MMA_M or MMA_N, MMA_K, buffer) and (MMA, MMA_N or MMA_M, MMA_K)
  Tensor tdQrdS = [&] {
    if constexpr (Traits::kDqTransposed) return thr_dq.partition_fragment_B(sdS);
    else return thr_dq.partition_fragment_A(sdS);
  }();
  Tensor tdQrK = [&] {
    if constexpr (Traits::kDqTransposed) return thr_dq.partition_fragment_A(sKt);
    else return thr_dq.partition_fragment_B(sKt);
  }();

  typename Traits::SmemCopydS smem_copy_ds;
  auto thr_copy_ds = smem_copy_ds.get_thread_slice(ds_tidx);
  Tensor tdSsdS = thr_copy_ds.partition_D(sdSt);  // (CPY, CPY_M, CPY_N, buffer)

  // This consumer's dQ staging buffers, and its slice of the (block_m x
  // head_dim) dQ tile (with kOwnKeys all of it) as the dQ product's
  // accumulator partition sees it.
  // (MMA, MMA_M, MMA_N, buffer), as acc_dq
  Tensor tdQsdQ = [&] {
    if constexpr (Traits::kDqTransposed) {
      return thr_dq.partition_C(
          make_tensor(make_smem_ptr(smem.dq.begin()), typename Traits::SmemLayoutdQt{}));
    } else {
      Tensor sdQ = make_tensor(make_smem_ptr(smem.dq.begin()), typename Traits::SmemLayoutdQ{});
      if constexpr (kOwnKeys) {
        return thr_dq.partition_C(sdQ(_, _, consumer, _));
      } else if constexpr (Traits::kDqSplitRows) {
        return thr_dq.partition_C(
            make_tensor(make_smem_ptr(smem.dq.begin()), typename Traits::SmemLayoutdQRows{}));
      } else {
        return thr_dq.partition_C(group_modes<1, 3>(sdQ));
      }
    }
  }();

  // dK and dV of this consumer's 64 keys, summed over every step.
  Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  clear(acc_dk);
  clear(acc_dv);

  // (key, query row) of each S^T accumulator element, as (rows, cols).
  Tensor cS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{}));
  Tensor cS_rc = make_tensor(cS.data(), acc_rowcol(cS.layout()));
  constexpr int kRows = decltype(size<0>(cS_rc))::value;  // keys this thread holds (2)
  constexpr int kCols = decltype(size<1>(cS_rc))::value;  // query rows it holds

  const int key0 = n_block * kBlockN;
  const Mask mask(params.mask, batch);
  // The per-element test, built before the loop: its barriers and fences
  // would make the compiler reload the bounds per step.
  const auto visible = mask.template element_test<int>();
  // dV += P^T dO issued after dK += dS^T Q (P^T converted to 16 bits only
  // then) rather than while dS^T is computed: for registers
  // (Traits::kTightRegisters), or with kOwnKeys, whose turns issue dK, dV and
  // dQ together.
  constexpr bool kLateDv = Traits::kTightRegisters || kOwnKeys;
  constexpr bool kSoftcap = kScore == ScoreKind::kSoftcap;
  // Softcap's derivative 1 - t^2 needs t where dS^T is computed. The other
  // tiles keep P^T (1 - t^2) in acc_s and P^T's own 16-bit copy for the dV
  // product beside it, which the register-tight step (Traits::
  // kTightRegisters) has no room for. There the exponent loop leaves t in
  // acc_s, and the dS^T loop computes P^T from it (the step's lse read
  // there), dS^T with 1 - t^2, and leaves P^T in acc_s for the late dV
  // product, as without softcap.
  constexpr bool kCapLate = kSoftcap && Traits::kTightRegisters;
  // Where a band's per-element mask is applied. In the exponent loop (P = -0
  // where hidden, which the dS^T loop then finds by its sign), dP^T's product
  // is in flight and S^T, dP^T, dK and dV hold 208 of the 240 registers; with
  // Traits::kTightRegisters (80 query rows) the mask's coordinates did not fit
  // beside them there (ptxas: a 48-byte spill), nor at head dim 64 with
  // kLateDv (116 bytes). kLateMask: after the dS^T loop instead, where no
  // product is in flight and lse and delta are dead, P^T and dS^T are set to
  // 0 where hidden (no spill). Either way a hidden score's P and dS are exact
  // zeros whatever the score was (inf, NaN).
  // (Not with softcap's own dV operand, a copy made in the exponent loop.)
  // Segment ids alike (Traits::kStepMaskFlags, segment_hide_late), their keys'
  // row ranges read again for the late pass rather than kept.
  constexpr bool kLateMask = kLateDv && !Mask::kDense && (!kSoftcap || kCapLate);
  // Dense scores (no band, no segment ids) mask nothing, not even the keys
  // past seqlen_k in the last key block: they are TMA's zero fill, K and V
  // rows of zeros, so their P and dS land only in dK and dV rows that the
  // store clips, and in dQ through a zero K row. There they must be finite:
  // a zero score's P = exp2(-lse_log2) overflows where a row's scores are all
  // far below zero, so the exponent is clamped at 0 (P <= 1, as it is for a
  // real key) by a min that keeps NaN. No -0 then, and no sign mask.
  constexpr bool kMasks = !Mask::kDense;
  static_assert(!(kLateMask && Mask::kHasSegments) || Traits::kStepMaskFlags);
  const int lane = tidx % 32;
  const bool warp_leader = lane == 0;
  // Named barriers (CUTLASS numbering, past its reserved ones). The dS
  // barrier: the dS^T rows of the threads that share the dS tile are in
  // shared memory (both consumers', or with kOwnKeys this consumer's, at
  // kDsBarrier + consumer).
  constexpr uint32_t kDsBarrier = 1;
  const uint32_t ds_barrier = kDsBarrier + own;
  // With kPdSShared: both consumers' P^T columns are in shared memory.
  constexpr uint32_t kPBarrier = 3;
  // Turns at the tensor cores (kOwnKeys): consumer c issues its products
  // once kTurnBarrier + c completes, and then hands the turn to the other.
  // Each issues twice per step (S^T and dP^T; then dK, dV and dQ), so that
  // one's exponentials and dS^T run under the other's products. Consumer 1
  // starts by handing consumer 0 the first turn and skips its own last
  // hand-over, which leaves both barriers as they were.
  constexpr uint32_t kTurnBarrier = 4;
  // Both consumers around the dK, dV store (epilogue_bwd_sm90.h).
  constexpr uint32_t kDkvBarrier = 6;
  auto begin_issue = [&] {
    if constexpr (kOwnKeys) cutlass::arch::NamedBarrier::sync(256, kTurnBarrier + consumer);
  };
  auto end_issue = [&](bool last) {
    if constexpr (kOwnKeys) {
      if (!(last && consumer == 1)) {
        cutlass::arch::NamedBarrier::arrive(256, kTurnBarrier + 1 - consumer);
      }
    }
  };
  // Counters of deterministic mode: params.h gives each query block of >= 32
  // rows two.
  static_assert(Traits::kConsumerWarpgroups <= 2 && kBlockM >= kDqSemaphoreRows);

  // lse (log2 domain) and delta of a step's query rows go through shared
  // memory, buffer step % 2 (with kOwnKeys a copy per consumer): the threads
  // that share the dS tile load values j = 0 .. block_m - 1 of lse and
  // block_m .. 2 block_m - 1 of delta, one row each (thread ds_tidx the
  // values ds_tidx + i * kDsThreads), a step ahead. The loads are issued
  // early in the step before (their latency hidden under its products) and
  // stored right before its dS barrier, which also orders them: every read of
  // that buffer two steps back came before the last dS barrier, and every
  // read of the new values comes after this one. Rows past the end and rows
  // that saw no key in the forward (lse = -inf) get lse = +inf, so that P = 0
  // there.
  constexpr int kStatLoads = Traits::kRowStatLoads;
  auto stat_value = [&](int i) { return ds_tidx + i * Traits::kDsThreads; };
  auto loads_stat = [&](int i) { return stat_value(i) < 2 * kBlockM; };
  StepWalk<Traits::kStepCursor, Steps> walk(steps);
  auto load_row_stat = [&](int step, int j) {  // step: the one the walk is at
    int head, m_block;
    walk.peek(step, head, m_block);
    const int row = m_block * kBlockM + j % kBlockM;
    const int64_t index = (int64_t{batch} * params.num_heads + head) * params.seqlen_q + row;
    if (row >= params.seqlen_q) return j < kBlockM ? INFINITY : 0.f;
    if (j >= kBlockM) return params.delta[index];
    const float lse = params.lse[index];
    return lse == -INFINITY ? INFINITY : lse * kLog2e;
  };
  auto store_row_stat = [&](int step, int j, float value) {
    (j < kBlockM ? smem.lse_log2 : smem.delta)[own][step % 2][j % kBlockM] = value;
  };
  if (steps.num_steps > 0) {
    CUTE_UNROLL
    for (int i = 0; i < kStatLoads; ++i) {
      if (loads_stat(i)) store_row_stat(0, stat_value(i), load_row_stat(0, stat_value(i)));
    }
    cutlass::arch::NamedBarrier::sync(Traits::kDsThreads, ds_barrier);
    if (kOwnKeys && consumer == 1) cutlass::arch::NamedBarrier::arrive(256, kTurnBarrier);
    FullBarrier::wait(&smem.kv_full, 0);
  }
  for (int step = 0; step < steps.num_steps; ++step) {
    int head, m_block;
    walk.unit(step, head, m_block);
    const int row0 = m_block * kBlockM;
    const RingSlot<kStages> slot(step);
    const int stage = slot.stage;
    const int buffer = step % 2;  // of lse and delta (and of P^T with kPdSShared)
    const int ds_buffer = step % Traits::kDsBuffers;

    // S^T = K Q^T and dP^T = V dO^T   (block_n x block_m)
    consumer_wait(&smem.qdo_full[stage], slot.phase);
    Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
    Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
    begin_issue();
    wgmma_issue</*kZeroInit=*/true>(mma_sdp, tSrK, tSrQ(_, _, _, stage), acc_s);
    wgmma_issue<true>(mma_sdp, tdPrV, tdPrdO(_, _, _, stage), acc_dp);
    end_issue(false);
    const bool next_row_stat = step + 1 < steps.num_steps;
    float row_stat[kStatLoads];
    CUTE_UNROLL
    for (int i = 0; i < kStatLoads; ++i) {
      row_stat[i] = next_row_stat && loads_stat(i) ? load_row_stat(step + 1, stat_value(i)) : 0.f;
    }
    // Segment ids, while the products run: the rows of this thread's keys,
    // and whether the warp masks this tile (mask_bwd_sm90.h).
    using IdBits = std::conditional_t<(kRows * kCols <= 32), uint32_t, uint64_t>;
    bool seg_needs_mask = false;
    int seg_lo[kRows], seg_hi[kRows];
    IdBits seg_same = ~IdBits{0};
    if constexpr (Mask::kHasSegments && !kLateMask) {
      // A full tile (the producer's flag) needs no key ranges.
      bool step_masked = true;
      if constexpr (Traits::kStepMaskFlags) step_masked = smem.step_masked.at[stage];
      if (step_masked) {
        seg_needs_mask = segment_rows<kBlockM, kCols>(mask, params, cS_rc, key0, row0, seg_lo,
                                                      seg_hi, seg_same);
      }
    }

    // P^T = exp2(S^T * scale_log2 - lse_log2); in masked kernels (kMasks)
    // keys outside the band or past the last key get P = 0, by a select that a
    // NaN lse or score cannot turn into NaN (with kLateMask after the dS^T
    // loop, below). The last key here is the last one that some row sees
    // (key_limit): a band may let rows past seqlen_q (zeros, lse = +inf) see
    // keys that no row sees, and their scores are NaN where k is. Masked P is
    // -0, which exp2 never gives: the dS^T loop below finds them by it.
    warpgroup_wait<1>();
    warpgroup_fence_operand(acc_s);
    Tensor s_rc = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));
    // (Segment ids with kLateMask: the producer's flag, read late below.)
    const bool needs_mask =
        Mask::kHasSegments
            ? seg_needs_mask
            : kMasks && (key0 + kBlockN > params.seqlen_k ||
                         mask.tile_class(row0, min(row0 + kBlockM, params.seqlen_q), key0,
                                         key0 + kBlockN) != TileClass::kFull);
    float lse_log2[kCols];  // of this thread's query rows (columns)
    if constexpr (!kCapLate) {
      load_column_stat<Traits::kTightRegisters>(lse_log2, smem.lse_log2[own][buffer], cS_rc, lane);
    }
    const int key_limit =
        static_cast<int>(mask.band().keys_of_rows(0, params.seqlen_q, params.seqlen_k).end);
    // Softcap: P^T of the capped score t (recomputed from S^T here rather than
    // kept: registers are what this kernel lacks). Without kCapLate it goes
    // to p_cap in Element for the dV product at once, and acc_s keeps P^T
    // (1 - t^2) for dS^T (-0 where masked, as P); with it acc_s keeps t.
    constexpr bool kOwnPOperand = kSoftcap && !kCapLate;
    Tensor p_cap = make_tensor<Element>(acc_s.layout());
    Tensor p_cap_rc = make_tensor(p_cap.data(), acc_rowcol(acc_s.layout()));
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float p_pair[2];
      CUTE_UNROLL
      for (int c = 0; c < kCols; ++c) {
        const float score = kSoftcap ? fast_tanh(s_rc(r, c) * params.softcap_scale) : s_rc(r, c);
        if constexpr (kCapLate) {
          s_rc(r, c) = score;
          continue;
        }
        const float exponent = fmaf(score, params.softmax_scale_log2, -lse_log2[c]);
        float p = fast_exp2(kMasks ? exponent : min_keep_nan(exponent, 0.f));
        float ds_factor = kOwnPOperand ? p * (1.f - score * score) : p;
        if (!kLateMask && needs_mask) {
          const int key = key0 + get<0>(cS_rc(r, c));
          const int row = row0 + get<1>(cS_rc(r, c));
          const bool hidden = Mask::kHasSegments
                                  ? row < seg_lo[r] || row >= seg_hi[r] ||
                                        !((seg_same >> (r * kCols + c)) & 1)
                                  : key >= key_limit || !visible(row, key);
          if (hidden) p = ds_factor = -0.f;
        }
        s_rc(r, c) = ds_factor;
        if constexpr (kOwnPOperand) {
          // Columns 2j and 2j + 1 are neighbours in the fragment: one conversion.
          p_pair[c % 2] = p;
          if (c % 2 == 1) {
            const auto pair = convert_pair<Element>(p_pair[0], p_pair[1]);
            p_cap_rc(r, c - 1) = pair[0];
            p_cap_rc(r, c) = pair[1];
          }
        }
      }
    }
    // P^T in Element, the A operand of the dV product.
    auto p_elements = [&] {
      if constexpr (kOwnPOperand) {
        return p_cap;
      } else {
        return convert_fragment<Element>(acc_s);
      }
    };
    // dV += P^T dO   (block_n x head_dim), issued while dS^T is computed
    // (with kLateDv after dK's product instead, below).
    if constexpr (Traits::kPdSShared) {
      // This consumer's P^T columns into shared memory; once both are there,
      // the product over all of them for this consumer's head-dim columns.
      Tensor sPt = make_tensor(make_smem_ptr(smem.p.begin()), typename Traits::SmemLayoutdSt{});
      copy(smem_copy_ds, thr_copy_ds.retile_S(p_elements()),
           thr_copy_ds.partition_D(sPt)(_, _, _, buffer));
      cutlass::arch::fence_view_async_shared();
      cutlass::arch::NamedBarrier::sync(Traits::kConsumerThreads, kPBarrier);
      Tensor tdVsPt = thr_dkv.partition_fragment_A(sPt);  // (MMA, MMA_M, MMA_K, buffer)
      wgmma_issue<false>(mma_dkv, tdVsPt(_, _, _, buffer), tdVrdO(_, _, _, stage), acc_dv);
    } else if constexpr (!kLateDv) {
      Tensor tdVrP = make_tensor<Element>(acc_as_a_operand(acc_s.layout()));
      Tensor p = p_elements();
      Tensor dst = make_tensor(tdVrP.data(), acc_s.layout());
      CUTE_UNROLL
      for (int i = 0; i < size(p); ++i) dst(i) = p(i);
      warpgroup_fence_operand(tdVrP);
      wgmma_issue<false>(mma_dkv, tdVrP, tdVrdO(_, _, _, stage), acc_dv);
    }

    // dS^T = P^T * (dP^T - delta); 0 where P was masked (dP - delta may be
    // NaN there: a NaN in v, or a NaN row's delta).
    warpgroup_wait<kLateDv ? 0 : 1>();  // dP^T done; dV may still run
    warpgroup_fence_operand(acc_dp);
    Tensor dp_rc = make_tensor(acc_dp.data(), acc_rowcol(acc_dp.layout()));
    float delta[kCols];
    load_column_stat<Traits::kTightRegisters>(delta, smem.delta[own][buffer], cS_rc, lane);
    if constexpr (kCapLate) {
      load_column_stat<true>(lse_log2, smem.lse_log2[own][buffer], cS_rc, lane);
    }
    // P's sign bit (that of P (1 - t^2) with softcap) is set only where masked
    // (-0; exp2 gives +0 and positive NaNs): spread into a mask, it clears dS
    // there. Unmasked tiles have no -0, so the mask is all ones; the two
    // integer operations cost less than a second copy of the loop for masked
    // tiles (which made ptxas spill).
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTE_UNROLL
      for (int c = 0; c < kCols; ++c) {
        if constexpr (kCapLate) {
          // acc_s holds t; masked late (kLateMask), so no -0 to find.
          const float t = s_rc(r, c);
          const float p = fast_exp2(fmaf(t, params.softmax_scale_log2, -lse_log2[c]));
          dp_rc(r, c) = p * (dp_rc(r, c) - delta[c]) * fmaf(-t, t, 1.f);
          s_rc(r, c) = p;
          continue;
        }
        const uint32_t keep =
            kMasks ? ~static_cast<uint32_t>(static_cast<int32_t>(__float_as_uint(s_rc(r, c))) >> 31)
                   : ~0u;
        dp_rc(r, c) =
            __uint_as_float(__float_as_uint(s_rc(r, c) * (dp_rc(r, c) - delta[c])) & keep);
      }
    }
    // kLateMask: the band's mask, on P^T (the dV product's operand, converted
    // below) and dS^T alike.
    if constexpr (kLateMask && Mask::kHasSegments) {
      if (smem.step_masked.at[stage]) {
        segment_hide_late<kRows, kCols>(mask, params, cS_rc, key0, row0, s_rc, dp_rc);
      }
    } else if constexpr (kLateMask) {
      if (needs_mask) {
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
          CUTE_UNROLL
          for (int c = 0; c < kCols; ++c) {
            const int key = key0 + get<0>(cS_rc(r, c));
            const int row = row0 + get<1>(cS_rc(r, c));
            if (key >= key_limit || !visible(row, key)) s_rc(r, c) = dp_rc(r, c) = 0.f;
          }
        }
      }
    }
    Tensor ds = convert_fragment<Element>(acc_dp);
    // dS^T rows into shared memory for the dQ product, then dK += dS^T Q.
    copy(smem_copy_ds, thr_copy_ds.retile_S(ds), tdSsdS(_, _, _, ds_buffer));
    begin_issue();
    if constexpr (!Traits::kPdSShared) {
      Tensor tdKrdS = make_tensor<Element>(acc_as_a_operand(acc_dp.layout()));
      Tensor dst = make_tensor(tdKrdS.data(), acc_dp.layout());
      CUTE_UNROLL
      for (int i = 0; i < size(ds); ++i) dst(i) = ds(i);
      warpgroup_fence_operand(tdKrdS);
      wgmma_issue<false>(mma_dkv, tdKrdS, tdKrQ(_, _, _, stage), acc_dk);
    }
    if constexpr (kLateDv) {
      // dV += P^T dO, P^T converted only now: its 16-bit copy (the product's
      // register operand) then never lives beside dP^T in float32.
      Tensor tdVrP = make_tensor<Element>(acc_as_a_operand(acc_s.layout()));
      Tensor p = p_elements();
      Tensor dst = make_tensor(tdVrP.data(), acc_s.layout());
      CUTE_UNROLL
      for (int i = 0; i < size(p); ++i) dst(i) = p(i);
      warpgroup_fence_operand(tdVrP);
      wgmma_issue<false>(mma_dkv, tdVrP, tdVrdO(_, _, _, stage), acc_dv);
    }

    // dQ = dS K   (block_m x this consumer's head-dim columns, or with
    // kOwnKeys all of them over its own keys; with kDqTransposed its
    // transpose, K^T dS^T), once the dS^T rows of the dS tile are visible to
    // the tensor cores (and, with kPdSShared, dK += dS^T Q for its head-dim
    // columns).
    if (next_row_stat) {
      CUTE_UNROLL
      for (int i = 0; i < kStatLoads; ++i) {
        if (loads_stat(i)) store_row_stat(step + 1, stat_value(i), row_stat[i]);
      }
    }
    cutlass::arch::fence_view_async_shared();
    cutlass::arch::NamedBarrier::sync(Traits::kDsThreads, ds_barrier);
    if constexpr (Traits::kPdSShared) {
      Tensor tdKsdSt = thr_dkv.partition_fragment_A(sdSt);  // (MMA, MMA_M, MMA_K, buffer)
      wgmma_issue<false>(mma_dkv, tdKsdSt(_, _, _, ds_buffer), tdKrQ(_, _, _, stage), acc_dk);
    }
    Tensor acc_dq = partition_fragment_C(mma_dq, typename Traits::dQAccShape{});
    if constexpr (Traits::kDqTransposed) {
      wgmma_issue<true>(mma_dq, tdQrK, tdQrdS(_, _, _, ds_buffer), acc_dq);
    } else {
      wgmma_issue<true>(mma_dq, tdQrdS(_, _, _, ds_buffer), tdQrK, acc_dq);
    }
    end_issue(step + 1 == steps.num_steps);
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_dv);
    warpgroup_fence_operand(acc_dk);
    warpgroup_fence_operand(acc_dq);
    // Q and dO of this stage are read; the other consumer may still read this
    // dS buffer (unless kOwnKeys), which is written again two steps later,
    // past its next barrier. With step flags every consumer thread arrives
    // (qdo_empty counts threads then): each read the stage's flag, a plain
    // shared-memory load, and only its own arrival orders that read before the
    // producer stores the stage's next flag (with one arrival per warp,
    // compute-sanitizer racecheck reports a WAR hazard there, a __syncwarp
    // before it or not; the leader's load passed on by a shuffle or vote
    // spilled 84-100 bytes).
    consumer_release(&smem.qdo_empty[stage], Traits::kStepMaskFlags || warp_leader);

    // dQ_accum += dS K (scaled in the convert kernel): registers -> this
    // consumer's staging buffer -> its writer's TMA reduce-add
    // (epilogue_bwd_sm90.h).
    stage_dq<Traits>(smem, acc_dq, tdQsdQ, consumer, step, warp_leader);
  }

  // dK and dV of the key block, written once, or added to the other shares'.
  write_dk_dv<Traits, kDkvBarrier>(smem, acc_dk, acc_dv, thr_dkv, tidx, key0, batch, kv_head,
                                   params);
}

}  // namespace jflash::cuda::sm90

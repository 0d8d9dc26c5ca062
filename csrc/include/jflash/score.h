// How a kernel turns q.k into the score that its softmax takes.
//
//   ScoreKind::kPlain    score = softmax_scale * q.k
//   ScoreKind::kSoftcap  score = softcap * tanh(softmax_scale * q.k / softcap):
//                        logit soft-capping, scores within (-softcap, softcap)
//
// The kind is a compile-time choice of every CUDA kernel (a template parameter
// beside the mask policy, and a part of the registry's key), so that kernels
// without softcap carry no tanh and no derivative. A softcap kernel computes
// t = tanh(softcap_scale * q.k) from the Q K^T product (softcap_scale =
// softmax_scale / softcap) and hands t to the same softmax as a plain kernel:
// the factor that takes its score into the log2 domain, softmax_scale_log2, is
// softcap * log2(e) for such calls (csrc/ffi/params_from_ffi.h). The backward
// multiplies dS by the derivative of the cap, d score / d (softmax_scale q.k)
// = 1 - t^2, with t recomputed from S where P is (registers are what the
// backward kernels lack, not tanh throughput), so dK and dQ keep their
// softmax_scale factor. The CPU twin computes in natural units,
// score = softcap * tanh(s / softcap) for its s = softmax_scale * q.k, and
// tests params.softcap once per tile rather than at compile time (its tanh
// pass over a tile is the cost either way).
//
// Masking comes after the cap: a hidden score is -inf, not -softcap. The
// CUDA kernels exist for the band and segment-id masks (the handlers run a
// softcap call without a mask on the band kernel).
#pragma once

#include "jflash/mask.h"  // JFLASH_HOST_DEVICE

namespace jflash {

enum class ScoreKind : int { kPlain = 0, kSoftcap = 1 };
inline constexpr int kNumScoreKinds = 2;

inline const char* ScoreKindName(ScoreKind kind) {
  return kind == ScoreKind::kSoftcap ? "softcapped" : "uncapped";
}

// Softcapped scores need no running max where the softcap is small enough
// (the Hopper forward's fixed-offset main loop, csrc/cuda/sm90/
// mainloop_fwd_fixed_sm90.h). A capped score in the log2 domain is C t with
// t = tanh(...) in [-1, 1] and C = softmax_scale_log2 = softcap * log2(e),
// so every exponent C t - offset lies in [-C - offset, C - offset] whatever
// the data; with the offset below, in [kSoftcapFixedLow, kSoftcapFixedHigh]
// wherever softcap_fixed_offset_fits(C): true for softcap <= 56.8 (C <= 82).
// P <= 2^64 keeps O and the float32 sums far from overflow (a row's P V
// overflows only for |v| near 2^64 / keys below float's limit), and
// P >= 2^-100 keeps every term a normal float and a normal bfloat16: nothing
// is flushed, P has its full precision, and lse = offset + log2(sum) as with a
// max. (P in float16, whose range is 2^-14 to 2^16, cannot take this.)
// tests/softcap_offset_check.cc checks these bounds.
inline constexpr float kSoftcapFixedHigh = 64.f;
inline constexpr float kSoftcapFixedLow = -100.f;
JFLASH_HOST_DEVICE float softcap_fixed_offset(float scale_log2) {
  return scale_log2 > kSoftcapFixedHigh ? scale_log2 - kSoftcapFixedHigh : 0.f;
}
JFLASH_HOST_DEVICE bool softcap_fixed_offset_fits(float scale_log2) {
  return scale_log2 > 0.f && -scale_log2 - softcap_fixed_offset(scale_log2) >= kSoftcapFixedLow;
}

}  // namespace jflash

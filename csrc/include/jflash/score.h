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

namespace jflash {

enum class ScoreKind : int { kPlain = 0, kSoftcap = 1 };
inline constexpr int kNumScoreKinds = 2;

inline const char* ScoreKindName(ScoreKind kind) {
  return kind == ScoreKind::kSoftcap ? "softcapped" : "uncapped";
}

}  // namespace jflash

// The head dims the kernels are built for: the one list. Every other head dim
// up to the last is zero-padded up to the next entry before the call (exact:
// zero columns add nothing to q.k, and padded output columns are sliced off).
//
// Its readers: csrc/cuda/generate_kernels.py writes the instantiations of the
// entries (it parses the initializer below), the CUDA registry and handlers
// index their kernel tables by kernel_head_dim_index, the FFI checks bound
// head_dim by kMaxKernelHeadDim, and Python reads the list from the CPU
// library (jflash_kernel_head_dims; jflash/_src/kernel_calls.py).
//
// Calls with segment ids (MaskKind::kSegments) run on kernels built for
// kSegmentHeadDims only, a subset that bounds the build; Python pads their
// head dims up to the next of these (jflash_segment_head_dims), exactly as above.
#pragma once

namespace jflash {

inline constexpr int kKernelHeadDims[] = {32, 64, 96, 128, 160, 192, 224, 256};
inline constexpr int kNumKernelHeadDims = sizeof(kKernelHeadDims) / sizeof(kKernelHeadDims[0]);
inline constexpr int kMaxKernelHeadDim = kKernelHeadDims[kNumKernelHeadDims - 1];

inline constexpr int kSegmentHeadDims[] = {64, 128, 256};
inline constexpr int kNumSegmentHeadDims = sizeof(kSegmentHeadDims) / sizeof(kSegmentHeadDims[0]);
static_assert(kSegmentHeadDims[kNumSegmentHeadDims - 1] == kMaxKernelHeadDim,
              "every head dim pads up to a segment head dim");

// The decode kernels (jflash.flash_attention_with_kvcache) are built for these
// head dims; Python pads other head dims up to the next of them (which copies
// the cache: README).
inline constexpr int kDecodeHeadDims[] = {64, 128, 256};
inline constexpr int kNumDecodeHeadDims = sizeof(kDecodeHeadDims) / sizeof(kDecodeHeadDims[0]);
static_assert(kDecodeHeadDims[kNumDecodeHeadDims - 1] == kMaxKernelHeadDim,
              "every head dim pads up to a decode head dim");

// Calls with softcap (ScoreKind::kSoftcap) likewise: their kernels exist for
// kSoftcapHeadDims only (jflash_softcap_head_dims), and with segment ids too
// for the head dims of both lists. Python pads up to the next head dim of
// every list that applies.
inline constexpr int kSoftcapHeadDims[] = {64, 128, 256};
inline constexpr int kNumSoftcapHeadDims = sizeof(kSoftcapHeadDims) / sizeof(kSoftcapHeadDims[0]);
static_assert(kSoftcapHeadDims[kNumSoftcapHeadDims - 1] == kMaxKernelHeadDim,
              "every head dim pads up to a softcap head dim");

// The float32 kernels (TF32 tensor-core MMAs, one or three passes: the
// precision of a float32 call, jflash/params.h tf32_passes) are built for these
// head dims only (build time: each doubles for the two precisions); Python pads
// a float32 call's head dim up to the next of them, on every platform, like
// the lists above.
inline constexpr int kFloat32HeadDims[] = {64, 128, 256};
inline constexpr int kNumFloat32HeadDims = sizeof(kFloat32HeadDims) / sizeof(kFloat32HeadDims[0]);
static_assert(kFloat32HeadDims[kNumFloat32HeadDims - 1] == kMaxKernelHeadDim,
              "every head dim pads up to a float32 head dim");

// The Hopper kernels (csrc/cuda/sm90/, forward and backward) are built for
// these head dims. On Hopper, a call at another entry of kKernelHeadDims runs
// the Hopper kernel of the next of these (sm90_kernel_head_dim): its TMA
// descriptors carry the call's head dim, so the columns past it load as zeros
// (which change no score and no output) and are not stored. Python does not
// pad for it; the call's buffers keep their head dim.
inline constexpr int kSm90HeadDims[] = {64, 128, 256};
inline constexpr int kNumSm90HeadDims = sizeof(kSm90HeadDims) / sizeof(kSm90HeadDims[0]);
static_assert(kSm90HeadDims[kNumSm90HeadDims - 1] == kMaxKernelHeadDim,
              "every head dim has a Hopper kernel to run on");

// The head dim of the Hopper kernel that runs a call of head_dim: the first
// entry of kSm90HeadDims at or above it.
constexpr int sm90_kernel_head_dim(int head_dim) {
  for (int d : kSm90HeadDims) {
    if (head_dim <= d) return d;
  }
  return -1;
}

// Whether head_dim is an entry of a head-dim list (host code: the handlers).
template <int kCount>
constexpr bool is_listed_head_dim(const int (&list)[kCount], int head_dim) {
  for (int d : list) {
    if (d == head_dim) return true;
  }
  return false;
}

// The position of head_dim in kKernelHeadDims, or -1 where it is not an entry
// (host code: the registry and the handlers).
constexpr int kernel_head_dim_index(int head_dim) {
  for (int i = 0; i < kNumKernelHeadDims; ++i) {
    if (kKernelHeadDims[i] == head_dim) return i;
  }
  return -1;
}

}  // namespace jflash

// XLA FFI handlers for platform "CUDA": JflashFwdCuda, JflashBwdCuda,
// JflashDecodeCuda and JflashDecodeAppendCuda.
//
// They bind the same arguments, results and attributes in the same order as
// the CPU handlers (cpu_handlers.cc), plus the XLA stream. Everything they do
// depends only on shapes and attributes: no synchronization, no allocation
// (dq_accum and delta come from XLA), launches only on the given stream, so
// they may be captured into CUDA graphs (kCmdBufferCompatible).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <string>
#include <utility>

#include "cuda/launch.h"
#include "ffi/bindings.h"
#include "ffi/decode_params_from_ffi.h"
#include "ffi/params_from_ffi.h"
#include "jflash/head_dims.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jflash {
namespace {

// Per-device properties, read once per device (cudaDeviceGetAttribute is cheap
// but not free, and these never change).
struct DeviceInfo {
  cudaError_t error = cudaSuccess;
  int sm_count = 0;
  int max_smem_per_block = 0;  // opt-in limit for dynamic shared memory
  bool is_sm90 = false;        // compute capability 9.0: the Hopper kernels apply
  int major = 0, minor = 0;    // compute capability, for error messages
};

constexpr int kMaxDevices = 64;

const DeviceInfo& device_info(int device) {
  static DeviceInfo infos[kMaxDevices];
  static std::once_flag once[kMaxDevices];
  std::call_once(once[device], [device] {
    DeviceInfo& info = infos[device];
    info.error = cudaDeviceGetAttribute(&info.sm_count, cudaDevAttrMultiProcessorCount, device);
    if (info.error == cudaSuccess) {
      info.error = cudaDeviceGetAttribute(&info.max_smem_per_block,
                                          cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    }
    if (info.error == cudaSuccess) {
      info.error = cudaDeviceGetAttribute(&info.major, cudaDevAttrComputeCapabilityMajor, device);
    }
    if (info.error == cudaSuccess) {
      info.error = cudaDeviceGetAttribute(&info.minor, cudaDevAttrComputeCapabilityMinor, device);
    }
    info.is_sm90 = info.major == 9 && info.minor == 0;
  });
  return infos[device];
}

// JFLASH_CUDA_FORWARD and JFLASH_CUDA_BACKWARD pick a kernel family: "auto"
// (default: the Hopper kernel on compute capability 9.0 where it covers the
// call, the sm80 kernel elsewhere) or "sm80" (the sm80 kernel everywhere; for
// comparisons). Read once per process, so every call of a program sees the
// same choice.
enum class FamilyChoice { kAuto, kSm80, kInvalid };
FamilyChoice read_family_choice(const char* variable) {
  const char* env = std::getenv(variable);
  if (env == nullptr || std::string(env).empty() || std::string(env) == "auto") {
    return FamilyChoice::kAuto;
  }
  return std::string(env) == "sm80" ? FamilyChoice::kSm80 : FamilyChoice::kInvalid;
}
FamilyChoice forward_choice() {
  static const FamilyChoice choice = read_family_choice("JFLASH_CUDA_FORWARD");
  return choice;
}
FamilyChoice backward_choice() {
  static const FamilyChoice choice = read_family_choice("JFLASH_CUDA_BACKWARD");
  return choice;
}

// An integer setting from the environment: 0 when unset or empty, the value
// when it is a whole number in [lo, hi], -1 otherwise (CheckSettings reports it).
int read_int_setting(const char* variable, long lo, long hi) {
  const char* env = std::getenv(variable);
  if (env == nullptr || *env == '\0') return 0;
  char* end = nullptr;
  const long value = std::strtol(env, &end, 10);
  return (*end == '\0' && value >= lo && value <= hi) ? static_cast<int>(value) : -1;
}

// JFLASH_CUDA_SMEM_LIMIT (bytes) lowers the per-block shared memory the
// kernels may use below the device's own limit, so that the small-shared-
// memory tiles of sm86 / sm89 (tile_sizes.h, SmemClass::kSmall) can be tested
// and timed on larger GPUs. Read once per process; 0 = unset, -1 = invalid.
int smem_limit_override() {
  static const int limit = read_int_setting("JFLASH_CUDA_SMEM_LIMIT", 1, 1L << 30);
  return limit;
}

// JFLASH_CUDA_BWD_HEAD_SPLITS forces the Hopper backward's GQA head split
// (csrc/cuda/sm90/tile_scheduler_sm90.h) where it divides the group, for
// measurements; unset or 0: the launcher's choice. Read once per process;
// -1 = invalid.
int bwd_head_splits_override() {
  static const int splits = read_int_setting("JFLASH_CUDA_BWD_HEAD_SPLITS", 0, 1024);
  return splits;
}

// The shared memory per block that kernels may use on this device.
int smem_limit(const DeviceInfo& info) {
  const int cap = smem_limit_override();
  return cap > 0 ? std::min(cap, info.max_smem_per_block) : info.max_smem_per_block;
}

// Errors of the process-wide settings (environment variables), checked on
// every call so that a typo is reported, never silently ignored.
ffi::Error CheckSettings() {
  for (auto [choice, variable] : {std::pair{forward_choice(), "JFLASH_CUDA_FORWARD"},
                                  std::pair{backward_choice(), "JFLASH_CUDA_BACKWARD"}}) {
    if (choice == FamilyChoice::kInvalid) {
      return ffi::Error::InvalidArgument(std::string("jflash: ") + variable +
                                         " must be 'auto' or 'sm80' (got '" +
                                         std::getenv(variable) + "')");
    }
  }
  if (smem_limit_override() < 0) {
    return ffi::Error::InvalidArgument(
        "jflash: JFLASH_CUDA_SMEM_LIMIT must be a positive number of bytes (got '" +
        std::string(std::getenv("JFLASH_CUDA_SMEM_LIMIT")) + "')");
  }
  if (bwd_head_splits_override() < 0) {
    return ffi::Error::InvalidArgument(
        "jflash: JFLASH_CUDA_BWD_HEAD_SPLITS must be a number from 0 to 1024 (got '" +
        std::string(std::getenv("JFLASH_CUDA_BWD_HEAD_SPLITS")) + "')");
  }
  return ffi::Error::Success();
}

ffi::ErrorOr<const DeviceInfo*> current_device_info() {
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) {
    return ffi::Error(ffi::ErrorCode::kInternal,
                      std::string("jflash: cudaGetDevice: ") + cudaGetErrorString(err));
  }
  if (device < 0 || device >= kMaxDevices) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented, "jflash: device ordinal out of range");
  }
  const DeviceInfo& info = device_info(device);
  if (info.error != cudaSuccess) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("jflash: cudaDeviceGetAttribute: ") +
                                                     cudaGetErrorString(info.error));
  }
  return &info;
}

ffi::Error CudaError(cudaError_t err, const char* what) {
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string("jflash: ") + what + ": " + cudaGetErrorString(err));
}

// A kernel launch's error. The Hopper kernels are built for 90a (and selected
// on compute capability 9.0 only), the others for every other arch of
// JFLASH_CUDA_ARCHS with the compute_80 PTX where 80 is one of them (the sm80
// forward and backward run on Hopper from that PTX: csrc/cuda/cuda.cmake), so
// a GPU finds no code only where the build's arch list leaves it out, and 80
// with it: say so, rather than CUDA's "no kernel image".
ffi::Error LaunchError(cudaError_t err, const DeviceInfo& info, const char* direction) {
  if (err == cudaErrorNoKernelImageForDevice || err == cudaErrorInvalidDeviceFunction) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      std::string("jflash: this build has no CUDA ") + direction +
                          " kernel code for this GPU (compute capability " +
                          std::to_string(info.major) + "." + std::to_string(info.minor) +
                          "): it was built with JFLASH_CUDA_ARCHS=" JFLASH_CUDA_ARCHS
                          "; rebuild with 80 among them (" + cudaGetErrorString(err) + ")");
  }
  return CudaError(err, (std::string(direction) + " launch").c_str());
}

const char* DTypeName(DType dtype) {
  return dtype == DType::kFloat16 ? "float16" : dtype == DType::kBFloat16 ? "bfloat16" : "float32";
}

// Whether kernels of (dtype, head dim) may exist: one of kKernelHeadDims, and
// of kFloat32HeadDims for float32.
bool KernelHeadDim(DType dtype, int head_dim) {
  return kernel_head_dim_index(head_dim) >= 0 &&
         (dtype != DType::kFloat32 || is_listed_head_dim(kFloat32HeadDims, head_dim));
}

// The column of the sm80 tile table for this device: kSmall where the kLarge
// tile of the head dim needs more shared memory than the device allows.
cuda::SmemClass Sm80Column(int large_tile_smem, bool has_small_tile, const DeviceInfo& info) {
  return has_small_tile && large_tile_smem > smem_limit(info) ? cuda::SmemClass::kSmall
                                                               : cuda::SmemClass::kLarge;
}

// Whether a family's Hopper kernel takes a call: compute capability 9.0, the
// family not forced to sm80, the kernel built for this (dtype, head dim,
// mask), within the shared-memory limit, and accepting the call's tensors
// (params == nullptr: assume it does).
template <typename Kernel, typename Params>
bool HopperTakes(const Kernel& hopper, const DeviceInfo& info, FamilyChoice choice,
                 const Params* params) {
  return info.is_sm90 && choice == FamilyChoice::kAuto && hopper.launch != nullptr &&
         hopper.smem_bytes <= smem_limit(info) &&
         (params == nullptr || hopper.accepts == nullptr || hopper.accepts(*params));
}

// The mask kind of the kernel that runs a call of this mask and score kind.
// The softcap kernels are built for bands and segment ids only (build time:
// docs/cuda_kernels.md, "Softcap"): a softcap call whose band removes nothing
// runs the band kernel, whose band then lets every key through (the same
// result, by per-tile classes that say "full").
MaskKind KernelMask(MaskKind mask, ScoreKind score) {
  return score == ScoreKind::kSoftcap && mask == MaskKind::kNone ? MaskKind::kBand : mask;
}

// The Hopper kernels that would run a call: those of the next Hopper head dim
// (head_dims.h, sm90_kernel_head_dim), which take a narrower call's buffers as
// they are.
const cuda::FwdKernel& HopperForward(DType dtype, int head_dim, MaskKind mask, ScoreKind score) {
  return cuda::sm90_fwd_kernel_slot(dtype, sm90_kernel_head_dim(head_dim), mask, score);
}
const cuda::BwdKernel& HopperBackward(DType dtype, int head_dim, MaskKind mask, ScoreKind score) {
  return cuda::sm90_bwd_kernel_slot(dtype, sm90_kernel_head_dim(head_dim), mask, score);
}

// The forward kernel for a call: the Hopper kernel where it takes the call,
// else the sm80 kernel of the device's tile column, which computes the same
// result everywhere. launch == nullptr when the kernel it needs was not built.
// float32 has sm80 kernels only (TF32, tf32_passes 1 or 3), in one column:
// Hopper runs them too.
cuda::FwdKernel SelectForward(const DeviceInfo& info, FamilyChoice choice, DType dtype,
                              int head_dim, MaskKind call_mask, ScoreKind score,
                              const FwdParams* params, int tf32_passes) {
  if (!KernelHeadDim(dtype, head_dim)) return {};
  const MaskKind mask = KernelMask(call_mask, score);
  if (dtype == DType::kFloat32) {
    return cuda::fwd_kernel_slot(dtype, head_dim, mask, score, cuda::SmemClass::kLarge,
                                 tf32_passes);
  }
  const cuda::FwdKernel& hopper = HopperForward(dtype, head_dim, mask, score);
  if (HopperTakes(hopper, info, choice, params)) return hopper;
  const auto column = Sm80Column(cuda::fwd_smem_bytes(cuda::fwd_tile(head_dim), head_dim),
                                 cuda::has_small_fwd_tile(head_dim), info);
  return cuda::fwd_kernel_slot(dtype, head_dim, mask, score, column);
}

// The backward kernel for a call, chosen the same way.
cuda::BwdKernel SelectBackward(const DeviceInfo& info, FamilyChoice choice, DType dtype,
                               int head_dim, MaskKind call_mask, ScoreKind score,
                               const BwdParams* params, int tf32_passes) {
  if (!KernelHeadDim(dtype, head_dim)) return {};
  const MaskKind mask = KernelMask(call_mask, score);
  if (dtype == DType::kFloat32) {
    return cuda::bwd_kernel_slot(dtype, head_dim, mask, score, cuda::SmemClass::kLarge,
                                 tf32_passes);
  }
  const cuda::BwdKernel& hopper = HopperBackward(dtype, head_dim, mask, score);
  if (HopperTakes(hopper, info, choice, params)) return hopper;
  const auto column = Sm80Column(cuda::bwd_smem_bytes(cuda::bwd_tile(head_dim), head_dim),
                                 cuda::has_small_bwd_tile(head_dim), info);
  return cuda::bwd_kernel_slot(dtype, head_dim, mask, score, column);
}

// Checks what the CUDA kernels support beyond FillFwdParams' ABI checks and
// returns the launch context of the current device.
ffi::ErrorOr<cuda::LaunchContext> Prepare(const FwdParams& params, cudaStream_t stream,
                                          const DeviceInfo& info, MaskKind mask, ScoreKind score,
                                          int smem_bytes, bool found, const char* direction) {
  auto listed = [&params](const auto& dims, const char* kernels) -> ffi::Error {
    if (is_listed_head_dim(dims, params.head_dim)) return ffi::Error::Success();
    std::string list;
    for (int d : dims) list += (list.empty() ? "" : ", ") + std::to_string(d);
    return ffi::Error::InvalidArgument(std::string("jflash: the CUDA ") + kernels +
                                       " need head_dim in " + list + " (got " +
                                       std::to_string(params.head_dim) +
                                       "); jflash pads head_dim before the call");
  };
  if (auto err = listed(kKernelHeadDims, "kernels"); err.failure()) return err;
  if (params.dtype == DType::kFloat32) {
    if (auto err = listed(kFloat32HeadDims, "float32 kernels"); err.failure()) return err;
  }
  if (score == ScoreKind::kSoftcap) {
    if (auto err = listed(kSoftcapHeadDims, "softcap kernels"); err.failure()) return err;
  }
  // The sm80 forward steps between a tile's rows with a 32-bit stride.
  constexpr int64_t kMaxTileOffset = int64_t{1} << 31;
  constexpr int64_t kTileRows = cuda::max_fwd_tile_rows();
  static_assert(kTileRows == 128);
  for (int64_t row_stride : {params.q_row_stride, params.k_row_stride, params.v_row_stride}) {
    if (row_stride * kTileRows >= kMaxTileOffset) {
      return ffi::Error::InvalidArgument(
          "jflash: num_heads * head_dim is too large for the CUDA kernels (row stride " +
          std::to_string(row_stride) + " elements)");
    }
  }
  if (!found) {
    return ffi::Error::InvalidArgument(
        std::string("jflash: this build has no CUDA ") + direction + " kernel for " +
        DTypeName(params.dtype) +
        (params.dtype == DType::kFloat32 ? (params.tf32_passes == 3 ? " (3xTF32)" : " (TF32)")
                                         : "") +
        ", head_dim " + std::to_string(params.head_dim) + ", " +
        MaskKindName(mask) + " " + ScoreKindName(score) +
        " attention: it was built with JFLASH_CUDA_SUBSET=" +
        JFLASH_CUDA_SUBSET + "; rebuild with JFLASH_CUDA_SUBSET=all");
  }
  if (smem_bytes > smem_limit(info)) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      std::string("jflash: the CUDA ") + direction + " kernel for head_dim " +
                          std::to_string(params.head_dim) + " needs " + std::to_string(smem_bytes) +
                          " bytes of shared memory per block; this GPU allows " +
                          std::to_string(smem_limit(info)) +
                          (smem_limit_override() > 0 ? " (JFLASH_CUDA_SMEM_LIMIT)" : "") +
                          (params.dtype == DType::kFloat32
                               ? ". The float32 kernels are built for GPUs with >= 163 KB per "
                                 "block (sm80, sm90); cast the inputs to bfloat16 on this one"
                               : ""));
  }
  return cuda::LaunchContext{stream, info.sm_count, bwd_head_splits_override()};
}

ffi::Error FwdCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   ffi::AnyBuffer q_segment_ids, ffi::AnyBuffer kv_segment_ids,
                   ffi::AnyBuffer q_segment_blocks, ffi::AnyBuffer kv_segment_blocks,
                   ffi::AnyBuffer q_segment_ranges, ffi::AnyBuffer kv_segment_ranges,
                   ffi::Result<ffi::AnyBuffer> out,
                   ffi::Result<ffi::AnyBuffer> lse, ffi::Result<ffi::AnyBuffer> tile_counter,
                   float softmax_scale, int64_t diag_lo, int64_t diag_hi, float softcap,
                   int64_t tf32_passes) {
  FwdParams params;
  const ffi_glue::SegmentBuffers segments{q_segment_ids,    kv_segment_ids,   q_segment_blocks,
                                          kv_segment_blocks, q_segment_ranges, kv_segment_ranges};
  if (auto err = ffi_glue::FillFwdParams(q, k, v, segments, *out, *lse, softmax_scale, diag_lo,
                                         diag_hi, softcap, &params);
      err.failure()) {
    return err;
  }
  if (auto err = ffi_glue::SetTf32Passes(tf32_passes, &params); err.failure()) return err;
  if (auto err = ffi_glue::SetTileCounter(*tile_counter, &params); err.failure()) return err;
  if (params.batch == 0 || params.seqlen_q == 0 || params.num_heads == 0) {
    return ffi::Error::Success();
  }
  auto info = current_device_info();
  if (info.has_error()) return info.error();
  const FamilyChoice choice = forward_choice();
  if (auto err = CheckSettings(); err.failure()) return err;
  const MaskKind mask = params.mask.kind(params.seqlen_q, params.seqlen_k);
  const ScoreKind score = params.score_kind();
  const cuda::FwdKernel kernel =
      SelectForward(**info, choice, params.dtype, params.head_dim, mask, score, &params,
                    params.tf32_passes);
  auto ctx = Prepare(params, stream, **info, mask, score, kernel.smem_bytes,
                     kernel.launch != nullptr, "forward");
  if (ctx.has_error()) return ctx.error();
  if (cudaError_t err = kernel.launch(params, *ctx); err != cudaSuccess) {
    return LaunchError(err, **info, "forward");
  }
  return ffi::Error::Success();
}

ffi::Error BwdCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   ffi::AnyBuffer out, ffi::AnyBuffer dout, ffi::AnyBuffer lse,
                   ffi::AnyBuffer dlse, ffi::AnyBuffer q_segment_ids,
                   ffi::AnyBuffer kv_segment_ids, ffi::AnyBuffer q_segment_blocks,
                   ffi::AnyBuffer kv_segment_blocks, ffi::AnyBuffer q_segment_ranges,
                   ffi::AnyBuffer kv_segment_ranges,
                   ffi::AnyBuffer delta_in, ffi::AnyBuffer dq_accum_in,
                   ffi::AnyBuffer dkv_accum_in,
                   ffi::Result<ffi::AnyBuffer> dq,
                   ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                   ffi::Result<ffi::AnyBuffer> dq_accum, ffi::Result<ffi::AnyBuffer> delta,
                   ffi::Result<ffi::AnyBuffer> dq_semaphore,
                   ffi::Result<ffi::AnyBuffer> dkv_accum, float softmax_scale,
                   int64_t diag_lo, int64_t diag_hi, float softcap, int64_t tf32_passes,
                   int64_t dq_mode, int64_t dq_accum_row_offset, int64_t dkv_mode) {
  BwdParams params;
  const ffi_glue::SegmentBuffers segments{q_segment_ids,    kv_segment_ids,   q_segment_blocks,
                                          kv_segment_blocks, q_segment_ranges, kv_segment_ranges};
  if (auto err = ffi_glue::FillBwdParams(q, k, v, out, dout, lse, dlse, segments, delta_in,
                                         dq_accum_in, dkv_accum_in, *dq, *dk, *dv, *dq_accum,
                                         *delta, *dq_semaphore, *dkv_accum, softmax_scale,
                                         diag_lo, diag_hi, softcap, dq_mode,
                                         dq_accum_row_offset, dkv_mode, &params);
      err.failure()) {
    return err;
  }
  if (auto err = ffi_glue::SetTf32Passes(tf32_passes, &params); err.failure()) return err;
  if (params.batch == 0 || params.num_heads == 0) return ffi::Error::Success();
  // seqlen_q == 0 still launches: dK and dV must be written (as zeros).
  auto info = current_device_info();
  if (info.has_error()) return info.error();
  if (auto err = CheckSettings(); err.failure()) return err;
  const MaskKind mask = params.mask.kind(params.seqlen_q, params.seqlen_k);
  const ScoreKind score = params.score_kind();
  const cuda::BwdKernel kernel = SelectBackward(**info, backward_choice(), params.dtype,
                                                params.head_dim, mask, score, &params,
                                                params.tf32_passes);
  auto ctx = Prepare(params, stream, **info, mask, score, kernel.smem_bytes,
                     kernel.launch != nullptr, "backward");
  if (ctx.has_error()) return ctx.error();
  if (cudaError_t err = kernel.launch(params, *ctx); err != cudaSuccess) {
    return LaunchError(err, **info, "backward");
  }
  return ffi::Error::Success();
}

bool DecodeHeadDim(int head_dim) {
  for (int d : kDecodeHeadDims) {
    if (d == head_dim) return true;
  }
  return false;
}

// The decode kernel of a call's dtype and head dim; launch == nullptr when
// none is built.
cuda::DecodeKernel SelectDecode(DType dtype, int head_dim) {
  if (dtype == DType::kFloat32 || !DecodeHeadDim(head_dim)) return {};
  return cuda::decode_kernel_slot(dtype, head_dim);
}

ffi::Error DecodeCuda(cudaStream_t stream, const ffi_glue::DecodeBuffers& buffers,
                      const ffi_glue::DecodeAttrs& attrs) {
  DecodeParams params;
  if (auto err = ffi_glue::FillDecodeParams(buffers, attrs, &params); err.failure()) return err;
  if (params.batch == 0 || params.num_heads == 0) return ffi::Error::Success();
  auto info = current_device_info();
  if (info.has_error()) return info.error();
  if (auto err = CheckSettings(); err.failure()) return err;
  if (params.dtype == DType::kFloat32) {
    return ffi::Error::InvalidArgument(
        "jflash decode: the CUDA kernel takes float16 or bfloat16; jflash attends over a "
        "bfloat16 copy of a float32 cache before the call (jflash/_src/decode.py)");
  }
  if (!DecodeHeadDim(params.head_dim)) {
    return ffi::Error::InvalidArgument("jflash decode: the CUDA kernel needs head_dim 64, 128 or "
                                       "256 (got " + std::to_string(params.head_dim) +
                                       "); jflash pads head_dim before the call");
  }
  const cuda::DecodeKernel kernel = SelectDecode(params.dtype, params.head_dim);
  if (kernel.launch == nullptr) {
    return ffi::Error::InvalidArgument(
        std::string("jflash: this build has no CUDA decode kernel for ") +
        DTypeName(params.dtype) + ", head_dim " + std::to_string(params.head_dim) +
        ": it was built with JFLASH_CUDA_SUBSET=" JFLASH_CUDA_SUBSET
        "; rebuild with JFLASH_CUDA_SUBSET=all");
  }
  const cuda::LaunchContext ctx{stream, (*info)->sm_count, 0, smem_limit(**info),
                                /*programmatic_launch=*/(*info)->is_sm90};
  const int rows = decode_rows(params);
  if (const int smem = kernel.smem_bytes(rows, ctx); smem > ctx.smem_limit) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      "jflash: the CUDA decode kernel for head_dim " +
                          std::to_string(params.head_dim) + " needs " + std::to_string(smem) +
                          " bytes of shared memory per block; this GPU allows " +
                          std::to_string(ctx.smem_limit));
  }
  // One CTA per (sequence, kv head, split, 16 rows at most): gridDim.x.
  if (int64_t{params.batch} * params.num_heads_kv * params.num_splits * rows > INT32_MAX) {
    return ffi::Error::InvalidArgument("jflash decode: batch * num_heads * seqlen_q * num_splits "
                                       "must be below 2^31");
  }
  if (cudaError_t err = kernel.launch(params, ctx); err != cudaSuccess) {
    return LaunchError(err, **info, "decode");
  }
  return ffi::Error::Success();
}

ffi::Error DecodeNoAppendCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k_cache,
                              ffi::AnyBuffer v_cache, ffi::AnyBuffer cache_seqlens,
                              ffi::AnyBuffer block_table, ffi::Result<ffi::AnyBuffer> out,
                              ffi::Result<ffi::AnyBuffer> lse,
                              ffi::Result<ffi::AnyBuffer> out_partial,
                              ffi::Result<ffi::AnyBuffer> lse_partial, float softmax_scale,
                              float softcap, int64_t window_left, int64_t window_right,
                              int64_t num_splits) {
  return DecodeCuda(stream,
                    {q, k_cache, v_cache, nullptr, nullptr, cache_seqlens, block_table, *out, *lse,
                     nullptr, nullptr, *out_partial, *lse_partial},
                    {softmax_scale, softcap, window_left, window_right, num_splits});
}

ffi::Error DecodeAppendCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k_cache,
                            ffi::AnyBuffer v_cache, ffi::AnyBuffer k_new, ffi::AnyBuffer v_new,
                            ffi::AnyBuffer cache_seqlens, ffi::AnyBuffer block_table,
                            ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse,
                            ffi::Result<ffi::AnyBuffer> k_cache_out,
                            ffi::Result<ffi::AnyBuffer> v_cache_out,
                            ffi::Result<ffi::AnyBuffer> out_partial,
                            ffi::Result<ffi::AnyBuffer> lse_partial, float softmax_scale,
                            float softcap, int64_t window_left, int64_t window_right,
                            int64_t num_splits) {
  return DecodeCuda(stream,
                    {q, k_cache, v_cache, &k_new, &v_new, cache_seqlens, block_table, *out, *lse,
                     &*k_cache_out, &*v_cache_out, *out_partial, *lse_partial},
                    {softmax_scale, softcap, window_left, window_right, num_splits});
}

// The device for the library's queries below: nullptr when there is no usable
// device or a setting is invalid (the queries then answer -1).
const DeviceInfo* QueryDevice() {
  auto info = current_device_info();
  if (info.has_error() || CheckSettings().failure()) return nullptr;
  return *info;
}

// A query's call: the device (nullptr where the query answers -1: no usable
// device, an invalid setting or kind) and the kinds, the mask kind that of the
// kernel that runs it (KernelMask).
struct Query {
  const DeviceInfo* info = nullptr;
  DType dtype = DType::kBFloat16;
  int tf32_passes = 1;
  MaskKind mask = MaskKind::kNone;
  ScoreKind score = ScoreKind::kPlain;
};
Query ReadQuery(int dtype, int mask_kind, int score_kind) {
  Query q;
  if (mask_kind < 0 || mask_kind >= kNumMaskKinds || score_kind < 0 ||
      score_kind >= kNumScoreKinds || dtype < 0 || dtype > 3) {
    return q;
  }
  // 0 float16, 1 bfloat16, 2 float32 with one TF32 pass, 3 with three.
  q.dtype = dtype >= 2 ? DType::kFloat32 : static_cast<DType>(dtype);
  q.tf32_passes = dtype == 3 ? 3 : 1;
  q.score = static_cast<ScoreKind>(score_kind);
  q.mask = KernelMask(static_cast<MaskKind>(mask_kind), q.score);
  q.info = QueryDevice();
  return q;
}

// The family of a call's kernel: 90 the Hopper kernel, 80 the sm80 one, 0
// neither built.
template <typename Kernel>
int Family(const Kernel& kernel, const Kernel& hopper) {
  if (kernel.launch == nullptr) return 0;
  return kernel.launch == hopper.launch ? 90 : 80;
}

}  // namespace
}  // namespace jflash

// Which forward kernel family a call would run on the current device, for
// tests and benchmarks (jflash/_src/ffi.py: cuda_forward_family): 90 (Hopper
// kernel), 80 (sm80 kernel), 0 (not built), -1 (no usable device, an invalid
// JFLASH_CUDA_FORWARD, dtype, mask kind or score kind). dtype: 0 float16, 1
// bfloat16, 2 float32 (TF32), 3 float32 (3xTF32); mask_kind: a MaskKind (jflash/_src/masks.py: MASK_KIND_*);
// score_kind: a ScoreKind (0 plain, 1 softcap).
extern "C" __attribute__((visibility("default"))) int jflash_cuda_forward_family(
    int dtype, int head_dim, int mask_kind, int score_kind) {
  const jflash::Query q = jflash::ReadQuery(dtype, mask_kind, score_kind);
  if (q.info == nullptr) return -1;
  return jflash::Family(jflash::SelectForward(*q.info, jflash::forward_choice(), q.dtype,
                                              head_dim, q.mask, q.score, nullptr,
                                              q.tf32_passes),
                        jflash::HopperForward(q.dtype, head_dim, q.mask, q.score));
}

// The same for the backward (jflash/_src/ffi.py: cuda_backward_family).
extern "C" __attribute__((visibility("default"))) int jflash_cuda_backward_family(
    int dtype, int head_dim, int mask_kind, int score_kind) {
  const jflash::Query q = jflash::ReadQuery(dtype, mask_kind, score_kind);
  if (q.info == nullptr) return -1;
  return jflash::Family(jflash::SelectBackward(*q.info, jflash::backward_choice(), q.dtype,
                                               head_dim, q.mask, q.score, nullptr,
                                               q.tf32_passes),
                        jflash::HopperBackward(q.dtype, head_dim, q.mask, q.score));
}

// The dynamic shared memory per block of the kernel a call would run on the
// current device (jflash/_src/ffi.py: cuda_kernel_smem_bytes): direction 0
// forward, 1 backward; 0 when that kernel was not built, -1 as above.
extern "C" __attribute__((visibility("default"))) int jflash_cuda_kernel_smem_bytes(
    int direction, int dtype, int head_dim, int mask_kind, int score_kind) {
  const jflash::Query q = jflash::ReadQuery(dtype, mask_kind, score_kind);
  if (q.info == nullptr) return -1;
  if (direction == 0) {
    const auto kernel = jflash::SelectForward(*q.info, jflash::forward_choice(), q.dtype,
                                              head_dim, q.mask, q.score, nullptr, q.tf32_passes);
    return kernel.launch == nullptr ? 0 : kernel.smem_bytes;
  }
  const auto kernel = jflash::SelectBackward(*q.info, jflash::backward_choice(), q.dtype,
                                             head_dim, q.mask, q.score, nullptr, q.tf32_passes);
  return kernel.launch == nullptr ? 0 : kernel.smem_bytes;
}

// The decode kernel's split heuristic on the current device
// (jflash/_src/ffi.py: decode_num_splits; jflash/decode.h): dtype 0 float16,
// 1 bfloat16; rows: query heads per kv head times queries; capacity: keys per
// sequence. -1 where there is no usable device or no kernel for the call.
extern "C" __attribute__((visibility("default"))) int jflash_cuda_decode_num_splits(
    int dtype, int head_dim, int64_t batch, int64_t num_heads_kv, int64_t rows,
    int64_t capacity) {
  const jflash::DeviceInfo* info = jflash::QueryDevice();
  if (info == nullptr || rows < 1 || rows > INT32_MAX) return -1;
  const auto kernel = jflash::SelectDecode(static_cast<jflash::DType>(dtype), head_dim);
  if (kernel.launch == nullptr) return -1;
  const jflash::cuda::LaunchContext ctx{nullptr, info->sm_count, 0, jflash::smem_limit(*info)};
  return kernel.num_splits(batch, num_heads_kv, static_cast<int>(rows), capacity, ctx);
}

// The library is built with hidden visibility; export the handler symbols
// that jflash/_src/ffi.py looks up.
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* JflashFwdCuda(XLA_FFI_CallFrame*);
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* JflashBwdCuda(XLA_FFI_CallFrame*);
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* JflashDecodeCuda(
    XLA_FFI_CallFrame*);
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* JflashDecodeAppendCuda(
    XLA_FFI_CallFrame*);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JflashFwdCuda, jflash::FwdCuda,
                              jflash::ffi_glue::BindFwd(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JflashBwdCuda, jflash::BwdCuda,
                              jflash::ffi_glue::BindBwd(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JflashDecodeCuda, jflash::DecodeNoAppendCuda,
                              jflash::ffi_glue::BindDecode(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JflashDecodeAppendCuda, jflash::DecodeAppendCuda,
                              jflash::ffi_glue::BindDecodeAppend(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

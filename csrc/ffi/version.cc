// Build provenance, compiled into every jflash library so that Python can
// refuse to register handlers built against a newer XLA FFI than the running
// jaxlib (such a handler fails to load and takes the backend down with it),
// and the facts of the build that Python must agree with (the head dims).
#include "jflash/head_dims.h"
#include "jflash/mask.h"
#include "xla/ffi/api/c_api.h"

#ifndef JFLASH_BUILD_JAXLIB_VERSION
#error "CMake defines JFLASH_BUILD_JAXLIB_VERSION (the jaxlib whose FFI headers we build against)"
#endif

#define JFLASH_EXPORT extern "C" __attribute__((visibility("default")))

JFLASH_EXPORT int jflash_ffi_api_major() { return XLA_FFI_API_MAJOR; }
JFLASH_EXPORT int jflash_ffi_api_minor() { return XLA_FFI_API_MINOR; }
JFLASH_EXPORT const char* jflash_build_jaxlib_version() { return JFLASH_BUILD_JAXLIB_VERSION; }

namespace {

// Writes at most capacity entries of a head-dim list to out; returns its length.
template <int kCount>
int write_head_dims(const int (&dims)[kCount], int* out, int capacity) {
  for (int i = 0; i < kCount && i < capacity; ++i) out[i] = dims[i];
  return kCount;
}

}  // namespace

// The head-dim lists of jflash/head_dims.h for Python: every kernel's, the
// segment-id kernels', the softcap kernels' and the float32 kernels'; and the
// block size of the segment ids' summaries (jflash/mask.h).
JFLASH_EXPORT int jflash_kernel_head_dims(int* out, int capacity) {
  return write_head_dims(jflash::kKernelHeadDims, out, capacity);
}
JFLASH_EXPORT int jflash_segment_head_dims(int* out, int capacity) {
  return write_head_dims(jflash::kSegmentHeadDims, out, capacity);
}
JFLASH_EXPORT int jflash_softcap_head_dims(int* out, int capacity) {
  return write_head_dims(jflash::kSoftcapHeadDims, out, capacity);
}
JFLASH_EXPORT int jflash_float32_head_dims(int* out, int capacity) {
  return write_head_dims(jflash::kFloat32HeadDims, out, capacity);
}
JFLASH_EXPORT int jflash_segment_block() { return jflash::kSegmentBlock; }

// The decode kernels' head dims (jflash/head_dims.h), for Python.
JFLASH_EXPORT int jflash_decode_head_dims(int* out, int capacity) {
  for (int i = 0; i < jflash::kNumDecodeHeadDims && i < capacity; ++i) {
    out[i] = jflash::kDecodeHeadDims[i];
  }
  return jflash::kNumDecodeHeadDims;
}

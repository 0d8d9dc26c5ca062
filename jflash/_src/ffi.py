"""Loads the compiled jflash libraries and registers their XLA FFI targets.

Target names carry an ABI version (``jflash_fwd_v5``): a serialized program
(jax.export) that names a target never binds to a handler of a changed ABI.
The CPU and CUDA handlers share names and argument order, so one ``ffi_call``
lowers for either platform.
"""

from __future__ import annotations

import ctypes
import os
import pathlib

import jax
import jaxlib

from jflash._src import masks

FWD_TARGET = "jflash_fwd_v5"
BWD_TARGET = "jflash_bwd_v8"
# Decode over a KV cache (jflash.flash_attention_with_kvcache): without and
# with an append (the latter aliases the caches to two of its results).
DECODE_TARGET = "jflash_decode_v1"
DECODE_APPEND_TARGET = "jflash_decode_append_v1"

_PACKAGE_DIR = pathlib.Path(__file__).resolve().parent.parent
_CPU_LIBRARY = "libjflash_cpu.so"
_CUDA_LIBRARY = "libjflash_cuda.so"


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def _check_built_against(lib: ctypes.CDLL, path: pathlib.Path) -> None:
    """Refuses a library built against FFI headers newer than the running jaxlib.

    Such a handler does not load: XLA rejects it when the backend starts and the
    whole backend fails. Failing here instead names the cause and the fix. A
    wheel declares the same bound (jaxlib >= the build's) to pip; this catches
    installs that bypass it (--no-deps, a later jaxlib downgrade).
    """
    lib.jflash_build_jaxlib_version.restype = ctypes.c_char_p
    built = lib.jflash_build_jaxlib_version().decode()
    api = (lib.jflash_ffi_api_major(), lib.jflash_ffi_api_minor())
    if _version_tuple(built) > _version_tuple(jaxlib.__version__):
        raise ImportError(
            f"jflash: {path.name} was built against jaxlib {built} (XLA FFI API "
            f"{api[0]}.{api[1]}), newer than the running jaxlib {jaxlib.__version__}. "
            f"Install jaxlib>={built}, or rebuild jflash in this environment with "
            "`pip install --no-build-isolation .` so that it uses the installed jax."
        )


def _load(name: str) -> ctypes.CDLL | None:
    path = _PACKAGE_DIR / name
    if not path.exists():
        return None
    lib = ctypes.cdll.LoadLibrary(str(path))
    _check_built_against(lib, path)
    return lib


def _register(lib: ctypes.CDLL, platform: str, suffix: str) -> None:
    for target, symbol in ((FWD_TARGET, "JflashFwd"), (BWD_TARGET, "JflashBwd"),
                           (DECODE_TARGET, "JflashDecode"),
                           (DECODE_APPEND_TARGET, "JflashDecodeAppend")):
        jax.ffi.register_ffi_target(
            target, jax.ffi.pycapsule(getattr(lib, symbol + suffix)), platform=platform
        )


CPU_THREADS_VARIABLE = "JFLASH_CPU_THREADS"
_MAX_CPU_THREADS = 1024  # kMaxThreads of csrc/cpu/thread_pool.cc


def _check_cpu_threads() -> None:
    """The CPU kernels' pool size (csrc/cpu/thread_pool.cc reads it on first use):
    unset, or an integer from 1 to 1024."""
    text = os.environ.get(CPU_THREADS_VARIABLE)
    if text is None:
        return
    if not (text.isascii() and text.isdigit() and 1 <= int(text) <= _MAX_CPU_THREADS):
        raise ValueError(
            f"{CPU_THREADS_VARIABLE} must be an integer from 1 to {_MAX_CPU_THREADS} "
            f"(threads of jflash's CPU kernels), got {text!r}"
        )


_check_cpu_threads()
_cpu_lib = _load(_CPU_LIBRARY)
if _cpu_lib is None:
    raise ImportError(
        f"jflash: {_CPU_LIBRARY} is missing from {_PACKAGE_DIR}; jflash must be installed "
        "(pip install --no-build-isolation .), not imported from a source tree"
    )
_register(_cpu_lib, "cpu", "Cpu")

_cuda_lib = _load(_CUDA_LIBRARY)
if _cuda_lib is not None:
    _register(_cuda_lib, "CUDA", "Cuda")

HAS_CUDA_KERNELS = _cuda_lib is not None
"""True when this build contains the CUDA kernels (they run when arrays live on a GPU)."""


def _read_list(function) -> tuple[int, ...]:
    capacity = 64
    out = (ctypes.c_int * capacity)()
    count = function(out, capacity)
    return tuple(out[: min(count, capacity)])


# The head dims the kernels are built for, and the subsets that calls with segment
# ids, with softcap and with float32 inputs run on (csrc/include/jflash/head_dims.h);
# the block of rows (keys) that segment ids are summarized by
# (csrc/include/jflash/mask.h, kSegmentBlock).
KERNEL_HEAD_DIMS = _read_list(_cpu_lib.jflash_kernel_head_dims)
SEGMENT_HEAD_DIMS = _read_list(_cpu_lib.jflash_segment_head_dims)
SOFTCAP_HEAD_DIMS = _read_list(_cpu_lib.jflash_softcap_head_dims)
FLOAT32_HEAD_DIMS = _read_list(_cpu_lib.jflash_float32_head_dims)
SEGMENT_BLOCK = int(_cpu_lib.jflash_segment_block())
# The head dims of the decode kernels (the same header).
DECODE_HEAD_DIMS = _read_list(_cpu_lib.jflash_decode_head_dims)

_DECODE_SPLITS_ARGS = [ctypes.c_int64] * 4  # batch, num_heads_kv, rows, capacity
_cpu_lib.jflash_cpu_decode_num_splits.argtypes = _DECODE_SPLITS_ARGS
_cpu_lib.jflash_decode_num_splits_cuda_model.argtypes = [ctypes.c_int64] * 4
if _cuda_lib is not None:
    _cuda_lib.jflash_cuda_decode_num_splits.argtypes = [ctypes.c_int, ctypes.c_int,
                                                        *_DECODE_SPLITS_ARGS]


# The precisions of float32 calls on CUDA (the FFI attribute tf32_passes,
# csrc/include/jflash/params.h): 1, TF32 tensor-core MMAs; 3, 3xTF32 (each operand
# split into a TF32 part and its TF32 remainder, three MMAs per product:
# float32-class accuracy). The half-precision and the CPU kernels ignore it.
TF32_PASSES = (1, 3)


def check_tf32_passes(tf32_passes) -> int:
    if tf32_passes not in TF32_PASSES or isinstance(tf32_passes, bool):
        raise ValueError(f"tf32_passes must be one of {TF32_PASSES}, got {tf32_passes!r}")
    return int(tf32_passes)


def _cuda_dtype_code(dtype, tf32_passes: int = 1) -> int | None:
    """The C library's dtype code (0 float16, 1 bfloat16, 2 float32 in one TF32 pass,
    3 float32 in three), or None where it has no kernel. tf32_passes: 1 or 3, for
    float32 only."""
    passes = check_tf32_passes(tf32_passes)
    if _cuda_lib is None:
        return None
    codes = {"float16": 0, "bfloat16": 1, "float32": 2 if passes == 1 else 3}
    return codes.get(jax.numpy.dtype(dtype).name)


# ScoreKind of csrc/include/jflash/score.h.
_SCORE_KIND_PLAIN = 0
_SCORE_KIND_SOFTCAP = 1


def _kinds(banded: bool, segments: bool, softcap: bool) -> tuple[int, int]:
    """(MaskKind, ScoreKind) of a call: the registry's key beside dtype and head dim."""
    return masks.mask_kind(banded, segments), _SCORE_KIND_SOFTCAP if softcap else _SCORE_KIND_PLAIN


def cuda_forward_family(dtype, head_dim: int, banded: bool, segments: bool = False,
                        softcap: bool = False, *, tf32_passes: int = 1) -> int:
    """The CUDA forward kernel a call would run on the current GPU.

    90: the Hopper (TMA + wgmma) kernel; 80: the sm80 kernel; 0: this build has
    neither for (dtype, head_dim, mask, softcap); -1: no usable GPU, or an
    invalid JFLASH_CUDA_FORWARD. head_dim is the kernel's (padded) head dim; the
    mask is segment ids where segments, else a band or none; softcap: the
    softcap kernels; tf32_passes: for float32, the TF32 (1) or 3xTF32 (3)
    kernels. For tests and benchmarks; the choice itself is made per call in
    the C++ handler.
    """
    code = _cuda_dtype_code(dtype, tf32_passes)
    if code is None:
        return 0
    kinds = _kinds(banded, segments, softcap)
    return int(_cuda_lib.jflash_cuda_forward_family(code, int(head_dim), *kinds))


def cuda_backward_family(dtype, head_dim: int, banded: bool, segments: bool = False,
                         softcap: bool = False, *, tf32_passes: int = 1) -> int:
    """The CUDA backward kernel a call would run on the current GPU.

    The same codes as cuda_forward_family, under JFLASH_CUDA_BACKWARD. Calls whose
    tensors the Hopper kernel cannot take (TMA's 16-byte alignment, an empty
    sequence) run the sm80 backward whatever this says.
    """
    code = _cuda_dtype_code(dtype, tf32_passes)
    if code is None:
        return 0
    kinds = _kinds(banded, segments, softcap)
    return int(_cuda_lib.jflash_cuda_backward_family(code, int(head_dim), *kinds))


def cuda_kernel_smem_bytes(direction: str, dtype, head_dim: int, banded: bool,
                           segments: bool = False, softcap: bool = False, *,
                           tf32_passes: int = 1) -> int:
    """Shared memory per block of the CUDA kernel a call would run on the current GPU.

    direction: "fwd" or "bwd". The handler picks the small-shared-memory tile
    column (csrc/cuda/tile_sizes.h) where the device, or JFLASH_CUDA_SMEM_LIMIT,
    allows less than the default tile needs. 0: that kernel was not built; -1:
    no usable GPU, or an invalid JFLASH_CUDA_FORWARD / _BACKWARD / _SMEM_LIMIT.
    For tests and benchmarks, like cuda_forward_family (tf32_passes likewise).
    """
    if direction not in ("fwd", "bwd"):
        raise ValueError(f"direction must be 'fwd' or 'bwd', got {direction!r}")
    code = _cuda_dtype_code(dtype, tf32_passes)
    if code is None:
        return 0
    kinds = _kinds(banded, segments, softcap)
    return int(
        _cuda_lib.jflash_cuda_kernel_smem_bytes(
            0 if direction == "fwd" else 1, code, int(head_dim), *kinds
        )
    )


def decode_num_splits(on_cpu: bool, dtype, head_dim: int, batch: int, num_heads_kv: int,
                      rows: int, capacity: int) -> int:
    """The decode kernels' split count for a call (csrc/include/jflash/decode.h):
    on CPU from the thread pool's size, on GPU from the current device's SMs and
    the kernel's occupancy. rows: query heads per kv head times queries;
    capacity: keys a cache holds. 1 where the GPU answer is unavailable (no
    usable device, or no kernel for the dtype: decode has none for float32)."""
    args = (int(batch), int(num_heads_kv), int(rows), int(capacity))
    if on_cpu:
        return int(_cpu_lib.jflash_cpu_decode_num_splits(*args))
    code = _cuda_dtype_code(dtype)
    if code not in (0, 1):  # float16, bfloat16
        return 1
    splits = int(_cuda_lib.jflash_cuda_decode_num_splits(code, int(head_dim), *args))
    return splits if splits >= 1 else 1


def decode_num_splits_cuda_model(units: int, sms: int, per_sm: int, capacity: int) -> int:
    """The CUDA decode kernel's split heuristic without a GPU (csrc/include/jflash/decode.h,
    kCudaDecodeSplitCost): units = batch * kv heads * row blocks (16 rows each up
    to 16 rows), sms and CTAs per SM (H100 or H200 at head dim 128: 132 and 3),
    capacity in keys. For tests and the design notes."""
    return int(_cpu_lib.jflash_decode_num_splits_cuda_model(
        int(units), int(sms), int(per_sm), int(capacity)))

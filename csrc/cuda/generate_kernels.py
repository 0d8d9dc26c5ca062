"""Writes one small .cu file per kernel instantiation into csrc/cuda/instantiations/.

One file per (direction, dtype, head dim, mask, score), and per (dtype, head
dim) of the decode kernels, lets JFLASH_CUDA_SUBSET
(csrc/cuda/cuda.cmake) compile only some of them; cuda.cmake then compiles the
chosen files of one (direction, head dim) as one translation unit (the
instantiations share most of nvcc's work: docs/cuda_kernels.md, "Build
time"). The files are committed; rerun this script after changing the set
below:

    python3 csrc/cuda/generate_kernels.py
"""

from __future__ import annotations

import itertools
import pathlib
import re


def _head_dims(name: str) -> tuple[int, ...]:
    """A head-dim list of csrc/include/jflash/head_dims.h (kKernelHeadDims, the one
    list, or kSegmentHeadDims)."""
    header = pathlib.Path(__file__).resolve().parents[1] / "include" / "jflash" / "head_dims.h"
    match = re.search(name + r"\[\]\s*=\s*\{([^}]*)\}", header.read_text())
    if match is None:
        raise SystemExit(f"no {name} initializer in {header}")
    return tuple(int(d) for d in match.group(1).split(","))


HEAD_DIMS = _head_dims("kKernelHeadDims")
# The decode kernels (flash_decode_sm80.h, launched by decode_launch_sm80.h):
# one file per (dtype, head dim), no mask kind (each sequence's band is
# computed in the kernel).
DECODE_HEAD_DIMS = _head_dims("kDecodeHeadDims")
DECODE_REGISTRATION = (
    "register_decode_kernel(DType::{dtype_enum}, {head_dim},\n"
    "    DecodeKernel{{&run_flash_decode<{element}, {head_dim}>,\n"
    "                 &decode_smem_bytes_sm80<{element}, {head_dim}>,\n"
    "                 &decode_num_splits_sm80<{element}, {head_dim}>}})"
)
# The segment-id kernels (SegmentMask) exist for these head dims only (build
# time); jflash pads the head dims of calls with segment ids up to them.
SEGMENT_HEAD_DIMS = _head_dims("kSegmentHeadDims")
# The softcap kernels (ScoreKind::kSoftcap, csrc/include/jflash/score.h) likewise,
# in every direction, for the band and segment-id masks: a softcap call whose
# band removes nothing runs the band kernel (the handlers' KernelMask;
# docs/cuda_kernels.md, "Softcap", has the build cost).
SOFTCAP_HEAD_DIMS = _head_dims("kSoftcapHeadDims")
SOFTCAP_MASKS = ("band", "segments")
# The Hopper kernels (forward and backward) exist for these head dims; Hopper
# runs every other head dim on the kernel of the next of them (head_dims.h).
SM90_HEAD_DIMS = _head_dims("kSm90HeadDims")
DTYPES = {
    "fp16": ("cutlass::half_t", "kFloat16"),
    "bf16": ("cutlass::bfloat16_t", "kBFloat16"),
}
# The float32 kernels: the sm80 forward and backward on TF32 MMAs, one file per
# precision ("tf32": one pass, "tf32x3": three; jflash/params.h, tf32_passes),
# for FLOAT32_HEAD_DIMS and every mask and score kind, in the kLarge tile column
# only (tile_sizes.h, fwd_tile_float32). They run on Hopper too, so cuda.cmake
# compiles them for every arch of the build.
FLOAT32_HEAD_DIMS = _head_dims("kFloat32HeadDims")
FLOAT32_PASSES = {"tf32": 1, "tf32x3": 3}
FLOAT32_DIRECTIONS = {
    "fwd": (
        "cuda/flash_fwd_kernel_sm80.h",
        "register_fwd_kernel(DType::kFloat32, {head_dim}, MaskKind::{mask_kind},\n"
        "    FwdKernel{{&run_flash_fwd<float, {head_dim}, {mask_policy}, SmemClass::kLarge,\n"
        "                              ScoreKind::{score_kind}, {passes}>,\n"
        "              FwdTraitsSm80<float, {head_dim}, SmemClass::kLarge, {passes}>::kSmemBytes}},\n"
        "    SmemClass::kLarge, ScoreKind::{score_kind}, {passes})",
    ),
    "bwd": (
        "cuda/flash_bwd_kernel_sm80.h",
        "register_bwd_kernel(DType::kFloat32, {head_dim}, MaskKind::{mask_kind},\n"
        "    BwdKernel{{&run_flash_bwd<float, {head_dim}, {mask_policy}, SmemClass::kLarge,\n"
        "                              ScoreKind::{score_kind}, {passes}>,\n"
        "              BwdTraitsSm80<float, {head_dim}, SmemClass::kLarge, {passes}>::kSmemBytes}},\n"
        "    SmemClass::kLarge, ScoreKind::{score_kind}, {passes})",
    ),
}
# The mask policies of csrc/include/jflash/mask.h, one instantiation each:
# name in the file name: (policy type, MaskKind). "full": NoMask, for calls whose
# band removes nothing (only the sequence-end residual is masked); "band":
# BandMask, any other band, causal and windows included; "segments":
# SegmentMask, calls with segment ids (any band), for SEGMENT_HEAD_DIMS only and
# the directions in SEGMENT_DIRECTIONS.
MASKS = {"full": ("NoMask", "kNone"), "band": ("BandMask", "kBand"),
         "segments": ("SegmentMask", "kSegments")}
SEGMENT_DIRECTIONS = ("fwd", "bwd", "fwd_small", "bwd_small", "fwd_sm90", "bwd_sm90")
# direction: (header, registration expression, head dims). {score}: nothing for
# the plain kernels, the score kind (after the sm80 kernels' SmemClass) for the
# softcap ones, as the launcher's last template argument and the registration's
# last argument.
DIRECTIONS = {
    "fwd": (
        "cuda/flash_fwd_kernel_sm80.h",
        "register_fwd_kernel(DType::{dtype_enum}, {head_dim}, MaskKind::{mask_kind},\n"
        "    FwdKernel{{&run_flash_fwd<{element}, {head_dim}, {mask_policy}{score}>,\n"
        "              FwdTraitsSm80<{element}, {head_dim}>::kSmemBytes}}{score})",
        HEAD_DIMS,
    ),
    "bwd": (
        "cuda/flash_bwd_kernel_sm80.h",
        "register_bwd_kernel(DType::{dtype_enum}, {head_dim}, MaskKind::{mask_kind},\n"
        "    BwdKernel{{&run_flash_bwd<{element}, {head_dim}, {mask_policy}{score}>,\n"
        "              BwdTraitsSm80<{element}, {head_dim}>::kSmemBytes}}{score})",
        HEAD_DIMS,
    ),
    # The sm80 kernels' small-shared-memory column (tile_sizes.h, SmemClass::
    # kSmall) for GPUs with 99 KB per block (sm86, sm89, sm120), only for the
    # head dims whose kLarge tile needs more; the static_assert keeps this list
    # and the tile table in step.
    "fwd_small": (
        "cuda/flash_fwd_kernel_sm80.h",
        "register_fwd_kernel(DType::{dtype_enum}, {head_dim}, MaskKind::{mask_kind},\n"
        "    FwdKernel{{&run_flash_fwd<{element}, {head_dim}, {mask_policy}, SmemClass::kSmall{score}>,\n"
        "              FwdTraitsSm80<{element}, {head_dim}, SmemClass::kSmall>::kSmemBytes}},\n"
        "    SmemClass::kSmall{score});\n"
        "static_assert(has_small_fwd_tile({head_dim}))",
        (224, 256),
    ),
    "bwd_small": (
        "cuda/flash_bwd_kernel_sm80.h",
        "register_bwd_kernel(DType::{dtype_enum}, {head_dim}, MaskKind::{mask_kind},\n"
        "    BwdKernel{{&run_flash_bwd<{element}, {head_dim}, {mask_policy}, SmemClass::kSmall{score}>,\n"
        "              BwdTraitsSm80<{element}, {head_dim}, SmemClass::kSmall>::kSmemBytes}},\n"
        "    SmemClass::kSmall{score});\n"
        "static_assert(has_small_bwd_tile({head_dim}))",
        (96, 128, 160, 192, 224, 256),
    ),
    # The Hopper forward (sm90a only; cuda.cmake compiles these files for 90a
    # alone).
    "fwd_sm90": (
        "cuda/sm90/flash_fwd_kernel_sm90.h",
        "register_sm90_fwd_kernel(DType::{dtype_enum}, {head_dim}, MaskKind::{mask_kind},\n"
        "    FwdKernel{{&sm90::run_flash_fwd_sm90<{element}, {head_dim}, {mask_policy}{score}>,\n"
        "              sm90::FwdTraitsSm90<{element}, {head_dim}>::kSmemBytes, &tma_compatible}}{score})",
        SM90_HEAD_DIMS,
    ),
    # The Hopper backward (sm90a only, like the Hopper forward).
    "bwd_sm90": (
        "cuda/sm90/flash_bwd_kernel_sm90.h",
        "register_sm90_bwd_kernel(DType::{dtype_enum}, {head_dim}, MaskKind::{mask_kind},\n"
        "    BwdKernel{{&sm90::run_flash_bwd_sm90<{element}, {head_dim}, {mask_policy}{score}>,\n"
        "              sm90::bwd_launch_smem_bytes_sm90<{element}, {head_dim},\n"
        "                                               MaskKind::{mask_kind}{score}>(),\n"
        "              &sm90::tma_compatible_bwd}}{score})",
        SM90_HEAD_DIMS,
    ),
}

# Every name a file declares is its own (no shared alias, a registration
# variable named after the file), so that cuda.cmake can compile several of
# these files as one translation unit.
TEMPLATE = """\
// Generated by csrc/cuda/generate_kernels.py; do not edit.
#include "{header}"

namespace jflash::cuda {{
namespace {{
[[maybe_unused]] const bool kRegistered_{name} = {registration};
}}  // namespace
}}  // namespace jflash::cuda
"""


def instantiation_name(direction: str, dtype: str, head_dim: int, mask: str,
                       softcap: bool = False) -> str:
    return f"flash_{direction}_{dtype}_hdim{head_dim}_{mask}" + "_softcap" * softcap


def _score_argument(direction: str, softcap: bool) -> str:
    """{score} of the registration templates: the sm80 launchers take the score
    kind after their SmemClass, which the kLarge column otherwise leaves to its
    default."""
    if not softcap:
        return ""
    large_sm80 = ", SmemClass::kLarge" if direction in ("fwd", "bwd") else ""
    return large_sm80 + ", ScoreKind::kSoftcap"


def _write(out_dir: pathlib.Path, stem: str, header: str, registration: str) -> str:
    """Writes one instantiation file (only when its text changes); its name."""
    text = TEMPLATE.format(header=header, name=stem.removeprefix("flash_"),
                           registration=registration)
    path = out_dir / (stem + ".cu")
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return path.name


def main() -> None:
    out_dir = pathlib.Path(__file__).resolve().parent / "instantiations"
    out_dir.mkdir(exist_ok=True)
    wanted = set()
    for dtype, (element, dtype_enum) in DTYPES.items():
        for head_dim in DECODE_HEAD_DIMS:
            registration = DECODE_REGISTRATION.format(element=element, dtype_enum=dtype_enum,
                                                      head_dim=head_dim)
            wanted.add(_write(out_dir, f"flash_decode_{dtype}_hdim{head_dim}",
                              "cuda/decode_launch_sm80.h", registration))
    for direction, (header, registration, head_dims) in DIRECTIONS.items():
        for dtype, (element, dtype_enum) in DTYPES.items():
            for head_dim, (mask, (mask_policy, mask_kind)), softcap in itertools.product(
                    head_dims, MASKS.items(), (False, True)):
                if mask == "segments" and (direction not in SEGMENT_DIRECTIONS
                                           or head_dim not in SEGMENT_HEAD_DIMS):
                    continue
                if softcap and (head_dim not in SOFTCAP_HEAD_DIMS or mask not in SOFTCAP_MASKS):
                    continue
                stem = instantiation_name(direction, dtype, head_dim, mask, softcap)
                wanted.add(_write(out_dir, stem, header, registration.format(
                    element=element, dtype_enum=dtype_enum, head_dim=head_dim,
                    mask_policy=mask_policy, mask_kind=mask_kind,
                    score=_score_argument(direction, softcap))))
    for direction, (header, registration) in FLOAT32_DIRECTIONS.items():
        for dtype, passes in FLOAT32_PASSES.items():
            for head_dim, (mask, (mask_policy, mask_kind)), softcap in itertools.product(
                    FLOAT32_HEAD_DIMS, MASKS.items(), (False, True)):
                if softcap and mask not in SOFTCAP_MASKS:
                    continue
                stem = instantiation_name(direction, dtype, head_dim, mask, softcap)
                wanted.add(_write(out_dir, stem, header, registration.format(
                    head_dim=head_dim, mask_policy=mask_policy, mask_kind=mask_kind,
                    score_kind="kSoftcap" if softcap else "kPlain", passes=passes)))
    for stale in out_dir.glob("*.cu"):
        if stale.name not in wanted:
            stale.unlink()


if __name__ == "__main__":
    main()

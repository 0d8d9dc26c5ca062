"""The CUDA library's host-side entry points on any machine, GPU or not.

CI builds the CUDA kernels on a machine without a GPU: the library must load
there, and its queries must answer without a device instead of crashing.
"""

from __future__ import annotations

import glob
import os
import pathlib
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import jflash
from jflash._src.ffi import cuda_forward_family, cuda_kernel_smem_bytes


def test_forward_family_answers():
    """90, 80 or 0 with a GPU; -1 (no usable device) or 0 (not built) without one."""
    family = cuda_forward_family(jnp.bfloat16, 128, False)
    if not jflash.HAS_CUDA_KERNELS:
        assert family == 0
    elif jax.default_backend() == "gpu":
        assert family in (90, 80, 0)
    else:
        assert family == -1


def test_forward_family_other_dtypes():
    """float16, bfloat16 and float32 (at 1 or 3 TF32 passes) have CUDA kernels:
    other dtypes report none; a pass count other than 1 or 3 is refused."""
    assert cuda_forward_family(jnp.int8, 128, False) == 0
    for passes in (1, 3):
        family = cuda_forward_family(jnp.float32, 128, False, tf32_passes=passes)
        if not jflash.HAS_CUDA_KERNELS:
            assert family == 0
        elif jax.default_backend() == "gpu":  # 0 on GPUs without the float32 kernels
            assert family in (90, 80, 0)
        else:
            assert family == -1
    with pytest.raises(ValueError, match="tf32_passes must be one of"):
        cuda_forward_family(jnp.float32, 128, False, tf32_passes=2)


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_kernel_smem_query_answers(direction):
    """Bytes with a GPU (0 if not built); -1 without a device; 0 for other dtypes."""
    for dtype, passes in ((jnp.bfloat16, 1), (jnp.float32, 1), (jnp.float32, 3)):
        smem = cuda_kernel_smem_bytes(direction, dtype, 128, False, tf32_passes=passes)
        if not jflash.HAS_CUDA_KERNELS:
            assert smem == 0
        elif jax.default_backend() == "gpu":
            assert smem == 0 or 48 * 1024 < smem <= 227 * 1024
        else:
            assert smem == -1
    assert cuda_kernel_smem_bytes(direction, jnp.int8, 128, False) == 0


def test_kernel_smem_query_rejects_direction():
    with pytest.raises(ValueError, match="direction"):
        cuda_kernel_smem_bytes("sideways", jnp.bfloat16, 128, False)


def _cuda_include_dir():
    """A directory with cuda_runtime.h (the CUDA toolkit's headers), or None."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(str(pathlib.Path(nvcc).resolve().parent.parent))
    roots += sorted(glob.glob("/usr/local/cuda-*"))
    for root in filter(None, roots):
        if os.path.isfile(os.path.join(root, "include", "cuda_runtime.h")):
            return os.path.join(root, "include")
    return None


def _run_host_check(tmp_path, name, needs):
    """Compiles tests/<name>.cc against csrc/ with the host C++ compiler and runs it;
    asserts that it prints "ok". needs: a file under csrc/ it checks."""
    root = pathlib.Path(__file__).resolve().parent.parent
    source = root / "tests" / f"{name}.cc"
    compiler = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    include = _cuda_include_dir()
    if not (root / "csrc" / needs).is_file() or compiler is None or include is None:
        pytest.skip("needs the source tree, a C++ compiler and the CUDA headers")
    binary = tmp_path / name
    build = subprocess.run(
        [compiler, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", f"-I{root / 'csrc'}",
         f"-I{root / 'csrc' / 'include'}", f"-I{include}", str(source), "-o", str(binary)],
        capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, build.stderr[-4000:]
    result = subprocess.run([str(binary)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.endswith("ok\n"), result.stdout[-4000:]


def test_grid_chunks(tmp_path):
    """The sm80 launchers' chunks of grids past 65535 heads or batches (csrc/cuda/launch.h)
    cover every (batch, head) once, in order, with the addresses of one launch: checked on
    the host by tests/cuda_grid_chunks_check.cc, compiled here."""
    _run_host_check(tmp_path, "cuda_grid_chunks_check", "cuda/launch.h")


def test_band_units(tmp_path):
    """The Hopper forward's work units under a band (csrc/cuda/sm90/band_units_sm90.h)
    hold every query block once and are simulated no slower than the all-paired units;
    a window's plateau gets one block per unit; the Hopper backward's launch order
    starts every unit once: checked on the host by tests/band_units_check.cc, compiled
    here."""
    _run_host_check(tmp_path, "band_units_check", "cuda/sm90/band_units_sm90.h")


def test_softcap_fixed_offset(tmp_path):
    """The softcap caps that the Hopper forward takes against a fixed offset keep every
    exponent of P in the range its bounds promise (csrc/include/jflash/score.h): checked
    on the host by tests/softcap_offset_check.cc, compiled here."""
    _run_host_check(tmp_path, "softcap_offset_check", "include/jflash/score.h")


_SM80_SPLIT_HEAD_DIMS = ("256",)  # cuda.cmake's _sm80_split_head_dims


def _expected_unit(name):
    """The translation unit csrc/cuda/cuda.cmake puts an instantiation file in, and
    its kind (which picks its -gencode flags)."""
    m = re.fullmatch(r"flash_decode_(fp16|bf16)_hdim(\d+)\.cu", name)
    if m:
        return f"flash_decode_hdim{m[2]}", "decode"
    m = re.fullmatch(r"flash_(fwd|bwd)(_small|_sm90)?_(fp16|bf16|tf32|tf32x3)_hdim(\d+)"
                     r"_(full|band|segments)(_softcap)?\.cu", name)
    assert m, name
    direction, family, dtype, head_dim, _, score = m.groups(default="")
    if family == "_sm90":  # forward and backward, softcap with the plain kernels
        return f"flash_sm90_hdim{head_dim}", "sm90"
    if dtype.startswith("tf32") and direction == "fwd":  # both precisions and scores
        return f"flash_fwd_float32_hdim{head_dim}", "float32_fwd"
    if dtype.startswith("tf32"):  # both precisions, softcap apart
        return f"flash_bwd_float32_hdim{head_dim}{score}", "float32_bwd"
    if head_dim in _SM80_SPLIT_HEAD_DIMS:
        return f"flash_{direction}_sm80_hdim{head_dim}", "sm80"
    return f"flash_sm80_hdim{head_dim}", "sm80"


# The -gencode flags of each kind in a full build for 80;90a (cuda.cmake): the sm80
# kernels without sm_90a SASS (JFLASH_CUDA_SM80_HOPPER_SASS off), the float32
# forward's sm_90 SASS from the compute_80 PTX, the Hopper kernels for 90a alone.
_GENCODE = {
    "sm80": {"compute_80,code=sm_80", "compute_80,code=compute_80"},
    "sm90": {"compute_90a,code=sm_90a"},
    "float32_fwd": {"compute_80,code=[sm_80,sm_90]", "compute_80,code=compute_80"},
    "float32_bwd": {"compute_80,code=sm_80", "compute_90a,code=sm_90a",
                    "compute_80,code=compute_80"},
    "decode": {"compute_80,code=sm_80", "compute_90a,code=sm_90a", "compute_80,code=compute_80"},
}


def test_cmake_groups_instantiations_into_units(tmp_path):
    """A full build's configure step makes one translation unit per head dim and kernel
    family (cuda.cmake), each compiled with the -gencode flags of its kind: a unit that
    swallows others serializes the build, and a float32 unit without sm_90a SASS would
    leave Hopper to compile its PTX at first use. The units are listed longest first."""
    root = pathlib.Path(__file__).resolve().parent.parent
    cmake = shutil.which("cmake")
    if not (root / "csrc" / "cuda" / "cuda.cmake").is_file() or cmake is None \
            or shutil.which("nvcc") is None:
        pytest.skip("needs the source tree, cmake and nvcc")
    try:
        import cutlass_library  # noqa: F401  (the CuTe headers the configure step asks for)
    except ImportError:
        pytest.skip("needs nvidia-cutlass")
    build = tmp_path / "build"
    configure = subprocess.run(
        [cmake, "-S", str(root), "-B", str(build), "-G", "Ninja", "-DJFLASH_CUDA=ON",
         "-DJFLASH_CUDA_SUBSET=all", "-DJFLASH_CUDA_ARCHS=80;90a",
         "-DJFLASH_CUDA_SM80_HOPPER_SASS=OFF", f"-DPython_EXECUTABLE={sys.executable}"],
        capture_output=True, text=True, timeout=600,
    )
    assert configure.returncode == 0, configure.stdout[-4000:] + configure.stderr[-4000:]
    instantiations = sorted(p.name for p in (root / "csrc" / "cuda" / "instantiations").glob("*.cu"))
    expected, kinds = {}, {}
    for name in instantiations:
        unit, kind = _expected_unit(name)
        expected.setdefault(unit, []).append(name)
        kinds[unit] = kind
    units = {p.stem: p.read_text() for p in (build / "jflash_kernels").glob("*.cu")}
    assert sorted(units) == sorted(expected)
    for unit, names in expected.items():
        included = re.findall(r'#include "cuda/instantiations/([^"]+)"', units[unit])
        assert sorted(included) == sorted(names), unit
    # Each unit's compile flags, and the order ninja starts them in, from build.ninja.
    ninja = (build / "build.ninja").read_text()
    blocks = re.findall(r"^build CMakeFiles/jflash_cuda_kernels\.dir/jflash_kernels/(\w+)\.cu\.o: "
                        r".*?\n  FLAGS = ([^\n]*)", ninja, flags=re.M | re.S)
    assert sorted(unit for unit, _ in blocks) == sorted(expected)
    for unit, flags in blocks:
        assert set(re.findall(r"-gencode=arch=(\S+)", flags)) == _GENCODE[kinds[unit]], unit
    order = [unit for unit, _ in blocks]
    # The longest units first (cuda.cmake's _unit_order): the float32 backward at 256
    # and the Hopper units before any sm80 forward-only, float32 forward or decode unit.
    first_short = min(order.index(u) for u in order if kinds[u] in ("float32_fwd", "decode")
                      or u.startswith("flash_fwd_sm80_"))
    assert order.index("flash_bwd_float32_hdim256") == 0
    assert all(order.index(u) < first_short for u in order if kinds[u] == "sm90"), order

"""The CUDA library's host-side entry points on any machine, GPU or not.

CI builds the CUDA kernels on a machine without a GPU: the library must load
there, and its queries must answer without a device instead of crashing.
"""

from __future__ import annotations

import glob
import os
import pathlib
import shutil
import subprocess

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


def test_grid_chunks(tmp_path):
    """The sm80 launchers' chunks of grids past 65535 heads or batches (csrc/cuda/launch.h)
    cover every (batch, head) once, in order, with the addresses of one launch: checked on
    the host by tests/cuda_grid_chunks_check.cc, compiled here."""
    root = pathlib.Path(__file__).resolve().parent.parent
    source = root / "tests" / "cuda_grid_chunks_check.cc"
    compiler = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    include = _cuda_include_dir()
    if not (root / "csrc" / "cuda" / "launch.h").is_file() or compiler is None or include is None:
        pytest.skip("needs the source tree, a C++ compiler and the CUDA headers")
    binary = tmp_path / "cuda_grid_chunks_check"
    build = subprocess.run(
        [compiler, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", f"-I{root / 'csrc'}",
         f"-I{root / 'csrc' / 'include'}", f"-I{include}", str(source), "-o", str(binary)],
        capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, build.stderr[-4000:]
    result = subprocess.run([str(binary)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.endswith("ok\n"), result.stdout[-4000:]

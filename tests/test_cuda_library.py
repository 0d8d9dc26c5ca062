"""The CUDA library's host-side entry points on any machine, GPU or not.

CI builds the CUDA kernels on a machine without a GPU: the library must load
there, and its queries must answer without a device instead of crashing.
"""

from __future__ import annotations

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


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int8])
def test_forward_family_other_dtypes(dtype):
    """Only float16 and bfloat16 have CUDA kernels: other dtypes report none."""
    assert cuda_forward_family(dtype, 128, False) == 0


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_kernel_smem_query_answers(direction):
    """Bytes with a GPU (0 if not built); -1 without a device; 0 for other dtypes."""
    smem = cuda_kernel_smem_bytes(direction, jnp.bfloat16, 128, False)
    if not jflash.HAS_CUDA_KERNELS:
        assert smem == 0
    elif jax.default_backend() == "gpu":
        assert smem == 0 or 48 * 1024 < smem <= 227 * 1024
    else:
        assert smem == -1
    assert cuda_kernel_smem_bytes(direction, jnp.float32, 128, False) == 0


def test_kernel_smem_query_rejects_direction():
    with pytest.raises(ValueError, match="direction"):
        cuda_kernel_smem_bytes("sideways", jnp.bfloat16, 128, False)

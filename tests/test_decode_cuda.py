"""Decode checks specific to the CUDA kernel (csrc/cuda/flash_decode_sm80.h);
skipped without a GPU.

test_decode.py runs the whole option grid on the GPU too. These add what is
specific to the CUDA tiling: lengths around the 64-key tiles, both warp
layouts (4 warps across the keys for at most 16 rows per kv head, across 64
rows otherwise, with several row blocks), the table's ring and the deeper one
of calls that leave SMs' slots empty, head dim 256 (Q read from shared
memory), the split heuristic choosing many splits, splits that get no tile,
float32 (a bfloat16 copy of the cache), shallower K/V rings under a 99 KB
shared-memory limit, and bitwise repeatability.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jflash
from decode_cases import Case, check_case, kwargs, make_inputs
from jflash._src import ffi as _ffi

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "gpu" or not jflash.HAS_CUDA_KERNELS,
    reason="needs a CUDA GPU and a jflash build with CUDA kernels",
)

SMALL_SMEM_LIMIT = 101376  # sm86 / sm89: 99 KB per block

CUDA_CASES = [
    # Cache lengths at the tile edges (and empty), 4 rows per kv head.
    Case(seqlens=(63, 64, 65, 127, 128, 129, 1, 0), capacity=192),
    Case(seqlens=(63, 64, 65, 127, 128, 129, 1, 0), capacity=192, num_splits=3, block_size=16,
         seq_new=1),
    # Enough CTAs to fill every SM's slots: the table's ring (smaller calls
    # deepen it into the slots they leave empty).
    Case(seqlens=(4000, 3000, 100, 2500, 4096, 1, 0, 1234), capacity=4096, heads=64,
         heads_kv=8, block_size=64, seq_new=1),
    # Long caches with the heuristic's split count (> 1 at this batch).
    Case(seqlens=(1000, 4095, 17), capacity=4096, block_size=16, seq_new=1),
    Case(seqlens=(6000,), capacity=8192, heads=64, heads_kv=8, block_size=256),
    # 128 rows per kv head: the 64-row warp layout, two row blocks.
    Case(seqlens=(300, 517), capacity=640, seq_q=16, heads=16, heads_kv=2, seq_new=16,
         block_size=64),
    # 40 rows, head dim 256, float16.
    Case(seqlens=(300, 517), capacity=768, seq_q=5, heads=8, heads_kv=1, head_dim=256,
         block_size=256, seq_new=5, dtype="float16"),
    Case(seqlens=(2000, 33), capacity=2048, head_dim=256, num_splits=5),
    # A window that leaves most of 16 splits without a tile.
    Case(seqlens=(2000,), capacity=2048, heads=32, heads_kv=8, head_dim=64, window=(100, 0),
         num_splits=16),
    Case(seqlens=(777, 5), capacity=1024, heads=4, heads_kv=4, softcap=50.0, num_splits=128,
         dtype="float16"),
    Case(seqlens=(3000, 2999), capacity=3072, heads=8, heads_kv=8, dtype="float32", seq_new=1),
    Case(seqlens=(500, 9), capacity=512, heads=8, heads_kv=8, dtype="float32", block_size=64),
]


@pytest.mark.parametrize("case", CUDA_CASES, ids=Case.id)
def test_cuda_decode(rng, case):
    check_case(rng, case)


def test_split_heuristic():
    """Few sequences get several splits, a batch that fills the GPU one."""
    splits = lambda batch, capacity: _ffi.decode_num_splits(  # noqa: E731
        False, jnp.bfloat16, 128, batch, 8, 8, capacity)
    assert splits(1, 8192) > 8
    assert splits(1, 256) == 1  # a split holds at least 256 keys
    assert splits(512, 8192) == 1
    assert 1 <= splits(8, 131072) <= 128


def test_garbage_past_the_end_is_never_read(rng):
    """Rows past each sequence hold NaN: the kernel zero-fills them, never reads."""
    case = Case(seqlens=(100, 4000, 63), capacity=4096, block_size=64, seq_new=1)
    out, _ = check_case(rng, case, nan_past_end=True)
    assert np.isfinite(np.asarray(out, np.float32)).all()


def test_repeatable(rng):
    """The same inputs give bitwise the same results (no races between warps or splits)."""
    case = Case(seqlens=(3000, 1000), capacity=4096, block_size=16, seq_q=2, heads=16,
                heads_kv=2)
    a = make_inputs(rng, case)
    fn = jax.jit(lambda q, kc, vc, lens, table: jflash.flash_attention_with_kvcache(
        q, kc, vc, cache_seqlens=lens, block_table=table, return_lse=True))
    args = (a["query"], a["k_cache"], a["v_cache"], a["cache_seqlens"], a["block_table"])
    first = fn(*args)
    for _ in range(3):
        for x, y in zip(first, fn(*args)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.skipif(
    os.environ.get("JFLASH_CUDA_SMEM_LIMIT") != str(SMALL_SMEM_LIMIT),
    reason="run by test_small_smem_rings, in a subprocess with JFLASH_CUDA_SMEM_LIMIT set",
)
@pytest.mark.parametrize("case", CUDA_CASES[5:8], ids=Case.id)
def test_small_smem_against_truth(rng, case):
    check_case(rng, case)


def test_small_smem_rings():
    """Under a 99 KB limit the launcher shortens the K/V ring (head dim 256: one
    stage); results stay within the rule."""
    if os.environ.get("JFLASH_CUDA_SMEM_LIMIT"):
        pytest.skip("already under a JFLASH_CUDA_SMEM_LIMIT")
    result = subprocess.run(
        [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
         str(pathlib.Path(__file__).resolve()), "-k", "test_small_smem_against_truth"],
        env=dict(os.environ, JFLASH_CUDA_SMEM_LIMIT=str(SMALL_SMEM_LIMIT)), capture_output=True,
        text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout, result.stdout[-2000:]


def test_donated_cache_stays_on_device(rng):
    """Donation on the GPU: the returned caches are the input buffers."""
    case = Case(seqlens=(30, 900), capacity=1024, block_size=64, seq_new=1)
    a = make_inputs(rng, case)
    kw = kwargs(case, a, return_lse=False)
    step = jax.jit(lambda q, kc, vc, kn, vn, lens, table: jflash.flash_attention_with_kvcache(
        q, kc, vc, cache_seqlens=lens, k_new=kn, v_new=vn, block_table=table),
        donate_argnums=(1, 2))
    k_cache, v_cache = jnp.array(a["k_cache"]), jnp.array(a["v_cache"])
    pointer = k_cache.unsafe_buffer_pointer()
    _, k_out, _ = step(a["query"], k_cache, v_cache, kw["k_new"], kw["v_new"],
                       kw["cache_seqlens"], kw["block_table"])
    assert k_out.unsafe_buffer_pointer() == pointer

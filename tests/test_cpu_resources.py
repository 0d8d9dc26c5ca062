"""What the CPU kernels take from the machine: threads and scratch memory.

JFLASH_CPU_THREADS sizes the CPU kernels' thread pool (csrc/cpu/thread_pool.cc),
read once per process, hence a subprocess per setting. The CPU backward needs
no float32 dq scratch, so its custom call gets an empty one; the CUDA lowering
keeps the [..., heads, seq_q, head_dim] buffer its kernels accumulate dq in.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import jflash
from jflash._src import ffi

_RUN = r"""
import pathlib
import jax, jax.numpy as jnp, numpy as np, jflash
rng = np.random.default_rng(3)
q, k, v = (jnp.asarray(rng.standard_normal((2, 300, 4, 64)), jnp.float32) for _ in range(3))
out, grads = jax.value_and_grad(
    lambda q, k, v: jnp.sum(jflash.flash_attention(q, k, v, causal=True) ** 2), (0, 1, 2)
)(q, k, v)
names = [p.read_text().strip() for p in pathlib.Path("/proc/self/task").glob("*/comm")]
print(names.count("jflash-cpu"))
print(float(out), *(float(jnp.sum(g * g)) for g in grads))
"""


def _run(threads):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop(ffi.CPU_THREADS_VARIABLE, None)
    if threads is not None:
        env[ffi.CPU_THREADS_VARIABLE] = threads
    return subprocess.run(
        [sys.executable, "-P", "-c", _RUN], env=env, capture_output=True, text=True, timeout=300
    )


def _workers_and_results(threads):
    result = _run(threads)
    assert result.returncode == 0, result.stderr[-3000:]
    workers, results = result.stdout.strip().splitlines()[-2:]
    return int(workers), results


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_cpu_threads_variable_sizes_the_pool():
    if jax.default_backend() != "cpu":
        pytest.skip("the CPU kernels' pool is checked on CPU machines")
    one, results_one = _workers_and_results("1")
    three, results_three = _workers_and_results("3")
    assert (one, three) == (0, 2)  # workers besides the calling thread
    # Each output row is one task's, whatever thread runs it: same bits.
    assert results_one == results_three


@pytest.mark.parametrize("threads", ["0", "-2", "two", "1.5", "100000"])
def test_bad_cpu_threads_value_raises_at_import(threads):
    result = _run(threads)
    assert result.returncode != 0
    expected = "ValueError: JFLASH_CPU_THREADS must be an integer from 1 to 1024"
    assert re.search(rf"{expected}.*got '{re.escape(threads)}'", result.stderr), result.stderr[-3000:]


def _bwd_results(text):
    """The result types of the backward custom call(s) in a StableHLO module."""
    calls = [line for line in text.splitlines() if f"@{ffi.BWD_TARGET}(" in line]
    assert calls
    return [line[line.index("->") :] for line in calls]


def _grad_fn():
    def loss(q, k, v):
        return jnp.sum(jflash.flash_attention(q, k, v, causal=True).astype(jnp.float32) ** 2)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=str)
def test_cpu_backward_allocates_no_dq_scratch(rng, dtype):
    q = jnp.asarray(rng.standard_normal((2, 48, 4, 64)), dtype)
    k = jnp.asarray(rng.standard_normal((2, 80, 2, 64)), dtype)
    fn = _grad_fn()
    dq_accum = "tensor<2x4x48x64xf32>"  # [batch, heads, seq_q, head_dim]

    disabled = [export.DisabledSafetyCheck.custom_call(t) for t in (ffi.FWD_TARGET, ffi.BWD_TARGET)]

    def lowered(platform):
        exported = export.export(fn, platforms=(platform,), disabled_checks=disabled)(q, k, k)
        return exported.mlir_module()

    (cpu,) = _bwd_results(lowered("cpu"))
    assert "tensor<0xf32>" in cpu and dq_accum not in cpu
    cuda = lowered("cuda")
    assert all(dq_accum in r for r in _bwd_results(cuda))

    # The empty scratch runs, and vmapped too (the handler folds the new axis).
    grads = fn(q, k, k)
    assert all(bool(jnp.all(jnp.isfinite(g.astype(jnp.float32)))) for g in grads)
    batched = jax.vmap(fn)(*(jnp.stack([x, 2 * x]) for x in (q, k, k)))
    for g, b in zip(grads, batched, strict=True):
        np.testing.assert_array_equal(np.asarray(b[0]), np.asarray(g))

"""Every instruction-set path of the CPU kernels, not only the widest one.

The CPU kernel picks AVX-512, AVX2+FMA or plain x86-64 at run time, so a
machine runs only its best path; JFLASH_CPU_ISA forces a narrower one. The
choice is made once per process, hence a subprocess per path.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import jax
import pytest

_CHECK = r"""
import sys
sys.path.insert(0, {tests_dir!r})
import jax, jax.numpy as jnp, numpy as np
import jflash, reference64
from checks import assert_within_rule
from jflash._src.masks import causal_band
from jflash.reference import attention_band

rng = np.random.default_rng(7)
for dtype in (jnp.float32, jnp.bfloat16):
    for (sq, sk, h, hkv, d) in ((77, 130, 4, 2, 64), (130, 33, 2, 1, 96)):
        q = jnp.asarray(rng.standard_normal((2, sq, h, d)), dtype)
        k = jnp.asarray(rng.standard_normal((2, sk, hkv, d)), dtype)
        v = jnp.asarray(rng.standard_normal((2, sk, hkv, d)), dtype)
        dout = jnp.asarray(rng.standard_normal(q.shape), dtype)
        lo, hi = causal_band(sq, sk, True)
        scale = d ** -0.5
        fn = lambda q, k, v: jflash.flash_attention(q, k, v, causal=True)
        out, vjp = jax.vjp(fn, q, k, v)
        plain_fn = lambda q, k, v: attention_band(q, k, v, softmax_scale=scale, diag_lo=lo,
                                                  diag_hi=hi, dtype=dtype)[0]
        plain, plain_vjp = jax.vjp(plain_fn, q, k, v)
        x64 = [np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (q, k, v, dout)]
        truth = reference64.forward(*x64[:3], scale, lo, hi)[0]
        assert_within_rule("out", out, plain, truth, dtype)
        truth_grads = reference64.backward(*x64, np.zeros((2, h, sq)), scale, lo, hi)
        for name, got, ref, exact in zip("qkv", vjp(dout), plain_vjp(dout), truth_grads):
            assert_within_rule("d" + name, got, ref, exact, dtype)
# The decode kernel (flash_attention_with_kvcache): paged, appended, split.
from decode_cases import Case, check_case
for case in (Case(seqlens=(100, 3), capacity=160, block_size=16, seq_new=2, seq_q=2, num_splits=3),
             Case(seqlens=(50,), capacity=64, heads=4, heads_kv=1, head_dim=64, dtype="float32")):
    check_case(rng, case)
print("ok")
"""


@pytest.mark.parametrize("isa", ["avx2", "baseline"])
def test_cpu_isa_path(isa):
    if jax.default_backend() != "cpu":
        pytest.skip("CPU kernel paths are checked on CPU machines")
    tests_dir = str(pathlib.Path(__file__).resolve().parent)
    env = dict(os.environ, JFLASH_CPU_ISA=isa, JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, "-P", "-c", _CHECK.format(tests_dir=tests_dir)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]

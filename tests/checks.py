"""FlashAttention's error rule, and inputs, shared by the test modules."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# Absolute floors added to 2x the plain computation's error; they only matter
# when the plain computation happens to be (nearly) exact.
FLOOR = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 1e-4, jnp.dtype(jnp.float16): 1e-4}


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def plain_dtype(dtype):
    """dtype of the plain computation that a kernel's error is judged against.

    On GPU, float32 inputs run the TF32 kernels at the default precision (README),
    whose operands keep 10 mantissa bits, while the plain computation
    (jflash.reference) runs float32 matmuls at HIGHEST: the general suite judges
    them against a bfloat16 plain computation, a bound that TF32 meets with room.
    test_precision.py holds float32 to XLA's attention at the same precision.
    """
    dtype = jnp.dtype(dtype)
    if on_gpu() and dtype == jnp.float32:
        return jnp.dtype(jnp.bfloat16)
    return dtype


def max_err(x, truth):
    x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    finite = np.isfinite(truth)
    assert np.array_equal(np.isfinite(x), finite), "non-finite entries differ from the reference"
    if not finite.any():
        return 0.0
    return float(np.max(np.abs(x[finite] - truth[finite])))


def assert_within_rule(name, kernel, plain, truth, dtype):
    """max|kernel - truth| <= 2 max|plain - truth| + floor * max(1, max|truth|)."""
    assert not np.isnan(np.asarray(jnp.asarray(kernel, jnp.float32))).any(), f"{name}: NaN"
    kernel_err = max_err(kernel, truth)
    plain_err = max_err(plain, truth)
    finite = truth[np.isfinite(truth)]
    scale = max(1.0, float(np.max(np.abs(finite)))) if finite.size else 1.0
    bound = 2 * plain_err + FLOOR[plain_dtype(dtype)] * scale
    assert kernel_err <= bound, (
        f"{name}: kernel error {kernel_err:.3g} > bound {bound:.3g} "
        f"(plain {plain_dtype(dtype)} error {plain_err:.3g})"
    )


def qkv_inputs(rng, shape, dtype):
    """Standard-normal q, k, v of shape = (batch, seq_q, seq_k, heads, heads_kv,
    head_dim), in dtype."""
    batch, seq_q, seq_k, heads, heads_kv, head_dim = shape
    q = rng.standard_normal((batch, seq_q, heads, head_dim))
    k = rng.standard_normal((batch, seq_k, heads_kv, head_dim))
    v = rng.standard_normal((batch, seq_k, heads_kv, head_dim))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def float64_inputs(*arrays):
    """The arrays as float64 NumPy arrays (of their values in the kernel's dtype)."""
    return [np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in arrays]


def window_diags(seq_q, seq_k, causal, window_size):
    """The band of causal and a (left, right) window, written out from the
    documented rule, independent of jflash."""
    left, right = (-1 if s is None else s for s in window_size)
    offset = seq_k - seq_q
    lo = offset - left if left >= 0 else -seq_q
    hi = offset + right if right >= 0 else seq_k
    if causal:
        hi = min(hi, offset)
    return lo, hi

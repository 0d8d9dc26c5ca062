"""softcap (logit soft-capping) against float64 truth with FlashAttention's 2x rule.

The scores become c * tanh(s / c) for s = softmax_scale * q.k. Queries are
scaled up in most cases so that |s| >> c and the cap, not the softmax, shapes
the result. Runs on whatever backend jax picks; test_cuda_specific.py adds the
CUDA kernels' tile-size cases.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jflash
import reference64
from checks import (assert_within_rule, float64_inputs, on_gpu, plain_dtype, qkv_inputs,
                    window_diags)
from segments import case_id, check_against_reference
from jflash.reference import attention_band as reference_band

# (batch, seq_q, seq_k, heads, heads_kv, head_dim, causal, window_size, softcap,
# q_scale, dtype): odd lengths and seq_q != seq_k both ways, GQA and MQA, head
# dims that pad (32 -> 64, 80 -> 128), rows that see no key, a cap that leaves
# the scores almost as they are (30) and caps far below the peaked scores.
CASES = [
    (2, 77, 65, 4, 2, 64, True, None, 2.0, 4.0, jnp.bfloat16),
    (1, 130, 97, 4, 1, 80, False, (20, 5), 5.0, 3.0, jnp.float32),
    (2, 33, 129, 2, 2, 256, False, None, 30.0, 1.0, jnp.float16),
    (1, 90, 70, 2, 1, 32, True, (12, -1), 1.0, 2.0, jnp.float32),  # rows 0..19 see nothing
]


def _case_id(case):
    b, sq, sk, h, hkv, d, causal, window, cap, q_scale, dtype = case
    return (f"b{b}_{sq}x{sk}_h{h}_{hkv}_d{d}" + "_causal" * causal +
            (f"_w{window[0]}_{window[1]}" if window else "") +
            f"_cap{cap}_q{q_scale}_{jnp.dtype(dtype).name}")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_softcap_against_reference(rng, case):
    b, sq, sk, h, hkv, d, causal, window, cap, q_scale, dtype = case
    q, k, v = qkv_inputs(rng, (b, sq, sk, h, hkv, d), dtype)
    q = (q.astype(jnp.float32) * q_scale).astype(dtype)
    dout = jnp.asarray(rng.standard_normal(q.shape), dtype)
    dlse = jnp.asarray(rng.standard_normal((b, h, sq)), jnp.float32)
    scale = 1 / np.sqrt(d)
    lo, hi = window_diags(sq, sk, causal, window or (None, None))

    def kernel_fn(q, k, v):
        return jflash.flash_attention(q, k, v, causal=causal, window_size=window, softcap=cap,
                                      return_lse=True)

    (out, lse), vjp = jax.vjp(jax.jit(kernel_fn), q, k, v)
    grads = vjp((dout, dlse))
    f64 = float64_inputs(q, k, v, dout)
    truth_out, truth_lse, _ = reference64.forward(*f64[:3], scale, lo, hi, softcap=cap)
    truth_grads = reference64.backward(*f64, np.asarray(dlse), scale, lo, hi, softcap=cap)
    (plain_out, plain_lse), plain_vjp = jax.vjp(
        lambda q, k, v: reference_band(q, k, v, softmax_scale=scale, diag_lo=lo, diag_hi=hi,
                                       dtype=plain_dtype(dtype), softcap=cap), q, k, v)
    plain_grads = plain_vjp((dout, dlse))
    assert_within_rule("out", out, plain_out, truth_out, dtype)
    assert_within_rule("lse", lse, plain_lse, truth_lse, dtype)
    for name, got, ref, exact in zip(("dq", "dk", "dv"), grads, plain_grads, truth_grads):
        assert got.dtype == q.dtype and got.shape == ref.shape
        assert_within_rule(name, got, ref, exact, dtype)
    # The cap matters here: the uncapped call differs by far more than the rule's bound.
    if cap < 10:
        uncapped = jflash.flash_attention(q, k, v, causal=causal, window_size=window)
        assert np.max(np.abs(np.asarray(uncapped, np.float32) - truth_out)) > 0.1


# Segment ids with softcap: packed causal documents, ids not contiguous, GQA.
SEGMENT_CASES = [
    (2, 200, 200, 4, 2, 64, True, None, "packed"),
    (1, 97, 130, 2, 1, 32, False, (10, 10), "random"),
]


@pytest.mark.parametrize("case", SEGMENT_CASES, ids=case_id)
def test_softcap_with_segment_ids(rng, case):
    check_against_reference(rng, case, jnp.bfloat16, softcap=3.0, q_scale=3.0)


def test_softcap_transforms(rng):
    """vmap is the per-slice call (bitwise on CPU); deterministic=True gives the
    default mode's gradients (on CPU bitwise); jax.jit agrees with eager."""
    q, k, v = qkv_inputs(rng, (2, 50, 60, 2, 1, 64), jnp.float32)
    q = q * 3

    def attend(q, k, v, deterministic=False):
        return jflash.flash_attention(q, k, v, causal=True, softcap=2.5,
                                      deterministic=deterministic)

    stack = lambda x: jnp.stack([x, x[::-1]])  # noqa: E731
    batched = jax.jit(jax.vmap(attend))(stack(q), stack(k), stack(v))
    for i, flip in enumerate((lambda x: x, lambda x: x[::-1])):
        np.testing.assert_array_equal(np.asarray(batched[i]),
                                      np.asarray(attend(flip(q), flip(k), flip(v))))

    def loss(q, k, v, deterministic=False):
        return jnp.sum(attend(q, k, v, deterministic) ** 2)

    g1 = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    g2 = jax.grad(lambda q, k, v: loss(q, k, v, True), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g1, g2):
        if jax.default_backend() == "cpu":
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        else:
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("spec", [P("data", None, "model"), P(None, "model")],
                         ids=["batch+heads", "sequence"])
def test_softcap_sharded(rng, spec):
    """Batch- and heads-sharded calls stay exact; a sequence-sharded one runs
    context-parallel (the cap applies score by score, so the chunks' partial rows
    merge through their lse as without it)."""
    devices = jax.devices("cpu")[:8]
    if len(devices) < 8:
        pytest.skip("needs 8 host CPU devices")
    mesh = jax.make_mesh((2, 4), ("data", "model"), devices=devices)
    with jax.default_device(devices[0]):
        q, k, v = qkv_inputs(rng, (4, 32, 32, 8, 4, 32), jnp.float32)
        q = q * 3
        dout = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

        def loss(q, k, v):
            return jnp.sum(jflash.flash_attention(q, k, v, causal=True, softcap=2.0) * dout)

        grads = jax.grad(loss, argnums=(0, 1, 2))
        want = grads(q, k, v)
        args = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)]
        got = jax.jit(grads)(*args)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_infinite_score_is_capped(rng):
    """An inf in q[i] makes row i's scores +-inf, which the cap takes to +-c: out
    and lse of the row stay finite, as in the reference (jax.nn has no cap).
    The gradients are NaN where the reference's are (dk of the keys row i sees:
    a 0 score gradient times the inf), and may be on neighbours in a tile
    (README, "NaN and Inf")."""
    q, k, v = qkv_inputs(rng, (1, 20, 30, 2, 2, 64), jnp.float32)
    q = q.at[0, 3, 1, 5].set(jnp.inf)
    kw = dict(causal=True, softcap=4.0, return_lse=True)
    dout = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

    def grads(fn):
        (out, lse), vjp = jax.vjp(lambda q, k, v: fn(q, k, v, **kw), q, k, v)
        return (out, lse, *vjp((dout, jnp.zeros(lse.shape))))

    got = grads(jflash.flash_attention)
    # On GPU float32 runs the TF32 kernels at the default precision (README):
    # a tolerance well above TF32's rounding.
    tol = 2e-2 if on_gpu() else 1e-4
    want = grads(jflash.reference.attention)
    assert np.all(np.isfinite(np.asarray(got[0]))) and np.all(np.isfinite(np.asarray(got[1])))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        a, b = np.asarray(a), np.asarray(b)
        assert not np.any(np.isfinite(a) & ~np.isfinite(b)), name
        both = np.isfinite(a) & np.isfinite(b)
        if name in ("out", "lse"):
            assert np.all(both), name
        np.testing.assert_allclose(a[both], b[both], rtol=tol, atol=tol, err_msg=name)


def test_reference_public_api(rng):
    """jflash.reference.attention(softcap=) against float64 truth, and a cap far
    above every score leaves the attention as it was."""
    q, k, v = qkv_inputs(rng, (2, 37, 19, 4, 2, 32), jnp.float32)
    out, lse = jflash.reference.attention(q, k, v, causal=True, softcap=1.5, return_lse=True)
    truth_out, truth_lse, _ = reference64.forward(*float64_inputs(q, k, v), 32**-0.5, -37,
                                                  19 - 37, softcap=1.5)
    np.testing.assert_allclose(np.asarray(out), truth_out, atol=1e-5)
    finite = np.isfinite(truth_lse)
    np.testing.assert_allclose(np.asarray(lse)[finite], truth_lse[finite], atol=1e-5)
    far = jflash.flash_attention(q, k, v, softcap=1e4)
    # On GPU two different kernels (TF32 at the default precision).
    np.testing.assert_allclose(np.asarray(far), np.asarray(jflash.flash_attention(q, k, v)),
                               atol=2e-2 if on_gpu() else 1e-5)


@pytest.mark.parametrize("softcap,error,message", [
    (0.0, ValueError, "softcap must be None or a number > 0"),
    (-1.0, ValueError, "softcap must be None or a number > 0"),
    (float("nan"), ValueError, "softcap must be None or a number > 0"),
    (float("inf"), ValueError, "softcap must be None or a number > 0"),
    (1e39, ValueError, "softcap must be None or a number > 0"),
    (1e-44, ValueError, "softcap 1e-44 with softmax_scale"),
    (True, TypeError, "softcap must be None or a Python or NumPy real number"),
    ("50", TypeError, "softcap must be None or a Python or NumPy real number"),
    (jnp.float32(50.0), TypeError, "softcap must be None or a Python or NumPy real number"),
])
def test_bad_softcap(softcap, error, message):
    q = jax.ShapeDtypeStruct((1, 8, 2, 64), jnp.bfloat16)
    for fn in (jflash.flash_attention, jflash.reference.attention):
        with pytest.raises(error, match=message):
            jax.eval_shape(lambda q: fn(q, q, q, softcap=softcap), q)


def test_dot_product_attention_softcap(rng):
    """jflash.dot_product_attention(softcap=) (a jflash extension): the kernels'
    capped attention; a call that only jax's function could run raises."""
    q, k, v = qkv_inputs(rng, (2, 40, 40, 4, 2, 64), jnp.float32)
    q = q * 3
    got = jflash.dot_product_attention(q, k, v, is_causal=True, softcap=2.0)
    want = jflash.flash_attention(q, k, v, causal=True, softcap=2.0)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for kw in (dict(implementation="xla"), dict(bias=jnp.zeros((2, 4, 40, 40)))):
        with pytest.raises(ValueError, match="softcap"):
            jflash.dot_product_attention(q, k, v, softcap=2.0, **kw)
    with pytest.raises(ValueError, match="softcap must be None or a number > 0"):
        jflash.dot_product_attention(q, k, v, softcap=-1.0)

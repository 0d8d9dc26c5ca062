"""NaN and Inf: where jflash's outputs and gradients are NaN (README, "NaN and Inf").

Three NaN patterns meet here (isnan masks of out, lse, dq, dk, dv):

  R  the references (tests/reference64.py in float64; jflash.reference is
     checked to agree): a masked (query, key) pair takes no part, so NaN flows
     through visible pairs only. The smallest pattern.
  K  the kernel under test (the CPU twin here, the CUDA kernels on a GPU).
  J  jax.nn.dot_product_attention(implementation="xla") in float32, with the
     same mask, and the lse of its own masked logits (max + log sum exp). jax
     masks with a large finite negative logit, so a NaN row's probabilities are
     NaN on its masked keys too, and its products multiply a NaN input by the
     masked pairs' zeros (0 * NaN = NaN): a NaN in q makes dk and dv NaN on
     every key, a NaN in k makes dq NaN on every row, a NaN in v[j, c] makes
     out[:, c] NaN on every row, masked or not.

The kernels must give R <= K <= J. They compute the same zeros for masked
pairs inside the tiles they visit (a NaN input times 0 is NaN there too), so
where an input NaN meets a masked pair, K lies between R and J, depending on
the tile sizes; everywhere else K is R exactly:

  out  exact unless v holds the NaN (P V multiplies it by masked zeros)
  lse  exact (masked scores are replaced, never multiplied)
  dq   exact unless k or v holds it (dS K; a NaN out through delta)
  dk   exact when k holds it; not for q (dS^T Q) or v (through delta)
  dv   exact (P^T dO: P is exactly 0 where masked, dO is finite)

Rows that see no key are out 0 and lse -inf exactly in every case. Finite
entries of K are within FlashAttention's 2x rule of the float64 truth.

Without a mask every row sees every key, and R = K = J. On a GPU the same
tests run the CUDA kernels in bfloat16 (head dims 64 and 128: the Hopper
kernels on an H100/H200); test_nan_sm80_kernels_on_hopper runs them again
with JFLASH_CUDA_FORWARD=sm80 and JFLASH_CUDA_BACKWARD=sm80.
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
import reference64
from checks import FLOOR, on_gpu, plain_dtype
from jflash._src.flash_attention import attention_band
from jflash._src.masks import clamp_band, window_band
from jflash.reference import attention_band as reference_band

DTYPE = jnp.bfloat16 if on_gpu() else jnp.float32

# (batch, seq_q, seq_k, heads, heads_kv, causal, window): GQA throughout;
# lengths that cross the CUDA and CPU tiles; seq_q > seq_k gives rows that see
# no key (rows 0..129 below, in tiles that also hold rows that do).
SHAPES = {
    "full": (2, 300, 300, 4, 2, False, None),
    "causal": (1, 300, 300, 4, 2, True, None),
    "causal_q_gt_k": (1, 300, 170, 4, 2, True, None),
    "causal_q_lt_k": (1, 170, 300, 4, 2, True, None),
    "window": (1, 300, 260, 4, 2, False, (70, 20)),
}

# Where the non-finite value goes: (what, position as a fraction of the
# sequence), head or kv head 1 (of batch 0). The q rows sit inside tiles and
# see 70 keys or more under every mask above (so that the +inf row's scores,
# +-inf, hold a +inf: a row whose visible scores are all -inf is a case of its
# own, below).
INJECTIONS = {
    "q_row_nan": ("q", 2 / 3),  # a whole q row
    "k_row_nan": ("k", 1 / 2),  # a whole k row
    "v_elem_nan": ("v", 1 / 2),  # one element of v
    "q_elem_inf": ("q_inf", 3 / 4),  # one element of q, +inf
}

# Which patterns must equal R; the others lie between R and J.
EXACT = {
    "out": {"q", "k", "q_inf"},
    "lse": {"q", "k", "v", "q_inf"},
    "dq": {"q", "q_inf"},
    "dk": {"k"},
    "dv": {"q", "k", "v", "q_inf"},
}
NAMES = ("out", "lse", "dq", "dk", "dv")


def _inputs(rng, batch, seq_q, seq_k, heads, heads_kv, head_dim, injection):
    q = rng.standard_normal((batch, seq_q, heads, head_dim))
    k = rng.standard_normal((batch, seq_k, heads_kv, head_dim))
    v = rng.standard_normal((batch, seq_k, heads_kv, head_dim))
    what, pos = injection
    if isinstance(pos, float):
        pos = int(pos * (seq_q if what.startswith("q") else seq_k))
    if what == "q":
        q[0, pos, 1, :] = np.nan
    elif what == "k":
        k[0, pos, 1, :] = np.nan
    elif what == "v":
        v[0, pos, 1, 3] = np.nan
    elif what == "q_inf":
        q[0, pos, 1, 5] = np.inf
    elif what == "v_row":  # a whole v row
        v[0, pos, 1, :] = np.nan
    dout = rng.standard_normal(q.shape)
    dlse = rng.standard_normal((batch, heads, seq_q))
    return q, k, v, dout, dlse


def _float64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _jax_nn(q, k, v, dout, visible, scale):
    """J: jax.nn's float32 out and gradients, and the lse of its masked logits,
    computed on the CPU (XLA's CPU backend) whatever the default device."""
    with jax.default_device(jax.devices("cpu")[0]):
        return _jax_nn_here(q, k, v, dout, visible, scale)


def _jax_nn_here(q, k, v, dout, visible, scale):
    q, k, v, dout = (jnp.asarray(x, jnp.float32) for x in (q, k, v, dout))
    mask = jnp.asarray(visible).reshape(-1, 1, *visible.shape[-2:])  # [batch or 1, 1, sq, sk]

    def attend(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation="xla")

    out, vjp = jax.vjp(attend, q, k, v)
    grads = vjp(dout)
    group = q.shape[2] // k.shape[2]
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, jnp.repeat(k, group, axis=2),
                        precision=jax.lax.Precision.HIGHEST) * scale
    logits = jnp.where(mask, logits, -0.7 * np.finfo(np.float32).max)  # jax.nn's masking
    m = jnp.max(logits, axis=-1)
    lse = m + jnp.log(jnp.sum(jnp.exp(logits - m[..., None]), axis=-1))
    return [np.asarray(x, np.float64) for x in (out, lse, *grads)]


def _kernel(q, k, v, dout, dlse, scale, lo, hi, dtype, segments=None):
    q_ids, kv_ids = segments or (None, None)

    def fn(q, k, v):
        return attention_band(q, k, v, softmax_scale=scale, diag_lo=lo, diag_hi=hi,
                              q_segment_ids=q_ids, kv_segment_ids=kv_ids)

    args = [jnp.asarray(x, dtype) for x in (q, k, v)]
    (out, lse), vjp = jax.vjp(jax.jit(fn), *args)
    grads = vjp((jnp.asarray(dout, dtype), jnp.asarray(dlse, jnp.float32)))
    return [_float64(x) for x in (out, lse, *grads)]


def _plain(q, k, v, dout, dlse, scale, lo, hi, dtype, segments=None):
    """jflash.reference in the plain dtype of the 2x rule."""
    q_ids, kv_ids = segments or (None, None)

    def fn(q, k, v):
        return reference_band(q, k, v, softmax_scale=scale, diag_lo=lo, diag_hi=hi,
                              dtype=plain_dtype(dtype), q_segment_ids=q_ids,
                              kv_segment_ids=kv_ids)

    args = [jnp.asarray(x, dtype) for x in (q, k, v)]
    (out, lse), vjp = jax.vjp(fn, *args)
    grads = vjp((jnp.asarray(dout, dtype), jnp.asarray(dlse, jnp.float32)))
    return [_float64(x) for x in (out, lse, *grads)]


def _assert_within_rule_where_finite(name, kernel, plain, truth, dtype):
    """The 2x rule on the entries where the kernel is finite (the truth is finite
    there: R <= K is checked first), against the plain error where it is finite."""
    kernel_finite = np.isfinite(kernel)
    assert np.all(np.isfinite(truth[kernel_finite])), f"{name}: finite where the truth is not"
    truth_finite = np.isfinite(truth)
    assert np.array_equal(np.isfinite(plain), truth_finite), f"{name}: plain pattern differs"
    if not kernel_finite.any():
        return
    kernel_err = np.max(np.abs(kernel[kernel_finite] - truth[kernel_finite]))
    plain_err = np.max(np.abs(plain[truth_finite] - truth[truth_finite]))
    scale = max(1.0, float(np.max(np.abs(truth[truth_finite]))))
    bound = 2 * plain_err + FLOOR[plain_dtype(dtype)] * scale
    assert kernel_err <= bound, f"{name}: kernel error {kernel_err:.3g} > bound {bound:.3g}"


def _check(rng, shape, head_dim, injection, *, scale=None, band=None, dtype=DTYPE,
           segments=None):
    """segments: None, or NumPy (q ids [batch, seq_q], kv ids [batch, seq_k])."""
    batch, seq_q, seq_k, heads, heads_kv, causal, window = shape
    if band is None:
        lo, hi = clamp_band(seq_q, seq_k, *window_band(seq_q, seq_k, causal, window))
    else:
        lo, hi = band
    scale = head_dim**-0.5 if scale is None else scale
    q, k, v, dout, dlse = _inputs(rng, batch, seq_q, seq_k, heads, heads_kv, head_dim, injection)
    # Round to the kernel's dtypes first: every pattern is of the same inputs.
    q, k, v, dout = (_float64(jnp.asarray(x, dtype)) for x in (q, k, v, dout))
    dlse = _float64(dlse)
    visible = reference64.visible_mask(seq_q, seq_k, lo, hi, *(segments or (None, None)))

    kernel = _kernel(q, k, v, dout, dlse, scale, lo, hi, dtype, segments)
    truth = [*reference64.forward(q, k, v, scale, lo, hi, segments)[:2],
             *reference64.backward(q, k, v, dout, dlse, scale, lo, hi, segments)]
    jax_nn = _jax_nn(q, k, v, dout, visible, scale)
    what = injection[0]
    for name, got, want, upper in zip(NAMES, kernel, truth, jax_nn):
        got_nan, want_nan, upper_nan = np.isnan(got), np.isnan(want), np.isnan(upper)
        assert np.all(got_nan[want_nan]), f"{name}: finite where NaN must reach"
        assert np.all(upper_nan[got_nan]), f"{name}: NaN where jax.nn has none"
        if what in EXACT[name]:
            assert np.array_equal(got_nan, want_nan), f"{name}: NaN pattern differs from R"
        if name != "lse":
            assert not np.isinf(got).any(), f"{name}: inf"

    # Rows that see no key: out 0 and lse -inf, whatever the inputs hold; no
    # other lse is -inf or +inf.
    out, lse = kernel[0], kernel[1]
    no_key = np.broadcast_to(~visible.any(-1), (batch, seq_q))
    assert np.all(out[no_key] == 0), "out of a row that sees no key"
    assert np.array_equal(np.isneginf(lse), np.broadcast_to(no_key[:, None], lse.shape)), "lse -inf"
    assert not np.isposinf(lse).any(), "lse +inf"

    plain = _plain(q, k, v, dout, dlse, scale, lo, hi, dtype, segments)
    for name, got, p, t in zip(NAMES, kernel, plain, truth):
        _assert_within_rule_where_finite(name, got, p, t, dtype)
    return kernel, truth, jax_nn


def _sm80_env():
    return os.environ.get("JFLASH_CUDA_FORWARD") == "sm80"


@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("injection", list(INJECTIONS), ids=str)
@pytest.mark.parametrize("shape", list(SHAPES), ids=str)
def test_nan_pattern(rng, shape, injection, head_dim):
    if _sm80_env():
        from jflash._src.ffi import cuda_backward_family, cuda_forward_family

        assert cuda_forward_family(DTYPE, head_dim, shape != "full") in (80, 0)
        assert cuda_backward_family(DTYPE, head_dim, shape != "full") in (80, 0)
    _check(rng, SHAPES[shape], head_dim, INJECTIONS[injection])


@pytest.mark.parametrize("injection", list(INJECTIONS), ids=str)
def test_nan_pattern_with_segment_ids(rng, injection):
    """Packed causal documents (one of one token); the third one's keys carry an
    id of their own, so that its rows see no key and those keys no row. A NaN
    reaches the rows and keys of its own document only, but for the tile limit."""
    lengths = [1, 60, 39, 100]
    q_ids = np.repeat(np.arange(4), lengths)[None]
    kv_ids = np.where(q_ids == 2, 9, q_ids)
    if on_gpu():
        from jflash._src.ffi import cuda_backward_family, cuda_forward_family

        if _sm80_env():
            assert cuda_forward_family(DTYPE, 64, True, segments=True) in (80, 0)
            assert cuda_backward_family(DTYPE, 64, True, segments=True) in (80, 0)
    _check(rng, (1, 200, 200, 4, 2, True, None), 64, INJECTIONS[injection],
           segments=(q_ids, kv_ids))


def _reference_float32_on_cpu(q, k, v, dout, dlse, scale, lo, hi):
    """jflash.reference in float32 on XLA's CPU backend: on a GPU, float32
    matmuls default to reduced precision, and plain_dtype is bfloat16 there."""
    with jax.default_device(jax.devices("cpu")[0]):
        def fn(q, k, v):
            return reference_band(q, k, v, softmax_scale=scale, diag_lo=lo, diag_hi=hi,
                                  dtype=jnp.float32)

        args = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
        (out, lse), vjp = jax.vjp(fn, *args)
        grads = vjp((jnp.asarray(dout, jnp.float32), jnp.asarray(dlse, jnp.float32)))
        return [_float64(x) for x in (out, lse, *grads)]


def test_references_agree_on_nan(rng):
    """jflash.reference (float32, its gradients by autodiff) has the float64
    reference's NaN pattern, and its values."""
    lo, hi = window_band(40, 30, True, None)
    scale = 32**-0.5
    for what, _ in INJECTIONS.values():
        q, k, v, dout, dlse = _inputs(rng, 2, 40, 30, 4, 2, 32, (what, 0.7))
        truth = [*reference64.forward(q, k, v, scale, lo, hi)[:2],
                 *reference64.backward(q, k, v, dout, dlse, scale, lo, hi)]
        ref = _reference_float32_on_cpu(q, k, v, dout, dlse, scale, lo, hi)
        for name, got, want in zip(NAMES, ref, truth):
            assert np.array_equal(np.isnan(got), np.isnan(want)), (what, name)
            assert np.array_equal(np.isneginf(got), np.isneginf(want)), (what, name)
            finite = np.isfinite(want)
            np.testing.assert_allclose(got[finite], want[finite], atol=2e-5, rtol=2e-5)


def test_no_mask_equals_jax_nn(rng):
    """Without a mask every row sees every key: jflash's NaN pattern is jax.nn's,
    entry for entry."""
    for injection in INJECTIONS.values():
        kernel, _, jax_nn = _check(rng, SHAPES["full"], 64, injection)
        for name, got, want in zip(NAMES, kernel, jax_nn):
            assert np.array_equal(np.isnan(got), np.isnan(want)), (injection, name)


@pytest.mark.parametrize("scale", [-0.3, 0.0], ids=["negative", "zero"])
@pytest.mark.parametrize("injection", ["q_row_nan", "k_row_nan"], ids=str)
def test_nan_with_scale_sign(rng, injection, scale):
    """A negative scale (the row max becomes a min) and a zero one (0 * NaN is
    still NaN; the Hopper forward's masked tiles take a path of their own)."""
    _check(rng, SHAPES["causal"], 64, INJECTIONS[injection], scale=scale)


@pytest.mark.parametrize("what", ["k", "v_row"])
def test_nan_in_a_key_no_row_sees(rng, what):
    """Top-left causal with seq_k > seq_q (jax.nn's is_causal): keys 100.. are
    seen by no query, but the rows past the last one in a padded query block
    would see key 105 if they counted. A NaN in its k or v row never reaches
    its dk and dv (0, as in jax.nn); a NaN k reaches no out, lse, dk or dv at
    all (dq: dS K multiplies k[105] by masked zeros in the tiles that hold
    it). A NaN v may reach out (and dq, dk) through P V's masked zeros, as
    the README's limit says."""
    shape = (1, 100, 300, 4, 2, False, None)
    kernel, _, _ = _check(rng, shape, 64, (what, 105), band=(-100, 0))
    out, lse, dq, dk, dv = kernel
    assert np.all(dk[:, 105] == 0) and np.all(dv[:, 105] == 0)
    assert not np.isnan(lse).any() and not np.isnan(dv).any()
    if what == "k":
        assert not np.isnan(out).any() and not np.isnan(dk).any()


def test_row_with_only_minus_inf_scores(rng):
    """A row that sees keys whose scores are all -inf: its softmax is 0 / 0, so
    out and lse are NaN (lse -inf stays reserved for rows that see no key), and
    so are its gradients on the keys it sees."""
    batch, seq_q, seq_k, heads, heads_kv, head_dim = 1, 70, 70, 2, 2, 64
    q, k, v, dout, dlse = _inputs(rng, batch, seq_q, seq_k, heads, heads_kv, head_dim, ("", 0))
    k[..., 0] = np.abs(k[..., 0]) + 0.5  # every score of a row with q[..., 0] = -inf is -inf
    q[0, 40, 1, 0] = -np.inf
    lo, hi = window_band(seq_q, seq_k, True, None)
    kernel = _kernel(q, k, v, dout, dlse, head_dim**-0.5, lo, hi, DTYPE)
    truth = [*reference64.forward(q, k, v, head_dim**-0.5, lo, hi)[:2],
             *reference64.backward(q, k, v, dout, dlse, head_dim**-0.5, lo, hi)]
    out, lse, dq, dk, dv = kernel
    assert np.isnan(out[0, 40, 1]).all() and np.isnan(lse[0, 1, 40])
    assert np.isnan(dq[0, 40, 1]).all()
    assert np.isnan(dv[0, :41, 1]).all() and np.isfinite(dv[0, 41:]).all()
    for name, got, want in zip(NAMES, kernel, truth):
        assert np.all(np.isnan(got)[np.isnan(want)]), name
        if name in ("out", "lse", "dq", "dv"):
            assert np.array_equal(np.isnan(got), np.isnan(want)), name


@pytest.mark.skipif(
    not on_gpu() or getattr(jax.devices()[0], "compute_capability", "") != "9.0"
    or not jflash.HAS_CUDA_KERNELS,
    reason="needs a compute capability 9.0 GPU (its sm80 kernels are forced in a subprocess)",
)
def test_nan_sm80_kernels_on_hopper():
    """The NaN tests again with JFLASH_CUDA_FORWARD=sm80 and JFLASH_CUDA_BACKWARD=sm80
    (read once per process, hence a subprocess): the sm80 kernels on Hopper."""
    if _sm80_env() or os.environ.get("JFLASH_CUDA_BACKWARD"):
        pytest.skip("already under JFLASH_CUDA_FORWARD / JFLASH_CUDA_BACKWARD")
    env = dict(os.environ, JFLASH_CUDA_FORWARD="sm80", JFLASH_CUDA_BACKWARD="sm80")
    result = subprocess.run(
        [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider",
         str(pathlib.Path(__file__).resolve()), "-k", "not sm80_kernels_on_hopper"],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout, result.stdout[-2000:]

"""jflash.flash_attention_varlen: sequences of different lengths packed along the
token axis, against a float64 truth computed sequence by sequence (each with its
own bottom-right band) under FlashAttention's 2x rule, on every platform's
kernels; the jnp reference (jflash.reference.attention_varlen) against the same
truth; bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jflash
import reference64
from checks import assert_within_rule, float64_inputs, on_gpu, plain_dtype, window_diags
from jflash.reference import attention_band as reference_band

# (query lengths, key lengths or None for the same cu_seqlens array, heads,
#  heads_kv, head_dim, causal, window, softcap, dtype)
CASES = [
    ((37, 1, 64), None, 4, 2, 64, True, None, None, jnp.bfloat16),
    ((70, 33), None, 2, 2, 128, False, None, None, jnp.float16),
    ((20, 65, 3), (50, 65, 40), 4, 1, 64, True, None, None, jnp.bfloat16),  # sq <= sk
    ((50, 9), (20, 1), 2, 1, 32, True, None, None, jnp.float32),  # sq > sk: rows see nothing
    ((64, 30), (90, 31), 4, 2, 80, False, (8, 3), 5.0, jnp.bfloat16),
    ((33, 70), (60, 99), 2, 2, 64, False, None, 3.0, jnp.float32),  # no band: as packed
    ((1, 1, 1), (0, 3, 1), 2, 1, 64, True, (16, -1), None, jnp.float32),  # an empty key sequence
]


def _case_id(case):
    lq, lk, h, hkv, d, causal, window, cap, dtype = case
    return (f"q{'-'.join(map(str, lq))}_k{'same' if lk is None else '-'.join(map(str, lk))}"
            f"_h{h}_{hkv}_d{d}" + "_causal" * causal + (f"_w{window[0]}_{window[1]}" if window
                                                        else "") +
            (f"_cap{cap}" if cap else "") + f"_{jnp.dtype(dtype).name}")


def _cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _per_sequence(lq, lk, fn):
    """fn(b, q rows slice, k rows slice) for each sequence."""
    cq, ck = _cu(lq), _cu(lk)
    return [fn(b, slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])) for b in range(len(lq))]


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_varlen_against_reference(rng, case):
    lq, lk, h, hkv, d, causal, window, cap, dtype = case
    same = lk is None
    lk = lq if same else lk
    cu_q, cu_k = _cu(lq), _cu(lk)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    q = jnp.asarray(rng.standard_normal((tq, h, d)) * (2.0 if cap else 1.0), dtype)
    k = jnp.asarray(rng.standard_normal((tk, hkv, d)), dtype)
    v = jnp.asarray(rng.standard_normal((tk, hkv, d)), dtype)
    dout = jnp.asarray(rng.standard_normal(q.shape), dtype)
    dlse = jnp.asarray(rng.standard_normal((h, tq)), jnp.float32)
    scale = 1 / np.sqrt(d)
    kw = dict(max_seqlen_q=max(lq), max_seqlen_k=max(max(lk), 1), causal=causal,
              window_size=window, softcap=cap, return_lse=True)
    cu_k_arg = cu_q if same else cu_k

    def call(q, k, v, cu_q, cu_k):
        return jflash.flash_attention_varlen(q, k, v, cu_q, cu_q if same else cu_k, **kw)

    (out, lse), vjp = jax.vjp(lambda q, k, v: jax.jit(call)(q, k, v, cu_q, cu_k_arg), q, k, v)
    grads = vjp((dout, dlse))

    # Truth and the plain computation, sequence by sequence.
    f64 = float64_inputs(q, k, v, dout)
    truth = {n: np.zeros(x.shape) for n, x in zip(("out", "dq", "dk", "dv"), (q, q, k, v))}
    truth["lse"] = np.full((h, tq), -np.inf)
    plain = {n: np.zeros(x.shape, np.float32) for n, x in zip(("out", "dq", "dk", "dv"),
                                                              (q, q, k, v))}
    plain["lse"] = np.full((h, tq), -np.inf, np.float32)

    def one(b, rq, rk):
        sq, sk = lq[b], lk[b]
        if sq == 0:
            return
        lo, hi = window_diags(sq, sk, causal, window or (None, None))
        if sk == 0:  # no key: out 0, lse -inf, zero gradients (the arrays' start)
            return
        qs, ks, vs, ds = (x[None] for x in (f64[0][rq], f64[1][rk], f64[2][rk], f64[3][rq]))
        dl = np.asarray(dlse)[None, :, rq]
        o, l_, _ = reference64.forward(qs, ks, vs, scale, lo, hi, softcap=cap)
        gq, gk, gv = reference64.backward(qs, ks, vs, ds, dl, scale, lo, hi, softcap=cap)
        truth["out"][rq], truth["lse"][:, rq] = o[0], l_[0]
        truth["dq"][rq], truth["dk"][rk], truth["dv"][rk] = gq[0], gk[0], gv[0]
        pkw = dict(softmax_scale=scale, diag_lo=lo, diag_hi=hi, dtype=plain_dtype(dtype),
                   softcap=cap)
        (po, pl), pvjp = jax.vjp(lambda a, b_, c: reference_band(a, b_, c, **pkw),
                                 q[rq][None], k[rk][None], v[rk][None])
        pq, pk, pv = pvjp((dout[rq][None], dlse[None, :, rq]))
        plain["out"][rq], plain["lse"][:, rq] = np.asarray(po[0], np.float32), pl[0]
        plain["dq"][rq] = np.asarray(pq[0], np.float32)
        plain["dk"][rk], plain["dv"][rk] = np.asarray(pk[0], np.float32), np.asarray(pv[0],
                                                                                    np.float32)

    _per_sequence(lq, lk, one)
    for name, got in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads)):
        assert got.shape == truth[name].shape, name
        assert_within_rule(name, got, plain[name], truth[name], dtype)


def test_reference_varlen_against_truth(rng):
    """jflash.reference.attention_varlen (one dense mask) against the float64
    truth computed sequence by sequence."""
    lq, lk = (30, 12, 41), (45, 12, 20)
    cu_q, cu_k = _cu(lq), _cu(lk)
    q = jnp.asarray(rng.standard_normal((int(cu_q[-1]), 2, 32)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((int(cu_k[-1]), 1, 32)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((int(cu_k[-1]), 1, 32)), jnp.float32)
    out, lse = jflash.reference.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=41,
                                                 max_seqlen_k=45, causal=True,
                                                 window_size=(10, -1), return_lse=True)
    f64 = float64_inputs(q, k, v)
    for b in range(3):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        lo, hi = window_diags(lq[b], lk[b], True, (10, None))
        o, l_, _ = reference64.forward(f64[0][rq][None], f64[1][rk][None], f64[2][rk][None],
                                       32 ** -0.5, lo, hi)
        np.testing.assert_allclose(np.asarray(out[rq]), o[0], atol=1e-5)
        finite = np.isfinite(l_[0])
        np.testing.assert_array_equal(np.isfinite(np.asarray(lse[:, rq])), finite)
        np.testing.assert_allclose(np.asarray(lse[:, rq])[finite], l_[0][finite], atol=1e-5)


def test_varlen_equals_separate_calls(rng):
    """Self-attention with one cu_seqlens array (the packed row itself) and with
    two equal arrays (the slotted row): both equal flash_attention called on
    each sequence alone (on GPU up to the output's bfloat16 rounding for
    float32 inputs)."""
    lengths = (17, 64, 3, 40)
    cu = _cu(lengths)
    q, k, v = (jnp.asarray(rng.standard_normal((int(cu[-1]), 2, 64)), jnp.float32)
               for _ in range(3))
    kw = dict(max_seqlen_q=64, max_seqlen_k=64, causal=True)
    tol = 2e-2 if on_gpu() else 2e-6
    packed = jflash.flash_attention_varlen(q, k, v, cu, cu, **kw)
    slotted = jax.jit(lambda cq, ck: jflash.flash_attention_varlen(q, k, v, cq, ck, **kw))(
        cu, jnp.asarray(cu))
    for b in range(len(lengths)):
        r = slice(cu[b], cu[b + 1])
        alone = jflash.flash_attention(q[r][None], k[r][None], v[r][None], causal=True)[0]
        np.testing.assert_allclose(np.asarray(packed[r]), np.asarray(alone), atol=tol)
        np.testing.assert_allclose(np.asarray(slotted[r]), np.asarray(alone), atol=tol)


def test_tokens_outside_sequences(rng):
    """Tokens past cu_seqlens[-1] output 0 and lse -inf, and get zero gradients."""
    cu = np.array([0, 10, 25], np.int32)
    q, k, v = (jnp.asarray(rng.standard_normal((32, 2, 64)), jnp.float32) for _ in range(3))
    for cu_k in (cu, jnp.asarray(cu)):  # the packed row, the slotted row
        def loss(q, k, v):
            out, lse = jflash.flash_attention_varlen(q, k, v, cu, cu_k, max_seqlen_q=15,
                                                     max_seqlen_k=15, causal=True,
                                                     return_lse=True)
            return jnp.sum(out ** 2), (out, lse)

        (_, (out, lse)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(
            q, k, v)
        assert np.all(np.asarray(out[25:]) == 0) and np.all(np.isneginf(np.asarray(lse[:, 25:])))
        assert np.all(np.isfinite(np.asarray(out[:25])))
        for g in grads:
            assert np.all(np.asarray(g[25:]) == 0)


def test_bad_cu_seqlens_stay_in_bounds(rng):
    """cu_seqlens that are not increasing or run past the arrays (values only
    known on device) give finite results and never read out of bounds."""
    q, k, v = (jnp.asarray(rng.standard_normal((20, 2, 64)), jnp.float32) for _ in range(3))
    for cu_q, cu_k in ((np.array([0, 30, 5], np.int32), np.array([0, 12, 99], np.int32)),
                       (np.array([-7, 4, 20], np.int32), np.array([3, 2, 1], np.int32))):
        out = jax.jit(lambda a, b: jflash.flash_attention_varlen(
            q, k, v, a, b, max_seqlen_q=20, max_seqlen_k=20, causal=True))(cu_q, cu_k)
        assert np.all(np.isfinite(np.asarray(out)))


@pytest.mark.parametrize("args,kwargs,error,message", [
    (((10, 2, 64), (10, 2, 64), (3,), (3,)), {}, ValueError, "must have rank 3"),
    (((10, 2, 64), (10, 2, 64), (3,), (4,)), {}, ValueError, "the same length"),
    (((10, 2, 64), (10, 2, 64), (1,), (1,)), {}, ValueError, "num_seqs >= 1"),
    (((10, 2, 64), (10, 2, 64), (3,), (3,)), {"max_seqlen_q": 0}, ValueError,
     "max_seqlen_q must be >= 1"),
    (((10, 2, 64), (10, 2, 64), (3,), (3,)), {"max_seqlen_k": 2.0}, TypeError,
     "max_seqlen_k must be a static int"),
    (((10, 2, 64), (10, 2, 64), (3,), (3,)), {"causal": 1}, TypeError, "causal must be a bool"),
])
def test_bad_input(args, kwargs, error, message):
    q_shape, k_shape, cq_shape, ck_shape = args
    if len(q_shape) == 3 and message == "must have rank 3":
        q_shape = (1, *q_shape)
    q = jnp.zeros(q_shape, jnp.bfloat16)
    k = v = jnp.zeros(k_shape, jnp.bfloat16)
    cq, ck = jnp.zeros(cq_shape, jnp.int32), jnp.zeros(ck_shape, jnp.int32)
    kw = dict(max_seqlen_q=5, max_seqlen_k=5)
    kw.update(kwargs)
    with pytest.raises(error, match=message):
        jflash.flash_attention_varlen(q, k, v, cq, ck, **kw)


def test_float_cu_seqlens_rejected():
    q = jnp.zeros((10, 2, 64), jnp.bfloat16)
    with pytest.raises(TypeError, match="cu_seqlens_q must be an integer array"):
        jflash.flash_attention_varlen(q, q, q, jnp.zeros(3), jnp.zeros(3, jnp.int32),
                                      max_seqlen_q=5, max_seqlen_k=5)

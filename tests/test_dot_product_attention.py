"""jflash.dot_product_attention against jax.nn.dot_product_attention, side by side.

Random argument combinations (seeded): rank 3 and 4, GQA/MQA, odd lengths,
seq_q != seq_k, causal, local windows (asymmetric, negative sides, rows that
see no key), explicit scales, three dtypes. Outputs and gradients of jflash
(implementation="jflash", so a silent fallback would fail) are judged with
FlashAttention's rule against jax's own float32 computation (the truth), the
plain computation being jax's math in the input dtype; float32 is held to tight
tolerances.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jflash
from checks import assert_within_rule, plain_dtype

NUM_COMBOS = 30


def _combo(index):
    """Arguments of the index-th random combination, drawn from a fixed seed."""
    rng = np.random.default_rng(1000 + index)
    num_heads_kv = int(rng.choice([1, 2]))
    window = [None, None, int(rng.integers(0, 9))]
    window.append((int(rng.integers(-3, 12)), int(rng.integers(-3, 12))))
    return dict(
        dtype=[jnp.float32, jnp.bfloat16, jnp.float16][index % 3],
        rank=int(rng.choice([3, 4])),
        batch=int(rng.choice([1, 2])),
        seq_q=int(rng.choice([1, 7, 16, 33, 64])),
        seq_k=int(rng.choice([1, 5, 16, 40, 64])),
        num_heads_kv=num_heads_kv,
        num_heads=num_heads_kv * int(rng.choice([1, 2, 3])),
        head_dim=int(rng.choice([16, 32, 64, 80])),
        is_causal=bool(rng.integers(0, 2)),
        local_window_size=window[int(rng.integers(0, len(window)))],
        scale=None if rng.integers(0, 2) else float(rng.uniform(0.05, 0.5)),
    )


def _inputs(rng, c):
    lead = (c["batch"],) if c["rank"] == 4 else ()
    q = rng.standard_normal((*lead, c["seq_q"], c["num_heads"], c["head_dim"]))
    k = rng.standard_normal((*lead, c["seq_k"], c["num_heads_kv"], c["head_dim"]))
    v = rng.standard_normal((*lead, c["seq_k"], c["num_heads_kv"], c["head_dim"]))
    dout = rng.standard_normal(q.shape)
    return [jnp.asarray(x, c["dtype"]) for x in (q, k, v, dout)]


def _plain_attention(q, k, v, *, scale, is_causal, local_window_size):
    """jax.nn.dot_product_attention's math (its masks, its large negative for
    masked logits) carried out entirely in the input dtype: the "plain
    same-dtype computation" of FlashAttention's rule. (jax's own half-precision
    path keeps logits and softmax in float32, a stricter yardstick than the
    rule's, and on CPU its float16 dot precision does not compile.)"""
    rank3 = q.ndim == 3
    if rank3:
        q, k, v = q[None], k[None], v[None]
    seq_q, num_heads, head_dim = q.shape[1:]
    seq_k, num_heads_kv = k.shape[1:3]
    group = num_heads // num_heads_kv
    k, v = (jnp.repeat(x, group, axis=2) for x in (k, v))
    scale = 1 / np.sqrt(head_dim) if scale is None else scale
    logits = jnp.einsum("btnh,bsnh->bnts", q, k) * jnp.asarray(scale, q.dtype)
    offset = np.arange(seq_k)[None, :] - np.arange(seq_q)[:, None]  # j - i
    visible = np.ones((seq_q, seq_k), bool)
    if is_causal:
        visible &= offset <= 0
    if local_window_size is not None:
        left, right = (
            (local_window_size,) * 2 if isinstance(local_window_size, int) else local_window_size
        )
        visible &= (offset >= -left) & (offset <= right)
    large_negative = -0.7 * float(jnp.finfo(q.dtype).max)
    logits = jnp.where(visible, logits, jnp.asarray(large_negative, q.dtype))
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bnts,bsnh->btnh", probs, v)
    return out[0] if rank3 else out


def _value_and_grads(attention, q, k, v, dout):
    """out and (dq, dk, dv) of sum(out * dout), jitted."""

    def loss(q, k, v):
        out = attention(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        q, k, v
    )
    return out, grads


def _assert_close(name, kernel, plain, truth, dtype):
    truth64 = np.asarray(truth, np.float64)
    if plain_dtype(dtype) == jnp.float32:
        np.testing.assert_allclose(
            np.asarray(kernel, np.float64),
            truth64,
            rtol=2e-5,
            atol=2e-5 * max(1.0, float(np.abs(truth64).max())),
            err_msg=name,
        )
    else:
        assert_within_rule(name, kernel, plain, truth64, dtype)


@pytest.mark.parametrize("index", range(NUM_COMBOS))
def test_matches_jax(rng, index):
    c = _combo(index)
    q, k, v, dout = _inputs(rng, c)
    kw = dict(
        scale=c["scale"], is_causal=c["is_causal"], local_window_size=c["local_window_size"]
    )

    def ours(q, k, v):
        return jflash.dot_product_attention(q, k, v, implementation="jflash", **kw)

    def theirs(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, **kw)

    out, grads = _value_and_grads(ours, q, k, v, dout)
    assert out.shape == q.shape and out.dtype == q.dtype
    f32 = [x.astype(jnp.float32) for x in (q, k, v, dout)]
    with jax.default_matmul_precision("highest"):
        truth_out, truth_grads = _value_and_grads(theirs, *f32)
    plain = [x.astype(plain_dtype(c["dtype"])) for x in (q, k, v, dout)]
    plain_out, plain_grads = _value_and_grads(
        lambda q, k, v: _plain_attention(q, k, v, **kw), *plain
    )
    _assert_close(f"out {c}", out, plain_out, truth_out, c["dtype"])
    for name, g, p, t in zip(("dq", "dk", "dv"), grads, plain_grads, truth_grads):
        assert g.dtype == c["dtype"]
        _assert_close(f"{name} {c}", g, p, t, c["dtype"])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=str)
def test_rows_without_keys_and_residual(rng, dtype):
    """Rows whose window holds no key: jax gives the mean of the values and its
    large negative logit as residual (-inf once cast to float16); so must we."""
    q, k, v, _ = _inputs(
        rng,
        dict(dtype=dtype, rank=4, batch=2, seq_q=24, seq_k=9, num_heads=4, num_heads_kv=2,
             head_dim=32),
    )
    kw = dict(local_window_size=(2, -1))  # row i sees keys i-2..i-1: none for 0 and >= 11
    out, res = jflash.dot_product_attention(
        q, k, v, implementation="jflash", return_residual=True, **kw
    )
    want_out, want_res = jax.nn.dot_product_attention(q, k, v, return_residual=True, **kw)
    assert res.shape == want_res.shape and res.dtype == want_res.dtype
    atol = 1e-5 if plain_dtype(dtype) == jnp.float32 else 2e-2  # float32: TF32 on GPU
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(want_out, np.float32), atol=atol, rtol=atol
    )
    res, want_res = np.asarray(res, np.float32), np.asarray(want_res, np.float32)
    seen = np.abs(want_res) < 1e30
    assert not seen[:, 0].any() and not seen[:, 11:].any() and seen[:, 1:11].all()
    np.testing.assert_array_equal(res[~seen], want_res[~seen])
    np.testing.assert_allclose(res[seen], want_res[seen], atol=atol, rtol=atol)


def _lowered_text(fn, *args):
    return jax.jit(fn).lower(*args).as_text()


def test_default_runs_jflash_and_fallbacks_run_jax(rng):
    q, k, v, _ = _inputs(
        rng, dict(dtype=jnp.bfloat16, rank=4, batch=2, seq_q=16, seq_k=16, num_heads=2,
                  num_heads_kv=2, head_dim=32)
    )
    assert "jflash_fwd" in _lowered_text(
        lambda q, k, v: jflash.dot_product_attention(q, k, v, is_causal=True), q, k, v
    )
    mask = jnp.asarray(rng.random((2, 1, 16, 16)) < 0.7)
    bias = jnp.asarray(rng.standard_normal((1, 2, 16, 16)), jnp.bfloat16)
    lengths = jnp.asarray([16, 9], jnp.int32)
    cases = {
        "bias": dict(bias=bias),
        "mask": dict(mask=mask),
        # Lengths that are not [B] int32 arrays: jax's function (and its checks).
        "query_seq_lengths": dict(query_seq_lengths=lengths.astype(jnp.int16)),
        "key_value_seq_lengths": dict(key_value_seq_lengths=lengths[:1]),
    }
    for name, kw in cases.items():
        if name.endswith("lengths"):  # jax's own error
            with pytest.raises((ValueError, TypeError)):
                jax.nn.dot_product_attention(q, k, v, **kw)
            with pytest.raises((ValueError, TypeError)):
                jflash.dot_product_attention(q, k, v, **kw)
            with pytest.raises(ValueError, match=name):
                jflash.dot_product_attention(q, k, v, implementation="jflash", **kw)
            continue
        ours = jflash.dot_product_attention(q, k, v, **kw)
        np.testing.assert_array_equal(ours, jax.nn.dot_product_attention(q, k, v, **kw))
        assert "jflash_fwd" not in _lowered_text(
            lambda q, k, v: jflash.dot_product_attention(q, k, v, **kw), q, k, v
        )
        with pytest.raises(ValueError, match=name):
            jflash.dot_product_attention(q, k, v, implementation="jflash", **kw)
    # A traced scale cannot be a kernel attribute: jax's function takes it.
    traced = jax.jit(lambda s: jflash.dot_product_attention(q, k, v, scale=s))(0.25)
    np.testing.assert_array_equal(traced, jax.nn.dot_product_attention(q, k, v, scale=0.25))
    with pytest.raises(ValueError, match="scale"):
        jax.jit(lambda s: jflash.dot_product_attention(q, k, v, scale=s, implementation="jflash"))(
            0.25
        )
    # "xla" is jax's function unchanged.
    np.testing.assert_array_equal(
        jflash.dot_product_attention(q, k, v, is_causal=True, implementation="xla"),
        jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla"),
    )


def test_unsupported_inputs(rng):
    q, k, v, _ = _inputs(
        rng, dict(dtype=jnp.float32, rank=4, batch=1, seq_q=8, seq_k=8, num_heads=2,
                  num_heads_kv=2, head_dim=16)
    )
    with pytest.raises(ValueError, match="implementation"):
        jflash.dot_product_attention(q, k, v, implementation="flash")
    with pytest.raises(ValueError, match="dtype"):
        jflash.dot_product_attention(q, k.astype(jnp.bfloat16), v, implementation="jflash")
    with pytest.raises(ValueError, match="head dim"):
        big = jnp.asarray(rng.standard_normal((1, 8, 2, 288)), jnp.float32)
        jflash.dot_product_attention(big, big, big, implementation="jflash")
    # jax's own checks still apply on the fallback path.
    with pytest.raises(ValueError):
        jflash.dot_product_attention(q, k.astype(jnp.bfloat16), v)


def _drop_in_outputs(fn, q, k, v, dout):
    """out, the residual and (dq, dk, dv) of sum(out * dout), jitted."""
    def loss(q, k, v):
        out, res = fn(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)), (out, res)

    (_, (out, res)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2),
                                                        has_aux=True))(q, k, v)
    return out, res, grads


def _assert_matches_jax(ours, theirs, dtype):
    """Outputs, residuals (exact where jax's is its masked logit) and gradients."""
    atol = 2e-5 if plain_dtype(dtype) == jnp.float32 else 3e-2
    out, res, grads = ours
    want_out, want_res, want_grads = theirs
    for a, b in zip((out, *grads), (want_out, *want_grads)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   atol=atol, rtol=atol)
    res, want_res = np.asarray(res, np.float32), np.asarray(want_res, np.float32)
    masked = ~(np.abs(want_res) < 1e30)
    # jax's masked logit, rounded to the residual's dtype (jax's own in dtype).
    logit = jnp.asarray(-0.7 * np.finfo(np.float32).max, jnp.float32).astype(dtype)
    np.testing.assert_array_equal(res[masked], np.asarray(logit, np.float32))
    np.testing.assert_allclose(res[~masked], want_res[~masked], atol=atol, rtol=atol)
    return masked


@pytest.mark.parametrize("dtype,is_causal", [(jnp.float32, False), (jnp.bfloat16, True)],
                         ids=["float32-full", "bfloat16-causal"])
def test_seq_lengths_run_on_the_kernels(rng, dtype, is_causal):
    """query_seq_lengths and key_value_seq_lengths on the kernels (as segment ids):
    jax's answer for every row: padded query rows 0 (no gradient), rows whose keys
    are all padded (batch entry 1) the mean of the values, its residuals."""
    q, k, v, dout = _inputs(rng, dict(dtype=dtype, rank=4, batch=3, seq_q=24, seq_k=17,
                                      num_heads=4, num_heads_kv=2, head_dim=32))
    kw = dict(is_causal=is_causal, return_residual=True,
              query_seq_lengths=jnp.asarray([24, 9, 1], jnp.int32),
              key_value_seq_lengths=jnp.asarray([17, 0, 5], jnp.int32))
    assert "jflash_fwd" in _lowered_text(
        lambda q, k, v: jflash.dot_product_attention(q, k, v, **kw)[0], q, k, v)
    ours = _drop_in_outputs(
        lambda q, k, v: jflash.dot_product_attention(q, k, v, implementation="jflash", **kw),
        q, k, v, dout)
    f32 = [x.astype(jnp.float32) for x in (q, k, v, dout)]
    with jax.default_matmul_precision("highest"):
        theirs = _drop_in_outputs(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, **kw),
                                  *f32)
    masked = _assert_matches_jax(ours, theirs, dtype)
    assert not masked[0].any() and masked[1].all() and masked[2, 1:].all()
    assert np.all(np.asarray(ours[0], np.float32)[1, 9:] == 0)


def test_segment_ids_drop_in(rng):
    """q_segment_ids / kv_segment_ids: the kernels give jax.nn's answer with the
    ids' mask (rows of an id that no key has: the mean of the values); on jax's
    own path (implementation="xla") they are that mask; with sequence lengths too;
    rank-3 inputs take [T] and [S] ids."""
    q, k, v, dout = _inputs(rng, dict(dtype=jnp.float32, rank=4, batch=2, seq_q=20, seq_k=30,
                                      num_heads=2, num_heads_kv=1, head_dim=16))
    q_ids = jnp.asarray(rng.integers(0, 3, (2, 20)), jnp.int32)
    kv_ids = jnp.asarray(rng.integers(1, 4, (2, 30)), jnp.int32)  # id 0: rows with no key
    mask = (q_ids[..., :, None] == kv_ids[..., None, :])[..., None, :, :]
    kw = dict(is_causal=True, return_residual=True)

    def ours(implementation):
        return _drop_in_outputs(
            lambda q, k, v: jflash.dot_product_attention(
                q, k, v, implementation=implementation, q_segment_ids=q_ids,
                kv_segment_ids=kv_ids, **kw), q, k, v, dout)

    def theirs():
        with jax.default_matmul_precision("highest"):
            return _drop_in_outputs(
                lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask, **kw),
                q, k, v, dout)

    masked = _assert_matches_jax(ours("jflash"), theirs(), jnp.float32)
    assert masked.any()
    xla = jflash.dot_product_attention(q, k, v, implementation="xla", q_segment_ids=q_ids,
                                       kv_segment_ids=kv_ids, **kw)
    for a, b in zip(xla, jax.nn.dot_product_attention(q, k, v, mask=mask, **kw)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    lengths = dict(query_seq_lengths=jnp.asarray([20, 7], jnp.int32),
                   key_value_seq_lengths=jnp.asarray([11, 30], jnp.int32))
    got = jflash.dot_product_attention(q, k, v, implementation="jflash", q_segment_ids=q_ids,
                                       kv_segment_ids=kv_ids, **kw, **lengths)
    want = jax.nn.dot_product_attention(q, k, v, mask=mask, **kw, **lengths)
    zeros = [jnp.zeros(x.shape) for x in (q, k, v)]
    _assert_matches_jax((got[0], got[1], zeros), (want[0], want[1], zeros), jnp.float32)
    with pytest.raises(ValueError, match="q_segment_ids is given but kv_segment_ids is None"):
        jflash.dot_product_attention(q, k, v, q_segment_ids=q_ids)
    got = jflash.dot_product_attention(q[1], k[1], v[1], is_causal=True, implementation="jflash",
                                       q_segment_ids=q_ids[1], kv_segment_ids=kv_ids[1])
    want = jax.nn.dot_product_attention(q[1], k[1], v[1], is_causal=True, mask=mask[1])
    atol = 2e-5 if plain_dtype(jnp.float32) == jnp.float32 else 3e-2
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=atol, rtol=atol)

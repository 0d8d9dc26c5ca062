"""jflash.flax against Flax's own attention layers, with the same parameters.

Each test builds Flax's layer and jflash's (or Flax's layer with jflash's
attention_fn), runs both on the same random inputs, and compares outputs and
the gradients with respect to parameters and inputs. float32, so tolerances
are tight.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

import jflash.flax  # noqa: E402

# float32 layers: elementwise within 2e-5 on CPU. On GPU jflash's float32 kernels
# and Flax's float32 matmuls both run TF32 at the default precision, rounding in
# different places, so there the check is of the wiring (same parameters, same
# math) at a resolution well above TF32's rounding: each leaf's RMS error under
# 2e-2 of its own RMS, or of the whole
# tree's where the leaf's true value is ~0 (the key bias gradient is exactly 0:
# a constant added to every logit of a row leaves the softmax unchanged, so
# only rounding noise remains there). The kernels' error rule itself is
# enforced in test_flash_attention.py.
TOL = dict(rtol=2e-5, atol=2e-5)
GPU_RELATIVE_TOL = 2e-2


def _rms(x):
    return float(np.sqrt(np.mean(np.square(np.asarray(x, np.float64))))) if np.size(x) else 0.0


def _assert_trees_close(got, want, **tol):
    if jax.default_backend() != "gpu" or tol:
        jax.tree.map(
            lambda g, w: np.testing.assert_allclose(
                np.asarray(g, np.float64), np.asarray(w, np.float64), **(tol or TOL)
            ),
            got,
            want,
        )
        return
    want_leaves = jax.tree.leaves(want)
    tree_rms = _rms(np.concatenate([np.ravel(np.asarray(w, np.float64)) for w in want_leaves]))
    for path_and_g, w in zip(jax.tree_util.tree_leaves_with_path(got), want_leaves):
        path, g = path_and_g
        error = _rms(np.asarray(g, np.float64) - np.asarray(w, np.float64))
        bound = GPU_RELATIVE_TOL * max(_rms(w), tree_rms)
        assert error <= bound, f"{jax.tree_util.keystr(path)}: rms error {error:.3g} > {bound:.3g}"


def _linen_value_and_grads(module, params, x, dout, **call_kw):
    """Output and gradients (params, input) of sum(module(x) * dout)."""

    def loss(params, x):
        out = module.apply({"params": params}, x, **call_kw)
        return jnp.sum(out * dout), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
    return out, grads


def _inputs(rng, batch=2, length=24, features=48):
    x = jnp.asarray(rng.standard_normal((batch, length, features)), jnp.float32)
    dout = jnp.asarray(rng.standard_normal((batch, length, features)), jnp.float32)
    return x, dout


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_linen_module_matches_flax(rng, is_causal):
    x, dout = _inputs(rng)
    ours = jflash.flax.linen.MultiHeadAttention(num_heads=4, is_causal=is_causal)
    theirs = nn.MultiHeadDotProductAttention(num_heads=4)
    params = ours.init(jax.random.key(int(rng.integers(1 << 30))), x)["params"]
    mask = nn.make_causal_mask(x[..., 0]) if is_causal else None
    want = _linen_value_and_grads(theirs, params, x, dout, mask=mask)
    got = _linen_value_and_grads(ours, params, x, dout)
    _assert_trees_close(got, want)


def test_linen_module_gqa_window_matches_xla(rng):
    """Flax's linen layer has no GQA: compare with the same layer on jax's XLA attention."""
    x, dout = _inputs(rng, batch=3, length=20)
    kw = dict(num_heads=6, num_kv_heads=2, qkv_features=96, is_causal=True, local_window_size=5)
    ours = jflash.flax.linen.MultiHeadAttention(**kw)
    params = ours.init(jax.random.key(int(rng.integers(1 << 30))), x)["params"]
    assert params["key"]["kernel"].shape == (48, 2, 16)
    want = _linen_value_and_grads(
        jflash.flax.linen.MultiHeadAttention(**kw, implementation="xla"), params, x, dout
    )
    got = _linen_value_and_grads(ours, params, x, dout)
    _assert_trees_close(got, want)


def _nnx_value_and_grads(model, x, dout, **call_kw):
    def loss(model, x):
        out = model(x, **call_kw)
        return jnp.sum(out * dout), out

    (_, out), grads = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))(model, x)
    return out, (nnx.state(grads[0], nnx.Param), grads[1])


def _copy_projections(src, dst):
    for name in ("query", "key", "value", "out"):
        for param in ("kernel", "bias"):
            target = getattr(getattr(dst, name), param)
            target[...] = getattr(getattr(src, name), param)[...]


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_nnx_module_matches_flax(rng, num_kv_heads):
    x, dout = _inputs(rng)
    seed = int(rng.integers(1 << 30))
    kw = dict(num_heads=4, in_features=48, num_kv_heads=num_kv_heads)
    ours = jflash.flax.nnx.MultiHeadAttention(**kw, is_causal=True, rngs=nnx.Rngs(seed))
    theirs = nnx.MultiHeadAttention(**kw, decode=False, rngs=nnx.Rngs(seed + 1))
    _copy_projections(ours, theirs)
    out, (grads, dx) = _nnx_value_and_grads(ours, x, dout)
    want_out, (want_grads, want_dx) = _nnx_value_and_grads(theirs, x, dout, is_causal=True)
    _assert_trees_close(out, want_out)
    _assert_trees_close(dx, want_dx)
    for name in ("query", "key", "value", "out"):
        _assert_trees_close(grads[name], want_grads[name])


def _reference_softcap_fn(softcap):
    """A Flax attention_fn: causal attention with softcap in plain jnp."""

    def attention_fn(query, key, value, bias=None, mask=None, **kwargs):
        del bias, mask, kwargs
        return jflash.reference.attention(query, key, value, causal=True, softcap=softcap)

    return attention_fn


def test_softcap_attribute(rng):
    """softcap as a layer attribute (linen) and argument (nnx): Flax's layers with
    the plain-jnp softcap attention, on queries large enough that the cap acts."""
    x, dout = _inputs(rng)
    x = x * 2
    ours = jflash.flax.linen.MultiHeadAttention(num_heads=4, is_causal=True, softcap=2.0)
    theirs = nn.MultiHeadDotProductAttention(num_heads=4,
                                             attention_fn=_reference_softcap_fn(2.0))
    params = ours.init(jax.random.key(int(rng.integers(1 << 30))), x)["params"]
    _assert_trees_close(_linen_value_and_grads(ours, params, x, dout),
                        _linen_value_and_grads(theirs, params, x, dout))

    seed = int(rng.integers(1 << 30))
    kw = dict(num_heads=4, in_features=48, num_kv_heads=2)
    ours = jflash.flax.nnx.MultiHeadAttention(**kw, is_causal=True, softcap=2.0,
                                              rngs=nnx.Rngs(seed))
    theirs = nnx.MultiHeadAttention(**kw, decode=False, attention_fn=_reference_softcap_fn(2.0),
                                    rngs=nnx.Rngs(seed + 1))
    _copy_projections(ours, theirs)
    got, want = _nnx_value_and_grads(ours, x, dout), _nnx_value_and_grads(theirs, x, dout)
    _assert_trees_close(got[0], want[0])
    _assert_trees_close(got[1][1], want[1][1])
    with pytest.raises(ValueError, match="softcap"):
        jflash.flax.linen.MultiHeadAttention(num_heads=4, softcap=2.0,
                                             implementation="xla").init(jax.random.key(0), x)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_attention_fn_in_linen_layer(rng, is_causal):
    """flax.linen.MultiHeadDotProductAttention(attention_fn=jflash.flax.attention_fn)."""
    x, dout = _inputs(rng)
    attention_fn = functools.partial(jflash.flax.attention_fn, is_causal=is_causal)
    ours = nn.MultiHeadDotProductAttention(num_heads=4, attention_fn=attention_fn)
    theirs = nn.MultiHeadDotProductAttention(num_heads=4)
    params = theirs.init(jax.random.key(int(rng.integers(1 << 30))), x)["params"]
    mask = nn.make_causal_mask(x[..., 0]) if is_causal else None
    want = _linen_value_and_grads(theirs, params, x, dout, mask=mask)
    got = _linen_value_and_grads(ours, params, x, dout)
    _assert_trees_close(got, want)
    lowered = jax.jit(lambda p, x: ours.apply({"params": p}, x)).lower(params, x).as_text()
    assert "jflash_fwd" in lowered


def test_attention_fn_falls_back_for_mask_and_dropout(rng):
    """A mask or active dropout is Flax's job: the results are Flax's own, exactly."""
    x, _ = _inputs(rng)
    mask = jnp.asarray(rng.random((2, 1, 24, 24)) < 0.8)
    kw = dict(num_heads=4, dropout_rate=0.3, deterministic=False)
    ours = nn.MultiHeadDotProductAttention(**kw, attention_fn=jflash.flax.attention_fn)
    theirs = nn.MultiHeadDotProductAttention(**kw)
    params = theirs.init(jax.random.key(0), x)["params"]
    rngs = {"dropout": jax.random.key(int(rng.integers(1 << 30)))}
    got = ours.apply({"params": params}, x, mask=mask, rngs=rngs)
    want = theirs.apply({"params": params}, x, mask=mask, rngs=rngs)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("num_kv_heads", [4, 2], ids=["mha", "gqa"])
def test_attention_fn_in_nnx_layer(rng, num_kv_heads):
    """flax.nnx.MultiHeadAttention(attention_fn=jflash.flax.attention_fn), is_causal
    passed by nnx itself."""
    x, dout = _inputs(rng)
    seed = int(rng.integers(1 << 30))
    kw = dict(num_heads=4, in_features=48, num_kv_heads=num_kv_heads, decode=False)
    ours = nnx.MultiHeadAttention(**kw, attention_fn=jflash.flax.attention_fn, rngs=nnx.Rngs(seed))
    theirs = nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(seed))
    _copy_projections(ours, theirs)
    for is_causal in (False, True):
        out, (grads, dx) = _nnx_value_and_grads(ours, x, dout, is_causal=is_causal)
        want_out, (want_grads, want_dx) = _nnx_value_and_grads(theirs, x, dout, is_causal=is_causal)
        _assert_trees_close(out, want_out)
        _assert_trees_close(dx, want_dx)
        _assert_trees_close(grads, want_grads)


def test_bfloat16_module_follows_the_rule(rng):
    """dtype=bfloat16 computation with float32 parameters: jflash's error against the
    float32 layer is at most about Flax's own bfloat16 error."""
    x, _ = _inputs(rng)
    layer = functools.partial(nn.MultiHeadDotProductAttention, num_heads=4)
    params = layer().init(jax.random.key(int(rng.integers(1 << 30))), x)["params"]
    ours = jflash.flax.linen.MultiHeadAttention(num_heads=4, dtype=jnp.bfloat16)
    got = ours.apply({"params": params}, x)
    assert got.dtype == jnp.bfloat16
    truth = np.asarray(layer().apply({"params": params}, x), np.float64)
    plain = np.asarray(layer(dtype=jnp.bfloat16).apply({"params": params}, x), np.float64)
    got_err = np.abs(np.asarray(got, np.float64) - truth).max()
    plain_err = np.abs(plain - truth).max()
    assert got_err <= 2 * plain_err + 1e-4 * max(1.0, np.abs(truth).max())


def test_import_jflash_does_not_import_flax():
    import subprocess
    import sys

    code = "import sys, jflash; assert 'flax' not in sys.modules, 'flax imported'"
    subprocess.run([sys.executable, "-P", "-c", code], check=True)


def test_linen_sown_weights_with_bound_is_causal(rng):
    """sow_weights=True in a linen layer with is_causal bound: the weights are sown
    where linen keeps them ("intermediates"), as with Flax's own causal layer."""
    x, _ = _inputs(rng)
    attention_fn = functools.partial(jflash.flax.attention_fn, is_causal=True)
    ours = nn.MultiHeadDotProductAttention(num_heads=4, attention_fn=attention_fn)
    theirs = nn.MultiHeadDotProductAttention(num_heads=4)
    params = theirs.init(jax.random.key(int(rng.integers(1 << 30))), x)["params"]
    got, got_state = ours.apply(
        {"params": params}, x, sow_weights=True, mutable=["intermediates"]
    )
    want, want_state = theirs.apply(
        {"params": params},
        x,
        mask=nn.make_causal_mask(x[..., 0]),
        sow_weights=True,
        mutable=["intermediates"],
    )
    (weights,) = got_state["intermediates"]["attention_weights"]
    (want_weights,) = want_state["intermediates"]["attention_weights"]
    assert weights.shape == (2, 4, 24, 24)
    np.testing.assert_allclose(weights, want_weights, **TOL)
    np.testing.assert_allclose(got, want, **TOL)


def _complex(rng, shape):
    return jnp.asarray(rng.standard_normal(shape) + 1j * rng.standard_normal(shape), jnp.complex64)


@pytest.mark.parametrize("is_causal", [None, True], ids=["linen", "nnx"])
def test_attention_fn_complex_inputs_give_flax_answer(rng, is_causal):
    """Complex q, k, v go to Flax's function. linen's keeps the logits' imaginary
    part, which jax.nn's drops; nnx's calls jax.nn's itself (and jax warns)."""
    q = _complex(rng, (2, 5, 2, 8))
    k, v = _complex(rng, (2, 7, 2, 8)), _complex(rng, (2, 7, 2, 8))
    with warnings.catch_warnings():  # jax: casting complex to real
        warnings.simplefilter("ignore", DeprecationWarning)
        got = jflash.flax.attention_fn(q, k, v, is_causal=is_causal)
        if is_causal is None:
            want = nn.dot_product_attention(q, k, v)
        else:
            want = nnx.dot_product_attention(q, k, v, is_causal=True)
        lossy = jax.nn.dot_product_attention(q, k, v, is_causal=bool(is_causal))
    assert got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    if is_causal is None:  # the case matters
        assert np.abs(np.asarray(want) - np.asarray(lossy)).max() > 0.1


@pytest.mark.parametrize(
    "kv_shape,message",
    [
        ((3, 2, 5, 2, 32), r"batch dims must match.*\(2, 3, 5, 2, 32\).*\(3, 2, 5, 2, 32\)"),
        ((6, 5, 2, 32), "must have the same rank, got 5, 4, 4"),
    ],
)
@pytest.mark.parametrize("is_causal", [None, True], ids=["linen", "nnx"])
def test_attention_fn_batch_dims_must_match(rng, kv_shape, message, is_causal):
    q = jnp.asarray(rng.standard_normal((2, 3, 5, 2, 32)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal(kv_shape), jnp.float32)
    with pytest.raises(ValueError, match=message):
        jflash.flax.attention_fn(q, kv, kv, is_causal=is_causal)
    with pytest.raises(ValueError, match="batch dims must match|same rank"):
        nnx.dot_product_attention(q, kv, kv)  # Flax's own answer


# ------------------------------------------------------------------ decode

def _chunks(length, first):
    """A prompt of `first` tokens, then one token per step."""
    return [slice(0, first)] + [slice(i, i + 1) for i in range(first, length)]


@pytest.mark.parametrize("window", [None, (3, 0)])
def test_linen_decode_matches_full_call(rng, window):
    """Decode steps (a prompt, then a token per step) give the full causal call's
    outputs for the same tokens; the cache index counts the tokens."""
    layer = jflash.flax.linen.MultiHeadAttention(num_heads=4, num_kv_heads=2, is_causal=True,
                                                 local_window_size=window, decode=True)
    x = jnp.asarray(rng.standard_normal((2, 11, 32)), jnp.float32)
    variables = layer.init(jax.random.key(0), x)  # sizes the cache: 11 tokens
    params, cache = variables["params"], variables["cache"]
    assert cache["cached_key"].shape == (2, 11, 2, 8)
    want = layer.clone(decode=False).apply({"params": params}, x)
    step = jax.jit(lambda cache, x: layer.apply({"params": params, "cache": cache}, x,
                                                mutable=["cache"]))
    outs = []
    for chunk in _chunks(11, 5):
        out, mutated = step(cache, x[:, chunk])
        cache = mutated["cache"]
        outs.append(out)
    # On GPU, float32 decode attends over a bfloat16 copy of the cache (README,
    # decode), the full call on the TF32 kernels: _assert_trees_close's GPU rule.
    _assert_trees_close(jnp.concatenate(outs, 1), want)
    assert int(cache["cache_index"]) == 11
    with pytest.raises(ValueError, match="self-attention"):
        layer.apply({"params": params, "cache": cache}, x[:, :1], x[:, :1], mutable=["cache"])


def test_nnx_decode_matches_full_call(rng):
    layer = jflash.flax.nnx.MultiHeadAttention(num_heads=4, in_features=32, num_kv_heads=1,
                                               is_causal=True, rngs=nnx.Rngs(0))
    x = jnp.asarray(rng.standard_normal((3, 9, 32)), jnp.float32)
    want = layer(x)
    with pytest.raises(ValueError, match="init_cache"):
        layer(x[:, :1], decode=True)
    layer.init_cache(x.shape, x.dtype)
    with pytest.raises(ValueError, match="self-attention"):
        layer(x[:, :1], x[:, :1], decode=True)
    got = jnp.concatenate([layer(x[:, chunk], decode=True) for chunk in _chunks(9, 4)], 1)
    _assert_trees_close(got, want)  # bfloat16 decode on GPU, as above
    assert int(layer.cache_index.get_value()) == 9


# ------------------------------------------------------------------ packed documents, window

def _packed_ids(rows):
    """[batch, length] int32 ids from each row's (id, document length) pairs."""
    return jnp.asarray(np.stack([np.repeat([i for i, _ in row], [n for _, n in row])
                                 for row in rows]), jnp.int32)


# Two rows of 24 tokens: documents of 7, 1, 10 and 6 tokens, and of 12 and 12
# (ids any integers, not in order).
PACKING = [[(4, 7), (0, 1), (9, 10), (-3, 6)], [(2, 12), (1, 12)]]


def _document_slices():
    for b, row in enumerate(PACKING):
        start = 0
        for _, n in row:
            yield b, slice(start, start + n)
            start += n


def _assert_packed_equals_separate(value_and_grads, x, dout):
    """value_and_grads(x, dout, segment_ids) -> (out, (param grads, dx)). The packed
    call's outputs and input gradients per document are those of the document
    alone, and its parameter gradients are the sum of the documents'."""
    out, (grads, dx) = value_and_grads(x, dout, _packed_ids(PACKING))
    summed = None
    for b, doc in _document_slices():
        doc_out, (doc_grads, doc_dx) = value_and_grads(x[b:b + 1, doc], dout[b:b + 1, doc], None)
        _assert_trees_close(out[b:b + 1, doc], doc_out)
        _assert_trees_close(dx[b:b + 1, doc], doc_dx)
        summed = doc_grads if summed is None else jax.tree.map(jnp.add, summed, doc_grads)
    _assert_trees_close(grads, summed, **({} if jax.default_backend() == "gpu" else
                                          dict(rtol=1e-4, atol=1e-5)))


@pytest.mark.parametrize("window", [None, (3, 0)], ids=["causal", "causal-window"])
def test_linen_packed_documents_equal_separate_documents(rng, window):
    x, dout = _inputs(rng)
    layer = jflash.flax.linen.MultiHeadAttention(num_heads=4, num_kv_heads=2, is_causal=True,
                                                 local_window_size=window)
    params = layer.init(jax.random.key(int(rng.integers(1 << 30))), x)["params"]

    def value_and_grads(x, dout, ids):
        out, grads = _linen_value_and_grads(layer, params, x, dout, segment_ids=ids)
        return out, grads

    _assert_packed_equals_separate(value_and_grads, x, dout)


@pytest.mark.parametrize("window", [None, (3, 0)], ids=["causal", "causal-window"])
def test_nnx_packed_documents_equal_separate_documents(rng, window):
    x, dout = _inputs(rng)
    layer = jflash.flax.nnx.MultiHeadAttention(num_heads=4, in_features=48, num_kv_heads=1,
                                               is_causal=True, local_window_size=window,
                                               rngs=nnx.Rngs(int(rng.integers(1 << 30))))

    def value_and_grads(x, dout, ids):
        return _nnx_value_and_grads(layer, x, dout, segment_ids=ids)

    _assert_packed_equals_separate(value_and_grads, x, dout)


def _reference_fn(is_causal=False, window=None, q_segment_ids=None, kv_segment_ids=None):
    """A Flax attention_fn on jflash.reference (plain jnp) with the ids bound."""

    def attention_fn(query, key, value, bias=None, mask=None, **kwargs):
        del bias, mask, kwargs
        return jflash.reference.attention(query, key, value, causal=is_causal,
                                          window_size=window, q_segment_ids=q_segment_ids,
                                          kv_segment_ids=kv_segment_ids)

    return attention_fn


def test_layers_with_segment_ids_match_the_reference(rng):
    """Both layers, packed causal self-attention with a window and cross-attention
    with q and kv ids, against Flax's layer on the plain-jnp reference."""
    x, dout = _inputs(rng)
    ids = _packed_ids(PACKING)
    ours = jflash.flax.linen.MultiHeadAttention(num_heads=4, is_causal=True,
                                                local_window_size=(5, 0))
    theirs = nn.MultiHeadDotProductAttention(
        num_heads=4, attention_fn=_reference_fn(True, (5, 0), ids, ids))
    params = ours.init(jax.random.key(int(rng.integers(1 << 30))), x)["params"]
    _assert_trees_close(_linen_value_and_grads(ours, params, x, dout, segment_ids=ids),
                        _linen_value_and_grads(theirs, params, x, dout))

    # Cross-attention: 24 queries over 16 keys; every query's id is among the keys'.
    x_kv = jnp.asarray(rng.standard_normal((2, 16, 48)), jnp.float32)
    kv_ids = jnp.asarray(rng.integers(0, 3, (2, 16)), jnp.int32).at[:, :3].set(jnp.arange(3))
    q_ids = jnp.asarray(rng.integers(0, 3, (2, 24)), jnp.int32)
    seed = int(rng.integers(1 << 30))
    ours = jflash.flax.nnx.MultiHeadAttention(num_heads=4, in_features=48, rngs=nnx.Rngs(seed))
    theirs = nnx.MultiHeadAttention(num_heads=4, in_features=48, decode=False,
                                    attention_fn=_reference_fn(False, None, q_ids, kv_ids),
                                    rngs=nnx.Rngs(seed + 1))
    _copy_projections(ours, theirs)

    def grads(model, **kw):
        def loss(model, x, x_kv):
            return jnp.sum(model(x, x_kv, **kw) * dout)

        return nnx.grad(loss, argnums=(0, 1, 2))(model, x, x_kv)

    got = grads(ours, q_segment_ids=q_ids, kv_segment_ids=kv_ids)
    want = grads(theirs)
    _assert_trees_close(ours(x, x_kv, q_segment_ids=q_ids, kv_segment_ids=kv_ids),
                        theirs(x, x_kv))
    _assert_trees_close((nnx.state(got[0], nnx.Param), got[1:]),
                        (nnx.state(want[0], nnx.Param), want[1:]))


def _flax_mask(q_ids, kv_ids, length_q, length_kv, window, is_causal):
    """The same visibility as Flax's boolean mask [batch, 1, length_q, length_kv]."""
    mask = nn.make_attention_mask(q_ids, kv_ids, jnp.equal, dtype=jnp.bool_)
    i, j = np.arange(length_q)[:, None], np.arange(length_kv)[None, :]
    band = (j >= i - window[0]) & (j <= i + window[1])
    if is_causal:
        band &= j <= i
    return mask & jnp.asarray(band)


def test_attention_fn_segment_ids_and_window_run_the_kernels(rng):
    """attention_fn with ids and a window bound, in Flax's linen and nnx layers:
    Flax's layer with the same visibility as a mask, and the kernels run it."""
    x, dout = _inputs(rng)
    ids = _packed_ids(PACKING)
    mask = _flax_mask(ids, ids, 24, 24, (4, 2), True)
    attention_fn = functools.partial(jflash.flax.attention_fn, is_causal=True,
                                     local_window_size=(4, 2), q_segment_ids=ids,
                                     kv_segment_ids=ids)
    ours = nn.MultiHeadDotProductAttention(num_heads=4, attention_fn=attention_fn)
    theirs = nn.MultiHeadDotProductAttention(num_heads=4)
    params = theirs.init(jax.random.key(int(rng.integers(1 << 30))), x)["params"]
    _assert_trees_close(_linen_value_and_grads(ours, params, x, dout),
                        _linen_value_and_grads(theirs, params, x, dout, mask=mask))
    lowered = jax.jit(lambda p, x: ours.apply({"params": p}, x)).lower(params, x).as_text()
    assert "jflash_fwd" in lowered and "diag_lo = -4 : i64" in lowered

    seed = int(rng.integers(1 << 30))
    kw = dict(num_heads=4, in_features=48, num_kv_heads=2, decode=False)
    attention_fn = functools.partial(jflash.flax.attention_fn, local_window_size=3,
                                     q_segment_ids=ids, kv_segment_ids=ids)
    ours = nnx.MultiHeadAttention(**kw, attention_fn=attention_fn, rngs=nnx.Rngs(seed))
    theirs = nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(seed))
    _copy_projections(ours, theirs)
    got = _nnx_value_and_grads(ours, x, dout, is_causal=True)
    want = _nnx_value_and_grads(theirs, x, dout, mask=_flax_mask(ids, ids, 24, 24, (3, 3), True))
    _assert_trees_close(got, want)


@pytest.mark.parametrize("is_causal", [None, True], ids=["linen", "nnx"])
def test_attention_fn_fallback_keeps_segment_ids_and_window(rng, is_causal):
    """With a mask (or dropout) Flax's function runs, with the ids and the window
    folded into its mask: Flax's result exactly; and the kernels' result agrees,
    also for query rows whose id no key has (the mean of the values in both)."""
    q = jnp.asarray(rng.standard_normal((2, 9, 4, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, 12, 2, 16)), jnp.float32) for _ in range(2))
    q_ids = jnp.asarray(rng.integers(0, 4, (2, 9)), jnp.int32).at[:, 4].set(3)  # no key has 3
    kv_ids = jnp.asarray(rng.integers(0, 3, (2, 12)), jnp.int32)
    window = (6, 1)
    extra = jnp.asarray(rng.random((2, 1, 9, 12)) < 0.9)
    fn = functools.partial(jflash.flax.attention_fn, is_causal=is_causal, local_window_size=window,
                           q_segment_ids=q_ids, kv_segment_ids=kv_ids)
    got = fn(q, k, v, mask=extra)
    full = _flax_mask(q_ids, kv_ids, 9, 12, window, bool(is_causal)) & extra
    kv = [jnp.repeat(x, 2, axis=-2) for x in (k, v)]
    if is_causal is None:
        want = nn.dot_product_attention(q, *kv, mask=full)
    else:
        want = nnx.dot_product_attention(q, *kv, mask=full)
    np.testing.assert_array_equal(got, want)
    fast = fn(q, k, v)
    slow = fn(q, k, v, mask=jnp.ones((9, 12), jnp.bool_))
    _assert_trees_close(fast, slow)


def test_window_reaches_the_kernels(rng):
    """Both layers' local_window_size is the kernels' band (diag_lo, diag_hi)."""
    x, _ = _inputs(rng)
    layer = jflash.flax.linen.MultiHeadAttention(num_heads=4, local_window_size=(5, 2))
    params = layer.init(jax.random.key(0), x)["params"]
    lowered = jax.jit(lambda p, x: layer.apply({"params": p}, x)).lower(params, x).as_text()
    assert "diag_hi = 2 : i64, diag_lo = -5 : i64" in lowered
    model = jflash.flax.nnx.MultiHeadAttention(num_heads=4, in_features=48, is_causal=True,
                                               local_window_size=7, rngs=nnx.Rngs(0))
    graph, state = nnx.split(model)
    lowered = jax.jit(lambda s, x: nnx.merge(graph, s)(x)).lower(state, x).as_text()
    assert "diag_hi = 0 : i64, diag_lo = -7 : i64" in lowered


def test_segment_id_errors(rng):
    x, _ = _inputs(rng)
    ids = _packed_ids(PACKING)
    linen_layer = jflash.flax.linen.MultiHeadAttention(num_heads=4, is_causal=True)
    params = linen_layer.init(jax.random.key(0), x)["params"]
    nnx_layer = jflash.flax.nnx.MultiHeadAttention(num_heads=4, in_features=48, rngs=nnx.Rngs(0))
    calls = [functools.partial(linen_layer.apply, {"params": params}), nnx_layer]
    for call in calls:
        with pytest.raises(ValueError, match=r"q_segment_ids must have shape \[batch\.\.\., "
                                             r"length_q\] = \(2, 24\).*got shape \(2, 23\)"):
            call(x, segment_ids=ids[:, 1:])
        with pytest.raises(ValueError, match=r"kv_segment_ids must have shape.*\(2, 16\)"):
            call(x, x[:, :16], q_segment_ids=ids, kv_segment_ids=ids)
        with pytest.raises(ValueError, match="pass both segment ids or neither"):
            call(x, q_segment_ids=ids)
        with pytest.raises(ValueError, match="not both"):
            call(x, segment_ids=ids, kv_segment_ids=ids)
        with pytest.raises(ValueError, match="segment_ids is for self-attention"):
            call(x, x, segment_ids=ids)
        with pytest.raises(TypeError, match="integer"):
            call(x, segment_ids=ids.astype(jnp.float32))
    with pytest.raises(ValueError, match="not supported with decode"):
        linen_layer.clone(decode=True).init(jax.random.key(0), x, segment_ids=ids)
    nnx_layer.init_cache(x.shape)
    with pytest.raises(ValueError, match="not supported with decode"):
        nnx_layer(x[:, :1], decode=True, segment_ids=ids[:, :1])
    with pytest.raises(ValueError, match="local_window_size must be"):
        jflash.flax.linen.MultiHeadAttention(num_heads=4, local_window_size=(1, 2, 3)).init(
            jax.random.key(0), x)
    q = jnp.ones((2, 24, 4, 8))
    with pytest.raises(ValueError, match="local_window_size must be"):
        jflash.flax.attention_fn(q, q, q, local_window_size="wide")
    with pytest.raises(ValueError, match=r"kv_segment_ids must have shape \[batch\.\.\., "
                                         r"length_kv\] = \(2, 24\)"):
        jflash.flax.attention_fn(q, q, q, q_segment_ids=ids, kv_segment_ids=ids[0])


# ------------------------------------------------------------------ precision

def _tf32_passes(text):
    """The tf32_passes attributes of the jflash calls in a lowered program."""
    import re

    return {int(x) for x in re.findall(r"tf32_passes = (\d+) : i64", text)}


@pytest.mark.parametrize("precision, passes", [
    (None, 1), ("highest", 3), (jax.lax.Precision.HIGH, 1),
    ((jax.lax.Precision.DEFAULT, jax.lax.Precision.HIGHEST), 3),
], ids=repr)
def test_attention_fn_precision_runs_the_kernels(rng, precision, passes):
    """An explicit precision that jflash maps (jax.lax.Precision, its names, pairs)
    runs the kernels at that precision, in Flax's layer as in a direct call, with
    Flax's results."""
    x, dout = _inputs(rng)
    ours = nn.MultiHeadDotProductAttention(num_heads=4, precision=precision,
                                           attention_fn=jflash.flax.attention_fn)
    theirs = nn.MultiHeadDotProductAttention(num_heads=4, precision=precision)
    params = theirs.init(jax.random.key(int(rng.integers(1 << 30))), x)["params"]
    _assert_trees_close(_linen_value_and_grads(ours, params, x, dout),
                        _linen_value_and_grads(theirs, params, x, dout))
    lowered = jax.jit(lambda p, x: ours.apply({"params": p}, x)).lower(params, x).as_text()
    assert "jflash_fwd" in lowered and _tf32_passes(lowered) == {passes}


@pytest.mark.parametrize("is_causal", [None, True], ids=["linen", "nnx"])
def test_attention_fn_unmapped_precision_falls_back(rng, is_causal):
    """A precision jflash cannot map (a jax.lax.DotAlgorithmPreset, also as
    jax_default_matmul_precision) is Flax's job: its own function runs, exactly."""
    q = jnp.asarray(rng.standard_normal((2, 9, 4, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, 12, 4, 16)), jnp.float32) for _ in range(2))
    flax_fn = nn.dot_product_attention if is_causal is None else functools.partial(
        nnx.dot_product_attention, is_causal=True)
    fn = functools.partial(jflash.flax.attention_fn, is_causal=is_causal)
    algorithm = jax.lax.DotAlgorithmPreset.F32_F32_F32
    assert "jflash_fwd" not in jax.jit(
        functools.partial(fn, precision=algorithm)).lower(q, k, v).as_text()
    np.testing.assert_array_equal(fn(q, k, v, precision=algorithm),
                                  flax_fn(q, k, v, precision=algorithm))
    with jax.default_matmul_precision("F32_F32_F32"):
        assert "jflash_fwd" not in jax.jit(fn).lower(q, k, v).as_text()
        np.testing.assert_array_equal(fn(q, k, v), flax_fn(q, k, v))
        # An explicit precision that jflash maps still runs the kernels.
        text = jax.jit(functools.partial(fn, precision="highest")).lower(q, k, v).as_text()
        assert _tf32_passes(text) == {3}


def test_layers_precision(rng):
    """The layers' precision reaches their projections (as in Flax's layers) and
    the kernels."""
    x, _ = _inputs(rng)
    linen_layer = jflash.flax.linen.MultiHeadAttention(num_heads=4, precision="highest")
    params = linen_layer.init(jax.random.key(0), x)["params"]
    text = jax.jit(lambda p, x: linen_layer.apply({"params": p}, x)).lower(params, x).as_text()
    assert _tf32_passes(text) == {3} and "HIGHEST" in text
    plain = jflash.flax.linen.MultiHeadAttention(num_heads=4)
    # The layer's own "highest" gives what a global "highest" gives the plain
    # layer (on GPU both run HIGHEST projections and the 3xTF32 kernels; at the
    # default precision the plain layer runs TF32 there and differs by its
    # rounding).
    with jax.default_matmul_precision("highest"):
        want = plain.apply({"params": params}, x)
    np.testing.assert_allclose(linen_layer.apply({"params": params}, x), want, **TOL)
    text = jax.jit(lambda p, x: plain.apply({"params": p}, x)).lower(params, x).as_text()
    assert _tf32_passes(text) == {1} and "HIGHEST" not in text

    nnx_layer = jflash.flax.nnx.MultiHeadAttention(num_heads=4, in_features=48,
                                                   precision=jax.lax.Precision.HIGHEST,
                                                   rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(nnx_layer)
    text = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)).lower(state, x).as_text()
    assert _tf32_passes(text) == {3} and "HIGHEST" in text
    with pytest.raises(ValueError, match="low"):  # the projections' check (jax's) comes first
        jflash.flax.linen.MultiHeadAttention(num_heads=4, precision="low").init(
            jax.random.key(0), x)

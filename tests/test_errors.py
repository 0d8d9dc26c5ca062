"""Bad input raises ValueError/TypeError at trace time, naming the argument."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jflash


def _qkv(q_shape=(2, 16, 4, 64), kv_shape=(2, 24, 2, 64), dtype=jnp.bfloat16):
    return (
        jax.ShapeDtypeStruct(q_shape, dtype),
        jax.ShapeDtypeStruct(kv_shape, dtype),
        jax.ShapeDtypeStruct(kv_shape, dtype),
    )


def _trace(q, k, v, **kwargs):
    """Traces without running anything: errors must come from trace-time checks."""
    return jax.eval_shape(lambda q, k, v: jflash.flash_attention(q, k, v, **kwargs), q, k, v)


BAD_SHAPES = [
    # (query shape, key/value shape, error type, message fragment)
    ((16, 4, 64), (2, 24, 2, 64), ValueError, "query must have rank 4"),
    ((2, 16, 4, 64), (2, 24, 2, 64, 1), ValueError, "key must have rank 4"),
    ((2, 16, 4, 64), (3, 24, 2, 64), ValueError, "same batch size"),
    ((2, 16, 4, 64), (2, 24, 2, 32), ValueError, "same head_dim"),
    ((2, 16, 4, 64), (2, 24, 3, 64), ValueError, "multiple of num_heads"),
    ((2, 16, 4, 320), (2, 24, 2, 320), ValueError, "head_dim must be at most 256"),
    ((2, 0, 4, 64), (2, 24, 2, 64), ValueError, "zero-sized"),
]


@pytest.mark.parametrize("q_shape,kv_shape,error,message", BAD_SHAPES)
def test_bad_shapes(q_shape, kv_shape, error, message):
    with pytest.raises(error, match=message):
        _trace(*_qkv(q_shape, kv_shape))


def test_key_value_shape_mismatch():
    q, k, _ = _qkv()
    v = jax.ShapeDtypeStruct((2, 25, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"key and value must have the same shape.*\(2, 25, 2, 64\)"):
        _trace(q, k, v)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_, jnp.complex64])
def test_non_floating_dtype(dtype):
    with pytest.raises(TypeError, match="must be a floating-point array"):
        _trace(*_qkv(dtype=dtype))


def test_unsupported_float_dtype():
    with pytest.raises(TypeError, match="supports float16, bfloat16 and float32"):
        _trace(*_qkv(dtype=jnp.float8_e4m3fn))


def test_mixed_dtypes():
    q, k, v = _qkv()
    v = jax.ShapeDtypeStruct(v.shape, jnp.float16)
    with pytest.raises(TypeError, match="must share one dtype"):
        _trace(q, k, v)


def test_not_an_array():
    _, k, v = _qkv()
    with pytest.raises(TypeError, match="query must be an array, got list"):
        jflash.flash_attention([[1.0]], k, v)


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        (dict(causal="yes"), TypeError, "causal must be a bool"),
        (dict(return_lse=1), TypeError, "return_lse must be a bool"),
        (dict(deterministic=1), TypeError, "deterministic must be a bool"),
        (dict(softmax_scale="0.1"), TypeError, "softmax_scale must be"),
        (dict(softmax_scale=float("nan")), ValueError, "softmax_scale must be finite"),
        # Finite as a Python float, not as the float32 the kernels receive.
        (dict(softmax_scale=1e39), ValueError, "softmax_scale must be finite as float32"),
        (dict(softmax_scale=-1e39), ValueError, "softmax_scale must be finite as float32"),
        (dict(softmax_scale=np.float64(4e38)), ValueError, "finite as float32"),
        # Beyond float64 too: float() would raise OverflowError.
        (dict(softmax_scale=10**400), ValueError, r"softmax_scale must be finite.*characters"),
        (dict(softmax_scale=jnp.float32(0.1) * jnp.ones(())), TypeError, "softmax_scale must be"),
        (dict(window_size=(-2, 0)), ValueError, "window_size left side must be >= 0"),
        (dict(window_size=(0, -5)), ValueError, "window_size right side must be >= 0"),
        (dict(window_size=(1.5, 0)), TypeError, "window_size left side must be an int"),
        (dict(window_size=(1, True)), TypeError, "window_size right side must be an int"),
        (dict(window_size=8), TypeError, r"window_size must be None or a \(left, right\) pair"),
        (dict(window_size=(1, 2, 3)), TypeError, "window_size must be None or a"),
    ],
)
def test_bad_keywords(kwargs, error, message):
    with pytest.raises(error, match=message):
        _trace(*_qkv(), **kwargs)


def _ids(shape, dtype=jnp.int32):
    return jnp.zeros(shape, dtype)


# q is [2, 16, ...] and k [2, 24, ...] (_qkv): valid ids are [2, 16] and [2, 24].
BAD_SEGMENT_IDS = [
    (dict(q_segment_ids=_ids((2, 16))), ValueError,
     "q_segment_ids is given but kv_segment_ids is None"),
    (dict(kv_segment_ids=_ids((2, 24))), ValueError,
     "kv_segment_ids is given but q_segment_ids is None"),
    (dict(q_segment_ids=_ids((16,)), kv_segment_ids=_ids((2, 24))), ValueError,
     r"q_segment_ids must have shape \[batch, seq_q\] of query, \(2, 16\), got shape \(16,\)"),
    (dict(q_segment_ids=_ids((2, 16)), kv_segment_ids=_ids((2, 24, 1))), ValueError,
     r"kv_segment_ids must have shape \[batch, seq_k\] of key, \(2, 24\)"),
    (dict(q_segment_ids=_ids((3, 16)), kv_segment_ids=_ids((2, 24))), ValueError,
     r"q_segment_ids must have shape.*got shape \(3, 16\)"),
    (dict(q_segment_ids=_ids((2, 16)), kv_segment_ids=_ids((2, 16))), ValueError,
     r"kv_segment_ids must have shape.*got shape \(2, 16\)"),
    (dict(q_segment_ids=_ids((2, 16), jnp.float32), kv_segment_ids=_ids((2, 24))), TypeError,
     "q_segment_ids must be an integer array"),
    (dict(q_segment_ids=_ids((2, 16)), kv_segment_ids=_ids((2, 24), jnp.bool_)), TypeError,
     "kv_segment_ids must be an integer array"),
    (dict(q_segment_ids=[[0] * 16] * 2, kv_segment_ids=_ids((2, 24))), TypeError,
     "q_segment_ids must be an array, got list"),
]


@pytest.mark.parametrize("kwargs,error,message", BAD_SEGMENT_IDS)
def test_bad_segment_ids(kwargs, error, message):
    with pytest.raises(error, match=message):
        _trace(*_qkv(), **kwargs)
    with pytest.raises(error, match=message):  # jflash.reference takes them alike
        jax.eval_shape(lambda q, k, v: jflash.reference.attention(q, k, v, **kwargs), *_qkv())


def test_wide_segment_ids_name_int32():
    """An integer dtype that int32 does not hold (here uint32) is refused, not wrapped."""
    with pytest.raises(TypeError, match="q_segment_ids has dtype uint32; segment ids are int32"):
        _trace(*_qkv(), q_segment_ids=_ids((2, 16), jnp.uint32), kv_segment_ids=_ids((2, 24)))


def test_valid_segment_ids_trace():
    for dtype in (jnp.int32, jnp.int16, jnp.uint8):
        out = _trace(*_qkv(), q_segment_ids=_ids((2, 16), dtype),
                     kv_segment_ids=_ids((2, 24), dtype), causal=True)
        assert out.shape == (2, 16, 4, 64)
    # NumPy's default int64 is what jax stores as int32 (without jax_enable_x64).
    q, k, v = (jnp.zeros(x.shape, x.dtype) for x in _qkv())
    ids_q, ids_k = np.zeros((2, 16), np.int64), np.zeros((2, 24), np.int64)
    out = jflash.flash_attention(q, k, v, q_segment_ids=ids_q, kv_segment_ids=ids_k)
    assert out.shape == q.shape


def test_valid_input_traces():
    """The error tests above mean something only if valid input traces fine."""
    out = _trace(*_qkv())
    assert out.shape == (2, 16, 4, 64) and out.dtype == jnp.bfloat16
    out, lse = _trace(*_qkv(), return_lse=True, softmax_scale=np.float32(0.2))
    assert lse.shape == (2, 4, 16) and lse.dtype == jnp.float32


def test_largest_float32_scale_traces():
    _trace(*_qkv(), softmax_scale=float(np.finfo(np.float32).max))
    _trace(*_qkv(), softmax_scale=10**30)  # a Python int that float32 holds


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # jax's own
@pytest.mark.parametrize("scale", [float("inf"), float("nan"), 1e39, -1e39])
def test_dot_product_attention_non_finite_scale_falls_back(rng, scale):
    """jax.nn's answer (NaN where its logits overflow), as for any call jflash cannot
    run; implementation="jflash" says why it cannot."""
    q, k, v = (jnp.asarray(rng.standard_normal((1, 8, 2, 16)), jnp.float32) for _ in range(3))
    got = jflash.dot_product_attention(q, k, v, scale=scale)
    want = jax.nn.dot_product_attention(q, k, v, scale=scale)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match="scale must be finite as float32"):
        jflash.dot_product_attention(q, k, v, scale=scale, implementation="jflash")


def _loss(q):
    return jnp.sum(jflash.flash_attention(q, q, q, causal=True) ** 2)


@pytest.mark.parametrize(
    "second_order",
    [
        lambda q: jax.grad(lambda q: jnp.sum(jax.grad(_loss)(q) ** 2))(q),
        jax.hessian(_loss),
        lambda q: jax.jvp(jax.grad(_loss), (q,), (q,)),
    ],
    ids=["grad-of-grad", "hessian", "jvp-of-grad"],
)
def test_second_order_differentiation_names_jflash(rng, second_order):
    q = jnp.asarray(rng.standard_normal((1, 8, 2, 16)), jnp.float32)
    assert np.all(np.isfinite(jax.grad(_loss)(q)))  # first order works
    with pytest.raises(NotImplementedError, match="jflash: second-order differentiation"):
        jax.eval_shape(second_order, q)


@pytest.mark.parametrize(
    "spec,dim",
    [("2, t, 4, 64", "seq_len 't'"), ("2, 16, 4, d", "head_dim 'd'")],
)
def test_export_with_symbolic_dims_names_the_dimension(spec, dim):
    from jax import export

    dims = export.symbolic_shape(f"{spec}, {spec.replace(', 4,', ', 2,')}")  # one scope
    q_shape, kv_shape = dims[:4], dims[4:]
    q, kv = (jax.ShapeDtypeStruct(s, jnp.float32) for s in (q_shape, kv_shape))
    with pytest.raises(ValueError, match=f"query has symbolic {dim}.*only batch"):
        export.export(jax.jit(jflash.flash_attention), platforms=("cpu",))(q, kv, kv)


def test_dot_product_attention_symbolic_seq_len_falls_back(rng):
    """jax.nn takes symbolic shapes, so its drop-in does too, through jax's function."""
    from jax import export

    q = jax.ShapeDtypeStruct(export.symbolic_shape("2, t, 4, 16"), jnp.float32)
    exported = export.export(jax.jit(jflash.dot_product_attention), platforms=("cpu",))(q, q, q)
    # Called where it was exported for (the default device may be a GPU).
    with jax.default_device(jax.devices("cpu")[0]):
        x = jnp.asarray(rng.standard_normal((2, 8, 4, 16)), jnp.float32)
        np.testing.assert_allclose(
            exported.call(x, x, x), jax.nn.dot_product_attention(x, x, x), rtol=1e-6, atol=1e-6
        )
    with pytest.raises(ValueError, match="query has symbolic seq_len 't'"):
        export.export(
            jax.jit(lambda q, k, v: jflash.dot_product_attention(q, k, v, implementation="jflash")),
            platforms=("cpu",),
        )(q, q, q)

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
        (dict(softmax_scale="0.1"), TypeError, "softmax_scale must be"),
        (dict(softmax_scale=float("nan")), ValueError, "softmax_scale must be finite"),
        (dict(softmax_scale=jnp.float32(0.1) * jnp.ones(())), TypeError, "softmax_scale must be"),
    ],
)
def test_bad_keywords(kwargs, error, message):
    with pytest.raises(error, match=message):
        _trace(*_qkv(), **kwargs)


def test_valid_input_traces():
    """The error tests above mean something only if valid input traces fine."""
    out = _trace(*_qkv())
    assert out.shape == (2, 16, 4, 64) and out.dtype == jnp.bfloat16
    out, lse = _trace(*_qkv(), return_lse=True, softmax_scale=np.float32(0.2))
    assert lse.shape == (2, 4, 16) and lse.dtype == jnp.float32

"""attention_fn: Flax's attention-function protocol, served by jflash where it can.

Flax's layers call attention_fn(query, key, value, **kwargs) with arrays
[batch..., length, heads, head_dim]. linen passes the keywords of
flax.linen.dot_product_attention that attention_fn's signature names; nnx passes
mask, dropout, dtype, precision, module and is_causal. Each keyword is either
handled by jflash or makes the call fall back to Flax's own function, so the
result is always Flax's (to rounding), never a silently different one.
"""

from __future__ import annotations

import math

import flax.linen as linen
import jax
import jax.numpy as jnp
from flax import nnx

from jflash._src.decode import flash_attention_with_kvcache
from jflash._src.dot_product_attention import _unsupported, dot_product_attention


def _check_batch_dims(query, key, value):
    """ValueError unless q, k, v have one rank and the same batch dims, as Flax's
    nnx.dot_product_attention requires (linen's asserts it)."""
    arrays = (query, key, value)
    if len({x.ndim for x in arrays}) != 1:
        ranks = ", ".join(str(x.ndim) for x in arrays)
        raise ValueError(f"query, key and value must have the same rank, got {ranks}")
    if any(x.ndim < 3 for x in arrays):
        shapes = ", ".join(str(x.shape) for x in arrays)
        raise ValueError(
            "query, key and value must be [batch..., length, heads, head_dim], "
            f"got shapes {shapes}"
        )
    if len({x.shape[:-3] for x in arrays}) != 1:
        shapes = ", ".join(str(x.shape) for x in arrays)
        raise ValueError(f"query, key and value batch dims must match, got shapes {shapes}")


def _fallback(query, key, value, *, bias, mask, is_causal, module, linen_only, **kwargs):
    """Flax's own attention, from the Flax API of the caller: linen's for a linen
    module, nnx's for an nnx module; without a module, nnx's when is_causal is
    passed (nnx passes it; a linen caller may bind it) and linen's otherwise."""
    nnx_caller = module is None and is_causal is not None and not linen_only
    if isinstance(module, nnx.Module) or nnx_caller:
        return nnx.dot_product_attention(
            query, key, value, bias, mask, module=module, is_causal=bool(is_causal), **kwargs
        )
    if is_causal:  # linen's function has no is_causal: fold it into the mask
        causal = jnp.tril(jnp.ones((query.shape[-3], key.shape[-3]), jnp.bool_))
        mask = causal if mask is None else jnp.logical_and(mask, causal)
    group = query.shape[-2] // key.shape[-2]  # linen's function has no GQA
    key, value = (jnp.repeat(x, group, axis=-2) for x in (key, value))
    return linen.dot_product_attention(
        query, key, value, bias, mask, module=module, **linen_only, **kwargs
    )


def attention_fn(
    query,
    key,
    value,
    bias=None,
    mask=None,
    broadcast_dropout=True,
    dropout_rng=None,
    dropout_rate=0.0,
    deterministic=False,
    dtype=None,
    precision=None,
    module=None,
    force_fp32_for_softmax=False,
    qk_attn_weights_einsum=None,
    attn_weights_value_einsum=None,
    is_causal=None,
):
    """Drop-in attention_fn for flax.linen and flax.nnx attention layers.

    jflash runs when there is no bias or mask, no active dropout (dropout_rate 0
    or deterministic), no sown weights (module None), no custom einsums, no
    explicit precision, and the kernels take q, k, v (float16, bfloat16 or
    float32 after promotion, head dim <= 256); otherwise Flax's own
    dot_product_attention runs (linen's for a linen module, nnx's for an nnx
    one; without a module, nnx's when is_causal is passed). q, k and v must
    have the same batch dims (ValueError, as in Flax). The softmax always runs in
    float32, so force_fp32_for_softmax needs nothing.

    Causal attention: nnx passes is_causal itself (MultiHeadAttention(...)(x,
    is_causal=True)); with linen, bind it, attention_fn=functools.partial(
    jflash.flax.attention_fn, is_causal=True), and pass no mask. A mask array
    (e.g. nn.make_causal_mask) cannot be read at trace time, so it always falls
    back, correct but not fast.
    """
    kwargs = dict(
        broadcast_dropout=broadcast_dropout,
        dropout_rng=dropout_rng,
        dropout_rate=dropout_rate,
        deterministic=deterministic,
        dtype=dtype,
        precision=precision,
    )
    _check_batch_dims(query, key, value)
    custom_einsums = qk_attn_weights_einsum is not None or attn_weights_value_einsum is not None
    dropout = dropout_rate > 0.0 and not deterministic
    if (
        bias is not None
        or mask is not None
        or dropout
        or module is not None
        or custom_einsums
        or precision is not None
        or _kernels_cannot_run(query, key, value, dtype) is not None
    ):
        linen_only = {}
        if force_fp32_for_softmax or custom_einsums:
            linen_only = dict(
                force_fp32_for_softmax=force_fp32_for_softmax,
                qk_attn_weights_einsum=qk_attn_weights_einsum,
                attn_weights_value_einsum=attn_weights_value_einsum,
            )
        return _fallback(
            query,
            key,
            value,
            bias=bias,
            mask=mask,
            is_causal=is_causal,
            module=module,
            linen_only=linen_only,
            **kwargs,
        )

    if dtype is not None:  # as Flax's promote_dtype does
        query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
    return attend(
        query, key, value, is_causal=bool(is_causal), local_window_size=None, implementation=None
    )


def _shapes_4d(query, key, value, dtype):
    """q, k, v as the [batch, length, heads, head_dim] arrays attend passes on: in
    their common dtype (or dtype), the batch dims folded into one."""
    dtype = jnp.result_type(query, key, value) if dtype is None else jnp.dtype(dtype)
    batch = math.prod(query.shape[:-3])
    return tuple(jax.ShapeDtypeStruct((batch, *x.shape[-3:]), dtype) for x in (query, key, value))


def _kernels_cannot_run(query, key, value, dtype):
    """Why jflash's kernels cannot take these q, k, v (e.g. complex dtypes, head dim
    over 256), or None. Such calls go to Flax's function, not to jax.nn's: jax.nn
    would drop the imaginary part of complex logits, for one."""
    return _unsupported(*_shapes_4d(query, key, value, dtype), None, None, None, None, None, None)


def attend(query, key, value, *, is_causal, local_window_size, implementation, softcap=None):
    """jflash.dot_product_attention on [batch..., length, heads, head_dim] arrays,
    q/k/v promoted to their common dtype first as Flax does."""
    _check_batch_dims(query, key, value)
    batch_shape = query.shape[:-3]
    query, key, value = (
        jnp.reshape(jnp.asarray(x, s.dtype), s.shape)
        for x, s in zip((query, key, value), _shapes_4d(query, key, value, None), strict=True)
    )
    out = dot_product_attention(
        query,
        key,
        value,
        is_causal=is_causal,
        local_window_size=local_window_size,
        implementation=implementation,
        softcap=softcap,
    )
    return jnp.reshape(out, (*batch_shape, *out.shape[1:]))


def attend_with_cache(query, key, value, cached_key, cached_value, cache_index, *, is_causal,
                      local_window_size, softcap=None):
    """The layers' decode step: key and value [batch..., length, kv_heads, head_dim]
    are written into the cache [batch..., max_length, kv_heads, head_dim] at
    cache_index, and query [batch..., length, heads, head_dim] attends over its
    first cache_index + length keys (jflash.flash_attention_with_kvcache): the
    layer's causal mask and local window then hold in the tokens' absolute
    positions, so a sequence fed in steps gets the outputs of one call on all of
    it. Returns (out, cached_key, cached_value)."""
    _check_batch_dims(query, key, value)
    batch_shape = query.shape[:-3]
    batch = math.prod(batch_shape)
    dtype = cached_key.dtype

    def flat(x):
        return jnp.reshape(jnp.asarray(x, dtype), (batch, *x.shape[-3:]))

    window = local_window_size
    if isinstance(window, int):  # jax.nn.dot_product_attention's int: both sides
        window = (window, window)
    out, cached_key, cached_value = flash_attention_with_kvcache(
        flat(query), flat(cached_key), flat(cached_value),
        cache_seqlens=jnp.full((batch,), cache_index, jnp.int32), k_new=flat(key),
        v_new=flat(value), causal=bool(is_causal), window_size=window, softcap=softcap,
    )
    out = jnp.reshape(out, (*batch_shape, *out.shape[1:])).astype(query.dtype)
    return (out, jnp.reshape(cached_key, (*batch_shape, *cached_key.shape[1:])),
            jnp.reshape(cached_value, (*batch_shape, *cached_value.shape[1:])))

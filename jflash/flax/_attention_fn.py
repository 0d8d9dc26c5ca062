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
import jax.numpy as jnp
from flax import nnx

from jflash._src.dot_product_attention import dot_product_attention


def _fallback(query, key, value, *, bias, mask, is_causal, module, linen_only, **kwargs):
    """Flax's own attention: nnx's when the caller is nnx (it passes is_causal or an
    nnx module), linen's otherwise."""
    if not linen_only and (is_causal is not None or isinstance(module, nnx.Module)):
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
    or deterministic), no sown weights (module None), no custom einsums and no
    explicit precision; otherwise Flax's own dot_product_attention runs (nnx's
    when the caller is nnx, linen's otherwise). The softmax always runs in
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
    custom_einsums = qk_attn_weights_einsum is not None or attn_weights_value_einsum is not None
    dropout = dropout_rate > 0.0 and not deterministic
    if (
        bias is not None
        or mask is not None
        or dropout
        or module is not None
        or custom_einsums
        or precision is not None
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


def attend(query, key, value, *, is_causal, local_window_size, implementation):
    """jflash.dot_product_attention on [batch..., length, heads, head_dim] arrays,
    q/k/v promoted to their common dtype first as Flax does."""
    dtype = jnp.result_type(query, key, value)
    batch_shape = query.shape[:-3]  # folded into one batch axis
    query, key, value = (
        jnp.reshape(x.astype(dtype), (math.prod(batch_shape), *x.shape[-3:]))
        for x in (query, key, value)
    )
    out = dot_product_attention(
        query,
        key,
        value,
        is_causal=is_causal,
        local_window_size=local_window_size,
        implementation=implementation,
    )
    return jnp.reshape(out, (*batch_shape, *out.shape[1:]))

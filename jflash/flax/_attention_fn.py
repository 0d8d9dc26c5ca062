"""attention_fn: Flax's attention-function protocol, served by jflash where it can.

Flax's layers call attention_fn(query, key, value, **kwargs) with arrays
[batch..., length, heads, head_dim]. linen passes the keywords of
flax.linen.dot_product_attention that attention_fn's signature names; nnx passes
mask, dropout, dtype, precision, module and is_causal. Each keyword is either
handled by jflash or makes the call fall back to Flax's own function, so the
result is always Flax's (to rounding), never a silently different one. jflash's
own keywords (local_window_size, q_segment_ids, kv_segment_ids; a caller binds
them with functools.partial) become part of Flax's mask when it falls back.
"""

from __future__ import annotations

import math

import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jflash._src import validation
from jflash._src.decode import flash_attention_with_kvcache
from jflash._src.dot_product_attention import _unsupported, _window, attention


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


def _window_pair(local_window_size):
    """(left, right) from None, an int or a pair of ints (jax.nn's convention), or a
    ValueError."""
    if local_window_size is None:
        return None
    window = _window(local_window_size)
    if window is None:
        raise ValueError("local_window_size must be None, an int or a pair of ints (left, right), "
                         f"got {local_window_size!r}")
    return window


def resolve_segment_ids(segment_ids, q_segment_ids, kv_segment_ids, *, cross_attention):
    """The layers' segment-id arguments as (q_segment_ids, kv_segment_ids) or
    (None, None): segment_ids (self-attention) stands for both sides."""
    if segment_ids is None:
        return q_segment_ids, kv_segment_ids
    if q_segment_ids is not None or kv_segment_ids is not None:
        raise ValueError("pass segment_ids (self-attention) or q_segment_ids and kv_segment_ids, "
                         "not both")
    if cross_attention:
        raise ValueError("segment_ids is for self-attention (inputs_q only); with inputs_k "
                         "pass q_segment_ids and kv_segment_ids")
    return segment_ids, segment_ids


def _segment_ids(query, key, q_segment_ids, kv_segment_ids):
    """q_segment_ids [batch..., length_q] and kv_segment_ids [batch..., length_kv]
    (the batch dims of query [batch..., length_q, heads, head_dim] and key) checked:
    both or neither (else ValueError), those shapes (ValueError), integer ids that
    int32 holds (TypeError). Returns them as int32 arrays of those shapes, or None."""
    given = {"q_segment_ids": q_segment_ids, "kv_segment_ids": kv_segment_ids}
    if all(x is None for x in given.values()):
        return None
    for (name, ids), (side, x) in zip(given.items(), (("query", query), ("key", key)),
                                      strict=True):
        if ids is None:
            other = "kv_segment_ids" if name == "q_segment_ids" else "q_segment_ids"
            raise ValueError(f"{other} is given but {name} is None; pass both segment ids "
                             "or neither")
        expected = tuple(x.shape[:-2])
        if tuple(np.shape(ids)) != expected:
            length = "length_q" if side == "query" else "length_kv"
            raise ValueError(
                f"{name} must have shape [batch..., {length}] = {expected} (the leading dims "
                f"of {side} {tuple(x.shape)}), got shape {tuple(np.shape(ids))}"
            )
    flat = [jnp.reshape(jnp.asarray(ids), (-1, jnp.shape(ids)[-1])) for ids in given.values()]
    q_ids, kv_ids = validation.check_segment_ids(*flat, flat[0].shape, flat[1].shape)
    return (jnp.reshape(q_ids, jnp.shape(q_segment_ids)),
            jnp.reshape(kv_ids, jnp.shape(kv_segment_ids)))


def _extension_mask(query, key, mask, window, segment_ids):
    """Flax's boolean mask with the local window (key j visible from query i iff
    i - left <= j <= i + right) and the segment ids (equal ids) folded in, for
    Flax's own function. mask is broadcast against [batch..., heads, length_q,
    length_kv]; None stays None when there is nothing to add."""
    if window is not None:
        rows = jnp.arange(query.shape[-3])[:, None]
        cols = jnp.arange(key.shape[-3])[None, :]
        band = (cols >= rows - window[0]) & (cols <= rows + window[1])
        mask = band if mask is None else jnp.logical_and(mask, band)
    if segment_ids is not None:
        q_ids, kv_ids = segment_ids
        same = (q_ids[..., :, None] == kv_ids[..., None, :])[..., None, :, :]
        mask = same if mask is None else jnp.logical_and(mask, same)
    return mask


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
    local_window_size=None,
    q_segment_ids=None,
    kv_segment_ids=None,
):
    """Drop-in attention_fn for flax.linen and flax.nnx attention layers.

    jflash runs when there is no bias or mask, no active dropout (dropout_rate 0
    or deterministic), no sown weights (module None), no custom einsums, a
    precision that jflash maps to its kernels, and the kernels take q, k, v
    (float16, bfloat16 or float32 after promotion, head dim <= 256); otherwise
    Flax's own dot_product_attention runs (linen's for a linen module, nnx's for
    an nnx one; without a module, nnx's when is_causal is passed). q, k and v
    must have the same batch dims (ValueError, as in Flax). The softmax always
    runs in float32, so force_fp32_for_softmax needs nothing.

    precision (Flax's layers pass their own): None (jax_default_matmul_precision),
    a jax.lax.Precision, one of its names or a pair of these run on the kernels at
    that precision (float32 on GPU: TF32 at DEFAULT and HIGH, 3xTF32 at HIGHEST;
    see jflash.flash_attention); anything else (a jax.lax.DotAlgorithm or
    DotAlgorithmPreset, also as jax_default_matmul_precision) goes to Flax's
    function.

    Causal attention: nnx passes is_causal itself (MultiHeadAttention(...)(x,
    is_causal=True)); with linen, bind it, attention_fn=functools.partial(
    jflash.flax.attention_fn, is_causal=True), and pass no mask. A mask array
    (e.g. nn.make_causal_mask) cannot be read at trace time, so it always falls
    back, correct but not fast.

    jflash keywords (Flax's layers do not pass them: bind them with
    functools.partial), the same in both paths:
      local_window_size: None, an int, or (left, right): query i sees keys
        i - left ... i + right (jax.nn.dot_product_attention's convention), on
        top of is_causal and mask.
      q_segment_ids [batch..., length_q], kv_segment_ids [batch..., length_kv]:
        integer ids, both or neither: query i sees key j only where their ids
        are equal (packed documents). Where Flax's function runs, the window and
        the ids become part of its mask. A row that sees no key gets the mean of
        the values there and on the kernels (jax's and Flax's answer).
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
    window = _window_pair(local_window_size)
    segment_ids = _segment_ids(query, key, q_segment_ids, kv_segment_ids)
    custom_einsums = qk_attn_weights_einsum is not None or attn_weights_value_einsum is not None
    dropout = dropout_rate > 0.0 and not deterministic
    if (
        bias is not None
        or mask is not None
        or dropout
        or module is not None
        or custom_einsums
        or not _kernels_take_precision(precision)
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
            mask=_extension_mask(query, key, mask, window, segment_ids),
            is_causal=is_causal,
            module=module,
            linen_only=linen_only,
            **kwargs,
        )

    if dtype is not None:  # as Flax's promote_dtype does
        query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
    return attend(
        query, key, value, is_causal=bool(is_causal), local_window_size=window,
        implementation=None, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
        precision=precision,
    )


def _kernels_take_precision(precision):
    """Whether jflash maps precision (None: jax_default_matmul_precision) to its
    kernels (validation.check_precision); Flax's function takes the rest."""
    try:
        validation.check_precision(precision)
    except ValueError:
        return False
    return True


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


def attend(query, key, value, *, is_causal, local_window_size, implementation, softcap=None,
           q_segment_ids=None, kv_segment_ids=None, precision=None):
    """jflash.dot_product_attention on [batch..., length, heads, head_dim] arrays,
    q/k/v promoted to their common dtype first as Flax does; segment ids
    [batch..., length_q] and [batch..., length_kv], or None; precision: None
    (jax_default_matmul_precision) or a value validation.check_precision takes,
    for the kernels and for jax's function where it runs."""
    _check_batch_dims(query, key, value)
    _window_pair(local_window_size)
    segment_ids = _segment_ids(query, key, q_segment_ids, kv_segment_ids)
    if segment_ids is not None:
        segment_ids = [jnp.reshape(x, (-1, x.shape[-1])) for x in segment_ids]
    batch_shape = query.shape[:-3]
    query, key, value = (
        jnp.reshape(jnp.asarray(x, s.dtype), s.shape)
        for x, s in zip((query, key, value), _shapes_4d(query, key, value, None), strict=True)
    )
    out = attention(
        query,
        key,
        value,
        is_causal=is_causal,
        local_window_size=local_window_size,
        implementation=implementation,
        softcap=softcap,
        q_segment_ids=None if segment_ids is None else segment_ids[0],
        kv_segment_ids=None if segment_ids is None else segment_ids[1],
        precision=precision,
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

"""Plain-jnp attention with jflash's exact semantics, in float32.

The documentation of what the kernels compute, and the reference every test
compares against. It materializes the seq_q x seq_k score matrix: use it for
checking, not for speed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jflash._src import masks
from jflash._src.flash_attention import resolve_arguments


def attention_band(query, key, value, *, softmax_scale, diag_lo, diag_hi, dtype=jnp.float32):
    """(out, lse) with key j visible from query i iff diag_lo <= j - i <= diag_hi.

    dtype is the compute dtype: float32 gives the reference; the input's own
    dtype gives the "same-dtype plain computation" of FlashAttention's test rule.
    Fully masked rows give out 0, lse -inf and zero gradients (never NaN).
    """
    batch, seqlen_q, num_heads, _ = query.shape
    seqlen_k, num_heads_kv = key.shape[1], key.shape[2]
    diag_lo, diag_hi = masks.clamp_band(seqlen_q, seqlen_k, diag_lo, diag_hi)
    group = num_heads // num_heads_kv
    q = query.astype(dtype)
    k = jnp.repeat(key.astype(dtype), group, axis=2)  # kv head h // group serves query head h
    v = jnp.repeat(value.astype(dtype), group, axis=2)
    # HIGHEST: on GPU a float32 einsum otherwise runs in TF32, and the reference
    # would be no more exact than the kernels it judges.
    einsum = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)
    scores = einsum("bqhd,bkhd->bhqk", q, k) * jnp.asarray(softmax_scale, dtype)
    scores = jnp.where(masks.visible(seqlen_q, seqlen_k, diag_lo, diag_hi), scores, -jnp.inf)
    # The row max only stabilizes exp; it cancels, so no gradient flows through it.
    row_max = jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0)  # fully masked: -inf - -inf = NaN
    p = jnp.exp(scores - row_max)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    seen = denom > 0
    safe_denom = jnp.where(seen, denom, 1)
    out = einsum("bhqk,bkhd->bqhd", p / safe_denom, v)
    lse = jnp.where(seen, jnp.log(safe_denom) + row_max, -jnp.inf)[..., 0]
    return out.astype(query.dtype), lse.astype(jnp.float32)


def attention(query, key, value, *, causal=False, softmax_scale=None, return_lse=False,
              window_size=None):
    """Same signature and semantics as jflash.flash_attention, in plain jnp."""
    softmax_scale, diag_lo, diag_hi, return_lse = resolve_arguments(
        query, key, value, causal, softmax_scale, return_lse, window_size
    )
    out, lse = attention_band(
        query, key, value, softmax_scale=softmax_scale, diag_lo=diag_lo, diag_hi=diag_hi
    )
    return (out, lse) if return_lse else out

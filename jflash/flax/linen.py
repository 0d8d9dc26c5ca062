"""A flax.linen multi-head attention layer on jflash kernels."""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from jflash.flax._attention_fn import attend, attend_with_cache, resolve_segment_ids


class MultiHeadAttention(nn.Module):
    """Multi-head attention: like flax.linen.MultiHeadDotProductAttention, with
    jflash attention, GQA and a built-in causal / local-window mask.

    Parameters are named and shaped like Flax's layer ("query", "key", "value",
    "out" DenseGeneral), so with num_kv_heads == num_heads its variables load
    into flax.linen.MultiHeadDotProductAttention and back. No dropout on the
    attention weights.

    decode=True (self-attention only), as in Flax: the "cache" collection holds
    cached_key and cached_value [batch..., max_length, num_kv_heads, head_dim]
    and cache_index. The call that creates them (model.init with inputs of
    max_length tokens) sizes the cache and attends as without decode; each later
    call appends its tokens at cache_index (any number of them: a prompt, then
    one token per step) and attends over the cache with
    jflash.flash_attention_with_kvcache, is_causal and the window in the
    tokens' absolute positions (implementation does not apply there). Tokens
    past max_length overwrite the cache's last rows.

    Packed training: __call__(x, segment_ids=ids) with integer ids
    [batch..., length], one per document packed into the row: a token attends
    only to tokens of its own document, on top of is_causal and the local
    window (which stay in the row's positions, so each causal document gets
    what it would alone). Cross-attention takes q_segment_ids and
    kv_segment_ids instead. Not with decode steps.

    Attributes:
      num_heads: query heads.
      num_kv_heads: key/value heads (GQA / MQA); num_heads must be a multiple.
        Default num_heads.
      qkv_features: width of the q/k/v projections over all query heads
        (head_dim = qkv_features // num_heads). Default: the input width.
      out_features: output width. Default: the input width.
      is_causal: top-left causal mask (query i sees keys j <= i).
      local_window_size: None, an int, or (left, right): query i sees keys
        i - left ... i + right (jax.nn.dot_product_attention's convention).
      implementation: passed to jflash.dot_product_attention (None, "jflash",
        "xla", "cudnn").
      decode: run as one step of autoregressive decoding with a KV cache (above).
      softcap: None, or c > 0: the logits become c * tanh(logits / c) (Gemma 2's
        attention logit soft-capping; on jflash's kernels only).
      precision: as Flax's layer's: the precision of the projections and of the
        attention (jflash.flash_attention's precision: float32 on GPU runs TF32
        at None/DEFAULT/HIGH, 3xTF32 at HIGHEST); not of decode steps
        (jflash.flash_attention_with_kvcache has one precision per dtype).
    """

    num_heads: int
    num_kv_heads: int | None = None
    qkv_features: int | None = None
    out_features: int | None = None
    dtype: Any = None
    param_dtype: Any = jnp.float32
    use_bias: bool = True
    kernel_init: Any = nn.initializers.lecun_normal()
    bias_init: Any = nn.initializers.zeros_init()
    is_causal: bool = False
    local_window_size: int | tuple[int, int] | None = None
    implementation: str | None = None
    decode: bool = False
    softcap: float | None = None
    precision: Any = None

    @nn.compact
    def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, segment_ids=None,
                 q_segment_ids=None, kv_segment_ids=None):
        """inputs_q [batch..., length_q, features]; inputs_k and inputs_v
        [batch..., length_kv, features_kv], default inputs_q (self-attention).

        segment_ids [batch..., length] (self-attention), or q_segment_ids
        [batch..., length_q] and kv_segment_ids [batch..., length_kv]: integer
        document ids; query i sees key j only where their ids are equal."""
        q_segment_ids, kv_segment_ids = resolve_segment_ids(
            segment_ids, q_segment_ids, kv_segment_ids, cross_attention=inputs_k is not None
        )
        if self.decode and q_segment_ids is not None:
            raise ValueError("segment ids are not supported with decode=True (a KV cache holds "
                             "one sequence per batch entry)")
        inputs_k = inputs_q if inputs_k is None else inputs_k
        inputs_v = inputs_k if inputs_v is None else inputs_v
        num_kv_heads = self.num_kv_heads or self.num_heads
        if self.num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({num_kv_heads})"
            )
        qkv_features = self.qkv_features or inputs_q.shape[-1]
        if qkv_features % self.num_heads != 0:
            raise ValueError(
                f"qkv_features ({qkv_features}) must be a multiple of num_heads ({self.num_heads})"
            )
        head_dim = qkv_features // self.num_heads
        dense = functools.partial(
            nn.DenseGeneral,
            axis=-1,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=self.kernel_init,
            bias_init=self.bias_init,
            use_bias=self.use_bias,
            precision=self.precision,
        )
        query = dense(features=(self.num_heads, head_dim), name="query")(inputs_q)
        key = dense(features=(num_kv_heads, head_dim), name="key")(inputs_k)
        value = dense(features=(num_kv_heads, head_dim), name="value")(inputs_v)
        cache = self._cache(inputs_q, inputs_k, key) if self.decode else None
        if cache is not None:
            cached_key, cached_value, cache_index = cache
            x, cached_key.value, cached_value.value = attend_with_cache(
                query, key, value, cached_key.value, cached_value.value, cache_index.value,
                is_causal=self.is_causal, local_window_size=self.local_window_size,
                softcap=self.softcap,
            )
            cache_index.value = cache_index.value + key.shape[-3]
        else:
            x = attend(
                query,
                key,
                value,
                is_causal=self.is_causal,
                local_window_size=self.local_window_size,
                implementation=self.implementation,
                softcap=self.softcap,
                q_segment_ids=q_segment_ids,
                kv_segment_ids=kv_segment_ids,
                precision=self.precision,
            )
        return nn.DenseGeneral(
            features=self.out_features or inputs_q.shape[-1],
            axis=(-2, -1),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=self.kernel_init,
            bias_init=self.bias_init,
            use_bias=self.use_bias,
            precision=self.precision,
            name="out",
        )(x)

    def _cache(self, inputs_q, inputs_k, key):
        """The cache variables (declared as zeros shaped like this call's keys), or
        None when this call declares them (it then attends as without decode)."""
        if inputs_k is not inputs_q:
            raise ValueError("decode=True is for self-attention: pass inputs_q only")
        initialized = self.has_variable("cache", "cached_key")
        cache = (self.variable("cache", "cached_key", jnp.zeros, key.shape, key.dtype),
                 self.variable("cache", "cached_value", jnp.zeros, key.shape, key.dtype),
                 self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32)))
        return cache if initialized else None

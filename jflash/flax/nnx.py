"""A flax.nnx multi-head attention layer on jflash kernels."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import nnx

from jflash.flax._attention_fn import attend, attend_with_cache, resolve_segment_ids


class MultiHeadAttention(nnx.Module):
    """Multi-head attention: like flax.nnx.MultiHeadAttention, with jflash
    attention, GQA (num_kv_heads) and a built-in causal / local-window mask.

    Sub-modules query, key, value and out are nnx.LinearGeneral laid out as in
    flax.nnx.MultiHeadAttention, so parameters copy across. No dropout on the
    attention weights.

    Decoding, as in Flax: init_cache(input_shape) creates nnx.Cache state
    (cached_key, cached_value [batch..., max_length, num_kv_heads, head_dim] and
    cache_index); then each call with decode=True (self-attention only) appends
    its tokens at cache_index (a prompt, then one token per step) and attends
    over the cache with jflash.flash_attention_with_kvcache, is_causal and the
    window in the tokens' absolute positions. Tokens past max_length overwrite
    the cache's last rows.

    Packed training: layer(x, segment_ids=ids) with integer ids [batch...,
    length], one per document packed into the row: a token attends only to
    tokens of its own document, on top of is_causal and the local window
    (which stay in the row's positions, so each causal document gets what it
    would alone). Cross-attention takes q_segment_ids and kv_segment_ids
    instead. Not with decode steps.

    Args:
      num_heads: query heads.
      in_features: width of inputs_q (and of inputs_k/inputs_v unless
        in_kv_features is given).
      qkv_features: width of the q/k/v projections over all query heads
        (head_dim = qkv_features // num_heads). Default in_features.
      out_features: output width. Default in_features.
      num_kv_heads: key/value heads (GQA / MQA). Default num_heads.
      is_causal: top-left causal mask (query i sees keys j <= i).
      local_window_size: None, an int, or (left, right): query i sees keys
        i - left ... i + right.
      implementation: passed to jflash.dot_product_attention (not to decode steps).
      decode: the default of __call__'s decode.
      softcap: None, or c > 0: the logits become c * tanh(logits / c) (on
        jflash's kernels only).
      precision: as Flax's layer's: the precision of the projections and of the
        attention (jflash.flash_attention's precision: float32 on GPU runs TF32
        at None/DEFAULT/HIGH, 3xTF32 at HIGHEST); not of decode steps
        (jflash.flash_attention_with_kvcache has one precision per dtype).
    """

    def __init__(
        self,
        num_heads: int,
        in_features: int,
        qkv_features: int | None = None,
        out_features: int | None = None,
        *,
        num_kv_heads: int | None = None,
        in_kv_features: int | None = None,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        use_bias: bool = True,
        kernel_init: Any = nnx.initializers.lecun_normal(),
        bias_init: Any = nnx.initializers.zeros_init(),
        is_causal: bool = False,
        local_window_size: int | tuple[int, int] | None = None,
        implementation: str | None = None,
        decode: bool = False,
        softcap: float | None = None,
        precision: Any = None,
        rngs: nnx.Rngs,
    ):
        qkv_features = qkv_features or in_features
        num_kv_heads = num_kv_heads or num_heads
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        if qkv_features % num_heads != 0:
            raise ValueError(
                f"qkv_features ({qkv_features}) must be a multiple of num_heads ({num_heads})"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = qkv_features // num_heads
        self.is_causal = is_causal
        self.local_window_size = local_window_size
        self.implementation = implementation
        self.decode = decode
        # Cache state once init_cache runs; data (not static) attributes, so that
        # the nnx.Cache variables it assigns later are part of the module's state.
        self.cached_key = nnx.data(None)
        self.cached_value = nnx.data(None)
        self.cache_index = nnx.data(None)
        self.softcap = softcap
        self.precision = precision

        def linear(in_features, out_features, **kw):
            return nnx.LinearGeneral(
                in_features,
                out_features,
                dtype=dtype,
                param_dtype=param_dtype,
                kernel_init=kernel_init,
                bias_init=bias_init,
                use_bias=use_bias,
                precision=precision,
                rngs=rngs,
                **kw,
            )

        in_kv_features = in_kv_features or in_features
        self.query = linear(in_features, (num_heads, self.head_dim))
        self.key = linear(in_kv_features, (num_kv_heads, self.head_dim))
        self.value = linear(in_kv_features, (num_kv_heads, self.head_dim))
        self.out = linear((num_heads, self.head_dim), out_features or in_features, axis=(-2, -1))

    def init_cache(self, input_shape, dtype=jnp.float32):
        """Creates the decode cache for inputs of input_shape [batch..., max_length,
        in_features] (the longest sequence it will hold), in dtype."""
        shape = (*input_shape[:-1], self.num_kv_heads, self.head_dim)
        self.cached_key = nnx.Cache(jnp.zeros(shape, dtype))
        self.cached_value = nnx.Cache(jnp.zeros(shape, dtype))
        self.cache_index = nnx.Cache(jnp.array(0, jnp.int32))

    def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, decode=None, segment_ids=None,
                 q_segment_ids=None, kv_segment_ids=None):
        """inputs_q [batch..., length_q, in_features]; inputs_k and inputs_v
        [batch..., length_kv, in_kv_features], default inputs_q (self-attention).
        decode (default: the layer's): a decode step over the cache (init_cache).
        segment_ids [batch..., length] (self-attention), or q_segment_ids
        [batch..., length_q] and kv_segment_ids [batch..., length_kv]: integer
        document ids; query i sees key j only where their ids are equal."""
        decode = self.decode if decode is None else decode
        q_segment_ids, kv_segment_ids = resolve_segment_ids(
            segment_ids, q_segment_ids, kv_segment_ids, cross_attention=inputs_k is not None
        )
        if decode and q_segment_ids is not None:
            raise ValueError("segment ids are not supported with decode=True (a KV cache holds "
                             "one sequence per batch entry)")
        if decode and (inputs_k is not None or inputs_v is not None):
            raise ValueError("decode=True is for self-attention: pass inputs_q only")
        if decode and self.cached_key is None:
            raise ValueError("decode=True needs a cache: call init_cache(input_shape) first")
        inputs_k = inputs_q if inputs_k is None else inputs_k
        inputs_v = inputs_k if inputs_v is None else inputs_v
        query, key, value = self.query(inputs_q), self.key(inputs_k), self.value(inputs_v)
        if decode:
            x, cached_key, cached_value = attend_with_cache(
                query, key, value, self.cached_key.get_value(), self.cached_value.get_value(),
                self.cache_index.get_value(), is_causal=self.is_causal,
                local_window_size=self.local_window_size, softcap=self.softcap,
            )
            self.cached_key.set_value(cached_key)
            self.cached_value.set_value(cached_value)
            self.cache_index.set_value(self.cache_index.get_value() + key.shape[-3])
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
        return self.out(x)

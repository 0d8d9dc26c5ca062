"""A flax.nnx multi-head attention layer on jflash kernels."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import nnx

from jflash.flax._attention_fn import attend


class MultiHeadAttention(nnx.Module):
    """Multi-head attention: like flax.nnx.MultiHeadAttention, with jflash
    attention, GQA (num_kv_heads) and a built-in causal / local-window mask.

    Sub-modules query, key, value and out are nnx.LinearGeneral laid out as in
    flax.nnx.MultiHeadAttention, so parameters copy across. No dropout on the
    attention weights and no decode cache.

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
      implementation: passed to jflash.dot_product_attention.
      softcap: None, or c > 0: the logits become c * tanh(logits / c) (on
        jflash's kernels only).
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
        softcap: float | None = None,
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
        self.softcap = softcap

        def linear(in_features, out_features, **kw):
            return nnx.LinearGeneral(
                in_features,
                out_features,
                dtype=dtype,
                param_dtype=param_dtype,
                kernel_init=kernel_init,
                bias_init=bias_init,
                use_bias=use_bias,
                rngs=rngs,
                **kw,
            )

        in_kv_features = in_kv_features or in_features
        self.query = linear(in_features, (num_heads, self.head_dim))
        self.key = linear(in_kv_features, (num_kv_heads, self.head_dim))
        self.value = linear(in_kv_features, (num_kv_heads, self.head_dim))
        self.out = linear((num_heads, self.head_dim), out_features or in_features, axis=(-2, -1))

    def __call__(self, inputs_q, inputs_k=None, inputs_v=None):
        """inputs_q [batch..., length_q, in_features]; inputs_k and inputs_v
        [batch..., length_kv, in_kv_features], default inputs_q (self-attention)."""
        inputs_k = inputs_q if inputs_k is None else inputs_k
        inputs_v = inputs_k if inputs_v is None else inputs_v
        x = attend(
            self.query(inputs_q),
            self.key(inputs_k),
            self.value(inputs_v),
            is_causal=self.is_causal,
            local_window_size=self.local_window_size,
            implementation=self.implementation,
            softcap=self.softcap,
        )
        return self.out(x)

"""A flax.linen multi-head attention layer on jflash kernels."""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from jflash.flax._attention_fn import attend


class MultiHeadAttention(nn.Module):
    """Multi-head attention: like flax.linen.MultiHeadDotProductAttention, with
    jflash attention, GQA and a built-in causal / local-window mask.

    Parameters are named and shaped like Flax's layer ("query", "key", "value",
    "out" DenseGeneral), so with num_kv_heads == num_heads its variables load
    into flax.linen.MultiHeadDotProductAttention and back. No dropout on the
    attention weights and no decode cache.

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
      softcap: None, or c > 0: the logits become c * tanh(logits / c) (Gemma 2's
        attention logit soft-capping; on jflash's kernels only).
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
    softcap: float | None = None

    @nn.compact
    def __call__(self, inputs_q, inputs_k=None, inputs_v=None):
        """inputs_q [batch..., length_q, features]; inputs_k and inputs_v
        [batch..., length_kv, features_kv], default inputs_q (self-attention)."""
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
        )
        query = dense(features=(self.num_heads, head_dim), name="query")(inputs_q)
        key = dense(features=(num_kv_heads, head_dim), name="key")(inputs_k)
        value = dense(features=(num_kv_heads, head_dim), name="value")(inputs_v)
        x = attend(
            query,
            key,
            value,
            is_causal=self.is_causal,
            local_window_size=self.local_window_size,
            implementation=self.implementation,
            softcap=self.softcap,
        )
        return nn.DenseGeneral(
            features=self.out_features or inputs_q.shape[-1],
            axis=(-2, -1),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=self.kernel_init,
            bias_init=self.bias_init,
            use_bias=self.use_bias,
            name="out",
        )(x)

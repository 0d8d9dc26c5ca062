"""The small decoder-only transformer of the examples (train_transformer.py,
generate.py): pre-norm blocks of jflash.flax.linen.MultiHeadAttention (causal,
GQA) and an MLP, learned position embeddings."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

import jflash.flax


class Block(nn.Module):
    num_heads: int
    num_kv_heads: int
    dtype: jnp.dtype
    implementation: str
    decode: bool = False  # attention over a KV cache, a step at a time

    @nn.compact
    def __call__(self, x):  # x [batch, seq, d_model]
        h = nn.LayerNorm(dtype=self.dtype)(x)
        x = x + jflash.flax.linen.MultiHeadAttention(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            is_causal=True,
            dtype=self.dtype,
            implementation=self.implementation,
            decode=self.decode,
        )(h)
        h = nn.LayerNorm(dtype=self.dtype)(x)
        h = nn.gelu(nn.Dense(4 * x.shape[-1], dtype=self.dtype)(h))
        return x + nn.Dense(x.shape[-1], dtype=self.dtype)(h)


class Transformer(nn.Module):
    vocab: int
    d_model: int
    layers: int
    num_heads: int
    num_kv_heads: int
    max_len: int
    dtype: jnp.dtype = jnp.float32
    implementation: str = "jflash"  # "jflash": never silently falls back
    decode: bool = False  # generate.py: the attention layers' decode mode

    @nn.compact
    def __call__(self, tokens, positions=None):  # tokens [batch, seq] -> logits [batch, seq, vocab]
        pos = self.param("pos", nn.initializers.normal(0.02), (self.max_len, self.d_model))
        # positions: the true position of each token (a permutation under the
        # zigzag layout of context parallelism; a decode step's place in the
        # sequence), natural order by default.
        pos = pos[: tokens.shape[1]] if positions is None else pos[positions]
        x = nn.Embed(self.vocab, self.d_model)(tokens) + pos
        for _ in range(self.layers):
            x = Block(self.num_heads, self.num_kv_heads, self.dtype, self.implementation,
                      self.decode)(x)
        x = nn.LayerNorm(dtype=self.dtype)(x)
        return nn.Dense(self.vocab, dtype=jnp.float32)(x)

"""Flax front ends for jflash (needs flax: pip install "jflash[flax]").

  attention_fn            plugs into Flax's own attention layers:
                          flax.linen.MultiHeadDotProductAttention(attention_fn=...)
                          flax.nnx.MultiHeadAttention(attention_fn=...)
  linen.MultiHeadAttention, nnx.MultiHeadAttention
                          q/k/v projections, jflash attention (causal, local
                          window, GQA through num_kv_heads, segment ids of
                          packed documents per call), output projection;
                          parameters laid out like Flax's layers; a decode mode
                          with a KV cache (flash_attention_with_kvcache).

`import jflash` never imports flax; `import jflash.flax` does.
"""

from jflash.flax import linen, nnx
from jflash.flax._attention_fn import attention_fn

__all__ = ["attention_fn", "linen", "nnx"]

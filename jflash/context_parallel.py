"""Context parallelism: attention over a sequence sharded across devices.

Under jax.jit, jflash.flash_attention (and jflash.dot_product_attention, the
Flax layers) run context-parallel when query/key/value are sharded along the
sequence; nothing to call. This module holds the controls and helpers:

  context_parallel_strategy("auto" | "ring" | "all_gather")   context manager
  sequence_layout("zigzag", axis_size) / ("contiguous")        context manager
  shard_sequence(x, axis_size, seq_axis=1), unshard_sequence(...)
      permute tokens into the causal load-balanced zigzag layout and back
  ring_attention(q, k, v, axis_name=..., causal=..., layout=..., strategy=...)
      the same computation for code written inside jax.shard_map
"""

from jflash._src.context_parallel import (
    LAYOUTS,
    STRATEGIES,
    choose_strategy,
    context_parallel_strategy,
    sequence_layout,
    shard_sequence,
    unshard_sequence,
)
from jflash._src.ring_attention import ring_attention

__all__ = [
    "LAYOUTS",
    "STRATEGIES",
    "choose_strategy",
    "context_parallel_strategy",
    "ring_attention",
    "sequence_layout",
    "shard_sequence",
    "unshard_sequence",
]

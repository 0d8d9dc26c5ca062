"""Small decode calls for compute-sanitizer (memcheck, racecheck).

  XLA_PYTHON_CLIENT_PREALLOCATE=false compute-sanitizer --tool memcheck \
      python3 -P tools/sanitizer_decode.py [--head-dims 64 128 256] [--dtypes bfloat16 float16]

Each case covers a part of csrc/cuda/flash_decode_sm80.h: contiguous and
paged caches (blocks of 16 and 256 rows) with the append, lengths that end
inside a tile, empty caches, block-table ids and cache lengths out of range
(clamped), both warp layouts (up to 16 rows per kv head, and several 64-row
blocks), one split and many (the combine kernel, with 1 to 8 warps per row),
and a window that leaves splits without a tile.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jflash

# (seqlens, capacity, seq_q, heads, heads_kv, block_size, seq_new, num_splits, window)
CASES = (
    ((77, 0, 130), 192, 1, 8, 2, None, 1, 1, None),
    ((77, 0, 130), 192, 1, 8, 2, 16, 1, 5, None),
    ((-3, 10**6), 512, 3, 8, 1, 256, 3, None, None),
    ((500, 31), 512, 16, 16, 2, 16, 16, 3, None),
    ((1000,), 1024, 1, 8, 8, None, 0, 16, (40, 0)),
    ((3000, 17), 3072, 2, 8, 2, None, 1, 70, None),  # 8 combine warps per row, two rounds
)


def run_case(rng, case, head_dim, dtype):
    seqlens, capacity, seq_q, heads, heads_kv, block_size, seq_new, num_splits, window = case
    batch = len(seqlens)
    if block_size is None:
        cache_shape, table = (batch, capacity, heads_kv, head_dim), None
    else:
        per_seq = capacity // block_size
        cache_shape = (batch * per_seq, block_size, heads_kv, head_dim)
        table = rng.permutation(batch * per_seq).reshape(batch, per_seq)
        table[0, 0] = 10**6  # clamped to the last block
        table = jnp.asarray(table, jnp.int32)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)  # noqa: E731
    kw = dict(cache_seqlens=jnp.asarray(seqlens, jnp.int32), block_table=table,
              num_splits=num_splits, window_size=window, return_lse=True)
    if seq_new:
        kw.update(k_new=normal(batch, seq_new, heads_kv, head_dim),
                  v_new=normal(batch, seq_new, heads_kv, head_dim))
    results = jax.jit(lambda q, kc, vc: jflash.flash_attention_with_kvcache(q, kc, vc, **kw))(
        normal(batch, seq_q, heads, head_dim), normal(*cache_shape), normal(*cache_shape))
    jax.block_until_ready(results)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=["bfloat16", "float16"])
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    for head_dim in args.head_dims:
        for dtype in args.dtypes:
            for case in CASES:
                run_case(rng, case, head_dim, jnp.dtype(dtype))
            print(f"decode head_dim {head_dim} {dtype}: {len(CASES)} cases")


if __name__ == "__main__":
    main()

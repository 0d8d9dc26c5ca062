"""The context-parallel forward's merge of a partial output (context_parallel.merge)
timed alone, at the shapes of benchmarks/context_parallel_chunks.py's default
64k grid (8 chunks: blocks of 8192 rows, 16 heads, head dim 128, float32 sum,
bfloat16 part), for all the block's rows and for its later half (the zigzag
steps whose source follows the device), in a jitted loop of dependent merges.
The later half is timed twice: updated in place in the block's array (the
ring's layout) and as an array of its own (a half's rows kept apart).

  python3 -P tools/cp_merge_time.py [--block 8192] [--heads 16] [--chunks 8]
"""

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import common  # noqa: E402
from jflash._src import context_parallel as cp  # noqa: E402


def time_merge(rows, block, heads, head_dim, iters=100):
    """Seconds per merge of `rows` rows into the last rows of a `block`-row sum."""
    f32 = jnp.float32
    keys = jax.random.split(jax.random.key(0), 4)
    out = jax.random.normal(keys[0], (1, block, heads, head_dim), f32)
    lse = jax.random.normal(keys[1], (1, heads, block), f32)
    part = (jax.random.normal(keys[2], (1, rows, heads, head_dim), jnp.bfloat16),
            jax.random.normal(keys[3], (1, heads, rows), f32))
    r0 = block - rows

    @jax.jit
    def loop(out, lse, part):
        def body(i, acc):
            out, lse = acc
            o, l_ = cp.merge((out[:, r0:], lse[..., r0:]), (part[0], part[1] + i * 1e-6))
            return out.at[:, r0:].set(o), lse.at[..., r0:].set(l_)

        return jax.lax.fori_loop(0, iters, body, (out, lse))

    return common.time_loop(loop, (out, lse, part), iterations=iters, min_repeats=5,
                            max_repeats=5)["median_s"]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--block", type=int, default=8192)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--chunks", type=int, default=8, help="ring devices the chunks benchmark simulates")
    args = p.parse_args()
    n = args.chunks
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
    b = args.block
    times = {}
    # All rows; the later half in place in the block's array, and apart.
    for rows, into in ((b, b), (b // 2, b), (b // 2, b // 2)):
        s = times[rows, into] = time_merge(rows, into, args.heads, args.head_dim)
        mb = rows * args.heads * args.head_dim * (4 + 2 + 4) / 1e6  # sum in and out, part
        print(f"merge of {rows} rows into {into}: {s * 1e6:.1f} us ({mb:.0f} MB, {mb / s / 1e3:.0f} GB/s)")
    full, half = times[b, b], times[b // 2, b]
    # After step 0 every device merges n - 1 parts; in the zigzag layout device
    # i's first i are all rows, the rest the later half.
    pairs = n * (n - 1) // 2
    print(f"{n} devices' merges: causal zigzag {pairs} + {pairs} = {(pairs * (full + half)) * 1e3:.2f} ms, "
          f"unmasked {2 * pairs} = {2 * pairs * full * 1e3:.2f} ms")


if __name__ == "__main__":
    main()

"""Per-kernel GPU time of a decode step, jflash beside jax's cuDNN attention, from a
`jax.profiler` trace of benchmarks/decode_benchmark.py's timed loop (same shapes:
bfloat16, head dim 128, 64 query heads over 8 kv heads, one token, the cache rotated
over copies so that it is read from HBM).

decode_benchmark gives a call's time; this says which kernels make it up (the main
kernel, the split combine, XLA's fusion that feeds a sliver of each output into the
next call's query) and how much of a call is gaps between kernels: "span" is the
time from the first kernel's start to the last one's end over the traced calls,
divided by the calls; kernel times that sum to less than it mean gaps.

  python3 -P tools/decode_kernel_times.py --batches 1 8 --caches 8192 32768
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tools"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import decode_benchmark as db  # noqa: E402
from kernel_times import kernel_events, per_kernel, short_name  # noqa: E402


def trace_row(impl, batch, cache, args):
    key = jax.random.key(0)
    q, caches, k_new, v_new, table = db.row_tensors(key, batch, cache, "contiguous", args)
    keys = cache + 1 if impl == "jflash_append" else cache
    lengths = jnp.full((batch,), keys, jnp.int32)
    step = db.attention_call(impl, "contiguous", args, lengths, table)
    loop = db.decode_loop(step, len(caches), args.iterations)
    carry = (q, tuple(caches), k_new, v_new)
    jax.block_until_ready(loop(*carry))  # compile, warm up
    jax.block_until_ready(loop(*carry))
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            jax.block_until_ready(loop(*carry))
        events = kernel_events(trace_dir)
    calls = args.iterations * len(caches)
    per_name, span = per_kernel(events)
    # From each kernel's end to the next one's start (negative: they overlap),
    # by the pair of names: where a call's time goes between its kernels.
    gaps = collections.defaultdict(list)
    events = sorted(events, key=lambda e: e[1])
    for (a, sa, da), (b, sb, _) in zip(events, events[1:]):
        gaps[(a, b)].append(sb - (sa + da))
    return per_name, span, calls, gaps


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--caches", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--impls", nargs="+", default=["jflash", "cudnn"])
    parser.add_argument("--iterations", type=int, default=20, help="loop steps in the trace")
    parser.add_argument("--rotate-mb", type=int, default=256)
    args = parser.parse_args()
    args.heads, args.kv_heads, args.head_dim, args.dtype = 64, 8, 128, "bfloat16"
    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}; bfloat16; "
          f"head dim 128, 64 query heads over 8 kv heads, one token")
    for batch in args.batches:
        for cache in args.caches:
            for impl in args.impls:
                try:
                    per_name, span, calls, gaps = trace_row(impl, batch, cache, args)
                except Exception as e:  # the peer may be unavailable; say so and go on
                    print(f"== {impl} B{batch} {cache}: {type(e).__name__}: {str(e)[:300]}")
                    continue
                total = sum(t for _, t in per_name.values())
                print(f"== {impl} batch {batch} cache {cache}: kernels {total / calls / 1e3:.2f} "
                      f"us per call, span {span / calls / 1e3:.2f} us per call")
                for kname, (count, t) in sorted(per_name.items(), key=lambda kv: -kv[1][1]):
                    print(f"  {count / calls:5.1f} x {t / count / 1e3:7.2f} us  "
                          f"{short_name(kname)}")
                print("  gaps, from a kernel's end to the next one's start:")
                for (a, b), values in sorted(gaps.items(), key=lambda kv: -len(kv[1]))[:6]:
                    if len(values) < calls // 2:
                        continue
                    print(f"  {len(values) / calls:5.1f} x {sum(values) / len(values) / 1e3:7.2f} us  "
                          f"{short_name(a, 40)} -> {short_name(b, 40)}")
        sys.stdout.flush()


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    main()

"""Per-kernel GPU time of benchmarks/context_parallel_chunks.py's chunks (the
kernel calls of n ring devices done one after the other on one GPU) beside
one flash_attention call on the whole sequence, from a `jax.profiler` trace of
tools/quick_bench.py's loop (kernel_times.profile): which kernels and XLA
fusions make up the chunks' extra time.

  python3 -P tools/cp_kernel_times.py --seq 65536 --causal yes --mode fwdbwd
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jflash  # noqa: E402
from context_parallel_chunks import chunked_attention, zigzag_layout  # noqa: E402
from kernel_times import profile, short_name  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=65536)
    p.add_argument("--causal", choices=("no", "yes"), default="yes")
    p.add_argument("--mode", choices=("fwd", "fwdbwd"), default="fwdbwd")
    p.add_argument("--chunks", type=int, default=8, help="ring devices simulated")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--steps", type=int, default=3, help="loop steps in the trace")
    p.add_argument("--top", type=int, default=30, help="kernels listed per implementation")
    args = p.parse_args()
    n, causal = args.chunks, args.causal == "yes"
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (1, args.seq, args.heads, args.head_dim), jnp.bfloat16)
    k, v = (jax.random.normal(key, (1, args.seq, args.kv_heads, args.head_dim), jnp.bfloat16)
            for key in keys[1:])
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
    impls = {
        # The chunks in the ring's layout, as the benchmark times them.
        "chunks": (chunked_attention(n, causal), [zigzag_layout(x, n, causal) for x in (q, k, v)]),
        "whole": (lambda q, k, v: jflash.flash_attention(q, k, v, causal=causal), [q, k, v]),
    }
    for name, (fn, inputs) in impls.items():
        per_name, span = profile(fn, args.mode, *inputs, args.steps)
        total = sum(ns for _, ns in per_name.values())
        print(f"== {name}: seq {args.seq}, causal {causal}, {args.mode}: "
              f"{span / args.steps / 1e6:.2f} ms per step, kernels {total / args.steps / 1e6:.2f} ms")
        for kernel, (launches, ns) in sorted(per_name.items(), key=lambda x: -x[1][1])[:args.top]:
            print(f"  {ns / args.steps / 1e3:9.1f} us  {launches / args.steps:6.1f}x  "
                  f"{short_name(kernel, 110)}")


if __name__ == "__main__":
    main()

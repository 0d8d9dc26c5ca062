"""Quick GPU timing of jflash against jax's cuDNN attention (the peer), bfloat16 (--dtype).

Benchmark convention (benchmarks/common.py): batch * seq = 16384 tokens,
heads * head_dim = 2048 (--group: query heads per kv head); TFLOP/s forward = 4 B H S S D / t (halved for causal),
forward+backward = 3.5x that count. Each timed call is one jitted lax.fori_loop
of `iterations` steps that feeds its output back as the next query, so the work
stays on the device; median of `repeats` calls.

  python3 -P tools/quick_bench.py --head-dims 64 128 256 --seqs 4096 16384
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jflash


def make_loop(attn, mode, iterations):
    def fwd_step(_, carry):
        q, k, v = carry
        return attn(q, k, v).astype(q.dtype), k, v

    def fwdbwd_step(_, carry):
        q, k, v = carry

        def loss(q, k, v):
            return jnp.sum(attn(q, k, v).astype(jnp.float32))

        dq, dk, dv = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
        # Feed every gradient back so that none of the work is dead code.
        return (dq * 1e-3).astype(q.dtype), k + (dk * 1e-6).astype(k.dtype), v + (dv * 1e-6).astype(v.dtype)

    step = fwd_step if mode == "fwd" else fwdbwd_step
    return jax.jit(lambda q, k, v: jax.lax.fori_loop(0, iterations, step, (q, k, v)))


def time_impl(attn, mode, q, k, v, iterations, repeats):
    loop = make_loop(attn, mode, iterations)
    jax.block_until_ready(loop(q, k, v))  # compile + warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(loop(q, k, v))
        times.append((time.perf_counter() - start) / iterations)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128])
    parser.add_argument("--seqs", type=int, nargs="+", default=[16384])
    parser.add_argument("--causal", choices=("no", "yes", "both"), default="no")
    parser.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd"])
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--impls", nargs="+", default=["jflash", "cudnn"])
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--group", type=int, default=1,
                        help="query heads per kv head (GQA/MQA); 1: MHA")
    parser.add_argument("--softcap", type=float, default=50.0,
                        help="the cap of the jflash_softcap impl")
    args = parser.parse_args()
    print(f"device: {jax.devices()[0].device_kind}, {args.dtype}, {args.group} query heads per kv head")
    header = "".join(f" {name + ' ms':>10} {'TFLOP/s':>8}" for name in args.impls)
    print(f"{'mode':7} {'causal':6} {'hdim':>4} {'seq':>6}" + header)
    rng = np.random.default_rng(0)
    causals = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    for d in args.head_dims:
        for s in args.seqs:
            b, h = 16384 // s, 2048 // d
            if h % args.group:
                parser.error(f"--group {args.group} does not divide {h} heads at head dim {d}")
            q = jnp.asarray(rng.standard_normal((b, s, h, d)), args.dtype)
            k, v = (jnp.asarray(rng.standard_normal((b, s, h // args.group, d)), args.dtype)
                    for _ in range(2))
            for causal in causals:
                flops = 4 * b * h * s * s * d / (2 if causal else 1)
                impls = {
                    "jflash": lambda q, k, v, c=causal: jflash.flash_attention(q, k, v, causal=c),
                    "jflash_det": lambda q, k, v, c=causal: jflash.flash_attention(
                        q, k, v, causal=c, deterministic=True),
                    "jflash_softcap": lambda q, k, v, c=causal: jflash.flash_attention(
                        q, k, v, causal=c, softcap=args.softcap),
                    "cudnn": lambda q, k, v, c=causal: jax.nn.dot_product_attention(
                        q, k, v, is_causal=c, implementation="cudnn"),
                }
                impls = {name: impls[name] for name in args.impls}
                for mode in args.modes:
                    f = flops * (3.5 if mode == "fwdbwd" else 1.0)
                    row = []
                    for name, attn in impls.items():
                        try:
                            t = time_impl(attn, mode, q, k, v, args.iterations, args.repeats)
                            row += [f"{t * 1e3:10.3f}", f"{f / t / 1e12:8.1f}"]
                        except Exception as e:  # the peer may be unavailable; say so and go on
                            row += [f"{'error':>10}", f"{'-':>8}"]
                            print(f"  {name}: {type(e).__name__}: {str(e)[:200]}")
                    print(f"{mode:7} {str(causal):6} {d:4d} {s:6d} " + " ".join(row), flush=True)


if __name__ == "__main__":
    main()

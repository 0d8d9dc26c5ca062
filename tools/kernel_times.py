"""Per-kernel GPU time of one forward or forward+backward step, jflash beside
jax's cuDNN attention, from a `jax.profiler` trace of the same timed loop that
tools/quick_bench.py runs (B * S = 16384, H * D = 2048, bfloat16).

quick_bench gives a step's time; this says which kernels make it up: the main
kernels, the small ones around them (delta, dQ zeroing and conversion) and
XLA's own fusions (the loop's feedback of the gradients, which both
implementations pay alike). Per kernel name: launches per step, device time
per step, and the share of the step's summed kernel time. "span" is the time
from the first kernel's start to the last one's end per step, over the traced
steps; kernel times that sum to less than it mean gaps between launches.
`--impls` also takes jflash_det (deterministic), jflash_ids (segment ids, one
per row), jflash_packed (the batch as documents of one row, segment ids) and
jflash_varlen (the same as sequences of flash_attention_varlen).

  python3 -P tools/kernel_times.py --head-dim 128 --seq 4096 --causal yes
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from quick_bench import make_loop  # noqa: E402

import jflash  # noqa: E402


def kernel_events(trace_dir):
    """(name, start_ns, duration_ns) of every kernel on the first GPU's streams."""
    from jax.profiler import ProfileData

    files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not files:
        raise RuntimeError(f"no xplane.pb under {trace_dir}")
    data = ProfileData.from_file(files[0])
    plane = data.find_plane_with_name("/device:GPU:0")
    if plane is None:
        names = [p.name for p in data.planes]
        raise RuntimeError(f"no /device:GPU:0 plane in the trace (planes: {names})")
    events = []
    for line in plane.lines:
        # Kernels and copies sit on the stream lines; the "XLA Ops" / "XLA
        # Modules" lines repeat the same time under HLO names.
        if not line.name.startswith("Stream"):
            continue
        for e in line.events:
            events.append((e.name, e.start_ns, e.duration_ns))
    return events


def short_name(name, width=90):
    name = name.replace("void ", "")
    return name if len(name) <= width else name[: width - 3] + "..."


def per_kernel(events):
    """{name: [launches, summed ns]} of (name, start_ns, duration_ns) events, and
    their span: the first start to the last end."""
    per_name = collections.defaultdict(lambda: [0, 0.0])
    for name, _, dur in events:
        per_name[name][0] += 1
        per_name[name][1] += dur
    span = max(s + d for _, s, d in events) - min(s for _, s, _ in events)
    return per_name, span


def profile(attn, mode, q, k, v, steps):
    loop = make_loop(attn, mode, steps)
    jax.block_until_ready(loop(q, k, v))  # compile, warm up
    jax.block_until_ready(loop(q, k, v))
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            jax.block_until_ready(loop(q, k, v))
        events = kernel_events(trace_dir)
    if not events:
        raise RuntimeError("the trace holds no kernel on the GPU's streams")
    return per_kernel(events)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--causal", choices=("no", "yes"), default="no")
    parser.add_argument("--mode", choices=("fwd", "fwdbwd"), default="fwdbwd")
    parser.add_argument("--steps", type=int, default=10, help="loop steps in the trace")
    parser.add_argument("--impls", nargs="+", default=["jflash", "cudnn"])
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--no-trace", action="store_true",
                        help="run each loop once and trace nothing (for a profiler attached "
                             "from outside, e.g. ncu --launch-count 1)")
    args = parser.parse_args()
    d, s, causal = args.head_dim, args.seq, args.causal == "yes"
    b, h = 16384 // s, 2048 // d
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((b, s, h, d)), args.dtype) for _ in range(3))
    ids = jnp.zeros((b, s), jnp.int32)
    packed_ids = jnp.repeat(jnp.arange(b, dtype=jnp.int32), s)[None]
    cu = jnp.arange(b + 1, dtype=jnp.int32) * s

    def data(x, q):
        # x as data of the step (a function of q that XLA cannot fold), so that
        # the work the kernels' callers do on ids or cu_seqlens stays in the
        # trace, as in a training step whose ids come with the batch.
        return jnp.where(jnp.isnan(q[0, 0, 0, 0]), jnp.zeros_like(x), x)

    def varlen(q, k, v):
        cu_seqlens = data(cu, q)  # one array for both sides: the self-attention path
        return jflash.flash_attention_varlen(
            *(x.reshape(b * s, *x.shape[2:]) for x in (q, k, v)), cu_seqlens, cu_seqlens,
            max_seqlen_q=s, max_seqlen_k=s, causal=causal).reshape(q.shape)

    flops = 4 * b * h * s * s * d / (2 if causal else 1) * (3.5 if args.mode == "fwdbwd" else 1)
    impls = {
        "jflash": lambda q, k, v: jflash.flash_attention(q, k, v, causal=causal),
        "jflash_det": lambda q, k, v: jflash.flash_attention(q, k, v, causal=causal,
                                                            deterministic=True),
        "cudnn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                              implementation="cudnn"),
        # The segment-id kernels on the same work: one id per row (nothing
        # masked); the batch packed into one row of b documents; the same as
        # a varlen batch of b sequences.
        "jflash_ids": lambda q, k, v: jflash.flash_attention(
            q, k, v, causal=causal, q_segment_ids=data(ids, q), kv_segment_ids=data(ids, q)),
        "jflash_packed": lambda q, k, v: jflash.flash_attention(
            *(x.reshape(1, b * s, *x.shape[2:]) for x in (q, k, v)), causal=causal,
            q_segment_ids=data(packed_ids, q), kv_segment_ids=data(packed_ids, q)
        ).reshape(q.shape),
        "jflash_varlen": varlen,
    }
    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}; {args.dtype}; "
          f"{args.mode}; head dim {d}, seq {s}, batch {b}, heads {h}, causal {causal}; "
          + ("nothing traced (--no-trace)" if args.no_trace else f"{args.steps} steps traced"))
    for name in args.impls:
        if args.no_trace:
            jax.block_until_ready(make_loop(impls[name], args.mode, 1)(q, k, v))
            continue
        try:
            per_name, span = profile(impls[name], args.mode, q, k, v, args.steps)
        except Exception as e:  # the peer may be unavailable; say so and go on
            print(f"== {name}: {type(e).__name__}: {str(e)[:300]}")
            continue
        total = sum(t for _, t in per_name.values())
        print(f"== {name}: kernels {total / args.steps / 1e3:.1f} us per step "
              f"({flops / (total / args.steps * 1e-9) / 1e12:.1f} TFLOP/s on kernel time), "
              f"span {span / args.steps / 1e3:.1f} us per step")
        print(f"  {'launches':>8} {'us/step':>9} {'share':>6}  kernel")
        for kname, (count, t) in sorted(per_name.items(), key=lambda kv: -kv[1][1]):
            print(f"  {count / args.steps:8.1f} {t / args.steps / 1e3:9.1f} {t / total:6.1%}  "
                  f"{short_name(kname)}")


if __name__ == "__main__":
    main()

"""Packed documents (segment ids) against the same documents one by one.

A row of --seq tokens packs documents of --doc-len tokens (the same ids on
both sides, causal or not). jflash.flash_attention with q_segment_ids /
kv_segment_ids on [batch, seq] is timed against the documents as a batch of
their own, [batch * seq / doc_len, doc_len], which is the work the packed call
should cost about (its kernels skip the tiles between documents), and against
the packed row without ids (the whole row's work). Forward and
forward+backward, bfloat16, device-side timing (common.time_loop).

  python3 -P benchmarks/segments_benchmark.py --head-dims 64 128 --seq 8192 --doc-lens 512 2048
  python3 -P benchmarks/segments_benchmark.py --allow-cpu --seq 512 --doc-lens 64 --head-dims 64
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import common  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--doc-lens", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--tokens", type=int, default=16384, help="batch = tokens / seq")
    parser.add_argument("--model-dim", type=int, default=2048, help="heads = model_dim / head_dim")
    parser.add_argument("--causal", choices=("yes", "no"), default="yes")
    parser.add_argument("--modes", default="fwd,fwdbwd")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--allow-cpu", action="store_true", help="run without a GPU (logic test)")
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    import jflash

    platform = jax.default_backend()
    if platform != "gpu" and not args.allow_cpu:
        raise SystemExit("no GPU (pass --allow-cpu to run the logic on a CPU)")
    causal = args.causal == "yes"
    records, rows = [], []
    for head_dim in args.head_dims:
        heads = max(1, args.model_dim // head_dim)
        batch = max(1, args.tokens // args.seq)
        for doc_len in args.doc_lens:
            if args.seq % doc_len:
                raise SystemExit(f"--seq {args.seq} is not a multiple of --doc-len {doc_len}")
            ids = jnp.asarray(np.repeat(np.arange(args.seq // doc_len), doc_len)[None]
                              .repeat(batch, 0), jnp.int32)
            cases = {
                "packed": ((batch, args.seq), lambda q, k, v: jflash.flash_attention(
                    q, k, v, causal=causal, q_segment_ids=ids, kv_segment_ids=ids)),
                "separate": ((batch * args.seq // doc_len, doc_len),
                             lambda q, k, v: jflash.flash_attention(q, k, v, causal=causal)),
                "no ids": ((batch, args.seq),
                           lambda q, k, v: jflash.flash_attention(q, k, v, causal=causal)),
            }
            for mode in args.modes.split(","):
                times = {}
                for name, ((b, s), fn) in cases.items():
                    inputs = common.random_qkv(0, b, s, heads, head_dim, jnp.bfloat16)
                    loop = common.make_loop(fn, mode, args.iterations)
                    result = common.time_loop(loop, inputs, iterations=args.iterations)
                    times[name] = result["median_s"]
                record = dict(head_dim=head_dim, seq=args.seq, doc_len=doc_len, batch=batch,
                              heads=heads, causal=causal, mode=mode,
                              **{f"{n.replace(' ', '_')}_ms": t * 1e3 for n, t in times.items()})
                records.append(record)
                rows.append([head_dim, doc_len, mode] +
                            [common.fmt(times[n] * 1e3, 3) for n in cases] +
                            [common.fmt(times["packed"] / times["separate"], 2)])
    print(common.format_table(
        ["head_dim", "doc_len", "mode", "packed ms", "separate ms", "no ids ms",
         "packed / separate"], rows))
    if args.out:
        common.write_json(args.out, dict(environment=common.environment_record(),
                                         records=records))


if __name__ == "__main__":
    main()

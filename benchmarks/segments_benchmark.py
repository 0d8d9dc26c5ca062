"""Packed documents (segment ids) against the same documents one by one.

A row of --seq tokens packs documents of --doc-len tokens (the same ids on
both sides, causal or not). jflash.flash_attention with q_segment_ids /
kv_segment_ids on [batch, seq] is timed against the documents as a batch of
their own, [batch * seq / doc_len, doc_len], which is the work the packed call
should cost about (its kernels skip the tiles between documents), and against
the packed row without ids (the whole row's work). Forward and
forward+backward, bfloat16, device-side timing (common.time_loop).

--random-docs adds a row of documents of random lengths in [--doc-min,
--doc-max] (128 and 4096 by default; seeded by --seed, the same packing in every
batch row, the last document taking what is left), timed against the sum of
separate calls, one per distinct length (its documents as a batch). The
lengths go into the JSON record. The target is packed / separate <= 1.15.

  python3 -P benchmarks/segments_benchmark.py --head-dims 64 128 --seq 8192 --doc-lens 512 2048
  python3 -P benchmarks/segments_benchmark.py --head-dims 128 --seq 16384 --doc-lens 2048 --random-docs
  python3 -P benchmarks/segments_benchmark.py --allow-cpu --seq 512 --doc-lens 64 --head-dims 64
  python3 -P benchmarks/segments_benchmark.py --allow-cpu --seq 1024 --doc-lens --random-docs \
      --doc-min 64 --doc-max 256 --head-dims 64 --iterations 2
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import common  # noqa: E402


def random_lengths(seq, low, high, seed):
    """Document lengths in [low, high] that sum to seq: drawn at random while more
    than high tokens remain (each leaving at least low), the rest the last."""
    import numpy as np

    if not 1 <= low <= high or seq < low:
        raise SystemExit(f"need 1 <= --doc-min <= --doc-max and --seq >= --doc-min, got "
                         f"{low}, {high}, {seq}")
    rng = np.random.default_rng(seed)
    lengths, left = [], seq
    while left > high:
        lengths.append(int(rng.integers(low, min(high, left - low) + 1)))
        left -= lengths[-1]
    return lengths + [left]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--doc-lens", type=int, nargs="*", default=[256, 1024, 4096])
    parser.add_argument("--random-docs", action="store_true",
                        help="also documents of random lengths in [--doc-min, --doc-max]")
    parser.add_argument("--doc-min", type=int, default=128)
    parser.add_argument("--doc-max", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0, help="of the random lengths")
    parser.add_argument("--tokens", type=int, default=16384, help="batch = tokens / seq")
    parser.add_argument("--model-dim", type=int, default=2048, help="heads = model_dim / head_dim")
    parser.add_argument("--causal", choices=("yes", "no"), default="yes")
    parser.add_argument("--modes", default="fwd,fwdbwd")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--allow-cpu", action="store_true", help="run without a GPU (logic test)")
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)

    import jax.numpy as jnp
    import numpy as np

    import jflash

    common.require_gpu(parser, args.allow_cpu)
    causal = args.causal == "yes"
    packings = []  # (name in the table, document lengths)
    for doc_len in args.doc_lens:
        if args.seq % doc_len:
            raise SystemExit(f"--seq {args.seq} is not a multiple of --doc-len {doc_len}")
        packings.append((str(doc_len), [doc_len] * (args.seq // doc_len)))
    if args.random_docs:
        lengths = random_lengths(args.seq, args.doc_min, args.doc_max, args.seed)
        packings.append((f"random {len(lengths)}", lengths))
    if not packings:
        raise SystemExit("nothing to run: give --doc-lens or --random-docs")

    def attention(ids=None):
        return lambda q, k, v: jflash.flash_attention(q, k, v, causal=causal, q_segment_ids=ids,
                                                      kv_segment_ids=ids)

    def timed(mode, batch, seq, heads, head_dim, fn):
        inputs = common.random_qkv(0, batch, seq, heads, head_dim, jnp.bfloat16)
        loop = common.make_loop(fn, mode, args.iterations)
        return common.time_loop(loop, inputs, iterations=args.iterations)["median_s"]

    records, rows = [], []
    for head_dim in args.head_dims:
        heads = max(1, args.model_dim // head_dim)
        batch = max(1, args.tokens // args.seq)
        for name, lengths in packings:
            ids = jnp.asarray(np.repeat(np.arange(len(lengths)), lengths)[None].repeat(batch, 0),
                              jnp.int32)
            counts = {n: lengths.count(n) for n in sorted(set(lengths))}
            for mode in args.modes.split(","):
                times = {
                    "packed": timed(mode, batch, args.seq, heads, head_dim, attention(ids)),
                    # One call per distinct length, its documents as a batch.
                    "separate": sum(timed(mode, batch * count, n, heads, head_dim, attention())
                                    for n, count in counts.items()),
                    "no ids": timed(mode, batch, args.seq, heads, head_dim, attention()),
                }
                record = dict(head_dim=head_dim, seq=args.seq, batch=batch, heads=heads,
                              causal=causal, mode=mode, separate_calls=len(counts),
                              **{f"{n.replace(' ', '_')}_ms": t * 1e3 for n, t in times.items()})
                if len(counts) == 1:
                    record["doc_len"] = lengths[0]
                else:
                    record["doc_lens"] = lengths
                records.append(record)
                rows.append([head_dim, name, mode] +
                            [common.fmt(times[n] * 1e3, 3) for n in times] +
                            [common.fmt(times["packed"] / times["separate"], 2)])
    print(common.format_table(
        ["head_dim", "doc_len", "mode", "packed ms", "separate ms", "no ids ms",
         "packed / separate"], rows))
    for name, lengths in packings:
        if len(set(lengths)) > 1:
            print(f"{name}: document lengths {lengths}")
    if args.out:
        common.write_json(args.out, dict(environment=common.environment_record(),
                                         records=records))

if __name__ == "__main__":
    main()

"""jflash.flash_attention_varlen on a batch of sequences of random lengths.

--num-seqs sequences (32) of lengths drawn uniformly from [--min-len, --max-len]
(128 and 8192; seeded by --seed; rounded up to a multiple of --length-multiple),
bfloat16, --heads 16 of --head-dim 128, causal and not, forward and
forward+backward. Rows:

  jflash_varlen  flash_attention_varlen on the packed tokens [total, H, D], one
                 cu_seqlens array for both sides (self-attention);
  jflash_mean    flash_attention on a dense batch at the mean length: seq =
                 round(total / num_seqs), batch = round(total / seq), about the
                 same tokens. The work varlen should cost about: the target is
                 varlen / mean >= 0.90 in TFLOP/s;
  cudnn_padded   jax.nn.dot_product_attention(implementation="cudnn") on the
                 batch padded to the longest sequence, [num_seqs, max_len, H, D],
                 with query_seq_lengths / key_value_seq_lengths ('unavailable'
                 where jax or cuDNN rejects it, and on a CPU);
  jflash_padded  jflash.dot_product_attention on the same padded batch and
                 lengths.

TFLOP/s are of the useful FLOPs, counted exactly per sequence: the sum over
sequences of 4 * H * D * (visible pairs), the pairs L * L, or L * (L + 1) / 2
under causal (common.band_flops); fwd+bwd 3.5x fwd. The padded rows are
credited with the same useful FLOPs as varlen (the padding is wasted work);
jflash_mean with those of its own dense shape. Timing: common.make_loop /
time_loop (device-side loops of dependent calls, median of repeats); the
cu_seqlens and lengths are arguments of the timed program, not constants.

  python3 -P benchmarks/varlen_benchmark.py --out $OUT/varlen.json
  python3 -P benchmarks/varlen_benchmark.py --allow-cpu --num-seqs 3 --min-len 16 \
      --max-len 64 --heads 2 --head-dim 32
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import common  # noqa: E402

IMPLS = ("jflash_varlen", "jflash_mean", "cudnn_padded", "jflash_padded")
TARGET = 0.90  # varlen / mean, TFLOP/s
_ASSUMED_FLOPS_PER_S = {"gpu": 4e14, "cpu": 3e10}


def random_lengths(num_seqs, low, high, seed, multiple=1):
    """Lengths drawn uniformly from [low, high], each rounded up to a multiple."""
    import numpy as np

    if not 1 <= low <= high or num_seqs < 1 or multiple < 1:
        raise SystemExit(f"need --num-seqs >= 1, 1 <= --min-len <= --max-len and "
                         f"--length-multiple >= 1, got {num_seqs}, {low}, {high}, {multiple}")
    drawn = np.random.default_rng(seed).integers(low, high + 1, num_seqs)
    return [int(-(-n // multiple) * multiple) for n in drawn]


def useful_flops(lengths, heads, head_dim, causal, mode):
    """Sum over sequences of the FLOPs of their visible pairs (self-attention)."""
    hi = 0 if causal else None
    return sum(common.band_flops(1, n, n, heads, head_dim, hi=hi, mode=mode) for n in lengths)


def mean_shape(lengths):
    total = sum(lengths)
    seq = max(1, round(total / len(lengths)))
    return max(1, round(total / seq)), seq


def build_inputs(lengths, heads, head_dim, dtype, seed):
    """Packed [total, H, D] q, k, v, cotangent; the same tokens padded to
    [num_seqs, max_len, H, D] (zeros past each length); the dense batch at the
    mean length; cu_seqlens and lengths (int32)."""
    import jax.numpy as jnp
    import numpy as np

    total, longest = sum(lengths), max(lengths)
    packed = tuple(x[0] for x in common.random_qkv(seed, 1, total, heads, head_dim, dtype))
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    # Token t of sequence b goes to padded row b, position t.
    rows = np.repeat(np.arange(len(lengths)), lengths)
    cols = np.arange(total) - np.repeat(cu[:-1], lengths)
    padded = tuple(jnp.zeros((len(lengths), longest, heads, head_dim), dtype).at[rows, cols].set(x)
                   for x in packed)
    batch, seq = mean_shape(lengths)
    mean = common.random_qkv(seed + 1, batch, seq, heads, head_dim, dtype)
    return dict(packed=packed, padded=padded, mean=mean, cu=jnp.asarray(cu),
                lengths=jnp.asarray(lengths, jnp.int32), rows=rows, cols=cols)


def attention_fn(impl, causal, platform, longest):
    """(attention(q, k, v, *operands), which operands) of one row."""
    import jax

    import jflash

    if impl.startswith("jflash"):
        common.require_cuda_kernels(platform)
    if impl == "jflash_varlen":
        return (lambda q, k, v, cu: jflash.flash_attention_varlen(
            q, k, v, cu, cu, max_seqlen_q=longest, max_seqlen_k=longest, causal=causal)), "cu"
    if impl == "jflash_mean":
        return (lambda q, k, v: jflash.flash_attention(q, k, v, causal=causal)), None
    if impl == "jflash_padded":
        return (lambda q, k, v, n: jflash.dot_product_attention(
            q, k, v, is_causal=causal, query_seq_lengths=n, key_value_seq_lengths=n)), "lengths"
    if impl == "cudnn_padded":
        if platform != "gpu":
            raise common.Unavailable(f"cuDNN attention needs a CUDA GPU; running on {platform}")
        return (lambda q, k, v, n: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, query_seq_lengths=n, key_value_seq_lengths=n,
            implementation="cudnn")), "lengths"
    raise ValueError(f"unknown impl {impl!r}")


def check_error(impl, attention, inputs, lengths, causal):
    """Forward ||out - ref|| / ||ref|| on the first sequence, head 0, against
    common's float32 reference (top-left causal, which is bottom-right here)."""
    import jax
    import jax.numpy as jnp

    n = lengths[0]
    if impl == "jflash_varlen":
        q, k, v, _ = inputs["packed"]
        out = jax.jit(attention)(q, k, v, inputs["cu"])[:n]
        ref_in = [x[None, :n] for x in (q, k, v)]
    elif impl == "jflash_mean":
        q, k, v, _ = inputs["mean"]
        out = jax.jit(attention)(q[:1, :, :1], k[:1, :, :1], v[:1, :, :1])[0]
        ref_in = [x[:1] for x in (q, k, v)]
    else:
        q, k, v, _ = inputs["padded"]
        out = jax.jit(attention)(q, k, v, inputs["lengths"])[0, :n]
        ref_in = [x[:1, :n] for x in (q, k, v)]
    ref_in = [x[:, :, :1] for x in ref_in]
    ref = jax.jit(lambda q, k, v: common._reference_attention(q, k, v, causal))(*ref_in)[0]
    got = out[:, :1].astype(jnp.float32)
    return float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))


def run_one(impl, causal, mode, inputs, lengths, args, platform):
    heads, head_dim = args.heads, args.head_dim
    rec = dict(impl=impl, heads=heads, head_dim=head_dim, causal=causal, mode=mode,
               dtype=args.dtype, num_seqs=len(lengths), total_tokens=sum(lengths))
    if impl == "jflash_mean":
        batch, seq = mean_shape(lengths)
        rec.update(batch=batch, seq=seq)
        rec["flops"] = useful_flops([seq] * batch, heads, head_dim, causal, mode)
    else:
        rec["flops"] = useful_flops(lengths, heads, head_dim, causal, mode)
        if impl != "jflash_varlen":
            rec.update(batch=len(lengths), seq=max(lengths))
    try:
        try:
            attention, operand = attention_fn(impl, causal, platform, max(lengths))
            if args.check and mode == "fwd":
                rec["rel_err"] = check_error(impl, attention, inputs, lengths, causal)
        except common.Unavailable:
            raise
        except Exception as exc:
            if impl == "cudnn_padded":  # jax or cuDNN rejects padded lengths here
                raise common.Unavailable(f"{type(exc).__name__}: {exc}"[:600]) from exc
            raise
        data = {"jflash_varlen": "packed", "jflash_mean": "mean"}.get(impl, "padded")
        args_ = tuple(inputs[data]) + ((inputs[operand],) if operand else ())
        iterations = common.iterations_for(rec["flops"], _ASSUMED_FLOPS_PER_S[platform],
                                           args.target_ms / 1e3, hi=args.max_iterations)
        loop = common.make_loop(attention, mode, iterations)
        try:
            timing = common.time_loop(loop, args_, iterations=iterations, min_repeats=args.repeats,
                                      max_repeats=max(args.repeats, 30),
                                      min_total_s=args.min_total_s)
        except Exception as exc:
            if impl == "cudnn_padded":
                raise common.Unavailable(f"{type(exc).__name__}: {exc}"[:600]) from exc
            raise
        common.record_timing(rec, timing, iterations)
        rec["tflops"] = common.tflops(rec["flops"], timing["median_s"])
        rec["status"] = "ok"
    except Exception as exc:  # recorded; the other rows still run
        common.record_failure(rec, exc)
    return rec


def summary_table(records):
    """One line per (causal, mode): TFLOP/s of each row, varlen / mean (the
    target), varlen / cudnn."""
    cells = {}
    for r in records:
        cells.setdefault((r["causal"], r["mode"]), {})[r["impl"]] = r

    rows = []
    for (causal, mode), cell in cells.items():
        target = common.cell_ratio(cell, "jflash_varlen", "jflash_mean")
        rows.append(["yes" if causal else "no", mode] + [common.cell_rate(cell, i) for i in IMPLS] +
                    [common.fmt(target, 2),
                     None if target is None else ("yes" if target >= TARGET else "NO"),
                     common.fmt(common.cell_ratio(cell, "jflash_varlen", "cudnn_padded"), 2),
                     common.fmt(common.cell_ratio(cell, "jflash_varlen", "jflash_padded"), 2)])
    return common.format_table(
        ["causal", "mode", "varlen", "dense@mean", "cudnn padded", "jflash padded",
         "varlen/mean", f">= {TARGET:.2f}", "varlen/cudnn", "varlen/padded"], rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=128)
    parser.add_argument("--max-len", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0, help="of the lengths and the data")
    parser.add_argument("--length-multiple", type=int, default=1,
                        help="round each length up to a multiple of this (128: every sequence "
                             "starts and ends on a tile border of the head dim 128 kernels)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    parser.add_argument("--modes", default="fwd,fwdbwd", help="comma list of fwd,fwdbwd")
    parser.add_argument("--impls", default=",".join(IMPLS), help="comma list of " + ",".join(IMPLS))
    common.add_loop_args(parser)
    parser.add_argument("--check", action="store_true",
                        help="forward error of each row on its first sequence (head 0) against a "
                             "float32 reference")
    parser.add_argument("--allow-cpu", action="store_true", help="run without a GPU (logic test)")
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    impls = common.comma_list(parser, "--impls", args.impls, IMPLS)
    modes = common.comma_list(parser, "--modes", args.modes, common.MODES)
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    lengths = random_lengths(args.num_seqs, args.min_len, args.max_len, args.seed,
                             args.length_multiple)

    platform = common.require_gpu(parser, args.allow_cpu)

    started = time.perf_counter()
    env = common.environment_record()
    out = args.out or common.default_results_path("varlen", env["device_kind"])
    batch, seq = mean_shape(lengths)
    common.print_run_header(env, out)
    print(f"{len(lengths)} sequences, {sum(lengths)} tokens (longest {max(lengths)}, mean "
          f"{sum(lengths) / len(lengths):.1f}; dense at the mean: batch {batch} x seq {seq}): "
          f"{lengths}", flush=True)
    payload = dict(benchmark="varlen", environment=env,
                   args=common.args_record(args),
                   lengths=lengths, mean_shape=dict(batch=batch, seq=seq),
                   flop_convention="useful FLOPs: sum over sequences of 4*H*D*pairs, pairs L*L "
                                   "or L*(L+1)/2 causal; fwdbwd 3.5x fwd; padded rows credited "
                                   "with the varlen FLOPs",
                   target=f"jflash_varlen / jflash_mean TFLOP/s >= {TARGET}", records=[])
    inputs = build_inputs(lengths, args.heads, args.head_dim, args.dtype, args.seed)
    for causal in causals:
        for mode in modes:
            for impl in impls:
                rec = run_one(impl, causal, mode, inputs, lengths, args, platform)
                payload["records"].append(rec)
                common.write_json(out, payload)  # after every record: a killed run keeps its rows
                what = (f"{common.fmt_rate(rec['tflops']):>7s} TFLOP/s  "
                        f"{rec['median_s'] * 1e3:8.3f} ms  x{rec['iterations']}"
                        if rec["status"] == "ok" else f"{rec['status']}: {rec.get('note', '')[:160]}")
                print(f"[{time.perf_counter() - started:6.1f}s] {'causal' if causal else 'full  '} "
                      f"{mode:6s} {impl:13s} {what}", flush=True)

    print(f"\nresults: {out}")
    print(f"{env['device_kind']} | jax {env['jax_version']} | jflash {env['jflash_commit'][:12]} | "
          f"{args.dtype} | H{args.heads} D{args.head_dim} | {len(lengths)} seqs in "
          f"[{args.min_len}, {args.max_len}] seed {args.seed} | useful TFLOP/s (exact pairs, "
          f"fwd+bwd 3.5x)")
    print(summary_table(payload["records"]))


if __name__ == "__main__":
    main()

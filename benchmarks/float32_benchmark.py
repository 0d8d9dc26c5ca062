"""float32 attention at its two precisions: jflash's TF32 and 3xTF32 kernels against XLA.

float32 q, k, v, B*S = --tokens (16384) tokens, H*D = --model-dim (2048), on the
(head dim, seq) cells of --shapes (head dim 64 at seq 2k, 4k, 8k; 128 at 2k, 4k,
8k, 16k), causal and not, forward and forward+backward. Rows:

  jflash_tf32     jflash.flash_attention at the default precision (TF32 MMAs,
                  as XLA runs float32 dots at DEFAULT on GPU);
  jflash_3xtf32   jflash.flash_attention(precision="highest") (3xTF32: three
                  TF32 MMAs per product, float32-class accuracy);
  xla_default     jax.nn.dot_product_attention(implementation="xla") at the
                  default matmul precision;
  xla_highest     the same under jax.default_matmul_precision("highest")
                  (float32 dots, forward and backward).

TFLOP/s count the FlashAttention papers' FLOPs (common.py: forward 4*B*H*S*S*D,
halved for causal; forward+backward 3.5x), the same for every row: 3xTF32's
extra MMAs are not credited. XLA materializes the S x S float32 scores
(B*H*S*S*4 bytes, 17 GB at seq 16k), so its rows may run out of memory there:
such a row is recorded with status "error" and the message, and the others
still run. Timing: common.make_loop / time_loop (device-side loops of dependent
calls, median of repeats).

With --check (the default; --no-check skips it), each row's forward output on
batch 0, head 0 and the first --check-rows query rows is compared with float64
NumPy attention on the same float32 inputs: max |out - truth| (max_abs_err),
and that over max |truth| (rel_max_err).

  PYTHONUNBUFFERED=1 python3 -P benchmarks/float32_benchmark.py --out $OUT/float32.json
  python3 -P benchmarks/float32_benchmark.py --allow-cpu --shapes 32:128 --tokens 128 \
      --model-dim 64
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import common  # noqa: E402

IMPLS = ("jflash_tf32", "jflash_3xtf32", "xla_default", "xla_highest")
DEFAULT_SHAPES = "64:2048,64:4096,64:8192,128:2048,128:4096,128:8192,128:16384"
# A guess of each row's rate, for the loop length only (one repeat ~ --target-ms).
_ASSUMED_FLOPS_PER_S = {
    "gpu": {"jflash_tf32": 2e14, "jflash_3xtf32": 8e13, "xla_default": 5e13,
            "xla_highest": 2e13},
    "cpu": 3e10,
}


def parse_shapes(parser, text):
    """[(head_dim, seq)] of "D:S,D:S,..."."""
    shapes = []
    for cell in (c for c in text.split(",") if c):
        try:
            head_dim, seq = (int(x) for x in cell.split(":"))
        except ValueError:
            parser.error(f"--shapes takes HEAD_DIM:SEQ cells separated by commas, got {cell!r}")
        if head_dim < 1 or seq < 1:
            parser.error(f"--shapes cell {cell!r}: head dim and seq must be >= 1")
        shapes.append((head_dim, seq))
    if not shapes:
        parser.error("--shapes names no cell")
    return shapes


def attention_fn(impl, causal, platform):
    """impl's attention(q, k, v) (float32, [batch, seq, heads, head_dim])."""
    import jax

    if impl.startswith("jflash"):
        import jflash

        common.require_cuda_kernels(platform)
        precision = "highest" if impl == "jflash_3xtf32" else None
        return lambda q, k, v: jflash.flash_attention(q, k, v, causal=causal, precision=precision)
    if impl in ("xla_default", "xla_highest"):
        precision = "highest" if impl == "xla_highest" else None

        def xla(q, k, v):
            # Read when the dots are traced, so the backward's dots (their
            # transposes) carry it too.
            with jax.default_matmul_precision(precision):
                return jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                    implementation="xla")

        return xla
    raise ValueError(f"unknown impl {impl!r}")


def reference_out(q, k, v, causal, rows):
    """float64 NumPy attention of the first `rows` queries of batch 0, head 0
    ([rows, head_dim]); seq_q == seq_k, so causal is j <= i."""
    import numpy as np

    q, k, v = (np.asarray(x[0, :, 0], np.float64) for x in (q, k, v))
    q = q[:rows]
    scores = q @ k.T / np.sqrt(q.shape[-1])
    if causal:
        scores = np.where(np.arange(k.shape[0])[None, :] <= np.arange(rows)[:, None], scores,
                          -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    return p @ v


def check_error(attention, inputs, causal, rows):
    """(max |out - truth|, that / max |truth|) on batch 0, head 0, the first rows queries."""
    import jax
    import numpy as np

    q, k, v = inputs[:3]
    rows = min(rows, q.shape[1])
    out = jax.jit(attention)(q, k, v)
    got = np.asarray(out[0, :rows, 0], np.float64)
    truth = reference_out(q, k, v, causal, rows)
    err = float(np.max(np.abs(got - truth)))
    return err, err / float(np.max(np.abs(truth)))


def run_one(impl, shape, causal, mode, inputs, args, platform):
    head_dim, seq, batch, heads = shape
    rec = dict(impl=impl, head_dim=head_dim, seq=seq, batch=batch, heads=heads, causal=causal,
               mode=mode, dtype="float32",
               precision="highest" if impl in ("jflash_3xtf32", "xla_highest") else "default")
    rec["flops"] = common.attention_flops(batch, seq, seq, heads, head_dim, causal=causal,
                                          mode=mode)
    try:
        attention = attention_fn(impl, causal, platform)
        if args.check and mode == "fwd":
            rec["max_abs_err"], rec["rel_max_err"] = check_error(attention, inputs, causal,
                                                                 args.check_rows)
        rate = (_ASSUMED_FLOPS_PER_S["gpu"][impl] if platform == "gpu"
                else _ASSUMED_FLOPS_PER_S["cpu"])
        iterations = common.iterations_for(rec["flops"], rate, args.target_ms / 1e3,
                                           hi=args.max_iterations)
        loop = common.make_loop(attention, mode, iterations)
        timing = common.time_loop(loop, inputs, iterations=iterations, min_repeats=args.repeats,
                                  max_repeats=max(args.repeats, 30), min_total_s=args.min_total_s)
        common.record_timing(rec, timing, iterations)
        rec["tflops"] = common.tflops(rec["flops"], timing["median_s"])
        rec["status"] = "ok"
    except Exception as exc:  # recorded (XLA out of memory at 16k, say); the other rows still run
        common.record_failure(rec, exc)
    return rec


def summary_table(records, impls):
    """One line per (head dim, seq, causal, mode): TFLOP/s of each row, 3xTF32 / TF32
    and jflash / XLA at each precision; the forward's max |error| per row."""
    cells = {}
    for r in records:
        key = (r["head_dim"], r["seq"], r["causal"], r["mode"])
        cells.setdefault(key, {})[r["impl"]] = r

    def ratio(cell, a, b):
        return common.fmt(common.cell_ratio(cell, a, b), 2)

    def err(cell, impl):
        value = (cell.get(impl) or {}).get("max_abs_err")
        return None if value is None else f"{value:.1e}"

    rows = []
    for (head_dim, seq, causal, mode), cell in cells.items():
        rows.append([head_dim, seq, "yes" if causal else "no", mode]
                    + [common.cell_rate(cell, i) for i in impls]
                    + [ratio(cell, "jflash_3xtf32", "jflash_tf32"),
                       ratio(cell, "jflash_tf32", "xla_default"),
                       ratio(cell, "jflash_3xtf32", "xla_highest")]
                    + ([err(cell, i) for i in impls] if mode == "fwd" else [None] * len(impls)))
    return common.format_table(
        ["D", "seq", "causal", "mode", *impls, "3x/1x", "tf32/xla", "3x/xla_hi",
         *(f"err {i}" for i in impls)], rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES,
                        help="comma list of HEAD_DIM:SEQ cells (default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=16384, help="batch = tokens / seq")
    parser.add_argument("--model-dim", type=int, default=2048, help="heads = model_dim / head_dim")
    parser.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    parser.add_argument("--modes", default="fwd,fwdbwd", help="comma list of fwd,fwdbwd")
    parser.add_argument("--impls", default=",".join(IMPLS), help="comma list of " + ",".join(IMPLS))
    common.add_loop_args(parser)
    parser.add_argument("--check-rows", type=int, default=256,
                        help="query rows (batch 0, head 0) of the float64 error check")
    parser.add_argument("--no-check", dest="check", action="store_false",
                        help="skip the float64 error check")
    parser.add_argument("--allow-cpu", action="store_true", help="run without a GPU (logic test)")
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    impls = common.comma_list(parser, "--impls", args.impls, IMPLS)
    modes = common.comma_list(parser, "--modes", args.modes, common.MODES)
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    shapes = parse_shapes(parser, args.shapes)

    platform = common.require_gpu(parser, args.allow_cpu)

    started = time.perf_counter()
    env = common.environment_record()
    out = args.out or common.default_results_path("float32", env["device_kind"])
    common.print_run_header(env, out)
    payload = dict(benchmark="float32", environment=env,
                   args=common.args_record(args),
                   flop_convention="fwd 4*B*H*Sq*Sk*D, /2 causal; fwdbwd 3.5x fwd (the same "
                                   "for every row: 3xTF32's extra MMAs are not credited)",
                   records=[])
    for head_dim, seq in shapes:
        batch = max(1, args.tokens // seq)
        heads = max(1, args.model_dim // head_dim)
        shape = (head_dim, seq, batch, heads)
        inputs = common.random_qkv(seq + head_dim, batch, seq, heads, head_dim, "float32")
        for causal in causals:
            for mode in modes:
                for impl in impls:
                    rec = run_one(impl, shape, causal, mode, inputs, args, platform)
                    payload["records"].append(rec)
                    # After every record: a killed run keeps its rows.
                    common.write_json(out, payload)
                    what = (f"{common.fmt_rate(rec['tflops']):>7s} TFLOP/s  "
                            f"{rec['median_s'] * 1e3:8.3f} ms  x{rec['iterations']}"
                            if rec["status"] == "ok"
                            else f"{rec['status']}: {rec.get('note', '')[:120]}")
                    if rec.get("max_abs_err") is not None:
                        what += f"  max|err| {rec['max_abs_err']:.2e}"
                    print(f"[{time.perf_counter() - started:6.1f}s] D{head_dim} S{seq} B{batch} "
                          f"H{heads} {'causal' if causal else 'full  '} {mode:6s} {impl:13s} "
                          f"{what}", flush=True)
        del inputs

    print(f"\nresults: {out}")
    print(f"{env['device_kind']} | jax {env['jax_version']} | jflash {env['jflash_commit'][:12]} | "
          f"float32 | B*S {args.tokens}, H*D {args.model_dim} | TFLOP/s (fwd 4BHS^2D, causal /2, "
          f"fwd+bwd 3.5x) | err: forward max |out - float64| on batch 0, head 0")
    print(summary_table(payload["records"], impls))


if __name__ == "__main__":
    main()

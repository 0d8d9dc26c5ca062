"""jflash on GPU against jax's cuDNN attention (the peer) and XLA's: the FA3 paper grid.

Grid (FlashAttention-3, section 4.1): head_dim 64/128/256; seq 512..16k;
batch = 16384 / seq (16k tokens); num_heads = 2048 / head_dim; causal and not;
forward and forward+backward; bfloat16. Every row times jflash,
jax.nn.dot_product_attention(implementation="cudnn") and implementation="xla"
(the last only where its [batch, heads, seq, seq] float32 scores fit, --xla-max-gb).

  python3 -P benchmarks/gpu_benchmark.py --quick
  python3 -P benchmarks/gpu_benchmark.py --head-dims 128 --seqs 4096 16384 --causal no \
      --modes fwd --out $OUT/gpu.json --time-budget-s 480

TFLOP/s use common.attention_flops (fwd 4*B*H*S*S*D, halved for causal;
fwd+bwd 3.5x fwd). Where both fwd and fwdbwd run, each impl also gets a "bwd"
row: the backward alone, as the difference of the two times (2.5x fwd FLOPs). --group G gives key and value num_heads / G heads (GQA; the
FLOPs are those of the query heads, as for MHA). A failing impl or row is recorded and the run goes on.
--allow-cpu runs the same logic on a CPU (tiny sizes; cuDNN rows 'unavailable').

--data normal rising peaked: what the inputs hold (common.DATA_MODES), one set
of rows per mode, each row recording its mode: standard normal q, k, v; keys
scaled by linspace(0.5, 4.0, S) along the sequence (the row maximum keeps
rising, so the online softmax rescales often); queries scaled by 8 (a sharply
peaked softmax: at head dim 128 a row's largest probability is 0.7 in the
median). A kernel's speed should not depend on it:

  python3 -P benchmarks/gpu_benchmark.py --head-dims 64 128 256 --seqs 4096 16384 \
      --impls jflash,cudnn --data normal rising peaked --out $OUT/data.json

Variants of jflash, run when asked for and put beside jflash in the summary:
jflash_det (deterministic=True) and jflash_softcap (softcap=--softcap, 50 by
default: the softcap kernels against the plain ones in the same run, e.g.

  python3 -P benchmarks/gpu_benchmark.py --head-dims 128 --seqs 4096 16384 \
      --impls jflash,jflash_softcap --out $OUT/softcap.json
).

--window LEFT: a causal sliding window of LEFT keys before each query. The
causal rows get two more impls: jflash_window (flash_attention(causal=True,
window_size=(LEFT, 0))) and cudnn_window (jax.nn.dot_product_attention(
is_causal=True, local_window_size=(LEFT, 0), implementation="cudnn"): jax's
window is top-left aligned, which is jflash's bottom-right one at seq_q ==
seq_k; query i sees keys i - LEFT .. i). Their FLOPs count the band's visible
pairs exactly (common.band_flops, j - i in [-LEFT, 0]); the summary puts each
beside its causal rate, window / causal (both on exact pair counts; the target
is jflash's >= 0.90 at seq 16384, LEFT 4096):

  python3 -P benchmarks/gpu_benchmark.py --head-dims 128 --seqs 16384 --causal yes \
      --impls jflash,cudnn --window 4096 --out $OUT/window.json

--value-head-dim DV: v (and out, and the fwd+bwd cotangent) get head dim DV,
q and k keep the row's head dim D (MLA-style, e.g. D 192, DV 128). FLOPs:
fwd 2*B*H*S*S*(D + DV), bwd 2*B*H*S*S*(3*D + 2*DV), halved for causal
(common.attention_flops; 4*B*H*S*S*D and 2.5x at DV == D). Rows record
value_head_dim (= head_dim without the option); the summary gets a Dv column.
jax.nn.dot_product_attention checks value's shape against key's (cudnn and
xla alike), so where it rejects DV != D those rows are 'unavailable' with its
message:

  python3 -P benchmarks/gpu_benchmark.py --head-dims 192 --value-head-dim 128 \
      --seqs 4096 16384 --impls jflash,cudnn --out $OUT/mla.json
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import common  # noqa: E402

# jflash_det: flash_attention(..., deterministic=True), whose backward adds dq
# in key-block order (run when asked for: --impls jflash,jflash_det,cudnn);
# jflash_softcap: flash_attention(..., softcap=--softcap); jflash_window and
# cudnn_window: the causal rows' sliding window of --window LEFT keys.
IMPLS = ("jflash", "jflash_det", "jflash_softcap", "cudnn", "xla", "jflash_window",
         "cudnn_window")
WINDOW_IMPLS = ("jflash_window", "cudnn_window")
# The variants' summary columns: impl, its column, the column of its rate over
# that of the impl it varies (jflash, or cudnn for cudnn_window).
VARIANTS = (("jflash_det", "jflash det", "det/jflash"),
            ("jflash_softcap", "jflash softcap", "softcap/jflash"),
            ("jflash_window", "jflash window", "window/causal"),
            ("cudnn_window", "cudnn window", "cudnn window/causal"))
_BASE = {"cudnn_window": "cudnn"}
DEFAULT_IMPLS = ("jflash", "cudnn", "xla")
PAPER_HEAD_DIMS = (64, 128, 256)
PAPER_SEQS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK = dict(head_dims=[128], seqs=[1024, 4096, 16384])

# Rough rates, only to pick how many calls one timed loop chains (~--target-ms per
# repeat); a wrong guess changes the loop length, not the measurement.
_ASSUMED_FLOPS_PER_S = {
    "gpu": {"jflash": 4e14, "jflash_det": 4e14, "jflash_softcap": 4e14, "cudnn": 4e14,
            "xla": 1e14, "jflash_window": 4e14, "cudnn_window": 4e14},
    "cpu": 3e10,
}


def attention_fn(impl, causal, platform, softcap=None, window=None):
    """impl's attention(q, k, v); softcap: that of jflash_softcap; window:
    (left, 0), that of jflash_window and cudnn_window."""
    import jax

    if impl in ("jflash", "jflash_det", "jflash_softcap", "jflash_window"):
        import jflash

        common.require_cuda_kernels(platform)
        det = impl == "jflash_det"
        cap = softcap if impl == "jflash_softcap" else None
        win = window if impl == "jflash_window" else None
        return lambda q, k, v: jflash.flash_attention(q, k, v, causal=causal, deterministic=det,
                                                      softcap=cap, window_size=win)
    if impl in ("cudnn", "cudnn_window"):
        if platform != "gpu":
            raise common.Unavailable(f"cuDNN attention needs a CUDA GPU; running on {platform}")
        # jax.nn's window is top-left aligned: with seq_q == seq_k it is jflash's.
        win = window if impl == "cudnn_window" else None
        return lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, local_window_size=win, implementation="cudnn"
        )
    if impl == "xla":
        return lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="xla"
        )
    raise ValueError(f"unknown impl {impl!r}")


def grid(args):
    for head_dim in args.head_dims:
        for seq in args.seqs:
            batch = max(1, args.tokens // seq)
            heads = max(1, args.model_dim // head_dim)
            yield head_dim, seq, batch, heads


def value_head_dim(args, head_dim):
    """The head dim of v and out in the rows of head dim head_dim."""
    return head_dim if args.value_head_dim is None else args.value_head_dim


def run_one(impl, shape, causal, mode, inputs, args, platform, data="normal"):
    head_dim, seq, batch, heads = shape
    dv = value_head_dim(args, head_dim)
    rec = dict(impl=impl, head_dim=head_dim, value_head_dim=dv, seq=seq, batch=batch,
               heads=heads, kv_heads=heads // args.group, causal=causal, mode=mode,
               dtype=args.dtype, data=data, feed=args.feed)
    window = None
    if impl in WINDOW_IMPLS:
        window = (args.window, 0)
        rec["window"] = list(window)
        # The band's visible pairs, exactly (query i sees keys i - left .. i).
        flops = common.band_flops(batch, seq, seq, heads, head_dim, lo=-args.window, hi=0,
                                  mode=mode, value_head_dim=dv)
    else:
        flops = common.attention_flops(batch, seq, seq, heads, head_dim, causal=causal, mode=mode,
                                       value_head_dim=dv)
    rec["flops"] = flops
    try:
        if impl == "xla":
            scores_gb = batch * heads * seq * seq * 4 / 1e9
            if scores_gb > args.xla_max_gb:
                raise common.Unavailable(f"skipped: S x S float32 scores need {scores_gb:.3g} GB "
                                         f"> --xla-max-gb {args.xla_max_gb}")
        softcap = args.softcap if impl == "jflash_softcap" else None
        if softcap is not None:
            rec["softcap"] = softcap
        attention = attention_fn(impl, causal, platform, softcap, window)
        if dv != head_dim and impl in ("cudnn", "cudnn_window", "xla"):
            # Whether jax.nn.dot_product_attention takes a value head dim other
            # than the query's (its shape check, not ours): traced, not run.
            import jax

            try:
                jax.eval_shape(attention, *inputs[:3])
            except (ValueError, NotImplementedError) as exc:
                raise common.Unavailable(
                    f"jax.nn.dot_product_attention rejects value head dim {dv} "
                    f"!= head dim {head_dim}: {type(exc).__name__}: {exc}") from exc
        if not args.no_check:
            rec["rel_err"] = common.relative_errors(
                attention, *inputs, causal=causal, mode=mode, softcap=softcap, window=window
            )
        rate = _ASSUMED_FLOPS_PER_S[platform][impl] if platform == "gpu" else _ASSUMED_FLOPS_PER_S["cpu"]
        iterations = common.iterations_for(flops, rate, args.target_ms / 1e3, hi=args.max_iterations)
        loop = common.make_loop(attention, mode, iterations, args.feed)
        timing = common.time_loop(loop, inputs, iterations=iterations, min_repeats=args.repeats,
                                  max_repeats=max(args.repeats, 30), min_total_s=args.min_total_s)
        common.record_timing(rec, timing, iterations)
        rec["tflops"] = common.tflops(flops, timing["median_s"])
        rec["status"] = "ok"
    except Exception as exc:  # recorded; the other impls and rows still run
        common.record_failure(rec, exc)
    return rec


def backward_record(fwd, fwdbwd):
    """The backward alone, from the forward and forward+backward rows of one run.

    Its time is the difference of the two medians (the loop's forward+backward
    iteration runs the forward once and the backward once); TFLOP/s count
    the forward's FLOPs times bwd / fwd of common.pair_flops ((3 D + 2 Dv) /
    (D + Dv): 2.5 at Dv == D). Derived, not timed on its own: a kernel's
    backward needs the residuals of its own forward, and a separately timed
    backward loop would time that forward too.
    """
    rec = {k: fwd[k] for k in ("impl", "head_dim", "value_head_dim", "seq", "batch", "heads",
                               "kv_heads", "causal", "dtype", "data", "window") if k in fwd}
    rec.update(mode="bwd", derived="fwdbwd median_s - fwd median_s")
    dv = fwd.get("value_head_dim")
    if "flops" in fwd:  # the forward's, counted as they were (band pairs for a window)
        rec["flops"] = fwd["flops"] * (common.pair_flops(fwd["head_dim"], dv, "bwd")
                                       / common.pair_flops(fwd["head_dim"], dv, "fwd"))
    else:
        rec["flops"] = common.attention_flops(fwd["batch"], fwd["seq"], fwd["seq"], fwd["heads"],
                                              fwd["head_dim"], causal=fwd["causal"], mode="bwd",
                                              value_head_dim=dv)
    if fwd.get("status") == fwdbwd.get("status") == "ok":
        rec["median_s"] = fwdbwd["median_s"] - fwd["median_s"]
        rec["tflops"] = common.tflops(rec["flops"], rec["median_s"])
        rec["status"] = "ok"
        if rec["tflops"] is None:  # tiny calls on a busy CPU: fwdbwd timed below fwd
            rec["status"] = "not run"
            rec["note"] = "fwdbwd median not above the fwd median (timing noise)"
    else:
        rec["status"] = "not run"
        rec["note"] = "needs ok fwd and fwdbwd rows"
    return rec


def summary_table(records, show_dv=None):
    """One line per (head_dim, value_head_dim, seq, data, causal, mode): TFLOP/s
    of each impl, jflash/cuDNN. show_dv: a Dv column after D (None: where a
    record's value head dim differs from its head dim)."""
    def dv_of(r):  # records written before --value-head-dim have none
        return r.get("value_head_dim", r["head_dim"])

    if show_dv is None:
        show_dv = any(dv_of(r) != r["head_dim"] for r in records)
    rows = {}
    for r in records:
        key = (r["head_dim"], dv_of(r), r["seq"], r.get("data", "normal"), r["causal"], r["mode"])
        rows.setdefault(key, {"batch": r["batch"], "heads": r["heads"]})[r["impl"]] = r
    table, notes = [], {}  # note text -> rows it applies to
    variants = [v for v in VARIANTS if any(r["impl"] == v[0] for r in records)]
    for (head_dim, dv, seq, data, causal, mode), cell in rows.items():
        dims = f"D{head_dim} Dv{dv}" if show_dv else f"D{head_dim}"
        def tf(impl):
            r = cell.get(impl)
            if r is None:
                return None
            if r["status"] != "ok":
                text = f"{impl} {r['status']}: {r.get('note', '')[:200]}"
                notes.setdefault(text, []).append(
                    f"{dims} S{seq} {data} {'causal' if causal else 'full'} {mode}")
                return {"error": "ERR", "unavailable": "n/a", "not run": "not run"}.get(r["status"], "?")
            return common.fmt_rate(r["tflops"])
        j, c = cell.get("jflash"), cell.get("cudnn")
        ratio = None
        if j and c and j["status"] == c["status"] == "ok":
            ratio = f"{j['tflops'] / c['tflops']:.2f}"
        def err(impl):
            errors = (cell.get(impl) or {}).get("rel_err")
            return f"{max(errors.values()):.1e}" if errors else None

        row = [head_dim, *([dv] if show_dv else []), seq, cell["batch"], cell["heads"], data,
               "yes" if causal else "no", mode,
               tf("jflash"), tf("cudnn"), tf("xla"), ratio, err("jflash"), err("cudnn")]
        for impl, _, _ in variants:
            d, base = cell.get(impl), cell.get(_BASE.get(impl, "jflash"))
            variant_ratio = None
            if base and d and base["status"] == d["status"] == "ok":
                base_rate = base["tflops"]
                if impl in WINDOW_IMPLS:  # against the causal rate on exact pairs too
                    base_rate = common.tflops(common.band_flops(
                        base["batch"], seq, seq, base["heads"], head_dim, hi=0,
                        mode=mode, value_head_dim=dv), base["median_s"])
                if base_rate and d["tflops"]:
                    variant_ratio = f"{d['tflops'] / base_rate:.2f}"
            row += [tf(impl), variant_ratio]
        table.append(row)
    headers = ["D", *(["Dv"] if show_dv else []), "seq", "B", "H", "data", "causal", "mode",
               "jflash", "cudnn", "xla", "jflash/cudnn", "jflash err", "cudnn err"]
    for _, column, ratio_column in variants:
        headers += [column, ratio_column]
    lines = []
    for text, where in notes.items():
        scope = where[0] if len(where) == 1 else f"{len(where)} rows, first {where[0]}"
        lines.append(f"{text} [{scope}]")
    return common.format_table(headers, table), lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=list(PAPER_HEAD_DIMS))
    parser.add_argument("--seqs", type=int, nargs="+", default=list(PAPER_SEQS))
    parser.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    parser.add_argument("--modes", default="fwd,fwdbwd", help="comma list of fwd,fwdbwd")
    parser.add_argument("--impls", default=",".join(DEFAULT_IMPLS),
                        help="comma list of " + ",".join(IMPLS))
    parser.add_argument("--quick", action="store_true",
                        help="head dim 128, seq 1k/4k/16k (overrides --head-dims/--seqs)")
    parser.add_argument("--tokens", type=int, default=16384, help="batch = tokens / seq")
    parser.add_argument("--model-dim", type=int, default=2048, help="heads = model_dim / head_dim")
    parser.add_argument("--group", type=int, default=1,
                        help="query heads per key/value head (GQA); 1: MHA")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--data", nargs="+", choices=common.DATA_MODES, default=["normal"],
                        help="what q, k, v hold (common.DATA_MODES); one set of rows per mode")
    parser.add_argument("--softcap", type=float, default=50.0,
                        help="the softcap of the jflash_softcap rows")
    parser.add_argument("--value-head-dim", type=int, default=None, metavar="DV",
                        help="head dim of v (and out) where it differs from q's and k's "
                             "(MLA-style); default: the row's head dim")
    parser.add_argument("--window", type=int, default=None, metavar="LEFT",
                        help="add jflash_window and cudnn_window to the causal rows: a causal "
                             "sliding window of LEFT keys before each query")
    parser.add_argument("--xla-max-gb", type=float, default=8.0)
    parser.add_argument("--feed", default="sliver", choices=common.FEEDS,
                        help="how one call's result reaches the next (common.py)")
    common.add_loop_args(parser)
    parser.add_argument("--no-check", action="store_true", help="skip the fp32 reference check")
    parser.add_argument("--time-budget-s", type=float, default=0,
                        help="start no new row after this many seconds (0: no limit)")
    parser.add_argument("--allow-cpu", action="store_true", help="run without a GPU (logic test)")
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.head_dims, args.seqs = QUICK["head_dims"], QUICK["seqs"]
    impls = common.comma_list(parser, "--impls", args.impls, IMPLS)
    modes = common.comma_list(parser, "--modes", args.modes, common.MODES)
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    if args.window is not None:
        if args.window < 0:
            parser.error("--window LEFT takes LEFT >= 0")
        if True not in causals:
            parser.error("--window adds causal rows: use --causal yes or both")
        impls += [i for i in WINDOW_IMPLS if i not in impls]
    elif set(impls) & set(WINDOW_IMPLS):
        parser.error("jflash_window and cudnn_window need --window LEFT")
    if args.value_head_dim is not None:
        if args.value_head_dim < 1:
            parser.error("--value-head-dim DV takes DV >= 1")
        if (args.feed == "out" and "fwd" in modes
                and any(d != args.value_head_dim for d in args.head_dims)):
            parser.error("--feed out with --modes fwd feeds out (head dim DV) back as q: "
                         "use --feed sliver with --value-head-dim")
    args.data = list(dict.fromkeys(args.data))
    if args.feed == "out" and "peaked" in args.data:
        parser.error("--data peaked needs --feed sliver: --feed out replaces q (where the data "
                     "is peaked) by each call's result")
    for head_dim, _, _, heads in grid(args):
        if args.group < 1 or heads % args.group:
            parser.error(f"--group {args.group} must divide the {heads} heads of head dim {head_dim}")

    platform = common.require_gpu(parser, args.allow_cpu)

    started = time.perf_counter()
    env = common.environment_record()
    out = args.out or common.default_results_path("gpu", env["device_kind"])
    common.print_run_header(env, out)
    flop_convention = "fwd 4*B*H*Sq*Sk*D, /2 causal; bwd 2.5x fwd; fwdbwd 3.5x fwd"
    if args.value_head_dim is not None:
        flop_convention = ("fwd 2*B*H*Sq*Sk*(D+Dv), bwd 2*B*H*Sq*Sk*(3*D+2*Dv), /2 causal; "
                           "fwdbwd fwd+bwd")
    payload = dict(benchmark="gpu", environment=env,
                   args=common.args_record(args),
                   flop_convention=flop_convention, records=[])
    records = payload["records"]
    for shape, data in ((shape, data) for shape in grid(args) for data in args.data):
        head_dim, seq, batch, heads = shape
        dv = value_head_dim(args, head_dim)
        dims = f"D{head_dim}" if args.value_head_dim is None else f"D{head_dim} Dv{dv}"
        out_of_time = args.time_budget_s and time.perf_counter() - started > args.time_budget_s
        inputs = None
        if not out_of_time:
            inputs = common.random_qkv(seq + head_dim, batch, seq, heads, head_dim, args.dtype,
                                       data=data, value_head_dim=args.value_head_dim)
            if args.group > 1:  # key and value keep their first heads // group heads
                q, k, v, cotangent = inputs
                inputs = (q, k[:, :, : heads // args.group], v[:, :, : heads // args.group], cotangent)
        for causal in causals:
            # The window impls run in the causal rows only.
            row_impls = [i for i in impls if causal or i not in WINDOW_IMPLS]
            for mode in modes:
                for impl in row_impls:
                    out_of_time = args.time_budget_s and (
                        time.perf_counter() - started > args.time_budget_s)
                    if out_of_time or inputs is None:
                        rec = dict(impl=impl, head_dim=head_dim, value_head_dim=dv, seq=seq,
                                   batch=batch, heads=heads,
                                   kv_heads=heads // args.group, causal=causal, mode=mode,
                                   dtype=args.dtype, data=data,
                                   status="not run", note="--time-budget-s reached")
                    else:
                        rec = run_one(impl, shape, causal, mode, inputs, args, platform, data)
                    records.append(rec)
                    common.write_json(out, payload)  # after every record: a killed run keeps its rows
                    what = (f"{common.fmt_rate(rec['tflops']):>7s} TFLOP/s  "
                            f"{rec['median_s'] * 1e3:8.3f} ms  x{rec['iterations']}"
                            if rec["status"] == "ok" else f"{rec['status']}: {rec.get('note', '')[:120]}")
                    print(f"[{time.perf_counter() - started:6.1f}s] {dims} S{seq} B{batch} H{heads} "
                          f"{data:7s}{'causal' if causal else 'full  '} {mode:6s} {impl:6s} {what}",
                          flush=True)
            if "fwd" in modes and "fwdbwd" in modes:
                for impl in row_impls:
                    by_mode = {r["mode"]: r for r in records[-len(modes) * len(row_impls):]
                               if r["impl"] == impl}
                    records.append(backward_record(by_mode["fwd"], by_mode["fwdbwd"]))
                common.write_json(out, payload)
        del inputs

    table, notes = summary_table(records, show_dv=args.value_head_dim is not None)
    print(f"\nresults: {out}")
    if notes:
        print("notes:\n  " + "\n  ".join(notes))
    group = f" | GQA: {args.group} query heads per kv head" if args.group > 1 else ""
    flop_text = "fwd 4BHS^2D, causal /2, fwd+bwd 3.5x"
    if args.value_head_dim is not None:
        group += f" | value head dim {args.value_head_dim}"
        flop_text = "fwd 2BHS^2(D+Dv), bwd 2BHS^2(3D+2Dv), causal /2"
    print(f"{env['device_kind']} | jax {env['jax_version']} | jflash {env['jflash_commit'][:12]} | "
          f"{args.dtype}{group} | TFLOP/s ({flop_text}) | feed {args.feed}")
    print(table)


if __name__ == "__main__":
    main()

"""jflash's CPU kernel against XLA's materialized attention on CPU: time and memory.

  python3 -P benchmarks/cpu_benchmark.py            # seq 1024 2048 4096
  python3 -P benchmarks/cpu_benchmark.py --seqs 4096 --causal

Peer: jax.nn.dot_product_attention(implementation="xla"), which builds the
[batch, heads, seq, seq] scores. Memory is measured two ways:
  temp MB  XLA's static buffer assignment of one compiled call
           (compiled.memory_analysis().temp_size_in_bytes): the S x S scratch.
  RSS MB   peak resident set of a fresh subprocess that runs one call
           (/proc/self/status VmHWM; getrusage's ru_maxrss is inherited from the
           parent through fork + exec on Linux), and how far the run itself rose
           above the process's RSS just before it (run +MB).
Ratio columns are jflash / XLA: time < 1 means jflash is faster, memory < 1 smaller.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import common  # noqa: E402

IMPLS = ("jflash", "xla")


def attention_fn(impl, causal):
    import jax

    if impl == "jflash":
        import jflash

        return lambda q, k, v: jflash.flash_attention(q, k, v, causal=causal)
    if impl == "xla":
        return lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="xla"
        )
    raise ValueError(f"unknown impl {impl!r}")


def _status_mb(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
    return None


def _rss_mb_now():
    return _status_mb("VmRSS")


def _maxrss_mb():
    # VmHWM, the peak RSS of this process image. getrusage's ru_maxrss would do on
    # its own, but Linux carries it over from the parent through fork + exec, so a
    # child of a benchmark that already ran XLA at seq 4096 would report that peak.
    peak = _status_mb("VmHWM")
    if peak is None:  # not Linux: ru_maxrss (KiB on Linux, bytes on macOS)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return peak


def child_rss(args):
    """Runs in a fresh process: one compiled call of one impl; prints a JSON line."""
    import jax

    q, k, v, _ = common.random_qkv(0, args.batch, args.seq, args.heads, args.head_dim, args.dtype)
    jax.block_until_ready((q, k, v))
    compiled = jax.jit(attention_fn(args.child, args.causal)).lower(q, k, v).compile()
    peak_before = _maxrss_mb()
    rss_before = _rss_mb_now()
    jax.block_until_ready(compiled(q, k, v))
    peak_after = _maxrss_mb()
    print(
        json.dumps(
            dict(
                rss_before_run_mb=rss_before,
                peak_before_run_mb=peak_before,
                peak_rss_mb=peak_after,
                # None: the run stayed under the peak that import/compile had reached.
                run_increase_mb=(peak_after - rss_before) if peak_after > peak_before else None,
            )
        )
    )


def measure_rss(impl, seq, args):
    command = [
        sys.executable, "-P", __file__, "--child", impl, "--seq", str(seq),
        "--batch", str(args.batch), "--heads", str(args.heads),
        "--head-dim", str(args.head_dim), "--dtype", args.dtype,
    ] + (["--causal"] if args.causal else [])
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"subprocess failed: {proc.stderr.strip()[-400:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_row(impl, seq, mode, args, inputs):
    import jax

    row = dict(impl=impl, seq=seq, mode=mode, batch=args.batch, heads=args.heads,
               head_dim=args.head_dim, dtype=args.dtype, causal=args.causal)
    flops = common.attention_flops(args.batch, seq, seq, args.heads, args.head_dim,
                                   causal=args.causal, mode=mode)
    row["flops"] = flops
    try:
        attention = attention_fn(impl, args.causal)
        q, k, v, cotangent = inputs
        if mode == "fwd":
            compiled = jax.jit(attention).lower(q, k, v).compile()
            row["memory"] = common.memory_stats(compiled)
        if not args.no_check:
            row["rel_err"] = common.relative_errors(
                attention, q, k, v, cotangent, causal=args.causal, mode=mode
            )
        loop = common.make_loop(attention, mode, args.iterations, args.feed)
        timing = common.time_loop(loop, inputs, iterations=args.iterations,
                                  min_repeats=args.repeats, max_repeats=max(args.repeats, 10),
                                  min_total_s=args.min_total_s)
        row["final_q_rms"] = common.check_finite_nonzero(timing.pop("last_carry")[0])
        row.update(timing)
        row["gflops_per_s"] = flops / timing["median_s"] / 1e9
        if mode == "fwd" and not args.no_rss:
            row["rss"] = measure_rss(impl, seq, args)
    except Exception as exc:  # one failed row must not end the run
        row["error"] = f"{type(exc).__name__}: {exc}"[:1000]
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    parser.add_argument("--modes", default="fwd", help="comma list of fwd,fwdbwd")
    parser.add_argument("--iterations", type=int, default=1,
                        help="dependent calls per timed loop (a CPU call is long enough alone)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (median)")
    parser.add_argument("--min-total-s", type=float, default=0.0)
    parser.add_argument("--feed", default="sliver", choices=common.FEEDS)
    parser.add_argument("--no-rss", action="store_true", help="skip the subprocess RSS runs")
    parser.add_argument("--no-check", action="store_true", help="skip the reference check")
    parser.add_argument("--out", type=pathlib.Path, default=None)
    parser.add_argument("--child", choices=IMPLS, help=argparse.SUPPRESS)
    parser.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    import jax

    jax.config.update("jax_platforms", "cpu")
    if args.child:
        return child_rss(args)

    started = time.perf_counter()
    env = common.environment_record()
    modes = [m for m in args.modes.split(",") if m]
    rows = []
    for seq in args.seqs:
        inputs = common.random_qkv(seq, args.batch, seq, args.heads, args.head_dim, args.dtype)
        for mode in modes:
            for impl in args.impls:
                row = run_row(impl, seq, mode, args, inputs)
                rows.append(row)
                status = row.get("error") or f"{row['median_s'] * 1e3:.1f} ms"
                print(f"[{time.perf_counter() - started:6.1f}s] {impl:6s} {mode:6s} seq {seq}: {status}",
                      flush=True)
        del inputs

    env["load_average_end"] = list(os.getloadavg())
    payload = dict(benchmark="cpu", environment=env, args=common.args_record(args),
                   flop_convention="fwd 4*B*H*Sq*Sk*D, /2 causal; fwdbwd 3.5x fwd", rows=rows)
    out = args.out or common.default_results_path("cpu", env["machine"])
    common.write_json(out, payload)

    by_key = {(r["seq"], r["mode"], r["impl"]): r for r in rows}
    table = []
    for r in rows:
        peer = by_key.get((r["seq"], r["mode"], "xla"))
        mem = (r.get("memory") or {}).get("temp_size_in_bytes")
        rss = r.get("rss") or {}
        time_ratio = mem_ratio = rss_ratio = None
        if r["impl"] != "xla" and peer and "error" not in r and "error" not in peer:
            time_ratio = r["median_s"] / peer["median_s"]
            peer_mem = (peer.get("memory") or {}).get("temp_size_in_bytes")
            if mem is not None and peer_mem:
                mem_ratio = mem / peer_mem
            if rss.get("peak_rss_mb") and (peer.get("rss") or {}).get("peak_rss_mb"):
                rss_ratio = rss["peak_rss_mb"] / peer["rss"]["peak_rss_mb"]
        errs = r.get("rel_err") or {}
        table.append([
            r["seq"], r["mode"], r["impl"],
            common.fmt(r.get("median_s", 0) * 1e3) if "median_s" in r else None,
            common.fmt(r.get("gflops_per_s")),
            common.fmt(time_ratio, 2),
            common.fmt(mem / 2**20 if mem is not None else None),
            common.fmt(mem_ratio, 3),
            common.fmt(rss.get("peak_rss_mb"), 0),
            common.fmt(rss.get("run_increase_mb"), 0),
            common.fmt(rss_ratio, 2),
            f"{max(errs.values()):.1e}" if errs else None,
            ("ERROR " + r["error"][:60]) if "error" in r else "",
        ])
    print(f"\nresults: {out}")
    print(f"{env['device_kind']} ({env['cpu_count']} cpus, load {env['load_average']} -> "
          f"{env['load_average_end']}), jax {env['jax_version']}, jflash {env['jflash_commit'][:12]}, "
          f"B={args.batch} H={args.heads} D={args.head_dim} {args.dtype} causal={args.causal}")
    print(common.format_table(
        ["seq", "mode", "impl", "ms", "GFLOP/s", "t/xla", "temp MB", "temp/xla",
         "RSS MB", "run +MB", "RSS/xla", "rel err", ""],
        table,
    ))


if __name__ == "__main__":
    main()

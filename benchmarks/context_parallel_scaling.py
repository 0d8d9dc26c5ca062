"""Context parallelism across devices: per-device rate against one device at the local length.

The sequence of q, k, v is sharded over a "seq" mesh axis of n devices
(jax.devices(), or the first --devices of them) and jflash.flash_attention runs
context-parallel under jax.jit (forward+backward). For every sequence length,
causal and not, and strategy (ring, all_gather), with the causal layouts
zigzag (balanced) and contiguous (not balanced), it reports

  per-device TFLOP/s  = FLOPs of the whole sequence / n / time
  single TFLOP/s      = one flash_attention call on one device at the local
                        length seq / n (same heads, same mask kind)
  efficiency          = per-device / single
  balance             = time(contiguous) / time(zigzag), causal, per strategy

and which strategy the "auto" heuristic picks there
(jflash.context_parallel.choose_strategy). Before timing, a short check
compares the sharded forward and gradients with one device's at a small length
(--check-seq) for every configuration.

Default grid: sequence 128k, 256k, 512k and 1M, bfloat16, head dim 128, 16
query heads over 8 kv heads, batch 1. Points whose estimated time exceeds
--max-point-s are skipped (recorded as such).

  python3 -P benchmarks/context_parallel_scaling.py --out $OUT/cp_scaling.json
  python3 -P benchmarks/context_parallel_scaling.py --smoke   # 8 CPU devices, tiny

Timing as in common.py: a jitted fori_loop of dependent forward+backward
calls (feed "out": each iteration's q is the last one's normalised dq, so no
call can be hoisted out of the loop), median over repeats after a warm-up.
Random data needs no zigzag permutation: a permuted normal sample is a normal
sample, so the zigzag rows run on the same arrays under
sequence_layout("zigzag", n). Results record the device, jax version and commit.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import sys
import traceback

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[131072, 262144, 524288, 1048576])
    p.add_argument("--devices", type=int, default=None, help="use the first N devices (default all)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--causal", default="both", choices=("yes", "no", "both"))
    p.add_argument("--strategies", nargs="+", default=["ring", "all_gather"],
                   choices=("ring", "all_gather"))
    p.add_argument("--layouts", nargs="+", default=["zigzag", "contiguous"],
                   choices=("zigzag", "contiguous"), help="causal layouts")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--target-s", type=float, default=1.0, help="seconds per timed repeat")
    p.add_argument("--max-point-s", type=float, default=60.0,
                   help="skip a point whose warm-up plus repeats would take longer (estimate)")
    p.add_argument("--assumed-tflops", type=float, default=350.0,
                   help="per-device rate for the time estimates")
    p.add_argument("--check-seq", type=int, default=16384, help="0 skips the check")
    p.add_argument("--out", type=pathlib.Path, default=None)
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes on 8 simulated CPU devices (seq 256, 4 heads over 2, head dim 32)")
    args = p.parse_args(argv)
    if args.smoke:
        args.seqs, args.heads, args.kv_heads, args.head_dim = [256, 512], 4, 2, 32
        args.dtype, args.repeats, args.target_s, args.check_seq = "float32", 1, 0.05, 128
        args.assumed_tflops = 0.01
    return p, args


def main(argv=None):
    parser, args = parse_args(argv)
    if args.smoke and "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_force_host_platform_device_count=8")
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import common
    import jflash
    from jflash.context_parallel import choose_strategy

    platform = jax.default_backend()
    if platform != "gpu" and not args.smoke:
        parser.error(f"jax runs on {platform}: this benchmark is for GPUs (use --smoke on CPU)")
    devices = jax.devices()[: args.devices] if args.devices else jax.devices()
    n = len(devices)
    if n < 2:
        parser.error(f"needs at least 2 devices, jax sees {len(jax.devices())}")
    for seq in args.seqs + ([args.check_seq] if args.check_seq else []):
        if seq % (2 * n):
            parser.error(f"sequence {seq} is not a multiple of 2 * {n} devices")
    if args.heads % args.kv_heads:
        parser.error("--heads must be a multiple of --kv-heads")

    env = common.environment_record()
    out_path = args.out or common.default_results_path(f"cp_scaling_x{n}", env["device_kind"])
    dtype = jnp.dtype(args.dtype)
    mesh = jax.make_mesh((n,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,), devices=devices)
    seq_sharded = NamedSharding(mesh, P(None, "seq"))
    causals = {"yes": [True], "no": [False], "both": [False, True]}[args.causal]
    payload = dict(environment=env, config=common.args_record(args, out=out_path, devices_used=n),
                   checks=[], records=[])
    print(f"{n} x {env['device_kind']}, jax {env['jax_version']}, commit {env['jflash_commit']}")

    def draw(seq, sharding, seed):
        """q, k, v, cotangent [batch, seq, heads, head_dim], drawn where they live."""
        shapes = [(args.batch, seq, h, args.head_dim)
                  for h in (args.heads, args.kv_heads, args.kv_heads, args.heads)]

        def make(key):
            keys = jax.random.split(key, 4)
            return tuple(jax.random.normal(k, s, jnp.float32).astype(dtype)
                         for k, s in zip(keys, shapes))

        return jax.jit(make, out_shardings=(sharding,) * 4)(jax.random.key(seed))

    def configs(causal):
        layouts = args.layouts if causal else ["contiguous"]
        return [(s, lay) for s in args.strategies for lay in layouts]

    def context(strategy, layout):
        stack = contextlib.ExitStack()
        stack.enter_context(jflash.context_parallel_strategy(strategy))
        stack.enter_context(jflash.sequence_layout(layout, n) if layout == "zigzag"
                            else jflash.sequence_layout("contiguous"))
        return stack

    def attention(causal):
        return lambda q, k, v: jflash.flash_attention(q, k, v, causal=causal)

    def fwd_bwd(causal):
        def run(q, k, v, cot):
            out, vjp = jax.vjp(attention(causal), q, k, v)
            return (out, *vjp(cot))

        return run

    # ---------------------------------------------------------------- check
    if args.check_seq:
        q, k, v, cot = draw(args.check_seq, NamedSharding(mesh, P()), seed=7)
        one = jax.device_put((q, k, v, cot), devices[0])
        for causal in causals:
            want = jax.jit(fwd_bwd(causal))(*one)
            for strategy, layout in configs(causal):
                with context(strategy, layout):
                    # Zigzag: the same tokens permuted into the layout, results permuted back.
                    xs = [jflash.context_parallel.shard_sequence(x, n) if layout == "zigzag" else x
                          for x in (q, k, v, cot)]
                    xs = [jax.device_put(x, seq_sharded) for x in xs]
                    compiled = jax.jit(fwd_bwd(causal)).lower(*xs).compile()
                    got = compiled(*xs)
                hlo = compiled.as_text()
                if layout == "zigzag":
                    got = [jflash.context_parallel.unshard_sequence(x, n) for x in got]
                err = max(float(jnp.max(jnp.abs(jax.device_put(g, devices[0]).astype(jnp.float32)
                                                - w.astype(jnp.float32))))
                          for g, w in zip(got, want))
                scale = max(float(jnp.max(jnp.abs(w.astype(jnp.float32)))) for w in want)
                rec = dict(seq=args.check_seq, causal=causal, strategy=strategy, layout=layout,
                           max_abs_diff=err, max_abs_value=scale,
                           collective_permutes=hlo.count("collective-permute-start")
                           + hlo.count("collective-permute("),
                           all_gathers=hlo.count("all-gather-start") + hlo.count("all-gather("))
                payload["checks"].append(rec)
                print(f"check seq {args.check_seq} causal={causal} {strategy}/{layout}: "
                      f"max |sharded - one device| {err:.3g} (values up to {scale:.3g}), "
                      f"{rec['collective_permutes']} collective-permutes, {rec['all_gathers']} all-gathers")
        common.write_json(out_path, payload)

    # ---------------------------------------------------------------- timing
    rate = args.assumed_tflops * 1e12

    def timed(fn, arrays, flops_per_device, ctx=None):
        """Per-iteration timing of fn's forward+backward loop; None if the estimate is too long."""
        est = flops_per_device / rate
        iterations = max(1, min(50, round(args.target_s / est)))
        estimate_s = est * iterations * (args.repeats + 1)
        if estimate_s > args.max_point_s:
            return dict(skipped=f"estimated {estimate_s:.0f} s > --max-point-s {args.max_point_s:g}")
        loop = common.make_loop(fn, "fwdbwd", iterations, feed="out")
        with ctx or contextlib.nullcontext():
            compiled = loop.lower(*arrays).compile()
        mem = common.memory_stats(compiled)
        timing = common.time_loop(compiled, arrays, iterations=iterations,
                                  min_repeats=args.repeats, max_repeats=args.repeats)
        rms = common.check_finite_nonzero(timing.pop("last_carry")[0])
        return dict(timing, iterations=iterations, final_q_rms=rms, memory=mem)

    rows = []
    for seq in args.seqs:
        local = seq // n
        auto = choose_strategy("auto", n, args.heads, args.kv_heads, keys_per_device=local)
        arrays = None
        single_arrays = None
        for causal in causals:
            flops = common.attention_flops(args.batch, seq, seq, args.heads, args.head_dim,
                                           causal=causal, mode="fwdbwd")
            local_flops = common.attention_flops(args.batch, local, local, args.heads,
                                                 args.head_dim, causal=causal, mode="fwdbwd")
            base = dict(seq=seq, local_seq=local, devices=n, batch=args.batch, heads=args.heads,
                        kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=args.dtype,
                        causal=causal, mode="fwdbwd", auto_strategy=auto)
            # One device at the local length.
            rec = dict(base, impl="single")
            try:
                if single_arrays is None:
                    single_arrays = draw(local, jax.sharding.SingleDeviceSharding(devices[0]), seed=1)
                rec.update(timed(attention(causal), single_arrays, local_flops))
                if "median_s" in rec:
                    rec["tflops"] = common.tflops(local_flops, rec["median_s"])
            except Exception as exc:  # recorded; the run goes on
                rec["error"] = f"{type(exc).__name__}: {exc}"[:2000]
                traceback.print_exc()
            payload["records"].append(rec)
            common.write_json(out_path, payload)
            single = rec.get("tflops")
            times = {}
            for strategy, layout in configs(causal):
                rec = dict(base, impl="context_parallel", strategy=strategy, layout=layout)
                try:
                    if arrays is None:
                        single_arrays = None  # free the single-device copies first
                        arrays = draw(seq, seq_sharded, seed=2)
                    rec.update(timed(attention(causal), arrays, flops / n,
                                     ctx=context(strategy, layout)))
                    if "median_s" in rec:
                        rec["tflops_per_device"] = common.tflops(flops / n, rec["median_s"])
                        rec["efficiency"] = (rec["tflops_per_device"] / single) if single else None
                        times[(strategy, layout)] = rec["median_s"]
                except Exception as exc:
                    rec["error"] = f"{type(exc).__name__}: {exc}"[:2000]
                    traceback.print_exc()
                payload["records"].append(rec)
                common.write_json(out_path, payload)
                rows.append([seq, "yes" if causal else "no",
                             strategy + (" (auto)" if strategy == auto else ""), layout,
                             common.fmt_rate(single), common.fmt_rate(rec.get("tflops_per_device")),
                             common.fmt(rec.get("efficiency"), 3), rec.get("skipped") or
                             (rec.get("error", "")[:40] or "")])
            if causal:
                for strategy in args.strategies:
                    z, c = times.get((strategy, "zigzag")), times.get((strategy, "contiguous"))
                    if z and c:
                        payload["records"].append(dict(base, impl="balance", strategy=strategy,
                                                       contiguous_over_zigzag=c / z))
                        rows.append([seq, "yes", strategy, "balance", None, None,
                                     common.fmt(c / z, 3), "time contiguous / zigzag"])
            common.write_json(out_path, payload)
        del arrays, single_arrays
    print(common.format_table(
        ["seq", "causal", "strategy", "layout", "single TFLOP/s", "per-device TFLOP/s",
         "efficiency", "note"], rows))
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

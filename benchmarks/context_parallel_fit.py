"""A sequence too long for one GPU, run context-parallel on n.

One forward+backward step (common.make_loop's body: flash_attention, its vjp,
the next q from the normalised dq) is compiled for the same shapes twice:
for one device that holds the whole sequence, and for the sequence sharded
over n devices in the balanced (zigzag) layout on the ring. XLA's static
buffer sizes of both are compared with the device's memory limit; then the
sharded step's executable runs (its second call timed), and with
--one-device the one-device step's is tried, which should fail to
allocate. The one-device try gets a process of its own: after its failed
allocation, the ring's large buffers could not be placed in the same
process.

Default: batch 4, 64 query heads over 8 kv heads, head dim 128, bfloat16,
causal, seq 327680, n = 2 (the first --devices of jax.devices()).

  python3 -P benchmarks/context_parallel_fit.py --out $OUT/cp_fit.json
  python3 -P benchmarks/context_parallel_fit.py --one-device --out $OUT/cp_fit_one.json
  python3 -P benchmarks/context_parallel_fit.py --smoke    # tiny, 2 CPU devices

The allocator may use 95% of a GPU's memory here (XLA_PYTHON_CLIENT_MEM_FRACTION,
unless set), not jax's default 75%, so that "does not fit" means the device.
Results record the device, jax version and commit.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=327680)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--one-device", action="store_true",
                   help="only try the one-device step (expected to fail to allocate)")
    p.add_argument("--out", type=pathlib.Path, default=None)
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes on 2 simulated CPU devices (no memory limit there)")
    args = p.parse_args(argv)
    if args.smoke:
        args.seq, args.batch, args.heads, args.kv_heads, args.head_dim = 256, 1, 4, 2, 32
        args.dtype = "float32"
    if args.seq % (2 * args.devices):
        p.error(f"--seq {args.seq} is not a multiple of 2 * --devices")
    return p, args


def main(argv=None):
    parser, args = parse_args(argv)
    if args.smoke and "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={args.devices}")
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from jax.sharding import SingleDeviceSharding

    import common
    import jflash

    if jax.default_backend() != "gpu" and not args.smoke:
        parser.error(f"jax runs on {jax.default_backend()}: this benchmark is for GPUs (--smoke on CPU)")
    if len(jax.devices()) < args.devices:
        parser.error(f"needs {args.devices} devices, jax sees {len(jax.devices())}")
    n = args.devices
    devices = jax.devices()[:n]
    env = common.environment_record()
    out_path = args.out or common.default_results_path(f"cp_fit_x{n}", env["device_kind"])
    dtype = jnp.dtype(args.dtype)
    shapes = [(args.batch, args.seq, h, args.head_dim)
              for h in (args.heads, args.kv_heads, args.kv_heads, args.heads)]
    stats = devices[0].memory_stats() or {}
    limit = stats.get("bytes_limit")  # None on CPU
    mesh = jax.make_mesh((n,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,), devices=devices)
    one, sharded = SingleDeviceSharding(devices[0]), NamedSharding(mesh, P(None, "seq"))
    loop = common.make_loop(lambda q, k, v: jflash.flash_attention(q, k, v, causal=True),
                            "fwdbwd", 1, feed="out")
    payload = dict(environment=env, config=common.args_record(args, out=out_path),
                   bytes_limit=limit)

    def ring():
        stack = contextlib.ExitStack()
        stack.enter_context(jflash.context_parallel_strategy("ring"))
        stack.enter_context(jflash.sequence_layout("zigzag", n))
        return stack

    def compile_step(sharding, ctx=None):
        """The step's executable for these shardings, and its static buffer sizes.

        The executable is what runs below: called through `loop`, the step
        would be compiled a second time."""
        specs = [jax.ShapeDtypeStruct(s, dtype, sharding=sharding) for s in shapes]
        t0 = time.perf_counter()
        with ctx or contextlib.nullcontext():
            step = loop.lower(*specs).compile()
        m = common.memory_stats(step)
        return step, dict(m, total=(m["argument_size_in_bytes"] + m["output_size_in_bytes"]
                                    + m["temp_size_in_bytes"] - m["alias_size_in_bytes"]),
                          compile_s=time.perf_counter() - t0)

    def draw(sharding, seed):
        def make(key):
            keys = jax.random.split(key, 4)
            return tuple(jax.random.normal(k, s, jnp.float32).astype(dtype)
                         for k, s in zip(keys, shapes))

        return jax.jit(make, out_shardings=(sharding,) * 4)(jax.random.key(seed))

    gb = lambda b: f"{b / 1e9:.1f} GB" if b is not None else "-"  # noqa: E731
    if args.one_device:
        step, payload["one_device_bytes"] = compile_step(one)
        try:
            jax.block_until_ready(step(*draw(one, seed=1)))
            payload["one_device"] = "ran"
        except Exception as exc:  # the expected outcome: recorded
            payload["one_device"] = f"{type(exc).__name__}: {exc}"[:600]
        print(f"one device: static buffers {gb(payload['one_device_bytes']['total'])} "
              f"(limit {gb(limit)}): {payload['one_device'][:200]}")
    else:
        payload["one_device_bytes"] = compile_step(one)[1]
        step, payload["ring_bytes_per_device"] = compile_step(sharded, ring())
        print(f"static buffers: one device {gb(payload['one_device_bytes']['total'])}, "
              f"ring {gb(payload['ring_bytes_per_device']['total'])} per device (limit {gb(limit)})")
        arrays = draw(sharded, seed=2)
        t0 = time.perf_counter()
        jax.block_until_ready(step(*arrays))
        t1 = time.perf_counter()
        final = jax.block_until_ready(step(*arrays))
        t2 = time.perf_counter()
        flops = common.attention_flops(args.batch, args.seq, args.seq, args.heads, args.head_dim,
                                       causal=True, mode="fwdbwd")
        payload.update(ring_first_call_s=t1 - t0, ring_s=t2 - t1,
                       ring_tflops_per_device=common.tflops(flops / n, t2 - t1),
                       final_q_rms=common.check_finite_nonzero(final[0]),
                       peak_bytes_in_use=[(d.memory_stats() or {}).get("peak_bytes_in_use")
                                          for d in devices])
        print(f"ring on {n} x {env['device_kind']}: {t2 - t1:.2f} s per step, "
              f"{payload['ring_tflops_per_device']:.1f} TFLOP/s per device, peak "
              f"{', '.join(gb(b) for b in payload['peak_bytes_in_use'])}")
    common.write_json(out_path, payload)
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

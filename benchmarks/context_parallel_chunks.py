"""The ring's per-device work done as chunks on ONE device, against one call.

Context parallelism over n devices splits a sequence into chunk pairs, each a
kernel call with its own band, merged through their lse. This script runs all
n devices' work of the balanced causal (zigzag) layout, n = --chunks, on one
GPU: the same kernel calls the ring makes, in sequence, without the transfers.
The ratio to one flash_attention call on the whole sequence is the kernels'
efficiency at chunk size (what shorter calls and the merges cost), the ceiling
of a ring whose transfers are hidden.

What a ring device does, and only that, is charged. Each step's running sums
(the forward's float32 output and lse, a K/V block's dK and dV) are
materialized, as the ring's loop carries them from step to step (otherwise
XLA fuses a device's merges into a few passes after all its calls). The
chunks take their inputs and give their outputs in the layout the ring's
devices hold (zigzag for causal calls: README, "Context parallelism"): a model
permutes its tokens into that layout once per batch, not per attention call,
so the permutation is made once before the timed loop. The one call on the
whole sequence takes the tokens in order.

Default grid: sequence 64k and 128k, bfloat16, head dim 128, 16 query heads
over 8 kv heads, batch 1, causal and not, forward+backward, 8 chunks.

  python3 -P benchmarks/context_parallel_chunks.py --out $OUT/cp_chunks.json
  python3 -P benchmarks/context_parallel_chunks.py --smoke    # tiny, on CPU

TFLOP/s use common.attention_flops (fwd+bwd: 3.5x fwd; causal halved) for
both rows, so the ratio is a ratio of times. Results record the device name,
jax version and commit (common.environment_record).
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys
import traceback

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import common  # noqa: E402


def ring_pairs(n, causal, block, idx, step):
    """The chunk pairs device idx computes at ring step `step` (zigzag layout):
    [(first q row, q rows, keys, diag_hi)] within its q block and the K/V block
    of device (idx - step) % n, the keys always the block's first ones (the
    kernels add their dK, dV at the sums' first rows); as context_parallel.py's
    ring."""
    if not causal:
        return [(0, block, block, block)]
    if step == 0:
        return [(0, block, block, 0)]
    half = block // 2
    if (idx - step) % n < idx:
        return [(0, block, half, half)]
    return [(half, half, block, block)]


def chunked_attention(n, causal):
    """attention(q, k, v) -> out, computed as the n devices of a ring would, one
    device after the other on this device; q, k, v and out in the ring's layout
    (zigzag_layout(x, n, causal))."""
    import jax
    import jax.numpy as jnp

    from jflash._src import context_parallel as cp
    from jflash._src import ring_attention as ra
    from jflash._src import validation

    # As flash_attention(..., precision=None) would: the float32 kernels'
    # passes at JAX's default matmul precision (bfloat16 inputs ignore them).
    tf32 = validation.tf32_passes(None)

    f32 = jnp.float32

    def blocks(x):
        b = x.shape[1] // n
        return [x[:, i * b:(i + 1) * b] for i in range(n)]

    @jax.custom_vjp
    def attention_zigzag(q, k, v):
        return forward(q, k, v)[0]

    def forward(q, k, v):
        fwd_call = ra._fwd_call(q.shape[-1] ** -0.5, tf32)
        qs, ks, vs = blocks(q), blocks(k), blocks(v)
        block = qs[0].shape[1]
        outs, lses = [], []
        for idx in range(n):
            out = lse = None
            for step in range(n):
                src = (idx - step) % n
                for r0, rn, kn, hi in ring_pairs(n, causal, block, idx, step):
                    part = fwd_call(qs[idx][:, r0:r0 + rn], ks[src][:, :kn], vs[src][:, :kn],
                                    -rn, hi)
                    if out is None:  # step 0, all rows: as the ring, no merge
                        out, lse = part[0].astype(f32), part[1]
                        continue
                    o, l_ = cp.merge((out[:, r0:r0 + rn], lse[..., r0:r0 + rn]), part)
                    out, lse = out.at[:, r0:r0 + rn].set(o), lse.at[..., r0:r0 + rn].set(l_)
                    # Each step's sum materialized, as the ring's loop carries
                    # it; otherwise XLA would fuse a device's merges into one
                    # pass after all its calls, which the ring's loop cannot.
                    out, lse = _step_end((out, lse))
            outs.append(out.astype(q.dtype))
            lses.append(lse)
        # Materialized, as the backward's gradients below.
        return jax.lax.optimization_barrier((jnp.concatenate(outs, 1), jnp.concatenate(lses, 2)))

    def attention_fwd(q, k, v):
        out, lse = forward(q, k, v)
        return out, (q, k, v, out, lse)

    def attention_bwd(residuals, dout):
        q, k, v, out, lse = residuals
        bwd_call = ra._bwd_call(q.shape[-1] ** -0.5, tf32)
        qs, ks, vs, os_, dos = (blocks(x) for x in (q, k, v, out, dout))
        block = qs[0].shape[1]
        lses = [lse[..., i * block:(i + 1) * block] for i in range(n)]
        dq = [None] * n
        # As the ring: one float32 dK, dV sum per K/V block, which the kernels
        # add into.
        dkv = [bwd_call.dkv_zeros(x) for x in ks]
        for idx in range(n):
            # As the ring: the first step's call (all of the block's rows)
            # starts the float32 dq sum and gives the rows' delta, the later
            # ones add into it.
            dlse = jnp.zeros_like(lses[idx])
            delta = None
            for step in range(n):
                src = (idx - step) % n
                for r0, rn, kn, hi in ring_pairs(n, causal, block, idx, step):
                    rows = slice(r0, r0 + rn)
                    q_rows, k_keys, v_keys = qs[idx][:, rows], ks[src][:, :kn], vs[src][:, :kn]
                    if delta is None:
                        dq[idx], dkv[src], delta = bwd_call.start(
                            q_rows, k_keys, v_keys, os_[idx][:, rows], dos[idx][:, rows],
                            lses[idx][..., rows], dlse[..., rows], -rn, hi, dkv[src],
                        )
                    else:
                        dq[idx], dkv[src] = bwd_call.add(
                            dq[idx], r0, dkv[src], q_rows, k_keys, v_keys, dos[idx][:, rows],
                            lses[idx][..., rows], delta[..., rows], -rn, hi,
                        )
        dq = [bwd_call.dq(acc, q.dtype) for acc in dq]
        dks, dvs = zip(*(bwd_call.dkv(acc, k.dtype) for acc in dkv))
        grads = (jnp.concatenate(dq, 1), jnp.concatenate(dks, 1), jnp.concatenate(dvs, 1))
        # Materialized, as a ring's outputs are (they leave a shard_map and a
        # loop): otherwise XLA fuses the caller's use of dq into the chunks'
        # chain of updates (the timed loop's rms of dq took 8.3 ms of a 118 ms
        # step at seq 64k causal, H200, against 0.07 ms on one call's dq).
        return jax.lax.optimization_barrier(grads)

    attention_zigzag.defvjp(attention_fwd, attention_bwd)
    return attention_zigzag


def _step_end(carry):
    """The state a ring's step leaves for the next one, materialized."""
    import jax

    return jax.lax.optimization_barrier(carry)


def zigzag_layout(x, n, causal, inverse=False):
    """x [batch, seq, ...] in the layout the chunks take (zigzag for causal
    calls, token order otherwise), or back with inverse."""
    from jflash._src import context_parallel as cp

    if not causal:
        return x
    return (cp.from_zigzag if inverse else cp.to_zigzag)(x, n, 1)


def _check(n, causal):
    """The chunked computation against one call (smoke runs): out and grads."""
    import jax
    import jax.numpy as jnp

    import jflash

    keys = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(keys[0], (1, 8 * n, 4, 32))
    k = jax.random.normal(keys[1], (1, 8 * n, 2, 32))
    v = jax.random.normal(keys[2], k.shape)
    cot = jax.random.normal(keys[3], q.shape)
    errs = []
    layout = functools.partial(zigzag_layout, n=n, causal=causal)
    out, vjp = jax.vjp(chunked_attention(n, causal), *(layout(x) for x in (q, k, v)))
    errs.append(tuple(layout(x, inverse=True) for x in (out, *vjp(layout(cot)))))
    out, vjp = jax.vjp(lambda q, k, v: jflash.flash_attention(q, k, v, causal=causal), q, k, v)
    errs.append((out, *vjp(cot)))
    worst = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(*errs))
    if not worst < 1e-4:
        raise AssertionError(f"chunks differ from one call by {worst:g} (causal={causal})")
    return worst


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[65536, 131072])
    parser.add_argument("--chunks", type=int, default=8, help="ring devices simulated")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--causal", default="both", choices=("yes", "no", "both"))
    parser.add_argument("--mode", default="fwdbwd", choices=common.MODES)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--target-ms", type=float, default=300.0)
    parser.add_argument("--max-iterations", type=int, default=20)
    parser.add_argument("--out", type=pathlib.Path, default=None)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes (seq 256, 4 heads over 2, head dim 32), runs on CPU")
    args = parser.parse_args(argv)
    if args.smoke:
        args.seqs, args.heads, args.kv_heads, args.head_dim = [256], 4, 2, 32
        args.repeats, args.target_ms = 2, 20.0
        args.dtype = "float32"
    for seq in args.seqs:
        if seq % (2 * args.chunks):
            parser.error(f"--seqs: {seq} is not a multiple of 2 * --chunks = {2 * args.chunks}")
    if args.heads % args.kv_heads:
        parser.error("--heads must be a multiple of --kv-heads")

    import jax
    import jax.numpy as jnp

    import jflash

    platform = jax.default_backend()
    if platform != "gpu" and not args.smoke:
        parser.error(f"jax runs on {platform}: this benchmark is for a GPU (use --smoke on CPU)")
    env = common.environment_record()
    out_path = args.out or common.default_results_path("cp_chunks", env["device_kind"])
    causals = {"yes": [True], "no": [False], "both": [True, False]}[args.causal]
    dtype = jnp.dtype(args.dtype)
    payload = dict(environment=env, config=common.args_record(args, out=out_path), records=[])
    rate = 3e14 if platform == "gpu" else 3e10
    print(f"{env['device_kind']}, jax {env['jax_version']}, commit {env['jflash_commit']}")
    if args.smoke:
        for causal in causals:
            print(f"check causal={causal}: max |chunks - whole| = {_check(args.chunks, causal):.2e}")
    rows = []
    for seq in args.seqs:
        keys = jax.random.split(jax.random.key(seq), 4)
        q = jax.random.normal(keys[0], (args.batch, seq, args.heads, args.head_dim)).astype(dtype)
        k = jax.random.normal(keys[1], (args.batch, seq, args.kv_heads, args.head_dim)).astype(dtype)
        v = jax.random.normal(keys[2], k.shape).astype(dtype)
        cot = jax.random.normal(keys[3], q.shape).astype(dtype)
        for causal in causals:
            flops = common.attention_flops(args.batch, seq, seq, args.heads, args.head_dim,
                                           causal=causal, mode=args.mode)
            result = {}
            impls = {
                "whole": lambda q, k, v, c=causal: jflash.flash_attention(q, k, v, causal=c),
                "chunks": chunked_attention(args.chunks, causal),
            }
            # The chunks' inputs in the ring's layout, made once (module docstring).
            inputs = {"whole": (q, k, v, cot),
                      "chunks": tuple(zigzag_layout(x, args.chunks, causal) for x in (q, k, v, cot))}
            for name, fn in impls.items():
                rec = dict(impl=name, seq=seq, batch=args.batch, heads=args.heads,
                           kv_heads=args.kv_heads, head_dim=args.head_dim, causal=causal,
                           mode=args.mode, dtype=args.dtype, chunks=args.chunks)
                if name == "chunks":
                    rec["layout"] = "zigzag" if causal else "contiguous"  # made once, untimed
                try:
                    iterations = common.iterations_for(flops, rate, args.target_ms / 1e3,
                                                       hi=args.max_iterations)
                    # feed "out": every iteration's q is the last one's dq (or out),
                    # so no chunk's inputs stay the same across iterations. With the
                    # default feed, which changes only q[0, 0, 0, 0], XLA may hoist the
                    # calls of the other chunks out of the timed loop: a first run on an
                    # H100 timed unmasked chunks at 2.4x one whole call, above the
                    # chip's peak.
                    loop = common.make_loop(fn, args.mode, iterations, feed="out")
                    timing = common.time_loop(loop, inputs[name], iterations=iterations,
                                              min_repeats=args.repeats)
                    rec["final_q_rms"] = common.check_finite_nonzero(timing.pop("last_carry")[0])
                    rec.update(timing, iterations=iterations)
                    rec["tflops"] = common.tflops(flops, timing["median_s"])
                    result[name] = rec["tflops"]
                except Exception as exc:  # recorded; the run goes on
                    rec["error"] = f"{type(exc).__name__}: {exc}"[:2000]
                    traceback.print_exc()
                payload["records"].append(rec)
                common.write_json(out_path, payload)
            ratio = (result["chunks"] / result["whole"]
                     if result.get("chunks") and result.get("whole") else None)
            payload["records"].append(dict(impl="ratio", seq=seq, causal=causal,
                                           chunks_over_whole=ratio))
            common.write_json(out_path, payload)
            rows.append([seq, "yes" if causal else "no", common.fmt_rate(result.get("whole")),
                         common.fmt_rate(result.get("chunks")), common.fmt(ratio, 3)])
    print(common.format_table(
        ["seq", "causal", "whole TFLOP/s", f"{args.chunks} chunks TFLOP/s", "chunks/whole"], rows))
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

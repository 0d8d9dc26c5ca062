"""dq precision on sharply peaked attention: jflash and jax.nn against float64.

The backward's dS = P * (dP - delta) takes delta = rowsum(dO * O) (FlashAttention's
identity: rowsum(P * dP) = rowsum(dO * O)). The kernels read O as the forward
stored it, rounded to bfloat16, so delta carries that rounding: about
2^-9 * sqrt(head_dim) * |dO| |O| for unit data. Where a row's softmax is sharply
peaked, dP - delta nearly cancels at the keys that carry the row's weight, the
true dS and dq are tiny, and the rounding of delta is what is left: dq gets
-softmax_scale * err(delta) * (P @ K)_i, the attention-weighted key. jax.nn's
XLA attention differentiates its float32 softmax instead (delta from P itself),
whose dS sums to zero over the keys up to float32 rounding.

The inputs show it plainly: keys k = x + key_offset * e0 (a component shared by
every key, as the keys of trained models often have: the softmax does not see
it, since it adds the same q . e0 to a whole row) and queries q = q_scale * x
(query i a scaled copy of key i's own part, so that row i peaks on key i; at
head dim 128, q_scale 1.5 puts a median 0.9999 of each row on its largest
probability). The true dq does not depend on key_offset (the dS of a row sums
to zero); the rounding of delta is multiplied by it. v and dO are standard
normal. Everything is rounded to bfloat16 first; the float64 reference
(numpy, in blocks of query rows) computes on those rounded values.

Rows, per case:
  jflash        jflash.flash_attention's dq
  xla           jax.nn.dot_product_attention(implementation="xla")'s dq
  cudnn         implementation="cudnn" (GPU only, when asked for)
  f64 bf16-O    float64 math except delta = rowsum(dO * O rounded to bfloat16):
                the error the rounding of O alone explains

  python3 -P benchmarks/dq_precision.py                    # CPU or GPU, seconds
  python3 -P benchmarks/dq_precision.py --head-dims 64 128 256 --seqs 512 4096 \\
      --impls jflash,xla,cudnn --out $OUT/dq_precision.json
  python3 -P benchmarks/dq_precision.py --key-offset 0 --q-scale 8 --aligned no  # q * 8 data

The default case (head dim 128, seq 512, 4 heads, q_scale 1.5, key_offset 64,
seed 0) gives a true max |dq| of 0.031, a jflash error of 0.34 and an xla error
of 1.1e-4 (0.020, 0.40 and 9.5e-5 with --causal yes), the figures the issue
reports; the f64 bf16-O row gives jflash's error to two digits. Without the
offset (--key-offset 0) jflash's error is 0.014 there, still 130x xla's; with
--q-scale 8 --aligned no --key-offset 0 (the gpu_benchmark's peaked data, a
median largest probability of 0.78) the two are alike (0.016 and 0.027).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import common  # noqa: E402

IMPLS = ("jflash", "xla", "cudnn")
EMULATED = "f64 bf16-O"


def inputs(seed, batch, seq, heads, head_dim, *, q_scale, key_offset, aligned):
    """q, k, v, dO [batch, seq, heads, head_dim] as float32 arrays of bfloat16
    values (see the module docstring)."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    shape = (batch, seq, heads, head_dim)
    x, v, dout = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))
    q = q_scale * (x if aligned else rng.standard_normal(shape).astype(np.float32))
    k = x.copy()
    k[..., 0] += key_offset
    return tuple(np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))
                 for a in (q, k, v, dout))


def reference(q, k, v, dout, *, causal, scale, block=1024):
    """Float64 dq, the dq of float64 math with delta from O rounded to bfloat16,
    and each row's largest probability, [batch, seq, heads, head_dim] (the last
    [batch, heads, seq]). Row blocks keep the score matrix [block, seq]."""
    import jax.numpy as jnp

    def bf16(x):
        return np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), np.float64)

    batch, seq, heads, _ = q.shape
    dq = np.zeros(q.shape, np.float64)
    dq_emulated = np.zeros(q.shape, np.float64)
    max_prob = np.zeros((batch, heads, seq), np.float64)
    for b in range(batch):
        for h in range(heads):
            qh, kh, vh, doh = (np.asarray(a[b, :, h], np.float64) for a in (q, k, v, dout))
            for r0 in range(0, seq, block):
                rows = slice(r0, min(seq, r0 + block))
                s = scale * (qh[rows] @ kh.T)
                if causal:
                    i = np.arange(rows.start, rows.stop)[:, None]
                    s = np.where(np.arange(seq)[None, :] <= i, s, -np.inf)
                p = np.exp(s - s.max(axis=1, keepdims=True))
                p /= p.sum(axis=1, keepdims=True)
                out = p @ vh
                dp = doh[rows] @ vh.T
                delta = np.sum(p * dp, axis=1, keepdims=True)
                delta_bf16_o = np.sum(doh[rows] * bf16(out), axis=1, keepdims=True)
                dq[b, rows, h] = scale * ((p * (dp - delta)) @ kh)
                dq_emulated[b, rows, h] = scale * ((p * (dp - delta_bf16_o)) @ kh)
                max_prob[b, h, rows] = p.max(axis=1)
    return dq, dq_emulated, max_prob


def impl_dq(impl, q, k, v, dout, *, causal, dtype):
    """impl's dq in float64, from inputs rounded to dtype."""
    import jax
    import jax.numpy as jnp

    if impl == "jflash":
        import jflash

        def attention(q, k, v):
            return jflash.flash_attention(q, k, v, causal=causal)
    else:
        def attention(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=impl)

    @jax.jit
    def grad_q(q, k, v, dout):
        _, vjp = jax.vjp(attention, q, k, v)
        return vjp(dout)[0]

    args = [jnp.asarray(a, dtype) for a in (q, k, v, dout)]
    return np.asarray(grad_q(*args).astype(jnp.float32), np.float64)


def errors(got, want):
    diff = got - want
    return dict(max_abs_dq_err=float(np.max(np.abs(diff))),
                rms_dq_err=float(np.sqrt(np.mean(diff * diff))),
                max_abs_dq_err_offset_coord=float(np.max(np.abs(diff[..., 0]))),
                max_abs_dq_err_other_coords=float(np.max(np.abs(diff[..., 1:])))
                if diff.shape[-1] > 1 else 0.0)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128])
    parser.add_argument("--seqs", type=int, nargs="+", default=[512])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--q-scale", type=float, default=1.5)
    parser.add_argument("--key-offset", type=float, default=64.0,
                        help="added to every key's first coordinate (the softmax ignores it)")
    parser.add_argument("--aligned", choices=("yes", "no"), default="yes",
                        help="yes: q = q_scale * (key i's own part); no: q = q_scale * normal")
    parser.add_argument("--causal", choices=("no", "yes"), default="no")
    parser.add_argument("--impls", default="jflash,xla", help="comma list of " + ",".join(IMPLS))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    impls = common.comma_list(parser, "--impls", args.impls, IMPLS)

    import jax

    env = common.environment_record()
    platform = jax.devices()[0].platform
    causal = args.causal == "yes"
    print(f"{env['device_kind']}, jax {env['jax_version']}, jflash {env['jflash_commit']}, "
          f"{args.dtype}, q_scale {args.q_scale}, key_offset {args.key_offset}, "
          f"aligned {args.aligned}, causal {args.causal}", flush=True)
    records, rows = [], []
    started = time.perf_counter()
    for head_dim in args.head_dims:
        for seq in args.seqs:
            q, k, v, dout = inputs(args.seed, args.batch, seq, args.heads, head_dim,
                                   q_scale=args.q_scale, key_offset=args.key_offset,
                                   aligned=args.aligned == "yes")
            dq, dq_emulated, max_prob = reference(q, k, v, dout, causal=causal,
                                                  scale=head_dim ** -0.5)
            case = dict(head_dim=head_dim, seq=seq, batch=args.batch, heads=args.heads,
                        causal=causal, dtype=args.dtype, q_scale=args.q_scale,
                        key_offset=args.key_offset, aligned=args.aligned == "yes",
                        true_max_abs_dq=float(np.max(np.abs(dq))),
                        max_prob_median=float(np.median(max_prob)),
                        max_prob_min=float(np.min(max_prob)))
            results = {EMULATED: dict(status="ok", **errors(dq_emulated, dq))}
            for impl in impls:
                if impl == "cudnn" and platform != "gpu":
                    results[impl] = dict(status="unavailable", note="cuDNN needs a CUDA GPU")
                    continue
                try:
                    got = impl_dq(impl, q, k, v, dout, causal=causal, dtype=args.dtype)
                    results[impl] = dict(status="ok", **errors(got, dq))
                except Exception as exc:  # recorded; the other impls still run
                    results[impl] = dict(status="error", note=f"{type(exc).__name__}: {exc}"[:500])
            for impl, result in results.items():
                records.append(dict(case, impl=impl, **result))
                ok = result["status"] == "ok"
                rows.append([head_dim, seq, common.fmt(case["max_prob_median"], 4),
                             f"{case['true_max_abs_dq']:.3g}", impl,
                             f"{result['max_abs_dq_err']:.3g}" if ok else result["status"],
                             f"{result['max_abs_dq_err_offset_coord']:.3g}" if ok else None,
                             f"{result['max_abs_dq_err_other_coords']:.3g}" if ok else None,
                             f"{result['max_abs_dq_err'] / case['true_max_abs_dq']:.3g}"
                             if ok and case["true_max_abs_dq"] > 0 else None])
            print(f"[{time.perf_counter() - started:6.1f}s] D{head_dim} S{seq} done", flush=True)
    print(common.format_table(
        ["D", "seq", "median max p", "true max|dq|", "impl", "max|dq err|", "coord 0",
         "other coords", "err / true"], rows))
    if args.out:
        payload = dict(benchmark="dq_precision", environment=env,
                       args=common.args_record(args),
                       records=records)
        print(f"results: {common.write_json(args.out, payload)}")


if __name__ == "__main__":
    main()

"""Decode over a KV cache: jflash's achieved bandwidth against the device's copy bandwidth
and against jax.nn.dot_product_attention (XLA, cuDNN), in one run.

Grid (the decode issue's): bfloat16, head dim 128, 64 query heads over 8 kv heads, one
query token; batch 1 / 8 / 32; caches of 2k to 128k keys; contiguous and paged (blocks
of 64 and 256) caches. Rows per (batch, cache):
  jflash         flash_attention_with_kvcache over the cache (cache_seqlens = cache)
  jflash_append  the same with one new key and value appended in place (the decode step;
                 the caches are loop carries, so XLA updates them in place)
  xla, cudnn     jax.nn.dot_product_attention(key_value_seq_lengths=...) over the same
                 keys (contiguous only; cuDNN where jax accepts the call)

Achieved bandwidth = (bytes of K and V read + bytes written) / time: the keys attended
(cache, plus the new one for jflash_append) times num_heads_kv * head_dim * 2 (K and V)
* 2 bytes, plus out (and the appended rows). It is compared with the bandwidth of a large
jnp elementwise copy (x + 1: bytes read + written over its time) measured in the same run.

Each timed call reads a different copy of the cache, up to --rotate-mb of copies, so that
caches smaller than the GPU's L2 are read from HBM as in a model's decode step (a model
reads each layer's cache once per token), not from L2.

  python3 -P benchmarks/decode_benchmark.py                         # the whole grid
  python3 -P benchmarks/decode_benchmark.py --batches 8 --caches 8192 --layouts contiguous
  python3 -P benchmarks/decode_benchmark.py --batches 1 8 --caches 8192 --layouts contiguous \
      --impls jflash --num-splits auto 1 2 4 8 16 32 33 64  # the split curve, one row each
  python3 -P benchmarks/decode_benchmark.py --allow-cpu --smoke     # tiny sizes, logic only
  python3 -P benchmarks/decode_benchmark.py --plot                  # PNG beside the JSON
                                                        # (benchmarks/plot.py's decode mode)
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import common  # noqa: E402

IMPLS = ("jflash", "jflash_append", "xla", "cudnn")
LAYOUTS = ("contiguous", "paged64", "paged256")
CACHES = (2048, 4096, 8192, 16384, 32768, 65536, 131072)
BATCHES = (1, 8, 32)
SMOKE = dict(batches=[1, 2], caches=[256, 1024], copy_mb=64, rotate_mb=0, max_iterations=20,
             repeats=2)


def make_cache(key, batch, capacity, args):
    """K and V caches [batch, capacity, kv_heads, head_dim], standard normal."""
    import jax
    import jax.numpy as jnp

    shape = (batch, capacity, args.kv_heads, args.head_dim)
    k1, k2 = jax.random.split(key)
    # Drawn in the cache's dtype: a float32 draw would need twice the cache's bytes
    # (17 GB each for K and V at batch 32, 128k keys).
    return tuple(jax.random.normal(k, shape, jnp.dtype(args.dtype)) for k in (k1, k2))


def to_paged(k_cache, v_cache, block_size, key):
    """The same caches as shuffled blocks of block_size rows, and the block table."""
    import jax
    import jax.numpy as jnp

    batch, capacity, kv_heads, head_dim = k_cache.shape
    per_seq = capacity // block_size
    order = jax.random.permutation(key, batch * per_seq)
    table = jnp.argsort(order).reshape(batch, per_seq).astype(jnp.int32)

    def blocks(x):
        return x.reshape(batch * per_seq, block_size, kv_heads, head_dim)[order]

    return blocks(k_cache), blocks(v_cache), table


def attention_call(impl, layout, args, lengths, table, num_splits=None):
    """f(q, k_cache, v_cache, k_new, v_new) -> (out, k_cache, v_cache): one decode step."""
    import jax

    import jflash

    if impl in ("xla", "cudnn"):
        if layout != "contiguous":
            raise common.Unavailable("jax.nn.dot_product_attention takes contiguous keys only")
        if impl == "cudnn" and jax.devices()[0].platform != "gpu":
            raise common.Unavailable("cuDNN needs a CUDA GPU")

        def peer(q, k_cache, v_cache, k_new, v_new):
            out = jax.nn.dot_product_attention(q, k_cache, v_cache, key_value_seq_lengths=lengths,
                                               implementation=impl)
            return out, k_cache, v_cache

        return peer
    append = impl == "jflash_append"
    # jflash_append writes one key at position `lengths` and attends over lengths + 1.
    seqlens = lengths - 1 if append else lengths

    def step(q, k_cache, v_cache, k_new, v_new):
        kw = dict(cache_seqlens=seqlens, block_table=table, num_splits=num_splits)
        if append:
            return jflash.flash_attention_with_kvcache(q, k_cache, v_cache, k_new=k_new,
                                                       v_new=v_new, **kw)
        return jflash.flash_attention_with_kvcache(q, k_cache, v_cache, **kw), k_cache, v_cache

    return step


def decode_loop(step, copies, iterations):
    """jit(q, caches, k_new, v_new) -> carry after `iterations` steps, each step calling the
    kernel once on every copy of the cache in turn (copies: the number of copies), each call
    depending on the one before through a sliver of its output written into q."""
    import jax

    def body(_, carry):
        q, caches, k_new, v_new = carry
        new_caches = []
        for k_cache, v_cache in caches:
            out, k_cache, v_cache = step(q, k_cache, v_cache, k_new, v_new)
            q = common._write_sliver(q, common._sliver(out))
            new_caches.append((k_cache, v_cache))
        return q, tuple(new_caches), k_new, v_new

    @jax.jit
    def loop(q, caches, k_new, v_new):
        assert len(caches) == copies
        return jax.lax.fori_loop(0, iterations, body, (q, caches, k_new, v_new))

    return loop


def copy_bandwidth(args):
    """Bytes read + written per second of x + 1 over a --copy-mb array."""
    import jax
    import jax.numpy as jnp

    n = args.copy_mb * 2**20 // 2
    x = jnp.ones((n,), jnp.bfloat16)
    iterations = 20
    loop = jax.jit(lambda x: jax.lax.fori_loop(0, iterations, lambda _, x: x + 1, x))
    timing = common.time_loop(loop, (x,), iterations=iterations, min_repeats=args.repeats)
    timing.pop("last_carry")
    return dict(bytes=2 * 2 * n, bandwidth_gbs=2 * 2 * n / timing["median_s"] / 1e9, **timing)


def reference_error(q, k_cache, v_cache, lengths, out):
    """||out - ref|| / ||ref|| on sequence 0, ref in float32 (jax.nn, XLA, HIGHEST)."""
    import jax
    import jax.numpy as jnp

    f32 = lambda x: x[:1].astype(jnp.float32)  # noqa: E731
    with jax.default_matmul_precision("highest"):
        ref = jax.nn.dot_product_attention(f32(q), f32(k_cache), f32(v_cache),
                                           key_value_seq_lengths=lengths[:1],
                                           implementation="xla")
    got = out[:1].astype(jnp.float32)
    return float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))


def heuristic_splits(batch, capacity, args):
    """The split count num_splits=None gives this row on this device."""
    import jax

    from jflash._src import ffi

    on_cpu = jax.devices()[0].platform == "cpu"
    return ffi.decode_num_splits(on_cpu, args.dtype, args.head_dim, batch, args.kv_heads,
                                 args.heads // args.kv_heads, capacity)


def run_row(impl, layout, batch, cache, tensors, args, num_splits=None):
    import jax
    import jax.numpy as jnp

    q, caches, k_new, v_new, table = tensors
    keys = cache + 1 if impl == "jflash_append" else cache
    lengths = jnp.full((batch,), keys, jnp.int32)
    kv_bytes = 2 * batch * keys * args.kv_heads * args.head_dim * 2
    written = q.size * 2 + (2 * batch * args.kv_heads * args.head_dim * 2
                            if impl == "jflash_append" else 0)
    rec = dict(impl=impl, layout=layout, batch=batch, cache=cache, keys=keys,
               heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
               copies=len(caches), bytes=kv_bytes + written + q.size * 2)
    if impl.startswith("jflash"):
        # num_splits: the forced count, None for the heuristic's; splits: the count run.
        capacity = caches[0][0].shape[1] if table is None else table.shape[1] * caches[0][0].shape[1]
        rec["num_splits"] = num_splits
        rec["splits"] = num_splits or heuristic_splits(batch, capacity, args)
    try:
        step = attention_call(impl, layout, args, lengths, table, num_splits)
        if not args.no_check and layout == "contiguous":
            out, k_cache, v_cache = jax.jit(step)(q, *caches[0], k_new, v_new)  # after the append
            rec["rel_err"] = reference_error(q, k_cache, v_cache, lengths, out)
        per_call = rec["bytes"] / args.assumed_gbs / 1e9
        iterations = max(1, min(args.max_iterations,
                                round(args.target_ms / 1e3 / per_call / len(caches))))
        loop = decode_loop(step, len(caches), iterations)
        timing = common.time_loop(loop, (q, tuple(caches), k_new, v_new),
                                  iterations=iterations * len(caches), min_repeats=args.repeats)
        common.record_timing(rec, timing, iterations)
        rec["bandwidth_gbs"] = rec["bytes"] / timing["median_s"] / 1e9
        rec["status"] = "ok"
    except Exception as exc:  # recorded; the other rows still run
        common.record_failure(rec, exc)
    return rec


def row_tensors(key, batch, cache, layout, args):
    """q, the cache copies [(k, v)], k_new, v_new, block table for one (batch, cache)."""
    import jax
    import jax.numpy as jnp

    capacity = -(-(cache + 1) // 256) * 256  # whole blocks of 256, room for the append
    keys = jax.random.split(key, 4)
    kv_bytes = 2 * batch * capacity * args.kv_heads * args.head_dim * 2
    copies = max(1, min(16, math.ceil(args.rotate_mb * 2**20 / kv_bytes)))
    caches, table = [], None
    for i in range(copies):
        k_cache, v_cache = make_cache(jax.random.fold_in(keys[0], i), batch, capacity, args)
        if layout != "contiguous":
            k_cache, v_cache, table = to_paged(k_cache, v_cache, int(layout[5:]), keys[1])
        caches.append((k_cache, v_cache))
    q = jax.random.normal(keys[2], (batch, 1, args.heads, args.head_dim)).astype(args.dtype)
    new = jax.random.normal(keys[3], (2, batch, 1, args.kv_heads, args.head_dim))
    return q, caches, new[0].astype(args.dtype), new[1].astype(args.dtype), table


def default_rows(records):
    """The rows of the default split heuristic (num_splits None), one per
    (impl, layout, batch, cache): what the targets, the summary and the plot read."""
    return [r for r in records if r.get("num_splits") is None]


def targets(records, copy_gbs):
    """The issue's targets, checked row by row (contiguous jflash unless stated)."""
    records = default_rows(records)
    ok = {(r["impl"], r["layout"], r["batch"], r["cache"]): r for r in records
          if r["status"] == "ok"}
    checks = []
    for (impl, layout, batch, cache), r in ok.items():
        if impl not in ("jflash", "jflash_append"):
            continue
        fraction = r["bandwidth_gbs"] / copy_gbs
        need = None
        if batch >= 8 and cache >= 8192:
            need = 0.85
        elif batch == 1 and cache == 8192:
            need = 0.60
        elif batch == 1 and cache == 131072:
            need = 0.85
        if need is not None:
            checks.append(dict(what=f"{impl} {layout} B{batch} cache {cache}: >= {need:.2f} of copy",
                               value=round(fraction, 3), met=fraction >= need))
        base = ok.get((impl, "contiguous", batch, cache))
        if layout != "contiguous" and base:
            ratio = r["bandwidth_gbs"] / base["bandwidth_gbs"]
            checks.append(dict(what=f"{impl} {layout} B{batch} cache {cache}: >= 0.95 x contiguous",
                               value=round(ratio, 3), met=ratio >= 0.95))
        if impl == "jflash" and layout == "contiguous":
            for peer in ("xla", "cudnn"):
                p = ok.get((peer, "contiguous", batch, cache))
                if p:
                    speedup = p["median_s"] / r["median_s"]
                    checks.append(dict(what=f"jflash faster than {peer} B{batch} cache {cache}",
                                       value=round(speedup, 3), met=speedup > 1))
    return checks


def summary(records, copy_gbs):
    records = default_rows(records)
    rows = {}
    for r in records:
        rows.setdefault((r["batch"], r["cache"]), {})[(r["impl"], r["layout"])] = r

    def gbs(cell, impl, layout="contiguous"):
        r = cell.get((impl, layout))
        if r is None:
            return None
        return f"{r['bandwidth_gbs']:.0f}" if r["status"] == "ok" else r["status"][:5]

    def frac(cell, impl, layout="contiguous"):
        r = cell.get((impl, layout))
        return f"{r['bandwidth_gbs'] / copy_gbs:.2f}" if r and r["status"] == "ok" else None

    table = []
    for (batch, cache), cell in sorted(rows.items()):
        table.append([batch, cache, gbs(cell, "jflash"), frac(cell, "jflash"),
                      frac(cell, "jflash_append"), frac(cell, "jflash", "paged64"),
                      frac(cell, "jflash", "paged256"), gbs(cell, "xla"), gbs(cell, "cudnn")])
    headers = ["B", "cache", "jflash GB/s", "of copy", "append", "paged64", "paged256",
               "xla GB/s", "cudnn GB/s"]
    return common.format_table(headers, table)


def split_sweep(records, copy_gbs):
    """Fraction of the copy's bandwidth per forced split count (--num-splits), one
    line per (impl, layout, batch, cache); None where the sweep has one value."""
    swept = sorted({r["num_splits"] for r in records if r.get("num_splits") is not None})
    if not swept:
        return None
    lines = {}
    for r in records:
        if "num_splits" not in r:
            continue
        key = (r["impl"], r["layout"], r["batch"], r["cache"])
        cell = f"{r['bandwidth_gbs'] / copy_gbs:.2f}" if r["status"] == "ok" else r["status"][:5]
        lines.setdefault(key, {})["auto" if r["num_splits"] is None else r["num_splits"]] = cell
        if r["num_splits"] is None:
            lines[key]["heuristic"] = r["splits"]
    columns = ["heuristic", "auto", *swept]
    table = [[*key, *(cells.get(c) for c in columns)] for key, cells in sorted(lines.items())]
    return common.format_table(["impl", "layout", "B", "cache", *map(str, columns)], table)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--caches", type=int, nargs="+", default=list(CACHES))
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-splits", nargs="+", default=["auto"], metavar="N",
                        help="jflash's split counts, one row each: 'auto' (the heuristic) or "
                             "an int in [1, 128] that forces it")
    parser.add_argument("--copy-mb", type=int, default=4096, help="size of the copy's array")
    parser.add_argument("--rotate-mb", type=int, default=256,
                        help="cache copies each timed loop cycles through (0: one copy)")
    parser.add_argument("--target-ms", type=float, default=50.0, help="length of one timed loop")
    parser.add_argument("--max-iterations", type=int, default=2000)
    parser.add_argument("--assumed-gbs", type=float, default=3000.0,
                        help="only sizes the loops; a wrong guess changes their length")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-check", action="store_true", help="skip the float32 reference check")
    parser.add_argument("--time-budget-s", type=float, default=0)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (with --allow-cpu)")
    parser.add_argument("--allow-cpu", action="store_true", help="run without a GPU (logic test)")
    parser.add_argument("--plot", action="store_true", help="bandwidth against cache length, PNG")
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    if args.smoke:  # tiny sizes where the command line leaves the defaults
        for name, value in SMOKE.items():
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)
    try:
        splits = [None if x == "auto" else int(x) for x in args.num_splits]
    except ValueError:
        parser.error(f"--num-splits takes 'auto' or ints, got {args.num_splits}")
    if any(n is not None and not 1 <= n <= 128 for n in splits) or len(set(splits)) < len(splits):
        parser.error(f"--num-splits takes distinct values in [1, 128] or 'auto', got {args.num_splits}")
    layouts = common.comma_list(parser, "--layouts", args.layouts, LAYOUTS)
    impls = common.comma_list(parser, "--impls", args.impls, IMPLS)

    import jax

    platform = common.require_gpu(parser, args.allow_cpu)
    started = time.perf_counter()
    env = common.environment_record()
    default = common.default_results_path(platform, env["device_kind"])
    out = args.out or default.with_name(default.stem + "_decode.json")
    copy = copy_bandwidth(args)
    print(f"{env['device_kind']}, jax {env['jax_version']}, jflash {env['jflash_commit']}; "
          f"copy {copy['bandwidth_gbs']:.0f} GB/s; results -> {out}", flush=True)
    payload = dict(benchmark="decode", environment=env, copy=copy, records=[],
                   args=common.args_record(args),
                   bandwidth="(bytes of K and V read + bytes written) / time")
    records = payload["records"]
    key = jax.random.key(0)
    for batch in args.batches:
        for cache in args.caches:
            for layout in layouts:
                row_impls = [i for i in impls if layout == "contiguous" or i.startswith("jflash")]
                runs = [(i, n) for i in row_impls
                        for n in (splits if i.startswith("jflash") else [None])]
                if args.time_budget_s and time.perf_counter() - started > args.time_budget_s:
                    records += [dict(impl=i, layout=layout, batch=batch, cache=cache,
                                     status="not run", note="--time-budget-s reached",
                                     **({"num_splits": n} if i.startswith("jflash") else {}))
                                for i, n in runs]
                    continue
                tensors = row_tensors(jax.random.fold_in(key, batch * 10**7 + cache), batch, cache,
                                      layout, args)
                for impl, num_splits in runs:
                    rec = run_row(impl, layout, batch, cache, tensors, args, num_splits)
                    if rec["status"] == "ok":
                        rec["fraction_of_copy"] = rec["bandwidth_gbs"] / copy["bandwidth_gbs"]
                    records.append(rec)
                    common.write_json(out, payload)  # a killed run keeps its rows
                    forced = f" splits {rec['splits']:3d}{'' if num_splits else ' (auto)'}" \
                        if "splits" in rec else ""
                    what = (f"{rec['bandwidth_gbs']:8.1f} GB/s ({rec['fraction_of_copy']:.2f} of copy)"
                            f"  {rec['median_s'] * 1e6:9.1f} us"
                            if rec["status"] == "ok" else f"{rec['status']}: {rec.get('note', '')[:100]}")
                    print(f"[{time.perf_counter() - started:6.1f}s] B{batch} cache {cache} "
                          f"{layout:10s} {impl:13s}{forced} {what}", flush=True)
                del tensors
    payload["targets"] = targets(records, copy["bandwidth_gbs"])
    common.write_json(out, payload)
    print(f"\n{env['device_kind']} | jax {env['jax_version']} | jflash {env['jflash_commit'][:12]} | "
          f"{args.dtype}, head dim {args.head_dim}, {args.heads} query heads over {args.kv_heads} "
          f"kv heads, 1 query token | copy {copy['bandwidth_gbs']:.0f} GB/s")
    print(summary(records, copy["bandwidth_gbs"]))
    sweep = split_sweep(records, copy["bandwidth_gbs"])
    if sweep:
        print("\nfraction of the copy's bandwidth by split count (heuristic: the count 'auto' ran)")
        print(sweep)
    for check in payload["targets"]:
        print(f"  {'met ' if check['met'] else 'MISS'} {check['what']}: {check['value']}")
    if args.plot:
        try:
            import plot

            plot.plot_decode(payload, out.with_suffix(".png"))
        except ImportError as exc:
            print(f"--plot needs matplotlib ({exc}); the JSON holds every number")
    print(f"results: {out}")


if __name__ == "__main__":
    main()

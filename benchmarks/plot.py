"""TFLOP/s against sequence length from a gpu_benchmark.py results JSON, as a PNG beside it.

  python3 -P benchmarks/plot.py benchmarks/results/gpu_<device>_<date>.json
  python3 -P benchmarks/plot.py benchmarks/results/gpu_<device>_<date>_decode.json

One panel per (head_dim, causal); in each, one colour per impl (jflash, cuDNN,
XLA), solid for forward, dotted for the backward alone (where the file has
"bwd" rows), dashed for forward+backward. Rows that did not run
(errors, skipped XLA, no GPU) are left out of the lines and listed under the
figure's title count. A cpu_benchmark.py file gives one panel of GFLOP/s.
A decode_benchmark.py file gives achieved bandwidth against cache length, one
panel per batch size: jflash over contiguous and paged caches, XLA and cuDNN,
and the copy's bandwidth of the same run as a dashed line (rows of the split
heuristic only; a --num-splits sweep's forced rows are left out).
matplotlib is a dev-only dependency: `python3 -m pip install matplotlib`.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import matplotlib

matplotlib.use("Agg")  # files only; no display here
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"jflash": "tab:red", "jflash_det": "tab:orange", "cudnn": "tab:blue", "xla": "tab:gray"}
STYLES = {"fwd": "-", "bwd": ":", "fwdbwd": "--"}
MARKERS = {"fwd": "o", "bwd": "^", "fwdbwd": "s"}
MODE_LABEL = {"fwd": "fwd", "bwd": "bwd", "fwdbwd": "fwd+bwd"}


def _panels(records, rate_key):
    """{(head_dim, causal): {(impl, mode): [(seq, rate), ...]}} of the rows that ran."""
    panels = {}
    for r in records:
        key = (r["head_dim"], r["causal"])
        series = panels.setdefault(key, {})
        if r.get("status", "ok") == "ok" and r.get(rate_key) is not None and "error" not in r:
            series.setdefault((r["impl"], r["mode"]), []).append((r["seq"], r[rate_key]))
    return panels


DECODE_SERIES = (  # (impl, layout, colour, line style)
    ("jflash", "contiguous", "tab:red", "-"),
    ("jflash_append", "contiguous", "tab:orange", "--"),
    ("jflash", "paged64", "tab:purple", "-"),
    ("jflash", "paged256", "tab:pink", ":"),
    ("cudnn", "contiguous", "tab:blue", "-"),
    ("xla", "contiguous", "tab:gray", "-"),
)


def _args(payload):
    """The run's arguments: the file's own, or a merged file's first part's
    (benchmarks/merge_results.py keeps each part's under "parts")."""
    if "args" in payload:
        return payload["args"]
    parts = payload.get("parts") or [{}]
    return parts[0].get("args", {})


def _cache_label(n):
    return f"{n // 1024}k" if n >= 1024 else str(n)


def plot_decode(payload, out):
    """Achieved bandwidth (GB/s, and as a fraction of the copy's on the right
    axis) against cache length, one panel per batch size."""
    env = payload.get("environment", {})
    copy_gbs = payload["copy"]["bandwidth_gbs"]
    records = [r for r in payload["records"] if r.get("num_splits") is None]
    ran = [r for r in records if r.get("status") == "ok"]
    if not ran:
        raise SystemExit("no decode rows ran")
    batches = sorted({r["batch"] for r in records})
    caches = sorted({r["cache"] for r in records})
    fig, axes = plt.subplots(1, len(batches), squeeze=False, sharey=True,
                             figsize=(4.6 * len(batches), 3.8))
    for ax, batch in zip(axes[0], batches):
        for impl, layout, color, style in DECODE_SERIES:
            points = sorted((r["cache"], r["bandwidth_gbs"]) for r in ran
                            if r["batch"] == batch and r["impl"] == impl and r["layout"] == layout)
            if points:
                ax.plot(*zip(*points), style, marker="o", markersize=3, color=color,
                        label=f"{impl} {layout}")
        ax.axhline(copy_gbs, color="black", linestyle="--", linewidth=0.8,
                   label=f"jnp copy {copy_gbs:.0f} GB/s")
        ax.set_xscale("log", base=2)
        ax.set_xticks(caches)
        ax.set_xticklabels([_cache_label(c) for c in caches])
        # Above the copy where a device's kernels beat it (the H200's do).
        ax.set_ylim(0, 1.1 * max(copy_gbs, max(r["bandwidth_gbs"] for r in ran)))
        ax.grid(alpha=0.3)
        ax.set_title(f"batch {batch}")
        ax.set_xlabel("cache length (keys)")
        right = ax.secondary_yaxis("right", functions=(lambda y: y / copy_gbs,
                                                       lambda f: f * copy_gbs))
        right.set_ylabel("of copy" if ax is axes[0][-1] else "")
    axes[0][0].set_ylabel("achieved GB/s (K, V read + out written)")
    axes[0][0].legend(fontsize=7, loc="lower right")
    args = _args(payload)
    failed = sum(1 for r in records if r.get("status") != "ok")
    fig.suptitle(
        f"decode: {env.get('device_kind', '?')}, {args.get('dtype', '')}, head dim "
        f"{args.get('head_dim', '?')}, {args.get('heads', '?')} query heads over "
        f"{args.get('kv_heads', '?')} kv heads, 1 token; jax {env.get('jax_version', '?')}, "
        f"jflash {str(env.get('jflash_commit', '?'))[:10]}, {env.get('date_utc', '')[:10]}"
        + (f"\n{failed} rows did not run (see JSON)" if failed else ""),
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot(path, out=None):
    path = pathlib.Path(path)
    payload = json.loads(path.read_text())
    if payload.get("benchmark") == "decode":
        return plot_decode(payload, pathlib.Path(out) if out else path.with_suffix(".png"))
    env = payload.get("environment", {})
    if "records" in payload:
        records, rate_key, unit = payload["records"], "tflops", "TFLOP/s"
    else:  # cpu_benchmark.py
        records, rate_key, unit = payload["rows"], "gflops_per_s", "GFLOP/s"
    panels = _panels(records, rate_key)
    if not panels:
        raise SystemExit(f"{path}: no records")
    head_dims = sorted({hd for hd, _ in panels})
    causals = sorted({c for _, c in panels})
    fig, axes = plt.subplots(len(head_dims), len(causals), squeeze=False,
                             figsize=(5.2 * len(causals), 3.6 * len(head_dims)), sharex=True)
    all_seqs = sorted({r["seq"] for r in records})
    for i, head_dim in enumerate(head_dims):
        for j, causal in enumerate(causals):
            ax = axes[i][j]
            for (impl, mode), points in sorted(panels.get((head_dim, causal), {}).items()):
                points.sort()
                ax.plot([p[0] for p in points], [p[1] for p in points], STYLES.get(mode, ":"),
                        marker=MARKERS.get(mode, "o"), markersize=3, color=COLORS.get(impl),
                        label=f"{impl} {MODE_LABEL.get(mode, mode)}")
            ax.set_xscale("log", base=2)
            ax.set_xticks(all_seqs)
            ax.set_xticklabels([f"{s // 1024}k" if s >= 1024 else str(s) for s in all_seqs])
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.set_title(f"head dim {head_dim}, {'causal' if causal else 'no mask'}")
            if j == 0:
                ax.set_ylabel(unit)
            if i == len(head_dims) - 1:
                ax.set_xlabel("sequence length")
            if ax.lines:
                ax.legend(fontsize=7)
    failed = sum(1 for r in records if r.get("status", "ok") != "ok" or "error" in r)
    fig.suptitle(
        f"{env.get('device_kind', '?')}, {_args(payload).get('dtype', '')}, "
        f"jax {env.get('jax_version', '?')}, jflash {str(env.get('jflash_commit', '?'))[:10]}, "
        f"{env.get('date_utc', '')}\n{unit}: fwd 4*B*H*S^2*D (causal /2), fwd+bwd 3.5x fwd"
        + (f"; {failed} impl/rows did not run (see JSON)" if failed else ""),
        fontsize=9,
    )
    fig.tight_layout()
    out = pathlib.Path(out) if out else path.with_suffix(".png")
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", type=pathlib.Path, nargs="+")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="only with one results file")
    args = parser.parse_args()
    for path in args.results:
        print(plot(path, args.out if len(args.results) == 1 else None))


if __name__ == "__main__":
    main()

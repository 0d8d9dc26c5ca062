"""TFLOP/s against sequence length from a gpu_benchmark.py results JSON, as a PNG beside it.

  python3 -P benchmarks/plot.py benchmarks/results/gpu_<device>_<date>.json

One panel per (head_dim, causal); in each, one colour per impl (jflash, cuDNN,
XLA), solid for forward, dotted for the backward alone (where the file has
"bwd" rows), dashed for forward+backward. Rows that did not run
(errors, skipped XLA, no GPU) are left out of the lines and listed under the
figure's title count. A cpu_benchmark.py file gives one panel of GFLOP/s.
matplotlib is a dev-only dependency: `python3 -m pip install matplotlib`.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import matplotlib

matplotlib.use("Agg")  # files only; no display here
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"jflash": "tab:red", "cudnn": "tab:blue", "xla": "tab:gray"}
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


def plot(path, out=None):
    path = pathlib.Path(path)
    payload = json.loads(path.read_text())
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
        f"{env.get('device_kind', '?')}, {payload.get('args', {}).get('dtype', '')}, "
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

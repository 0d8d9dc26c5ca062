"""Medians of an A/B timing log (tools/ab_bench.sh or a run that calls
quick_bench.py per tree in rounds), one row per configuration.

  python3 tools/ab_summary.py ab_bench.log [--base base]

Input: header lines "== <tree> (round N)" (or "== <tree> round N") followed by
quick_bench.py rows "<mode> <causal> <head_dim> <seq> <ms> <TFLOP/s> [<ms>
<TFLOP/s> of cuDNN]" or benchmarks/gpu_benchmark.py progress lines
"[  1.2s] D64 S512 B32 H32 causal fwd    jflash   165.5 TFLOP/s ...". Output: each tree's median TFLOP/s, its ratio to the base
tree, and the spread (max / min - 1) of the base's rounds. On the H200 the
spread reached 5-10% at seq 512-1024 and ~2% at 16k (docs/cuda_kernels.md, Measuring):
a ratio inside the base's spread is not a result.
"""

from __future__ import annotations

import argparse
import collections
import re
import statistics


def parse(path):
    runs = collections.defaultdict(list)  # (tree, config) -> TFLOP/s per round
    cudnn = collections.defaultdict(list)
    tree = None
    for line in open(path):
        header = re.match(r"==\s+(\S+)\s+\(?round", line)
        if header:
            tree = header.group(1)
            continue
        bench = re.match(r"\[\s*[\d.]+s\]\s+D(\d+)\s+S(\d+)\s+B\d+\s+H\d+\s+(causal|full)\s+"
                         r"(\S+)\s+(jflash|cudnn)\s+([\d.]+) TFLOP/s", line)
        if bench and tree is not None:
            d, seq, mask, mode, impl, rate = bench.groups()
            config = (mode, int(d), mask == "causal", int(seq))
            (runs[tree, config] if impl == "jflash" else cudnn[config]).append(float(rate))
            continue
        fields = line.split()
        if tree is None or len(fields) < 6 or fields[0] not in ("fwd", "fwdbwd"):
            continue
        config = (fields[0], int(fields[2]), fields[1] == "True", int(fields[3]))
        runs[tree, config].append(float(fields[5]))
        if len(fields) >= 8:
            cudnn[config].append(float(fields[7]))
    return runs, cudnn


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("log")
    parser.add_argument("--base", default="base", help="the tree the others are compared with")
    args = parser.parse_args()
    runs, cudnn = parse(args.log)
    trees = list(dict.fromkeys(tree for tree, _ in runs))
    if args.base not in trees:
        raise SystemExit(f"no tree named {args.base!r} in {args.log} (trees: {trees})")
    configs = sorted({config for _, config in runs})
    print("mode    d  causal    seq  " + "  ".join(f"{t:>16}" for t in trees) +
          "  base spread  cudnn")
    for config in configs:
        base = runs.get((args.base, config))
        if not base:
            continue
        cells = []
        for tree in trees:
            values = runs.get((tree, config))
            if not values:
                cells.append(f"{'-':>16}")
                continue
            median = statistics.median(values)
            ratio = median / statistics.median(base)
            cells.append(f"{median:8.1f} ({ratio:5.3f})")
        spread = max(base) / min(base) - 1
        peer = f"{statistics.median(cudnn[config]):6.1f}" if cudnn.get(config) else "     -"
        mode, d, causal, seq = config
        print(f"{mode:6} {d:3}  {'yes' if causal else 'no':>6} {seq:6}  " + "  ".join(cells) +
              f"  {spread:10.1%}  {peer}")


if __name__ == "__main__":
    main()

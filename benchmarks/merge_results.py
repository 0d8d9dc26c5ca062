"""Merges gpu_benchmark.py results files from several runs into one.

Where GPU time comes in limited slices, the grid is run in parts; plot.py and
the README table read one file. Each part's environment and arguments are kept
under "parts" (device, jax version, commit per part); records are concatenated.

  python3 -P benchmarks/merge_results.py OUT.json PART.json [PART.json ...]
"""

from __future__ import annotations

import json
import pathlib
import sys


def merge(paths):
    parts = [json.loads(pathlib.Path(p).read_text()) for p in paths]
    devices = {p["environment"]["device_kind"] for p in parts}
    if len(devices) != 1:
        raise SystemExit(f"refusing to merge results from different devices: {sorted(devices)}")
    merged = {key: parts[0][key] for key in ("benchmark", "environment", "flop_convention")}
    merged["parts"] = [
        {"file": pathlib.Path(path).name, "environment": p["environment"], "args": p["args"]}
        for path, p in zip(paths, parts)
    ]
    merged["records"] = [r for p in parts for r in p["records"]]
    return merged


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    out = pathlib.Path(sys.argv[1])
    out.write_text(json.dumps(merge(sys.argv[2:]), indent=1) + "\n")
    print(f"wrote {out}")

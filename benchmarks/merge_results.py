"""Merges gpu_benchmark.py results files from several runs into one.

Where GPU time comes in limited slices, the grid is run in parts; plot.py and
the README table read one file. Each part's environment and arguments are kept
under "parts" (device, jax version, commit per part); records are concatenated,
except that a part's record replaces an earlier part's of the same
configuration (CONFIG_FIELDS), unless it did not run where the earlier one
did: a part that re-runs rows an earlier part left unrun (its time budget) or
ran alone supersedes them, so that every jflash/peer pair comes from one run.

  python3 -P benchmarks/merge_results.py OUT.json PART.json [PART.json ...]
"""

from __future__ import annotations

import json
import pathlib
import sys


# What makes two records the same row of the grid (gpu_benchmark.py's fields).
CONFIG_FIELDS = ("impl", "head_dim", "value_head_dim", "seq", "batch", "heads", "kv_heads",
                 "causal", "mode", "dtype", "data", "feed")


def _config(record, args):
    # Rows that did not run, and the derived backward rows, carry no "feed":
    # theirs is the run's.
    return tuple(record.get(field, args.get(field)) for field in CONFIG_FIELDS)


def merge_records(parts):
    """The parts' records in order, a later part's replacing an earlier one's
    of the same configuration unless the later did not run and the earlier did.
    parts: (records, args) of each part."""
    merged = {}
    for records, args in parts:
        for record in records:
            key = _config(record, args)
            earlier = merged.get(key)
            if earlier is not None and earlier.get("status") == "ok" and record.get("status") != "ok":
                continue
            merged.pop(key, None)  # a replaced row moves to its new part's place
            merged[key] = record
    return list(merged.values())


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
    merged["records"] = merge_records([(p["records"], p["args"]) for p in parts])
    return merged


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    out = pathlib.Path(sys.argv[1])
    out.write_text(json.dumps(merge(sys.argv[2:]), indent=1) + "\n")
    print(f"wrote {out}")

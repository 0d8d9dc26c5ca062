"""Where the warps of one profiled launch spend their time, per SASS opcode.

Reads the CSV of `ncu --import REP --page source --csv --print-source sass`
(a report taken with `--section SourceCounters`; tools/device_run.sh
steps `ncu_source` and `ncu_bwd_source`) and prints, for the code before the
producer's `USETMAXREG.DEALLOC` (the consumer warps of the Hopper forward and
backward, which both place the producer's code last), the warp-state
samples of each opcode converted to cycles per warp and step, and the
instructions with the most samples with their top stall reasons.

  python3 tools/ncu_source_summary.py ncu_source.csv \
      --cycles-per-step 2773 --executions-per-step 507904 [--top 30]

--cycles-per-step: elapsed cycles / key-tile steps per CTA (details page);
--executions-per-step: `Instructions Executed` of an instruction that runs
once per warp and step (e.g. the first HGMMA of the main loop). Without them
the table shows sample shares only. docs/cuda_kernels.md (Hopper forward: softmax) has an example.

Two launches of different kernels (e.g. a band kernel against its unmasked
twin, sampled at the same rate) compare by opcode, as consumer samples per
step, with the steps (tiles) of each launch:

  python3 tools/ncu_source_summary.py causal.csv --steps 264192 \
      --against unmasked.csv --against-steps 524288
"""

import argparse
import collections
import csv


def load(path):
    rows = list(csv.reader(open(path)))
    header = rows[1]
    col = {h: i for i, h in enumerate(header)}
    stalls = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    base = int(rows[2][0], 16)
    out = []
    for r in rows[2:]:
        if len(r) < len(header):
            continue
        samples = int(r[col["Warp Stall Sampling (All Samples)"]] or 0)
        executed = int(r[col["Instructions Executed"]] or 0)
        reasons = {h[len("stall_"):]: int(r[col[h]] or 0) for h in stalls}
        out.append((int(r[0], 16) - base, r[1].strip(), samples, executed, reasons))
    return out


def opcode(source):
    words = source.split()
    word = words[1] if words[0].startswith("@") else words[0]
    return word.split(".")[0]


def consumer_rows(rows):
    """The rows before the producer's USETMAXREG.DEALLOC, and that offset (None: all rows)."""
    end = next((a for a, src, *_ in rows if "USETMAXREG.DEALLOC" in src), None)
    return [r for r in rows if end is None or r[0] < end], end


def by_opcode(rows):
    samples, executed = collections.Counter(), collections.Counter()
    for _, src, s, ex, _ in rows:
        samples[opcode(src)] += s
        executed[opcode(src)] += ex
    return samples, executed


def compare(rows, steps, other, other_steps, top):
    """Consumer samples per step by opcode, this launch against the other."""
    mine, theirs = by_opcode(rows)[0], by_opcode(other)[0]
    total, other_total = sum(mine.values()), sum(theirs.values())
    print(f"consumer samples per step: {total / steps:.3f} here, {other_total / other_steps:.3f} "
          f"against ({total / steps / (other_total / other_steps) - 1:+.1%})")
    print(f"{'opcode':12s} {'here':>7s} {'against':>7s} {'diff':>7s}")
    diffs = {op: mine[op] / steps - theirs[op] / other_steps for op in set(mine) | set(theirs)}
    for op in sorted(diffs, key=lambda o: -abs(diffs[o]))[:top]:
        print(f"{op:12s} {mine[op] / steps:7.3f} {theirs[op] / other_steps:7.3f} {diffs[op]:+7.3f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv")
    parser.add_argument("--cycles-per-step", type=float)
    parser.add_argument("--executions-per-step", type=float)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--steps", type=float, help="the launch's steps (tiles), for --against")
    parser.add_argument("--against", help="a second launch's CSV, compared by opcode per step")
    parser.add_argument("--against-steps", type=float, help="the second launch's steps")
    args = parser.parse_args()
    consumer, end = consumer_rows(load(args.csv))
    if args.against:
        if not (args.steps and args.against_steps):
            parser.error("--against needs --steps and --against-steps")
        compare(consumer, args.steps, consumer_rows(load(args.against))[0], args.against_steps,
                args.top)
        return
    total = sum(r[2] for r in consumer)
    samples, executed = by_opcode(consumer)
    print(f"consumer samples {total} (code before offset {end:#x})" if end else f"samples {total}")
    scaled = args.cycles_per_step and args.executions_per_step
    for op, s in samples.most_common(25):
        line = f"{op:12s} {100 * s / total:5.1f}%"
        if scaled:
            cycles = s / total * args.cycles_per_step
            count = executed[op] / args.executions_per_step
            line += f"  {cycles:6.0f} cycles/step  {count:6.1f} instr/step  {cycles / max(count, 1e-9):5.1f} each"
        print(line)
    print()
    for offset, src, s, _, reasons in sorted(consumer, key=lambda r: -r[2])[: args.top]:
        top = sorted(((v, k) for k, v in reasons.items() if v), reverse=True)[:3]
        print(f"{offset:06x} {s:6d} {src[:56]:56s} " + " ".join(f"{k}={v}" for v, k in top))


if __name__ == "__main__":
    main()

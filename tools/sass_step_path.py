"""The Hopper backward's step loop as its SASS lays it out, without a GPU.

For each copy of the consumer's step in a kernel (step_copies says how a copy
is found): where the waits for S^T and dP^T sit, where the dK product's first HGMMA is
issued, how many instructions lie between the wait for S^T and that issue on
the path that skips every forward branch's span (the late mask's block, on a
step the band does not cut), the MUFU.EX2 placed before and after the wait for
dP^T, and the local-memory loads and stores (spill) inside the copy.

A static count: docs/hopper_backward.md ("Where the time goes") compares it
with measured rates, and it does not rank variants by itself.

    cuobjdump -sass kernel.cubin > kernel.sass
    python3 tools/sass_step_path.py kernel.sass [more.sass ...] [--kernel NAME]

Input: `cuobjdump -sass` text, or a cubin (then cuobjdump runs on it).
--kernel picks the function whose mangled name contains NAME (default
flash_bwd_sm90_kernel; the first such function of the file).
"""

import argparse
import dataclasses
import re
import subprocess
import sys

_LINE = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


@dataclasses.dataclass
class StepCopy:
    first_hgmma: int
    wait_s: int
    wait_dp: int
    dk_issue: int
    path: int
    mufu_before_dp_wait: int
    mufu_after_dp_wait: int
    local_loads: int
    local_stores: int


def read_sass(path):
    if path.endswith(".cubin"):
        return subprocess.run(["cuobjdump", "-sass", path], check=True, capture_output=True,
                              text=True).stdout
    with open(path) as f:
        return f.read()


def function_body(sass, kernel):
    """(address, instruction) pairs of the first function whose name holds kernel."""
    for part in re.split(r"\n\s*Function : ", sass):
        name = part.split(None, 1)[0] if part.strip() else ""
        if kernel in name:
            body = []
            for line in part.splitlines():
                m = _LINE.match(line)
                if m:
                    body.append((int(m.group(1), 16), m.group(2)))
            return name, body
    raise ValueError(f"no function whose name contains {kernel!r}")


def _opcode(instruction):
    words = instruction.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0] if words else ""


def step_copies(body):
    """The step copies of a consumer loop, in the order of the code.

    Each product's chain of HGMMAs starts with one whose C operand is RZ. A
    step issues S^T and dP^T back to back (no wait between their first
    HGMMAs) and waits for S^T with dP^T in flight (a wait that leaves one
    group); dQ's chains are waited for whole. A copy ends where the next one
    starts, the last at the loop's back edge.
    """
    ops = [_opcode(x) for _, x in body]
    index_of = {a: i for i, (a, _) in enumerate(body)}
    hgmma = [i for i, op in enumerate(ops) if op.startswith("HGMMA")]
    waits = [i for i, op in enumerate(ops) if op == "WARPGROUP.DEPBAR.LE"]
    zero = [i for i in hgmma if ", RZ" in body[i][1]]
    zero_set = set(zero)
    mufu = [j for j, op in enumerate(ops) if op.startswith("MUFU.EX2")]

    def branch_target(j):
        return index_of.get(int(body[j][1].split()[-1], 16))

    def next_wait(i):
        return next((w for w in waits if w > i), None)

    # S^T's chain: the first zero-initializing HGMMA since the last wait, whose
    # next wait leaves one group (dP^T) in flight.
    starts = []
    for h in zero:
        w = next_wait(h)
        first_since_wait = not any(z < h and next_wait(z) == w for z in zero)
        if w is not None and first_since_wait and body[w][1].endswith("0x1"):
            starts.append(h)
    copies = []
    for n, first in enumerate(starts):
        after = [w for w in waits if w > first]
        if len(after) < 2:
            break
        wait_s, wait_dp = after[0], after[1]
        # The dK product: the first accumulating HGMMA after the dP^T wait.
        dk = next((h for h in hgmma if h > wait_dp and h not in zero_set), None)
        if dk is None:
            break
        if n + 1 < len(starts):
            end = starts[n + 1]
        else:
            back_edges = (j + 1 for j in range(dk, len(body)) if ops[j] == "BRA"
                          and branch_target(j) is not None and branch_target(j) <= first)
            end = next(back_edges, len(body))
        # Walk from the wait to the issue taking every forward branch (nested
        # ones inside a skipped span are skipped with it).
        path, j = 0, wait_s
        while j < dk:
            path += 1
            t = branch_target(j) if ops[j] == "BRA" else None
            j = min(t, dk) if t is not None and t > j else j + 1
        copies.append(StepCopy(
            first_hgmma=first, wait_s=wait_s, wait_dp=wait_dp, dk_issue=dk,
            path=path,
            mufu_before_dp_wait=sum(wait_s < j < wait_dp for j in mufu),
            mufu_after_dp_wait=sum(wait_dp < j < dk for j in mufu),
            local_loads=sum(ops[j].startswith("LDL") for j in range(first, end)),
            local_stores=sum(ops[j].startswith("STL") for j in range(first, end))))
    return copies


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--kernel", default="flash_bwd_sm90_kernel")
    args = parser.parse_args(argv)
    for path in args.files:
        try:
            name, body = function_body(read_sass(path), args.kernel)
        except ValueError as e:
            parser.error(f"{path}: {e}")
        print(f"{path}: {len(body)} instructions ({name[:80]})")
        for n, c in enumerate(step_copies(body)):
            print(f"  copy {n}: S^T wait {c.wait_s}, dP^T wait {c.wait_dp}, dK issue {c.dk_issue}; "
                  f"path S^T wait -> dK {c.path}; MUFU.EX2 before / after the dP^T wait "
                  f"{c.mufu_before_dp_wait} / {c.mufu_after_dp_wait}; LDL {c.local_loads}, "
                  f"STL {c.local_stores}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

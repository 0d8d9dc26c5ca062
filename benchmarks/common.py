"""What every jflash benchmark shares: the FLOP formula, the device-side timer, records.

One FLOP convention for all numbers (the FlashAttention papers'):
  forward          = 4 * batch * heads * seq_q * seq_k * head_dim   (two matmuls, 2 FLOP per MAC)
  causal           = half of that (the masked triangle is not counted)
  backward         = 2.5 x forward (five matmuls instead of two)
  forward+backward = 3.5 x forward
Softmax exps and the online-softmax rescales are not counted. With a value head
dim Dv other than the query/key head dim D (MLA-style): forward = 2 * B * H *
Sq * Sk * (D + Dv) (Q K^T, P V), backward = 2 * B * H * Sq * Sk * (3 D + 2 Dv)
(recomputed Q K^T, dQ = dS K, dK = dS^T Q on D; dP = dO V^T, dV = P^T dO on
Dv); at Dv == D these are the lines above.

Timing keeps the work on the device: one jitted lax.fori_loop runs `iterations`
attention calls back to back, each depending on the one before (see make_loop), so
the host launches one program and waits once; per-call time = wall time /
iterations, median over repeats after a warm-up call. This is how the peer
numbers the README compares with were taken.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import pathlib
import platform
import re
import statistics
import subprocess
import time
import traceback
from typing import Callable

import jax
import jax.numpy as jnp
import jaxlib

MODES = ("fwd", "fwdbwd")

BENCHMARKS_DIR = pathlib.Path(__file__).resolve().parent
RESULTS_DIR = BENCHMARKS_DIR / "results"


def pair_flops(head_dim, value_head_dim=None, mode="fwd"):
    """FLOPs per (query, key) pair and query head under the convention above
    (mode: fwd, bwd, fwdbwd); value_head_dim None: head_dim.

    fwd 2 * (D + Dv), bwd 2 * (3 D + 2 Dv): 4 D and 10 D (2.5x) at Dv == D.
    """
    dv = head_dim if value_head_dim is None else value_head_dim
    fwd = 2 * (head_dim + dv)
    bwd = 2 * (3 * head_dim + 2 * dv)
    return {"fwd": fwd, "bwd": bwd, "fwdbwd": fwd + bwd}[mode]


def attention_flops(batch, seqlen_q, seqlen_k, num_heads, head_dim, *, causal, mode="fwd",
                    value_head_dim=None):
    """FLOPs of one attention call under the convention above (mode: fwd, bwd,
    fwdbwd); value_head_dim: that of v and out (None: head_dim)."""
    flops = float(batch * num_heads * seqlen_q * seqlen_k) * pair_flops(head_dim, value_head_dim,
                                                                        mode)
    if causal:
        flops /= 2
    return flops


def band_pairs(seqlen_q, seqlen_k, lo=None, hi=None):
    """Query/key pairs (i, j), 0 <= i < seqlen_q, 0 <= j < seqlen_k, with
    lo <= j - i <= hi (None: that side unbounded), counted exactly.

    Causal with seqlen_q == seqlen_k is lo=None, hi=0: S * (S + 1) / 2 pairs; a
    causal sliding window of `left` keys before the query is lo=-left, hi=0.
    """
    lo = -(seqlen_q - 1) if lo is None else max(int(lo), -(seqlen_q - 1))
    hi = seqlen_k - 1 if hi is None else min(int(hi), seqlen_k - 1)
    total = 0
    for d in range(lo, hi + 1):  # the pairs of diagonal j - i = d
        total += max(0, min(seqlen_q, seqlen_k - d) - max(0, -d))
    return total


def band_flops(batch, seqlen_q, seqlen_k, num_heads, head_dim, *, lo=None, hi=None, mode="fwd",
               value_head_dim=None):
    """FLOPs of an attention call that computes only the pairs of band_pairs
    (pair_flops per pair and head: the convention above, counted exactly)."""
    pairs = band_pairs(seqlen_q, seqlen_k, lo, hi)
    return float(batch * num_heads * pairs) * pair_flops(head_dim, value_head_dim, mode)


def tflops(flops, seconds):
    return flops / seconds / 1e12 if seconds and seconds > 0 else None


# --------------------------------------------------------------------------- timing

# How an iteration's result reaches the next iteration's inputs.
#   "sliver" (default): q, k, v stay the random tensors they were drawn as; one
#     element of the result (out, or out + dq + dk + dv) is written into q[0, 0, 0, 0]
#     (an in-place dynamic-update-slice on the loop carry, ~no memory traffic).
#     Every call must wait for the one before, no output can be dead-code
#     eliminated (out, dq, dk, dv are all read), and the data never drifts
#     towards constants or zeros (timing zeros flatters every kernel).
#   "out": the peer numbers' method taken literally. fwd: q <- out (no extra op; out
#     is a convex mix of v rows so it stays bounded, but rows grow alike over
#     iterations). fwdbwd: q <- dq / rms(dq), which costs one extra fused
#     pass over q per iteration (reported as feed_ms), and dk, dv are linked
#     in as in "sliver".
FEEDS = ("sliver", "out")


def _sliver(x):
    return jax.lax.slice(x, (0,) * x.ndim, (1,) * x.ndim).astype(jnp.float32)


def _write_sliver(q, value):
    # Clipped so a runaway element cannot grow across iterations.
    value = jnp.clip(value, -4.0, 4.0).astype(q.dtype)
    return jax.lax.dynamic_update_slice(q, value, (0,) * q.ndim)


def _unit_rms(x, dtype):
    x = x.astype(jnp.float32)
    return (x * jax.lax.rsqrt(jnp.mean(x * x) + 1e-30)).astype(dtype)


def make_loop(attention: Callable, mode: str, iterations: int, feed: str = "sliver"):
    """jit(q, k, v, cotangent, *operands) -> final carry of `iterations` dependent
    attention calls.

    attention(q, k, v, *operands) -> out, [batch, seq, heads, head_dim] (or any
    layout of q's rank; v's head dim, hence out's and the cotangent's, may
    differ from q's, except for fwd with feed "out", which needs out shaped
    as q). operands (sequence lengths, cu_seqlens, ...) are passed
    to every call as they are, as arguments of the jitted program rather than
    constants XLA could fold at compile time. For fwdbwd each
    iteration is the forward plus the gradient of sum(out * cotangent) with respect
    to q, k and v (a jax.vjp); the cotangent is a fixed random tensor (not ones,
    which would make dv a column sum of P).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if feed not in FEEDS:
        raise ValueError(f"feed must be one of {FEEDS}, got {feed!r}")

    def forward_backward(q, k, v, cotangent, operands):
        # jax.vjp rather than jax.grad of a sum: out must be used, as in training,
        # or XLA drops the P @ V product that its own backward does not need.
        out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, *operands), q, k, v)
        dq, dk, dv = vjp(cotangent.astype(out.dtype))
        return out, dq, dk, dv

    def body(operands, _, carry):
        q, k, v, cotangent = carry
        if mode == "fwd":
            out = attention(q, k, v, *operands)
            q = out.astype(q.dtype) if feed == "out" else _write_sliver(q, _sliver(out))
        else:
            out, dq, dk, dv = forward_backward(q, k, v, cotangent, operands)
            others = _sliver(out) + _sliver(dk) + _sliver(dv)
            if feed == "out":
                q = _unit_rms(dq, q.dtype)
                q = _write_sliver(q, others + _sliver(q))
            else:
                q = _write_sliver(q, others + _sliver(dq))
        return q, k, v, cotangent

    @jax.jit
    def loop(q, k, v, cotangent, *operands):
        return jax.lax.fori_loop(0, iterations, functools.partial(body, operands),
                                 (q, k, v, cotangent))

    return loop


def make_feed_only_loop(mode: str, iterations: int, feed: str):
    """The loop with attention replaced by identity, to measure what the feed costs."""
    return make_loop(lambda q, k, v: q, mode, iterations, feed)


def _block(tree):
    jax.tree_util.tree_map(lambda x: x.block_until_ready(), tree)
    return tree


def time_loop(loop, args, *, iterations, min_repeats=3, max_repeats=20, min_total_s=0.5):
    """Per-iteration seconds of a make_loop program: warm-up, then median of repeats.

    The first call compiles and warms up (module load, autotuning, handles) and is
    not timed. Repeats continue until both min_repeats and min_total_s are reached.
    Returns dict(median_s, min_s, max_s, repeats, compile_s, last_carry).
    """
    start = time.perf_counter()
    carry = _block(loop(*args))
    compile_s = time.perf_counter() - start
    times = []
    while len(times) < max_repeats:
        start = time.perf_counter()
        carry = _block(loop(*args))
        times.append((time.perf_counter() - start) / iterations)
        if len(times) >= min_repeats and sum(times) * iterations >= min_total_s:
            break
    return dict(
        median_s=statistics.median(times),
        min_s=min(times),
        max_s=max(times),
        repeats=len(times),
        compile_s=compile_s,
        last_carry=carry,
    )


def check_finite_nonzero(q_final):
    """Raises if the loop's data degenerated (NaN/inf, or all zeros): such timings lie."""
    x = jnp.asarray(q_final, jnp.float32)
    rms = float(jnp.sqrt(jnp.mean(x * x)))
    if not jnp.isfinite(rms):
        raise FloatingPointError(f"non-finite values after the timed loop (rms {rms})")
    if rms == 0.0:
        raise FloatingPointError("all-zero values after the timed loop")
    return rms


class Unavailable(Exception):
    """A row that cannot run here (no GPU for cuDNN, a build without CUDA kernels,
    a shape jax rejects, too much memory for XLA): recorded, not an error."""


def require_cuda_kernels(platform):
    """Raises Unavailable where a jflash row on the GPU would run without CUDA kernels
    (a build with JFLASH_CUDA=OFF): such a row is reported, not timed."""
    import jflash

    if platform == "gpu" and not jflash.HAS_CUDA_KERNELS:
        raise Unavailable("this jflash build has no CUDA kernels (built with JFLASH_CUDA=OFF?)")


def record_timing(rec, timing, iterations):
    """A timed row's record: the loop's final rms (raises if it degenerated),
    time_loop's statistics and the loop length."""
    rec["final_q_rms"] = check_finite_nonzero(timing.pop("last_carry")[0])
    rec.update(timing, iterations=iterations)


def record_failure(rec, exc):
    """A row that did not run, from inside its `except`: "unavailable" with the
    reason for Unavailable, else "error" with the exception and its traceback,
    so that the other rows still run."""
    if isinstance(exc, Unavailable):
        rec.update(status="unavailable", note=str(exc))
    else:
        rec.update(status="error", note=f"{type(exc).__name__}: {exc}"[:1500],
                   traceback=portable_paths(traceback.format_exc())[-4000:])


def portable_paths(text):
    """A traceback's file names without the machine's folders: relative to the
    checkout, from site-packages on, or the bare file name."""
    root = str(BENCHMARKS_DIR.parent) + "/"

    def short(match):
        path = match.group(1)
        if path.startswith(root):
            path = path[len(root):]
        elif "/site-packages/" in path:
            path = "site-packages/" + path.split("/site-packages/", 1)[1]
        else:
            path = path.rsplit("/", 1)[-1]
        return f'File "{path}"'

    return re.sub(r'File "(/[^"]*)"', short, text)


def add_loop_args(parser):
    """The timed loop's options (iterations_for, time_loop) of the attention benchmarks."""
    parser.add_argument("--target-ms", type=float, default=50.0, help="length of one timed loop")
    parser.add_argument("--max-iterations", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5, help="at least this many timed loops")
    parser.add_argument("--min-total-s", type=float, default=0.25)


def iterations_for(flops, assumed_flops_per_s, target_s, lo=1, hi=200):
    """Loop length so that one repeat takes about target_s at the assumed rate."""
    n = int(round(target_s * assumed_flops_per_s / max(flops, 1.0)))
    return max(lo, min(hi, n))


# What the inputs hold (--data): a kernel's speed should not depend on it, and
# standard normal data alone would not show it if it did.
#   normal  q, k, v (and the cotangent) standard normal: every softmax row is
#           nearly flat (at head dim 128 its largest probability is about 1/S
#           to 5/S).
#   rising  normal, then the keys scaled by linspace(0.5, 4.0, S) along the
#           sequence: the logits grow along the row, so the row maximum keeps
#           rising as the key blocks go by and the online softmax rescales its
#           accumulator again and again (largest probability about 0.2-0.4 of
#           a row at head dim 128, S 1k-16k).
#   peaked  normal, then the queries scaled by PEAKED_QUERY_SCALE (8): logits
#           of standard deviation 8 at the default scale 1/sqrt(head_dim), so
#           a few keys take nearly all of each row (at head dim 128, S 1k-16k,
#           the largest probability of a row is 0.7 in the median, 0.13 to
#           1.0 over rows; 1/S for normal data).
# All three draw the same normal numbers from a seed; only the scaling differs.
DATA_MODES = ("normal", "rising", "peaked")
RISING_KEY_SCALE = (0.5, 4.0)
PEAKED_QUERY_SCALE = 8.0


def random_qkv(seed, batch, seqlen, num_heads, head_dim, dtype, data="normal",
               value_head_dim=None):
    """q, k, v and a cotangent, [batch, seq, heads, head_dim]: standard normal,
    then scaled as the data mode says (DATA_MODES above), rounded to dtype last.
    value_head_dim: the head dim of v and the cotangent (out's), None: head_dim."""
    if data not in DATA_MODES:
        raise ValueError(f"data must be one of {DATA_MODES}, got {data!r}")
    keys = jax.random.split(jax.random.key(seed), 4)
    shape = (batch, seqlen, num_heads, head_dim)
    v_shape = shape if value_head_dim is None else shape[:3] + (value_head_dim,)
    q, k, v, cotangent = (jax.random.normal(key, s, jnp.float32)
                          for key, s in zip(keys, (shape, shape, v_shape, v_shape)))
    if data == "rising":
        k = k * jnp.linspace(*RISING_KEY_SCALE, seqlen, dtype=jnp.float32)[None, :, None, None]
    elif data == "peaked":
        q = q * PEAKED_QUERY_SCALE
    return tuple(x.astype(dtype) for x in (q, k, v, cotangent))


def memory_stats(compiled):
    """Byte counts of a compiled executable (XLA's static buffer assignment)."""
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    names = (
        "temp_size_in_bytes",
        "argument_size_in_bytes",
        "output_size_in_bytes",
        "alias_size_in_bytes",
        "generated_code_size_in_bytes",
    )
    return {name: int(getattr(stats, name, 0) or 0) for name in names}


# --------------------------------------------------------------------------- records


def jflash_commit():
    """$JFLASH_COMMIT if set, else git HEAD of this checkout (+'-dirty'), else 'unknown'.

    A copy of the tree on another machine may lack .git or carry a stale one
    (it once reported an older HEAD than the tree it ran): pass
    JFLASH_COMMIT=<sha> on the command line there.
    """
    if os.environ.get("JFLASH_COMMIT"):
        return os.environ["JFLASH_COMMIT"]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=BENCHMARKS_DIR,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=BENCHMARKS_DIR,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        if head:
            return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def comma_list(parser, option, text, allowed):
    """The values of a comma-list option (e.g. --impls "jflash,cudnn"); a usage
    error (parser.error) where there are none or one is not in allowed."""
    values = [v for v in text.split(",") if v]
    if not values or set(values) - set(allowed):
        parser.error(f"{option} takes a comma list of {','.join(allowed)}")
    return values


def require_gpu(parser, allow_cpu):
    """The platform jax runs on; a usage error (parser.error) where it is not a
    GPU, unless allow_cpu (a script's --allow-cpu: its logic at tiny sizes)."""
    platform = jax.devices()[0].platform
    if platform != "gpu" and not allow_cpu:
        parser.error(f"no GPU found (jax platform {platform}); pass --allow-cpu to test the logic")
    return platform


def jflash_source(path):
    """Where the jflash that ran came from, without the machine's paths: the
    source tree of this checkout (its build in place) or an installed copy."""
    here = pathlib.Path(path).resolve()
    root = BENCHMARKS_DIR.parent
    return "source tree" if root in here.parents else "installed"


def args_record(args, **extra):
    """The command line of a run for its results file: paths by file name only
    (a results file names no folders of the machine that wrote it)."""
    record = dict(vars(args), **extra)
    return {k: (pathlib.Path(v).name if isinstance(v, pathlib.PurePath) else v)
            for k, v in record.items()}


def environment_record():
    """Who measured what, where: attached to every results file."""
    device = jax.devices()[0]
    try:
        import jflash

        jflash_version = jflash.__version__
        jflash_from = jflash_source(jflash.__file__)
        has_cuda = bool(jflash.HAS_CUDA_KERNELS)
    except Exception as exc:  # recorded, not fatal: the peer rows still run
        jflash_version, jflash_from, has_cuda = f"import failed: {exc!r}"[:300], None, None
    return dict(
        date_utc=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        machine=platform.machine(),
        platform=device.platform,
        device_kind=device.device_kind,
        device_count=jax.device_count(),
        cpu_count=os.cpu_count(),
        load_average=list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        jax_version=jax.__version__,
        jaxlib_version=jaxlib.__version__,
        jflash_version=jflash_version,
        jflash_from=jflash_from,
        jflash_has_cuda_kernels=has_cuda,
        jflash_commit=jflash_commit(),
        # Kernel choices made from the environment (JFLASH_CUDA_FORWARD and
        # JFLASH_CUDA_BACKWARD pick the Hopper or the sm80 kernels;
        # JFLASH_CPU_ISA narrows the CPU path).
        jflash_env={k: os.environ[k]
                    for k in ("JFLASH_CUDA_FORWARD", "JFLASH_CUDA_BACKWARD", "JFLASH_CPU_ISA")
                    if k in os.environ},
    )


def slug(text):
    return "".join(ch if ch.isalnum() else "-" for ch in str(text)).strip("-").lower()


def default_results_path(prefix, device_name):
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return RESULTS_DIR / f"{prefix}_{slug(device_name)}_{date}.json"


def write_json(path, payload):
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    return path


def format_table(headers, rows):
    """Plain aligned text table; None prints as '-'."""
    cells = [[("-" if c is None else str(c)) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths))
    out = [line, "-" * len(line)]
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(out)


def fmt(x, digits=1):
    return None if x is None else f"{x:.{digits}f}"


# --------------------------------------------------------------------------- correctness


def _reference_attention(q, k, v, causal, softcap=None, window=None):
    """Plain-jnp float32 attention, [batch, seq, heads, head_dim]; top-left causal;
    softcap c: scores c * tanh(s / c); window (left, right): query i sees key j
    iff i - left <= j <= i + right (top-left, as causal).

    Kept here rather than imported from jflash.reference so that the peer rows are
    checked even when jflash fails to import. Sq == Sk in every benchmark, where
    top-left and jflash's bottom-right causal masks coincide.
    """
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    highest = jax.lax.Precision.HIGHEST  # not TF32 on GPU: this is the reference
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=highest)
    scores = scores / jnp.sqrt(jnp.float32(q.shape[-1]))
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    if causal:
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
        visible = jnp.arange(seqlen_k)[None, :] <= jnp.arange(seqlen_q)[:, None]
        scores = jnp.where(visible, scores, -jnp.inf)
    if window is not None:
        left, right = window
        offset = jnp.arange(k.shape[1])[None, :] - jnp.arange(q.shape[1])[:, None]
        scores = jnp.where((offset >= -left) & (offset <= right), scores, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v, precision=highest)


def relative_errors(attention, q, k, v, cotangent, *, causal, mode, num_heads=1, softcap=None,
                    window=None):
    """||impl - ref|| / ||ref|| on batch 0 and the first num_heads heads; softcap:
    that of the impl's scores (None: none); window: the impl's (left, right)
    window (None: none).

    A slice keeps the float32 reference's seq x seq scores small (1 GiB at 16k).
    fwd: {"out": e}; fwdbwd: also "dq", "dk", "dv".
    """
    sl = lambda x: x[:1, :, :num_heads, :]
    q, k, v, cotangent = map(sl, (q, k, v, cotangent))

    def run(fn, dtype, q, k, v, cotangent):
        args = [x.astype(dtype) for x in (q, k, v)]
        if mode == "fwd":
            return {"out": fn(*args)}
        out, vjp = jax.vjp(fn, *args)
        dq, dk, dv = vjp(cotangent.astype(out.dtype))
        return {"out": out, "dq": dq, "dk": dk, "dv": dv}

    # Inputs go in as arguments: closed-over arrays would become constants that
    # XLA folds at compile time (seconds at seq 4096).
    got = jax.jit(lambda *a: run(attention, q.dtype, *a))(q, k, v, cotangent)
    reference = lambda *a: _reference_attention(*a, causal, softcap, window)
    ref = jax.jit(lambda *a: run(reference, jnp.float32, *a))(q, k, v, cotangent)
    errors = {}
    for name, r in ref.items():
        g = got[name].astype(jnp.float32)
        if not bool(jnp.all(jnp.isfinite(g))):
            errors[name] = float("nan")
            continue
        errors[name] = float(jnp.linalg.norm(g - r) / jnp.linalg.norm(r))
    return errors


def fmt_rate(x):
    """A rate with one decimal from 10 up, three significant digits below."""
    return None if x is None else (f"{x:.1f}" if x >= 10 else f"{x:.3g}")


def cell_rate(cell, impl):
    """The TFLOP/s text of one row of a summary cell (impl -> record): None where
    the row was not run, "n/a" where it was unavailable, "ERR" where it failed."""
    r = cell.get(impl)
    if r is None:
        return None
    if r["status"] != "ok":
        return {"unavailable": "n/a", "error": "ERR"}.get(r["status"], "?")
    return fmt_rate(r["tflops"])


def cell_ratio(cell, a, b):
    """TFLOP/s of row a over row b of a summary cell; None unless both ran."""
    ra, rb = cell.get(a), cell.get(b)
    if ra and rb and ra["status"] == rb["status"] == "ok":
        return ra["tflops"] / rb["tflops"]
    return None


def print_run_header(env, out):
    """The first line of a GPU benchmark's output: device, versions, where results go."""
    print(f"{env['device_kind']}, jax {env['jax_version']}, jflash {env['jflash_commit']}, "
          f"jflash CUDA kernels: {env['jflash_has_cuda_kernels']}; results -> {out}", flush=True)

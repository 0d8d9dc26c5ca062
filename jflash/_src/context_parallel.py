"""Context parallelism: attention over a sequence sharded across devices.

Each device holds a block of L query rows and L key/value rows of the
sequence. Two strategies compute exact attention without gathering queries:

  ring        K/V blocks travel around the ring of devices with ppermute (the
              next block's transfer issued before the current block's kernel
              call, so that XLA can overlap them). Partial outputs merge through
              their lse. The backward sends dK/dV accumulators (float32) around
              the ring the same way; each chunk pair's kernel backward call gets
              the row's merged out and lse, so its delta is the global one and
              the call returns exactly that pair's contribution.
  all_gather  K/V of the whole sequence gathered on every device (Llama 3);
              the backward reduce-scatters dK/dV. One collective instead of
              n - 1 steps, and cheap when K/V are small (GQA with few kv heads).

Layouts (which tokens a device holds), with the sequence split into chunks:
  contiguous  device i holds block i (n chunks). Under a causal mask device i
              has i + 1 blocks of work: the last device does n times the first.
  zigzag      2n chunks; device i holds chunks i and 2n - 1 - i. Under a causal
              mask every device does the same work. shard_sequence and
              unshard_sequence permute tokens into this layout and back; the
              mask is computed from the tokens' true positions.

Masks supported in context-parallel form: none (any seq_q, seq_k) and causal
with seq_q == seq_k. Every chunk pair is then either fully visible, fully
masked (skipped: never computed) or on the diagonal, and is one kernel call with
its own band. Other masks, and segment ids, gather the sequence (correct, and
not parallel).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

STRATEGIES = ("auto", "ring", "all_gather")
LAYOUTS = ("contiguous", "zigzag")

_strategy_context = jax.make_user_context(default_value="auto")
_layout_context = jax.make_user_context(default_value=("contiguous", None))


@contextlib.contextmanager
def context_parallel_strategy(strategy: str):
    """Picks how sequence-sharded attention runs, for calls traced inside the block.

    "auto" (the default): see choose_strategy. "ring" or "all_gather" force
    one. Read at trace time; a jitted function is traced again when the
    strategy changes.
    """
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    with _strategy_context(strategy):
        yield


@contextlib.contextmanager
def sequence_layout(layout: str, axis_size: int | None = None):
    """Declares the token order of the sequence axis for calls traced inside the block.

    "zigzag" with axis_size n: the tokens were permuted by
    shard_sequence(x, n) (device i of n holds chunks i and 2n - 1 - i of 2n),
    so the causal mask follows their true positions. "contiguous" (the
    default): tokens in their natural order. Results come back in the layout
    of the inputs.
    """
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "zigzag":
        axis_size = _check_axis_size(axis_size)
    elif axis_size is not None:
        raise ValueError(f"axis_size is for layout='zigzag' only, got {axis_size!r}")
    with _layout_context((layout, axis_size)):
        yield


def current_config():
    """(strategy, layout, layout_axis_size), hashable: the static of the kernel calls."""
    layout, axis_size = _layout_context.value
    return (_strategy_context.value, layout, axis_size)


DEFAULT_CONFIG = ("auto", "contiguous", None)


# --------------------------------------------------------------------------- layout


def _check_axis_size(axis_size):
    if isinstance(axis_size, (bool, np.bool_)) or not isinstance(axis_size, (int, np.integer)):
        raise TypeError(f"axis_size must be an int, got {type(axis_size).__name__}")
    if axis_size < 1:
        raise ValueError(f"axis_size must be at least 1, got {axis_size}")
    return int(axis_size)


def zigzag_chunks(axis_size: int) -> list[int]:
    """The chunk (of 2 * axis_size) at each chunk slot of the zigzag layout."""
    order = []
    for i in range(axis_size):
        order += [i, 2 * axis_size - 1 - i]
    return order


def zigzag_positions(seq_len: int, axis_size: int) -> np.ndarray:
    """True token position of each slot of the zigzag layout (a permutation)."""
    chunk = seq_len // (2 * axis_size)
    order = np.asarray(zigzag_chunks(axis_size))
    return (order[:, None] * chunk + np.arange(chunk)[None, :]).reshape(-1)


def _reorder_chunks(x, order, axis):
    """x with its equal chunks along axis concatenated in the given order (static
    slices: no index constant, which a partitioned call's body may not hold)."""
    size = x.shape[axis] // len(order)
    chunks = [jax.lax.slice_in_dim(x, c * size, (c + 1) * size, axis=axis) for c in order]
    return jnp.concatenate(chunks, axis=axis)


def to_zigzag(x, axis_size, axis):
    """Natural token order -> zigzag layout along axis."""
    return _reorder_chunks(x, zigzag_chunks(axis_size), axis)


def from_zigzag(x, axis_size, axis):
    """Zigzag layout -> natural token order along axis."""
    return _reorder_chunks(x, list(np.argsort(zigzag_chunks(axis_size))), axis)


def _check_layout_args(x, axis_size, seq_axis):
    shape = getattr(x, "shape", None)
    if shape is None or getattr(x, "dtype", None) is None:
        raise TypeError(f"x must be an array, got {type(x).__name__}")
    axis_size = _check_axis_size(axis_size)
    if isinstance(seq_axis, (bool, np.bool_)) or not isinstance(seq_axis, (int, np.integer)):
        raise TypeError(f"seq_axis must be an int, got {type(seq_axis).__name__}")
    if not -len(shape) <= seq_axis < len(shape):
        raise ValueError(f"seq_axis {seq_axis} out of range for shape {tuple(shape)}")
    seq_axis = int(seq_axis) % len(shape)
    if shape[seq_axis] % (2 * axis_size):
        raise ValueError(
            f"the sequence length {shape[seq_axis]} (axis {seq_axis} of shape {tuple(shape)}) "
            f"must be a multiple of 2 * axis_size = {2 * axis_size} for the zigzag layout"
        )
    return axis_size, seq_axis


def shard_sequence(x, axis_size, seq_axis=1):
    """Permutes tokens into the zigzag layout for axis_size devices.

    The sequence (axis seq_axis, a multiple of 2 * axis_size long) is cut into
    2 * axis_size chunks; device i of a sequence sharding over axis_size devices
    then holds chunks i and 2 * axis_size - 1 - i, which balances causal work.
    Apply it to every per-token array (tokens, targets, positions) alike, and
    run attention under sequence_layout("zigzag", axis_size).
    """
    axis_size, seq_axis = _check_layout_args(x, axis_size, seq_axis)
    return to_zigzag(jnp.asarray(x), axis_size, seq_axis)


def unshard_sequence(x, axis_size, seq_axis=1):
    """Inverse of shard_sequence: tokens back in their natural order."""
    axis_size, seq_axis = _check_layout_args(x, axis_size, seq_axis)
    return from_zigzag(jnp.asarray(x), axis_size, seq_axis)


# --------------------------------------------------------------------------- plans


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one call runs context-parallel (static, decided per traced call)."""

    axis_name: str | tuple  # the mesh axis (or axes) the sequence is sharded over
    axis_size: int
    strategy: str  # "ring" or "all_gather"
    layout: str  # "contiguous" or "zigzag"
    causal: bool


def band_kind(seqlen_q, seqlen_k, diag_lo, diag_hi):
    """"full", "causal" (seq_q == seq_k, j <= i), or None for other bands."""
    if diag_lo <= -seqlen_q and diag_hi >= seqlen_k:
        return "full"
    if seqlen_q == seqlen_k and diag_lo <= -seqlen_q and diag_hi == 0:
        return "causal"
    return None


# Keys per device from which a ring of up to four devices beats the all-gather.
# Measured on NVIDIA H200s (NVLink), bfloat16, head dim 128, 16 query heads
# over 8 kv heads, forward+backward, per-device rate all-gather / ring: on 2
# (benchmarks/results/gpu_2x-nvidia-h200_20261124_context-parallel-scaling.json)
# 1.08 (unmasked) and 0.99 (causal) at 64k keys per device, 1.04 and 1.00 at
# 128k, 0.98 and 0.96 at 256k, and causal 0.99 at 512k, where the all-gather
# also holds 1.5x the ring's temporaries (21 against 15 GB); on 4
# (gpu_4x-nvidia-h200_20261129_context-parallel-scaling.json) 1.07 and 1.06
# at 32k, 1.10 and 1.04 at 64k, 1.10 and 1.01 at 128k (temporaries 9.7-10.8
# against 4.3-4.6 GB at 128k). Past 4 devices not measured: the ring.
RING_MIN_KEYS_PER_DEVICE = 262144
GATHER_MAX_DEVICES = 4


def choose_strategy(strategy, axis_size, num_heads, num_heads_kv, keys_per_device=None):
    """The "auto" heuristic: which strategy a sequence sharding runs.

    all_gather when the whole sequence's K and V are no bigger than a device's
    query block (num_heads >= 2 * axis_size * num_heads_kv: GQA/MQA with few kv
    heads), or when there are at most GATHER_MAX_DEVICES devices and fewer
    than RING_MIN_KEYS_PER_DEVICE keys per device (the all-gather's one
    collective measured faster there); ring otherwise. keys_per_device None
    counts as short. "ring" or "all_gather" are returned as given.
    """
    if strategy != "auto":
        return strategy
    if num_heads >= 2 * axis_size * num_heads_kv:
        return "all_gather"
    short = keys_per_device is None or keys_per_device < RING_MIN_KEYS_PER_DEVICE
    if axis_size <= GATHER_MAX_DEVICES and short:
        return "all_gather"
    return "ring"


def make_plan(config, axis_name, axis_size, seqlen_q, seqlen_k, num_heads, num_heads_kv,
              diag_lo, diag_hi):
    """A Plan for a sequence sharded over axis_size devices, or None to gather."""
    strategy, layout, layout_size = config
    if axis_size <= 1 or seqlen_q % axis_size or seqlen_k % axis_size:
        return None
    kind = band_kind(seqlen_q, seqlen_k, diag_lo, diag_hi)
    if kind is None:
        return None
    if kind == "full":
        layout = "contiguous"  # no mask: the token order does not matter
    elif layout == "zigzag" and (layout_size != axis_size or seqlen_q % (2 * axis_size)):
        return None
    strategy = choose_strategy(strategy, axis_size, num_heads, num_heads_kv,
                               keys_per_device=seqlen_k // axis_size)
    return Plan(axis_name, axis_size, strategy, layout, kind == "causal")


# --------------------------------------------------------------------------- helpers

_F32 = jnp.float32


def _rows(x, start, size, axis):
    return jax.lax.slice_in_dim(x, start, start + size, axis=axis)


def _q_rows(x, start, size):  # q-like [..., seq, heads, dim]
    return _rows(x, start, size, x.ndim - 3)


def _lse_rows(x, start, size):  # lse-like [..., heads, seq]
    return _rows(x, start, size, x.ndim - 1)


def _add_q_rows(x, part, start):
    axis = x.ndim - 3
    current = _rows(x, start, part.shape[axis], axis)
    return jax.lax.dynamic_update_slice_in_dim(x, current + part.astype(x.dtype), start, axis)


def _set_rows(x, part, start, axis):
    return jax.lax.dynamic_update_slice_in_dim(x, part, start, axis)


def merge(acc, part):
    """Merges two partial attentions over disjoint keys through their lse.

    acc = (out float32 [..., L, H, D], lse [..., H, L]), part likewise (out in any
    dtype). Rows that saw no key have lse -inf and out 0 on either side; the
    weights of such rows are 0, never NaN.
    """
    out1, lse1 = acc
    out2, lse2 = part
    lse = jnp.logaddexp(lse1, lse2)
    safe = jnp.where(jnp.isneginf(lse), 0.0, lse)

    def weight(x):  # [..., H, L] -> [..., L, H, 1]
        return jnp.swapaxes(jnp.exp(x - safe), -1, -2)[..., None]

    return out1 * weight(lse1) + out2.astype(_F32) * weight(lse2), lse


def _ring_perm(n):
    return [(j, (j + 1) % n) for j in range(n)]


def _axis_index(plan):
    return jax.lax.axis_index(plan.axis_name)


# --------------------------------------------------------------------------- forward


def sharded_fwd(q, k, v, *, plan, call):
    """Per-device forward: local q [..., L, H, D], k, v [..., Lk, Hk, D] -> (out, lse).

    call(q, k, v, diag_lo, diag_hi) -> (out, lse) is the kernel (bands relative
    to the arrays it is given). Runs inside a manual-axes context (shard_map or
    a partitioned call's lowering).
    """
    if plan.strategy == "all_gather":
        return _gather_fwd(q, k, v, plan=plan, call=call)
    return _ring_fwd(q, k, v, plan=plan, call=call)


def _ring_loop(first, step, last, n, carry, kv, plan):
    """Runs step 0, then steps 1 .. n-1 with the K/V block of device (idx - s) % n.

    The transfer of the next block is issued before the compute of the current
    one, so XLA can overlap them; steps 1 .. n-2 run in a fori_loop, so each
    device holds two K/V blocks at a time, whatever n.
    first(carry, kv), step(carry, kv, s) and last(carry) return the new carry.
    """

    def send(x):
        return jax.lax.ppermute(x, plan.axis_name, _ring_perm(n))

    if n == 1:
        return last(first(carry, kv))
    incoming = send(kv)
    carry = first(carry, kv)

    def body(s, state):
        carry, kv = state
        incoming = send(kv)  # for step s + 1, before step s computes
        return step(carry, kv, s), incoming

    carry, kv = jax.lax.fori_loop(1, n - 1, body, (carry, incoming))
    return last(step(carry, kv, n - 1))


def _ring_fwd(q, k, v, *, plan, call):
    lq, lk = q.shape[-3], k.shape[-3]
    idx = _axis_index(plan)

    def first(_, kv):  # the device's own block
        out, lse = call(q, *kv, -lq, 0 if plan.causal else lk)
        return out.astype(_F32), lse

    def step(acc, kv, s):
        return _ring_fwd_step(q, kv, acc, s, idx, plan, call)

    out, lse = _ring_loop(first, step, lambda acc: acc, plan.axis_size, None, (k, v), plan)
    return out.astype(q.dtype), lse


def _ring_fwd_step(q, kv, acc, step, idx, plan, call):
    """Merges the block of device (idx - step) % n into acc (its kernel call or nothing)."""
    k, v = kv
    lq, lk = q.shape[-3], k.shape[-3]
    if not plan.causal:
        return merge(acc, call(q, k, v, -lq, lk))
    src = (idx - step) % plan.axis_size
    if plan.layout == "contiguous":
        # The source block is entirely before this device's (visible) or after
        # it (masked: skipped).
        return jax.lax.cond(
            src < idx,
            lambda acc, k, v: merge(acc, call(q, k, v, -lq, lk)),
            lambda acc, k, v: acc,
            acc, k, v,
        )
    # zigzag: q = [chunk idx, chunk 2n-1-idx], kv = [chunk src, chunk 2n-1-src].
    # src < idx: both q chunks see kv chunk src, neither sees 2n-1-src.
    # src > idx: q chunk 2n-1-idx sees both kv chunks, q chunk idx sees none.
    # Either way half the block pair, with no mask inside.
    c = lq // 2

    def early(acc, k, v):
        return merge(acc, call(q, _q_rows(k, 0, c), _q_rows(v, 0, c), -lq, c))

    def late(acc, k, v):
        out, lse = acc
        tail = merge(
            (_q_rows(out, c, c), _lse_rows(lse, c, c)),
            call(_q_rows(q, c, c), k, v, -c, lk),
        )
        return (_set_rows(out, tail[0], c, out.ndim - 3), _set_rows(lse, tail[1], c, lse.ndim - 1))

    return jax.lax.cond(src < idx, early, late, acc, k, v)


def _natural_order(x, plan, axis):
    """A gathered zigzag-layout sequence put back in token order (a static gather)."""
    if plan.layout != "zigzag":
        return x
    return from_zigzag(x, plan.axis_size, axis)


def _layout_order(x, plan, axis):
    if plan.layout != "zigzag":
        return x
    return to_zigzag(x, plan.axis_size, axis)


def _gather_kv(k, v, plan):
    axis = k.ndim - 3
    k, v = (jax.lax.all_gather(x, plan.axis_name, axis=axis, tiled=True) for x in (k, v))
    return _natural_order(k, plan, axis), _natural_order(v, plan, axis)


def _gather_row_bands(plan, device, lq, seqlen_k):
    """[(first local row, rows, diag_hi)] of device's query rows against the whole
    sequence in token order (causal)."""
    n = plan.axis_size
    if plan.layout == "contiguous":
        return [(0, lq, device * lq)]
    c = lq // 2
    return [(0, c, device * c), (c, c, (2 * n - 1 - device) * c)]


def _gather_fwd(q, k, v, *, plan, call):
    k, v = _gather_kv(k, v, plan)
    lq, seqlen_k = q.shape[-3], k.shape[-3]
    if not plan.causal:
        return call(q, k, v, -lq, seqlen_k)

    def branch(device):
        def run(q, k, v):
            parts = [
                call(_q_rows(q, start, rows), k, v, -rows, min(hi, seqlen_k))
                for start, rows, hi in _gather_row_bands(plan, device, lq, seqlen_k)
            ]
            out = jnp.concatenate([p[0] for p in parts], axis=q.ndim - 3)
            lse = jnp.concatenate([p[1] for p in parts], axis=q.ndim - 2)
            return out, lse

        return run

    branches = [branch(d) for d in range(plan.axis_size)]
    return jax.lax.switch(_axis_index(plan), branches, q, k, v)


# --------------------------------------------------------------------------- backward


def sharded_bwd(q, k, v, out, dout, lse, dlse, *, plan, call):
    """Per-device backward -> (dq, dk, dv) of the local blocks.

    call: a kernel_calls.BwdBandCall (call(q, k, v, out, dout, lse, dlse,
    diag_lo, diag_hi) -> (dq, dk, dv), and the ring's start / add / dq); out
    and lse are the merged (global) ones of the rows.
    """
    if plan.strategy == "all_gather":
        return _gather_bwd(q, k, v, out, dout, lse, dlse, plan=plan, call=call)
    return _ring_bwd(q, k, v, out, dout, lse, dlse, plan=plan, call=call)


def _ring_bwd(q, k, v, out, dout, lse, dlse, *, plan, call):
    """The ring's steps add into one float32 dq sum with the delta of the first
    step's call, which covers all the device's rows: no zeroing, conversion or
    delta per step, and dq is rounded once. The kernels add dK and dV into
    float32 sums that travel with their K/V block, and home in the input dtype."""
    lq, lk = q.shape[-3], k.shape[-3]
    n = plan.axis_size
    idx = _axis_index(plan)
    rows = (q, dout, lse)

    def send(x):
        return jax.lax.ppermute(x, plan.axis_name, _ring_perm(n))

    def first(_, kv):
        return call.start(q, *kv, out, dout, lse, dlse, -lq, 0 if plan.causal else lk,
                          call.dkv_zeros(k))

    def step(acc, kv, s):
        dq, dkv, delta = acc
        dkv = send(dkv)  # the sums follow their K/V block
        return (*_ring_bwd_step(rows, delta, kv, (dq, dkv), s, idx, plan, call), delta)

    def last(acc):
        dq, dkv, _ = acc
        # The sums are complete: rounded before the hop home, which then moves
        # half the bytes and gives the same values.
        dk, dv = call.dkv(dkv, k.dtype)
        return (dq, *send((dk, dv))) if n > 1 else (dq, dk, dv)

    dq, dk, dv = _ring_loop(first, step, last, n, None, (k, v), plan)
    return call.dq(dq, q.dtype), dk, dv


def _ring_bwd_step(rows, delta, kv, acc, step, idx, plan, call):
    q, dout, lse = rows
    k, v = kv
    lq, lk = q.shape[-3], k.shape[-3]

    def pair(row_start, row_count, key_count, diag_hi, acc, k, v):
        # The pair's keys are the block's first key_count: the kernel adds
        # their dK, dV into the first rows of the block's sums.
        dq, dkv = acc
        sub = [_q_rows(x, row_start, row_count) for x in (q, dout)]
        kk, vv = _q_rows(k, 0, key_count), _q_rows(v, 0, key_count)
        return call.add(dq, row_start, dkv, sub[0], kk, vv, sub[1],
                        _lse_rows(lse, row_start, row_count),
                        _lse_rows(delta, row_start, row_count), -row_count, diag_hi)

    if not plan.causal:
        return pair(0, lq, lk, lk, acc, k, v)
    src = (idx - step) % plan.axis_size
    if plan.layout == "contiguous":
        return jax.lax.cond(
            src < idx,
            functools.partial(pair, 0, lq, lk, lk),
            lambda acc, k, v: acc,
            acc, k, v,
        )
    c = lq // 2
    return jax.lax.cond(
        src < idx,
        functools.partial(pair, 0, lq, c, c),  # both q chunks, kv chunk src
        functools.partial(pair, c, c, lk, lk),  # q chunk 2n-1-idx, both kv chunks
        acc, k, v,
    )


def _gather_bwd(q, k, v, out, dout, lse, dlse, *, plan, call):
    k_all, v_all = _gather_kv(k, v, plan)
    lq, seqlen_k = q.shape[-3], k_all.shape[-3]

    def branch(bands):
        def run(q, k_all, v_all, out, dout, lse, dlse):
            dq = jnp.zeros(q.shape, _F32)
            dk = jnp.zeros(k_all.shape, _F32)
            dv = jnp.zeros(v_all.shape, _F32)
            for start, rows, hi in bands:
                sub = [_q_rows(x, start, rows) for x in (q, out, dout)]
                sub_lse = [_lse_rows(x, start, rows) for x in (lse, dlse)]
                gq, gk, gv = call(sub[0], k_all, v_all, sub[1], sub[2], *sub_lse, -rows, hi)
                dq = _add_q_rows(dq, gq, start)
                dk, dv = dk + gk.astype(_F32), dv + gv.astype(_F32)
            return dq, dk, dv

        return run

    operands = (q, k_all, v_all, out, dout, lse, dlse)
    if not plan.causal:
        dq, dk, dv = branch([(0, lq, seqlen_k)])(*operands)
    else:
        branches = [
            branch([(s, r, min(hi, seqlen_k)) for s, r, hi in _gather_row_bands(plan, d, lq, seqlen_k)])
            for d in range(plan.axis_size)
        ]
        dq, dk, dv = jax.lax.switch(_axis_index(plan), branches, *operands)
    axis = k.ndim - 3

    def scatter(x):  # this device's queries' share of every key -> the key owner's block
        x = _layout_order(x, plan, axis)
        return jax.lax.psum_scatter(x, plan.axis_name, scatter_dimension=axis, tiled=True)

    return dq.astype(q.dtype), scatter(dk).astype(k.dtype), scatter(dv).astype(v.dtype)


# --------------------------------------------------------------------------- unsharded


def _natural_segment_ids(segment_ids, n):
    """Segment ids [..., seq] of a zigzag layout in token order (None stays None)."""
    if segment_ids is None:
        return None
    return tuple(from_zigzag(x, n, x.ndim - 1) for x in segment_ids)


def full_sequence_fwd(q, k, v, *, diag_lo, diag_hi, config, call, segment_ids=None):
    """The whole sequence on one device, in the token order that config declares.
    segment_ids: None, or the (q, kv) ids in the layout of q and k."""
    layout, n = config[1], config[2]
    if layout != "zigzag" or band_kind(q.shape[-3], k.shape[-3], diag_lo, diag_hi) == "full":
        return call(q, k, v, diag_lo, diag_hi, segment_ids=segment_ids)
    qa, ka = q.ndim - 3, k.ndim - 3
    out, lse = call(from_zigzag(q, n, qa), from_zigzag(k, n, ka), from_zigzag(v, n, ka),
                    diag_lo, diag_hi, segment_ids=_natural_segment_ids(segment_ids, n))
    return to_zigzag(out, n, qa), to_zigzag(lse, n, lse.ndim - 1)


def full_sequence_bwd(q, k, v, out, dout, lse, dlse, *, diag_lo, diag_hi, config, call,
                      segment_ids=None):
    layout, n = config[1], config[2]
    if layout != "zigzag" or band_kind(q.shape[-3], k.shape[-3], diag_lo, diag_hi) == "full":
        return call(q, k, v, out, dout, lse, dlse, diag_lo, diag_hi, segment_ids=segment_ids)
    qa, ka, la = q.ndim - 3, k.ndim - 3, lse.ndim - 1
    qs = [from_zigzag(x, n, qa) for x in (q, out, dout)]
    ls = [from_zigzag(x, n, la) for x in (lse, dlse)]
    ks = [from_zigzag(x, n, ka) for x in (k, v)]
    dq, dk, dv = call(qs[0], *ks, qs[1], qs[2], *ls, diag_lo, diag_hi,
                      segment_ids=_natural_segment_ids(segment_ids, n))
    return to_zigzag(dq, n, qa), to_zigzag(dk, n, ka), to_zigzag(dv, n, ka)


def axis_size_of(axis_name):
    """The size of a manual mesh axis (or the product over a tuple of axes)."""
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    return math.prod(jax.lax.axis_size(a) for a in names)

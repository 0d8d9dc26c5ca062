"""The two FFI calls (forward, backward) and how inputs are adapted to them.

Everything here sees kernel-ready shapes: head_dim already padded to one of
KERNEL_HEAD_DIMS (and of SEGMENT_HEAD_DIMS with segment ids, SOFTCAP_HEAD_DIMS
with softcap, FLOAT32_HEAD_DIMS for float32 inputs) and the mask already
reduced to a diagonal band and, optionally, segment ids [batch, seq] of the
queries and the keys (masks.py, csrc/include/jflash/mask.h). softcap: None, or
the cap c > 0 of the scores (csrc/include/jflash/score.h). tf32_passes: the
precision of float32 inputs on CUDA, 1 (TF32) or 3 (3xTF32)
(validation.tf32_passes); the kernels of other dtypes and the CPU kernels
ignore it. Validation happens before, in flash_attention.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jflash._src import context_parallel as _cp
from jflash._src import ffi as _ffi
from jflash._src import sharding
from jflash._src.masks import clamp_band, segment_operands

# Head dims the kernels are built for, read from the library
# (csrc/include/jflash/head_dims.h, the one list). Other head dims are
# zero-padded up to the next one: zero columns of q and k add nothing to q.k,
# and zero columns of v give output columns that are sliced off. The CPU kernel
# takes the same padded shapes so that both platforms run one traced program.
KERNEL_HEAD_DIMS = _ffi.KERNEL_HEAD_DIMS
# Calls with segment ids, calls with softcap, and calls with float32 inputs run on
# kernels built for these head dims only (the CUDA build time), and pad other head
# dims up to the next of them (of every list that applies), on every platform.
SEGMENT_HEAD_DIMS = _ffi.SEGMENT_HEAD_DIMS
SOFTCAP_HEAD_DIMS = _ffi.SOFTCAP_HEAD_DIMS
FLOAT32_HEAD_DIMS = _ffi.FLOAT32_HEAD_DIMS


def padded_head_dim(head_dim: int, segments: bool = False, softcap: bool = False,
                    float32: bool = False) -> int:
    lists = [dims for dims, used in ((SEGMENT_HEAD_DIMS, segments), (SOFTCAP_HEAD_DIMS, softcap),
                                     (FLOAT32_HEAD_DIMS, float32))
             if used]
    for d in KERNEL_HEAD_DIMS:
        if head_dim <= d and all(d in dims for dims in lists):
            return d
    raise ValueError(f"head_dim {head_dim} exceeds {KERNEL_HEAD_DIMS[-1]}")


def _softcap_attribute(softcap):
    """The FFI's softcap attribute: the cap as float32, 0 for none."""
    return np.float32(0.0 if softcap is None else softcap)


def _tf32_passes_attribute(dtype, tf32_passes):
    """The FFI's tf32_passes attribute (int64, required on every call): the
    precision of float32 inputs, 1 for the other dtypes (whose kernels ignore it)."""
    return np.int64(tf32_passes if jnp.dtype(dtype) == jnp.float32 else 1)


def _segment_operands(segment_ids):
    """The six segment buffers of both FFI calls: the ids [..., seq] (int32) of the
    queries and the keys, their block summaries, and each row's keys and each
    key's rows (masks.segment_operands), computed here for the arrays the kernel
    gets; six empty arrays without segment ids."""
    if segment_ids is None:
        return (jnp.zeros((0,), jnp.int32),) * 6
    return segment_operands(*segment_ids, _ffi.SEGMENT_BLOCK)


def _fwd_ffi(q, k, v, *, softmax_scale, diag_lo, diag_hi, segment_ids=None, softcap=None,
             tf32_passes=1):
    *lead, seqlen_q, num_heads, _ = q.shape
    call = jax.ffi.ffi_call(
        _ffi.FWD_TARGET,
        (
            jax.ShapeDtypeStruct(q.shape, q.dtype),  # out
            jax.ShapeDtypeStruct((*lead, num_heads, seqlen_q), jnp.float32),  # lse
            # The Hopper kernels' schedule counter under segment ids (params.h).
            jax.ShapeDtypeStruct((0 if segment_ids is None else 1,), jnp.int32),
        ),
        # Handlers fold every leading axis into batch, so a vmapped call is one
        # kernel launch over batch * vmap_size, not a loop.
        vmap_method="broadcast_all",
    )
    out, lse, _ = call(
        q,
        k,
        v,
        *_segment_operands(segment_ids),
        softmax_scale=np.float32(softmax_scale),
        diag_lo=np.int64(diag_lo),
        diag_hi=np.int64(diag_hi),
        softcap=_softcap_attribute(softcap),
        tf32_passes=_tf32_passes_attribute(q.dtype, tf32_passes),
    )
    return out, lse


# Deterministic mode's int32 counters per (batch, head): two per 32 query rows
# (csrc/include/jflash/params.h, dq_semaphore_slots).
_DQ_SEMAPHORE_ROWS = 32


# Where a backward call's dq goes (csrc/include/jflash/params.h, DqMode): dq in
# the input dtype; the float32 sum of dS K itself (dq = softmax_scale times it;
# q's layout), with the call's delta; or that sum given and added into, with
# the delta of the call that started it.
DQ_WRITE, DQ_RETURN_ACCUM, DQ_ADD_TO_ACCUM = 0, 1, 2


def _bwd_ffi(q, k, v, out, dout, lse, dlse, *, softmax_scale, diag_lo, diag_hi, on_cpu,
             deterministic=False, segment_ids=None, softcap=None, tf32_passes=1,
             dq_mode=DQ_WRITE, dq_accum=None, delta=None, row_offset=0, dkv_accum=None):
    """(dq, dk, dv); with DQ_RETURN_ACCUM (dq_accum, dk, dv, delta); with
    DQ_ADD_TO_ACCUM (dq_accum + this call's sum in its rows [row_offset,
    row_offset + seqlen_q), dk, dv), given the dq_accum and delta of a
    DQ_RETURN_ACCUM call over rows that include these; out and dlse are then
    not read (delta replaces rowsum(dout * out) - dlse).

    dkv_accum: None, or float32 sums [..., 2, rows, num_heads_kv, head_dim]
    (dK then dV, rows >= seqlen_k; params.h, DkvMode) that this call's dK and
    dV are added into, at their first seqlen_k rows: it then stands for dk, dv
    in the results (one array where there were two)."""
    *lead, seqlen_q, num_heads, head_dim = q.shape
    f32 = jnp.float32
    adds = dq_mode == DQ_ADD_TO_ACCUM
    if adds != (dq_accum is not None and delta is not None) or (row_offset and not adds):
        raise ValueError("dq_accum, delta and row_offset go with DQ_ADD_TO_ACCUM only")
    # The CUDA kernels accumulate dq in a float32 scratch; the CPU kernel keeps
    # each dq tile in its task's memory, so on CPU the handler takes an empty one
    # unless the caller takes the sum.
    rows_shape = (*lead, num_heads, seqlen_q)
    if adds:
        dq_accum_shape = dq_accum.shape
    elif dq_mode == DQ_RETURN_ACCUM:
        dq_accum_shape = q.shape
    elif on_cpu:
        dq_accum_shape = (0,)
    else:
        dq_accum_shape = (*rows_shape, head_dim)  # the kernels' own layout
    # Deterministic mode: counters that order the CUDA kernels' dq additions by
    # key block. Their presence is the switch; the CPU kernel is deterministic
    # by construction and takes an empty buffer.
    slots = 2 * -(-seqlen_q // _DQ_SEMAPHORE_ROWS)
    semaphore_shape = (*lead, num_heads, slots) if deterministic and not on_cpu else (0,)
    # GQA: float32 dK, dV sums per kv head, so that the CUDA launcher may split a
    # kv head's query heads over several CTAs (params.h, dkv_accum); 2 / group
    # of dq_accum's size.
    num_heads_kv, seqlen_k = k.shape[-2], k.shape[-3]
    adds_dkv = dkv_accum is not None
    if adds_dkv:
        want = (*k.shape[:-3], 2, None, num_heads_kv, k.shape[-1])
        if (dkv_accum.dtype != f32 or dkv_accum.ndim != len(want)
                or any(w is not None and g != w for g, w in zip(dkv_accum.shape, want))
                or dkv_accum.shape[-3] < seqlen_k):
            raise ValueError(f"dkv_accum must be float32 [..., 2, rows >= {seqlen_k}, "
                             f"{num_heads_kv}, {k.shape[-1]}] for k {k.shape}, got "
                             f"{dkv_accum.dtype} {dkv_accum.shape}")
        dkv_accum_shape = dkv_accum.shape
    elif num_heads != num_heads_kv and not on_cpu:
        dkv_accum_shape = (*lead, num_heads_kv, 2, seqlen_k, head_dim)
    else:
        dkv_accum_shape = (0,)
    aliases = {**({14: 3} if adds else {}), **({15: 6} if adds_dkv else {})}
    empty = jnp.zeros((0,), f32)
    call = jax.ffi.ffi_call(
        _ffi.BWD_TARGET,
        (
            jax.ShapeDtypeStruct(q.shape if dq_mode == DQ_WRITE else (0,), q.dtype),  # dq
            jax.ShapeDtypeStruct((0,) if adds_dkv else k.shape, k.dtype),  # dk
            jax.ShapeDtypeStruct((0,) if adds_dkv else v.shape, v.dtype),  # dv
            # Float32 scratch the kernels need; XLA allocates it, so the handlers
            # never call cudaMalloc and stay CUDA-graph safe.
            jax.ShapeDtypeStruct(dq_accum_shape, f32),  # dq_accum
            jax.ShapeDtypeStruct((0,) if adds else rows_shape, f32),  # delta
            jax.ShapeDtypeStruct(semaphore_shape, jnp.int32),  # dq_semaphore
            jax.ShapeDtypeStruct(dkv_accum_shape, f32),  # dkv_accum
        ),
        vmap_method="broadcast_all",
        # The caller's accumulators are the dq_accum and dkv_accum results:
        # added into in place.
        input_output_aliases=aliases or None,
    )
    dq, dk, dv, dq_accum_out, delta_out, _, dkv_out = call(
        q,
        k,
        v,
        out,
        dout,
        lse,
        dlse,
        *_segment_operands(segment_ids),
        delta if adds else empty,  # delta_in
        dq_accum if adds else empty,  # dq_accum_in
        dkv_accum if adds_dkv else empty,  # dkv_accum_in
        softmax_scale=np.float32(softmax_scale),
        diag_lo=np.int64(diag_lo),
        diag_hi=np.int64(diag_hi),
        softcap=_softcap_attribute(softcap),
        tf32_passes=_tf32_passes_attribute(q.dtype, tf32_passes),
        dq_mode=np.int64(dq_mode),
        dq_accum_row_offset=np.int64(row_offset),
        dkv_mode=np.int64(1 if adds_dkv else 0),
    )
    dkv = (dkv_out,) if adds_dkv else (dk, dv)
    if dq_mode == DQ_WRITE:
        return dq, *dkv
    if dq_mode == DQ_RETURN_ACCUM:
        return dq_accum_out, *dkv, delta_out
    return dq_accum_out, *dkv


def dq_from_accum(dq_accum, softmax_scale, dtype):
    """dq in dtype from a float32 dq_accum, as the kernels convert their own."""
    return (dq_accum * np.float32(softmax_scale)).astype(dtype)


class BwdBandCall:
    """The backward kernel on any arrays, its band clamped to their lengths
    (context_parallel.py's chunk pairs). call(q, k, v, out, dout, lse, dlse,
    diag_lo, diag_hi, segment_ids=None) -> (dq, dk, dv).

    A ring's steps share one float32 dq sum and one delta per query block and
    one float32 dK, dV sum per K/V block instead, which the kernels add into:
    start(q, k, v, out, dout, lse, dlse, diag_lo, diag_hi, dkv_accum) ->
    (dq_accum, dkv_accum, delta) over all the rows, add(dq_accum, row_offset,
    dkv_accum, q, k, v, dout, lse, delta, diag_lo, diag_hi) -> (dq_accum,
    dkv_accum) for rows [row_offset, row_offset + q rows) of them, with
    dkv_accum from dkv_zeros(k) (the call's keys are its first rows), and
    dq(dq_accum, dtype), dkv(dkv_accum, dtype) -> (dk, dv) at the end.

    run(*operands, **kw) is the FFI call (_bwd_ffi without the static
    arguments below); plain, if given, serves __call__ instead (the
    partitioned call, where one is needed)."""

    def __init__(self, softmax_scale, run, *, plain=None):
        self.softmax_scale = softmax_scale
        self._run = run
        self._plain = plain

    def __call__(self, q, k, v, out, dout, lse, dlse, diag_lo, diag_hi, segment_ids=None):
        lo, hi = clamp_band(q.shape[-3], k.shape[-3], diag_lo, diag_hi)
        if self._plain is not None:
            return self._plain(q, k, v, out, dout, lse, dlse, lo, hi, segment_ids=segment_ids)
        return self._run(q, k, v, out, dout, lse, dlse, diag_lo=lo, diag_hi=hi,
                         segment_ids=segment_ids)

    def start(self, q, k, v, out, dout, lse, dlse, diag_lo, diag_hi, dkv_accum):
        lo, hi = clamp_band(q.shape[-3], k.shape[-3], diag_lo, diag_hi)
        return self._run(q, k, v, out, dout, lse, dlse, diag_lo=lo, diag_hi=hi,
                         dq_mode=DQ_RETURN_ACCUM, dkv_accum=dkv_accum)

    def add(self, dq_accum, row_offset, dkv_accum, q, k, v, dout, lse, delta, diag_lo, diag_hi):
        lo, hi = clamp_band(q.shape[-3], k.shape[-3], diag_lo, diag_hi)
        # out and dlse are not read with the caller's delta (_bwd_ffi): dout and
        # delta stand in, so that a ring's sub-calls need no slices of them.
        return self._run(q, k, v, dout, dout, lse, delta, diag_lo=lo, diag_hi=hi,
                         dq_mode=DQ_ADD_TO_ACCUM, dq_accum=dq_accum, delta=delta,
                         row_offset=row_offset, dkv_accum=dkv_accum)

    def dq(self, dq_accum, dtype):
        return dq_from_accum(dq_accum, self.softmax_scale, dtype)

    @staticmethod
    def dkv_zeros(k):
        """Empty dK, dV sums for the keys of k, [..., 2, seq, heads_kv, head_dim]."""
        return jnp.zeros((*k.shape[:-3], 2, *k.shape[-3:]), jnp.float32)

    @staticmethod
    def dkv(dkv_accum, dtype):
        """(dk, dv) in dtype from dK, dV sums (dK scaled, as the kernels add it)."""
        return tuple(jnp.take(dkv_accum, i, axis=-4).astype(dtype) for i in (0, 1))


def fwd_band_call(softmax_scale, softcap=None, tf32_passes=1):
    """call(q, k, v, diag_lo, diag_hi, segment_ids=None) -> (out, lse): the forward
    kernel on any arrays, its band clamped to their lengths (context_parallel.py's
    chunk pairs: the cap applies score by score, so chunks combine exactly);
    segment_ids: None or (q ids, kv ids) of those arrays."""

    def call(q, k, v, diag_lo, diag_hi, segment_ids=None):
        lo, hi = clamp_band(q.shape[-3], k.shape[-3], diag_lo, diag_hi)
        return _fwd_ffi(q, k, v, softmax_scale=softmax_scale, diag_lo=lo, diag_hi=hi,
                        segment_ids=segment_ids, softcap=softcap, tf32_passes=tf32_passes)

    return call


def bwd_band_call(softmax_scale, *, on_cpu, deterministic=False, softcap=None, tf32_passes=1):
    """A BwdBandCall on one platform (on_cpu: the CPU branch of bwd, no dq
    scratch); deterministic: dq bit-identical from run to run."""
    return BwdBandCall(softmax_scale, functools.partial(
        _bwd_ffi, softmax_scale=softmax_scale, on_cpu=on_cpu, deterministic=deterministic,
        softcap=softcap, tf32_passes=tf32_passes,
    ))


def bwd_local_call(softmax_scale, *, plain=None, softcap=None, tf32_passes=1):
    """A BwdBandCall for per-device code (inside shard_map) that picks the CPU
    or the CUDA kernel when the program is lowered; plain serves its
    (dq, dk, dv) calls."""

    def run(*operands, dq_accum=None, delta=None, dkv_accum=None, **kw):
        # The accumulators and delta travel as operands of the platform switch.
        names = [n for n, x in (("dq_accum", dq_accum), ("delta", delta),
                                ("dkv_accum", dkv_accum)) if x is not None]
        given = tuple(x for x in (dq_accum, delta, dkv_accum) if x is not None)

        def on(cpu):
            def branch(*arrays):
                extra = dict(zip(names, arrays[len(operands):]))
                return _bwd_ffi(*arrays[:len(operands)], softmax_scale=softmax_scale, on_cpu=cpu,
                                softcap=softcap, tf32_passes=tf32_passes, **extra, **kw)

            return branch

        arrays = (*operands, *given)
        results = jax.lax.platform_dependent(*arrays, cpu=on(True), default=on(False))
        # Inside shard_map: typed as varying where the operands are.
        return sharding._restore_varying_axes(arrays, results)

    return BwdBandCall(softmax_scale, run, plain=plain)


def _segments(segment_ids):
    """The optional trailing operands (q ids, kv ids) of the partitioned calls."""
    return tuple(segment_ids) if segment_ids else None


def _fwd_body(q, k, v, *segment_ids, softmax_scale, softcap, tf32_passes, diag_lo, diag_hi,
              context_parallel):
    """The forward of a whole sequence, in the token order context_parallel declares."""
    return _cp.full_sequence_fwd(
        q, k, v, diag_lo=diag_lo, diag_hi=diag_hi, config=context_parallel,
        call=fwd_band_call(softmax_scale, softcap, tf32_passes),
        segment_ids=_segments(segment_ids),
    )


def _bwd_body(q, k, v, out, dout, lse, dlse, *segment_ids, softmax_scale, softcap, tf32_passes,
              diag_lo, diag_hi, context_parallel, on_cpu, deterministic):
    return _cp.full_sequence_bwd(
        q, k, v, out, dout, lse, dlse, diag_lo=diag_lo, diag_hi=diag_hi,
        config=context_parallel,
        call=bwd_band_call(softmax_scale, on_cpu=on_cpu, deterministic=deterministic,
                           softcap=softcap, tf32_passes=tf32_passes),
        segment_ids=_segments(segment_ids),
    )


# Under jax.jit with sharded operands, each device runs the kernels on its own
# batch/heads shard, and a sequence shard runs context-parallel (sharding.py has
# the rules and what they gather; context_parallel.py the ring).
_fwd_native = sharding.partitioned_fwd(_fwd_body, fwd_band_call)
_bwd_native = sharding.partitioned_bwd(_bwd_body, bwd_band_call)


def fwd(q, k, v, *, softmax_scale, diag_lo, diag_hi, context_parallel=_cp.DEFAULT_CONFIG,
        segment_ids=None, softcap=None, tf32_passes=1):
    """(out, lse) for kernel-ready inputs; lse is float32 [batch, heads, seqlen_q],
    of the capped scores with softcap.

    context_parallel: (strategy, layout, layout axis size), context_parallel.py.
    segment_ids: None, or int32 (q ids [batch, seqlen_q], kv ids [batch, seqlen_k]).
    softcap: None, or the cap c > 0 (a Python float).
    tf32_passes: 1 or 3, the precision of float32 inputs on CUDA (the module
    docstring); every dtype goes to the kernels as it is (the CUDA and the CPU
    kernels read float16, bfloat16 and float32).
    """
    kw = dict(softmax_scale=softmax_scale, softcap=softcap,
              tf32_passes=_ffi.check_tf32_passes(tf32_passes), diag_lo=diag_lo,
              diag_hi=diag_hi, context_parallel=context_parallel)
    return _fwd_native(q, k, v, *tuple(segment_ids or ()), **kw)


def bwd(q, k, v, out, dout, lse, dlse, *, softmax_scale, diag_lo, diag_hi,
        context_parallel=_cp.DEFAULT_CONFIG, deterministic=False, segment_ids=None,
        softcap=None, tf32_passes=1):
    """(dq, dk, dv) in the input dtype, recomputing attention from (q, k, v, out, lse).

    deterministic: gradients bit-identical from run to run (the CUDA kernels add
    dq in key-block order; the CPU kernel always does). segment_ids, softcap,
    tf32_passes: as for fwd. lax.platform_dependent picks the CPU call (no dq
    scratch) or the CUDA one when the program is lowered.
    """
    kw = dict(softmax_scale=softmax_scale, softcap=softcap,
              tf32_passes=_ffi.check_tf32_passes(tf32_passes), diag_lo=diag_lo,
              diag_hi=diag_hi, context_parallel=context_parallel, on_cpu=False,
              deterministic=bool(deterministic))
    ids = tuple(segment_ids or ())
    on_cpu = functools.partial(_bwd_native, **dict(kw, on_cpu=True))
    on_gpu = functools.partial(_bwd_native, **kw)
    return jax.lax.platform_dependent(
        q, k, v, out, dout, lse, dlse, *ids, cpu=on_cpu, default=on_gpu
    )

"""jflash.context_parallel.ring_attention: context parallelism inside jax.shard_map.

For programs that manage their own per-device code: each device passes its
sequence block, and the blocks of the other devices along axis_name come to it
(ring) or are gathered (all_gather). Differentiable through a custom_vjp whose
backward runs the kernel backward per chunk pair (context_parallel.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jflash._src import context_parallel as cp
from jflash._src import kernel_calls, masks, validation


def _fwd_call(softmax_scale, tf32_passes):
    def call(q, k, v, diag_lo, diag_hi):
        lo, hi = masks.clamp_band(q.shape[-3], k.shape[-3], diag_lo, diag_hi)
        return kernel_calls.fwd(q, k, v, softmax_scale=softmax_scale, diag_lo=lo, diag_hi=hi,
                                tf32_passes=tf32_passes)

    return call


def _bwd_call(softmax_scale, tf32_passes):
    def plain(q, k, v, out, dout, lse, dlse, diag_lo, diag_hi, segment_ids=None):
        del segment_ids  # ring_attention has none
        return kernel_calls.bwd(
            q, k, v, out, dout, lse, dlse, softmax_scale=softmax_scale, diag_lo=diag_lo,
            diag_hi=diag_hi, tf32_passes=tf32_passes,
        )

    return kernel_calls.bwd_local_call(softmax_scale, plain=plain, tf32_passes=tf32_passes)


# tf32: the kernels' tf32_passes (validation.tf32_passes), static like the plan.
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _ring(q, k, v, plan, softmax_scale, tf32):
    return cp.sharded_fwd(q, k, v, plan=plan, call=_fwd_call(softmax_scale, tf32))


def _ring_fwd(q, k, v, plan, softmax_scale, tf32):
    out, lse = cp.sharded_fwd(q, k, v, plan=plan, call=_fwd_call(softmax_scale, tf32))
    return (out, lse), (q, k, v, out, lse)


def _ring_bwd(plan, softmax_scale, tf32, residuals, cotangents):
    q, k, v, out, lse = residuals
    dout, dlse = cotangents
    return cp.sharded_bwd(
        q, k, v, out, dout.astype(out.dtype), lse, dlse.astype(jnp.float32),
        plan=plan, call=_bwd_call(softmax_scale, tf32),
    )


_ring.defvjp(_ring_fwd, _ring_bwd)


def _check_axis_name(axis_name):
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if not names or not all(isinstance(a, str) for a in names):
        raise TypeError(
            f"axis_name must be a mesh axis name or a tuple of them, got {axis_name!r}"
        )
    try:
        return cp.axis_size_of(axis_name)
    except NameError as e:
        raise ValueError(
            f"axis_name {axis_name!r} is not a manual axis here: call ring_attention inside "
            f"jax.shard_map over that mesh axis ({e})"
        ) from None


def ring_attention(query, key, value, *, axis_name, causal=False, softmax_scale=None,
                   layout="contiguous", strategy="ring", return_lse=False, precision=None):
    """Context-parallel attention over the sequence blocks of a shard_map axis.

    Call inside jax.shard_map with the sequence axis of query, key and value
    sharded over axis_name: each device passes its own blocks, [batch, L,
    num_heads, head_dim] and [batch, Lk, num_heads_kv, head_dim], and gets the
    output rows of its queries against the whole sequence.

    Args:
      axis_name: the mesh axis (or tuple of axes) the sequence is sharded over.
      causal: causal mask over the whole sequence (needs L == Lk); positions
        follow layout.
      layout: "contiguous": device i holds block i of the sequence in order.
        "zigzag": device i of n holds chunks i and 2n - 1 - i of 2n (the tokens
        permuted by shard_sequence(x, n)); balances causal work.
      strategy: "ring" (K/V blocks pass around the ring with ppermute),
        "all_gather" (K/V gathered, dK/dV reduce-scattered) or "auto" (the
        heuristic of jflash.context_parallel_strategy).
      softmax_scale, return_lse, precision: as for jflash.flash_attention (lse
        of the whole row, differentiable; precision: of float32 inputs on GPU).
    """
    q_shape, k_shape, dtype = validation.check_qkv(query, key, value)
    causal = validation.check_bool("causal", causal)
    return_lse = validation.check_bool("return_lse", return_lse)
    softmax_scale = validation.check_softmax_scale(softmax_scale, q_shape[3])
    float32 = dtype == jnp.float32
    tf32 = validation.tf32_passes(precision)  # validated whatever the dtype
    tf32 = tf32 if float32 else 1
    if not isinstance(layout, str) or layout not in cp.LAYOUTS:
        raise ValueError(f"layout must be one of {cp.LAYOUTS}, got {layout!r}")
    if not isinstance(strategy, str) or strategy not in cp.STRATEGIES:
        raise ValueError(f"strategy must be one of {cp.STRATEGIES}, got {strategy!r}")
    if causal and q_shape[1] != k_shape[1]:
        raise ValueError(
            "causal ring_attention needs query and key blocks of the same length, got "
            f"query {q_shape} and key {k_shape}"
        )
    if causal and layout == "zigzag" and q_shape[1] % 2:
        raise ValueError(
            f"layout='zigzag' needs an even block length (two chunks), got query {q_shape}"
        )
    axis_size = _check_axis_name(axis_name)
    plan = cp.Plan(
        axis_name=axis_name,
        axis_size=axis_size,
        strategy=cp.choose_strategy(strategy, axis_size, q_shape[2], k_shape[2],
                                    keys_per_device=k_shape[1]),
        layout=layout if causal else "contiguous",
        causal=causal,
    )
    head_dim = q_shape[3]
    kernel_head_dim = kernel_calls.padded_head_dim(head_dim, float32=float32)
    q, k, v = query, key, value
    if kernel_head_dim != head_dim:
        pad = [(0, 0), (0, 0), (0, 0), (0, kernel_head_dim - head_dim)]
        q, k, v = (jnp.pad(x, pad) for x in (q, k, v))
    out, lse = _ring(q, k, v, plan, float(softmax_scale), tf32)
    if kernel_head_dim != head_dim:
        out = out[..., :head_dim]
    return (out, lse) if return_lse else out

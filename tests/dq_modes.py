"""The backward's accumulating modes (kernel_calls.BwdBandCall: start, add, dq,
dkv), as a context-parallel ring uses them: one call over all rows keeps its
float32 dq sum and gives its delta, a later call over a slice of the rows (its
own keys, its own band) adds into that sum at a row offset; every call adds its
dK, dV into float32 sums of its K/V block (the call's keys are their first
rows). Checked against the plain calls of the same sub-problems (the CPU tests
in test_context_parallel.py, the CUDA kernels in test_cuda_specific.py)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from checks import qkv_inputs
from jflash._src import kernel_calls


def _f32(x):
    return np.asarray(jnp.asarray(x, jnp.float32))


def check_dq_modes(rng, *, dtype, head_dim, on_cpu, exact, deterministic=False,
                   shape=(2, 203, 4, 2), row_offset=96, key_split=130):
    """exact: the sums must match bit for bit (the CPU kernels, whose dq tiles
    do not depend on where they are added); else within a few roundings of
    dtype (the CUDA kernels add in the order their CTAs finish)."""
    batch, seq, heads, heads_kv = shape
    q, k, v = qkv_inputs(rng, (batch, seq, seq, heads, heads_kv, head_dim), dtype)
    dout = jnp.asarray(rng.standard_normal(q.shape), dtype)
    dlse = jnp.asarray(rng.standard_normal((batch, heads, seq)), jnp.float32)
    scale = head_dim ** -0.5
    # The causal forward over all keys gives out and lse (bounded P).
    out, lse = kernel_calls._fwd_ffi(q, k, v, softmax_scale=scale, diag_lo=-seq, diag_hi=0)
    call = kernel_calls.bwd_band_call(scale, on_cpu=on_cpu, deterministic=deterministic)

    # A: every row against keys [0, key_split), causal. B: rows [row_offset,
    # seq) against keys [key_split, seq), the same diagonal in its own indices.
    ka, va = k[:, :key_split], v[:, :key_split]
    kb, vb = k[:, key_split:], v[:, key_split:]
    rows = slice(row_offset, seq)
    hi_b = row_offset - key_split
    b_args = (q[:, rows], kb, vb, out[:, rows], dout[:, rows], lse[..., rows], dlse[..., rows],
              -seq, hi_b)

    accum, dkv_a, delta = call.start(q, ka, va, out, dout, lse, dlse, -seq, 0,
                                     call.dkv_zeros(ka))
    dk_a, dv_a = call.dkv(dkv_a, dtype)
    plain_a = call(q, ka, va, out, dout, lse, dlse, -seq, 0)
    accum_b_alone, dkv_b_alone, _ = call.start(*b_args, call.dkv_zeros(kb))
    plain_b = call(*b_args)
    # B's dK, dV go into sums with rows past its keys, which already hold values.
    extra = 7
    dkv_init = jnp.asarray(rng.standard_normal((batch, 2, kb.shape[1] + extra, *kb.shape[2:])),
                           jnp.float32)
    added, dkv_b = call.add(accum, row_offset, dkv_init, q[:, rows], kb, vb, dout[:, rows],
                            lse[..., rows], delta[..., rows], -seq, hi_b)
    dk_b, dv_b = call.dkv(dkv_b_alone, dtype)

    assert accum.shape == q.shape and accum.dtype == jnp.float32
    assert dkv_b.shape == dkv_init.shape and dkv_b.dtype == jnp.float32
    want_delta = (np.sum(_f32(dout) * _f32(out), -1).transpose(0, 2, 1) - _f32(dlse))
    np.testing.assert_allclose(_f32(delta), want_delta, rtol=1e-5, atol=1e-5)
    # The kept sums are the plain call's dq before its scale and rounding, and
    # its dk, dv before their rounding.
    dq_a = _f32(call.dq(accum, dtype))
    want = _f32(accum).copy()
    want[:, rows] += _f32(accum_b_alone)
    want_dkv = _f32(dkv_init).copy()
    want_dkv[:, :, :kb.shape[1]] += _f32(dkv_b_alone)
    tol = 0 if exact else 4 * float(jnp.finfo(dtype).eps)
    for got, ref in ((dq_a, _f32(plain_a[0])), (_f32(dk_a), _f32(plain_a[1])),
                     (_f32(dv_a), _f32(plain_a[2])), (_f32(dk_b), _f32(plain_b[1])),
                     (_f32(dv_b), _f32(plain_b[2])), (_f32(added), want),
                     (_f32(dkv_b), want_dkv)):
        np.testing.assert_allclose(got, ref, rtol=0, atol=tol * max(1.0, np.abs(ref).max()))
    # What a ring returns: every row's dq from one rounding of the sum.
    dq_total = _f32(call.dq(added, dtype))
    dq_parts = dq_a.copy()
    dq_parts[:, rows] += _f32(plain_b[0])
    part_tol = 4 * float(jnp.finfo(dtype).eps) * max(1.0, np.abs(dq_parts).max())
    np.testing.assert_allclose(dq_total, dq_parts, rtol=0, atol=part_tol)
    # The rows before the offset are the first call's alone; the sums' rows
    # past B's keys are as they were.
    np.testing.assert_array_equal(_f32(added)[:, :row_offset], _f32(accum)[:, :row_offset])
    np.testing.assert_array_equal(_f32(dkv_b)[:, :, kb.shape[1]:],
                                  _f32(dkv_init)[:, :, kb.shape[1]:])

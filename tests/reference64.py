"""A float64 NumPy attention and its gradients: the yardstick for error checks.

jflash.reference computes in float32, which is exact enough to judge half
precision but not float32 kernels (a float32 kernel would be judged against
itself). FlashAttention's rule compares errors against this float64 truth:
    max|kernel - truth| <= 2 * max|plain same-dtype computation - truth| + floor.
"""

from __future__ import annotations

import numpy as np


def _expand_kv(x, group):
    return np.repeat(x, group, axis=2)  # kv head h // group serves query head h


def forward(q, k, v, softmax_scale, diag_lo, diag_hi):
    """(out [b,sq,h,d], lse [b,h,sq], p [b,h,sq,sk]) in float64."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = _expand_kv(k, group), _expand_kv(v, group)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * softmax_scale
    sq, sk = q.shape[1], k.shape[1]
    offset = np.arange(sk)[None, :] - np.arange(sq)[:, None]
    visible = (offset >= diag_lo) & (offset <= diag_hi)
    s = np.where(visible, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    denom = p.sum(-1, keepdims=True)
    seen = denom > 0
    p = p / np.where(seen, denom, 1.0)
    out = np.einsum("bhqk,bkhd->bqhd", p, v)
    lse = np.where(seen, np.log(np.where(seen, denom, 1.0)) + m, -np.inf)[..., 0]
    return out, lse, p


def backward(q, k, v, dout, dlse, softmax_scale, diag_lo, diag_hi):
    """(dq, dk, dv) in float64 for cotangents dout (of out) and dlse (of lse)."""
    q, k, v, dout = (np.asarray(x, np.float64) for x in (q, k, v, dout))
    dlse = np.asarray(dlse, np.float64)
    out, _, p = forward(q, k, v, softmax_scale, diag_lo, diag_hi)
    group = q.shape[2] // k.shape[2]
    ke, ve = _expand_kv(k, group), _expand_kv(v, group)
    dv = np.einsum("bhqk,bqhd->bkhd", p, dout)
    dp = np.einsum("bqhd,bkhd->bhqk", dout, ve)
    delta = np.einsum("bqhd,bqhd->bhq", dout, out) - dlse  # d lse / d s = p
    ds = p * (dp - delta[..., None])
    dq = np.einsum("bhqk,bkhd->bqhd", ds, ke) * softmax_scale
    dk = np.einsum("bhqk,bqhd->bkhd", ds, q) * softmax_scale

    def fold(x):  # sum the query heads of each group into their kv head
        b, s, h, d = x.shape
        return x.reshape(b, s, h // group, group, d).sum(3)

    return dq, fold(dk), fold(dv)

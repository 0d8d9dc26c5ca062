"""A float64 NumPy attention and its gradients: the yardstick for error checks.

jflash.reference computes in float32, which is exact enough to judge half
precision but not float32 kernels (a float32 kernel would be judged against
itself). FlashAttention's rule compares errors against this float64 truth:
    max|kernel - truth| <= 2 * max|plain same-dtype computation - truth| + floor.

NaN and Inf follow jflash's semantics (README, "NaN and Inf"), the same as
jflash.reference's: a masked (query, key) pair takes no part, so its score
enters no max or sum, and its probability and score gradient are exactly 0;
sums over the pairs (P V, P^T dO, dS K, dS^T Q) skip masked pairs rather
than multiply a non-finite input by their 0. A row that sees no key (a fact
of the mask) gives out 0, lse -inf and no gradient; a row that sees keys
but whose softmax is undefined (a NaN or +inf score, or every score -inf)
gives out and lse NaN. softcap c: the scores are c * tanh(s / c) for s =
softmax_scale * q.k, before the mask.
"""

from __future__ import annotations

import numpy as np


def _expand_kv(x, group):
    return np.repeat(x, group, axis=2)  # kv head h // group serves query head h


def visible_mask(seqlen_q, seqlen_k, diag_lo, diag_hi, q_segment_ids=None, kv_segment_ids=None):
    """[seqlen_q, seqlen_k] bool: key j visible from query i iff diag_lo <= j - i <= diag_hi;
    with segment ids ([batch, seqlen_q], [batch, seqlen_k]) [batch, seqlen_q, seqlen_k],
    where also q_segment_ids[b, i] == kv_segment_ids[b, j]."""
    offset = np.arange(seqlen_k)[None, :] - np.arange(seqlen_q)[:, None]
    band = (offset >= diag_lo) & (offset <= diag_hi)
    if q_segment_ids is None:
        return band
    q_ids, kv_ids = np.asarray(q_segment_ids), np.asarray(kv_segment_ids)
    return band & (q_ids[:, :, None] == kv_ids[:, None, :])


def visible_sum(w, x, visible, over_keys=False):
    """The sum over visible pairs of w times x, masked pairs skipped.

    over_keys False: y[b, i, h] = sum_j w[b, h, i, j] x[b, j, h] (P V, dS K).
    over_keys True:  y[b, j, h] = sum_i w[b, h, i, j] x[b, i, h] (P^T dO, dS^T Q).
    w must be 0 on masked pairs; visible [seq_q, seq_k] or [batch, seq_q, seq_k].
    Finite x enters one einsum; each row of x with a non-finite entry adds its
    terms of the visible pairs only, so a NaN in x reaches the rows (or keys)
    that see it, and no others.
    """
    spec = "bhij,bihd->bjhd" if over_keys else "bhij,bjhd->bihd"
    finite = np.isfinite(x)
    y = np.einsum(spec, w, np.where(finite, x, 0.0))
    visible = np.broadcast_to(visible, (w.shape[0], *visible.shape[-2:]))
    for b, n, h in zip(*np.nonzero(~finite.all(-1))):
        pairs = visible[b].T if over_keys else visible[b]  # [summed-into, summed-over]
        into = pairs[:, n]  # the rows (keys) that see position n of x
        weights = w[b, h, :, n][into] if not over_keys else w[b, h, n, :][into]
        bad = ~finite[b, n, h]
        with np.errstate(invalid="ignore"):
            y[b, into, h] += np.where(bad, weights[:, None] * x[b, n, h][None, :], 0.0)
    return y


def _visible4(sq, sk, diag_lo, diag_hi, segment_ids):
    """The mask as [batch or 1, 1, sq, sk], broadcast over heads."""
    visible = visible_mask(sq, sk, diag_lo, diag_hi, *(segment_ids or (None, None)))
    return visible.reshape(-1, 1, sq, sk)


def _capped_scores(q, k, softmax_scale, softcap):
    """(scores [b,h,sq,sk], tanh of the capped ones or None) of expanded q, k."""
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * softmax_scale
    if softcap is None:
        return s, None
    t = np.tanh(s / softcap)
    return softcap * t, t


def forward(q, k, v, softmax_scale, diag_lo, diag_hi, segment_ids=None, softcap=None):
    """(out [b,sq,h,d], lse [b,h,sq], p [b,h,sq,sk]) in float64; segment_ids: None or
    (q ids [b, sq], kv ids [b, sk]); softcap: None or the cap c > 0."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = _expand_kv(k, group), _expand_kv(v, group)
    sq, sk = q.shape[1], k.shape[1]
    visible = _visible4(sq, sk, diag_lo, diag_hi, segment_ids)
    no_key = ~visible.any(-1, keepdims=True)  # rows that see no key
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        s, _ = _capped_scores(q, k, softmax_scale, softcap)
        s = np.where(visible, s, -np.inf)
        m = s.max(-1, keepdims=True)  # NaN if a visible score is NaN
        m = np.where(m == -np.inf, 0.0, m)  # no key, or every score -inf: -inf - -inf = NaN
        p = np.where(visible, np.exp(s - m), 0.0)
        denom = p.sum(-1, keepdims=True)
        p = np.where(visible, p / np.where(no_key, 1.0, denom), 0.0)  # 0 / 0 = NaN: undefined rows
        lse = np.where(no_key, -np.inf, np.where(denom == 0, np.nan, np.log(denom) + m))[..., 0]
    out = visible_sum(p, v, visible[:, 0])
    return out, lse, p


def backward(q, k, v, dout, dlse, softmax_scale, diag_lo, diag_hi, segment_ids=None,
             softcap=None):
    """(dq, dk, dv) in float64 for cotangents dout (of out) and dlse (of lse)."""
    q, k, v, dout = (np.asarray(x, np.float64) for x in (q, k, v, dout))
    dlse = np.asarray(dlse, np.float64)
    out, _, p = forward(q, k, v, softmax_scale, diag_lo, diag_hi, segment_ids, softcap)
    group = q.shape[2] // k.shape[2]
    ke, ve = _expand_kv(k, group), _expand_kv(v, group)
    visible = _visible4(q.shape[1], k.shape[1], diag_lo, diag_hi, segment_ids)
    with np.errstate(invalid="ignore", over="ignore"):
        dv = visible_sum(p, dout, visible[:, 0], over_keys=True)
        dp = np.einsum("bqhd,bkhd->bhqk", dout, ve)
        delta = np.einsum("bqhd,bqhd->bhq", dout, out) - dlse  # d lse / d s = p
        ds = p * (dp - delta[..., None])
        if softcap is not None:  # d (c tanh(s / c)) / ds
            ds = ds * (1 - _capped_scores(q, ke, softmax_scale, softcap)[1] ** 2)
        ds = np.where(visible, ds, 0.0)
        dq = visible_sum(ds, ke, visible[:, 0]) * softmax_scale
        dk = visible_sum(ds, q, visible[:, 0], over_keys=True) * softmax_scale

    def fold(x):  # sum the query heads of each group into their kv head
        b, s, h, d = x.shape
        return x.reshape(b, s, h // group, group, d).sum(3)

    return dq, fold(dk), fold(dv)

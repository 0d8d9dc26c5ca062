"""Segment ids for the tests: the ids of each kind of packing and the check of
one case against the float64 reference (the CPU tests in test_flash_attention.py,
the CUDA kernels' paths in test_cuda_specific.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jflash
import reference64
from checks import (assert_within_rule, float64_inputs, plain_dtype, qkv_inputs,
                    window_diags)
from jflash.reference import attention_band as reference_band


def _documents(rng, length, n=None, longest=40):
    """Lengths of documents packed into `length` positions: n of them (random
    cuts), or a first one of length 1 and then random lengths up to longest."""
    if n is not None:
        cuts = np.sort(rng.choice(np.arange(1, length), n - 1, replace=False))
        return list(np.diff([0, *cuts, length]))
    lengths = [1]
    while sum(lengths) < length:
        lengths.append(int(rng.integers(1, longest + 1)))
    lengths[-1] -= sum(lengths) - length
    return lengths


def packed_ids(lengths, ids):
    return np.repeat(np.asarray(ids, np.int32), lengths)


def segment_ids(rng, kind, batch, seq_q, seq_k):
    """(q ids [batch, seq_q], kv ids [batch, seq_k]) int32 of one kind of packing:
      packed    documents one after the other (the first of length 1, the others
                up to 40 long), ids 0, 1, 2, ...; with seq_q != seq_k each side
                has its own lengths
      long      the same with documents up to 700 long (tiles inside them are full)
      shuffled  the same with the ids in random order, then 5 positions of
                padding (id -1 on the query side, -2 on the key side: unseen)
      random    an id from {3, 7, 9} per position: not contiguous
      disjoint  random ids from {0..4} on the query side and {2..6} on the key
                side: some rows see no key, some keys no row
    """
    q_ids, kv_ids = [], []
    for _ in range(batch):
        if kind in ("packed", "long", "shuffled"):
            pad = 5 if kind == "shuffled" else 0
            docs_q = _documents(rng, seq_q - pad, longest=700 if kind == "long" else 40)
            docs_k = docs_q if seq_q == seq_k else _documents(rng, seq_k - pad, len(docs_q))
            ids = rng.permutation(len(docs_q)) if kind == "shuffled" else np.arange(len(docs_q))
            q = np.concatenate([packed_ids(docs_q, ids), np.full(pad, -1)])
            k = np.concatenate([packed_ids(docs_k, ids), np.full(pad, -2)])
        elif kind == "random":
            q, k = rng.choice([3, 7, 9], seq_q), rng.choice([3, 7, 9], seq_k)
        else:
            q, k = rng.integers(0, 5, seq_q), rng.integers(2, 7, seq_k)
        q_ids.append(q)
        kv_ids.append(k)
    return jnp.asarray(np.stack(q_ids), jnp.int32), jnp.asarray(np.stack(kv_ids), jnp.int32)


def case_id(case):
    b, sq, sk, h, hkv, d, causal, window, kind = case
    return f"{kind}_b{b}_{sq}x{sk}_h{h}_{hkv}_d{d}" + "_causal" * causal + (
        f"_w{window[0]}_{window[1]}" if window else "")


def check_against_reference(rng, case, dtype, fn=None, softcap=None, q_scale=1.0):
    """out, lse and the gradients of one case (batch, seq_q, seq_k, heads, heads_kv,
    head_dim, causal, window_size, kind of ids) within the 2x rule, and
    rows that see no key (keys that no row sees) exact: out 0, lse -inf, dq 0 (dk,
    dv 0). fn(q, k, v, q_ids, kv_ids, causal, window) -> (out, lse): the call
    under test, flash_attention (with softcap) by default. q_scale scales the
    queries (peaked scores, where a small softcap matters)."""
    b, sq, sk, h, hkv, d, causal, window, kind = case
    q, k, v = qkv_inputs(rng, (b, sq, sk, h, hkv, d), dtype)
    q = (q.astype(jnp.float32) * q_scale).astype(dtype)
    q_ids, kv_ids = segment_ids(rng, kind, b, sq, sk)
    dout = jnp.asarray(rng.standard_normal(q.shape), dtype)
    dlse = jnp.asarray(rng.standard_normal((b, h, sq)), jnp.float32)
    scale = 1 / np.sqrt(d)
    lo, hi = window_diags(sq, sk, causal, window or (None, None))
    if fn is None:
        def fn(q, k, v, q_ids, kv_ids, causal, window):
            return jflash.flash_attention(q, k, v, causal=causal, window_size=window,
                                          return_lse=True, q_segment_ids=q_ids,
                                          kv_segment_ids=kv_ids, softcap=softcap)

    (out, lse), vjp = jax.vjp(
        jax.jit(lambda q, k, v: fn(q, k, v, q_ids, kv_ids, causal, window)), q, k, v)
    grads = vjp((dout, dlse))
    ids = (np.asarray(q_ids), np.asarray(kv_ids))
    truth_out, truth_lse, _ = reference64.forward(*float64_inputs(q, k, v), scale, lo, hi, ids,
                                                  softcap)
    truth_grads = reference64.backward(*float64_inputs(q, k, v, dout), np.asarray(dlse), scale,
                                       lo, hi, ids, softcap)
    plain_kw = dict(softmax_scale=scale, diag_lo=lo, diag_hi=hi, dtype=plain_dtype(dtype),
                    q_segment_ids=q_ids, kv_segment_ids=kv_ids, softcap=softcap)
    plain = jax.jit(lambda q, k, v, dout, dlse: jax.vjp(
        lambda q, k, v: reference_band(q, k, v, **plain_kw), q, k, v)[1]((dout, dlse)))
    plain_out = jax.jit(lambda q, k, v: reference_band(q, k, v, **plain_kw))(q, k, v)
    plain_grads = plain(q, k, v, dout, dlse)
    for name, got, ref, exact in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads),
                                     (*plain_out, *plain_grads), (truth_out, truth_lse, *truth_grads)):
        assert got.dtype == ref.dtype and got.shape == ref.shape, name
        assert_within_rule(name, got, ref, exact, dtype)

    visible = reference64.visible_mask(sq, sk, lo, hi, *ids)  # [b, sq, sk]
    no_key, unseen = ~visible.any(2), ~visible.any(1)  # [b, sq], [b, sk]
    f32 = [np.asarray(jnp.asarray(x, jnp.float32)) for x in (out, lse, *grads)]
    assert np.all(f32[0][no_key] == 0) and np.all(f32[2][no_key] == 0)
    assert np.all(np.isneginf(f32[1].transpose(0, 2, 1)[no_key]))
    assert np.all(np.isfinite(f32[1].transpose(0, 2, 1)[~no_key]))
    assert np.all(f32[3][unseen] == 0) and np.all(f32[4][unseen] == 0)
    return no_key.any(), unseen.any()

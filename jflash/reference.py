"""Plain-jnp attention with jflash's exact semantics, in float32:
attention (flash_attention's), attention_varlen (flash_attention_varlen's) and
attention_with_kvcache (flash_attention_with_kvcache's).

The documentation of what the kernels compute, and the reference every test
compares against. It materializes the seq_q x seq_k score matrix: use it for
checking, not for speed.

NaN and Inf (README, "NaN and Inf"): a masked (query, key) pair takes no part
in the attention. Its score enters no row max or sum, its probability and its
score gradient are exactly 0, and the sums over pairs (P V, and in the
gradients P^T dO, dS K, dS^T Q) skip it, rather than multiply a non-finite
input by its 0. Everything else is float32 IEEE arithmetic: a NaN reaches
exactly what depends on it through visible pairs. A row that sees no key (a
fact of the mask, not of the values) gives out 0, lse -inf and zero
gradients; a row that sees keys but whose softmax is undefined (a NaN or +inf
score, or every score -inf) gives out and lse NaN, so lse -inf always means
"no key". tests/reference64.py computes the same in float64.

softcap c: the scores are c * tanh(s / c) for s = softmax_scale * q.k (an
infinite s is capped to +-c), before the mask; lse is of the capped scores.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jflash._src import decode, masks, validation, varlen
from jflash._src.flash_attention import resolve_arguments

# HIGHEST: on GPU a float32 einsum otherwise runs in TF32, and the reference
# would be no more exact than the kernels it judges.
_einsum = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)


def _nonfinite_terms(w, x, visible, spec):
    """The terms of the visible pairs whose x is NaN or +-inf, summed by IEEE
    rules: NaN if any is NaN (x NaN, or inf times a 0 weight) or both signs of
    inf occur, else the inf, else 0. Counts of such terms come from products of
    0/1 matrices (float32, exact), so nothing here materializes pairs x head_dim."""
    f32 = jnp.float32
    w = w.astype(f32)
    vis = visible.astype(f32)
    pos, neg, zero = (vis * c.astype(f32) for c in (w > 0, w < 0, w == 0))
    nan_x, pinf, ninf = (c.astype(f32) for c in (jnp.isnan(x), x == jnp.inf, x == -jnp.inf))

    def count(a, b):
        return _einsum(spec, a, b) > 0

    is_nan = count(jnp.broadcast_to(vis, w.shape), nan_x) | count(zero, pinf + ninf)
    pos_inf = count(pos, pinf) | count(neg, ninf)
    neg_inf = count(pos, ninf) | count(neg, pinf)
    return jnp.where(is_nan | (pos_inf & neg_inf), jnp.nan,
                     jnp.where(pos_inf, jnp.inf, jnp.where(neg_inf, -jnp.inf, 0.0)))


# visible, below: the mask as a bool array [batch or 1, 1, seq_q, seq_k]
# (broadcast over heads), True where query i sees key j.
@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _visible_sum(w, x, visible, over_keys):
    """The sum over the visible pairs of w times x, masked pairs skipped.

    over_keys False: y[b, i, h] = sum_j w[b, h, i, j] x[b, j, h]   (P V, dS K)
    over_keys True:  y[b, j, h] = sum_i w[b, h, i, j] x[b, i, h]   (P^T dO, dS^T Q)

    With finite x this is one einsum; a NaN or inf in x reaches only the rows
    (keys) that see its key (row), as in the kernels, instead of every row
    through 0 * NaN. Its gradient skips masked pairs alike.
    """
    spec = "bhij,bihd->bjhd" if over_keys else "bhij,bjhd->bihd"
    w = jnp.where(visible, w, 0)
    finite = jnp.isfinite(x)
    y = _einsum(spec, w, jnp.where(finite, x, 0))
    pairs = jnp.swapaxes(visible, -1, -2) if over_keys else visible
    w_pairs = jnp.swapaxes(w, -1, -2) if over_keys else w
    extra = jax.lax.cond(
        jnp.all(finite),
        lambda: jnp.zeros(y.shape, jnp.float32),
        lambda: _nonfinite_terms(w_pairs, x, pairs, "bhij,bjhd->bihd"),
    )
    return y + extra.astype(y.dtype)


def _visible_sum_fwd(w, x, visible, over_keys):
    return _visible_sum(w, x, visible, over_keys), (w, x, visible)


def _visible_sum_bwd(over_keys, residuals, g):
    w, x, visible = residuals
    # dw[i, j] = g . x over head_dim for visible pairs (over_keys: g at key j,
    # x at row i); dx is a visible sum of w and g the other way round.
    dw_spec = "bjhd,bihd->bhij" if over_keys else "bihd,bjhd->bhij"
    dw = jnp.where(visible, _einsum(dw_spec, g, x), 0).astype(w.dtype)
    dx = _visible_sum(w, g, visible, not over_keys).astype(x.dtype)
    return dw, dx, None


_visible_sum.defvjp(_visible_sum_fwd, _visible_sum_bwd)


@jax.custom_vjp
def _scores(q, k, visible):
    """S = Q K^T [b, h, i, j]; its gradient skips masked pairs (dQ = dS K and
    dK = dS^T Q as visible sums), so a NaN in k (q) does not reach the rows
    (keys) that do not see it."""
    del visible
    return _einsum("bqhd,bkhd->bhqk", q, k)


def _scores_fwd(q, k, visible):
    return _scores(q, k, visible), (q, k, visible)


def _scores_bwd(residuals, ds):
    q, k, visible = residuals
    ds = ds.astype(q.dtype)
    return (_visible_sum(ds, k, visible, False).astype(q.dtype),
            _visible_sum(ds, q, visible, True).astype(k.dtype), None)


_scores.defvjp(_scores_fwd, _scores_bwd)


def attention_band(query, key, value, *, softmax_scale, diag_lo, diag_hi, dtype=jnp.float32,
                   q_segment_ids=None, kv_segment_ids=None, softcap=None):
    """(out, lse) with key j visible from query i iff diag_lo <= j - i <= diag_hi
    and, with segment ids ([batch, seq_q], [batch, seq_k]), q_segment_ids[b, i] ==
    kv_segment_ids[b, j]; softcap: None, or the cap c > 0 of the scores.

    dtype is the compute dtype: float32 gives the reference; the input's own
    dtype gives the "same-dtype plain computation" of FlashAttention's test rule.
    Rows that see no key give out 0, lse -inf and zero gradients (never NaN);
    NaN and Inf as in the module docstring.
    """
    seqlen_q, seqlen_k = query.shape[1], key.shape[1]
    diag_lo, diag_hi = masks.clamp_band(seqlen_q, seqlen_k, diag_lo, diag_hi)
    visible = masks.visible(seqlen_q, seqlen_k, diag_lo, diag_hi, q_segment_ids, kv_segment_ids)
    return masked_attention(query, key, value, visible, softmax_scale=softmax_scale,
                            softcap=softcap, dtype=dtype)


def masked_attention(query, key, value, visible, *, softmax_scale, softcap=None,
                     dtype=jnp.float32):
    """(out, lse) with key j visible from query i where visible [seq_q, seq_k] (or
    [batch, seq_q, seq_k]) is True; softcap: None, or c with scores c * tanh(s / c)
    for s = softmax_scale * q.k. dtype and the rest as in attention_band."""
    seqlen_q, seqlen_k = query.shape[1], key.shape[1]
    group = query.shape[2] // key.shape[2]
    q = query.astype(dtype)
    k = jnp.repeat(key.astype(dtype), group, axis=2)  # kv head h // group serves query head h
    v = jnp.repeat(value.astype(dtype), group, axis=2)
    visible = jnp.reshape(visible, (-1, 1, seqlen_q, seqlen_k))  # [batch or 1, 1, sq, sk]
    no_key = ~jnp.any(visible, axis=-1, keepdims=True)  # rows that see no key
    scores = _scores(q, k, visible) * jnp.asarray(softmax_scale, dtype)
    if softcap is not None:
        cap = jnp.asarray(softcap, dtype)
        scores = cap * jnp.tanh(scores / cap)
    scores = jnp.where(visible, scores, -jnp.inf)
    # The row max only stabilizes exp; it cancels, so no gradient flows through
    # it. NaN (a NaN score) and +inf stay: they make the row NaN, as they must.
    row_max = jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
    row_max = jnp.where(row_max == -jnp.inf, 0, row_max)  # no visible score above -inf
    p = jnp.where(visible, jnp.exp(scores - row_max), 0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    # 0 / 0 = NaN where a row sees keys whose scores are all -inf.
    safe_denom = jnp.where(no_key, 1, denom)
    out = _visible_sum(p / safe_denom, v, visible, False)
    log_denom = jnp.log(jnp.where(denom == 0, 1, safe_denom)) + row_max
    lse = jnp.where(no_key, -jnp.inf, jnp.where(denom == 0, jnp.nan, log_denom))[..., 0]
    return out.astype(query.dtype), lse.astype(jnp.float32)


def attention(query, key, value, *, causal=False, softmax_scale=None, return_lse=False,
              window_size=None, q_segment_ids=None, kv_segment_ids=None, softcap=None):
    """Same signature and semantics as jflash.flash_attention, in plain jnp."""
    softmax_scale, diag_lo, diag_hi, return_lse, segment_ids, softcap = resolve_arguments(
        query, key, value, causal, softmax_scale, return_lse, window_size, q_segment_ids,
        kv_segment_ids, softcap,
    )
    q_ids, kv_ids = segment_ids or (None, None)
    out, lse = attention_band(
        query, key, value, softmax_scale=softmax_scale, diag_lo=diag_lo, diag_hi=diag_hi,
        q_segment_ids=q_ids, kv_segment_ids=kv_ids, softcap=softcap,
    )
    return (out, lse) if return_lse else out


def kvcache_attention(query, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, *,
                      config, capacity, dtype=jnp.float32):
    """(out, lse, k_cache, v_cache) of flash_attention_with_kvcache for validated
    arguments (config: jflash._src.decode.DecodeConfig; the caches None without
    k_new); dtype as in attention_band. The keys of sequence b are its first
    cache_len cache positions (cache_len: cache_seqlens[b] clamped to [0,
    capacity - seq_new]), then k_new's: materialized [batch, capacity, ...]."""
    batch, seqlen_q = query.shape[:2]
    seqlen_new = 0 if k_new is None else k_new.shape[1]
    cache_len = jnp.clip(cache_seqlens, 0, capacity - seqlen_new)
    total = cache_len + seqlen_new
    positions = jnp.arange(capacity, dtype=jnp.int32)
    if block_table is None:
        keys, values = k_cache, v_cache
    else:
        block_size, num_blocks = k_cache.shape[1], k_cache.shape[0]
        blocks = jnp.clip(block_table[:, positions // block_size], 0, num_blocks - 1)
        keys, values = (x[blocks, positions % block_size] for x in (k_cache, v_cache))
    if k_new is not None:
        new_index = jnp.clip(positions[None, :] - cache_len[:, None], 0, seqlen_new - 1)
        is_new = (positions[None, :] >= cache_len[:, None])[..., None, None]
        keys = jnp.where(is_new, jnp.take_along_axis(k_new, new_index[..., None, None], 1), keys)
        values = jnp.where(is_new, jnp.take_along_axis(v_new, new_index[..., None, None], 1),
                           values)
        k_cache, v_cache = decode.append_rows(k_cache, v_cache, k_new, v_new, cache_seqlens,
                                              block_table, capacity)
    # The band aligned bottom-right to each sequence's length (decode_window).
    offset = (total - seqlen_q)[:, None, None]
    j_minus_i = positions[None, None, :] - jnp.arange(seqlen_q)[None, :, None]
    visible = positions[None, None, :] < total[:, None, None]
    if config.window_left >= 0:
        visible &= j_minus_i >= offset - config.window_left
    if config.window_right >= 0:
        visible &= j_minus_i <= offset + config.window_right
    out, lse = masked_attention(query, keys, values, visible, softmax_scale=config.softmax_scale,
                                softcap=config.softcap or None, dtype=dtype)
    return out, lse, (k_cache if k_new is not None else None), (
        v_cache if k_new is not None else None)


def attention_with_kvcache(query, k_cache, v_cache, *, cache_seqlens, k_new=None, v_new=None,
                           block_table=None, causal=True, window_size=None, softcap=None,
                           softmax_scale=None, return_lse=False, num_splits=None):
    """Same signature and semantics as jflash.flash_attention_with_kvcache, in plain
    jnp (num_splits is checked and otherwise ignored: the softmax here is whole)."""
    args = decode.resolve_kvcache_arguments(query, k_cache, v_cache, cache_seqlens, k_new, v_new,
                                            block_table, causal, window_size, softcap,
                                            softmax_scale, return_lse, num_splits)
    out, lse, k_out, v_out = kvcache_attention(query, k_cache, v_cache, args.cache_seqlens, k_new,
                                               v_new, args.block_table, config=args.config,
                                               capacity=args.capacity)
    results = (out, lse) if args.return_lse else (out,)
    if k_new is not None:
        results += (k_out, v_out)
    return results[0] if len(results) == 1 else results


def _varlen_positions(cu, total):
    """(sequence index, position within it, whether in a sequence) of each of
    the packed row's tokens: the first b with cu[b] <= p < cu[b + 1]."""
    p = jnp.arange(total)
    inside = (cu[:-1, None] <= p[None, :]) & (p[None, :] < cu[1:, None])  # [num_seqs, total]
    b = jnp.argmax(inside, axis=0)
    return b, p - cu[b], jnp.any(inside, axis=0)


def attention_varlen(query, key, value, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q,
                     max_seqlen_k, causal=False, softmax_scale=None, return_lse=False,
                     window_size=None, softcap=None):
    """Same signature and semantics as jflash.flash_attention_varlen, in plain jnp:
    one [total_q, total_k] mask of each sequence's bottom-right band."""
    total_q, total_k, _, cu_q, cu_k = varlen._check_varlen(
        query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    # The 4-D checks of flash_attention (dtypes, heads, head dim) on a batch of 1.
    softmax_scale, _, _, return_lse, _, softcap = resolve_arguments(
        query[None], key[None], value[None], causal, softmax_scale, return_lse, window_size,
        None, None, softcap)
    window = validation.check_window_size(window_size)
    bq, i, q_in = _varlen_positions(cu_q, total_q)
    bk, j, k_in = _varlen_positions(cu_k, total_k)
    offset = (cu_k[1:] - cu_k[:-1]) - (cu_q[1:] - cu_q[:-1])  # sk - sq of each sequence
    j_minus_i = j[None, :] - i[:, None]
    off = offset[bq][:, None]
    visible = q_in[:, None] & k_in[None, :] & (bq[:, None] == bk[None, :])
    if causal:
        visible &= j_minus_i <= off
    if window is not None and window[0] >= 0:
        visible &= j_minus_i >= off - window[0]
    if window is not None and window[1] >= 0:
        visible &= j_minus_i <= off + window[1]
    out, lse = masked_attention(query[None], key[None], value[None], visible[None],
                                softmax_scale=softmax_scale, softcap=softcap)
    return (out[0], lse[0]) if return_lse else out[0]

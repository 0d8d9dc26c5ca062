"""jflash.flash_attention_varlen: a batch of sequences of different lengths,
packed along the token axis (FlashAttention's varlen layout), on the segment-id
kernels.

Sequence b is query[cu_seqlens_q[b]:cu_seqlens_q[b + 1]] against
key/value[cu_seqlens_k[b]:cu_seqlens_k[b + 1]]. The call becomes one
flash_attention row of batch 1 whose segment ids are the sequence index, so the
kernels skip every tile between sequences (the packed-documents machinery):
no padding to the longest sequence, and the same kernels, CPU twin included.

Masks align bottom-right within each sequence (query i of a sequence with sq
queries and sk keys sees key j iff j <= i + sk - sq under causal), while
flash_attention's band is one band on the row's absolute positions. The two
agree when each sequence's queries and keys start at the same row position and
sq == sk, which the packed layout gives when both sides share one cu_seqlens
array. Otherwise, under causal or a window, each sequence gets a slot of
max(sq, sk) positions in a row of total_q + total_k positions, its queries and
keys placed at the slot's end; a slot's unused positions carry ids that match
nothing, so their tiles are skipped too. Without causal or a window the
positions do not matter and the packed rows are used as they are.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jflash._src import validation
from jflash._src.flash_attention import flash_attention


def _check_varlen(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                  max_seqlen_k):
    """Validates the varlen layout; returns (total_q, total_k, num_seqs) and the
    int32 cu_seqlens."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        shape = getattr(x, "shape", None)
        if shape is None:
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
        if len(shape) != 3:
            raise ValueError(f"{name} must have rank 3 [total_tokens, num_heads, head_dim] "
                             f"(the varlen layout), got shape {tuple(shape)}")
    cu = []
    for name, x in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        shape = getattr(x, "shape", None)
        if shape is None:
            raise TypeError(f"{name} must be an int32 array, got {type(x).__name__}")
        if len(shape) != 1 or shape[0] < 2:
            raise ValueError(f"{name} must have shape [num_seqs + 1] with num_seqs >= 1 "
                             f"(cumulative sequence starts), got shape {tuple(shape)}")
        cu.append(validation._int32_array(name, x, tuple(shape), "[num_seqs + 1]"))
    if cu[0].shape != cu[1].shape:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must have the same length "
                         f"(num_seqs + 1), got {cu[0].shape[0]} and {cu[1].shape[0]}")
    for name, value_ in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value_, (bool, np.bool_)) or not isinstance(value_, (int, np.integer)):
            raise TypeError(f"{name} must be a static int, got {type(value_).__name__}")
        if value_ < 1:
            raise ValueError(f"{name} must be >= 1, got {int(value_)}")
    return query.shape[0], key.shape[0], cu[0].shape[0] - 1, cu[0], cu[1]


def _sequence_of(cu, positions, num_seqs):
    """(sequence index, valid) of each position: the b with cu[b] <= position <
    cu[b + 1]. Any cu values give in-bounds indices (not increasing ones give
    some b, never an index outside [0, num_seqs))."""
    b = jnp.searchsorted(cu, positions, side="right").astype(jnp.int32) - 1
    valid = (b >= 0) & (b < num_seqs) & (positions < cu[jnp.clip(b + 1, 0, num_seqs)])
    return jnp.clip(b, 0, num_seqs - 1), valid


def _packed_ids(cu, total, num_seqs, outside):
    """Segment ids of a packed row of `total` tokens: the sequence index, or
    `outside` (an id the other side never has) for tokens past the sequences
    (cu[-1] < total) or before them (cu[0] > 0)."""
    b, valid = _sequence_of(cu, jnp.arange(total, dtype=jnp.int32), num_seqs)
    return jnp.where(valid, b, outside)


def _slot_layout(cu_q, cu_k, total_q, total_k, num_seqs):
    """The slotted row: sequence b occupies positions [start_b, start_b + L_b),
    L_b = max(sq_b, sk_b), with its queries and keys at the slot's end, so that
    a key's position minus a query's is j - i - (sk_b - sq_b): the bottom-right
    band of each sequence is one band (that of a square row) on the slotted row.

    Returns (q_src, k_src, q_ids, k_ids, q_pos) over the row's total_q + total_k
    positions: the packed token each position holds (total_q / total_k, out of
    range, where it holds none), the segment ids (2b for tokens of sequence b;
    odd or past-the-end ids, which the other side never has, for empty
    positions), and the slotted position of each packed query.
    """
    length = total_q + total_k
    sq = jnp.clip(cu_q[1:] - cu_q[:-1], 0, total_q)
    sk = jnp.clip(cu_k[1:] - cu_k[:-1], 0, total_k)
    slot = jnp.maximum(sq, sk)
    ends = jnp.cumsum(slot)  # int32; the slots fit in `length` for valid cu_seqlens
    starts = ends - slot
    pos = jnp.arange(length, dtype=jnp.int32)
    b = jnp.clip(jnp.searchsorted(ends, pos, side="right").astype(jnp.int32), 0, num_seqs - 1)
    in_slot = pos < ends[b]
    local_q = pos - (ends[b] - sq[b])  # query index within sequence b, if >= 0
    local_k = pos - (ends[b] - sk[b])
    q_here = in_slot & (local_q >= 0)
    k_here = in_slot & (local_k >= 0)
    q_src = jnp.where(q_here, cu_q[b] + local_q, total_q)
    k_src = jnp.where(k_here, cu_k[b] + local_k, total_k)
    q_src = jnp.where((q_src >= 0) & (q_src < total_q), q_src, total_q)
    k_src = jnp.where((k_src >= 0) & (k_src < total_k), k_src, total_k)
    # Empty positions: odd ids inside a slot (a slot's empty positions are all on
    # one side, so they meet no token of their sequence), past-the-end ids after
    # the last slot; query and key ids never equal there.
    q_ids = jnp.where(q_here, 2 * b, jnp.where(in_slot, 2 * b + 1, 2 * num_seqs))
    k_ids = jnp.where(k_here, 2 * b, jnp.where(in_slot, 2 * b + 1, 2 * num_seqs + 1))
    # Each packed query's slotted position (its slot's end minus sq + i).
    qb, q_valid = _sequence_of(cu_q, jnp.arange(total_q, dtype=jnp.int32), num_seqs)
    q_pos = ends[qb] - sq[qb] + (jnp.arange(total_q, dtype=jnp.int32) - cu_q[qb])
    q_pos = jnp.where(q_valid & (q_pos >= 0) & (q_pos < length), q_pos, length)
    return q_src, k_src, q_ids, k_ids, q_pos


def _same_array(a, b):
    """Whether the two cu_seqlens are one array: the same object (a traced
    argument passed twice), or equal concrete values."""
    if a is b:
        return True
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a.shape == b.shape and bool(np.array_equal(a, b))
    return False


def flash_attention_varlen(query, key, value, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q,
                           max_seqlen_k, causal=False, softmax_scale=None, return_lse=False,
                           window_size=None, softcap=None, deterministic=False, precision=None):
    """Attention over a batch of sequences of different lengths, packed.

    Args:
      query: [total_q, num_heads, head_dim], the sequences' queries one after
        the other; key, value: [total_k, num_heads_kv, head_dim] likewise
        (num_heads a multiple of num_heads_kv).
      cu_seqlens_q, cu_seqlens_k: int32 [num_seqs + 1], cumulative starts
        (FlashAttention's layout): sequence b is query[cu_seqlens_q[b] :
        cu_seqlens_q[b + 1]] against key/value[cu_seqlens_k[b] :
        cu_seqlens_k[b + 1]]. Tokens outside every sequence output 0 (lse
        -inf) and take no part. Values that are not increasing or run past
        the arrays never read or write out of bounds; the results are then
        those of the sequences the values describe where they fit.
      max_seqlen_q, max_seqlen_k: static ints >= 1, FlashAttention's
        arguments; the kernels find each tile's keys from the sequence ids and
        do not need them.
      causal, window_size, softcap, softmax_scale, deterministic, precision: as
        in flash_attention, applied within each sequence and aligned bottom-right
        in it (query i of a sequence with sq queries and sk keys sees key j iff
        j <= i + sk - sq under causal).
      return_lse: also return lse [num_heads, total_q] (float32).

    Under causal or a window with two different cu_seqlens arrays, the kernels
    run a row of total_q + total_k positions (module docstring); pass the same
    array as both when queries and keys have the same lengths (self-attention)
    and the row is the packed tokens themselves.

    Returns:
      out [total_q, num_heads, head_dim] in query's dtype, or (out, lse).
    """
    total_q, total_k, num_seqs, cu_q, cu_k = _check_varlen(
        query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    causal = validation.check_bool("causal", causal)
    return_lse = validation.check_bool("return_lse", return_lse)
    window = validation.check_window_size(window_size)
    banded = causal or (window is not None and max(window) >= 0)
    kw = dict(causal=causal, softmax_scale=softmax_scale, window_size=window, softcap=softcap,
              deterministic=deterministic, precision=precision, return_lse=True)
    same = _same_array(cu_seqlens_q, cu_seqlens_k)
    if not banded or same:
        if banded and total_q != total_k:
            raise ValueError("one cu_seqlens array for both sides needs total_q == total_k, "
                             f"got query {tuple(query.shape)} and key {tuple(key.shape)}")
        q_ids = _packed_ids(cu_q, total_q, num_seqs, -1)
        k_ids = _packed_ids(cu_k, total_k, num_seqs, -2)
        out, lse = flash_attention(query[None], key[None], value[None],
                                   q_segment_ids=q_ids[None], kv_segment_ids=k_ids[None], **kw)
        out, lse = out[0], lse[0]
    else:
        q_src, k_src, q_ids, k_ids, q_pos = _slot_layout(cu_q, cu_k, total_q, total_k, num_seqs)

        def gather(x, src):  # empty positions (src out of range) get zeros
            return jnp.take(x, src, axis=0, mode="fill", fill_value=0)

        out, lse = flash_attention(
            gather(query, q_src)[None], gather(key, k_src)[None], gather(value, k_src)[None],
            q_segment_ids=q_ids[None], kv_segment_ids=k_ids[None], **kw)
        out = jnp.take(out[0], q_pos, axis=0, mode="fill", fill_value=0)
        lse = jnp.take(lse[0], q_pos, axis=1, mode="fill", fill_value=-jnp.inf)
    return (out, lse) if return_lse else out

"""The attention mask in Python: every front end's mask reduced to the kernels' band.

The kernels take one band (csrc/include/jflash/mask.h): key j is visible from
query i iff diag_lo <= j - i <= diag_hi. This module is the one place that
builds it from each front end's arguments and answers the questions asked of
it outside the kernels:

  causal_band, window_band  flash_attention's causal mask and window, aligned
                            bottom-right (FlashAttention's convention)
  top_left_band             jax.nn.dot_product_attention's is_causal and
                            local_window_size, aligned top-left
  clamp_band                the range [-seq_q, seq_k] the kernels expect
  visible                   the [seq_q, seq_k] mask itself (the reference), or
                            [batch, seq_q, seq_k] with segment ids
  rows_without_keys         the query rows that see no key at all
  segment_operands          the segment ids' summaries that the kernels classify
                            tiles by (SegmentMask): per block of rows and keys,
                            and each query row's keys

Segment ids (packed documents) restrict the band further: query i sees key j
only where q_segment_ids[b, i] == kv_segment_ids[b, j].

MASK_KIND_* mirror the C++ MaskKind, the kernels' dispatch key.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# MaskKind of csrc/include/jflash/mask.h.
MASK_KIND_NONE = 0
MASK_KIND_BAND = 1
MASK_KIND_SEGMENTS = 2


def mask_kind(banded: bool, segments: bool = False) -> int:
    """The MaskKind of a call: the segment kernels (whatever the band), the band
    kernels, or the unmasked ones."""
    if segments:
        return MASK_KIND_SEGMENTS
    return MASK_KIND_BAND if banded else MASK_KIND_NONE


def clamp_band(seqlen_q: int, seqlen_k: int, diag_lo: int, diag_hi: int):
    """Clamps a band into [-seqlen_q, seqlen_k], the range the kernels expect."""
    lo = max(-seqlen_q, min(seqlen_k, int(diag_lo)))
    hi = max(-seqlen_q, min(seqlen_k, int(diag_hi)))
    return lo, hi


def causal_band(seqlen_q: int, seqlen_k: int, causal: bool, *, bottom_right: bool = True):
    """(diag_lo, diag_hi) for no mask or a causal one.

    Bottom-right causal: query i sees key j iff j <= i + seqlen_k - seqlen_q.
    Top-left causal (jax.nn.dot_product_attention): iff j <= i.
    """
    diag_lo = -seqlen_q
    if not causal:
        return diag_lo, seqlen_k
    return diag_lo, (seqlen_k - seqlen_q) if bottom_right else 0


def window_band(seqlen_q: int, seqlen_k: int, causal: bool, window_size):
    """(diag_lo, diag_hi) for causal and a (left, right) window, both bottom-right.

    Query i sees key j iff i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k -
    seqlen_q + right (FlashAttention's convention); -1 leaves a side unbounded,
    and causal caps right at 0. window_size None is no window.
    """
    diag_lo, diag_hi = causal_band(seqlen_q, seqlen_k, causal)
    if window_size is None:
        return diag_lo, diag_hi
    left, right = window_size
    offset = seqlen_k - seqlen_q
    if left >= 0:
        diag_lo = max(diag_lo, offset - left)
    if right >= 0:
        diag_hi = min(diag_hi, offset + right)
    return diag_lo, diag_hi


def top_left_band(seqlen_q: int, seqlen_k: int, is_causal: bool, window):
    """(diag_lo, diag_hi) of jax.nn.dot_product_attention's masks, aligned top-left.

    is_causal: j <= i. window (left, right), already a pair of ints:
    i - left <= j <= i + right.
    """
    diag_lo, diag_hi = causal_band(seqlen_q, seqlen_k, is_causal, bottom_right=False)
    if window is not None:
        left, right = window
        diag_lo, diag_hi = max(diag_lo, -left), min(diag_hi, right)
    return diag_lo, diag_hi


def visible(seqlen_q: int, seqlen_k: int, diag_lo: int, diag_hi: int, q_segment_ids=None,
            kv_segment_ids=None):
    """[seqlen_q, seqlen_k] bool (jnp), True where query i sees key j; with segment
    ids ([batch, seqlen_q], [batch, seqlen_k]) [batch, seqlen_q, seqlen_k]."""
    offset = jnp.arange(seqlen_k)[None, :] - jnp.arange(seqlen_q)[:, None]  # j - i
    band = (offset >= diag_lo) & (offset <= diag_hi)
    if q_segment_ids is None:
        return band
    same = q_segment_ids[..., :, None] == kv_segment_ids[..., None, :]
    return band & same


def rows_without_keys(seqlen_q: int, seqlen_k: int, diag_lo: int, diag_hi: int):
    """[seqlen_q] bool (numpy, from the static shapes), True where the band holds
    no key of [0, seqlen_k): the rows the kernels write as out 0, lse -inf."""
    rows = np.arange(seqlen_q)
    first = np.maximum(rows + diag_lo, 0)
    last = np.minimum(rows + diag_hi, seqlen_k - 1)
    return first > last


def _id_hulls(ids, other_ids):
    """For each position of ids [..., S]: the hull [first, end) of the positions of
    other_ids [..., T] that hold its id (T, 0 where none does), and whether those
    positions are contiguous (then the hull is exactly them). A stable sort of
    other_ids and two binary searches per position: O((S + T) log T)."""
    *lead, s = ids.shape
    t = other_ids.shape[-1]

    def hulls(row, other):
        order = jnp.argsort(other, stable=True)  # positions ascending within an id
        sorted_ids = other[order]
        # Unrolled: XLA fuses the log2(T) steps into one kernel on GPU, where the
        # default method's loop launches a kernel or more per step.
        lo = jnp.searchsorted(sorted_ids, row, side="left", method="scan_unrolled")
        hi = jnp.searchsorted(sorted_ids, row, side="right", method="scan_unrolled")
        found = hi > lo
        first = jnp.where(found, order[jnp.minimum(lo, t - 1)], t)
        end = jnp.where(found, order[jnp.maximum(hi - 1, 0)] + 1, 0)
        return first, end, ~found | (end - first == hi - lo)

    flat = [x.reshape(-1, x.shape[-1]) for x in (ids, other_ids)]
    return [x.reshape(*lead, s) for x in jax.vmap(hulls)(*flat)]


def segment_blocks(ids, other_ids, block: int, hulls=None):
    """The kernels' block summaries of segment ids (csrc/include/jflash/mask.h,
    SegmentBlock).

    ids [..., S], other_ids [..., T] (int32, the other side's ids of the same batch
    entries) -> [..., ceil(S / block), 4] int32: per block of `block` positions of
    ids, the min and max id, and the hull [begin, end) of the positions of
    other_ids that hold one of the block's ids (begin >= end where none does).
    The hull of each id is exact where its positions are contiguous, whatever the
    order of the ids (documents packed one after the other, padding included).
    hulls: _id_hulls(ids, other_ids), where already computed.
    """
    *lead, s = ids.shape
    t = other_ids.shape[-1]
    first, end, _ = _id_hulls(ids, other_ids) if hulls is None else hulls
    num_blocks = -(-s // block)
    pad = num_blocks * block - s
    info = np.iinfo(np.int32)

    def per_block(x, fill):
        x = x.reshape(-1, s)
        return jnp.pad(x, ((0, 0), (0, pad)), constant_values=fill).reshape(-1, num_blocks, block)

    summary = jnp.stack(
        [
            per_block(ids, info.max).min(-1),
            per_block(ids, info.min).max(-1),
            per_block(first, t).min(-1),
            per_block(end, 0).max(-1),
        ],
        axis=-1,
    )
    return summary.astype(jnp.int32).reshape(*lead, num_blocks, 4)


def segment_ranges(hulls):
    """[..., S, 2] int32 from _id_hulls: per position (a query row, or a key), the
    positions [begin, end) of the other side that hold its id, begin stored as
    -1 - begin where those are not contiguous (the range is then only their
    hull); [0, 0) where none holds it."""
    first, end, exact = hulls
    first = jnp.where(end > first, first, 0)
    end = jnp.where(end > first, end, 0)
    return jnp.stack([jnp.where(exact, first, -1 - first), end], axis=-1).astype(jnp.int32)


def segment_operands(q_ids, kv_ids, block: int):
    """The kernels' segment buffers (csrc/ffi/bindings.h): q ids, kv ids, their
    block summaries, the query rows' key ranges and the keys' row ranges."""
    q_hulls, kv_hulls = _id_hulls(q_ids, kv_ids), _id_hulls(kv_ids, q_ids)
    return (q_ids, kv_ids, segment_blocks(q_ids, kv_ids, block, q_hulls),
            segment_blocks(kv_ids, q_ids, block, kv_hulls), segment_ranges(q_hulls),
            segment_ranges(kv_hulls))

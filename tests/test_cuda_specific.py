"""Checks that only mean something for the CUDA kernels; skipped without a GPU.

The general suite (test_flash_attention.py, ...) already runs on the GPU when
one is present. These add what is specific to the CUDA tiling: lengths around
the tile sizes of csrc/cuda/tile_sizes.h (block_m 64/80/128, block_n 64/128),
bands whose edges cut tiles, GQA groups summed inside the backward kernel,
fully masked rows next to visible ones in one tile, and the error a build
without an instantiation must give.

On a Hopper GPU the forward and the backward run the TMA/wgmma kernels
(csrc/cuda/sm90/) for the head dims they cover; the sm80 kernels are checked
there too, in subprocesses with JFLASH_CUDA_FORWARD=sm80 and
JFLASH_CUDA_BACKWARD=sm80 (the choice is read once per process). The
small-shared-memory tiles of sm86/sm89 run in a subprocess with
JFLASH_CUDA_SMEM_LIMIT=101376 (99 KB).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jflash
from checks import assert_within_rule
from dq_modes import check_dq_modes
from segments import case_id as segment_case_id
from segments import check_against_reference as check_segments
from jflash._src.flash_attention import attention_band
from jflash._src.ffi import cuda_backward_family, cuda_forward_family, cuda_kernel_smem_bytes
from segments import segment_ids
from jflash.reference import attention_band as reference_band

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "gpu" or not jflash.HAS_CUDA_KERNELS,
    reason="needs a CUDA GPU and a jflash build with CUDA kernels",
)

DTYPES = [jnp.bfloat16, jnp.float16]


def _is_hopper():
    return getattr(jax.devices()[0], "compute_capability", "") == "9.0"

# (batch, seq_q, seq_k, num_heads, num_heads_kv, head_dim, diag_lo, diag_hi);
# None bounds mean "no mask" (the unmasked instantiation).
CASES = [
    (1, 1, 1, 2, 2, 128, None, None),
    (2, 17, 17, 2, 1, 128, None, None),  # MQA, less than one tile
    (1, 129, 1000, 4, 2, 128, None, None),  # GQA, one row past a tile, seq_q < seq_k
    (1, 1000, 129, 4, 4, 128, None, None),  # seq_q > seq_k
    (1, 1000, 129, 4, 2, 128, -1000, 129 - 1000),  # bottom-right causal: 871 rows see nothing
    (1, 129, 1000, 2, 2, 128, -129, 1000 - 129),  # bottom-right causal, seq_q < seq_k
    (2, 300, 300, 2, 1, 128, -70, -5),  # sliding window; rows 0..4 see no key
    (1, 257, 255, 6, 2, 128, -3, 40),  # narrow band crossing every tile diagonally
    (1, 130, 190, 2, 2, 64, -10, 10),
    (1, 130, 190, 2, 2, 96, -200, 0),  # swizzle-32 head dim, top-left causal
    (1, 130, 190, 4, 2, 256, None, None),  # 8-warp forward, 64-key backward tiles
    (1, 77, 130, 4, 1, 256, -30, 30),
    (1, 65, 63, 2, 2, 32, None, None),
    (1, 100, 70, 2, 1, 160, -50, 5),
    (1, 70, 100, 2, 2, 192, None, None),
    (2, 90, 90, 2, 2, 224, -90, 0),  # single-buffered Q/dO backward
    # Hopper forward tiles (block_m 128; block_n 128, or 64 at head dim 256;
    # a 2-deep K/V ring): many ring turns, one key past a tile, a query block
    # whose second consumer warpgroup holds only masked or absent rows.
    (1, 200, 2049, 2, 1, 128, None, None),
    (1, 383, 513, 4, 2, 128, -200, 100),  # sliding window cutting tiles on both sides
    (2, 511, 1537, 4, 1, 64, -511, 1537 - 511),  # bottom-right causal, MQA
    (1, 250, 700, 2, 2, 256, -300, 100),
    (1, 70, 130, 2, 2, 128, -70, -60),  # rows 0..59 see nothing; rows 64.. of the tile absent
    # More work units than a GPU has SMs, so that each persistent CTA runs
    # several (Q and the K/V ring reused across units, the next unit's tiles
    # prefetched into L2), with units whose rows see no key between them.
    (4, 1030, 900, 16, 4, 128, None, None),
    (3, 1500, 700, 16, 8, 128, -1500, 700 - 1500),  # rows 0..799 see nothing
    (4, 1100, 1100, 16, 4, 64, -1100, 0),  # causal, three consumer warpgroups
    (4, 1000, 777, 16, 16, 64, None, None),  # a last block with one warpgroup's rows
    (4, 1200, 500, 16, 4, 64, -1200, 500 - 1200),  # rows 0..699 see nothing
    (3, 1000, 1000, 16, 8, 256, -1000, 0),
    # Head dim 64 under a band with both lengths <= 1024 runs 128-row tiles on
    # two ping-pong consumers (sm90_fwd_tile_short_band); longer ones above.
    (4, 1000, 1000, 16, 4, 64, -1000, 0),  # causal, many units
    (2, 700, 1024, 8, 8, 64, -300, 1024 - 700 + 20),  # window; a last block of 60 rows
    # Hopper backward tiles (128 keys per CTA, 64 or 80 query rows per step, a
    # 2-deep Q/dO ring): many steps per CTA over a GQA group of 4, the band's
    # first and last query blocks cut, a last key block of one key.
    (2, 1000, 1025, 8, 2, 128, -1000, 1025 - 1000),
    (1, 513, 385, 8, 2, 64, None, None),
    (1, 700, 700, 4, 1, 128, -150, 40),  # window: each key block visits a few query blocks
    # Unmasked head dim 128 steps 80 query rows (dQ computed transposed, one
    # dQ staging buffer): a last block of one row, GQA; three whole blocks of
    # 80 (not a multiple of 64), MQA, a last key block of one key.
    (1, 161, 300, 4, 2, 128, None, None),
    (2, 240, 257, 4, 1, 128, None, None),
    # Bands at head dim 128 step 80 rows too (the mask applied after dS^T):
    # top-left causal over 5 blocks of 80, the first block each key block
    # visits starting 0, 48, 16 and 64 rows above its diagonal (the last key
    # block of 16 keys); bottom-right causal, MQA, seq_q < seq_k, 3 blocks of
    # 80 and a last key block of 48 keys.
    (2, 400, 400, 4, 2, 128, -400, 0),
    (1, 240, 560, 4, 1, 128, -240, 560 - 240),
    # Head dim 256: 64 keys per CTA shared by both consumers (P^T and dS^T
    # through shared memory), one Q/dO buffer and one dQ staging buffer.
    (2, 1000, 1025, 8, 2, 256, -1000, 1025 - 1000),
    (1, 513, 385, 8, 1, 256, None, None),  # MQA; a last key block of one key
    (1, 700, 700, 4, 2, 256, -150, 40),
    (1, 63, 1, 2, 2, 256, None, None),
    # Head dims without a Hopper kernel of their own run, on Hopper, the one of
    # the next Hopper head dim (head_dims.h, sm90_kernel_head_dim): the columns
    # past the call's head dim load as zeros and are not stored. Many tiles and
    # steps, GQA and MQA, bands with rows that see no key, on each of the three
    # Hopper kernels (64: 32; 128: 96; 256: 160, 192, 224).
    (1, 513, 385, 8, 1, 32, None, None),
    (2, 700, 1025, 8, 2, 32, -700, 1025 - 700),
    (2, 1000, 1025, 8, 2, 96, -1000, 1025 - 1000),
    (1, 1001, 777, 8, 4, 96, None, None),
    (1, 383, 513, 4, 2, 160, -200, 100),
    (1, 700, 900, 8, 2, 192, -700, 900 - 700),
    (1, 1000, 1000, 16, 4, 224, None, None),
]


def _case_id(case):
    b, sq, sk, h, hkv, d, lo, hi = case
    mask = "full" if lo is None else f"band{lo}_{hi}"
    return f"b{b}_q{sq}_k{sk}_h{h}_{hkv}_d{d}_{mask}"


def _run(fn, q, k, v, g_out, g_lse):
    """(out, lse, dq, dk, dv) with the lse cotangent included (masked rows excluded)."""

    # The cotangents are arguments, not constants baked into the program: XLA
    # took minutes to compile programs holding tens of MB of constants.
    def loss(q, k, v, g_out, g_lse):
        out, lse = fn(q, k, v)
        finite_lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(out.astype(jnp.float32) * g_out) + jnp.sum(finite_lse * g_lse), (out, lse)

    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        q, k, v, g_out, g_lse
    )
    return (out, lse, *grads)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_against_reference(rng, case, dtype):
    _check_against_reference(rng, case, dtype)


# Segment ids (packed documents) on the CUDA kernels: SegmentMask's instantiations
# (head dims 64, 128, 256; other head dims pad up to them). On Hopper the
# forward and backward run the Hopper kernels (the forward's 192-row tiles at
# head dim 64 past 1024 rows, 128 below); test_segments_on_sm80_kernels runs
# the same cases on the sm80 kernels, test_small_smem_tiles its own on the
# 99 KB tiles.
# (batch, seq_q, seq_k, heads, heads_kv, head_dim, causal, window_size, kind;
# tests/segments.py describes the kinds of ids.)
SEGMENT_CASES = [
    (2, 1000, 1000, 4, 2, 64, True, None, "packed"),  # documents of 1..40 across every tile
    (1, 1030, 1030, 4, 2, 128, False, None, "packed"),
    (2, 1500, 1500, 4, 2, 64, True, None, "long"),  # full tiles inside documents
    (1, 2049, 1500, 8, 4, 128, True, None, "long"),  # seq_q > seq_k: rows that see nothing
    (1, 4096, 4096, 4, 1, 128, True, None, "long"),  # many units and steps per CTA
    (1, 300, 517, 8, 1, 128, True, None, "random"),  # MQA, ids not contiguous
    (1, 700, 700, 4, 4, 256, True, (200, 0), "shuffled"),  # ids out of order, padding
    (1, 1100, 900, 4, 2, 256, False, None, "long"),
    (2, 255, 257, 2, 2, 64, False, None, "disjoint"),  # rows and keys with no partner
    (1, 200, 300, 2, 1, 80, False, (30, 30), "random"),  # head dim 80 runs 128's kernels
    (1, 130, 130, 2, 2, 32, True, None, "packed"),  # head dim 32 runs 64's kernels
    # Head dim 128 steps 80 query rows (masked after dS^T): lengths that are
    # multiples of 80 and not of 64, documents across the steps' edges.
    (1, 1040, 1040, 4, 2, 128, True, (300, 0), "shuffled"),
    (2, 560, 720, 4, 4, 128, False, None, "packed"),
]


def _segments_call(deterministic=False, softcap=None):
    def fn(q, k, v, q_ids, kv_ids, causal, window):
        return jflash.flash_attention(q, k, v, causal=causal, window_size=window,
                                      return_lse=True, q_segment_ids=q_ids,
                                      kv_segment_ids=kv_ids, deterministic=deterministic,
                                      softcap=softcap)

    return fn


def _assert_segment_kernels(head_dim, fwd_family, bwd_family):
    """The families (cuda_forward_family's codes) the segment kernels of a padded
    head dim run in, each where this build has them (0: left out of the build)."""
    for dtype in DTYPES:
        assert cuda_forward_family(dtype, head_dim, True, segments=True) in (fwd_family, 0)
        assert cuda_backward_family(dtype, head_dim, True, segments=True) in (bwd_family, 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", SEGMENT_CASES, ids=segment_case_id)
def test_segments_against_reference(rng, case, dtype):
    padded = {32: 64, 80: 128}.get(case[5], case[5])
    if os.environ.get("JFLASH_CUDA_FORWARD") == "sm80":
        _assert_segment_kernels(padded, 80, 80)
    elif _is_hopper():
        _assert_segment_kernels(padded, 90, 90)
    _kernel_call(lambda: check_segments(rng, case, dtype, _segments_call()))


@pytest.mark.skipif(not _is_hopper(), reason="needs a compute capability 9.0 GPU")
def test_segments_on_sm80_kernels():
    """The segment cases on the sm80 forward and backward, forced on Hopper."""
    _pytest_in_subprocess("test_segments_against_reference or test_segments_deterministic",
                          JFLASH_CUDA_FORWARD="sm80", JFLASH_CUDA_BACKWARD="sm80")


# Deterministic mode with segment ids orders dQ by the band's key blocks (the
# tiles of other documents in them computed fully masked), on the Hopper
# backward at head dims 64, 128 and 256.
SEGMENT_DETERMINISTIC_CASES = [
    (1, 1500, 1500, 8, 2, 128, True, None, "packed"),
    (1, 1000, 1200, 4, 4, 64, False, None, "long"),
    (1, 900, 900, 4, 2, 256, True, None, "shuffled"),
]


@pytest.mark.parametrize("case", SEGMENT_DETERMINISTIC_CASES, ids=segment_case_id)
def test_segments_deterministic(rng, case):
    """Within the 2x rule, and bitwise the same gradients every run."""
    _kernel_call(lambda: check_segments(rng, case, jnp.bfloat16, _segments_call(True)))
    b, sq, sk, h, hkv, d, causal, window, kind = case
    q, k, v = (jnp.asarray(rng.standard_normal((b, s, n, d)), jnp.bfloat16)
               for s, n in ((sq, h), (sk, hkv), (sk, hkv)))
    q_ids, kv_ids = segment_ids(rng, kind, b, sq, sk)
    g_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    fn = _segments_call(True)

    def loss(q, k, v):
        return jnp.sum(fn(q, k, v, q_ids, kv_ids, causal, window)[0].astype(jnp.float32) * g_out)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    first = [np.asarray(g) for g in _kernel_call(lambda: grad(q, k, v))]
    for _ in range(4):
        for name, a, b_ in zip(("dq", "dk", "dv"), first, grad(q, k, v)):
            assert np.array_equal(a, np.asarray(b_)), f"{name} differs between runs"


def test_segments_grid_limits(rng):
    """Batch past 65535 (the sm80 launchers' grid chunks advance the ids and their
    summaries with the batch): forward and backward within the 2x rule."""
    _kernel_call(lambda: check_segments(rng, (70000, 4, 6, 1, 1, 64, True, None, "random"),
                                        jnp.bfloat16, _segments_call()))


# Softcap (csrc/include/jflash/score.h) on the CUDA kernels: the softcap
# instantiations of head dims 64, 128 and 256 (80 runs 128's, 32 runs 64's),
# every mask kind, GQA and MQA, odd lengths both ways, rows that see no key, many
# units and steps per CTA, and queries scaled (q_scale) so that |softmax_scale
# q.k| >> softcap where the cap is small. On Hopper the Hopper kernels run them;
# test_softcap_on_sm80_kernels runs them on the sm80 kernels, test_small_smem_tiles
# its own on the 99 KB tiles.
# (batch, seq_q, seq_k, heads, heads_kv, head_dim, diag_lo, diag_hi, softcap, q_scale)
SOFTCAP_CASES = [
    (1, 129, 1000, 4, 2, 128, None, None, 50.0, 1.0),  # the cap; seq_q < seq_k
    (1, 1000, 129, 4, 4, 128, -1000, 129 - 1000, 5.0, 4.0),  # causal: 871 rows see nothing
    (2, 300, 300, 2, 1, 128, -70, -5, 2.0, 4.0),  # window; rows 0..4 see nothing
    (1, 383, 513, 4, 2, 128, -200, 100, 10.0, 3.0),  # a window cutting tiles on both sides
    (2, 511, 1537, 4, 1, 64, -511, 1537 - 511, 30.0, 3.0),  # causal, MQA
    (2, 700, 1024, 8, 8, 64, -300, 1024 - 700 + 20, 5.0, 3.0),  # short-band tile, window
    (4, 1100, 1100, 16, 4, 64, -1100, 0, 50.0, 2.0),  # causal, many units, 3 consumers
    (1, 250, 700, 2, 2, 256, -300, 100, 5.0, 3.0),
    (1, 513, 385, 8, 1, 256, None, None, 1.0, 2.0),  # MQA; a last key block of one key
    (3, 1000, 1000, 16, 8, 256, -1000, 0, 30.0, 2.0),
    (1, 200, 300, 2, 1, 80, -200, 100, 5.0, 3.0),  # head dim 80 runs 128's kernels
    (1, 130, 190, 2, 2, 32, None, None, 2.0, 3.0),  # head dim 32 runs 64's
    # The Hopper forward takes bfloat16 softcaps up to 56.8 against a fixed
    # offset (jflash/score.h): 56 needs an offset; past 56.8 the running max.
    (1, 257, 300, 4, 2, 128, None, None, 56.0, 8.0),
    (2, 200, 333, 2, 1, 128, -200, 133, 100.0, 8.0),
    (1, 300, 200, 2, 2, 64, None, None, 60.0, 8.0),
    (1, 150, 190, 2, 2, 256, -150, 40, 80.0, 6.0),
]


def _softcap_case_id(case):
    return _case_id(case[:8]) + f"_cap{case[8]:g}_q{case[9]:g}"


def _assert_softcap_kernels(head_dim):
    """On Hopper the softcap kernels of a padded head dim run in the Hopper family,
    under JFLASH_CUDA_FORWARD/BACKWARD=sm80 in the sm80 one (0: not built)."""
    expected = 80 if os.environ.get("JFLASH_CUDA_FORWARD") == "sm80" else 90
    if not _is_hopper():
        return
    for dtype in DTYPES:
        for banded in (False, True):
            assert cuda_forward_family(dtype, head_dim, banded, softcap=True) in (expected, 0)
            assert cuda_backward_family(dtype, head_dim, banded, softcap=True) in (expected, 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", SOFTCAP_CASES, ids=_softcap_case_id)
def test_softcap_against_reference(rng, case, dtype):
    _assert_softcap_kernels({32: 64, 80: 128}.get(case[5], case[5]))
    _check_against_reference(rng, case[:8], dtype, softcap=case[8], q_scale=case[9])


# Softcap with segment ids (the softcap kernels of SegmentMask) and in
# deterministic mode (bitwise the same gradients every run).
SOFTCAP_SEGMENT_CASES = [
    (2, 1000, 1000, 4, 2, 64, True, None, "packed"),
    (1, 2049, 1500, 8, 4, 128, True, None, "long"),
    (1, 300, 517, 8, 1, 128, True, None, "random"),
    (1, 700, 700, 4, 4, 256, True, (200, 0), "shuffled"),
]


@pytest.mark.parametrize("case", SOFTCAP_SEGMENT_CASES, ids=segment_case_id)
def test_softcap_segments_against_reference(rng, case):
    _kernel_call(lambda: check_segments(rng, case, jnp.bfloat16, _segments_call(softcap=5.0),
                                        softcap=5.0, q_scale=3.0))


SOFTCAP_DETERMINISTIC_CASES = [
    (1, 1500, 2000, 8, 8, 128, -1500, 2000 - 1500, 5.0, 3.0),
    (1, 1000, 1000, 8, 1, 64, -300, 20, 30.0, 2.0),
    (1, 900, 900, 4, 4, 256, -900, 0, 5.0, 3.0),
]


@pytest.mark.parametrize("case", SOFTCAP_DETERMINISTIC_CASES, ids=_softcap_case_id)
def test_softcap_deterministic(rng, case):
    _check_deterministic(rng, case[:8], runs=4, softcap=case[8], q_scale=case[9])


@pytest.mark.skipif(not _is_hopper(), reason="needs a compute capability 9.0 GPU")
def test_softcap_on_sm80_kernels():
    """The softcap cases on the sm80 forward and backward, forced on Hopper."""
    _pytest_in_subprocess("test_softcap_against_reference or test_softcap_segments or "
                          "test_softcap_deterministic",
                          JFLASH_CUDA_FORWARD="sm80", JFLASH_CUDA_BACKWARD="sm80")


# A negative or zero softmax_scale: the Hopper forward masks raw scores with a
# value that the scale's sign sends to -inf, and a zero scale (nothing is sent
# to -inf) takes a path of its own on masked tiles.
SCALE_CASES = [
    (1, 1100, 1100, 4, 2, 64, -1100, 0),  # causal past 1024: three consumer warpgroups
    (2, 300, 300, 4, 2, 64, -300, 0),  # causal, the short-band tile (two consumers)
    (2, 300, 300, 4, 2, 128, -300, 0),
    (1, 383, 513, 4, 2, 128, -200, 100),  # a window cutting tiles on both sides
    (2, 250, 250, 2, 1, 256, -250, 0),
    (1, 200, 2049, 2, 1, 128, None, None),  # the sequence end cuts the last tile
    (1, 130, 190, 2, 2, 64, None, None),
]


@pytest.mark.parametrize("scale", [-0.3, 0.0])
@pytest.mark.parametrize("case", SCALE_CASES, ids=_case_id)
def test_scale_sign_against_reference(rng, case, scale):
    _check_against_reference(rng, case, jnp.bfloat16, scale=scale)


def _kernel_call(call):
    """call()'s result, ready; a skip where a development build left the instantiation out."""
    try:
        return jax.block_until_ready(call())
    except Exception as e:
        if "JFLASH_CUDA_SUBSET" not in str(e):
            raise
        pytest.skip(f"instantiation not compiled in: {str(e).splitlines()[0][:200]}")


def _check_against_reference(rng, case, dtype, scale=None, deterministic=False, softcap=None,
                             q_scale=1.0, k_rise=None, score_shift=None):
    """out, lse and the three gradients within the 2x rule; masked rows exact.
    softcap: that of the call; q_scale scales the queries (peaked scores);
    k_rise = (first, last) scales key j by linspace(first, last, seq_k)[j]
    (rising key norms); score_shift adds this to every score (at the call's
    scale, through the first head-dim coordinate: q there shift / scale, k 1)."""
    b, sq, sk, h, hkv, d, lo, hi = case
    if lo is None:
        lo, hi = -sq, sk
    if scale is None:
        scale = 1.0 / np.sqrt(d)
    q = rng.standard_normal((b, sq, h, d)) * q_scale
    k = rng.standard_normal((b, sk, hkv, d))
    if k_rise is not None:
        k = k * np.linspace(*k_rise, sk)[None, :, None, None]
    if score_shift is not None:
        q[..., 0] = score_shift / scale
        k[..., 0] = 1.0
    q = jnp.asarray(q, dtype)
    k = jnp.asarray(k, dtype)
    v = jnp.asarray(rng.standard_normal((b, sk, hkv, d)), dtype)
    g_out = jnp.asarray(rng.standard_normal((b, sq, h, d)), jnp.float32)
    g_lse = jnp.asarray(rng.standard_normal((b, h, sq)), jnp.float32)
    kw = dict(softmax_scale=scale, diag_lo=lo, diag_hi=hi, softcap=softcap)

    got = _kernel_call(
        lambda: _run(
            lambda q, k, v: attention_band(q, k, v, deterministic=deterministic, **kw),
            q, k, v, g_out, g_lse,
        )
    )
    truth = _run(lambda q, k, v: reference_band(q, k, v, **kw), q, k, v, g_out, g_lse)
    plain = _run(lambda q, k, v: reference_band(q, k, v, dtype=dtype, **kw), q, k, v, g_out, g_lse)

    truth_np = [np.asarray(jnp.asarray(t, jnp.float32), np.float64) for t in truth]
    for name, x, p, t in zip(("out", "lse", "dq", "dk", "dv"), got, plain, truth_np):
        assert_within_rule(name, x, p, t, dtype)

    # Rows that see no key: out 0, lse -inf, zero gradient, never NaN.
    rows = np.arange(sq)
    seen = (np.minimum(sk - 1, rows + hi) >= np.maximum(0, rows + lo))
    out, lse, dq = (np.asarray(jnp.asarray(x, jnp.float32)) for x in (got[0], got[1], got[2]))
    assert np.all(out[:, ~seen] == 0) and np.all(dq[:, ~seen] == 0)
    assert np.all(np.isneginf(lse[:, :, ~seen])) and np.all(np.isfinite(lse[:, :, seen]))


def _forward_against_reference(rng, q, k, lo, hi, dtype):
    """The forward at softmax_scale 1 on these scores (q, k as numpy arrays,
    cast to dtype) and random values: out and lse within the 2x rule of the
    float64 reference. Returns out, lse and that reference's (out, lse)."""
    b, sk, hkv, d = k.shape
    q, k = jnp.asarray(q, dtype), jnp.asarray(k, dtype)
    v = jnp.asarray(rng.standard_normal((b, sk, hkv, d)), dtype)
    kw = dict(softmax_scale=1.0, diag_lo=lo, diag_hi=hi)
    out, lse = _kernel_call(lambda: jax.jit(lambda q, k, v: attention_band(q, k, v, **kw))(q, k, v))
    truth = [np.asarray(t, np.float64) for t in reference_band(q, k, v, **kw)]
    plain = reference_band(q, k, v, dtype=dtype, **kw)
    for name, x, p, t in zip(("out", "lse"), (out, lse), plain, truth):
        assert_within_rule(name, x, p, t, dtype)
    return out, lse, truth


# Scores whose row maxima rise along the keys, by steps that cross the Hopper
# forward's rescale slack (2^15 in exp2 terms, about 10.4 in natural units) and
# one step past float32's exp2 range (about 88.7). The Hopper softmax first
# takes each key tile against the running max; where a row's max rose past
# the slack it raises the max from the exponentials, and where it rose by
# more than 64 in log2 units (44.4 natural: the steps to 125 and 140), it
# computes the tile again with fresh maxima; random scores (the cases above)
# almost never take those paths. The bias of key block
# j (64 keys) is RISING_BIAS[j] in natural units, added through the first
# head-dim coordinate (q = +-1 there, half of the rows falling instead).
RISING_BIAS = [0, 3, 3, 10, 10, 2, 25, 25, 24, 125, 125, 120, 130, 131, 60, 140]
RISING_CASES = [
    (1, 300, 1000, 4, 2, 64, None, None),
    (1, 300, 1000, 4, 2, 128, None, None),
    (1, 300, 1000, 4, 2, 256, None, None),
    (1, 300, 1000, 4, 1, 64, -300, 1000 - 300),  # bottom-right causal
    (1, 300, 1000, 4, 1, 128, -300, 1000 - 300),
    (1, 300, 1000, 4, 1, 256, -300, 1000 - 300),
]


@pytest.mark.parametrize("case", RISING_CASES, ids=_case_id)
def test_rising_scores_against_reference(rng, case):
    b, sq, sk, h, hkv, d, lo, hi = case
    if lo is None:
        lo, hi = -sq, sk
    dtype = jnp.bfloat16
    # Noise of unit variance in the scores at softmax_scale 1; the biases are
    # small integers, exact in bfloat16.
    q = rng.standard_normal((b, sq, h, d)) * d ** -0.25
    k = rng.standard_normal((b, sk, hkv, d)) * d ** -0.25
    q[..., 0] = np.where(np.arange(sq) % 2 == 0, 1.0, -1.0)[None, :, None]
    k[..., 0] = np.asarray(RISING_BIAS)[np.minimum(np.arange(sk) // 64, len(RISING_BIAS) - 1)][None, :, None]
    out, lse, truth = _forward_against_reference(rng, q, k, lo, hi, dtype)
    # Scores this large make the plain bfloat16 computation (scores rounded to
    # bfloat16) coarse, and so the rule loose; the kernel takes the scores in
    # float32, so its error stays at P's and O's bfloat16 rounding.
    out_err = np.max(np.abs(np.asarray(out, np.float64) - truth[0]))
    lse_err = np.max(np.abs(np.asarray(lse, np.float64) - truth[1]) / np.maximum(1, np.abs(truth[1])))
    assert out_err <= 2e-2 * max(1.0, np.max(np.abs(truth[0]))), out_err
    assert lse_err <= 1e-5, lse_err


# A row's max that rises by 126 to 128 in log2 units (87.3 to 88.7 in natural
# units) from one key tile to a later one: the Hopper forward's terms against
# the stale max are still finite there, but the factor that takes them to the
# new max, 2^-126 or less, is no normal float. One key of the third key tile
# carries the jump (a few such terms in a thread's sum overflow it, which
# always took the path that computes S again), the others score 0; rows with
# q = -1 in the first coordinate see a fall instead. Scores are exact in
# bfloat16 (no noise).
@pytest.mark.parametrize("rise", [87.5, 88.0, 88.5])
@pytest.mark.parametrize("case", [
    (1, 128, 512, 2, 1, 64, None, None),
    (1, 128, 512, 2, 1, 128, None, None),
    (1, 128, 512, 2, 2, 128, -128, 512 - 128),  # bottom-right causal
], ids=_case_id)
def test_max_jump_to_float32_range_against_reference(rng, case, rise):
    b, sq, sk, h, hkv, d, lo, hi = case
    if lo is None:
        lo, hi = -sq, sk
    dtype = jnp.bfloat16
    q = np.zeros((b, sq, h, d))
    k = np.zeros((b, sk, hkv, d))
    q[..., 0] = np.where(np.arange(sq) % 2 == 0, 1.0, -1.0)[None, :, None]
    k[:, 300, :, 0] = rise
    out, lse, _ = _forward_against_reference(rng, q, k, lo, hi, dtype)
    assert np.all(np.isfinite(np.asarray(out, np.float32))) and np.all(np.isfinite(np.asarray(lse)))


# Sharply peaked scores (queries times 8: scores of standard deviation 8 in
# natural units, about 11.5 in log2) and keys whose norms rise along the
# sequence: a row's max keeps rising past the Hopper forward's slack on many
# tiles, and a tile's sum of exponentials against the stale max fails its
# bound even where its max does not. These tiles take the raise path (the
# maxima raised from the exponentials, without S again); the checks are
# _check_against_reference's (the 2x rule, forward and gradients).
PEAKED_CASES = [
    (1, 1000, 1000, 4, 2, 64, None, None),
    (1, 1000, 1000, 4, 2, 128, None, None),
    (1, 700, 1500, 4, 4, 64, -700, 1500 - 700),  # bottom-right causal
    (2, 517, 777, 4, 1, 128, -517, 777 - 517),
    (1, 900, 900, 2, 2, 128, -300, 0),  # a left window: rows whose first tile holds few keys
]


@pytest.mark.parametrize("data", ["peaked", "rising"])
@pytest.mark.parametrize("case", PEAKED_CASES, ids=_case_id)
def test_peaked_and_rising_data_against_reference(rng, case, data):
    if data == "peaked":
        _check_against_reference(rng, case, jnp.bfloat16, q_scale=8.0)
    else:
        _check_against_reference(rng, case, jnp.bfloat16, k_rise=(0.5, 4.0))


# Every score far below zero (lse about -100) on calls whose last key block is
# cut by seq_k: the Hopper backward's unmasked kernels mask no key there (the
# keys past seq_k are the loads' zero rows, dK and dV rows the store drops),
# and a zero score's exp2(-lse) would overflow to inf and reach dq as
# inf * 0 = NaN; the kernels clamp its exponent at 0. A band cuts the same
# block in the last case (masked as before).
LOW_SCORE_CASES = [
    (1, 200, 333, 2, 2, 64, None, None),
    (1, 130, 77, 4, 2, 128, None, None),  # GQA, odd lengths
    (2, 96, 200, 2, 1, 256, None, None),  # MQA
    (1, 150, 333, 2, 2, 128, -150, 333 - 150),  # bottom-right causal
]


@pytest.mark.parametrize("case", LOW_SCORE_CASES, ids=_case_id)
def test_low_scores_against_reference(rng, case):
    _check_against_reference(rng, case, jnp.bfloat16, score_shift=-100.0)


# Softcapped scores near -softcap everywhere: the Hopper forward's fixed-offset
# softmax at the low end of its range (P near 2^-80 at cap 50, 2^-98 at 56).
@pytest.mark.parametrize("cap", [50.0, 56.0])
@pytest.mark.parametrize("case", LOW_SCORE_CASES, ids=_case_id)
def test_softcap_low_scores_against_reference(rng, case, cap):
    _check_against_reference(rng, case, jnp.bfloat16, softcap=cap, score_shift=-1000.0)


# GPUs with 99 KB of shared memory per block (sm86, sm89) run the kSmall column
# of the tile table for these head dims (csrc/cuda/tile_sizes.h); here the
# column is forced by JFLASH_CUDA_SMEM_LIMIT, in a subprocess (read once per
# process). Block sizes there: backward 64 x 64 (96..160), 64 x 32 (192),
# 32 x 32 on 4 warps (224, 256); forward 64 x 64 on 4 warps (224, 256).
SMALL_SMEM_LIMIT = 99 * 1024
SMALL_SMEM_CASES = [
    (1, 130, 77, 4, 2, 96, None, None),  # GQA, odd lengths
    (1, 100, 190, 2, 2, 128, -100, 90),  # bottom-right causal, seq_q < seq_k
    (2, 65, 65, 2, 1, 160, -20, 3),  # MQA, band
    (1, 97, 33, 2, 2, 192, None, None),  # one key past a 32-key tile
    (1, 90, 70, 4, 4, 224, -90, -30),  # rows 0..29 see nothing
    (1, 70, 129, 4, 2, 256, -70, 129 - 70),  # GQA, bottom-right causal
    (1, 33, 31, 2, 2, 256, None, None),
]


@pytest.mark.skipif(
    os.environ.get("JFLASH_CUDA_SMEM_LIMIT") != str(SMALL_SMEM_LIMIT),
    reason="run by test_small_smem_tiles, in a subprocess with JFLASH_CUDA_SMEM_LIMIT set",
)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", SMALL_SMEM_CASES, ids=_case_id)
def test_small_smem_against_reference(rng, case, dtype):
    d, banded = case[5], case[6] is not None
    for direction in ("fwd", "bwd"):
        smem = cuda_kernel_smem_bytes(direction, dtype, d, banded)
        assert smem <= SMALL_SMEM_LIMIT, (direction, d, smem)
    _check_against_reference(rng, case, dtype)


# Segment ids on the 99 KB tiles: backward 64 x 64 (head dim 128), 32 x 32
# (256), forward 64 x 64 (256).
SMALL_SMEM_SEGMENT_CASES = [
    (1, 300, 333, 4, 2, 128, True, None, "packed"),
    (1, 257, 255, 2, 1, 256, False, None, "long"),
    (1, 190, 190, 2, 2, 256, True, (40, 0), "random"),
]


@pytest.mark.skipif(
    os.environ.get("JFLASH_CUDA_SMEM_LIMIT") != str(SMALL_SMEM_LIMIT),
    reason="run by test_small_smem_tiles, in a subprocess with JFLASH_CUDA_SMEM_LIMIT set",
)
@pytest.mark.parametrize("case", SMALL_SMEM_SEGMENT_CASES, ids=segment_case_id)
def test_small_smem_segments_against_reference(rng, case):
    for direction in ("fwd", "bwd"):
        smem = cuda_kernel_smem_bytes(direction, jnp.bfloat16, case[5], True, segments=True)
        assert smem <= SMALL_SMEM_LIMIT, (direction, case[5], smem)
    _kernel_call(lambda: check_segments(rng, case, jnp.bfloat16, _segments_call()))


# Softcap on the 99 KB tiles (the softcap head dims with a kSmall column:
# backward 128 and 256, forward 256).
SMALL_SMEM_SOFTCAP_CASES = [
    (1, 100, 190, 2, 2, 128, -100, 90, 5.0, 3.0),
    (1, 70, 129, 4, 2, 256, -70, 129 - 70, 2.0, 4.0),
    (1, 33, 31, 2, 2, 256, None, None, 30.0, 2.0),
]


@pytest.mark.skipif(
    os.environ.get("JFLASH_CUDA_SMEM_LIMIT") != str(SMALL_SMEM_LIMIT),
    reason="run by test_small_smem_tiles, in a subprocess with JFLASH_CUDA_SMEM_LIMIT set",
)
@pytest.mark.parametrize("case", SMALL_SMEM_SOFTCAP_CASES, ids=_softcap_case_id)
def test_small_smem_softcap_against_reference(rng, case):
    for direction in ("fwd", "bwd"):
        smem = cuda_kernel_smem_bytes(direction, jnp.bfloat16, case[5], case[6] is not None,
                                      softcap=True)
        assert smem <= SMALL_SMEM_LIMIT, (direction, case[5], smem)
    _check_against_reference(rng, case[:8], jnp.bfloat16, softcap=case[8], q_scale=case[9])


def test_small_smem_tiles():
    """The small-shared-memory tiles, forced on this GPU, against the reference."""
    # Skipped before the checks below, which assume no cap (the subprocess
    # call would skip too, but only after them).
    if os.environ.get("JFLASH_CUDA_SMEM_LIMIT"):
        pytest.skip("already under a JFLASH_CUDA_SMEM_LIMIT")
    # Without the cap, a Hopper GPU runs tiles that need more than 99 KB for
    # these head dims (so the subprocess below really runs other kernels).
    if _is_hopper():
        for d in (96, 128, 160, 192, 224, 256):
            smem = cuda_kernel_smem_bytes("bwd", jnp.bfloat16, d, False)
            assert smem == 0 or smem > SMALL_SMEM_LIMIT, (d, smem)
    _pytest_in_subprocess("test_small_smem_against_reference or test_small_smem_segments or "
                          "test_small_smem_softcap", JFLASH_CUDA_SMEM_LIMIT=str(SMALL_SMEM_LIMIT))


def _pytest_in_subprocess(test_name, **env):
    """Runs this file's test_name in a fresh process with env set; all must pass.

    Skips where this process already runs under one of those variables (it is
    itself such a subprocess, or the caller set one for the whole run), and
    where no case there passed and every one skipped for a kernel that a
    JFLASH_CUDA_SUBSET build left out (conftest.py, _kernel_call) or for
    this check (the wrapper itself, matched by test_name), with those reasons.
    """
    already = [name for name in env if os.environ.get(name)]
    if already:
        pytest.skip(f"already under {' / '.join(already)}")
    result = subprocess.run(
        [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
         str(pathlib.Path(__file__).resolve()), "-k", test_name],
        env=dict(os.environ, **env), capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    skips = [line for line in result.stdout.splitlines() if line.startswith("SKIPPED")]
    left_out = ("a kernel left out of this build", "instantiation not compiled in", "already under")
    if " passed" not in result.stdout and skips and all(
            any(reason in line for reason in left_out) for line in skips):
        pytest.skip("every case skipped in the subprocess: " + " | ".join(skips)[:500])
    assert " passed" in result.stdout, result.stdout[-2000:]


def _assert_setting_rejected(variable, value, setup, call):
    """In a fresh process with variable=value, `call` (after `setup`) raises an
    error that names the variable: a malformed setting is never ignored."""
    code = (
        "import jax, jax.numpy as jnp, jflash\n" + setup +
        "try:\n"
        f"    ({call}).block_until_ready()\n"
        "except Exception as e:\n"
        f"    assert {variable!r} in str(e), e\n"
        "    print('rejected')\n"
    )
    env = dict(os.environ, **{variable: value})
    result = subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "rejected" in result.stdout


def test_smem_limit_setting_is_checked():
    _assert_setting_rejected(
        "JFLASH_CUDA_SMEM_LIMIT", "99KB",
        "from jflash._src.ffi import cuda_kernel_smem_bytes\n"
        "assert cuda_kernel_smem_bytes('fwd', jnp.bfloat16, 128, False) == -1\n"
        "q = jnp.ones((1, 8, 1, 128), jnp.bfloat16)\n",
        "jflash.flash_attention(q, q, q)",
    )


def test_repeatable(rng):
    """The same inputs give bitwise the same forward (no races between warps)."""
    q = jnp.asarray(rng.standard_normal((1, 515, 4, 128)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((1, 700, 2, 128)), jnp.bfloat16)
    fn = jax.jit(lambda q, k: jflash.flash_attention(q, k, k, causal=True, return_lse=True))
    first = fn(q, k)
    for _ in range(3):
        again = fn(q, k)
        assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(first, again))


# Deterministic mode (dq added in key-block order): many key blocks per query
# block, so that the default order varies between runs; GQA groups walked by
# one CTA; bands whose first key block differs per query block; the Hopper
# backward at head dims 64, 128 and 256 (the sm80 one on other GPUs).
DETERMINISTIC_CASES = [
    (2, 2048, 2048, 8, 2, 128, None, None),
    (1, 1500, 2000, 8, 8, 128, -1500, 2000 - 1500),  # bottom-right causal
    (1, 1001, 777, 8, 2, 128, None, None),  # 80-row steps: a last block of 41 rows
    (1, 1000, 1000, 8, 1, 64, -300, 20),  # window, MQA
    (1, 777, 1025, 16, 4, 128, -700, 30),  # window; a last key block of one key
    (1, 1040, 1040, 8, 2, 128, -1040, 0),  # causal: 13 blocks of 80 rows
    (1, 1024, 1536, 4, 2, 256, None, None),
    (1, 900, 900, 4, 4, 256, -900, 0),  # causal
    (1, 1000, 1000, 8, 2, 96, -1000, 0),  # causal, on the Hopper head dim 128 kernel
]


@pytest.mark.parametrize("case", DETERMINISTIC_CASES, ids=_case_id)
def test_deterministic_gradients(rng, case):
    _check_deterministic(rng, case, runs=8)


def _check_deterministic(rng, case, runs, softcap=None, q_scale=1.0):
    """deterministic=True: within the 2x rule, and bitwise the same gradients in
    `runs` more runs."""
    _check_against_reference(rng, case, jnp.bfloat16, deterministic=True, softcap=softcap,
                             q_scale=q_scale)
    b, sq, sk, h, hkv, d, lo, hi = case
    if lo is None:
        lo, hi = -sq, sk
    kw = dict(softmax_scale=d**-0.5, diag_lo=lo, diag_hi=hi, deterministic=True, softcap=softcap)
    q = jnp.asarray(rng.standard_normal((b, sq, h, d)) * q_scale, jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((b, sk, hkv, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((b, sk, hkv, d)), jnp.bfloat16)
    g_out = jnp.asarray(rng.standard_normal((b, sq, h, d)), jnp.float32)

    def loss(q, k, v, g_out):
        return jnp.sum(attention_band(q, k, v, **kw)[0].astype(jnp.float32) * g_out)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    first = [np.asarray(g) for g in _kernel_call(lambda: grad(q, k, v, g_out))]
    for _ in range(runs):
        again = grad(q, k, v, g_out)
        for name, a, b_ in zip(("dq", "dk", "dv"), first, again):
            assert np.array_equal(a, np.asarray(b_)), f"{name} differs between runs"


# Grids past CUDA's 65535 limit on gridDim.y and gridDim.z, where the sm80
# kernels put heads and batch: their launchers split such a grid into launches
# of at most 65535 heads and batches (csrc/cuda/launch.h, for_each_grid_chunk),
# so that any batch (a vmap folds its axes into it) and any head count run.
# Tiny rows, many of them: batch chunks; head chunks of whole GQA groups and,
# under MQA with more than 65535 query heads, inside one group; chunks of
# both; two row blocks along x (head dim 32 runs 128-row forward and 128-key
# backward tiles on sm80). On Hopper every case runs the Hopper kernels (head
# dim 32 on the head dim 64 ones; 128 is in the ci build), whose forward and
# backward launch one-dimensional grids of work units, and
# test_grid_limits_with_sm80_kernels runs every case on the sm80 kernels too.
# (batch, seq_q, seq_k, num_heads, num_heads_kv, head_dim, diag_lo, diag_hi, deterministic)
GRID_CASES = [
    (70000, 4, 4, 1, 1, 32, None, None, False),  # the batch: was gridDim.z = 70000
    (70000, 4, 4, 2, 1, 32, -4, 0, False),  # causal, GQA; batch chunks of 65535 and 4465
    (1, 129, 5, 66000, 1, 32, None, None, False),  # MQA: forward chunks inside the group
    (2, 3, 5, 66000, 33000, 32, -3, 2, False),  # forward: chunks of whole groups, 65534 + 466
    (1, 4, 4, 70000, 70000, 32, -4, 0, False),  # backward: kv head chunks
    (66000, 3, 129, 1, 1, 32, -3, 126, False),  # bottom-right causal; 2 key blocks
    (66000, 3, 129, 1, 1, 32, -3, 126, True),  # deterministic: dq_semaphore per chunk
    (70000, 4, 4, 1, 1, 128, None, None, False),
    (1, 4, 4, 70000, 70000, 128, -4, 0, False),
]


def _grid_case_id(case):
    return _case_id(case[:8]) + ("_deterministic" if case[8] else "")


@pytest.mark.parametrize("case", GRID_CASES, ids=_grid_case_id)
def test_grid_limits_against_reference(rng, case):
    """Batch or heads past 65535: forward and backward within the 2x rule."""
    dtype = jnp.bfloat16
    if os.environ.get("JFLASH_CUDA_FORWARD") == "sm80":
        assert cuda_forward_family(dtype, case[5], case[6] is not None) in (80, 0)
    if os.environ.get("JFLASH_CUDA_BACKWARD") == "sm80":
        assert cuda_backward_family(dtype, case[5], case[6] is not None) in (80, 0)
    _check_against_reference(rng, case[:8], dtype, deterministic=case[8])


def test_grid_limits_vmap(rng):
    """A vmap of 70000 calls, folded into one launch over batch 70000 (forward
    and backward), gives bitwise what one call over that batch gives."""
    shape = (70000, 1, 4, 2, 32)  # vmapped axis, then [batch, seq, heads, head_dim]
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(3))
    g = jnp.asarray(rng.standard_normal(shape), jnp.float32)

    def loss(q, k, v, g):
        out = jflash.flash_attention(q, k, v, causal=True)
        return jnp.sum(out.astype(jnp.float32) * g), out

    value_and_grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    (_, out), grads = _kernel_call(lambda: jax.jit(jax.vmap(value_and_grad))(q, k, v, g))
    flat = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731
    (_, out_flat), grads_flat = jax.jit(value_and_grad)(flat(q), flat(k), flat(v), flat(g))
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), (out_flat, *grads_flat)):
        assert np.array_equal(np.asarray(flat(a)), np.asarray(b)), name


@pytest.mark.skipif(not _is_hopper(), reason="needs a compute capability 9.0 GPU")
def test_grid_limits_with_sm80_kernels():
    """The large-grid cases on the sm80 forward and backward, forced on Hopper."""
    _pytest_in_subprocess("test_grid_limits_against_reference or test_grid_limits_vmap",
                          JFLASH_CUDA_FORWARD="sm80", JFLASH_CUDA_BACKWARD="sm80")


@pytest.mark.skipif(not _is_hopper(), reason="needs a compute capability 9.0 GPU")
def test_hopper_kernels_are_selected():
    """On Hopper the forward and backward run the sm90 kernels wherever they were built."""
    # The ci subset builds them for bfloat16 head dim 128; "all" for head dims
    # 64/128/256.
    for banded in (False, True):
        assert cuda_forward_family(jnp.bfloat16, 128, banded) == 90
        assert cuda_backward_family(jnp.bfloat16, 128, banded) == 90
    for dtype in DTYPES:
        for d in (64, 128, 256):
            assert cuda_forward_family(dtype, d, False) in (90, 0)
        for d in (64, 128, 256):
            assert cuda_backward_family(dtype, d, False) in (90, 0)
        # Other head dims run the Hopper kernel of the next Hopper head dim
        # wherever that one was built (head_dims.h, sm90_kernel_head_dim).
        for d, hopper_d in ((32, 64), (96, 128), (160, 256), (192, 256), (224, 256)):
            for banded in (False, True):
                for family in (cuda_forward_family, cuda_backward_family):
                    if family(dtype, hopper_d, banded) == 90:
                        assert family(dtype, d, banded) == 90, (family.__name__, d, banded)


# The sm80 backward on Hopper (JFLASH_CUDA_BACKWARD=sm80, in a subprocess: the
# choice is read once per process), on shapes that the Hopper backward covers.
# A build without JFLASH_CUDA_SM80_HOPPER_SASS has no sm_90a SASS for the sm80
# kernels: the driver then compiles their PTX at first use, seconds per kernel
# unit, and these tests (and the other *_sm80_* ones) take minutes.
SM80_BACKWARD_CASES = [
    (1, 129, 1000, 4, 2, 128, None, None),
    (1, 300, 300, 2, 1, 128, -70, -5),
    (2, 511, 1537, 4, 1, 64, -511, 1537 - 511),
    (1, 300, 700, 4, 2, 256, -300, 700 - 300),
]


@pytest.mark.skipif(
    os.environ.get("JFLASH_CUDA_BACKWARD") != "sm80",
    reason="run by test_sm80_backward_on_hopper, in a subprocess with JFLASH_CUDA_BACKWARD=sm80",
)
@pytest.mark.parametrize("case", SM80_BACKWARD_CASES, ids=_case_id)
def test_sm80_backward_against_reference(rng, case):
    assert cuda_backward_family(jnp.bfloat16, case[5], case[6] is not None) in (80, 0)
    _check_against_reference(rng, case, jnp.bfloat16)


@pytest.mark.skipif(not _is_hopper(), reason="needs a compute capability 9.0 GPU")
def test_sm80_backward_on_hopper():
    """JFLASH_CUDA_BACKWARD=sm80 runs (and checks) the sm80 backward on Hopper."""
    _pytest_in_subprocess("test_sm80_backward_against_reference", JFLASH_CUDA_BACKWARD="sm80")


_SM80_ON_HOPPER = r"""
import sys
sys.path.insert(0, {tests_dir!r})
import jax, jax.numpy as jnp, numpy as np
from checks import assert_within_rule
from jflash._src.ffi import cuda_backward_family, cuda_forward_family, cuda_kernel_smem_bytes
from jflash._src.flash_attention import attention_band
from jflash.reference import attention_band as reference_band

assert cuda_forward_family(jnp.bfloat16, 128, False) == 80
rng = np.random.default_rng(11)
for (sq, sk, h, hkv, d, lo, hi) in ((129, 1000, 4, 2, 128, None, None),
                                    (300, 300, 2, 1, 128, -70, -5),
                                    (77, 130, 4, 1, 256, -30, 30)):
    lo, hi = (-sq, sk) if lo is None else (lo, hi)
    kw = dict(softmax_scale=d ** -0.5, diag_lo=lo, diag_hi=hi)
    q = jnp.asarray(rng.standard_normal((1, sq, h, d)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((1, sk, hkv, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((1, sk, hkv, d)), jnp.bfloat16)
    got = attention_band(q, k, v, **kw)
    truth = [np.asarray(t, np.float64) for t in reference_band(q, k, v, **kw)]
    plain = reference_band(q, k, v, dtype=jnp.bfloat16, **kw)
    for name, x, p, t in zip(("out", "lse"), got, plain, truth):
        assert_within_rule(name, x, p, t, jnp.bfloat16)
print("sm80 forward on Hopper: ok")
"""


@pytest.mark.parametrize("deterministic", [False, True])
def test_dq_modes(rng, deterministic):
    """The dq modes of a context-parallel ring's steps (tests/dq_modes.py) on the
    CUDA backward: the kept float32 sum, its delta, and an add at a row offset
    that is not a tile multiple (the reduce-adds' rows, GQA, a band)."""
    check_dq_modes(rng, dtype=jnp.bfloat16, head_dim=128, on_cpu=False, exact=False,
                   deterministic=deterministic)


@pytest.mark.skipif(not _is_hopper(), reason="needs a compute capability 9.0 GPU")
def test_dq_modes_on_sm80_backward():
    """The same on the sm80 backward (its float32 atomics into the sum)."""
    _pytest_in_subprocess("test_dq_modes", JFLASH_CUDA_BACKWARD="sm80")


@pytest.mark.skipif(not _is_hopper(), reason="needs a compute capability 9.0 GPU")
def test_sm80_forward_on_hopper():
    """JFLASH_CUDA_FORWARD=sm80 runs (and checks) the sm80 forward on Hopper."""
    tests_dir = str(pathlib.Path(__file__).resolve().parent)
    env = dict(os.environ, JFLASH_CUDA_FORWARD="sm80")
    result = subprocess.run(
        [sys.executable, "-P", "-c", _SM80_ON_HOPPER.format(tests_dir=tests_dir)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "ok" in result.stdout


# The Hopper backward's GQA head split (tile_scheduler_sm90.h): the launcher
# chooses it per call, so the cases above run whichever it picks. Forced here
# (JFLASH_CUDA_BWD_HEAD_SPLITS, read once per process: in subprocesses) to 1
# (one CTA per key block sums the group) and to 2 and 4 (partial dK, dV added
# in float32 across CTAs), on GQA shapes: causal, a window, rows that see no
# key, several batches, a last key block of one key, MQA.
HEAD_SPLIT_CASES = [
    (2, 1000, 1025, 8, 2, 128, -1000, 1025 - 1000),
    (2, 1000, 1025, 8, 2, 128, None, None),  # unmasked: 80-row steps, a last block of 40
    (1, 161, 385, 16, 1, 128, None, None),  # MQA; a last block of one row
    (1, 513, 385, 8, 1, 64, None, None),
    (1, 700, 700, 16, 2, 128, -150, 40),
    (3, 1500, 700, 16, 4, 128, -1500, 700 - 1500),
    (2, 300, 129, 4, 1, 64, -300, 129 - 300),
    (1, 700, 900, 8, 1, 256, -700, 900 - 700),
    (1, 700, 900, 8, 2, 256, None, None),
    (1, 700, 900, 8, 1, 192, -700, 900 - 700),  # on the head dim 256 kernel
    (1, 161, 385, 16, 1, 96, None, None),  # on the head dim 128 kernel
]


@pytest.mark.skipif(
    not os.environ.get("JFLASH_CUDA_BWD_HEAD_SPLITS"),
    reason="run by test_head_splits, in subprocesses with JFLASH_CUDA_BWD_HEAD_SPLITS set",
)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", HEAD_SPLIT_CASES, ids=_case_id)
def test_head_split_against_reference(rng, case, dtype):
    _check_against_reference(rng, case, dtype)


@pytest.mark.skipif(not _is_hopper(), reason="needs a compute capability 9.0 GPU")
@pytest.mark.parametrize("splits", ["1", "2", "4"])
def test_head_splits(splits):
    _pytest_in_subprocess("test_head_split_against_reference", JFLASH_CUDA_BWD_HEAD_SPLITS=splits)


def test_head_splits_setting_is_checked():
    _assert_setting_rejected(
        "JFLASH_CUDA_BWD_HEAD_SPLITS", "two",
        "q = jnp.ones((1, 8, 2, 128), jnp.bfloat16)\n"
        "k = jnp.ones((1, 8, 1, 128), jnp.bfloat16)\n",
        "jax.grad(lambda q: jflash.flash_attention(q, k, k).sum())(q)",
    )

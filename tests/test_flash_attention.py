"""jflash.flash_attention against float64 truth with FlashAttention's 2x rule.

Runs on whatever backend jax picks: the CPU kernel in CI, the CUDA kernels on a
GPU machine.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jflash
import reference64
from checks import assert_within_rule, float64_inputs, plain_dtype, qkv_inputs, window_diags
from segments import case_id, check_against_reference, packed_ids, segment_ids
from jflash._src.flash_attention import attention_band
from jflash._src.masks import causal_band
from jflash.reference import attention_band as reference_band

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]

# (batch, seq_q, seq_k, num_heads, num_heads_kv, head_dim): odd lengths, seq_q
# != seq_k both ways, MHA / GQA / MQA, and every head dim family (80 is padded).
SHAPES = [
    (2, 1, 1, 2, 2, 64),
    (2, 17, 129, 4, 2, 32),
    (2, 129, 17, 4, 1, 80),
    (1, 1000, 1000, 2, 2, 64),
    (2, 128, 256, 2, 2, 96),
    (2, 64, 64, 4, 1, 128),
    (1, 33, 65, 2, 2, 256),
    (1, 1, 1000, 4, 4, 128),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward(rng, shape, causal, dtype):
    q, k, v = qkv_inputs(rng, shape, dtype)
    out, lse = jax.jit(
        lambda q, k, v: jflash.flash_attention(q, k, v, causal=causal, return_lse=True)
    )(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (shape[0], shape[3], shape[1]) and lse.dtype == jnp.float32

    scale = 1 / np.sqrt(shape[5])
    lo, hi = causal_band(shape[1], shape[2], causal)
    truth_out, truth_lse, _ = reference64.forward(*float64_inputs(q, k, v), scale, lo, hi)
    plain_out, plain_lse = reference_band(
        q, k, v, softmax_scale=scale, diag_lo=lo, diag_hi=hi, dtype=plain_dtype(dtype)
    )
    assert_within_rule("out", out, plain_out, truth_out, dtype)
    assert_within_rule("lse", lse, plain_lse, truth_lse, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_backward(rng, shape, causal, dtype):
    """Gradients of (out, lse) with random cotangents for both: dlse exercises
    the delta - dlse term that lse-combining callers (ring attention) rely on."""
    q, k, v = qkv_inputs(rng, shape, dtype)
    dout = jnp.asarray(rng.standard_normal(q.shape), dtype)
    dlse = jnp.asarray(rng.standard_normal((shape[0], shape[3], shape[1])), jnp.float32)
    scale = 1 / np.sqrt(shape[5])
    lo, hi = causal_band(shape[1], shape[2], causal)

    def grads(fn, q, k, v, dout, dlse):
        _, vjp = jax.vjp(fn, q, k, v)
        return vjp((dout, dlse))

    def kernel_fn(q, k, v):
        return jflash.flash_attention(q, k, v, causal=causal, return_lse=True)

    def plain_fn(q, k, v):
        return reference_band(
            q, k, v, softmax_scale=scale, diag_lo=lo, diag_hi=hi, dtype=plain_dtype(dtype)
        )

    kernel = jax.jit(lambda *args: grads(kernel_fn, *args))(q, k, v, dout, dlse)
    plain = grads(plain_fn, q, k, v, dout, dlse)
    truth = reference64.backward(*float64_inputs(q, k, v, dout), np.asarray(dlse), scale, lo, hi)
    for name, got, ref, exact in zip(("dq", "dk", "dv"), kernel, plain, truth):
        assert got.dtype == q.dtype and got.shape == ref.shape
        assert_within_rule(name, got, ref, exact, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_fully_masked_rows_are_zero_not_nan(rng, dtype):
    """Rows that see no key: out 0, lse -inf, zero gradients, never NaN.

    causal with seq_q > seq_k (bottom-right) masks rows 0..seq_q-seq_k-1 fully;
    a band with diag_hi = -5 masks rows 0..4 in a square problem.
    """
    q, k, v = qkv_inputs(rng, (2, 40, 23, 4, 2, 64), dtype)
    out, lse = jflash.flash_attention(q, k, v, causal=True, return_lse=True)
    masked = 40 - 23
    assert np.all(np.asarray(out[:, :masked], np.float32) == 0)
    assert np.all(np.isneginf(np.asarray(lse[:, :, :masked])))
    assert np.all(np.isfinite(np.asarray(lse[:, :, masked:])))

    def loss(q, k, v):
        out, lse = attention_band(q, k, v, softmax_scale=0.125, diag_lo=-40, diag_hi=-5)
        return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))

    q2, k2, v2 = qkv_inputs(rng, (1, 31, 31, 2, 2, 64), dtype)
    out2, lse2 = attention_band(q2, k2, v2, softmax_scale=0.125, diag_lo=-31, diag_hi=-5)
    assert np.all(np.asarray(out2[:, :5], np.float32) == 0)
    assert np.all(np.isneginf(np.asarray(lse2[:, :, :5])))
    dq, dk, dv = jax.grad(loss, argnums=(0, 1, 2))(q2, k2, v2)
    for g in (dq, dk, dv):
        assert np.all(np.isfinite(np.asarray(g, np.float32)))
    assert np.all(np.asarray(dq[:, :5], np.float32) == 0)
    # keys 26..30 are seen by no query (j - i <= -5 means j <= 25)
    assert np.all(np.asarray(dk[:, 26:], np.float32) == 0)
    assert np.all(np.asarray(dv[:, 26:], np.float32) == 0)


def test_band_mask_matches_reference(rng):
    """A sliding window (both band edges) against float64 truth."""
    q, k, v = qkv_inputs(rng, (1, 150, 130, 4, 2, 64), jnp.bfloat16)
    lo, hi = -37, 11
    out, lse = attention_band(q, k, v, softmax_scale=0.1, diag_lo=lo, diag_hi=hi)
    truth_out, truth_lse, _ = reference64.forward(*float64_inputs(q, k, v), 0.1, lo, hi)
    plain_out, plain_lse = reference_band(
        q, k, v, softmax_scale=0.1, diag_lo=lo, diag_hi=hi, dtype=jnp.bfloat16
    )
    assert_within_rule("out", out, plain_out, truth_out, jnp.bfloat16)
    assert_within_rule("lse", lse, plain_lse, truth_lse, jnp.bfloat16)


def test_softmax_scale_and_default(rng):
    q, k, v = qkv_inputs(rng, (1, 70, 90, 2, 2, 64), jnp.float32)
    out_default = jflash.flash_attention(q, k, v)
    out_explicit = jflash.flash_attention(q, k, v, softmax_scale=1 / 8.0)
    np.testing.assert_array_equal(np.asarray(out_default), np.asarray(out_explicit))
    out_scaled = jflash.flash_attention(q, k, v, softmax_scale=0.37)
    truth, _, _ = reference64.forward(*float64_inputs(q, k, v), 0.37, -70, 90)
    plain = reference_band(q, k, v, softmax_scale=0.37, diag_lo=-70, diag_hi=90,
                           dtype=plain_dtype(jnp.float32))[0]
    assert_within_rule("out", out_scaled, plain, truth, jnp.float32)


def test_reference_public_api_matches_truth(rng):
    """jflash.reference.attention documents the semantics; check it too."""
    q, k, v = qkv_inputs(rng, (2, 37, 19, 4, 2, 32), jnp.float32)
    out, lse = jflash.reference.attention(q, k, v, causal=True, return_lse=True)
    truth_out, truth_lse, _ = reference64.forward(*float64_inputs(q, k, v), 32**-0.5, -37, 19 - 37)
    np.testing.assert_allclose(np.asarray(out), truth_out, atol=1e-5)
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), np.isneginf(truth_lse))


# (batch, seq_q, seq_k, heads, heads_kv, head_dim, causal, window_size): windows
# aligned bottom-right like causal, each side bounded or not, with and without
# causal, seq_q != seq_k both ways, GQA, rows that see no key.
WINDOW_CASES = [
    (1, 70, 70, 2, 2, 64, False, (5, 3)),
    (1, 70, 90, 4, 2, 64, False, (0, 0)),  # one key per row: the diagonal
    (1, 90, 70, 2, 1, 32, True, (12, -1)),  # causal caps the right side; rows 0..19 see nothing
    (1, 50, 80, 2, 2, 80, False, (-1, 4)),  # left unbounded
    (2, 40, 40, 2, 2, 64, True, (None, 7)),  # None is unbounded too; causal wins on the right
    (1, 33, 65, 4, 4, 128, False, (100, 100)),  # wider than the sequences: no mask
]


@pytest.mark.parametrize("case", WINDOW_CASES, ids=lambda c: f"{c[1]}x{c[2]}_c{int(c[6])}_w{c[7]}")
def test_window_size_against_reference(rng, case):
    *shape, causal, window = case
    dtype = jnp.bfloat16
    q, k, v = qkv_inputs(rng, shape, dtype)
    dout = jnp.asarray(rng.standard_normal(q.shape), dtype)
    dlse = jnp.asarray(rng.standard_normal((shape[0], shape[3], shape[1])), jnp.float32)
    scale = 1 / np.sqrt(shape[5])
    lo, hi = window_diags(shape[1], shape[2], causal, window)

    def kernel_fn(q, k, v):
        return jflash.flash_attention(q, k, v, causal=causal, window_size=window, return_lse=True)

    (out, lse), vjp = jax.vjp(jax.jit(kernel_fn), q, k, v)
    grads = vjp((dout, dlse))
    truth_out, truth_lse, _ = reference64.forward(*float64_inputs(q, k, v), scale, lo, hi)
    truth_grads = reference64.backward(*float64_inputs(q, k, v, dout), np.asarray(dlse), scale, lo, hi)
    plain = jax.vjp(lambda q, k, v: reference_band(q, k, v, softmax_scale=scale, diag_lo=lo,
                                                   diag_hi=hi, dtype=plain_dtype(dtype)), q, k, v)
    plain_out, plain_lse = plain[0]
    plain_grads = plain[1]((dout, dlse))
    assert_within_rule("out", out, plain_out, truth_out, dtype)
    assert_within_rule("lse", lse, plain_lse, truth_lse, dtype)
    for name, got, ref, exact in zip(("dq", "dk", "dv"), grads, plain_grads, truth_grads):
        assert_within_rule(name, got, ref, exact, dtype)
    # jflash.reference takes the same argument: the band above, exactly.
    ref_out = jflash.reference.attention(q, k, v, causal=causal, window_size=window)
    band_out, _ = reference_band(q, k, v, softmax_scale=scale, diag_lo=lo, diag_hi=hi)
    np.testing.assert_array_equal(np.asarray(ref_out, np.float32), np.asarray(band_out, np.float32))


@pytest.mark.parametrize("window", [(3, 2), (0, 5), (7, 0)])
def test_window_size_matches_jax_nn(rng, window):
    """Square problems, where bottom-right and top-left alignment agree: the
    window of jax.nn.dot_product_attention's local_window_size."""
    q, k, v = qkv_inputs(rng, (2, 60, 60, 4, 2, 64), jnp.float32)
    got = jflash.flash_attention(q, k, v, window_size=window)
    want = jax.nn.dot_product_attention(q, k, v, local_window_size=window, implementation="xla")
    # On GPU float32 runs the TF32 kernels (README), judged as bfloat16
    # (checks.plain_dtype): bfloat16 tolerance, still far below what one key more
    # or less in a window changes.
    atol = 2e-5 if plain_dtype(jnp.float32) == jnp.float32 else 3e-2
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=atol, rtol=atol)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_deterministic_mode(rng, causal):
    """deterministic=True: gradients within the 2x rule, equal to the default
    mode's on CPU (whose backward is deterministic either way) and, through
    the drop-in, to flash_attention's. Bitwise repeatability on GPU is
    test_cuda_specific.py's test_deterministic_gradients."""
    shape = (2, 300, 500, 4, 2, 64)
    q, k, v = qkv_inputs(rng, shape, jnp.bfloat16)
    dout = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)
    scale = 1 / np.sqrt(shape[5])

    def grads(fn):
        _, vjp = jax.vjp(fn, q, k, v)
        return vjp(dout)

    default = grads(lambda q, k, v: jflash.flash_attention(q, k, v, causal=causal))
    ordered = grads(
        lambda q, k, v: jflash.flash_attention(q, k, v, causal=causal, deterministic=True)
    )
    lo, hi = causal_band(shape[1], shape[2], causal)
    no_dlse = np.zeros((shape[0], shape[3], shape[1]))
    truth = reference64.backward(*float64_inputs(q, k, v, dout), no_dlse, scale, lo, hi)
    plain = grads(
        lambda q, k, v: reference_band(
            q, k, v, softmax_scale=scale, diag_lo=lo, diag_hi=hi, dtype=plain_dtype(jnp.bfloat16)
        )[0]
    )
    for name, a, b, p, t in zip(("dq", "dk", "dv"), default, ordered, plain, truth):
        assert_within_rule(name, b, p, t, jnp.bfloat16)
        if jax.default_backend() == "cpu":
            assert np.array_equal(np.asarray(a), np.asarray(b)), name

    # The drop-in's causal mask is top-left: the same band when seq_q == seq_k.
    ks, vs = k[:, :300], v[:, :300]
    square = [
        jax.vjp(fn, q, ks, vs)[1](dout)
        for fn in (
            lambda q, k, v: jflash.flash_attention(q, k, v, causal=causal, deterministic=True),
            lambda q, k, v: jflash.dot_product_attention(
                q, k, v, is_causal=causal, deterministic=True
            ),
        )
    ]
    for name, a, b in zip(("dq", "dk", "dv"), *square):
        assert np.array_equal(np.asarray(a), np.asarray(b)), name


# ---------------------------------------------------------------- segment ids
# (segments.py: the ids of each kind of packing and the check of one case)

# (batch, seq_q, seq_k, heads, heads_kv, head_dim, causal, window_size, kind):
# packed causal documents, GQA and MQA, odd lengths both ways, head dims that
# pad (32, 80), windows, ids out of order, non-contiguous ids, rows and keys
# with no partner.
SEGMENT_CASES = [
    (2, 200, 200, 4, 2, 64, True, None, "packed"),
    (1, 130, 97, 4, 2, 80, True, None, "packed"),  # bottom-right causal: rows 0..32 see nothing
    (2, 97, 130, 2, 1, 32, False, None, "random"),
    (1, 160, 160, 2, 2, 128, True, (20, 0), "shuffled"),
    (2, 70, 90, 2, 2, 64, False, (10, 10), "disjoint"),
]


@pytest.mark.parametrize("case", SEGMENT_CASES, ids=case_id)
def test_segment_ids_against_reference(rng, case):
    no_key, _ = check_against_reference(rng, case, jnp.bfloat16)
    if case[-1] == "disjoint":
        assert no_key  # the case exercises rows that see nothing


def test_segment_ids_float32(rng):
    check_against_reference(rng, SEGMENT_CASES[0], jnp.float32)


def test_packed_documents_equal_separate_documents(rng):
    """Causal documents packed one after the other attend as if alone: out, lse
    and the gradients of each document equal its own flash_attention call."""
    lengths = [1, 37, 64, 5, 93]
    seq = sum(lengths)
    q, k, v = qkv_inputs(rng, (1, seq, seq, 4, 2, 64), jnp.float32)
    dout = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    ids = jnp.asarray(packed_ids(lengths, np.arange(len(lengths)) + 10))[None]

    def packed(q, k, v):
        return jflash.flash_attention(q, k, v, causal=True, return_lse=True,
                                      q_segment_ids=ids, kv_segment_ids=ids)

    (out, lse), vjp = jax.vjp(packed, q, k, v)
    grads = vjp((dout, jnp.zeros(lse.shape)))
    start = 0
    for n in lengths:
        part = slice(start, start + n)
        (o, l), vjp_part = jax.vjp(
            lambda q, k, v: jflash.flash_attention(q, k, v, causal=True, return_lse=True),
            q[:, part], k[:, part], v[:, part])
        g = vjp_part((dout[:, part], jnp.zeros(l.shape)))
        for a, b in ((out[:, part], o), (lse[:, :, part], l),
                     *((x[:, part], y) for x, y in zip(grads, g))):
            np.testing.assert_allclose(a, b, **_same_call_tolerance(b))
        start += n


def _same_call_tolerance(want):
    """Two kernel calls of the same math whose tiles differ: float32 round-off on
    CPU; on GPU, where float32 runs the TF32 kernels (README), a few bfloat16
    roundings of the largest magnitude (above TF32's)."""
    if plain_dtype(jnp.float32) == jnp.float32:
        return dict(rtol=2e-5, atol=2e-6)
    return dict(rtol=0, atol=2.0**-6 * max(1.0, float(np.max(np.abs(np.asarray(want))))))


def test_segment_summaries_match_brute_force(rng):
    """The kernels' summaries of the ids: per block of 32 rows (keys), the min and
    max id and the hull of the other side's positions that hold one of its ids;
    per row (key), its id's keys (rows), exact where they are contiguous."""
    from jflash._src.masks import segment_operands

    for kind in ("packed", "shuffled", "random", "disjoint"):
        q_ids, kv_ids = segment_ids(rng, kind, 2, 75, 61)
        operands = map(np.asarray, segment_operands(q_ids, kv_ids, 32))
        _, _, q_blocks, kv_blocks, q_ranges, kv_ranges = operands
        assert q_blocks.shape == (2, 3, 4) and kv_blocks.shape == (2, 2, 4)
        assert q_ranges.shape == (2, 75, 2) and q_ranges.dtype == np.int32
        assert kv_ranges.shape == (2, 61, 2)
        for b in range(2):
            for ids, other, blocks in ((q_ids, kv_ids, q_blocks), (kv_ids, q_ids, kv_blocks)):
                ids, other = np.asarray(ids[b]), np.asarray(other[b])
                for blk in range(blocks.shape[1]):
                    block = ids[blk * 32:(blk + 1) * 32]
                    where = np.nonzero(np.isin(other, block))[0]
                    assert tuple(blocks[b, blk, :2]) == (block.min(), block.max())
                    if where.size:
                        assert tuple(blocks[b, blk, 2:]) == (where.min(), where.max() + 1)
                    else:
                        assert blocks[b, blk, 2] >= blocks[b, blk, 3]
            for ids, other, ranges in ((q_ids, kv_ids, q_ranges), (kv_ids, q_ids, kv_ranges)):
                for i, x in enumerate(np.asarray(ids[b])):
                    where = np.nonzero(np.asarray(other[b]) == x)[0]
                    begin, end = ranges[b, i]
                    if not where.size:
                        assert (begin, end) == (0, 0)
                        continue
                    exact = where.max() + 1 - where.min() == where.size
                    assert (begin if exact else -1 - begin, end) == (where.min(), where.max() + 1)
                    assert (begin >= 0) == exact


def test_segment_ids_transforms(rng):
    """vmap over an extra axis is the per-slice call (bitwise on CPU); gradients
    under jit and deterministic=True agree; the ids get no gradient; all ids
    equal is the call without them (within the rule)."""
    q, k, v = qkv_inputs(rng, (2, 50, 60, 2, 1, 64), jnp.float32)
    q_ids, kv_ids = segment_ids(rng, "random", 2, 50, 60)

    def attend(q, k, v, q_ids, kv_ids, deterministic=False):
        return jflash.flash_attention(q, k, v, causal=True, q_segment_ids=q_ids,
                                      kv_segment_ids=kv_ids, deterministic=deterministic)

    stack = lambda x: jnp.stack([x, x[::-1]])  # noqa: E731
    batched = jax.jit(jax.vmap(attend))(stack(q), stack(k), stack(v), stack(q_ids), stack(kv_ids))
    for i, flip in enumerate((lambda x: x, lambda x: x[::-1])):
        one = attend(flip(q), flip(k), flip(v), flip(q_ids), flip(kv_ids))
        np.testing.assert_array_equal(np.asarray(batched[i]), np.asarray(one))

    def loss(q, k, v, deterministic=False):
        return jnp.sum(attend(q, k, v, q_ids, kv_ids, deterministic) ** 2)

    g1 = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    g2 = jax.grad(functools.partial(loss, deterministic=True), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g1, g2):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Integer inputs: jax.grad refuses them, as for any integer argument.
    with pytest.raises(TypeError, match="integer"):
        jax.grad(lambda ids: jnp.sum(attend(q, k, v, ids, kv_ids)))(q_ids)
    same = attend(q, k, v, jnp.zeros_like(q_ids), jnp.zeros_like(kv_ids))
    plain = jflash.flash_attention(q, k, v, causal=True)
    np.testing.assert_allclose(np.asarray(same), np.asarray(plain), rtol=1e-5, atol=1e-6)


# A value head dim of its own (MLA-style): (batch, seq_q, seq_k, heads, heads_kv,
# head_dim, head_dim_v, causal, window, segment kind or None, softcap).
VALUE_HEAD_DIM_CASES = [
    (2, 77, 65, 4, 2, 192, 128, True, None, None, None),
    (1, 130, 97, 2, 1, 64, 128, False, (20, 5), None, None),
    (2, 50, 50, 4, 4, 32, 80, True, None, "packed", 3.0),
    (1, 33, 129, 2, 2, 256, 64, False, None, None, None),
]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", VALUE_HEAD_DIM_CASES,
                         ids=lambda c: f"d{c[5]}_dv{c[6]}" + "_causal" * c[7] +
                         ("_window" if c[8] else "") + ("_segments" if c[9] else "") +
                         ("_softcap" if c[10] else ""))
def test_value_head_dim_against_reference(rng, case, dtype):
    """out [.., head_dim_v], lse and the three gradients against float64 truth
    under the 2x rule, with masks, segment ids and softcap."""
    b, sq, sk, h, hkv, d, dv, causal, window, kind, cap = case
    q, k, _ = qkv_inputs(rng, (b, sq, sk, h, hkv, d), dtype)
    v = jnp.asarray(rng.standard_normal((b, sk, hkv, dv)), dtype)
    ids = segment_ids(rng, kind, b, sq, sk) if kind else (None, None)
    dout = jnp.asarray(rng.standard_normal((b, sq, h, dv)), dtype)
    dlse = jnp.asarray(rng.standard_normal((b, h, sq)), jnp.float32)
    scale = 1 / np.sqrt(d)
    lo, hi = window_diags(sq, sk, causal, window or (None, None))
    kw = dict(causal=causal, window_size=window, softcap=cap, q_segment_ids=ids[0],
              kv_segment_ids=ids[1])
    (out, lse), vjp = jax.vjp(
        jax.jit(lambda q, k, v: jflash.flash_attention(q, k, v, return_lse=True, **kw)), q, k, v)
    assert out.shape == (b, sq, h, dv) and out.dtype == q.dtype
    grads = vjp((dout, dlse))
    seg = None if kind is None else tuple(np.asarray(x) for x in ids)
    truth_out, truth_lse, _ = reference64.forward(*float64_inputs(q, k, v), scale, lo, hi, seg,
                                                  cap)
    truth_grads = reference64.backward(*float64_inputs(q, k, v, dout), np.asarray(dlse), scale,
                                       lo, hi, seg, cap)
    plain_kw = dict(softmax_scale=scale, diag_lo=lo, diag_hi=hi, dtype=plain_dtype(dtype),
                    q_segment_ids=ids[0], kv_segment_ids=ids[1], softcap=cap)
    (plain_out, plain_lse), plain_vjp = jax.vjp(
        lambda q, k, v: reference_band(q, k, v, **plain_kw), q, k, v)
    plain_grads = plain_vjp((dout, dlse))
    for name, got, ref, exact in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads),
                                     (plain_out, plain_lse, *plain_grads),
                                     (truth_out, truth_lse, *truth_grads)):
        assert got.shape == ref.shape, name
        assert_within_rule(name, got, ref, exact, dtype)
    # The public reference gives the same shape.
    assert jflash.reference.attention(q, k, v, **kw).shape == (b, sq, h, dv)


def test_value_head_dim_bad_shapes():
    q = jax.ShapeDtypeStruct((2, 16, 4, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 16, 2, 64), jnp.bfloat16)
    for v_shape, message in (((2, 16, 2, 512), "value's head_dim must be at most"),
                             ((2, 16, 4, 128), "same shape but for head_dim")):
        v = jax.ShapeDtypeStruct(v_shape, jnp.bfloat16)
        with pytest.raises(ValueError, match=message):
            jax.eval_shape(jflash.flash_attention, q, k, v)

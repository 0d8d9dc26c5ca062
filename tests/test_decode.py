"""jflash.flash_attention_with_kvcache against float64 truth with FlashAttention's 2x rule.

Runs on whatever backend jax picks: the CPU twin in CI, the CUDA decode kernel
on a GPU machine. decode_cases.py builds the inputs and the truth.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jflash
from checks import assert_within_rule
from decode_cases import Case, check_case, kwargs, make_inputs, plain, truth

# Every option of the issue: contiguous and paged caches (blocks of 16, 64,
# 256), append or not, MHA / GQA / MQA, windows, softcap, seq_q 1 to 16, empty
# and ragged caches, num_splits forced to 1 and to many, head dims 64 / 128 /
# 256 and one that is padded (80), each dtype.
CASES = [
    Case(seqlens=(0, 1, 333, 600), capacity=600),
    Case(seqlens=(599, 10, 250), capacity=600, heads=4, heads_kv=1, head_dim=64, seq_new=1,
         num_splits=1),
    Case(seqlens=(0, 297, 150), capacity=300, seq_q=3, heads=2, heads_kv=2, seq_new=3,
         window=(7, 0), num_splits=5, dtype="float16"),
    Case(seqlens=(5, 300, 0), capacity=320, block_size=16, num_splits=7),
    Case(seqlens=(40, 200), capacity=256, seq_q=16, heads=4, head_dim=64, block_size=64,
         seq_new=16, softcap=30.0),
    Case(seqlens=(700, 3), capacity=768, seq_q=3, heads=8, heads_kv=1, head_dim=256,
         block_size=256, seq_new=3, num_splits=128, dtype="float32"),
    Case(seqlens=(90, 31, 64), capacity=128, seq_q=4, heads=2, heads_kv=1, head_dim=80,
         causal=False, window=(10, 10), dtype="float32"),
    Case(seqlens=(500, 129), capacity=512, softcap=5.0, num_splits=1),
    Case(seqlens=(500, 129), capacity=512, softcap=5.0, num_splits=9, seq_new=2, seq_q=2),
    # cache_seqlens outside [0, capacity - seq_new], and block ids outside the
    # cache: clamped, never read or written out of bounds.
    Case(seqlens=(-5, 10**6), capacity=160, block_size=16, seq_new=2, seq_q=2, bad_block_id=-1),
    Case(seqlens=(2**31 - 1, 7), capacity=64, block_size=16, bad_block_id=10**6, num_splits=3),
    # A cache shorter than seq_q: the first rows see no key (0, lse -inf).
    Case(seqlens=(2, 0), capacity=64, seq_q=5, heads=2, heads_kv=2, head_dim=64),
    Case(seqlens=(300, 20), capacity=300, seq_q=6, heads=6, heads_kv=3, causal=False,
         window=(-1, 2), seq_new=4),
]


@pytest.mark.parametrize("case", CASES, ids=Case.id)
def test_against_truth(rng, case):
    check_case(rng, case)


@pytest.mark.parametrize("num_splits", [1, 2, 128])
@pytest.mark.parametrize("block_size", [None, 16, 64, 256])
def test_splits_and_layouts(rng, num_splits, block_size):
    """The same ragged batch, contiguous and paged, one split to many."""
    case = Case(seqlens=(257, 0, 511, 1), capacity=512, block_size=block_size, seq_new=1,
                num_splits=num_splits)
    check_case(rng, case)


def test_garbage_past_the_end_is_never_read(rng):
    """NaN in every cache position past a sequence's length (where the new keys
    go, and beyond): no result sees it, and the appended rows replace it."""
    for case in (Case(seqlens=(100, 37), capacity=256, seq_new=2, seq_q=2, num_splits=4),
                 Case(seqlens=(100, 37), capacity=256, block_size=16, seq_new=1)):
        out, lse = check_case(rng, case, nan_past_end=True)
        assert np.isfinite(np.asarray(out, np.float32)).all()


def test_eager_matches_jit_and_reference(rng):
    """Eager calls and the public reference (jflash.reference) agree with the kernel."""
    case = Case(seqlens=(33, 200), capacity=256, block_size=64, seq_new=1, num_splits=2,
                dtype="float32")
    out, lse = check_case(rng, case, jit=False)
    arrays = make_inputs(rng, case)
    ref = jflash.reference.attention_with_kvcache(arrays["query"], arrays["k_cache"],
                                                  arrays["v_cache"], **kwargs(case, arrays))
    true_out, true_lse, true_k, _ = truth(case, arrays)
    np.testing.assert_allclose(np.asarray(ref[0]), true_out, atol=2e-5)
    np.testing.assert_allclose(np.asarray(ref[1]), true_lse, atol=2e-5)
    np.testing.assert_array_equal(np.asarray(ref[2]), true_k)


def test_return_structure(rng):
    case = Case(seqlens=(10,), capacity=32, heads=2, heads_kv=1, head_dim=64, dtype="float32")
    a = make_inputs(rng, case)
    q, kc, vc, lens = a["query"], a["k_cache"], a["v_cache"], a["cache_seqlens"]
    kn = jnp.ones((1, 1, 1, 64), jnp.float32)
    out = jflash.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=lens)
    assert out.shape == q.shape
    out, lse = jflash.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=lens, return_lse=True)
    assert lse.shape == (1, 2, 1)
    out, k2, v2 = jflash.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=lens, k_new=kn,
                                                      v_new=kn)
    assert k2.shape == kc.shape and np.all(np.asarray(k2[0, 10]) == 1)
    assert np.array_equal(np.asarray(kc[0, 10]), np.asarray(a["k_cache"][0, 10]))  # not donated
    *_, k3, v3 = jflash.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=lens, k_new=kn,
                                                     v_new=kn, return_lse=True)
    np.testing.assert_array_equal(np.asarray(k2), np.asarray(k3))


@pytest.mark.parametrize("block_size", [None, 16])
def test_donated_cache_is_updated_in_place(rng, block_size):
    """Under jit with the caches donated, the returned caches are the input
    buffers (no copy), holding the input with the new rows written."""
    case = Case(seqlens=(30, 90), capacity=128, block_size=block_size, seq_new=1,
                dtype="float32", head_dim=64)
    a = make_inputs(rng, case)
    _, _, want_k, want_v = truth(case, a)

    @jax.jit
    def step(q, k_cache, v_cache, k_new, v_new, lens, table):
        return jflash.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
                                                   k_new=k_new, v_new=v_new, block_table=table)

    donated = jax.jit(step.__wrapped__, donate_argnums=(1, 2))
    k_cache, v_cache = jnp.array(a["k_cache"]), jnp.array(a["v_cache"])
    pointers = (k_cache.unsafe_buffer_pointer(), v_cache.unsafe_buffer_pointer())
    args = (a["query"], k_cache, v_cache, a["k_new"], a["v_new"], a["cache_seqlens"],
            a["block_table"])
    text = donated.lower(*args).compile().as_text()
    _, k_out, v_out = donated(*args)
    assert (k_out.unsafe_buffer_pointer(), v_out.unsafe_buffer_pointer()) == pointers
    assert k_cache.is_deleted() and v_cache.is_deleted()
    np.testing.assert_array_equal(np.asarray(k_out), want_k)
    np.testing.assert_array_equal(np.asarray(v_out), want_v)
    # No copy of a cache-sized buffer in the donated program.
    assert f"copy(f32[{','.join(map(str, a['k_cache'].shape))}]" not in text.replace(" ", "")


# (layout's block size, append, the operands vmapped, folded into one call): a
# vmapped axis joins the batch where each slice has its own contiguous cache or
# shares a paged pool that no append writes; otherwise one call per slice.
_VMAP_NAMES = ("query", "k_cache", "v_cache", "k_new", "v_new", "cache_seqlens", "block_table")
VMAP_CASES = [
    (None, True, _VMAP_NAMES, True),
    (None, False, ("query", "cache_seqlens"), False),  # a cache the slices share
    (16, False, ("query", "cache_seqlens", "block_table"), True),  # a shared pool, read only
    (16, True, ("query", "k_new", "v_new", "cache_seqlens", "block_table"), False),
    (16, True, _VMAP_NAMES, False),  # a pool of each slice's own
    (None, False, ("query", "k_cache", "v_cache"), True),  # lengths shared
]


@pytest.mark.parametrize("block_size,append,mapped,folded", VMAP_CASES)
def test_vmap(rng, block_size, append, mapped, folded):
    """vmap over an extra leading axis gives the per-slice calls' results, exactly
    (the split count forced: with the heuristic's, a folded call may choose
    another); the folded calls run as one call, the others as a loop."""
    case = Case(seqlens=(9, 40), capacity=64, block_size=block_size,
                seq_new=1 if append else 0, dtype="float32", head_dim=64, num_splits=3)
    slices = [make_inputs(rng, case) for _ in range(3)]
    names = [n for n in _VMAP_NAMES if (append or n not in ("k_new", "v_new"))
             and (block_size or n != "block_table")]
    args = [jnp.stack([s[n] for s in slices]) if n in mapped else slices[0][n] for n in names]
    in_axes = [0 if n in mapped else None for n in names]

    def call(*a):
        kw = dict(zip(names, a, strict=True))
        q, kc, vc = kw.pop("query"), kw.pop("k_cache"), kw.pop("v_cache")
        return jflash.flash_attention_with_kvcache(q, kc, vc, num_splits=3, return_lse=True,
                                                   **kw)

    fn = jax.vmap(call, in_axes=in_axes)
    assert ("scan[" in str(jax.make_jaxpr(fn)(*args))) != folded
    batched = jax.jit(fn)(*args)
    for i in range(len(slices)):
        one = call(*(x[i] if n in mapped else x for n, x in zip(names, args, strict=True)))
        for got, want in zip(batched, one, strict=True):
            np.testing.assert_array_equal(np.asarray(got[i]), np.asarray(want))


def test_vmap_folded_heuristic_split(rng):
    """A folded vmap with the split heuristic (which sees the folded batch) and
    two vmapped axes, under the 2x rule against each slice's truth."""
    case = Case(seqlens=(300, 5), capacity=320, seq_new=2, seq_q=2, dtype="bfloat16")
    grid = [[make_inputs(rng, case) for _ in range(2)] for _ in range(2)]
    names = ("query", "k_cache", "v_cache", "k_new", "v_new", "cache_seqlens")
    args = [jnp.stack([jnp.stack([s[n] for s in row]) for row in grid]) for n in names]

    def call(q, kc, vc, kn, vn, lens):
        return jflash.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=lens, k_new=kn,
                                                   v_new=vn, return_lse=True)

    fn = jax.vmap(jax.vmap(call))
    assert "scan[" not in str(jax.make_jaxpr(fn)(*args))
    out, lse, k_cache, v_cache = jax.jit(fn)(*args)
    for i, row in enumerate(grid):
        for j, arrays in enumerate(row):
            true_out, true_lse, true_k, true_v = truth(case, arrays)
            plain_out, plain_lse = plain(case, arrays)
            assert_within_rule("out", out[i, j], plain_out, true_out, jnp.bfloat16)
            assert_within_rule("lse", lse[i, j], plain_lse, true_lse, jnp.bfloat16)
            for name, got, want in (("k_cache", k_cache, true_k), ("v_cache", v_cache, true_v)):
                got = np.asarray(jnp.asarray(got[i, j], jnp.float32), np.float64)
                np.testing.assert_array_equal(got, want, err_msg=name)


def test_no_gradient(rng):
    case = Case(seqlens=(10,), capacity=32, heads=2, heads_kv=1, head_dim=64, dtype="float32")
    a = make_inputs(rng, case)

    def loss(q):
        return jnp.sum(jflash.flash_attention_with_kvcache(q, a["k_cache"], a["v_cache"],
                                                           cache_seqlens=a["cache_seqlens"]))

    with pytest.raises(NotImplementedError, match="no gradient"):
        jax.grad(loss)(a["query"])
    # Inputs that carry no tangent do not count as differentiation.
    jax.grad(lambda x: x * jnp.sum(jflash.flash_attention_with_kvcache(
        a["query"], a["k_cache"], a["v_cache"], cache_seqlens=a["cache_seqlens"])))(1.0)


def _shapes(q=(2, 1, 8, 64), cache=(2, 128, 2, 64), new=None, table=None, dtype=jnp.bfloat16,
            seqlens=(2,)):
    s = jax.ShapeDtypeStruct
    out = dict(query=s(q, dtype), k_cache=s(cache, dtype), v_cache=s(cache, dtype),
               cache_seqlens=s(seqlens, jnp.int32))
    if new is not None:
        out["k_new"], out["v_new"] = s(new, dtype), s(new, dtype)
    if table is not None:
        out["block_table"] = s(table, jnp.int32)
    return out


BAD = [
    # (arrays, keywords, error, message)
    (_shapes(q=(2, 8, 64)), {}, ValueError, "query must have rank 4"),
    (_shapes(cache=(3, 128, 2, 64)), {}, ValueError, "k_cache must have query's batch size"),
    (_shapes(cache=(2, 128, 3, 64)), {}, ValueError, "multiple of num_heads"),
    (_shapes(cache=(2, 128, 2, 32)), {}, ValueError, "same head_dim"),
    (_shapes(seqlens=(3,)), {}, ValueError, "cache_seqlens must have shape"),
    (_shapes(new=(2, 1, 2, 64)) | {"v_new": None}, {}, ValueError, "k_new is given but v_new"),
    (_shapes(new=(2, 1, 1, 64)), {}, ValueError, "k_new must be"),
    (_shapes(new=(2, 129, 2, 64)), {}, ValueError, "capacity"),
    (_shapes(cache=(9, 24, 2, 64), table=(2, 4)), {}, ValueError, "multiple of 16"),
    (_shapes(cache=(9, 32, 2, 64), table=(3, 4)), {}, ValueError, "block_table must have shape"),
    (_shapes(q=(2, 1, 8, 320), cache=(2, 128, 2, 320)), {}, ValueError, "at most 256"),
    (_shapes(), {"softcap": 0.0}, ValueError, "softcap must be None or a number > 0"),
    (_shapes(), {"softcap": -1.0}, ValueError, "softcap must be None or a number > 0"),
    (_shapes(), {"softcap": float("inf")}, ValueError, "softcap must be None or a number > 0"),
    (_shapes(), {"num_splits": 0}, ValueError, "num_splits must be in"),
    (_shapes(), {"num_splits": 129}, ValueError, "num_splits must be in"),
    (_shapes(), {"num_splits": 2.0}, TypeError, "num_splits must be None or an int"),
    (_shapes(), {"causal": 1}, TypeError, "causal must be a bool"),
    (_shapes(), {"window_size": (3,)}, TypeError, "window_size"),
]


@pytest.mark.parametrize("arrays,kw,error,message", BAD, ids=lambda x: str(x)[:40])
def test_errors_at_trace_time(arrays, kw, error, message):
    def run(**a):
        return jflash.flash_attention_with_kvcache(**a, **kw)

    with pytest.raises(error, match=message):
        jax.eval_shape(run, **arrays)


def test_dtype_errors():
    a = _shapes()
    a["k_cache"] = jax.ShapeDtypeStruct(a["k_cache"].shape, jnp.float16)
    with pytest.raises(TypeError, match="share one dtype"):
        jax.eval_shape(lambda **x: jflash.flash_attention_with_kvcache(**x), **a)
    a = _shapes()
    a["cache_seqlens"] = jax.ShapeDtypeStruct((2,), jnp.float32)
    with pytest.raises(TypeError, match="cache_seqlens must be an integer array"):
        jax.eval_shape(lambda **x: jflash.flash_attention_with_kvcache(**x), **a)


def test_cuda_split_model():
    """The CUDA split heuristic on an H100's or H200's SMs (132, 3 CTAs each at
    head dim 128), without a GPU: the choices docs/decode.md measures for the
    benchmark grid (8 kv heads of 8 query rows each; capacities rounded up past
    one more key to 256-key blocks)."""
    from jflash._src.ffi import decode_num_splits_cuda_model as model

    sms, per_sm = 132, 3
    assert model(1 * 8, sms, per_sm, 8448) == 33  # 264 CTAs: two per SM, 4 tiles each
    assert model(1 * 8, sms, per_sm, 16640) == 33  # two per SM (44 splits: three, 6 tiles)
    assert model(1 * 8, sms, per_sm, 33024) == 33
    assert model(1 * 8, sms, per_sm, 131328) == 49  # within 3% of 33: more CTAs per SM
    assert model(8 * 8, sms, per_sm, 8448) == 6  # 384 CTAs in one wave
    assert model(8 * 8, sms, per_sm, 131328) == 6
    assert model(8 * 8, sms, 2, 131328) == 4  # 6 would not fit one wave of 264
    assert model(1 * 8, sms, per_sm, 2304) == 9  # each split at least 256 keys
    assert model(32 * 8, sms, per_sm, 8448) == 1  # the batch alone fills the SMs
    assert model(1, sms, per_sm, 256) == 1
    # Only counts that shorten a run's tile count are chosen.
    for units in (1, 3, 8, 20, 64, 100, 200):
        for capacity in (512, 1000, 4096, 8448, 65536):
            for per in (1, 2, 3):
                splits = model(units, sms, per, capacity)
                tiles = -(-capacity // 64)
                assert 1 <= splits <= 128
                assert splits == 1 or -(-tiles // splits) < -(-tiles // (splits - 1))

"""flash_attention_with_kvcache under sharding: jit with NamedSharding, 8 CPU devices.

The decode call partitions over the batch and the kv heads (query heads with
their group): a batch- or heads-sharded call must compile with no all-gather,
all-to-all or collective-permute, keep its cache results aliased to the cache
operands, and equal the unsharded call. A paged pool has no batch axis: under
batch sharding it is replicated, and an append all-gathers only its small
operands (new rows, lengths, block table), never the pool.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jflash
from decode_cases import Case, make_inputs, truth
from host_mesh import HOST_CPUS as _HOST_CPUS
from host_mesh import mesh as _mesh
from host_mesh import needs_8_cpus, on_host_cpus  # noqa: F401 (autouse fixture)
from jflash._src.sharding import AVOIDED_COLLECTIVES

pytestmark = needs_8_cpus


_NAMES = ("query", "k_cache", "v_cache", "cache_seqlens", "k_new", "v_new", "block_table")


def _call(query, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, *, num_splits):
    return jflash.flash_attention_with_kvcache(
        query, k_cache, v_cache, cache_seqlens=cache_seqlens, k_new=k_new, v_new=v_new,
        block_table=block_table, return_lse=True, num_splits=num_splits)


def _specs(batch, heads, paged, pool=None):
    """PartitionSpecs of the _NAMES operands: batch and heads mesh axes (or None);
    pool: the spec of a paged pool (default: its kv heads sharded like heads)."""
    q = P(batch, None, heads)
    cache = (pool or P(None, None, heads)) if paged else P(batch, None, heads)
    return dict(query=q, k_cache=cache, v_cache=cache, cache_seqlens=P(batch),
                k_new=P(batch, None, heads), v_new=P(batch, None, heads),
                block_table=P(batch))


def _put(mesh, arrays, specs):
    return {n: None if arrays[n] is None else jax.device_put(arrays[n], NamedSharding(mesh, specs[n]))
            for n in _NAMES}


def _all_gathers(text):
    """The result shapes of the all-gathers in optimized HLO text."""
    return re.findall(r"= \S*?\[([\d,]*)\][^ ]* all-gather(?:-start)?\(", text)


def _collectives(text):
    return [c for c in AVOIDED_COLLECTIVES if c in text]


def _run(case, specs, rng, mesh=None, num_splits=2, donate=False):
    """(sharded results, unsharded results, optimized HLO text, inputs)."""
    mesh = mesh or _mesh()
    arrays = make_inputs(rng, case)
    arrays.setdefault("k_new", None)
    arrays.setdefault("v_new", None)
    want = _call(*(arrays[n] for n in _NAMES), num_splits=num_splits)
    sharded = _put(mesh, arrays, specs)
    fn = jax.jit(lambda *a: _call(*a, num_splits=num_splits),
                 donate_argnums=(1, 2) if donate else ())
    args = [sharded[n] for n in _NAMES]
    text = fn.lower(*args).compile().as_text()
    return fn(*args), want, text, arrays


def _spec3(x):
    """The first three entries of an array's PartitionSpec, padded with None."""
    return (*tuple(x.sharding.spec), None, None, None)[:3]


def _assert_same(got, want):
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


PARTITIONED = {
    # name: (case keywords, batch axes, heads axes)
    "batch": (dict(), ("data", "model"), None),
    "kv heads": (dict(heads=16, heads_kv=4), None, "model"),
    "batch+kv heads": (dict(heads=16, heads_kv=4), "data", "model"),
    "batch+kv heads mha": (dict(heads=4, heads_kv=4), "data", "model"),
    "batch+kv heads, seq_q 3": (dict(heads=16, heads_kv=4, seq_q=3), "data", "model"),
}


@pytest.mark.parametrize("append", [False, True], ids=["read", "append"])
@pytest.mark.parametrize("case", PARTITIONED, ids=str)
def test_contiguous_partitions_without_collectives(rng, case, append):
    kw, batch, heads = PARTITIONED[case]
    c = Case(seqlens=(37, 0, 120, 64, 5, 127, 90, 1), capacity=128, head_dim=64,
             dtype="float32", seq_new=kw.get("seq_q", 1) if append else 0, **kw)
    specs = _specs(batch, heads, paged=False)
    got, want, text, arrays = _run(c, specs, rng)
    assert _collectives(text) == []
    _assert_same(got, want)
    assert _spec3(got[0]) == (batch, None, heads)
    if append:
        _, _, true_k, true_v = truth(c, arrays)
        np.testing.assert_array_equal(np.asarray(got[2]), true_k)
        assert _spec3(got[2]) == (batch, None, heads)


@pytest.mark.parametrize("append", [False, True], ids=["read", "append"])
def test_paged_pool_sharded_over_kv_heads(rng, append):
    """Tensor parallelism: the pool's kv heads follow the query heads; the append
    stays in the kernel, nothing is gathered."""
    c = Case(seqlens=(37, 0, 120, 64), capacity=128, block_size=16, heads=16, heads_kv=4,
             head_dim=64, dtype="float32", seq_new=append * 2, seq_q=2)
    got, want, text, _ = _run(c, _specs(None, "model", paged=True), rng)
    assert _collectives(text) == []
    _assert_same(got, want)


def test_paged_batch_sharded_reads_a_replicated_pool(rng):
    c = Case(seqlens=(37, 0, 120, 64, 5, 127, 90, 1), capacity=128, block_size=16,
             head_dim=64, dtype="float32")
    specs = _specs(("data", "model"), None, paged=True, pool=P())
    got, want, text, _ = _run(c, specs, rng)
    assert _collectives(text) == []
    _assert_same(got, want)


@pytest.mark.parametrize("heads", [None, "model"], ids=["batch", "batch+kv heads"])
def test_paged_batch_sharded_append_gathers_only_the_new_rows(rng, heads):
    """Every device's copy of the pool takes every sequence's new rows: the
    all-gathers are of the append's small operands, none of the pool."""
    c = Case(seqlens=(37, 0, 120, 64, 5, 127, 90, 1), capacity=128, block_size=16,
             heads=16, heads_kv=4, head_dim=64, dtype="float32", seq_new=2, seq_q=2)
    batch = "data" if heads else ("data", "model")
    specs = _specs(batch, heads, paged=True,
                   pool=P(None, None, heads) if heads else P())
    got, want, text, arrays = _run(c, specs, rng, donate=True)
    pool = arrays["k_cache"].shape
    gathered = [tuple(int(x) for x in s.split(",") if x) for s in _all_gathers(text)]
    assert gathered, "the append's operands are all-gathered over the batch axes"
    for shape in gathered:
        assert len(shape) < 4 or shape[0] == c.batch, shape  # k_new, v_new: [batch, ...]
        assert shape[:2] != pool[:2]
    assert "all-to-all" not in text and "collective-permute" not in text
    _assert_same(got, want)


def test_donated_sharded_cache_is_aliased(rng):
    """The cache results alias the donated cache operands in the partitioned
    program, as without sharding: the step updates the cache in place."""
    c = Case(seqlens=(30, 90, 7, 100), capacity=128, heads=16, heads_kv=4, head_dim=64,
             dtype="float32", seq_new=1)
    got, want, text, arrays = _run(c, _specs("data", "model", paged=False), rng, donate=True)
    assert _collectives(text) == []
    # The program's cache results are its donated cache parameters (1, 2), and
    # the kernel's cache results its cache operands.
    assert "input_output_alias={ {2}: (1, {}, may-alias), {3}: (2, {}, may-alias) }" in text
    call = next(line for line in text.splitlines() if "jflash_decode_append_v1" in line)
    assert "output_to_operand_aliasing={{2}: (1, {}), {3}: (2, {})}" in call
    local = f"f32[{c.batch // 2},128,1,64]"
    assert f"copy({local}" not in text.replace(" ", ""), "no copy of a cache shard"
    _assert_same(got, want)


def test_mqa_query_heads_split_over_one_kv_head(rng):
    """MQA: query heads shard while the one kv head stays replicated; every
    device appends the same rows to its copy of the cache."""
    c = Case(seqlens=(37, 0, 120, 64), capacity=128, heads=8, heads_kv=1, head_dim=64,
             dtype="float32", seq_new=1)
    specs = _specs("data", None, paged=False) | dict(query=P("data", None, "model"))
    got, want, text, _ = _run(c, specs, rng)
    assert _collectives(text) == []
    _assert_same(got, want)


def test_cache_length_sharded_is_gathered_and_correct(rng):
    """A cache sharded along its length (no context-parallel decode) is gathered:
    correct, not partitioned along it."""
    c = Case(seqlens=(37, 0, 120, 64), capacity=128, heads=8, heads_kv=2, head_dim=64,
             dtype="float32", seq_new=1)
    specs = _specs("data", None, paged=False) | dict(k_cache=P("data", "model"),
                                                     v_cache=P("data", "model"))
    got, want, _, _ = _run(c, specs, rng)
    _assert_same(got, want)


def test_heuristic_splits_of_the_local_batch(rng):
    """num_splits=None: each device picks the split count of its own shard, so the
    results equal the unsharded call's up to the order of the split sums."""
    c = Case(seqlens=(300, 0, 511, 64, 5, 200, 90, 1), capacity=512, head_dim=64,
             dtype="float32", seq_new=1)
    got, want, text, _ = _run(c, _specs(("data", "model"), None, paged=False), rng,
                              num_splits=None)
    assert _collectives(text) == []
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("set_mesh", [False, True], ids=["arrays only", "jax.set_mesh"])
def test_explicit_axes_and_bfloat16(rng, set_mesh):
    """jax.make_mesh's default (Explicit) axes, with and without the mesh set as
    context (then the results carry sharded types), bfloat16."""
    c = Case(seqlens=(37, 0, 120, 64), capacity=128, heads=16, heads_kv=4, head_dim=64,
             seq_new=1)
    mesh = _mesh(AxisType.Explicit)
    specs = _specs("data", "model", paged=False)
    if set_mesh:
        with jax.set_mesh(mesh):
            got, want, text, _ = _run(c, specs, rng, mesh=mesh)
            assert (*jax.typeof(got[0]).sharding.spec, None)[:3] == ("data", None, "model")
    else:
        got, want, text, _ = _run(c, specs, rng, mesh=mesh)
    assert _collectives(text) == []
    _assert_same(got, want)


@pytest.mark.parametrize("vmapped,batch", [(None, "data"), ("data", None)])
def test_vmap_of_sharded_call(rng, vmapped, batch):
    """jax.vmap over a leading axis: folded into one call (each slice's cache its
    own), still partitioned over the vmapped axis or the batch, and the kv
    heads, with no collectives."""
    c = Case(seqlens=(37, 0, 120, 64), capacity=128, heads=16, heads_kv=4, head_dim=64,
             dtype="float32", seq_new=1)
    slices = [make_inputs(rng, c) for _ in range(2)]
    names = [n for n in _NAMES if n != "block_table"]
    stacked = [jnp.stack([s[n] for s in slices]) for n in names]
    mesh = _mesh()
    specs = _specs(batch, "model", paged=False)
    args = [jax.device_put(x, NamedSharding(mesh, P(vmapped, *specs[n])))
            for x, n in zip(stacked, names, strict=True)]

    def call(*a):
        return _call(*a, None, num_splits=2)

    fn = jax.jit(jax.vmap(call))
    assert "scan[" not in str(jax.make_jaxpr(fn)(*args))
    assert _collectives(fn.lower(*args).compile().as_text()) == []
    got = fn(*args)
    for i, s in enumerate(slices):
        _assert_same([x[i] for x in got], call(*(s[n] for n in names)))


def test_inside_shard_map(rng):
    """Per-device calls under jax.shard_map (manual axes, check_vma): each device's
    own sequences and cache, results typed as varying."""
    c = Case(seqlens=(37, 0, 120, 64, 5, 127, 90, 1), capacity=128, heads=8, heads_kv=2,
             head_dim=64, dtype="float32", seq_new=1)
    arrays = make_inputs(rng, c)
    names = [n for n in _NAMES if n != "block_table"]
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,), devices=_HOST_CPUS)

    def call(*a):
        return _call(*a, None, num_splits=3)

    fn = jax.jit(jax.shard_map(call, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    _assert_same(fn(*(arrays[n] for n in names)), call(*(arrays[n] for n in names)))

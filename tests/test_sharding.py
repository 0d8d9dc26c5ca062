"""jflash under sharding: jit with NamedSharding, shard_map and pmap, 8 CPU devices.

Batch- and heads-sharded operands must partition the forward and backward
custom calls with no all-gather, all-to-all or collective-permute in the
optimized HLO; every sharded result must equal the unsharded call. Sequence
sharding runs context-parallel (tests/test_context_parallel.py has its checks);
the cases here only check that it stays correct beside the other shardings.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jflash
from host_mesh import HOST_CPUS as _HOST_CPUS
from host_mesh import mesh as _mesh
from host_mesh import needs_8_cpus, on_host_cpus  # noqa: F401 (autouse fixture)
from jflash._src.sharding import AVOIDED_COLLECTIVES

pytestmark = needs_8_cpus


def _qkv(rng, batch=4, seq=32, heads=8, heads_kv=8, head_dim=32, dtype=jnp.float32):
    def draw(*shape):
        return jnp.asarray(rng.standard_normal(shape), dtype)

    q = draw(batch, seq, heads, head_dim)
    k, v = draw(batch, seq, heads_kv, head_dim), draw(batch, seq, heads_kv, head_dim)
    return q, k, v, draw(*q.shape)


def _attention(q, k, v):
    return jflash.flash_attention(q, k, v, causal=True)


def _loss(q, k, v, dout):
    return jnp.sum(_attention(q, k, v).astype(jnp.float32) * dout.astype(jnp.float32))


_grads = jax.grad(_loss, argnums=(0, 1, 2))


def _collectives(compiled):
    text = compiled.as_text()
    return [c for c in AVOIDED_COLLECTIVES if c in text]


def _run_sharded(mesh, q_spec, kv_spec, q, k, v, dout):
    """(out, grads, collectives of the forward, of the backward) on sharded inputs."""
    specs = (q_spec, kv_spec, kv_spec, q_spec)
    args = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip((q, k, v, dout), specs)]
    fwd = jax.jit(_attention).lower(*args[:3]).compile()
    bwd = jax.jit(_grads).lower(*args).compile()
    return fwd(*args[:3]), bwd(*args), _collectives(fwd), _collectives(bwd)


def _assert_equal_trees(got, want, tol=1e-6):
    jax.tree.map(
        lambda g, w: np.testing.assert_allclose(
            np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=tol, atol=tol
        ),
        got,
        want,
    )


PARTITIONED = {
    "batch": (P("data"), P("data"), 8),
    "heads": (P(None, None, "model"), P(None, None, "model"), 8),
    "batch+heads": (P("data", None, "model"), P("data", None, "model"), 8),
    "batch+heads gqa": (P("data", None, "model"), P("data", None, "model"), 4),
    "all devices on batch": (P(("data", "model")), P(("data", "model")), 2),
}


@pytest.mark.parametrize("case", PARTITIONED, ids=str)
def test_batch_and_heads_partition_without_collectives(rng, case):
    q_spec, kv_spec, heads_kv = PARTITIONED[case]
    batch = 8 if case == "all devices on batch" else 4
    q, k, v, dout = _qkv(rng, batch=batch, heads_kv=heads_kv)
    want_out, want_grads = _attention(q, k, v), _grads(q, k, v, dout)
    out, grads, fwd_collectives, bwd_collectives = _run_sharded(
        _mesh(), q_spec, kv_spec, q, k, v, dout
    )
    assert fwd_collectives == [] and bwd_collectives == []
    def padded(spec):
        return (*spec, None, None, None, None)[:4]

    assert padded(out.sharding.spec) == padded(q_spec)
    _assert_equal_trees(out, want_out)
    _assert_equal_trees(grads, want_grads)


@pytest.mark.parametrize("set_mesh", [False, True], ids=["arrays only", "jax.set_mesh"])
def test_explicit_axes_and_bfloat16(rng, set_mesh):
    """jax.make_mesh's default (Explicit) axes, with and without the mesh set as
    context (then results carry sharded types), bfloat16 (no platform_dependent)."""
    q, k, v, dout = _qkv(rng, heads_kv=4, dtype=jnp.bfloat16)
    spec = P("data", None, "model")
    mesh = _mesh(AxisType.Explicit)
    with jax.set_mesh(mesh) if set_mesh else contextlib.nullcontext():
        out, grads, fwd_collectives, bwd_collectives = _run_sharded(
            mesh, spec, spec, q, k, v, dout
        )
    assert fwd_collectives == [] and bwd_collectives == []
    if set_mesh:
        assert jax.typeof(out).sharding.spec == P("data", None, "model", None)
    _assert_equal_trees(out, _attention(q, k, v))
    _assert_equal_trees(grads, _grads(q, k, v, dout))


def test_mqa_heads_sharded(rng):
    """MQA: the single kv head stays replicated while query heads shard; in the
    backward each device's dk, dv cover its own query heads and are summed
    across devices (an all-reduce, in float32), so the order of the sum differs
    from the unsharded call's."""
    q, k, v, dout = _qkv(rng, heads_kv=1)
    out, grads, fwd_collectives, bwd_collectives = _run_sharded(
        _mesh(), P("data", None, "model"), P("data"), q, k, v, dout
    )
    assert fwd_collectives == [] and bwd_collectives == []
    _assert_equal_trees(out, _attention(q, k, v))
    for got, want in zip(grads, _grads(q, k, v, dout)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))


GATHERED = {
    # Sequence shards run context-parallel (k is sharded like q when it is not).
    "sequence": (P(None, "model"), P(None, "model"), 4),
    "sequence of q only": (P("data", "model"), P("data"), 4),
    # 2 kv heads cannot follow 8 query heads over 4 devices (Shardy splits the
    # axis into sub-axes): heads are gathered, batch stays sharded.
    "heads over more devices than kv heads": (P("data", None, "model"), P("data"), 2),
}


@pytest.mark.parametrize("case", GATHERED, ids=str)
def test_gathering_shardings_are_correct(rng, case):
    q_spec, kv_spec, heads_kv = GATHERED[case]
    q, k, v, dout = _qkv(rng, heads_kv=heads_kv)
    out, grads, _, _ = _run_sharded(_mesh(), q_spec, kv_spec, q, k, v, dout)
    # Context parallelism merges partial rows through their lse: equal up to
    # float32 rounding, not bit for bit.
    tol = 1e-5 if case.startswith("sequence") else 1e-6
    _assert_equal_trees(out, _attention(q, k, v), tol)
    _assert_equal_trees(grads, _grads(q, k, v, dout), tol)


@pytest.mark.parametrize("case", ["batch+heads", "sequence"])
def test_segment_ids_sharded(rng, case):
    """Segment ids sharded like the batch: a batch- and heads-sharded call stays
    partitioned with no collective; a sequence-sharded one (no context-parallel
    form with segment ids) is gathered, and equal all the same."""
    q, k, v, dout = _qkv(rng, heads_kv=4)
    ids = jnp.asarray(rng.integers(0, 3, q.shape[:2]), jnp.int32)
    spec = P("data", None, "model") if case == "batch+heads" else P("data", "model")
    ids_spec = P("data") if case == "batch+heads" else P("data", "model")

    def attend(q, k, v, ids):
        return jflash.flash_attention(q, k, v, causal=True, q_segment_ids=ids, kv_segment_ids=ids)

    def loss(q, k, v, ids, dout):
        return jnp.sum(attend(q, k, v, ids) * dout)

    grads = jax.grad(loss, argnums=(0, 1, 2))
    mesh = _mesh()
    args = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)]
    args.append(jax.device_put(ids, NamedSharding(mesh, ids_spec)))
    dout_sharded = jax.device_put(dout, NamedSharding(mesh, spec))
    fwd = jax.jit(attend).lower(*args).compile()
    bwd = jax.jit(grads).lower(*args, dout_sharded).compile()
    if case == "batch+heads":
        assert _collectives(fwd) == [] and _collectives(bwd) == []
    _assert_equal_trees(fwd(*args), attend(q, k, v, ids))
    _assert_equal_trees(bwd(*args, dout_sharded), grads(q, k, v, ids, dout))


def test_vmap_of_sharded_call(rng):
    """jax.vmap over a sharded leading axis: still partitioned, still exact."""
    q, k, v, dout = _qkv(rng, batch=2, heads_kv=4)
    stack = [jnp.stack([x, x[::-1]]) for x in (q, k, v, dout)]  # leading axis of 2
    spec = P("data", None, None, "model")
    mesh = _mesh()
    args = [jax.device_put(x, NamedSharding(mesh, spec)) for x in stack]
    vmapped = jax.jit(jax.vmap(_grads)).lower(*args).compile()
    assert _collectives(vmapped) == []
    want = jax.vmap(_grads)(*stack)
    _assert_equal_trees(vmapped(*args), want)


def _tiny_model(params, x):
    """One attention layer: x [batch, seq, features] -> [batch, seq, features]."""
    batch, seq, _ = x.shape
    heads, head_dim = 4, 16

    def project(w):
        return (x @ w).reshape(batch, seq, -1, head_dim)

    q, k, v = project(params["wq"]), project(params["wk"]), project(params["wv"])
    assert q.shape[2] == heads
    out = jflash.dot_product_attention(q, k, v, is_causal=True)
    return out.reshape(batch, seq, -1) @ params["wo"]


def _model_loss(params, x, y):
    return jnp.mean((_tiny_model(params, x) - y) ** 2)


def _model_inputs(rng, batch=16, seq=24, features=32):
    def draw(*shape, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)

    params = dict(
        wq=draw(features, 64, scale=0.2),
        wk=draw(features, 32, scale=0.2),  # 2 kv heads: GQA
        wv=draw(features, 32, scale=0.2),
        wo=draw(64, features, scale=0.2),
    )
    return params, draw(batch, seq, features), draw(batch, seq, features)


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no-vma"])
def test_shard_map_data_parallel_grads(rng, check_vma):
    """Training step under jax.shard_map, batch split over 8 devices. With
    check_vma, grads of the pmean'd loss are global (jax psums the cotangents of
    replicated params); without it, the classic form: local grads, then pmean."""
    params, x, y = _model_inputs(rng)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,), devices=_HOST_CPUS)

    @jax.jit
    @jax.shard_map(
        mesh=mesh,
        in_specs=(P(), P("data"), P("data")),
        out_specs=(P(), P()),
        check_vma=check_vma,
    )
    def step(params, x, y):
        if check_vma:
            return jax.value_and_grad(
                lambda p: jax.lax.pmean(_model_loss(p, x, y), "data")
            )(params)
        loss, grads = jax.value_and_grad(_model_loss)(params, x, y)
        return jax.lax.pmean(loss, "data"), jax.lax.pmean(grads, "data")

    loss, grads = step(params, x, y)
    want_loss, want_grads = jax.value_and_grad(_model_loss)(params, x, y)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    jax.tree.map(
        lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6), grads, want_grads
    )


def test_pmap_data_parallel_grads(rng):
    params, x, y = _model_inputs(rng)
    n = len(_HOST_CPUS)

    def step(params, x, y):
        loss, grads = jax.value_and_grad(_model_loss)(params, x, y)
        return jax.lax.pmean(loss, "i"), jax.lax.pmean(grads, "i")

    def split(a):
        return a.reshape(n, a.shape[0] // n, *a.shape[1:])

    replicated = jax.tree.map(lambda a: jnp.broadcast_to(a, (n, *a.shape)), params)
    loss, grads = jax.pmap(step, axis_name="i", devices=_HOST_CPUS)(replicated, split(x), split(y))
    want_loss, want_grads = jax.value_and_grad(_model_loss)(params, x, y)
    np.testing.assert_allclose(loss[0], want_loss, rtol=1e-5)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g[0], w, rtol=1e-4, atol=1e-6), grads,
                 want_grads)

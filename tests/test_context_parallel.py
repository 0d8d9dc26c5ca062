"""Context parallelism on 8 host CPU devices (tests/conftest.py creates them).

Sequence-sharded forward and gradients (of out and lse) against float64 truth
with FlashAttention's 2x rule; the ring's compiled program moves K/V with
collective-permutes, gathers nothing and keeps its temporaries at the size of
the local shard; shard_map's ring_attention; the layout helpers; errors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jflash
import reference64
from checks import assert_within_rule, plain_dtype
from dq_modes import check_dq_modes
from jflash._src import kernel_calls
from jflash.context_parallel import ring_attention, shard_sequence, unshard_sequence
from jflash.reference import attention_band as reference_band

_HOST_CPUS = jax.devices("cpu")[:8]
pytestmark = pytest.mark.skipif(len(_HOST_CPUS) < 8, reason="needs 8 host CPU devices")
SEQ_DEVICES = 4


@pytest.fixture(autouse=True)
def _on_host_cpus():
    with jax.default_device(_HOST_CPUS[0]):
        yield


def _mesh(axis_type=AxisType.Auto):
    return jax.make_mesh(
        (2, SEQ_DEVICES), ("data", "seq"), axis_types=(axis_type,) * 2, devices=_HOST_CPUS
    )


def _inputs(rng, batch=2, seq=64, heads=4, heads_kv=2, head_dim=32, dtype=jnp.float32):
    def draw(*shape, dtype=dtype):
        return jnp.asarray(rng.standard_normal(shape), dtype)

    q = draw(batch, seq, heads, head_dim)
    k, v = draw(batch, seq, heads_kv, head_dim), draw(batch, seq, heads_kv, head_dim)
    dout = draw(*q.shape)
    dlse = draw(batch, heads, seq, dtype=jnp.float32)
    return q, k, v, dout, dlse


def _out_lse_and_grads(causal):
    def run(q, k, v, dout, dlse):
        (out, lse), vjp = jax.vjp(
            lambda q, k, v: jflash.flash_attention(q, k, v, causal=causal, return_lse=True),
            q, k, v,
        )
        return (out, lse, *vjp((dout, dlse)))

    return run


def _layout(layout, n):
    if layout == "zigzag":
        return jflash.sequence_layout("zigzag", n)
    return jflash.sequence_layout("contiguous")


def _unshard(results, n, axes):
    """Results of a sharded call in token order, reordered on the host: reordering
    a sharded array runs programs with collectives, and several of those in
    flight at once can deadlock XLA:CPU's in-process collectives on a machine
    of few cores (seen on 2: one device never reached a collective-permute
    while the host threads waited in other programs)."""
    return [unshard_sequence(np.asarray(x), n, a) for x, a in zip(results, axes)]


def _sharded(fn, args, specs, mesh, strategy, layout):
    """Compiled fn on args put in layout and sharded by specs; results back in
    token order."""
    n = mesh.shape["seq"]
    seq_axes = (1, 1, 1, 1, 2)  # q, k, v, dout [b s h d]; dlse [b h s]
    if layout == "zigzag":
        args = [shard_sequence(x, n, a) for x, a in zip(args, seq_axes)]
    args = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs)]
    with jflash.context_parallel_strategy(strategy), _layout(layout, n):
        compiled = jax.jit(fn).lower(*args).compile()
    results = compiled(*args)
    if layout == "zigzag":  # out, lse, dq, dk, dv
        results = _unshard(results, n, (1, 2, 1, 1, 1))
    return results, compiled


def _check_against_truth(results, q, k, v, dout, dlse, causal, dtype):
    seq, head_dim = q.shape[1], q.shape[3]
    scale = head_dim**-0.5
    lo, hi = -seq, 0 if causal else seq
    f64 = [np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v, dout)]
    truth_out, truth_lse, _ = reference64.forward(*f64[:3], scale, lo, hi)
    truth_grads = reference64.backward(*f64, np.asarray(dlse, np.float64), scale, lo, hi)

    def plain_fn(q, k, v):
        return reference_band(q, k, v, softmax_scale=scale, diag_lo=lo, diag_hi=hi,
                              dtype=plain_dtype(dtype))

    (plain_out, plain_lse), vjp = jax.vjp(plain_fn, q, k, v)
    plain_grads = vjp((dout, dlse))
    out, lse, *grads = results
    assert out.dtype == q.dtype and lse.dtype == jnp.float32
    assert_within_rule("out", out, plain_out, truth_out, dtype)
    assert_within_rule("lse", lse, plain_lse, truth_lse, dtype)
    for name, got, plain, truth in zip(("dq", "dk", "dv"), grads, plain_grads, truth_grads):
        assert got.shape == plain.shape and got.dtype == q.dtype
        assert_within_rule(name, got, plain, truth, dtype)


def _hlo_collectives(compiled):
    text = compiled.as_text()
    return {c: text.count(f"{c}(") + text.count(f"{c}-start(") for c in
            ("collective-permute", "all-gather", "reduce-scatter", "all-reduce")}


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_sequence_sharded_matches_truth(rng, strategy, layout, causal):
    """Batch over "data", sequence over "seq" (4 devices), GQA (4 query heads
    over 2 kv heads): forward and the gradients of out and lse."""
    q, k, v, dout, dlse = _inputs(rng)
    spec, row_spec = P("data", "seq"), P("data", None, "seq")
    results, compiled = _sharded(
        _out_lse_and_grads(causal), (q, k, v, dout, dlse), (spec,) * 4 + (row_spec,),
        _mesh(), strategy, layout,
    )
    _check_against_truth(results, q, k, v, dout, dlse, causal, jnp.float32)
    collectives = _hlo_collectives(compiled)
    if strategy == "ring":
        assert collectives["collective-permute"] > 0
        assert collectives["all-gather"] == 0
    else:
        assert collectives["all-gather"] > 0


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_bfloat16_gqa_heads_and_sequence(rng, strategy):
    """bfloat16, 8 query heads over 2 kv heads sharded over "data", the
    sequence (zigzag) over "seq": partial rows are merged in float32."""
    q, k, v, dout, dlse = _inputs(rng, batch=1, heads=8, heads_kv=2, dtype=jnp.bfloat16)
    spec, row_spec = P(None, "seq", "data"), P(None, "data", "seq")
    results, compiled = _sharded(
        _out_lse_and_grads(True), (q, k, v, dout, dlse), (spec,) * 4 + (row_spec,),
        _mesh(), strategy, "zigzag",
    )
    _check_against_truth(results, q, k, v, dout, dlse, True, jnp.bfloat16)
    if strategy == "ring":
        assert _hlo_collectives(compiled)["all-gather"] == 0


def test_ring_memory_stays_at_the_local_shard(rng):
    """The ring's per-device temporaries stay a small multiple of its own
    shard, below the whole sequence's K and V, which the all-gather holds."""
    seq, heads, head_dim = 1024, 2, 64  # a float32 kernel head dim: no padded copies
    q, k, v, dout, dlse = _inputs(rng, batch=1, seq=seq, heads=heads, heads_kv=heads,
                                  head_dim=head_dim)
    mesh = jax.make_mesh((8,), ("seq",), axis_types=(AxisType.Auto,), devices=_HOST_CPUS)
    spec, row_spec = P(None, "seq"), P(None, None, "seq")
    temps = {}
    for strategy in ("ring", "all_gather"):
        _, compiled = _sharded(_out_lse_and_grads(True), (q, k, v, dout, dlse),
                               (spec,) * 4 + (row_spec,), mesh, strategy, "zigzag")
        temps[strategy] = compiled.memory_analysis().temp_size_in_bytes
    shard_bytes = q.nbytes // 8  # one device's block of q (= of k, v, dout)
    whole_kv_bytes = k.nbytes + v.nbytes
    # Whatever the ring's length: two K/V blocks in flight, float32 accumulators.
    assert temps["ring"] <= 12 * shard_bytes < whole_kv_bytes, temps
    assert whole_kv_bytes <= temps["all_gather"], temps


def test_auto_strategy_heuristic(rng):
    choose = jflash.context_parallel.choose_strategy
    assert choose("auto", 2, 8, 8) == "all_gather"  # short ring
    assert choose("auto", 2, 8, 8, keys_per_device=131072) == "all_gather"
    assert choose("auto", 2, 8, 8, keys_per_device=262144) == "ring"  # long blocks: ring
    assert choose("auto", 2, 16, 2, keys_per_device=262144) == "all_gather"  # few kv heads
    assert choose("auto", 4, 8, 8) == "all_gather"  # up to 4 devices, short blocks
    assert choose("auto", 4, 8, 8, keys_per_device=262144) == "ring"
    assert choose("auto", 8, 8, 8) == "ring"  # past 4 devices
    assert choose("auto", 8, 32, 2) == "all_gather"  # few kv heads: K/V smaller than q
    assert choose("ring", 2, 16, 1) == "ring"
    # Under jit, 4 sequence devices: short blocks -> all-gather, unless the
    # strategy says ring.
    mesh = _mesh()
    q, k, v, _, _ = _inputs(rng, batch=1, seq=32, heads=4, heads_kv=4)
    args = [jax.device_put(x, NamedSharding(mesh, P(None, "seq"))) for x in (q, k, v)]
    fn = lambda q, k, v: jflash.flash_attention(q, k, v, causal=True)  # noqa: E731
    for strategy, want in (("auto", "all-gather"), ("ring", "collective-permute")):
        with jflash.context_parallel_strategy(strategy):
            collectives = _hlo_collectives(jax.jit(fn).lower(*args).compile())
        assert collectives[want] > 0, (strategy, collectives)


def test_explicit_axes_dot_product_attention(rng):
    """jax.set_mesh with Explicit axes and the jax.nn drop-in (top-left causal):
    results typed sequence-sharded, equal to the unsharded call."""
    q, k, v, _, _ = _inputs(rng, seq=32)
    mesh = _mesh(AxisType.Explicit)

    def attend(q, k, v):
        return jflash.dot_product_attention(q, k, v, is_causal=True)

    want = attend(q, k, v)
    with jax.set_mesh(mesh):
        args = [jax.device_put(x, P("data", "seq")) for x in (q, k, v)]
        out = jax.jit(attend)(*args)
        assert jax.typeof(out).sharding.spec[:2] == ("data", "seq")
        grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v) ** 2),
                                 argnums=(0, 1, 2)))(*args)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)
    want_grads = jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v) ** 2), argnums=(0, 1, 2))(q, k, v)
    for got, w in zip(grads, want_grads):
        np.testing.assert_allclose(np.asarray(got), np.asarray(w), rtol=1e-4, atol=1e-4)


def test_zigzag_layout_without_matching_sharding(rng):
    """A zigzag sequence that is not sharded over its axis size (here: not at
    all) still gets the causal mask of true positions."""
    q, k, v, dout, dlse = _inputs(rng, batch=1, seq=32)
    run = _out_lse_and_grads(True)
    want = run(q, k, v, dout, dlse)
    zig = [shard_sequence(x, SEQ_DEVICES, a) for x, a in zip((q, k, v, dout, dlse), (1, 1, 1, 1, 2))]
    with jflash.sequence_layout("zigzag", SEQ_DEVICES):
        got = jax.jit(run)(*zig)
    got = _unshard(got, SEQ_DEVICES, (1, 2, 1, 1, 1))
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)


def test_zigzag_layout_with_segment_ids(rng):
    """Segment ids in the zigzag layout of q and k: masked by their documents at
    the tokens' true positions, the same as the call in token order."""
    q, k, v, dout, _ = _inputs(rng, batch=1, seq=32)
    ids = jnp.asarray(np.repeat(np.arange(4), [3, 13, 1, 15])[None], jnp.int32)

    def run(q, k, v, ids, dout):
        def loss(q, k, v):
            out = jflash.flash_attention(q, k, v, causal=True, q_segment_ids=ids,
                                         kv_segment_ids=ids)
            return jnp.sum(out * dout), out

        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return (out, *grads)

    want = run(q, k, v, ids, dout)
    zig = [shard_sequence(x, SEQ_DEVICES, 1) for x in (q, k, v, ids, dout)]
    with jflash.sequence_layout("zigzag", SEQ_DEVICES):
        got = jax.jit(run)(*zig)
    for g, w in zip(_unshard(got, SEQ_DEVICES, (1,) * len(got)), want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_ring_attention_in_shard_map(rng, layout):
    """ring_attention inside jax.shard_map (check_vma), GQA, with lse gradients."""
    q, k, v, dout, dlse = _inputs(rng, batch=1, seq=32, heads=4, heads_kv=1, head_dim=40)  # 40: padded to 64
    mesh = jax.make_mesh((8,), ("seq",), axis_types=(AxisType.Auto,), devices=_HOST_CPUS)

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(P(None, "seq"),) * 4 + (P(None, None, "seq"),),
                   out_specs=(P(None, "seq"), P(None, None, "seq")) + (P(None, "seq"),) * 3)
    def run(q, k, v, dout, dlse):
        (out, lse), vjp = jax.vjp(
            lambda q, k, v: ring_attention(q, k, v, axis_name="seq", causal=True,
                                           layout=layout, return_lse=True),
            q, k, v,
        )
        return (out, lse, *vjp((dout, dlse)))

    args = (q, k, v, dout, dlse)
    if layout == "zigzag":
        args = [shard_sequence(x, 8, a) for x, a in zip(args, (1, 1, 1, 1, 2))]
    results = run(*args)
    if layout == "zigzag":
        results = _unshard(results, 8, (1, 2, 1, 1, 1))
    _check_against_truth(results, q, k, v, dout, dlse, True, jnp.float32)


def test_shard_and_unshard_sequence(rng):
    x = jnp.asarray(rng.standard_normal((2, 16, 3)), jnp.float32)
    y = shard_sequence(x, 4)
    # device i of 4 holds chunks i and 7 - i of 8 (2 tokens each)
    np.testing.assert_array_equal(np.asarray(y[:, 2:4]), np.asarray(x[:, 14:16]))
    np.testing.assert_array_equal(np.asarray(y[:, 4:6]), np.asarray(x[:, 2:4]))
    np.testing.assert_array_equal(np.asarray(unshard_sequence(y, 4)), np.asarray(x))
    z = shard_sequence(x, 2, seq_axis=-2)
    np.testing.assert_array_equal(np.asarray(unshard_sequence(z, 2, seq_axis=1)), np.asarray(x))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=str)
def test_ring_dq_modes_add_up(rng, dtype):
    """The CPU kernel's dq modes, which the ring's steps use (tests/dq_modes.py):
    the kept float32 sum, the delta it returns, and a call that adds into it
    at a row offset, bit for bit against the plain calls' sums."""
    check_dq_modes(rng, dtype=dtype, head_dim=64, on_cpu=True, exact=True)


def test_dq_mode_arguments_are_checked(rng):
    q, k, v, dout, dlse = _inputs(rng, batch=1, seq=16, heads=2, heads_kv=2, head_dim=32)
    call = kernel_calls.bwd_band_call(1.0, on_cpu=True)
    out, lse = kernel_calls._fwd_ffi(q, k, v, softmax_scale=1.0, diag_lo=-16, diag_hi=16)
    dkv = call.dkv_zeros(k)
    accum, dkv, delta = call.start(q, k, v, out, dout, lse, dlse, -16, 16, dkv)
    with pytest.raises(Exception, match="dq_accum_row_offset"):  # 8 rows from row 9 of 16
        jax.block_until_ready(call.add(accum, 9, dkv, q[:, :8], k, v, dout[:, :8],
                                       lse[..., :8], delta[..., :8], -16, 16))
    with pytest.raises(ValueError, match="DQ_ADD_TO_ACCUM"):
        kernel_calls._bwd_ffi(q, k, v, out, dout, lse, dlse, softmax_scale=1.0, diag_lo=-16,
                              diag_hi=16, on_cpu=True, row_offset=3)
    # dK, dV sums with fewer rows than the call's keys, or not float32.
    for bad in (dkv[:, :, :15], dkv.astype(jnp.bfloat16), dkv[:, :1]):
        with pytest.raises(ValueError, match="dkv_accum must be float32"):
            call.add(accum, 0, bad, q, k, v, dout, lse, delta, -16, 16)


def test_errors(rng):
    x = jnp.asarray(rng.standard_normal((2, 12, 3)), jnp.float32)
    with pytest.raises(ValueError, match="multiple of 2 \\* axis_size"):
        shard_sequence(x, 4)
    with pytest.raises(TypeError, match="axis_size must be an int"):
        shard_sequence(x, 2.0)
    with pytest.raises(ValueError, match="seq_axis 3 out of range"):
        unshard_sequence(x, 2, seq_axis=3)
    with pytest.raises(TypeError, match="x must be an array"):
        shard_sequence([1, 2], 1)
    with pytest.raises(ValueError, match="strategy must be one of"):
        with jflash.context_parallel_strategy("rings"):
            pass
    with pytest.raises(ValueError, match="layout must be one of"):
        with jflash.sequence_layout("zig"):
            pass
    with pytest.raises(TypeError, match="axis_size must be an int"):
        with jflash.sequence_layout("zigzag"):
            pass
    with pytest.raises(ValueError, match="for layout='zigzag' only"):
        with jflash.sequence_layout("contiguous", 4):
            pass
    q, k, v, _, _ = _inputs(rng, batch=1, seq=8)
    with pytest.raises(ValueError, match="inside jax.shard_map"):
        ring_attention(q, k, v, axis_name="seq")
    with pytest.raises(TypeError, match="axis_name must be"):
        ring_attention(q, k, v, axis_name=3)
    with pytest.raises(ValueError, match="layout must be one of"):
        ring_attention(q, k, v, axis_name="seq", layout="spiral")
    with pytest.raises(ValueError, match="same length"):
        ring_attention(q, k[:, :4], v[:, :4], axis_name="seq", causal=True)

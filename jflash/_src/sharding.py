"""How the forward and backward custom calls partition under jax.jit.

An FFI call is opaque to XLA's partitioner: given sharded operands it gathers
them and runs the call whole on every device. Attention is independent across
batch and heads, so each device can run the kernel on its own shard instead.
Both calls are wrapped in jax.experimental.custom_partitioning with a Shardy
sharding rule, one factor per dimension:

  forward   q [... b sq (hk g) d], k, v [... b sk hk d]
              -> out [... b sq (hk g) d], lse [... b (hk g) sq]
  backward  q, k, v, out, dout [like q], lse, dlse [like lse]
              -> dq [like q], dk, dv [like k]

Segment ids (optional trailing operands, q ids [... b sq] and kv ids [... b
sk]) are sharded like the batch. Query heads are the compound factor (hk g): kv head hk serves query heads
hk * g ... hk * g + g - 1 (GQA), so sharding heads shards q and k/v alike.
The head dim d is contracted in q.k and needs replication (Shardy gathers it
before the call). A query sequence sharded over mesh axes runs context-parallel
(context_parallel.py): k and v are sharded like q along the sequence, and the
per-device lowering is a ring of ppermutes, or an all-gather of K/V, around
kernel calls on chunk pairs, with their own band offsets. Masks or lengths that
context_parallel.make_plan does not take, and calls with segment ids, are
gathered along the sequence.
Query heads split finer than kv heads (a shard of g) work for MQA: its one kv
head stays replicated, and in the backward each device's dk, dv, which sum over
its own query heads only, are summed across devices (an all-reduce). Other
splits of g (sub-axes, see _spec) gather heads.

What custom_partitioning and ffi_call leave to this module:
  - batching: custom_partitioning_p has no vmap rule. Each partitioned call is
    wrapped in custom_vmap, whose rule moves the vmapped axis in front and calls
    the partitioned function again on the higher rank; the rules' leading "..."
    and the FFI handlers (which fold leading axes into batch) take any number of
    leading axes.
  - typing: under jax.set_mesh with Explicit axes and inside shard_map, the
    results get the sharding and varying-axes types of their operands
    (_with_auto_axes, _restore_varying_axes).
Programs with one device or only manual axes (shard_map, pmap, jax.export for
one device) never reach the partitioner: custom_partitioning lowers its body,
the plain FFI call, inline there.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from jflash._src import context_parallel as cp

# HLO collectives that a batch- or heads-sharded call must not need.
AVOIDED_COLLECTIVES = ("all-gather", "all-to-all", "collective-permute")


def _heads_factor(num_heads, num_heads_kv):
    """The query-heads factor of the rule and the factor sizes it needs."""
    if num_heads == num_heads_kv:
        return "hk", {}
    if num_heads_kv == 1:  # MQA: Shardy allows no size-1 factor in a compound
        return "g", {}
    return "(hk g)", {"g": num_heads // num_heads_kv}


def _in_rule_order(rule, factors):
    """factors sorted by first appearance in rule, the order Shardy requires."""
    order = rule.replace("(", " ").replace(")", " ").replace(",", " ").split()
    return tuple(sorted(factors, key=order.index))


def _rule(value_types, operands, results):
    """Shardy rule over q-like, kv-like and row (lse-like) tensors, e.g. operands
    ("q", "kv", "kv"), and the segment ids of q and kv where value_types has them
    past the operands; only batch and heads may stay sharded."""
    num_heads, num_heads_kv = value_types[0].shape[-2], value_types[1].shape[-2]
    h, sizes = _heads_factor(num_heads, num_heads_kv)
    spelled = {"q": f"... b sq {h} d", "kv": "... b sk hk d", "row": f"... b {h} sq",
               "q_ids": "... b sq", "kv_ids": "... b sk"}
    if len(value_types) > len(operands):
        operands = (*operands, "q_ids", "kv_ids")
    rule = ", ".join(spelled[x] for x in operands) + " -> " + ", ".join(spelled[x] for x in results)
    return rule, dict(sizes, need_replication_factors=_in_rule_order(rule, ("d",)))


_FWD_OPERANDS = ("q", "kv", "kv")
_BWD_OPERANDS = ("q", "kv", "kv", "q", "q", "row", "row")


def _fwd_rule(static, mesh, value_types, result_types):
    del static, mesh, result_types
    return _rule(value_types, _FWD_OPERANDS, ("q", "row"))


def _bwd_rule(static, mesh, value_types, result_types):
    del static, mesh, result_types
    return _rule(value_types, _BWD_OPERANDS, ("q", "kv", "kv"))


def _spec(sharding, ndim, mesh):
    """The PartitionSpec of an operand's sharding, or None when it has none.

    Shardy may split a mesh axis between factors (sub-axes, e.g. query heads
    over 4 devices with 2 kv heads), which no PartitionSpec expresses; so the
    shardings arrive undecoded (decode_shardings=False) and are parsed here.
    """
    from jax._src.sharding_impls import parse_flatten_op_sharding

    if mesh.empty:
        return None
    try:
        spec = tuple(parse_flatten_op_sharding(sharding._hlo_sharding, mesh)[0])  # noqa: SLF001
    except (ValueError, StopIteration):
        return None
    return spec + (None,) * (ndim - len(spec))


def _local_shardings(mesh, arg_shapes, static, segments=False):
    """(q-like, kv, row, segment ids) shardings for the per-device call, the mesh
    axes over which per-device dk, dv are partial sums, and the context-parallel
    Plan (or None).

    A sharded query sequence keeps its mesh axes when context_parallel.make_plan
    accepts the call (k and v are then sharded alike); otherwise, and always
    with segment ids, it is gathered.

    Only leading/batch and heads axes stay sharded, and heads only when every
    device's query heads read exactly its own kv heads: kv heads sharded like
    query heads, or MQA's single kv head replicated (then dk, dv are partial).
    Anything else replicates heads (or everything, when the shardings name no
    mesh axes), which is correct and gathers.
    """
    q, k = arg_shapes[0], arg_shapes[1]
    q_spec = _spec(q.sharding, len(q.shape), mesh)
    k_spec = _spec(k.sharding, len(k.shape), mesh)
    if q_spec is None:
        if mesh.empty:
            from jax._src.sharding_impls import GSPMDSharding

            devices = q.sharding._device_assignment  # noqa: SLF001
            return (GSPMDSharding.get_replicated(devices),) * 4, (), None
        q_spec = (None,) * len(q.shape)
    lead = q_spec[:-3]  # vmapped axes and batch
    heads = q_spec[-2]
    heads_kv = None if k_spec is None else k_spec[-2]
    mqa_split = k.shape[-2] == 1 and heads_kv is None and heads is not None
    if heads != heads_kv and not mqa_split:
        heads = heads_kv = None
    partial_axes = ()
    if mqa_split:  # the spec entry of a dim is one axis name or a tuple of them
        partial_axes = _axes(heads)

    seq, plan = q_spec[-3], None
    if seq is not None and segments:
        seq = None  # segment ids have no context-parallel form: gathered
    if seq is not None:
        seq_axes = _axes(seq)
        heads_devices = math.prod(mesh.shape[a] for a in _axes(heads)) if heads else 1
        heads_kv_devices = math.prod(mesh.shape[a] for a in _axes(heads_kv)) if heads_kv else 1
        plan = cp.make_plan(
            static["context_parallel"],
            axis_name=seq_axes[0] if len(seq_axes) == 1 else seq_axes,
            axis_size=math.prod(mesh.shape[a] for a in seq_axes),
            seqlen_q=q.shape[-3],
            seqlen_k=k.shape[-3],
            num_heads=q.shape[-2] // heads_devices,
            num_heads_kv=k.shape[-2] // heads_kv_devices,
            diag_lo=static["diag_lo"],
            diag_hi=static["diag_hi"],
        )
        if plan is None:
            seq = None

    def named(*dims):
        return NamedSharding(mesh, PartitionSpec(*lead, *dims))

    shardings = named(seq, heads, None), named(seq, heads_kv, None), named(heads, seq), named(seq)
    return shardings, partial_axes, plan


def _axes(entry):
    """The mesh axes of a PartitionSpec entry (one name or a tuple of them)."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _custom_call(call, lowering, rule, vmap_rule, result_specs):
    """call(*arrays, **static) as custom_partitioning with a custom_vmap around it.

    lowering(static, mesh, arg_shapes) -> (lower, result_shardings,
    arg_shardings): the per-device call and its shardings; rule: the Shardy
    sharding rule; vmap_rule(batched, axis_size, in_batched, arrays, static) ->
    the results of the vmapped call, every one batched; result_specs(static) maps
    the operands' full PartitionSpecs to the results' (used under Explicit mesh
    axes only)."""

    @functools.partial(custom_partitioning, static_argnums=(0,))
    def partitioned(static, *arrays):
        return call(*arrays, **dict(static))

    def partition(static, mesh, arg_shapes, result_shape):
        del result_shape
        lower, result_shardings, arg_shardings = lowering(dict(static), mesh, arg_shapes)
        return mesh, lower, result_shardings, arg_shardings

    partitioned.def_partition(partition=partition, sharding_rule=rule, decode_shardings=False)

    def custom_call(*arrays, **static):
        static = tuple(sorted(static.items()))

        @jax.custom_batching.custom_vmap
        def batched(*arrays):
            return partitioned(static, *arrays)

        @batched.def_vmap
        def _(axis_size, in_batched, *arrays):
            out = vmap_rule(batched, axis_size, in_batched, arrays, dict(static))
            return out, jax.tree.map(lambda _: True, out)

        results = _with_auto_axes(batched, arrays, result_specs(static))
        return _restore_varying_axes(arrays, results)

    return custom_call


def _vmap_folded(batched, axis_size, in_batched, arrays, static, shared=()):
    """The vmapped axis as one more leading axis of every operand (custom_vmap
    puts it first; the unbatched operands are broadcast to it, but those whose
    index is in `shared`, which every slice reads whole), for calls that fold
    it into their batch."""
    del static
    arrays = [
        a if is_batched or i in shared else jnp.broadcast_to(a, (axis_size, *a.shape))
        for i, (a, is_batched) in enumerate(zip(arrays, in_batched, strict=True))
    ]
    return batched(*arrays)


def _vmap_per_slice(batched, axis_size, in_batched, arrays, static=None):
    """One call per slice of the vmapped axis (lax.map)."""
    del axis_size, static
    mapped = [i for i, b in enumerate(in_batched) if b]

    def one(slices):
        full = list(arrays)
        for i, x in zip(mapped, slices, strict=True):
            full[i] = x
        return batched(*full)

    return jax.lax.map(one, [arrays[i] for i in mapped])


def _partitioned(call, rule, local_shardings, result_specs, band_call):
    """call(*arrays, **static) partitioned by rule and local_shardings, a
    vmapped axis folded into the batch. result_specs maps the operands' full
    PartitionSpecs to the results' specs (used under Explicit mesh axes only).
    band_call(softmax_scale, ..., softcap=..., tf32_passes=...) is the kernel on
    chunk pairs that a context-parallel lowering calls."""

    def lowering(static, mesh, arg_shapes):
        lower = functools.partial(call, **static)
        result_shardings, arg_shardings, lower = local_shardings(
            mesh, arg_shapes, lower, static, band_call
        )
        return lower, result_shardings, arg_shardings

    return _custom_call(call, lowering, rule, _vmap_folded, lambda static: result_specs)


def _with_auto_axes(fn, operands, result_specs):
    """fn(*operands), its explicit mesh axes (jax.set_mesh) made Auto for the call.

    Under Explicit axes an ffi_call's results are typed replicated, which would
    gather them and break custom_vjp's check that gradients are typed like
    their primals. Inside auto_axes the partitioner places the call by the
    rules above; the results then get the types result_specs derives from the
    operands' (moving no data when those agree with the rules).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not mesh.explicit_axes:
        return fn(*operands)
    specs = []
    for a in operands:
        spec = tuple(jax.typeof(a).sharding.spec)
        specs.append(spec + (None,) * (a.ndim - len(spec)))
    out_sharding = tuple(PartitionSpec(*spec) for spec in result_specs(specs))
    return jax.sharding.auto_axes(fn, axes=mesh.explicit_axes, out_sharding=out_sharding)(
        *operands
    )


def _restore_varying_axes(operands, results):
    """Types results as varying over every manual axis an operand varies over.

    Inside jax.shard_map (check_vma=True), ffi_call types its results as
    invariant across the manual axes even when computed from per-device
    operands, and custom_vjp then rejects gradients that differ in type from
    their primals. pcast to "varying" fixes the type and moves no data.
    """
    varying = frozenset().union(*(jax.typeof(a).manual_axis_type.varying for a in operands))
    if not varying:
        return results

    def cast(x):
        missing = varying - jax.typeof(x).manual_axis_type.varying
        return jax.lax.pcast(x, tuple(sorted(missing)), to="varying") if missing else x

    return jax.tree.map(cast, results)


def _without_mesh_context(fn):
    """fn traced with no mesh in context: a partitioned call's lowering is traced
    during compilation, possibly under jax.set_mesh (Explicit axes), where jnp
    ops would add sharding annotations that nothing partitions any more."""

    @functools.wraps(fn)
    def wrapped(*args):
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
            return fn(*args)

    return wrapped


def _fwd_shardings(mesh, arg_shapes, lower, static, band_call):
    segments = len(arg_shapes) > len(_FWD_OPERANDS)
    (q_like, kv, row, ids), _, plan = _local_shardings(mesh, arg_shapes, static, segments)
    if plan is not None:
        lower = _without_mesh_context(functools.partial(
            cp.sharded_fwd, plan=plan,
            call=band_call(static["softmax_scale"], softcap=static["softcap"],
                           tf32_passes=static["tf32_passes"]),
        ))
    return (q_like, row), (q_like, kv, kv) + (ids, ids) * segments, lower


def _bwd_shardings(mesh, arg_shapes, lower, static, band_call):
    segments = len(arg_shapes) > len(_BWD_OPERANDS)
    (q_like, kv, row, ids), partial_axes, plan = _local_shardings(mesh, arg_shapes, static,
                                                                  segments)
    if plan is not None:
        lower = _without_mesh_context(functools.partial(
            cp.sharded_bwd, plan=plan,
            call=band_call(static["softmax_scale"], on_cpu=static["on_cpu"],
                           deterministic=static["deterministic"], softcap=static["softcap"],
                           tf32_passes=static["tf32_passes"]),
        ))
    if partial_axes:
        unsummed = lower

        def lower(*operands):
            dq, dk, dv = unsummed(*operands)

            def total(x):  # summed in float32, as the kernel accumulates
                return jax.lax.psum(x.astype(jnp.float32), partial_axes).astype(x.dtype)

            return dq, total(dk), total(dv)

    args = (q_like, kv, kv, q_like, q_like, row, row) + (ids, ids) * segments
    return (q_like, kv, kv), args, lower


def _fwd_result_specs(specs):
    q = specs[0]  # [... b sq h d]
    return q, (*q[:-3], q[-2], q[-3])  # out like q; lse [... b h sq]


def _bwd_result_specs(specs):
    return specs[0], specs[1], specs[2]  # dq, dk, dv typed like q, k, v


def partitioned_fwd(call, band_call):
    """call(q, k, v, [q_ids, kv_ids,] **static) -> (out, lse), partitioned by the
    forward rule."""
    return _partitioned(call, _fwd_rule, _fwd_shardings, _fwd_result_specs, band_call)


def partitioned_bwd(call, band_call):
    """call(q, k, v, out, dout, lse, dlse, [q_ids, kv_ids,] **static) -> (dq, dk, dv),
    by the backward rule."""
    return _partitioned(call, _bwd_rule, _bwd_shardings, _bwd_result_specs, band_call)


# ------------------------------------------------------------------ decode
#
# flash_attention_with_kvcache (decode.py): one call over operands
#   q [b sq (hk g) d], k_cache, v_cache, cache_seqlens [b],
#   k_new, v_new [b sn hk d] (with an append), block_table [b nb] (paged)
#   -> out [b sq (hk g) d], lse [b (hk g) sq], k_cache, v_cache (with an append)
# where a contiguous cache is [b c hk d] and a paged one a pool [n bs hk d]
# that has no batch axis. Batch and kv heads (query heads with their group)
# stay sharded; the head dim, the cache's length and the pool's blocks are
# replicated (a cache sharded along them is gathered).
#
# A paged pool is shared by every sequence, so under batch sharding it is
# replicated and each device reads its own sequences' blocks from its copy.
# Without an append nothing moves. With one, every copy of the pool must take
# every sequence's new rows, or the copies would differ: the small operands of
# the append (k_new, v_new, cache_seqlens, block_table) are all-gathered over
# the batch axes, each device writes all the new rows into its copy (a scatter,
# in place when the pool is donated), then attends its own sequences over the
# updated pool (decode.py, gather_appends_over). Sharding the pool's kv heads
# instead (tensor parallelism) partitions the pool, and the append stays in
# the kernel.


def _decode_operand_names(append, paged):
    names = ["q", "cache", "cache", "seqlens"]
    names += ["new", "new"] if append else []
    names += ["table"] if paged else []
    return names


def _decode_rule(static, mesh, value_types, result_types):
    del mesh, result_types
    static = dict(static)
    append, paged = static["append"], static["paged"]
    h, sizes = _heads_factor(value_types[0].shape[-2], value_types[1].shape[-2])
    # Leading axes (a vmapped axis folded into the call) on everything but a
    # paged pool, which every sequence reads whole.
    cache = "n bs hk d" if paged else "... b c hk d"
    spelled = {"q": f"... b sq {h} d", "cache": cache, "seqlens": "... b",
               "new": "... b sn hk d", "table": "... b nb", "row": f"... b {h} sq"}
    results = ["q", "row"] + (["cache", "cache"] if append else [])
    rule = (", ".join(spelled[x] for x in _decode_operand_names(append, paged)) + " -> "
            + ", ".join(spelled[x] for x in results))
    return rule, dict(sizes, need_replication_factors=_in_rule_order(rule, ("d",)))


def _decode_shardings(mesh, arg_shapes, static):
    """(result shardings, operand shardings, the batch axes over which a paged
    pool's appends are gathered) of the per-device decode call."""
    append, paged = static["append"], static["paged"]
    names = _decode_operand_names(append, paged)
    results = 2 + 2 * append
    q, k = arg_shapes[0], arg_shapes[1]
    q_spec = _spec(q.sharding, len(q.shape), mesh)
    k_spec = _spec(k.sharding, len(k.shape), mesh)
    if q_spec is None and mesh.empty:
        from jax._src.sharding_impls import GSPMDSharding

        replicated = GSPMDSharding.get_replicated(q.sharding._device_assignment)  # noqa: SLF001
        return (replicated,) * results, (replicated,) * len(names), ()
    q_spec = q_spec or (None,) * len(q.shape)
    lead, batch, heads = q_spec[:-4], q_spec[-4], q_spec[-2]  # lead: folded vmapped axes
    heads_kv = None if k_spec is None else k_spec[-2]
    # MQA: query heads may split while the one kv head stays replicated (every
    # device appends the same rows to its copy of the cache).
    mqa_split = k.shape[-2] == 1 and heads_kv is None and heads is not None
    if heads != heads_kv and not mqa_split:
        heads = heads_kv = None

    def named(*dims):
        return NamedSharding(mesh, PartitionSpec(*lead, *dims))

    cache = (NamedSharding(mesh, PartitionSpec(None, None, heads_kv, None)) if paged
             else named(batch, None, heads_kv, None))
    by_name = {"q": named(batch, None, heads, None), "cache": cache, "seqlens": named(batch),
               "new": named(batch, None, heads_kv, None), "table": named(batch, None)}
    operands = tuple(by_name[x] for x in names)
    result_shardings = (by_name["q"], named(batch, heads, None)) + (cache, cache) * append
    gather = _axes(batch) if paged and append else ()
    return result_shardings, operands, gather


def _decode_result_specs(static):
    append = dict(static)["append"]

    def specs(operand_specs):
        q, cache = operand_specs[0], operand_specs[1]
        return (q, (*q[:-3], q[-2], q[-3])) + (cache, cache) * append

    return specs


def partitioned_decode(call):
    """call(*operands, append, paged, gather_appends_over=(), **static) -> (out,
    lse[, k_cache, v_cache]): the decode FFI call (decode.py), partitioned by
    the decode rule. operands: q, k_cache, v_cache, cache_seqlens[, k_new,
    v_new][, block_table]. gather_appends_over: the mesh axes over which the
    per-device lowering must all-gather a paged pool's appends (above).

    Under jax.vmap the vmapped axis becomes a leading axis of the call, which
    call folds into the batch (_vmap_decode), or the call runs once per slice.
    """

    def lowering(static, mesh, arg_shapes):
        result_shardings, arg_shardings, gather = _decode_shardings(mesh, arg_shapes, static)
        lower = _without_mesh_context(
            functools.partial(call, **static, gather_appends_over=gather))
        return lower, result_shardings, arg_shardings

    return _custom_call(call, lowering, _decode_rule, _vmap_decode, _decode_result_specs)


def _vmap_decode(batched, axis_size, in_batched, arrays, static):
    """A vmapped decode call: folded into the batch where every slice has a cache
    of its own (a contiguous cache, vmapped), or reads a shared paged pool
    without writing it; one call per slice otherwise (a contiguous cache shared
    by the slices would have to be copied for each; a shared pool written by
    each slice's append is each slice's own copy; a vmapped pool would need
    its block ids offset per slice)."""
    k_cache, v_cache = in_batched[1], in_batched[2]
    if static["paged"]:
        fold = not (static["append"] or k_cache or v_cache)
    else:
        fold = k_cache and v_cache
    if not fold:
        return _vmap_per_slice(batched, axis_size, in_batched, arrays)
    return _vmap_folded(batched, axis_size, in_batched, arrays, static,
                        shared=(1, 2) if static["paged"] else ())

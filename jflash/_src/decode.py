"""jflash.flash_attention_with_kvcache: decode attention over a KV cache.

A few query rows per sequence (one token, or a few for speculative decoding)
against a cache of keys and values, contiguous or paged, optionally after
appending new keys to it in place. The kernels (csrc/cpu/flash_decode.cc,
csrc/cuda/flash_decode_sm80.h) split each sequence's key range over several
work units where the batch alone would leave the machine idle, and combine
the splits' partial results by their lse.

Two FFI targets: jflash_decode_v1 (no append) and jflash_decode_append_v1,
whose cache results alias the cache operands (input_output_aliases), so that
under jit with donated caches XLA writes the new rows in place.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jflash._src import ffi as _ffi
from jflash._src import sharding, validation

NO_GRADIENT = (
    "jflash.flash_attention_with_kvcache has no gradient: it is an inference op (the "
    "decode kernels compute no backward). Differentiate jflash.flash_attention instead, "
    "or wrap the inputs in jax.lax.stop_gradient."
)


class DecodeConfig(NamedTuple):
    """The static part of a call (hashable: a custom_jvp nondiff argument)."""

    softmax_scale: float
    softcap: float  # 0.0: none
    window_left: int  # -1: unbounded
    window_right: int  # -1: unbounded; causal: 0
    num_splits: int | None  # None: the heuristic, per platform


def decode_window(causal, window_size):
    """(left, right) of causal and window_size, -1 for an unbounded side: the
    kernels' band aligned bottom-right to each sequence's length."""
    left, right = window_size if window_size is not None else (-1, -1)
    if causal:
        right = 0
    return left, right


class KvCacheArguments(NamedTuple):
    config: DecodeConfig
    return_lse: bool
    cache_seqlens: jax.Array  # int32 [batch]
    block_table: jax.Array | None  # int32 [batch, max_blocks_per_seq]
    capacity: int  # keys per sequence the cache holds


def resolve_kvcache_arguments(query, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table,
                              causal, window_size, softcap, softmax_scale, return_lse,
                              num_splits):
    """Validates flash_attention_with_kvcache's arguments (shared with
    jflash.reference.attention_with_kvcache)."""
    seqlens, table, capacity = validation.check_kvcache(
        query, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table)
    causal = validation.check_bool("causal", causal)
    return_lse = validation.check_bool("return_lse", return_lse)
    softmax_scale = validation.check_softmax_scale(softmax_scale, query.shape[3])
    window_size = validation.check_window_size(window_size)
    softcap = validation.check_softcap(softcap, softmax_scale)
    num_splits = validation.check_num_splits(num_splits)
    left, right = decode_window(causal, window_size)
    config = DecodeConfig(softmax_scale, softcap or 0.0, left, right, num_splits)
    return KvCacheArguments(config, return_lse, seqlens, table, capacity)


# ------------------------------------------------------------------ kernel calls

# float32 on GPU: the decode kernels are half-precision tensor-core kernels. A
# float32 cache cannot be cast for the call and back without rounding every row
# already in it, so the new rows are written in float32 here, and the kernel
# attends over a bfloat16 copy of the cache (bfloat16 precision, plus the cost
# of the copy; flash_attention has float32 kernels, decode does not).
_GPU_COMPUTE_DTYPE = jnp.bfloat16


def cache_slots(cache_seqlens, seqlen_new, capacity, block_table, block_size, num_blocks):
    """(block, row) [batch, seqlen_new] of the appended keys: at each sequence's
    length clamped to [0, capacity - seqlen_new], through the block table (its ids
    clamped to [0, num_blocks)), as the kernels write them."""
    start = jnp.clip(cache_seqlens, 0, capacity - seqlen_new)
    positions = start[:, None] + jnp.arange(seqlen_new, dtype=jnp.int32)[None, :]
    if block_table is None:
        batch = jnp.broadcast_to(jnp.arange(positions.shape[0])[:, None], positions.shape)
        return batch, positions
    blocks = jnp.take_along_axis(block_table, positions // block_size, axis=1)
    return jnp.clip(blocks, 0, num_blocks - 1), positions % block_size


def append_rows(k_cache, v_cache, k_new, v_new, cache_seqlens, block_table, capacity):
    """The caches with k_new, v_new written where the kernels write them."""
    block, row = cache_slots(cache_seqlens, k_new.shape[1], capacity, block_table,
                             k_cache.shape[1], k_cache.shape[0])
    return k_cache.at[block, row].set(k_new), v_cache.at[block, row].set(v_new)


def _ffi_decode(q, k_cache, v_cache, k_new, v_new, cache_seqlens, block_table, config,
                num_splits):
    """One decode kernel call; (out, lse, k_cache, v_cache), the caches None without
    an append."""
    batch, seqlen_q, num_heads, head_dim = q.shape
    append = k_new is not None
    split = num_splits > 1
    f32 = jnp.float32
    results = [jax.ShapeDtypeStruct(q.shape, q.dtype),
               jax.ShapeDtypeStruct((batch, num_heads, seqlen_q), f32)]
    if append:
        results += [jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                    jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)]
    # Each split's share, float32 scratch that XLA allocates (no cudaMalloc in the
    # handlers); none for one split, whose kernel writes out and lse itself.
    rows = (num_splits, batch, num_heads, seqlen_q)
    results += [jax.ShapeDtypeStruct((*rows, head_dim) if split else (0,), f32),
                jax.ShapeDtypeStruct(rows if split else (0,), f32)]
    table = block_table if block_table is not None else jnp.zeros((0,), jnp.int32)
    operands = ((q, k_cache, v_cache, k_new, v_new, cache_seqlens, table) if append
                else (q, k_cache, v_cache, cache_seqlens, table))
    call = jax.ffi.ffi_call(
        _ffi.DECODE_APPEND_TARGET if append else _ffi.DECODE_TARGET,
        results,
        # jax.vmap is handled before this call (sharding.py, _vmap_decode); a
        # vmap reaching it would be one call per slice.
        vmap_method="sequential",
        input_output_aliases={1: 2, 2: 3} if append else None,
    )
    out, lse, *rest = call(
        *operands,
        softmax_scale=np.float32(config.softmax_scale),
        softcap=np.float32(config.softcap),
        window_left=np.int64(config.window_left),
        window_right=np.int64(config.window_right),
        num_splits=np.int64(num_splits),
    )
    caches = tuple(rest[:2]) if append else (None, None)
    return (out, lse, *caches)


def _splits(config, on_cpu, q, k_cache, block_table, capacity):
    if config.num_splits is not None:
        return config.num_splits
    batch, seqlen_q, num_heads, head_dim = q.shape
    num_heads_kv = k_cache.shape[2]
    rows = num_heads // num_heads_kv * seqlen_q
    return _ffi.decode_num_splits(on_cpu, q.dtype, head_dim, batch, num_heads_kv, rows, capacity)


def _unpack(ops, append, paged):
    """(q, k_cache, v_cache, k_new, v_new, cache_seqlens, block_table) of the
    operand list, None for the absent ones."""
    q, k_cache, v_cache, seqlens, *rest = ops
    k_new, v_new = (rest[0], rest[1]) if append else (None, None)
    return q, k_cache, v_cache, k_new, v_new, seqlens, rest[-1] if paged else None


def _decode_branch(*ops, kind, config, capacity, append, paged, gather_appends_over=()):
    """(out, lse[, k_cache, v_cache]) of one device's call on one platform.

    Leading axes in front of the batch (a folded jax.vmap, sharding.py
    _vmap_decode) are merged into it, a local reshape that copies nothing; a
    paged pool has none."""
    q, k_cache, v_cache, k_new, v_new, seqlens, table = _unpack(ops, append, paged)
    lead = q.shape[:-4]
    if not lead:
        return _decode_flat(*ops, kind=kind, config=config, capacity=capacity, append=append,
                            paged=paged, gather_appends_over=gather_appends_over)

    def merged(x, trailing):
        return x.reshape(-1, *x.shape[x.ndim - trailing:])

    flat = [merged(q, 3), k_cache if paged else merged(k_cache, 3),
            v_cache if paged else merged(v_cache, 3), seqlens.reshape(-1)]
    flat += [merged(k_new, 3), merged(v_new, 3)] if append else []
    flat += [merged(table, 1)] if paged else []
    results = _decode_flat(*flat, kind=kind, config=config, capacity=capacity, append=append,
                           paged=paged, gather_appends_over=gather_appends_over)
    out, lse, *caches = results
    out = out.reshape(q.shape)
    lse = lse.reshape(*q.shape[:-3], *lse.shape[1:])
    return (out, lse, *(c.reshape(k_cache.shape) for c in caches))


def _decode_flat(*ops, kind, config, capacity, append, paged, gather_appends_over=()):
    """_decode_branch on operands without leading axes.

    kind: "cpu", "gpu" (the native kernels) or "gpu_float32" (a bfloat16 copy of
    the cache, the append done in float32 first). gather_appends_over: the mesh
    axes over which the batch of a paged call is sharded while its pool is
    replicated (sharding.py): every device writes every sequence's new rows into
    its copy of the pool, then attends its own sequences."""
    q, k_cache, v_cache, k_new, v_new, seqlens, table = _unpack(ops, append, paged)
    if append and (kind == "gpu_float32" or gather_appends_over):
        all_rows = (k_new, v_new, seqlens, table)
        if gather_appends_over:
            all_rows = [jax.lax.all_gather(x, gather_appends_over, tiled=True) for x in all_rows]
        k_cache, v_cache = append_rows(k_cache, v_cache, *all_rows, capacity)
        lengths = jnp.clip(seqlens, 0, capacity - k_new.shape[1]) + k_new.shape[1]
        out, lse = _decode_flat(q, k_cache, v_cache, lengths, *([table] if paged else []),
                                kind=kind, config=config, capacity=capacity, append=False,
                                paged=paged)
        return out, lse, k_cache, v_cache
    if kind == "gpu_float32":
        c = _GPU_COMPUTE_DTYPE
        splits = _splits(config, False, q.astype(c), k_cache, table, capacity)
        out, lse, _, _ = _ffi_decode(q.astype(c), k_cache.astype(c), v_cache.astype(c), None,
                                     None, seqlens, table, config, splits)
        return out.astype(q.dtype), lse
    splits = _splits(config, kind == "cpu", q, k_cache, table, capacity)
    results = _ffi_decode(q, k_cache, v_cache, k_new, v_new, seqlens, table, config, splits)
    return tuple(x for x in results if x is not None)


# Under jax.jit with sharded operands, each device runs the kernel on its own
# batch / kv-heads shard (sharding.py has the rule and what it gathers).
_decode_partitioned = sharding.partitioned_decode(_decode_branch)


def _decode_call(q, k_cache, v_cache, k_new, v_new, cache_seqlens, block_table, *, config,
                 capacity):
    """(out, lse, k_cache, v_cache) on whichever platform the program lowers for."""
    append = k_new is not None
    paged = block_table is not None
    operands = [q, k_cache, v_cache, cache_seqlens]
    operands += [k_new, v_new] if append else []
    operands += [block_table] if paged else []
    static = dict(config=config, capacity=capacity, append=append, paged=paged)

    def on(kind):
        return lambda *ops: tuple(_decode_partitioned(*ops, kind=kind, **static))

    gpu = "gpu_float32" if q.dtype == jnp.float32 else "gpu"
    results = jax.lax.platform_dependent(*operands, cpu=on("cpu"), default=on(gpu))
    return (*results, None, None) if not append else tuple(results)


# ------------------------------------------------------------------ the op


@functools.partial(jax.custom_jvp, nondiff_argnums=(7, 8))
def _decode(q, k_cache, v_cache, k_new, v_new, cache_seqlens, block_table, config, capacity):
    return _decode_call(q, k_cache, v_cache, k_new, v_new, cache_seqlens, block_table,
                        config=config, capacity=capacity)


@_decode.defjvp
def _decode_jvp(config, capacity, primals, tangents):
    del config, capacity, primals, tangents
    raise NotImplementedError(NO_GRADIENT)


def padded_decode_head_dim(head_dim: int) -> int:
    for d in _ffi.DECODE_HEAD_DIMS:
        if head_dim <= d:
            return d
    raise ValueError(f"head_dim {head_dim} exceeds {_ffi.DECODE_HEAD_DIMS[-1]}")


def flash_attention_with_kvcache(query, k_cache, v_cache, *, cache_seqlens, k_new=None,
                                 v_new=None, block_table=None, causal=True, window_size=None,
                                 softcap=None, softmax_scale=None, return_lse=False,
                                 num_splits=None):
    """Attention of a few new query rows per sequence over a KV cache (decoding).

    Args:
      query: [batch, seq_q, num_heads, head_dim], float16, bfloat16 or float32;
        seq_q is small (1 for decoding, a few for speculative decoding), but any
        seq_q is exact.
      k_cache, v_cache: the cache, query's dtype. Contiguous: [batch, seq_cache,
        num_heads_kv, head_dim]. Paged (with block_table): [num_blocks,
        block_size, num_heads_kv, head_dim], block_size a multiple of 16.
        num_heads must be a multiple of num_heads_kv (GQA/MQA); the query heads
        of a kv head are computed together, so each cache byte is read once.
      cache_seqlens: [batch] int32, the keys each sequence holds before the
        append. Values outside [0, capacity - seq_new] are clamped into it
        (capacity: seq_cache, or max_blocks_per_seq * block_size), so nothing
        is read or written outside the cache.
      k_new, v_new: None, or [batch, seq_new, num_heads_kv, head_dim]: keys and
        values appended at positions cache_seqlens[b] ... of each sequence,
        before attention, which covers cache_seqlens[b] + seq_new keys. The
        caches are returned with the new rows; they alias the inputs, so under
        jax.jit with the caches donated (donate_argnums) XLA writes the rows in
        place and copies nothing, and without donation the result is the same.
      block_table: None (contiguous cache), or [batch, max_blocks_per_seq] int32:
        position p of sequence b is row p % block_size of block
        block_table[b, p // block_size]. Ids outside [0, num_blocks) are clamped.
      causal: aligned bottom-right among each sequence's keys: query i of
        seq_q sees key j iff j <= i + seqlen_k - seq_q, seqlen_k =
        cache_seqlens[b] + seq_new. A row that sees no key (an empty cache, or a
        cache shorter than seq_q) gives 0 and lse -inf.
      window_size: None, or (left, right) as in flash_attention, aligned the
        same way to each sequence's length.
      softcap: None, or c > 0: scores become c * tanh(softmax_scale * q.k / c)
        before the softmax.
      softmax_scale: static scale applied to q.k; default 1/sqrt(head_dim).
      return_lse: also return lse [batch, num_heads, seq_q], float32.
      num_splits: None (a heuristic fills the GPU's SMs, or the CPU threads, by
        splitting each sequence's key range), or an int in [1, 128] that forces
        the split count. Splits are combined exactly, through their lse.

    Returns:
      out (query's shape and dtype); (out, lse) with return_lse; with k_new and
      v_new also the updated caches: (out, k_cache, v_cache) or (out, lse,
      k_cache, v_cache).

    No gradient: differentiating raises NotImplementedError. Head dims other than
    64, 128 and 256 are zero-padded up to the next of these, which copies the
    cache on every call. On GPU, float32 inputs attend at bfloat16 precision over
    a bfloat16 copy of the cache. Under jax.vmap the vmapped axis joins the
    batch of one call where each slice has its own contiguous cache, or reads a
    paged pool that the slices share without an append; otherwise the kernel
    runs once per slice.
    Under jax.jit with sharded operands the call partitions over the batch and
    the kv heads (docs/decode.md, "Sharding"); a paged pool is replicated under
    batch sharding, and an append then all-gathers only the new rows.
    """
    args = resolve_kvcache_arguments(query, k_cache, v_cache, cache_seqlens, k_new, v_new,
                                     block_table, causal, window_size, softcap, softmax_scale,
                                     return_lse, num_splits)
    head_dim = query.shape[3]
    kernel_head_dim = padded_decode_head_dim(head_dim)
    pad = kernel_head_dim != head_dim
    tensors = [query, k_cache, v_cache, k_new, v_new]
    if pad:
        widths = [(0, 0)] * 3 + [(0, kernel_head_dim - head_dim)]
        tensors = [None if x is None else jnp.pad(x, widths) for x in tensors]
    out, lse, k_out, v_out = _decode(*tensors, args.cache_seqlens, args.block_table, args.config,
                                     args.capacity)
    if pad:
        out = out[..., :head_dim]
        k_out, v_out = (None if x is None else x[..., :head_dim] for x in (k_out, v_out))
    results = (out, lse) if args.return_lse else (out,)
    if k_new is not None:
        results += (k_out, v_out)
    return results[0] if len(results) == 1 else results

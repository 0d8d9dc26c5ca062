"""Trace-time checks shared by every public entry point.

Each check raises before any kernel is traced, naming the argument and what it
got, so that nothing reaches a kernel that the kernel cannot handle.
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from jflash._src import ffi as _ffi

SUPPORTED_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
MAX_HEAD_DIM = _ffi.KERNEL_HEAD_DIMS[-1]  # larger head dims have no kernel to pad up to


def _shape_dtype(name, x):
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    return tuple(shape), jnp.dtype(dtype)


def symbolic_dims(shape):
    """Which of seq_len and head_dim of a [..., seq_len, num_heads, head_dim] shape
    are symbolic (jax.export shape polymorphism), e.g. ["seq_len 't'"]. The kernels'
    mask band and head-dim padding are computed from them at trace time."""
    dims = (("seq_len", shape[-3]), ("head_dim", shape[-1]))
    return [f"{name} {str(d)!r}" for name, d in dims if not isinstance(d, (int, np.integer))]


def check_qkv(query, key, value):
    """Validates [batch, seq, heads, head_dim] q/k/v (value's head_dim may differ
    from that of query and key); returns the shapes of query and key, and dtype."""
    shapes = {}
    dtypes = {}
    for name, x in (("query", query), ("key", key), ("value", value)):
        shape, dtype = _shape_dtype(name, x)
        if len(shape) != 4:
            raise ValueError(
                f"{name} must have rank 4 [batch, seq_len, num_heads, head_dim], got shape {shape}"
            )
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(f"{name} must be a floating-point array, got dtype {dtype}")
        if dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{name} has dtype {dtype}; jflash supports float16, bfloat16 and float32"
            )
        symbolic = symbolic_dims(shape)
        if symbolic:
            raise ValueError(
                f"{name} has symbolic {' and '.join(symbolic)} in shape {shape}; jflash "
                "needs static sequence lengths and head_dim (in jax.export, only batch and "
                "num_heads may be symbolic)"
            )
        if any(d == 0 for d in shape):
            raise ValueError(f"{name} must have no zero-sized dimension, got shape {shape}")
        shapes[name] = shape
        dtypes[name] = dtype
    if len(set(dtypes.values())) != 1:
        raise TypeError(
            "query, key and value must share one dtype, got "
            f"{dtypes['query']}, {dtypes['key']} and {dtypes['value']}"
        )
    q, k, v = shapes["query"], shapes["key"], shapes["value"]
    if k[:3] != v[:3]:
        raise ValueError("key and value must have the same shape but for head_dim (value's "
                         f"may differ), got key {k} and value {v}")
    if q[0] != k[0]:
        raise ValueError(f"query and key must have the same batch size, got query {q} and key {k}")
    if q[3] != k[3]:
        raise ValueError(f"query and key must have the same head_dim, got query {q} and key {k}")
    if q[2] % k[2] != 0:
        raise ValueError(
            "num_heads of query must be a multiple of num_heads of key/value (GQA/MQA), "
            f"got query {q} and key {k}"
        )
    if q[3] > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be at most {MAX_HEAD_DIM}, got query {q}")
    if v[3] > MAX_HEAD_DIM:
        raise ValueError(f"value's head_dim must be at most {MAX_HEAD_DIM}, got value {v}")
    return q, k, dtypes["query"]


def check_softmax_scale(softmax_scale, head_dim):
    """Returns the scale as a Python float; defaults to 1/sqrt(head_dim)."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    _check_static_real("softmax_scale", softmax_scale)
    return check_scale_value("softmax_scale", softmax_scale)


def _check_static_real(name, value, alternative=""):
    """TypeError unless value is a Python or NumPy real number (bool is not);
    alternative: what else the argument may be, for the message ("None or ")."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (numbers.Real, np.floating, np.integer)
    ):
        raise TypeError(
            f"{name} must be {alternative}a Python or NumPy real number (a static value), "
            f"got {type(value).__name__}"
        )


def check_scale_value(name, value):
    """A real scale as the Python float of the float32 the kernels receive; ValueError
    when that float32 is not finite (nan, inf, or beyond float32's range)."""
    try:
        scale = float(value)
    except OverflowError:
        scale = math.inf
    if not finite_as_float32(scale):
        raise ValueError(
            f"{name} must be finite as float32 (|{name}| <= "
            f"{float(np.finfo(np.float32).max):.4g}), got {_short_repr(value)}"
        )
    return float(np.float32(scale))


def check_softcap(softcap, softmax_scale):
    """None (no cap), or the cap c > 0 as the Python float of the float32 the
    kernels receive: a static real number, finite and > 0 as float32, such that
    the factors the kernels derive, softmax_scale / c and c * log2(e), are finite
    as float32 too (softmax_scale: the checked scale)."""
    if softcap is None:
        return None
    _check_static_real("softcap", softcap, alternative="None or ")
    try:
        cap = float(softcap)
    except OverflowError:
        cap = math.inf
    cap32 = float(np.float32(cap)) if finite_as_float32(cap) else math.nan
    if not cap32 > 0:
        raise ValueError(f"softcap must be None or a number > 0, finite as float32, got "
                         f"{_short_repr(softcap)}")
    factors = (softmax_scale / cap32, cap32 * math.log2(math.e))
    if not all(finite_as_float32(x) for x in factors):
        raise ValueError(
            f"softcap {_short_repr(softcap)} with softmax_scale {softmax_scale} is out of "
            "float32's range: softmax_scale / softcap and softcap * log2(e) must be finite"
        )
    return cap32


def _short_repr(value):
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:12]}...({len(text)} characters)"


def finite_as_float32(scale: float) -> bool:
    with np.errstate(over="ignore", invalid="ignore"):
        return bool(np.isfinite(np.float32(scale)))


def check_window_size(window_size):
    """(left, right) with -1 for an unbounded side, or None for no window.

    Each side is a non-negative int, or -1 / None for unbounded (FlashAttention's
    convention).
    """
    if window_size is None:
        return None
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(
            f"window_size must be None or a (left, right) pair, got {_short_repr(window_size)}")
    sides = []
    for name, side in zip(("left", "right"), window_size):
        if side is None:
            side = -1
        if isinstance(side, (bool, np.bool_)) or not isinstance(side, (int, np.integer)):
            raise TypeError(f"window_size {name} side must be an int or None, "
                            f"got {type(side).__name__}")
        if side < -1:
            raise ValueError(f"window_size {name} side must be >= 0, or -1 / None for "
                             f"unbounded; got {int(side)}")
        sides.append(int(side))
    return tuple(sides)


# Integer dtypes whose values int32 holds exactly (the kernels compare int32 ids).
_SEGMENT_ID_DTYPES = tuple(jnp.dtype(t) for t in (jnp.int8, jnp.int16, jnp.int32, jnp.uint8,
                                                  jnp.uint16))


def check_segment_ids(q_segment_ids, kv_segment_ids, q_shape, k_shape):
    """Validates segment ids against q [batch, seq_q, ...] and k [batch, seq_k, ...]
    shapes: both or neither, [batch, seq_q] and [batch, seq_k], an integer dtype
    that int32 holds (as jax stores it: without jax_enable_x64 a NumPy int64 array
    becomes int32). Returns them as int32 arrays, or None."""
    given = {"q_segment_ids": q_segment_ids, "kv_segment_ids": kv_segment_ids}
    missing = [name for name, x in given.items() if x is None]
    if len(missing) == 2:
        return None
    if missing:
        other = "kv_segment_ids" if missing[0] == "q_segment_ids" else "q_segment_ids"
        raise ValueError(f"{other} is given but {missing[0]} is None; pass both segment ids "
                         "or neither")
    return (
        _int32_array("q_segment_ids", q_segment_ids, (q_shape[0], q_shape[1]),
                     "[batch, seq_q] of query", "segment ids are"),
        _int32_array("kv_segment_ids", kv_segment_ids, (k_shape[0], k_shape[1]),
                     "[batch, seq_k] of key", "segment ids are"),
    )


def _int32_array(name, x, expected_shape, dims, subject="it must be"):
    """x as an int32 array: an integer dtype that int32 holds (as jax stores it),
    of shape expected_shape (described as dims in the error)."""
    shape, dtype = _shape_dtype(name, x)
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array (int32), got dtype {dtype}")
    if jnp.dtype(jax.dtypes.canonicalize_dtype(dtype)) not in _SEGMENT_ID_DTYPES:
        raise TypeError(f"{name} has dtype {dtype}; {subject} int32 (or a narrower integer "
                        "type): cast with .astype(jnp.int32)")
    if shape != expected_shape:
        raise ValueError(f"{name} must have shape {dims}, {expected_shape}, got shape {shape}")
    return jnp.asarray(x).astype(jnp.int32)


def check_bool(name, value):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


# ------------------------------------------------------------------ precision

# The precision of float32 inputs on CUDA, as jax's matmul precision names it:
# DEFAULT and HIGH run the TF32 kernels (one TF32 MMA per product, as XLA runs a
# float32 dot at DEFAULT on GPU), HIGHEST the 3xTF32 ones (three per product,
# float32-class accuracy). The value is the FFI attribute tf32_passes.
_TF32_PASSES = {jax.lax.Precision.DEFAULT: 1, jax.lax.Precision.HIGH: 1,
                jax.lax.Precision.HIGHEST: 3}
_PRECISION_ACCEPTED = (
    "None (jax_default_matmul_precision), a jax.lax.Precision, one of its names "
    "('default', 'fastest', 'bfloat16', 'high', 'tensorfloat32', 'bfloat16_3x', "
    "'highest', 'float32') or a pair (lhs, rhs) of these"
)


def _one_precision(value):
    """A jax.lax.Precision from a Precision or one of its names, else None."""
    if isinstance(value, jax.lax.Precision):
        return value
    if isinstance(value, str):
        try:
            return jax.lax.Precision(value)
        except ValueError:
            return None
    return None


def check_precision(precision):
    """precision as one jax.lax.Precision: a Precision, one of its names, or a
    pair (lhs, rhs) of those (the higher of the two); None reads
    jax.config.jax_default_matmul_precision (at trace time; its None is
    DEFAULT). ValueError for anything else, e.g. a jax.lax.DotAlgorithmPreset
    or its name, which jflash cannot map to its kernels."""
    source = "precision"
    value = precision
    if precision is None:
        source = "jax_default_matmul_precision"
        value = jax.config.jax_default_matmul_precision
        if value is None:
            return jax.lax.Precision.DEFAULT
    if isinstance(value, (tuple, list)) and len(value) == 2:
        parts = [_one_precision(x) for x in value]
        if all(p is not None for p in parts):
            return max(parts, key=lambda p: p.value)
    else:
        one = _one_precision(value)
        if one is not None:
            return one
    raise ValueError(
        f"jflash: {source} {_short_repr(value)} is not a precision jflash can run; it "
        f"accepts {_PRECISION_ACCEPTED}"
    )


def tf32_passes(precision):
    """The kernels' tf32_passes for float32 inputs (1 or 3) of a precision
    argument (check_precision): 1 for DEFAULT and HIGH, 3 for HIGHEST."""
    return _TF32_PASSES[check_precision(precision)]


# ------------------------------------------------------------------ decode

# Rows per block of a paged cache must be a multiple of this (the kernels'
# key tiles gather whole 16-row runs of a block).
PAGED_BLOCK_MULTIPLE = 16  # kPagedBlockMultiple of csrc/include/jflash/decode.h
MAX_DECODE_SPLITS = 128  # kMaxDecodeSplits of csrc/include/jflash/decode.h


def _rank4(name, x, layout):
    shape, dtype = _shape_dtype(name, x)
    if len(shape) != 4:
        raise ValueError(f"{name} must have rank 4 {layout}, got shape {shape}")
    if not all(isinstance(d, (int, np.integer)) for d in shape):
        raise ValueError(f"{name} has a symbolic dimension in shape {shape}; "
                         "flash_attention_with_kvcache needs static shapes")
    if any(d == 0 for d in shape):
        raise ValueError(f"{name} must have no zero-sized dimension, got shape {shape}")
    return shape, dtype


def check_kvcache(query, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table):
    """Validates flash_attention_with_kvcache's arrays. Returns (cache_seqlens,
    block_table) as int32 arrays (block_table None for a contiguous cache) and
    the cache's capacity in keys per sequence."""
    q, dtype = _rank4("query", query, "[batch, seq_q, num_heads, head_dim]")
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"query has dtype {dtype}; jflash supports float16, bfloat16 and float32")
    paged = block_table is not None
    layout = ("[num_blocks, block_size, num_heads_kv, head_dim] (paged)" if paged
              else "[batch, seq_cache, num_heads_kv, head_dim]")
    k, k_dtype = _rank4("k_cache", k_cache, layout)
    v, v_dtype = _rank4("v_cache", v_cache, layout)
    if k_dtype != dtype or v_dtype != dtype:
        raise TypeError(f"query, k_cache and v_cache must share one dtype, got {dtype}, "
                        f"{k_dtype} and {v_dtype}")
    if k != v:
        raise ValueError(f"k_cache and v_cache must have the same shape, got {k} and {v}")
    batch, _, num_heads, head_dim = q
    if k[3] != head_dim:
        raise ValueError(f"query and k_cache must have the same head_dim, got query {q} and "
                         f"k_cache {k}")
    if num_heads % k[2] != 0:
        raise ValueError("num_heads of query must be a multiple of num_heads of k_cache "
                         f"(GQA/MQA), got query {q} and k_cache {k}")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be at most {MAX_HEAD_DIM}, got query {q}")
    if paged:
        table = _rank_checked_table(block_table, batch)
        if k[1] % PAGED_BLOCK_MULTIPLE != 0:
            raise ValueError(f"block_size (k_cache.shape[1]) of a paged cache must be a multiple "
                             f"of {PAGED_BLOCK_MULTIPLE}, got k_cache {k}")
        capacity = table.shape[1] * k[1]
    else:
        table = None
        if k[0] != batch:
            raise ValueError(f"k_cache must have query's batch size, got query {q} and k_cache "
                             f"{k} (a paged cache comes with block_table)")
        capacity = k[1]
    seqlens = _int32_array("cache_seqlens", cache_seqlens, (batch,), "[batch] of query")
    if (k_new is None) != (v_new is None):
        given, missing = ("k_new", "v_new") if v_new is None else ("v_new", "k_new")
        raise ValueError(f"{given} is given but {missing} is None; pass both or neither")
    if k_new is not None:
        kn, kn_dtype = _rank4("k_new", k_new, "[batch, seq_new, num_heads_kv, head_dim]")
        vn, vn_dtype = _rank4("v_new", v_new, "[batch, seq_new, num_heads_kv, head_dim]")
        if kn_dtype != dtype or vn_dtype != dtype:
            raise TypeError(f"k_new and v_new must have query's dtype {dtype}, got {kn_dtype} "
                            f"and {vn_dtype}")
        if kn != vn:
            raise ValueError(f"k_new and v_new must have the same shape, got {kn} and {vn}")
        if (kn[0], kn[2], kn[3]) != (batch, k[2], head_dim):
            raise ValueError(f"k_new must be [batch, seq_new, num_heads_kv, head_dim] = "
                             f"[{batch}, seq_new, {k[2]}, {head_dim}], got {kn}")
        if kn[1] > capacity:
            raise ValueError(f"k_new holds {kn[1]} new keys per sequence, more than the cache's "
                             f"capacity of {capacity}")
    return seqlens, table, capacity


def _rank_checked_table(block_table, batch):
    shape, _ = _shape_dtype("block_table", block_table)
    if len(shape) != 2 or shape[0] != batch or shape[1] == 0:
        raise ValueError(f"block_table must have shape [batch, max_blocks_per_seq] with batch "
                         f"{batch} and at least one block, got shape {shape}")
    return _int32_array("block_table", block_table, shape, "[batch, max_blocks_per_seq]")


def check_num_splits(num_splits):
    """None (the heuristic), or an int in [1, MAX_DECODE_SPLITS]."""
    if num_splits is None:
        return None
    if isinstance(num_splits, (bool, np.bool_)) or not isinstance(num_splits, (int, np.integer)):
        raise TypeError(f"num_splits must be None or an int, got {type(num_splits).__name__}")
    if not 1 <= num_splits <= MAX_DECODE_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_DECODE_SPLITS}], got {int(num_splits)}")
    return int(num_splits)

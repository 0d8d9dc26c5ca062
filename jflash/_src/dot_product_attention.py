"""jflash.dot_product_attention: a drop-in for jax.nn.dot_product_attention.

Same signature and results as jax.nn.dot_product_attention (jax 0.11). The
arguments jflash handles run its kernels; the rest go to jax's own function
(implementation=None) or raise (implementation="jflash").

How jax's masks map to the kernels' band (masks.top_left_band;
csrc/include/jflash/mask.h), key j visible from query i iff diag_lo <= j - i <= diag_hi:
  is_causal                      top-left: j <= i, so diag_hi = 0
  local_window_size=(left, right)  i - left <= j <= i + right
A query row that sees no key is where the two differ: jax fills masked logits
with a large finite negative number, so such a row's softmax is uniform and its
output is the mean of all values (its lse residual that large negative); the
kernels write zeros. Those rows are patched here to jax's answer, gradients
included: known from the static shapes for a band, and from the kernels' lse
(-inf exactly where a row sees no key) under segment ids.

query_seq_lengths and key_value_seq_lengths run on the kernels as segment ids:
query rows past their length get an id that no key has, keys past theirs one
that no row has. jax's answer for a padded query row is 0 (it multiplies the
output by the row's validity) with zero gradients, which is the kernels' answer
for a row that sees no key; a row within its length that sees no key (all its
keys padded or outside the band) gets jax's mean of the values, as above.
q_segment_ids and kv_segment_ids are jflash's own keywords (jax.nn has none):
where jax's function runs instead, they become its boolean mask. So is softcap,
which jax's function cannot compute: a call with it runs the kernels or raises.

Precision: jax.nn.dot_product_attention has no precision argument; its float32
dots run at jax_default_matmul_precision. So do the kernels here
(validation.tf32_passes, read at trace time): TF32 on GPU at DEFAULT and HIGH,
3xTF32 at HIGHEST. A setting jflash cannot map (a DotAlgorithmPreset name) is
one more reason for jax's function to run the call.
"""

from __future__ import annotations

import contextlib
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from jflash._src import masks, validation
from jflash._src.flash_attention import attention_band

IMPLEMENTATIONS = (None, "jflash", "xla", "cudnn")

# jax's masked-logit value, in the float32 its softmax runs in
# (jax._src.nn.functions._get_large_negative).
_JAX_MASKED_LOGIT = np.float32(-0.7 * np.finfo(np.float32).max)


def _static_scale(scale):
    """scale as a Python float, or None when it is traced (jflash needs it static)."""
    if isinstance(scale, (bool, np.bool_)):
        return None
    if isinstance(scale, (numbers.Real, np.floating, np.integer)):
        try:
            return float(scale)
        except OverflowError:  # a Python int beyond float64's range
            return math.copysign(math.inf, scale)
    if isinstance(scale, (np.ndarray, jax.Array)) and np.shape(scale) == ():
        try:
            return float(scale)
        except jax.errors.ConcretizationTypeError:
            return None
    return None


def _window(local_window_size):
    """(left, right) from jax's int-or-pair convention, or None when not static ints."""
    if isinstance(local_window_size, (numbers.Integral, np.integer)) and not isinstance(
        local_window_size, bool
    ):
        return int(local_window_size), int(local_window_size)
    if (
        isinstance(local_window_size, (tuple, list))
        and len(local_window_size) == 2
        and all(
            isinstance(w, (numbers.Integral, np.integer)) and not isinstance(w, bool)
            for w in local_window_size
        )
    ):
        return int(local_window_size[0]), int(local_window_size[1])
    return None


def _lengths_unsupported(query, q_lengths, kv_lengths):
    """Why sequence lengths cannot run on the kernels (None: they can, or none given):
    jax's [batch] int32 arrays, with a batch axis on the inputs."""
    for name, arg in (("query_seq_lengths", q_lengths), ("key_value_seq_lengths", kv_lengths)):
        if arg is None:
            continue
        if query.ndim != 4:
            return f"{name} is given with rank-3 inputs (jflash takes lengths per batch entry)"
        shape, dtype = np.shape(arg), getattr(arg, "dtype", None)
        if shape != (query.shape[0],) or dtype is None or jnp.dtype(dtype) != jnp.int32:
            return f"{name} must be an int32 array of shape ({query.shape[0]},) for jflash"
    return None


def _unsupported(query, key, value, bias, mask, scale, q_lengths, kv_lengths, window):
    """Why the jflash kernels cannot run this call, or None when they can."""
    for name, arg in (("bias", bias), ("mask", mask)):
        if arg is not None:
            return (f"{name} is given (jflash supports is_causal, local_window_size, sequence "
                    "lengths and segment ids)")
    shapes = {n: x.shape for n, x in (("query", query), ("key", key), ("value", value))}
    ranks = {len(s) for s in shapes.values()}
    if len(ranks) != 1 or ranks.pop() not in (3, 4):
        return f"query, key and value must all have rank 3 or all rank 4, got shapes {shapes}"
    for name, shape in shapes.items():
        symbolic = validation.symbolic_dims(shape)
        if symbolic:
            return f"{name} has symbolic {' and '.join(symbolic)} (jflash needs them static)"
    dtypes = {query.dtype, key.dtype, value.dtype}
    if len(dtypes) != 1 or query.dtype not in validation.SUPPORTED_DTYPES:
        return (
            "query, key and value must share one dtype of float16, bfloat16 or float32, got "
            f"{query.dtype}, {key.dtype} and {value.dtype}"
        )
    q = query.shape if query.ndim == 4 else (1, *query.shape)  # [B, T, N, H]
    k = key.shape if key.ndim == 4 else (1, *key.shape)  # [B, S, K, H]
    if key.shape != value.shape:
        return f"key and value must have the same shape, got {key.shape} and {value.shape}"
    if q[0] != k[0] or q[3] != k[3] or q[2] % k[2] != 0:
        return (
            "query [B, T, N, H] and key [B, S, K, H] need the same B and H and N a "
            f"multiple of K, got query {query.shape} and key {key.shape}"
        )
    if q[3] > validation.MAX_HEAD_DIM:
        return f"head dim {q[3]} exceeds {validation.MAX_HEAD_DIM}"
    if 0 in q or 0 in k:
        return f"zero-sized dimension in query {query.shape} or key {key.shape}"
    if scale is not None:
        static_scale = _static_scale(scale)
        if static_scale is None:
            return f"scale must be a static real number for jflash, got {type(scale).__name__}"
        if not validation.finite_as_float32(static_scale):
            return f"scale must be finite as float32 for jflash, got {static_scale}"
    if window is not None and _window(window) is None:
        return f"local_window_size must be an int or a pair of ints, got {window!r}"
    return _lengths_unsupported(query, q_lengths, kv_lengths)


def _batched_segment_ids(query, key, q_segment_ids, kv_segment_ids):
    """The jflash keywords q_segment_ids, kv_segment_ids ([B, T] and [B, S], or [T]
    and [S] for rank-3 inputs) validated and as int32 [B, T], [B, S]; or None."""
    if q_segment_ids is None and kv_segment_ids is None:
        return None
    q_shape = query.shape if query.ndim == 4 else (1, *query.shape)
    k_shape = key.shape if key.ndim == 4 else (1, *key.shape)
    if query.ndim == 3:
        q_segment_ids = None if q_segment_ids is None else jnp.asarray(q_segment_ids)[None]
        kv_segment_ids = None if kv_segment_ids is None else jnp.asarray(kv_segment_ids)[None]
    return validation.check_segment_ids(q_segment_ids, kv_segment_ids, q_shape, k_shape)


def _segment_mask(segment_ids, rank):
    """Segment ids as jax.nn's boolean mask: [B, 1, T, S] (rank 4) or [1, T, S]."""
    q_ids, kv_ids = segment_ids
    mask = (q_ids[:, :, None] == kv_ids[:, None, :])[:, None]
    return mask if rank == 4 else mask[0]


def _kernel_segment_ids(segment_ids, q_lengths, kv_lengths, seqlen_q, seqlen_k):
    """Segment ids with the sequence lengths folded in, for the kernels: rows past
    a query length get -1, keys past a key length -2, ids that no valid position
    has (the ids of valid positions are made non-negative first: 0 without
    segment ids, else each id's rank among the batch entry's ids, which keeps
    equal ids equal and others apart). None when neither is given."""
    if q_lengths is None and kv_lengths is None:
        return segment_ids
    batch = (q_lengths if q_lengths is not None else kv_lengths).shape[0]
    if segment_ids is None:
        q_ids = jnp.zeros((batch, seqlen_q), jnp.int32)
        kv_ids = jnp.zeros((batch, seqlen_k), jnp.int32)
    else:
        q_ids, kv_ids = segment_ids
        ids = jnp.sort(jnp.concatenate([q_ids, kv_ids], axis=-1), axis=-1)
        rank = jax.vmap(lambda ids, x: jnp.searchsorted(ids, x).astype(jnp.int32))
        q_ids, kv_ids = rank(ids, q_ids), rank(ids, kv_ids)
    if q_lengths is not None:
        q_ids = jnp.where(jnp.arange(seqlen_q)[None] < q_lengths[:, None], q_ids, -1)
    if kv_lengths is not None:
        kv_ids = jnp.where(jnp.arange(seqlen_k)[None] < kv_lengths[:, None], kv_ids, -2)
    return q_ids, kv_ids


def dot_product_attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    scale=None,
    is_causal=False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size=None,
    implementation=None,
    return_residual=False,
    deterministic=False,
    q_segment_ids=None,
    kv_segment_ids=None,
    softcap=None,
):
    """jax.nn.dot_product_attention, computed by the jflash kernels where they apply.

    Arguments and results are those of jax.nn.dot_product_attention: query
    [B, T, N, H] or [T, N, H], key and value [B, S, K, H] or [S, K, H] (GQA when
    K < N), top-left causal mask, local_window_size=(left, right) or an int,
    return_residual gives the logsumexp [B, T, N] in the input dtype.

    jflash runs when bias and mask are None, query/key/value share a dtype of
    float16, bfloat16 or float32, head dim <= 256, scale is static, and the
    sequence lengths (if given) are int32 [B] arrays of rank-4 inputs. Rows
    that see no key give jax's result (the mean of the values), not the
    kernels' zeros; query rows past their length give 0, as in jax.

    Args:
      implementation: None: jflash when supported, else jax's own function
        (its default, XLA). "jflash": jflash, or a ValueError saying why it
        cannot run. "xla" or "cudnn": passed to jax.nn.dot_product_attention
        unchanged. float32 inputs run at jax_default_matmul_precision, as jax's
        float32 dots do (read when the call is traced; on GPU: the TF32
        kernels at DEFAULT and HIGH, 3xTF32 at HIGHEST, see
        jflash.flash_attention's precision); a setting that jflash cannot map
        (the name of a jax.lax.DotAlgorithmPreset) goes to jax's function (or
        raises, for "jflash").
      deterministic: a jflash extension (jax.nn has no such argument): if True,
        the jflash kernels' gradients are bit-identical from run to run (see
        jflash.flash_attention). Calls that go to jax's own function are not
        affected.
      q_segment_ids, kv_segment_ids: a jflash extension: both None, or integer
        arrays [B, T] and [B, S] ([T] and [S] for rank-3 inputs): query t sees
        key s only where q_segment_ids[b, t] == kv_segment_ids[b, s] (packed
        documents; see jflash.flash_attention), on top of the other masks. A
        call that goes to jax's own function gets them as its boolean mask.
      softcap: a jflash extension: None, or c > 0: the logits become
        c * tanh(logits / c) (see jflash.flash_attention). jax's function has
        no such option: with softcap, a call that the kernels cannot run, or
        implementation "xla" or "cudnn", raises a ValueError.
    """
    return attention(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size, implementation=implementation,
        return_residual=return_residual, deterministic=deterministic,
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, softcap=softcap,
    )


def _precision_context(precision):
    """A context in which jax's function runs at an explicit precision (jax.nn's
    function has no precision argument; its dots read jax_default_matmul_precision)."""
    if precision is None:
        return contextlib.nullcontext()
    return jax.default_matmul_precision(validation.check_precision(precision).name.lower())


def attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
              query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
              implementation=None, return_residual=False, deterministic=False,
              q_segment_ids=None, kv_segment_ids=None, softcap=None, precision=None):
    """dot_product_attention with a precision of its own (the Flax front ends pass
    their layer's): None reads jax_default_matmul_precision, as jax.nn does; an
    explicit value (validation.check_precision) applies to the kernels and, where
    jax's function runs, to its dots."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}"
        )

    segment_ids = _batched_segment_ids(jnp.asarray(query), jnp.asarray(key), q_segment_ids,
                                       kv_segment_ids)

    def jax_attention(implementation):
        full_mask = mask
        if segment_ids is not None:
            full_mask = _segment_mask(segment_ids, jnp.ndim(query))
            if mask is not None:
                full_mask = jnp.logical_and(mask, full_mask)
        with _precision_context(precision):
            return jax.nn.dot_product_attention(
                query,
                key,
                value,
                bias,
                full_mask,
                scale=scale,
                is_causal=is_causal,
                query_seq_lengths=query_seq_lengths,
                key_value_seq_lengths=key_value_seq_lengths,
                local_window_size=local_window_size,
                implementation=implementation,
                return_residual=return_residual,
            )

    deterministic = validation.check_bool("deterministic", deterministic)
    if implementation in ("xla", "cudnn"):
        if softcap is not None:
            raise ValueError(f"softcap is a jflash extension; implementation={implementation!r} "
                             "(jax's function) has no softcap: use None or 'jflash'")
        return jax_attention(implementation)
    q, k, v = (jnp.asarray(x) for x in (query, key, value))
    reason = _unsupported(
        q, k, v, bias, mask, scale, query_seq_lengths, key_value_seq_lengths, local_window_size
    )
    if precision is not None:
        tf32_passes = validation.tf32_passes(precision)
    else:
        try:
            tf32_passes = validation.tf32_passes(None)
        except ValueError as e:  # a setting jax's function takes (a DotAlgorithmPreset)
            tf32_passes, reason = 1, reason or str(e).removeprefix("jflash: ")
    if reason is not None:
        if implementation == "jflash" or softcap is not None:
            why = "implementation='jflash'" if softcap is None else "softcap (a jflash extension)"
            raise ValueError(f"{why} needs jflash's kernels, which cannot run this call: {reason}")
        return jax_attention(None)

    output_shape = q.shape
    if q.ndim == 3:
        q, k, v = q[None], k[None], v[None]
    _, seqlen_q, num_heads, head_dim = q.shape
    seqlen_k, num_heads_kv = k.shape[1], k.shape[2]
    window = None if local_window_size is None else _window(local_window_size)
    diag_lo, diag_hi = masks.top_left_band(seqlen_q, seqlen_k, bool(is_causal), window)
    softmax_scale = 1.0 / np.sqrt(head_dim) if scale is None else _static_scale(scale)
    softcap = validation.check_softcap(softcap, float(softmax_scale))
    q_lengths, kv_lengths = query_seq_lengths, key_value_seq_lengths
    kernel_ids = _kernel_segment_ids(segment_ids, q_lengths, kv_lengths, seqlen_q, seqlen_k)
    out, lse = attention_band(
        q, k, v, softmax_scale=float(softmax_scale), diag_lo=diag_lo, diag_hi=diag_hi,
        deterministic=deterministic, q_segment_ids=None if kernel_ids is None else kernel_ids[0],
        kv_segment_ids=None if kernel_ids is None else kernel_ids[1], softcap=softcap,
        tf32_passes=tf32_passes,
    )
    if kernel_ids is None:
        empty = masks.rows_without_keys(seqlen_q, seqlen_k, diag_lo, diag_hi)
        patch = jnp.asarray(empty)[None, None, :] if empty.any() else None  # [1, 1, T]
    else:  # lse is -inf exactly where a row sees no key
        patch = jnp.isneginf(lse)  # [B, N, T]
    if patch is not None:
        group = num_heads // num_heads_kv
        mean_v = jnp.repeat(jnp.mean(v.astype(jnp.float32), axis=1), group, axis=1)
        rows = jnp.swapaxes(patch, 1, 2)[..., None]  # [B or 1, T, N or 1, 1]
        if q_lengths is not None:  # jax's padded query rows are 0, not the mean
            rows = rows & (jnp.arange(seqlen_q) < q_lengths[:, None])[:, :, None, None]
        # Merged in float32 and rounded once, so that dv, which sums both
        # paths' gradients, is rounded once more at most.
        out = jnp.where(rows, mean_v[:, None], out.astype(jnp.float32)).astype(q.dtype)
        lse = jnp.where(patch, _JAX_MASKED_LOGIT, lse)
    out = jnp.reshape(out, output_shape)
    if not return_residual:
        return out
    residual = jax.lax.stop_gradient(jnp.transpose(lse, (0, 2, 1)).astype(k.dtype))
    return out, jnp.reshape(residual, output_shape[:-1])

"""jflash.flash_attention: the op, its custom_vjp and its residuals.

Forward:  out, lse = kernel(q, k, v)              (lse in float32, natural log)
Backward: dq, dk, dv = kernel(q, k, v, out, dout, lse, dlse)
          recomputes P = exp(S - lse) tile by tile; no seq_q x seq_k buffer.

The gradient flows through lse too (dS = P * (dP - (delta - dlse))), which
ring attention and other lse-combining callers rely on. With softcap c the
scores are c * tanh(s / c) for s = softmax_scale * q.k, and dS is taken back
through the cap: times 1 - tanh(s / c)^2.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jflash._src import context_parallel, kernel_calls, validation
from jflash._src.masks import clamp_band, window_band

# Names for jax.checkpoint policies, e.g.
# jax.checkpoint_policies.save_only_these_names(OUT_NAME, LSE_NAME).
OUT_NAME = "jflash_out"
LSE_NAME = "jflash_lse"


SECOND_ORDER_UNSUPPORTED = (
    "jflash: second-order differentiation of flash attention (jax.grad of jax.grad, "
    "jax.hessian, or any derivative of its backward pass) is not supported; the "
    "backward kernel has no derivative rule. Use jax.nn.dot_product_attention "
    "(implementation='xla') where second derivatives are needed."
)


# cp, here and in _attention: the context-parallel configuration (strategy,
# layout, layout axis size), read when the call is traced
# (context_parallel.current_config) and static like the band. seg: None, or the
# int32 segment ids (q ids [batch, seq_q], kv ids [batch, seq_k]), which get no
# gradient. softcap: None, or the cap (a Python float), static too. tf32: the
# kernels' tf32_passes (1 or 3, validation.tf32_passes), static.
@functools.partial(jax.custom_jvp, nondiff_argnums=(4, 5, 6, 7, 8, 9))
def _forward(q, k, v, seg, softmax_scale, softcap, tf32, diag_lo, diag_hi, cp):
    return kernel_calls.fwd(
        q, k, v, softmax_scale=softmax_scale, diag_lo=diag_lo, diag_hi=diag_hi, context_parallel=cp,
        segment_ids=seg, softcap=softcap, tf32_passes=tf32,
    )


@functools.partial(jax.custom_jvp, nondiff_argnums=(8, 9, 10, 11, 12, 13, 14))
def _backward(q, k, v, out, dout, lse, dlse, seg, softmax_scale, softcap, tf32, diag_lo, diag_hi,
              cp, deterministic):
    return kernel_calls.bwd(
        q, k, v, out, dout, lse, dlse, softmax_scale=softmax_scale, diag_lo=diag_lo,
        diag_hi=diag_hi, context_parallel=cp, deterministic=deterministic, segment_ids=seg,
        softcap=softcap, tf32_passes=tf32,
    )


def _no_second_order(*args):
    # The custom_vjp below (_attention) gives first derivatives. A second derivative
    # differentiates the kernel calls themselves (the forward's under the outer
    # transform, or the backward's), which would otherwise fail deep inside jax
    # ("Differentiation rule for 'custom_partitioning' not implemented").
    del args
    raise NotImplementedError(SECOND_ORDER_UNSUPPORTED)


_forward.defjvp(_no_second_order)
_backward.defjvp(_no_second_order)


# deterministic: the backward's gradients bit-identical from run to run.
@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9, 10))
def _attention(q, k, v, seg, softmax_scale, softcap, tf32, diag_lo, diag_hi, cp, deterministic):
    del deterministic
    return _forward(q, k, v, seg, softmax_scale, softcap, tf32, diag_lo, diag_hi, cp)


def _attention_fwd(q, k, v, seg, softmax_scale, softcap, tf32, diag_lo, diag_hi, cp,
                   deterministic):
    del deterministic
    out, lse = _forward(q, k, v, seg, softmax_scale, softcap, tf32, diag_lo, diag_hi, cp)
    out = checkpoint_name(out, OUT_NAME)
    lse = checkpoint_name(lse, LSE_NAME)
    return (out, lse), (q, k, v, seg, out, lse)


def _attention_bwd(softmax_scale, softcap, tf32, diag_lo, diag_hi, cp, deterministic, residuals,
                   cotangents):
    q, k, v, seg, out, lse = residuals
    dout, dlse = cotangents
    dq, dk, dv = _backward(
        q,
        k,
        v,
        out,
        dout.astype(out.dtype),
        lse,
        dlse.astype(jnp.float32),
        seg,
        softmax_scale,
        softcap,
        tf32,
        diag_lo,
        diag_hi,
        cp,
        deterministic,
    )
    return dq, dk, dv, None  # segment ids: no gradient


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention_band(query, key, value, *, softmax_scale, diag_lo, diag_hi, deterministic=False,
                   q_segment_ids=None, kv_segment_ids=None, softcap=None, tf32_passes=1):
    """Attention with the band mask diag_lo <= j - i <= diag_hi; returns (out, lse).

    deterministic: the gradients are bit-identical from run to run (see
    flash_attention). q_segment_ids, kv_segment_ids: both None, or int32
    [batch, seq_q] and [batch, seq_k]: key j is visible from query i only where
    they are equal, on top of the band. softcap: None, or the cap c > 0 of the
    scores (validated: validation.check_softcap). tf32_passes: the precision of
    float32 inputs on CUDA, 1 (TF32) or 3 (3xTF32), from validation.tf32_passes;
    other dtypes run as 1 (their kernels have one precision).

    Positions i, j are true token positions: under
    jflash.context_parallel.sequence_layout("zigzag", n) the sequence axis holds
    the tokens permuted by shard_sequence. A sequence-sharded call runs
    context-parallel with the strategy of jflash.context_parallel_strategy.

    For validated inputs (see flash_attention); the entry point that other
    front ends (the jax.nn drop-in, Flax modules) build on.
    """
    _, seqlen_q, _, head_dim = query.shape
    seqlen_k = key.shape[1]
    diag_lo, diag_hi = clamp_band(seqlen_q, seqlen_k, diag_lo, diag_hi)
    seg = None
    if q_segment_ids is not None:
        seg = (jnp.asarray(q_segment_ids, jnp.int32), jnp.asarray(kv_segment_ids, jnp.int32))
    if softcap is not None:
        softcap = float(softcap)
    float32 = jnp.dtype(query.dtype) == jnp.float32
    tf32 = int(tf32_passes) if float32 else 1  # one static (and one trace) per precision
    # One head dim for the kernels: query/key and value (whose head dim may
    # differ) zero-padded up to a kernel head dim that holds both. Zero columns
    # of q and k leave the scores as they are; those of v give output columns
    # of zeros, sliced off below.
    value_head_dim = value.shape[3]
    kernel_head_dim = kernel_calls.padded_head_dim(max(head_dim, value_head_dim),
                                                   segments=seg is not None,
                                                   softcap=softcap is not None, float32=float32)

    def pad(x):
        extra = kernel_head_dim - x.shape[3]
        return jnp.pad(x, [(0, 0), (0, 0), (0, 0), (0, extra)]) if extra else x

    query, key, value = pad(query), pad(key), pad(value)
    cp = context_parallel.current_config()
    out, lse = _attention(
        query, key, value, seg, float(softmax_scale), softcap, tf32, diag_lo, diag_hi, cp,
        bool(deterministic),
    )
    if kernel_head_dim != value_head_dim:
        out = out[..., :value_head_dim]
    return out, lse


def resolve_arguments(query, key, value, causal, softmax_scale, return_lse, window_size=None,
                      q_segment_ids=None, kv_segment_ids=None, softcap=None):
    """Validates flash_attention's arguments; (softmax_scale, diag_lo, diag_hi,
    return_lse, segment_ids, softcap), segment_ids None or the int32 (q ids, kv
    ids), softcap None or a float > 0.

    Shared with jflash.reference.attention so that both read arguments alike.
    """
    q_shape, k_shape, _ = validation.check_qkv(query, key, value)
    causal = validation.check_bool("causal", causal)
    return_lse = validation.check_bool("return_lse", return_lse)
    softmax_scale = validation.check_softmax_scale(softmax_scale, q_shape[3])
    window_size = validation.check_window_size(window_size)
    segment_ids = validation.check_segment_ids(q_segment_ids, kv_segment_ids, q_shape, k_shape)
    softcap = validation.check_softcap(softcap, softmax_scale)
    diag_lo, diag_hi = window_band(q_shape[1], k_shape[1], causal, window_size)
    return softmax_scale, diag_lo, diag_hi, return_lse, segment_ids, softcap


def flash_attention(query, key, value, *, causal=False, softmax_scale=None, return_lse=False,
                    window_size=None, q_segment_ids=None, kv_segment_ids=None,
                    softcap=None, deterministic=False, precision=None):
    """Exact attention, computed tile by tile without a seq_q x seq_k buffer.

    Args:
      query: [batch, seq_q, num_heads, head_dim], float16, bfloat16 or float32.
      key: [batch, seq_k, num_heads_kv, head_dim], same dtype; num_heads must be
        a multiple of num_heads_kv (GQA/MQA: query head h reads kv head
        h // (num_heads // num_heads_kv)).
      value: [batch, seq_k, num_heads_kv, head_dim_v], the dtype of key; its
        head dim may differ from query's and key's (MLA-style models): out then
        has head_dim_v. The kernels run at one head dim, the larger of the two
        (padded up to a kernel head dim as any head dim is), so a call with
        head_dim 192 and head_dim_v 128 costs what head dim 192 costs.
      causal: mask aligned to the bottom-right corner: query i sees key j iff
        j <= i + seq_k - seq_q. A row that sees no key outputs zeros, lse -inf,
        and gets zero gradients. NaN and Inf propagate as in float32
        jax.nn.dot_product_attention, through the pairs the mask lets through
        (README, "NaN and Inf").
      softmax_scale: static scale applied to q.k; default 1/sqrt(head_dim).
      return_lse: also return lse [batch, num_heads, seq_q], float32, natural
        log of the softmax denominator (differentiable).
      window_size: None, or (left, right): a sliding window aligned like causal,
        query i sees key j iff i + seq_k - seq_q - left <= j <= i + seq_k -
        seq_q + right; -1 (or None) leaves a side unbounded; with causal=True
        the right side is 0. Runs on the same band-masked kernels as causal,
        which skip the key tiles outside the window.
      q_segment_ids, kv_segment_ids: both None (the default), or integer arrays
        [batch, seq_q] and [batch, seq_k] (int32 ids, any values): query i sees
        key j only where q_segment_ids[b, i] == kv_segment_ids[b, j], on top of
        causal and window_size, which stay in the rows' absolute positions. With
        documents packed one after the other (the same ids on both sides), each
        document attends only to itself, causally under causal=True, and the
        kernels skip the tiles between documents, so a packed row costs about
        what its documents cost apart. A row whose segment has no visible key
        outputs zeros and lse -inf, like any row that sees no key. The ids get
        no gradient. Head dims other than 64, 128 and 256 are zero-padded up to
        the next of these for such calls. A sequence-sharded (context-parallel)
        call with segment ids gathers the sequence.
      softcap: None (the default), or a static number c > 0: the scores
        become c * tanh(softmax_scale * q.k / c) before the softmax (logit
        soft-capping, as in Gemma 2), and the gradients are those of the capped
        scores; lse is of the capped scores. An inf score is capped to +-c, a
        NaN stays NaN. Head dims other than 64, 128 and 256 are zero-padded up
        to the next of these for such calls. Works with every other option.
      deterministic: if True, the gradients are bit-identical from run to run
        on the same device and inputs. The CUDA backward then adds each query
        block's dq contributions in key-block order instead of as they come
        (a cost measured in the README); the CPU backward is deterministic
        either way. The forward is always deterministic.
      precision: the precision of float32 inputs on GPU, in jax's matmul
        convention: None (the default: jax_default_matmul_precision, read when
        the call is traced; unset means DEFAULT), a jax.lax.Precision, one of
        its names ("default", "high", "highest", "bfloat16", "tensorfloat32",
        "float32", ...), or a pair (lhs, rhs) of these (the higher counts).
        DEFAULT and HIGH run the TF32 kernels (one TF32 tensor-core MMA per
        product, as XLA runs float32 dots at DEFAULT on GPU); HIGHEST runs
        3xTF32 (three MMAs per product, float32-class accuracy, about 3x the
        MMA work). Anything else (e.g. a jax.lax.DotAlgorithmPreset) raises a
        ValueError. float16 and bfloat16 inputs accept it and ignore it; on
        CPU float32 is always computed in float32, at least as precise as
        either setting. Float32 calls run on kernels built for head dims 64,
        128 and 256; other head dims are zero-padded up to the next of these
        (on every platform).

    Returns:
      out [batch, seq_q, num_heads, head_dim_v] in query's dtype, or (out, lse).
    """
    softmax_scale, diag_lo, diag_hi, return_lse, segment_ids, softcap = resolve_arguments(
        query, key, value, causal, softmax_scale, return_lse, window_size, q_segment_ids,
        kv_segment_ids, softcap,
    )
    deterministic = validation.check_bool("deterministic", deterministic)
    tf32_passes = validation.tf32_passes(precision)
    q_ids, kv_ids = segment_ids or (None, None)
    out, lse = attention_band(
        query, key, value, softmax_scale=softmax_scale, diag_lo=diag_lo, diag_hi=diag_hi,
        deterministic=deterministic, q_segment_ids=q_ids, kv_segment_ids=kv_ids, softcap=softcap,
        tf32_passes=tf32_passes,
    )
    return (out, lse) if return_lse else out

"""A small forward + backward run for compute-sanitizer (memcheck, racecheck).

Odd lengths that leave partial tiles at both sequence ends, GQA, one unmasked
and one banded call (with fully masked rows), per head dim and dtype given:

  XLA_PYTHON_CLIENT_PREALLOCATE=false compute-sanitizer --tool memcheck \
      python3 -P tools/sanitizer_driver.py [--head-dims 128 192 256] \
      [--dtypes bfloat16 float16] [--deterministic]

A second shape has more work units than the GPU has SMs (each persistent CTA
of the Hopper forward then runs several units back to back), with a
bottom-right causal band whose first query rows see no key. A third one has
row maxima that rise along the keys (a bias per 64-key block through the
first head-dim coordinate), so that the Hopper forward's softmax computes key
tiles again with fresh maxima (tests/test_cuda_specific.py, rising scores).

`--segments` runs packed documents instead (segment ids; odd document
lengths, a query document with no key and documents of one token; GQA;
unmasked and causal): the kernels of segment ids and of the producer's
per-step tile flags that the Hopper backward stores beside its Q/dO buffers.

`--softcap C` runs either set with logit soft-capping at C (the softcap
kernels).

With JFLASH_CUDA_SMEM_LIMIT=101376 the same cases run the 99 KB tile column
(head dims 192 and 256 then cover its 64 x 32 and 4-warp 32 x 32 backward).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jflash
from jflash._src.flash_attention import attention_band


def report(attention, q, k, v, label):
    """Forward and backward of attention(q, k, v) -> (out, lse) under jit (the
    kernels the sanitizer watches); prints the loss and whether all is finite."""
    def loss(q, k, v):
        out, lse = attention(q, k, v)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))

    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)
    finite = bool(np.isfinite(float(value))) and all(
        np.isfinite(np.asarray(g, np.float32)).all() for g in grads)
    print(f"{label}: loss {float(value):.4f}, finite {finite}")


def run_segments(head_dims, dtypes, deterministic, softcap, rng, scale):
    """Packed documents: rows of segment ids, unmasked and causal."""
    # Per batch entry, the documents' lengths (query side = key side); in
    # entry 1, query document 7 has no key (its keys carry id 8) and two
    # documents hold one token.
    docs = ((300, 1, 129, 77, 500), (80, 1, 1, 400, 211, 3))
    seq = max(sum(d) for d in docs)

    def ids_of(lengths, last):
        ids = np.repeat(np.arange(len(lengths)), lengths)
        return np.concatenate([ids, np.full(seq - len(ids), last)]).astype(np.int32)

    q_ids = np.stack([ids_of(docs[0], 99), ids_of(docs[1], 99)])
    kv_ids = q_ids.copy()
    kv_ids[1][kv_ids[1] == 7] = 8
    kv_ids[1][-5:] = 98  # padding keys of no query's document
    q_ids, kv_ids = jnp.asarray(q_ids), jnp.asarray(kv_ids)
    for d, dtype in ((d, jnp.dtype(t)) for d in head_dims for t in dtypes):
        q = jnp.asarray(rng.standard_normal((2, seq, 8, d)), dtype)
        k = jnp.asarray(rng.standard_normal((2, seq, 2, d)), dtype)
        v = jnp.asarray(rng.standard_normal((2, seq, 2, d)), dtype)
        for causal in (False, True):
            def attention(q, k, v, causal=causal):
                return jflash.flash_attention(
                    q, k, v, causal=causal, softmax_scale=scale, return_lse=True,
                    q_segment_ids=q_ids, kv_segment_ids=kv_ids, deterministic=deterministic,
                    softcap=softcap)

            report(attention, q, k, v,
                   f"{jnp.dtype(dtype).name} d{d} segments 2x{seq} causal {causal}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=["bfloat16", "float16"])
    parser.add_argument("--deterministic", action="store_true",
                        help="the backward's deterministic mode (dq added in key-block order)")
    parser.add_argument("--segments", action="store_true",
                        help="packed documents (segment ids) instead of the band calls")
    parser.add_argument("--softcap", type=float, default=None,
                        help="logit soft-capping at this value (the softcap kernels)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    scale = 0.1
    if args.segments:
        run_segments(args.head_dims, args.dtypes, args.deterministic, args.softcap, rng, scale)
        return
    shapes = (  # (batch, seq_q, seq_k, heads, kv_heads, bands, rising)
        (1, 77, 131, 4, 2, ((-77, 131), (-20, -5)), False),
        (6, 700, 650, 16, 4, ((-700, 650), (-700, 650 - 700)), False),
        (2, 300, 700, 8, 2, ((-300, 700), (-300, 700 - 300)), True),
        # The Hopper forward's other band units (sm90/band_units_sm90.h): a
        # window's plateau one query block per unit; causal with seq_q > seq_k,
        # whose first query blocks see no key and go last as single units.
        (2, 1500, 1500, 4, 2, ((-300, 0),), False),
        (4, 700, 300, 8, 2, ((-700, 300 - 700),), False),
    )
    # Natural-log units per 64-key block; steps past exp2's float32 range too.
    rising_bias = np.asarray([0, 3, 10, 10, 25, 24, 125, 120, 130, 60, 140])
    for d, dtype in ((d, jnp.dtype(t)) for d in args.head_dims for t in args.dtypes):
        for b, sq, sk, h, hkv, bands, rising in shapes:
            q = rng.standard_normal((b, sq, h, d))
            k = rng.standard_normal((b, sk, hkv, d))
            if rising:
                q[..., 0] = np.where(np.arange(sq) % 2 == 0, 1.0, -1.0)[None, :, None]
                k[..., 0] = rising_bias[np.minimum(np.arange(sk) // 64, len(rising_bias) - 1)][
                    None, :, None] / scale
            q, k = jnp.asarray(q, dtype), jnp.asarray(k, dtype)
            v = jnp.asarray(rng.standard_normal((b, sk, hkv, d)), dtype)
            for lo, hi in bands:
                def attention(q, k, v, lo=lo, hi=hi):
                    return attention_band(q, k, v, softmax_scale=scale, diag_lo=lo, diag_hi=hi,
                                          deterministic=args.deterministic,
                                          softcap=args.softcap)

                report(attention, q, k, v,
                       f"{jnp.dtype(dtype).name} d{d} {b}x{sq}x{sk}{' rising' if rising else ''} "
                       f"band ({lo}, {hi})")

if __name__ == "__main__":
    main()

"""A small forward + backward run for compute-sanitizer (memcheck, racecheck).

Odd lengths that leave partial tiles at both sequence ends, GQA, one unmasked
and one banded call (with fully masked rows), both dtypes compiled in:

  XLA_PYTHON_CLIENT_PREALLOCATE=false compute-sanitizer --tool memcheck \
      python3 -P csrc/cuda/tools/sanitizer_driver.py [--head-dims 128 192 256]

With JFLASH_CUDA_SMEM_LIMIT=101376 the same cases run the 99 KB tile column
(head dims 192 and 256 then cover its 64 x 32 and 4-warp 32 x 32 backward).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jflash._src.flash_attention import attention_band


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128])
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    for dtype, d in ((jnp.bfloat16, d) for d in args.head_dims):
        q = jnp.asarray(rng.standard_normal((1, 77, 4, d)), dtype)
        k = jnp.asarray(rng.standard_normal((1, 131, 2, d)), dtype)
        v = jnp.asarray(rng.standard_normal((1, 131, 2, d)), dtype)
        for lo, hi in ((-77, 131), (-20, -5)):
            def loss(q, k, v, lo=lo, hi=hi):
                out, lse = attention_band(q, k, v, softmax_scale=0.1, diag_lo=lo, diag_hi=hi)
                return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))

            value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)
            finite = bool(np.isfinite(float(value))) and all(
                np.isfinite(np.asarray(g, np.float32)).all() for g in grads)
            print(f"{jnp.dtype(dtype).name} d{d} band ({lo}, {hi}): loss {float(value):.4f}, finite {finite}")


if __name__ == "__main__":
    main()

"""A small forward + backward run for compute-sanitizer (memcheck, racecheck).

Odd lengths that leave partial tiles at both sequence ends, GQA, one unmasked
and one banded call (with fully masked rows), both dtypes compiled in:

  XLA_PYTHON_CLIENT_PREALLOCATE=false compute-sanitizer --tool memcheck \
      python3 -P csrc/cuda/tools/sanitizer_driver.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jflash._src.flash_attention import attention_band


def main():
    rng = np.random.default_rng(0)
    for dtype in (jnp.bfloat16,):
        q = jnp.asarray(rng.standard_normal((1, 77, 4, 128)), dtype)
        k = jnp.asarray(rng.standard_normal((1, 131, 2, 128)), dtype)
        v = jnp.asarray(rng.standard_normal((1, 131, 2, 128)), dtype)
        for lo, hi in ((-77, 131), (-20, -5)):
            def loss(q, k, v, lo=lo, hi=hi):
                out, lse = attention_band(q, k, v, softmax_scale=0.1, diag_lo=lo, diag_hi=hi)
                return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))

            value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)
            finite = bool(np.isfinite(float(value))) and all(
                np.isfinite(np.asarray(g, np.float32)).all() for g in grads)
            print(f"{jnp.dtype(dtype).name} band ({lo}, {hi}): loss {float(value):.4f}, finite {finite}")


if __name__ == "__main__":
    main()

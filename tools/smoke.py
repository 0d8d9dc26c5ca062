"""First look at a new kernel on the GPU: a few forward calls against the float32
reference, with the kernel family each one ran. Run under `timeout`, before the
test suite, so that a hang costs seconds, not the suite's time limit.

  timeout 120 python3 -P tools/smoke.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jflash._src.ffi import cuda_forward_family
from jflash._src.flash_attention import attention_band
from jflash.reference import attention_band as reference_band

# (batch, seq_q, seq_k, heads, kv heads, head_dim, diag_lo, diag_hi); None: unmasked.
CASES = [
    (1, 128, 128, 2, 2, 128, None, None),
    (1, 1000, 1000, 4, 2, 128, -1000, 0),
    (1, 300, 2049, 2, 1, 64, None, None),
    (1, 250, 700, 2, 2, 256, -300, 100),
    (2, 4096, 4096, 16, 16, 128, None, None),
]


def main():
    print("device:", jax.devices()[0].device_kind)
    rng = np.random.default_rng(0)
    for b, sq, sk, h, hkv, d, lo, hi in CASES:
        banded = lo is not None
        lo, hi = (-sq, sk) if lo is None else (lo, hi)
        kw = dict(softmax_scale=d**-0.5, diag_lo=lo, diag_hi=hi)
        q = jnp.asarray(rng.standard_normal((b, sq, h, d)), jnp.bfloat16)
        k = jnp.asarray(rng.standard_normal((b, sk, hkv, d)), jnp.bfloat16)
        v = jnp.asarray(rng.standard_normal((b, sk, hkv, d)), jnp.bfloat16)
        out, lse = jax.block_until_ready(attention_band(q, k, v, **kw))
        t_out, t_lse = reference_band(q, k, v, **kw)
        p_out, _ = reference_band(q, k, v, dtype=jnp.bfloat16, **kw)
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - t_out)))
        plain = float(jnp.max(jnp.abs(p_out.astype(jnp.float32) - t_out)))
        finite = jnp.isfinite(t_lse)
        lse_err = float(jnp.max(jnp.where(finite, jnp.abs(lse - t_lse), 0.0)))
        same_inf = bool(jnp.all(jnp.isfinite(lse) == finite))
        print(f"b{b} q{sq} k{sk} h{h}/{hkv} d{d} band={banded} "
              f"family={cuda_forward_family(jnp.bfloat16, d, banded)}: "
              f"out err {err:.3g} (plain bf16 {plain:.3g}), lse err {lse_err:.3g}, "
              f"masked rows agree {same_inf}, nan {bool(jnp.isnan(out).any())}")


if __name__ == "__main__":
    main()

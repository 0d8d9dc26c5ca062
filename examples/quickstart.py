"""jflash in ten lines: causal GQA attention, its lse, and a gradient.

Runs on the GPU kernels when jax sees a GPU, on the C++ CPU kernel otherwise.
"""

import jax
import jax.numpy as jnp

import jflash

key_q, key_k, key_v = jax.random.split(jax.random.key(0), 3)
batch, seq_q, seq_k, num_heads, num_heads_kv, head_dim = 2, 256, 384, 8, 2, 64
q = jax.random.normal(key_q, (batch, seq_q, num_heads, head_dim), jnp.bfloat16)
k = jax.random.normal(key_k, (batch, seq_k, num_heads_kv, head_dim), jnp.bfloat16)
v = jax.random.normal(key_v, (batch, seq_k, num_heads_kv, head_dim), jnp.bfloat16)

out, lse = jax.jit(lambda q, k, v: jflash.flash_attention(q, k, v, causal=True, return_lse=True))(q, k, v)
ref = jflash.reference.attention(q, k, v, causal=True)
print(f"backend {jax.default_backend()} (CUDA kernels built: {jflash.HAS_CUDA_KERNELS}): out {out.shape} {out.dtype}, lse {lse.shape} {lse.dtype}")
print(f"max |jflash - reference| = {float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32)))):.2e}")


def loss(q, k, v):
    return jnp.sum(jflash.flash_attention(q, k, v, causal=True).astype(jnp.float32) ** 2)


dq, dk, dv = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
print(f"gradients: dq {dq.shape}, dk {dk.shape}, dv {dv.shape} (GQA summed into kv heads)")

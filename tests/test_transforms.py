"""jit, grad, vmap (folded into one kernel call), checkpoint, shard_map, pmap."""

from __future__ import annotations

import functools

import jax
import jax.test_util
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jflash
import reference64
from jflash._src.ffi import BWD_TARGET, FWD_TARGET
from checks import assert_within_rule, plain_dtype


def _inputs(rng, batch=2, seq_q=33, seq_k=47, heads=4, heads_kv=2, head_dim=64, dtype=jnp.float32):
    q = rng.standard_normal((batch, seq_q, heads, head_dim))
    k = rng.standard_normal((batch, seq_k, heads_kv, head_dim))
    v = rng.standard_normal((batch, seq_k, heads_kv, head_dim))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def _count(hlo_text, target):
    return hlo_text.count(f'custom_call_target="{target}"')


def test_vmap_is_one_kernel_call(rng):
    """Two vmapped axes over batch become one launch over the folded batch."""
    q, k, v = _inputs(rng, dtype=jnp.bfloat16)
    qs, ks, vs = (jnp.stack([x * (i + 1) for i in range(3)]) for x in (q, k, v))
    qs, ks, vs = (jnp.stack([x, -x]) for x in (qs, ks, vs))  # [2, 3, batch, ...]

    attend = functools.partial(jflash.flash_attention, causal=True)
    batched = jax.jit(jax.vmap(jax.vmap(attend)))
    hlo = batched.lower(qs, ks, vs).compile().as_text()
    assert _count(hlo, FWD_TARGET) == 1
    assert "while" not in hlo  # not a sequential loop

    out = batched(qs, ks, vs)
    for i in range(2):
        for j in range(3):
            np.testing.assert_array_equal(
                np.asarray(out[i, j], np.float32), np.asarray(attend(qs[i, j], ks[i, j], vs[i, j]), np.float32)
            )


def test_vmap_of_grad_with_unbatched_kv(rng):
    """vmap with in_axes=None for k/v, through the backward kernel."""
    q, k, v = _inputs(rng)
    qs = jnp.stack([q, 2 * q, -q])

    def loss(q, k, v):
        return jnp.sum(jflash.flash_attention(q, k, v, causal=True) ** 2)

    grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), in_axes=(0, None, None)))(qs, k, v)
    for i in range(3):
        expected = jax.grad(loss, argnums=(0, 1, 2))(qs[i], k, v)
        for got, want in zip(grads, expected):
            np.testing.assert_allclose(np.asarray(got[i]), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_check_grads_numerically(rng):
    """Finite differences against the custom_vjp (float32, small problem; on GPU at
    precision "highest", whose 3xTF32 kernels are float32-class: TF32's rounding
    would swamp the differences)."""
    q, k, v = _inputs(rng, batch=1, seq_q=9, seq_k=13, heads=2, heads_kv=1, head_dim=32)
    jax.test_util.check_grads(
        lambda q, k, v: jflash.flash_attention(q, k, v, causal=True, precision="highest"),
        (q, k, v),
        order=1,
        modes=["rev"],
        atol=2e-2,
        rtol=2e-2,
    )


@pytest.mark.parametrize("policy,forward_calls", [("save_names", 1), ("nothing", 2)])
def test_checkpoint_policy_can_save_out_and_lse(rng, policy, forward_calls):
    """With out/lse saved by name the backward does not rerun the forward kernel;
    with nothing saveable it does (rematerialization)."""
    q, k, v = _inputs(rng, dtype=jnp.bfloat16)
    policies = {
        "save_names": jax.checkpoint_policies.save_only_these_names(jflash.OUT_NAME, jflash.LSE_NAME),
        "nothing": jax.checkpoint_policies.nothing_saveable,
    }

    @functools.partial(jax.checkpoint, policy=policies[policy])
    def block(q, k, v):
        return jnp.sin(jflash.flash_attention(q, k, v, causal=True))

    def loss(q, k, v):
        return jnp.sum(block(q, k, v) ** 2)

    grad_fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    # Compiled HLO: jax.checkpoint's optimization barriers keep XLA from merging
    # a recomputed forward with the original, so the count is what remat did.
    hlo = grad_fn.lower(q, k, v).compile().as_text()
    assert _count(hlo, FWD_TARGET) == forward_calls
    assert _count(hlo, BWD_TARGET) == 1
    unchecked = jax.jit(jax.grad(lambda q, k, v: jnp.sum(jnp.sin(jflash.flash_attention(q, k, v, causal=True)) ** 2),
                                 argnums=(0, 1, 2)))
    for got, want in zip(grad_fn(q, k, v), unchecked(q, k, v)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def _mesh():
    devices = jax.devices("cpu")
    if len(devices) < 8:
        pytest.skip("needs 8 host devices (tests/conftest.py sets XLA_FLAGS)")
    return Mesh(np.array(devices[:8]).reshape(4, 2), ("data", "model"))


def test_shard_map_forward_backward(rng):
    """Batch over 'data', heads over 'model': each shard runs the kernel locally."""
    mesh = _mesh()
    with jax.default_device(jax.devices("cpu")[0]):
        q, k, v = _inputs(rng, batch=4, heads=4, heads_kv=2)
        spec = P("data", None, "model", None)

        def local_loss(q, k, v):
            out = jflash.flash_attention(q, k, v, causal=True)
            return jax.lax.psum(jnp.sum(out**2), ("data", "model"))

        sharded = jax.jit(
            jax.shard_map(
                jax.value_and_grad(local_loss, argnums=(0, 1, 2)),
                mesh=mesh,
                in_specs=(spec, spec, spec),
                out_specs=(P(), (spec, spec, spec)),
            )
        )
        value, grads = sharded(q, k, v)
        want_value, want_grads = jax.value_and_grad(
            lambda q, k, v: jnp.sum(jflash.flash_attention(q, k, v, causal=True) ** 2), argnums=(0, 1, 2)
        )(q, k, v)
        np.testing.assert_allclose(float(value), float(want_value), rtol=1e-5)
        for got, want in zip(grads, want_grads):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_pmap_forward_backward(rng):
    devices = jax.devices("cpu")
    if len(devices) < 8:
        pytest.skip("needs 8 host devices")
    with jax.default_device(devices[0]):
        q, k, v = _inputs(rng, batch=8, seq_q=21, seq_k=21, heads=2, heads_kv=2)
        per_device = [x.reshape(8, 1, *x.shape[1:]) for x in (q, k, v)]

        def step(q, k, v):
            return jax.value_and_grad(lambda q: jnp.sum(jflash.flash_attention(q, k, v) ** 2))(q)

        values, dq = jax.pmap(step, devices=devices[:8])(*per_device)
        for i in range(8):
            want_value, want_dq = jax.value_and_grad(
                lambda q: jnp.sum(jflash.flash_attention(q, k[i : i + 1], v[i : i + 1]) ** 2)
            )(q[i : i + 1])
            np.testing.assert_allclose(float(values[i]), float(want_value), rtol=1e-5)
            np.testing.assert_allclose(np.asarray(dq[i]), np.asarray(want_dq), rtol=1e-5, atol=1e-6)


def test_jit_matches_eager_and_truth(rng):
    q, k, v = _inputs(rng, dtype=jnp.bfloat16)
    eager = jflash.flash_attention(q, k, v)
    jitted = jax.jit(jflash.flash_attention)(q, k, v)
    np.testing.assert_array_equal(np.asarray(eager, np.float32), np.asarray(jitted, np.float32))
    truth, _, _ = reference64.forward(
        *(np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v)), 0.125, -33, 47
    )
    plain = jflash.reference.attention(q, k, v)  # float32 math; judge against bf16 plain below
    plain_bf16 = jflash.reference.attention_band(
        q, k, v, softmax_scale=0.125, diag_lo=-33, diag_hi=47, dtype=plain_dtype(jnp.bfloat16)
    )[0]
    assert_within_rule("out", jitted, plain_bf16, truth, jnp.bfloat16)
    assert np.max(np.abs(np.asarray(plain, np.float64) - truth)) < 1e-2

"""jax.export round trip of jitted functions that call jflash.

jflash's FFI targets are not in jax's list of custom calls with a stable ABI,
so exporting needs DisabledSafetyCheck.custom_call for each target; the
targets' names carry an ABI version (jflash_fwd_v5) so that a serialized
program never binds to a changed handler. The export is lowered for CPU and
CUDA together (no GPU needed to lower), and the deserialized function must run
here and give the original function's results.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import jflash
from jflash._src import ffi

DISABLED = [export.DisabledSafetyCheck.custom_call(t) for t in (ffi.FWD_TARGET, ffi.BWD_TARGET)]


def _attention_loss(q, k, v):
    out = jflash.dot_product_attention(q, k, v, is_causal=True)
    return jnp.sum(out.astype(jnp.float32) ** 2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=str)
def test_round_trip_forward_and_backward(rng, dtype):
    pytest.importorskip("flatbuffers", reason="jax.export serialization needs flatbuffers")
    q = jnp.asarray(rng.standard_normal((2, 24, 4, 32)), dtype)
    k = jnp.asarray(rng.standard_normal((2, 40, 2, 32)), dtype)
    v = jnp.asarray(rng.standard_normal((2, 40, 2, 32)), dtype)
    fn = jax.jit(jax.value_and_grad(_attention_loss, argnums=(0, 1, 2)))

    exported = export.export(fn, platforms=("cpu", "cuda"), disabled_checks=DISABLED)(q, k, v)
    assert exported.platforms == ("cpu", "cuda")
    text = exported.mlir_module()
    assert ffi.FWD_TARGET in text and ffi.BWD_TARGET in text

    restored = export.deserialize(exported.serialize())
    got = restored.call(q, k, v)
    want = fn(q, k, v)
    jax.tree.map(lambda g, w: np.testing.assert_array_equal(np.asarray(g), np.asarray(w)), got,
                 want)


def test_export_without_disabled_checks_names_the_target(rng):
    q = jnp.asarray(rng.standard_normal((1, 8, 2, 32)), jnp.float32)
    with pytest.raises(ValueError, match=ffi.FWD_TARGET):
        export.export(jax.jit(jflash.flash_attention), platforms=("cpu",))(q, q, q)


def test_round_trip_of_shard_map_over_devices(rng):
    """Multi-device programs export through shard_map (per-device code holds the
    plain FFI call). A jit-partitioned one does not: custom_partitioning's
    partitioner is a Python callback, which jax.export cannot serialize."""
    pytest.importorskip("flatbuffers", reason="jax.export serialization needs flatbuffers")
    host_cpus = jax.devices("cpu")[:8]  # tests/conftest.py; also present on a GPU machine
    if len(host_cpus) < 8:
        pytest.skip("needs 8 host CPU devices")
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=host_cpus)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    q = jax.device_put(jnp.asarray(rng.standard_normal((8, 16, 2, 32)), jnp.float32), sharding)

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=jax.P("data"), out_specs=jax.P("data"))
    def attend(q):
        return jflash.flash_attention(q, q, q, causal=True)

    exported = export.export(attend, platforms=("cpu", "cuda"), disabled_checks=DISABLED)(
        jax.ShapeDtypeStruct(q.shape, q.dtype, sharding=sharding)
    )
    assert exported.nr_devices == 8
    restored = export.deserialize(exported.serialize())
    np.testing.assert_array_equal(restored.call(q), attend(q))

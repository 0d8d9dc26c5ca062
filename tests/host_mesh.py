"""The 8 host CPU devices of tests/conftest.py, for the sharding tests.

Also on a GPU machine (one GPU cannot host these meshes): partitioning is
platform independent, and the unsharded comparisons run on the same CPU
devices. A module that imports on_host_cpus runs each of its tests with the
first of them as jax's default device.
"""

from __future__ import annotations

import jax
import pytest
from jax.sharding import AxisType

HOST_CPUS = jax.devices("cpu")[:8]
needs_8_cpus = pytest.mark.skipif(len(HOST_CPUS) < 8, reason="needs 8 host CPU devices")


@pytest.fixture(autouse=True)
def on_host_cpus():
    with jax.default_device(HOST_CPUS[0]):
        yield


def mesh(axis_type=AxisType.Auto):
    """A (2, 4) mesh over the host CPUs, axes ("data", "model")."""
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type,) * 2,
                         devices=HOST_CPUS)

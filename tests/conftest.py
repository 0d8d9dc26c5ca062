"""Test setup: 8 host CPU devices (for shard_map/pmap/sharding tests), fresh seeds.

XLA_FLAGS must be set before jax initializes its backends, hence here.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def rng(request):
    """A NumPy generator seeded per test (its node id), so that failures reproduce and
    every test still draws its own fresh inputs."""
    seed = abs(hash(request.node.nodeid)) % (2**32)
    return np.random.default_rng(seed)

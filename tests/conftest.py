"""Test setup: 8 host CPU devices (for shard_map/pmap/sharding tests), fresh seeds.

XLA_FLAGS must be set before jax initializes its backends, hence here.
"""

import os
import re
import zlib

# On a GPU the tests' references (float32 and same-dtype attention in jnp) run
# through XLA, and every test brings new shapes. XLA's default gemm path
# autotunes Triton kernels per shape and compiles each candidate with ptxas:
# on an H100 (jax 0.11.2) tests/test_cuda_specific.py's bfloat16 reference
# cases took 15-25 s each, mostly compiling, and overran a 300 s budget after
# 7-14 of 76; without autotuning ~6.5 s each; with cuBLAS gemms and no
# autotuning the 76 (47 run, the rest skipped in a subset build) took 123 s. The references' numbers stay those
# of a correct gemm either way, but not their precision at DEFAULT: cuBLAS ran
# some of a float32 attention's dots at float32 where XLA's Triton gemms run TF32,
# so tests/test_precision.py compiles its XLA yardstick with XLA's own gemm
# defaults. Flags the caller sets come later and win.
_GPU_TEST_FLAGS = "--xla_gpu_autotune_level=0 --xla_gpu_enable_triton_gemm=false"
os.environ["XLA_FLAGS"] = " ".join(
    f for f in (_GPU_TEST_FLAGS, os.environ.get("XLA_FLAGS", ""),
                "--xla_force_host_platform_device_count=8") if f
)

import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def rng(request):
    """A NumPy generator seeded per test (its node id), so that failures reproduce and
    every test still draws its own fresh inputs. crc32, not hash(): Python
    salts str hashes per process, which gave every run new inputs."""
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)


# A development build with JFLASH_CUDA_SUBSET (README, "Build") leaves kernels
# out, and a call that needs one fails in the handler with an error naming the
# subset. Such a test reports a skip, not a failure; in a full build ("all") a
# missing kernel is a defect and still fails.
_LEFT_OUT = re.compile(r"this build has no CUDA .*? it was built with JFLASH_CUDA_SUBSET=([^;]+);", re.S)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed or call.excinfo is None:
        return
    left_out = _LEFT_OUT.search(str(call.excinfo.value))
    if left_out and left_out.group(1) != "all":
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0,
                           f"Skipped: a kernel left out of this build (JFLASH_CUDA_SUBSET={left_out.group(1)})")

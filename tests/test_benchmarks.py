"""The benchmarks' logic on the CPU, at tiny sizes: each script runs as a user
runs it (its own process, --allow-cpu where it has one) and writes the records
its options promise. Timings here mean nothing."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


def _run(script, *args):
    result = subprocess.run([sys.executable, "-P", str(BENCHMARKS / script), *map(str, args)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


@pytest.fixture(autouse=True)
def _one_cpu_device(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "")  # not conftest's 8 host devices


def test_gpu_benchmark_data_modes(tmp_path):
    out = tmp_path / "gpu.json"
    stdout = _run("gpu_benchmark.py", "--allow-cpu", "--head-dims", 32, "--seqs", 128,
                  "--tokens", 128, "--model-dim", 64, "--causal", "yes", "--impls", "jflash,xla",
                  "--data", "normal", "rising", "peaked", "--target-ms", 1, "--repeats", 1,
                  "--min-total-s", 0, "--no-check", "--out", out)
    records = json.loads(out.read_text())["records"]
    # fwd, fwdbwd and the derived bwd, for two impls, per data mode
    assert [r["data"] for r in records] == [d for d in ("normal", "rising", "peaked")
                                            for _ in range(6)]
    assert all(r["status"] == "ok" for r in records), records
    table = stdout[stdout.index("D  seq"):]
    assert table.split("\n")[0].split()[4] == "data"
    for data in ("normal", "rising", "peaked"):
        assert sum(line.split()[4] == data for line in table.split("\n")[2:] if line) == 3


def test_data_modes_scale_the_inputs():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import common
    finally:
        sys.path.pop(0)
    import numpy as np

    normal, rising, peaked = (common.random_qkv(3, 2, 64, 2, 16, "float32", data=d)
                              for d in common.DATA_MODES)
    np.testing.assert_array_equal(peaked[0], normal[0] * common.PEAKED_QUERY_SCALE)
    np.testing.assert_array_equal(peaked[1:], normal[1:])
    ramp = np.linspace(*common.RISING_KEY_SCALE, 64, dtype=np.float32)[None, :, None, None]
    np.testing.assert_allclose(rising[1], normal[1] * ramp, rtol=1e-6)
    np.testing.assert_array_equal(rising[0], normal[0])
    with pytest.raises(ValueError, match="data must be one of"):
        common.random_qkv(0, 1, 8, 1, 8, "float32", data="uniform")


def test_dq_precision_probe(tmp_path):
    out = tmp_path / "dq.json"
    stdout = _run("dq_precision.py", "--head-dims", 64, "--seqs", 128, "--heads", 1,
                  "--out", out)
    payload = json.loads(out.read_text())
    assert payload["environment"]["jax_version"]
    by_impl = {r["impl"]: r for r in payload["records"]}
    assert set(by_impl) == {"jflash", "xla", "f64 bf16-O"}
    assert all(r["status"] == "ok" for r in by_impl.values())
    # The rounding of delta is jflash's error (CPU twin: O read back in bfloat16)
    # and it dwarfs xla's on these inputs.
    jflash_err = by_impl["jflash"]["max_abs_dq_err"]
    assert jflash_err == pytest.approx(by_impl["f64 bf16-O"]["max_abs_dq_err"], rel=0.1)
    assert jflash_err > 10 * by_impl["xla"]["max_abs_dq_err"]
    assert "true max|dq|" in stdout


def test_segments_benchmark_random_documents(tmp_path):
    out = tmp_path / "segments.json"
    stdout = _run("segments_benchmark.py", "--allow-cpu", "--seq", 512, "--tokens", 512,
                  "--head-dims", 32, "--model-dim", 64, "--doc-lens", "--random-docs",
                  "--doc-min", 32, "--doc-max", 160, "--modes", "fwd", "--iterations", 1,
                  "--out", out)
    (record,) = json.loads(out.read_text())["records"]
    lengths = record["doc_lens"]
    assert sum(lengths) == 512 and all(32 <= n <= 160 for n in lengths)
    assert record["separate_calls"] == len(set(lengths))
    assert record["packed_ms"] > 0 and record["separate_ms"] > 0
    assert f"random {len(lengths)}" in stdout

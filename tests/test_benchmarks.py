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


def test_varlen_benchmark(tmp_path):
    out = tmp_path / "varlen.json"
    stdout = _run("varlen_benchmark.py", "--allow-cpu", "--num-seqs", 3, "--min-len", 16,
                  "--max-len", 48, "--heads", 2, "--head-dim", 32, "--causal", "yes",
                  "--modes", "fwd", "--target-ms", 1, "--repeats", 1, "--min-total-s", 0,
                  "--check", "--out", out)
    payload = json.loads(out.read_text())
    lengths = payload["lengths"]
    assert len(lengths) == 3 and all(16 <= n <= 48 for n in lengths)
    by_impl = {r["impl"]: r for r in payload["records"]}
    assert set(by_impl) == {"jflash_varlen", "jflash_mean", "cudnn_padded", "jflash_padded"}
    assert by_impl["cudnn_padded"]["status"] == "unavailable"
    # Causal useful FLOPs: the visible pairs of each sequence, L * (L + 1) / 2.
    flops = 4 * 2 * 32 * sum(n * (n + 1) // 2 for n in lengths)
    batch, seq = payload["mean_shape"]["batch"], payload["mean_shape"]["seq"]
    assert by_impl["jflash_mean"]["flops"] == 4 * 2 * 32 * batch * seq * (seq + 1) // 2
    for impl in ("jflash_varlen", "jflash_mean", "jflash_padded"):
        r = by_impl[impl]
        assert r["status"] == "ok", r
        assert r["tflops"] > 0 and r["rel_err"] < 2e-2
        if impl != "jflash_mean":
            assert r["flops"] == flops
    table = stdout[stdout.index("causal"):]
    assert "varlen/mean" in table and ">= 0.90" in table


def test_band_pairs():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import common
    finally:
        sys.path.pop(0)
    import numpy as np

    for sq, sk in ((1, 1), (7, 7), (9, 4), (4, 9)):
        offset = np.arange(sk)[None, :] - np.arange(sq)[:, None]
        for lo in (None, -20, -3, 0, 2):
            for hi in (None, -2, 0, 3, 20):
                visible = np.ones((sq, sk), bool)
                if lo is not None:
                    visible &= offset >= lo
                if hi is not None:
                    visible &= offset <= hi
                assert common.band_pairs(sq, sk, lo, hi) == visible.sum(), (sq, sk, lo, hi)
    assert common.band_pairs(16384, 16384, hi=0) == 16384 * 16385 // 2


def test_gpu_benchmark_window(tmp_path):
    out = tmp_path / "window.json"
    stdout = _run("gpu_benchmark.py", "--allow-cpu", "--head-dims", 32, "--seqs", 128,
                  "--tokens", 128, "--model-dim", 64, "--causal", "both", "--impls", "jflash,cudnn",
                  "--window", 16, "--target-ms", 1, "--repeats", 1, "--min-total-s", 0,
                  "--out", out)
    records = json.loads(out.read_text())["records"]
    windowed = [r for r in records if r["impl"] in ("jflash_window", "cudnn_window")]
    # causal rows only: fwd, fwdbwd and the derived bwd of each window impl
    assert len(windowed) == 6 and all(r["causal"] and r["window"] == [16, 0] for r in windowed)
    pairs = 17 * 128 - 16 * 17 // 2  # j - i in [-16, 0] on 128 x 128
    factor = {"fwd": 1.0, "fwdbwd": 3.5, "bwd": 2.5}
    for r in windowed:
        assert r["flops"] == 4 * 1 * 2 * 32 * pairs * factor[r["mode"]]
    jflash_window = {r["mode"]: r for r in windowed if r["impl"] == "jflash_window"}
    assert all(r["status"] == "ok" for r in jflash_window.values())
    # checked against a windowed float32 reference: a wrong band would be far off
    assert max(jflash_window["fwdbwd"]["rel_err"].values()) < 2e-2
    assert all(r["status"] != "ok" for r in windowed if r["impl"] == "cudnn_window")
    header = stdout[stdout.index(" D  seq"):].split("\n")[0]
    assert "window/causal" in header and "cudnn window/causal" in header
    lines = [line.split() for line in stdout[stdout.index(" D  seq"):].split("\n")[2:] if line]
    causal_fwd = next(c for c in lines if c[5] == "yes" and c[6] == "fwd")
    assert float(causal_fwd[-4]) > 0 and float(causal_fwd[-3]) > 0  # jflash window, window/causal

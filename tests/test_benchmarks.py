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


def _ok(record):
    """A record that ran; a derived backward row at these tiny sizes may instead
    say that the fwdbwd median came out below the fwd median (a busy CPU)."""
    return record["status"] == "ok" or (
        record["mode"] == "bwd" and "timing noise" in record.get("note", ""))


@pytest.fixture(autouse=True)
def _one_cpu_device(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "")  # not conftest's 8 host devices
    # The CPU also where a GPU is: these check the scripts' logic and records (a
    # GPU's rows differ by design, e.g. cuDNN available, float32 on TF32).
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")


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
    assert all(_ok(r) for r in records), records
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


def test_results_name_no_machine_folders():
    sys.path.insert(0, str(BENCHMARKS))
    import argparse

    import common

    args = argparse.Namespace(out=pathlib.Path("/some/machine/dir/run.json"), seqs=[1, 2])
    assert common.args_record(args, extra=pathlib.Path("/x/y.json")) == {
        "out": "run.json", "seqs": [1, 2], "extra": "y.json"}
    root = str(BENCHMARKS.parent)
    text = (f'File "{root}/benchmarks/common.py", line 1\n'
            'File "/opt/env/lib/python3.12/site-packages/jax/core.py", line 2\n'
            'File "/elsewhere/tool.py", line 3\n')
    assert common.portable_paths(text) == (
        'File "benchmarks/common.py", line 1\n'
        'File "site-packages/jax/core.py", line 2\n'
        'File "tool.py", line 3\n')
    assert common.jflash_source(f"{root}/jflash/__init__.py") == "source tree"
    assert common.jflash_source("/opt/env/site-packages/jflash/__init__.py") == "installed"


def test_varlen_lengths_rounded():
    sys.path.insert(0, str(BENCHMARKS))
    import varlen_benchmark

    drawn = varlen_benchmark.random_lengths(40, 1, 300, seed=3)
    rounded = varlen_benchmark.random_lengths(40, 1, 300, seed=3, multiple=128)
    assert rounded == [-(-n // 128) * 128 for n in drawn]
    assert all(n % 128 == 0 for n in rounded) and any(n % 128 for n in drawn)


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
    assert all(_ok(r) for r in jflash_window.values())
    # checked against a windowed float32 reference: a wrong band would be far off
    assert max(jflash_window["fwdbwd"]["rel_err"].values()) < 2e-2
    assert all(r["status"] != "ok" for r in windowed if r["impl"] == "cudnn_window")
    header = stdout[stdout.index(" D  seq"):].split("\n")[0]
    assert "window/causal" in header and "cudnn window/causal" in header
    lines = [line.split() for line in stdout[stdout.index(" D  seq"):].split("\n")[2:] if line]
    causal_fwd = next(c for c in lines if c[5] == "yes" and c[6] == "fwd")
    assert float(causal_fwd[-4]) > 0 and float(causal_fwd[-3]) > 0  # jflash window, window/causal


def _common():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import common
    finally:
        sys.path.pop(0)
    return common


def test_flops_with_value_head_dim():
    common = _common()
    # Dv == D (or None): the old convention exactly, 4 B H Sq Sk D and 2.5x / 3.5x of it
    for b, sq, sk, h, d in ((1, 128, 128, 2, 32), (3, 1000, 777, 5, 72),
                            (1, 16384, 16384, 16, 256)):
        for causal in (False, True):
            fwd = 4.0 * b * h * sq * sk * d / (2 if causal else 1)
            for dv in (None, d):
                for mode, factor in (("fwd", 1.0), ("bwd", 2.5), ("fwdbwd", 3.5)):
                    got = common.attention_flops(b, sq, sk, h, d, causal=causal, mode=mode,
                                                 value_head_dim=dv)
                    assert got == fwd * factor, (b, sq, sk, h, d, causal, dv, mode)
    # D 192, Dv 128 by hand: fwd QK^T 2*192 + PV 2*128 = 640 FLOPs per pair and head;
    # bwd QK^T, dQ, dK 3 * 2*192 + dP, dV 2 * 2*128 = 1664
    pairs = 2 * 16 * 4096 * 4096  # B 2, H 16, S 4096
    assert common.attention_flops(2, 4096, 4096, 16, 192, causal=False, value_head_dim=128) \
        == pairs * 640
    assert common.attention_flops(2, 4096, 4096, 16, 192, causal=False, mode="bwd",
                                  value_head_dim=128) == pairs * 1664
    assert common.attention_flops(2, 4096, 4096, 16, 192, causal=True, mode="fwdbwd",
                                  value_head_dim=128) == pairs * (640 + 1664) / 2
    # the band: the same per pair, on the exact pair count
    pairs = common.band_pairs(128, 128, -16, 0)
    assert common.band_flops(1, 128, 128, 2, 48, lo=-16, hi=0, mode="bwd", value_head_dim=32) \
        == 2 * pairs * 2 * (3 * 48 + 2 * 32)
    assert common.band_flops(1, 128, 128, 2, 48, lo=-16, hi=0, mode="fwdbwd") \
        == 4 * 2 * 48 * pairs * 3.5


def test_random_qkv_value_head_dim():
    common = _common()
    import numpy as np

    q, k, v, cotangent = common.random_qkv(5, 2, 64, 3, 48, "float32", value_head_dim=16)
    assert q.shape == k.shape == (2, 64, 3, 48) and v.shape == cotangent.shape == (2, 64, 3, 16)
    same = common.random_qkv(5, 2, 64, 3, 48, "float32")
    np.testing.assert_array_equal(q, same[0])
    np.testing.assert_array_equal(k, same[1])
    assert float(np.std(v)) == pytest.approx(1.0, abs=0.1)


def test_gpu_benchmark_value_head_dim(tmp_path):
    out = tmp_path / "mla.json"
    stdout = _run("gpu_benchmark.py", "--allow-cpu", "--head-dims", 48, "--value-head-dim", 32,
                  "--seqs", 128, "--tokens", 256, "--model-dim", 96, "--causal", "both",
                  "--impls", "jflash,cudnn,xla", "--target-ms", 1, "--repeats", 1,
                  "--min-total-s", 0, "--out", out)
    payload = json.loads(out.read_text())
    records = payload["records"]
    assert payload["args"]["value_head_dim"] == 32
    # 2 causal x 3 impls x (fwd, fwdbwd, derived bwd)
    assert len(records) == 18
    assert all(r["head_dim"] == 48 and r["value_head_dim"] == 32 for r in records)
    pairs = {False: 2 * 2 * 128 * 128, True: 2 * 2 * 128 * 128 / 2}  # B 2, H 2
    per_pair = {"fwd": 2 * (48 + 32), "bwd": 2 * (3 * 48 + 2 * 32)}
    per_pair["fwdbwd"] = per_pair["fwd"] + per_pair["bwd"]
    for r in records:
        assert r["flops"] == pairs[r["causal"]] * per_pair[r["mode"]], r
    jflash = [r for r in records if r["impl"] == "jflash"]
    assert len(jflash) == 6 and all(_ok(r) for r in jflash), jflash
    for r in jflash:
        if r["status"] != "ok":
            continue  # a derived backward row below the timing noise (_ok)
        assert r["tflops"] > 0 and r["median_s"] > 0
        assert r["tflops"] == pytest.approx(r["flops"] / r["median_s"] / 1e12)
        if r["mode"] != "bwd":
            # out [.., 32] (and dq, dk, dv) against the float32 reference: a wrong
            # shape would not compare, a wrong Dv slice would be far off
            assert set(r["rel_err"]) == ({"out"} if r["mode"] == "fwd"
                                         else {"out", "dq", "dk", "dv"})
            assert max(r["rel_err"].values()) < 2e-2
    xla = [r for r in records if r["impl"] == "xla" and r["mode"] != "bwd"]
    assert all(r["status"] == "unavailable" and "rejects value head dim 32" in r["note"]
               for r in xla), xla
    table = stdout[stdout.index(" D  Dv"):].split("\n")
    assert table[0].split()[:3] == ["D", "Dv", "seq"]
    rows = [line.split() for line in table[2:] if line]
    assert len(rows) == 6 and all(row[:2] == ["48", "32"] for row in rows)
    assert "value head dim 32" in stdout and "2BHS^2(D+Dv)" in stdout


def test_gpu_benchmark_value_head_dim_with_feed_out_fwd_is_refused():
    result = subprocess.run([sys.executable, "-P", str(BENCHMARKS / "gpu_benchmark.py"),
                             "--allow-cpu", "--head-dims", "48", "--value-head-dim", "32",
                             "--feed", "out", "--modes", "fwd"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 2 and "--feed out" in result.stderr


def test_float32_benchmark(tmp_path):
    out = tmp_path / "float32.json"
    stdout = _run("float32_benchmark.py", "--allow-cpu", "--shapes", "32:128", "--tokens", 128,
                  "--model-dim", 64, "--causal", "both", "--target-ms", 1, "--repeats", 1,
                  "--min-total-s", 0, "--check-rows", 64, "--out", out)
    payload = json.loads(out.read_text())
    assert payload["environment"]["jax_version"] and payload["environment"]["jflash_commit"]
    records = payload["records"]
    impls = ("jflash_tf32", "jflash_3xtf32", "xla_default", "xla_highest")
    # 2 causal x 2 modes x 4 impls, every one run, in that order
    assert [r["impl"] for r in records] == [i for _ in range(4) for i in impls]
    assert all(r["status"] == "ok" and r["dtype"] == "float32" for r in records), records
    for r in records:
        flops = 4 * 1 * 2 * 128 * 128 * 32 * (3.5 if r["mode"] == "fwdbwd" else 1.0)
        assert r["flops"] == flops / (2 if r["causal"] else 1)
        assert r["tflops"] == pytest.approx(r["flops"] / r["median_s"] / 1e12)
        assert r["precision"] == ("highest" if r["impl"].endswith(("3xtf32", "highest"))
                                  else "default")
        if r["mode"] == "fwd":  # float32 on CPU: every row is float32-accurate
            assert 0 <= r["rel_max_err"] < 1e-5
        else:
            assert "max_abs_err" not in r
    header = stdout[stdout.index(" D  seq"):].split("\n")[0]
    assert "3x/1x" in header and "err xla_highest" in header


def test_backward_record_when_fwdbwd_times_below_fwd():
    """The derived backward row of a noisy tiny run: no rate, a reason, and a
    summary table that still prints (its ratios left empty)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import gpu_benchmark
    finally:
        sys.path.pop(0)
    shape = dict(impl="jflash", head_dim=32, seq=128, batch=1, heads=2, kv_heads=2, causal=True,
                 dtype="float32", data="normal", status="ok")
    fwd = dict(shape, mode="fwd", flops=1e9, median_s=4.9e-4, tflops=1e9 / 4.9e-4 / 1e12)
    fwdbwd = dict(shape, mode="fwdbwd", flops=3.5e9, median_s=3.8e-4, tflops=3.5e9 / 3.8e-4 / 1e12)
    bwd = gpu_benchmark.backward_record(fwd, fwdbwd)
    assert bwd["status"] == "not run" and "timing noise" in bwd["note"] and "tflops" in bwd
    assert bwd["tflops"] is None
    window = [dict(r, impl="jflash_window", window=[16, 0]) for r in (fwd, fwdbwd, bwd)]
    table, _ = gpu_benchmark.summary_table([fwd, fwdbwd, bwd, *window])
    assert "window/causal" in table
    ok = gpu_benchmark.backward_record(fwd, dict(fwdbwd, median_s=9.8e-4))
    assert ok["status"] == "ok" and ok["tflops"] == pytest.approx(2.5e9 / 4.9e-4 / 1e12)


def test_context_parallel_chunks(tmp_path):
    """The ring's chunk calls on one device: --smoke checks them against one
    call (out and gradients, causal zigzag and unmasked) before timing."""
    out = tmp_path / "chunks.json"
    stdout = _run("context_parallel_chunks.py", "--smoke", "--chunks", 2, "--out", out)
    assert "check causal=True" in stdout and "check causal=False" in stdout
    records = json.loads(out.read_text())["records"]
    assert {(r["impl"], r["causal"]) for r in records} == {
        (impl, causal) for impl in ("whole", "chunks", "ratio") for causal in (True, False)}
    timed = [r for r in records if r["impl"] != "ratio"]
    assert all(r["tflops"] > 0 and "error" not in r for r in timed), records


def test_context_parallel_fit(tmp_path):
    """Both programs' static buffer sizes, and the ring's step on 2 CPU devices."""
    out = tmp_path / "fit.json"
    _run("context_parallel_fit.py", "--smoke", "--out", out)
    payload = json.loads(out.read_text())
    assert payload["one_device_bytes"]["total"] > 0 and payload["ring_bytes_per_device"]["total"] > 0
    assert payload["ring_s"] > 0 and payload["final_q_rms"] > 0


def test_decode_benchmark(tmp_path):
    out = tmp_path / "decode.json"
    _run("decode_benchmark.py", "--smoke", "--allow-cpu", "--batches", 1, "--caches", 256,
         "--layouts", "contiguous,paged64", "--impls", "jflash,jflash_append,xla",
         "--target-ms", 1, "--repeats", 1, "--out", out)
    records = json.loads(out.read_text())["records"]
    by_key = {(r["impl"], r["layout"]): r for r in records}
    assert set(by_key) == {("jflash", "contiguous"), ("jflash_append", "contiguous"),
                           ("jflash", "paged64"), ("jflash_append", "paged64"),
                           ("xla", "contiguous")}, sorted(by_key)
    for r in records:
        assert r["status"] == "ok", r
        assert r["bandwidth_gbs"] > 0
        if r["layout"] == "contiguous":  # checked against the reference there
            assert r["rel_err"] < 2e-2, r


def test_merge_results_later_parts_replace_rows():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import merge_results
    finally:
        sys.path.pop(0)

    def row(impl, seq, mode, status="ok", tflops=1.0):
        record = {"impl": impl, "head_dim": 64, "value_head_dim": 64, "seq": seq, "batch": 1,
                  "heads": 2, "kv_heads": 2, "causal": True, "mode": mode, "dtype": "bfloat16",
                  "data": "normal", "status": status, "tflops": tflops}
        if status == "ok" and mode != "bwd":  # as gpu_benchmark.py: only timed rows name it
            record["feed"] = "sliver"
        return record

    args = {"feed": "sliver"}
    first = [row("jflash", 1024, "fwd", tflops=1.0), row("cudnn", 1024, "fwd", tflops=2.0),
             row("jflash", 4096, "fwd", tflops=3.0), row("cudnn", 4096, "fwd", "not run"),
             row("jflash", 4096, "bwd", "not run")]
    # The second part re-runs seq 4096 whole, and its cuDNN seq 1024 row did not run.
    second = [row("jflash", 4096, "fwd", tflops=4.0), row("cudnn", 4096, "fwd", tflops=5.0),
              row("jflash", 4096, "bwd", tflops=6.0), row("cudnn", 1024, "fwd", "not run")]
    merged = merge_results.merge_records([(first, args), (second, args)])
    got = {(r["impl"], r["seq"], r["mode"]): (r["status"], r.get("tflops")) for r in merged}
    assert len(merged) == 5
    assert got == {("jflash", 1024, "fwd"): ("ok", 1.0), ("cudnn", 1024, "fwd"): ("ok", 2.0),
                   ("jflash", 4096, "fwd"): ("ok", 4.0), ("cudnn", 4096, "fwd"): ("ok", 5.0),
                   ("jflash", 4096, "bwd"): ("ok", 6.0)}

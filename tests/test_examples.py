"""examples/train_transformer.py as a user runs it (its own process, 8 simulated
CPU devices), in its context-parallel modes: the loss must match the model on
jax.nn.dot_product_attention (the script's own check, its exit code), and the
compiled step must hold the collectives of the strategy that ran.
(examples/quickstart.py and generate.py run in the README's CI commands.)"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("strategy, collective", [
    ("auto", "all-gather"),  # 4 devices, short blocks: the all-gather
    ("ring", "collective-permute"),
])
def test_train_transformer_context_parallel(tmp_path, monkeypatch, strategy, collective):
    monkeypatch.setenv("XLA_FLAGS", "")  # the script asks for its own host devices
    results = tmp_path / "results.json"
    args = ["--host-devices", "8", "--context-parallel", "4", "--cp-strategy", strategy,
            "--steps", "12", "--check-steps", "10", "--warmup-steps", "2",
            "--results", str(results)]
    run = subprocess.run([sys.executable, str(EXAMPLES / "train_transformer.py"), *args],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    record = json.loads(results.read_text())
    assert record["check"]["ok"] and record["check"]["step"] == 10, record["check"]
    assert record["mesh"]["seq"] == 4, record["mesh"]
    assert record["collectives"]["counts"][collective] > 0, record["collectives"]["counts"]

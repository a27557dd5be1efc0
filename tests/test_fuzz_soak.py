"""CPU smoke runs of the hardening scripts: benchmarks/fuzz_backends.py, benchmarks/soak_engine.py
and tools/bad_input_survey.py (the full runs are GPU work: see their docstrings)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import fuzz_backends, soak_engine  # noqa: E402


def test_fuzz_quick_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "fuzz.json"
    assert fuzz_backends.main(["--device", "cpu", "--quick", "--batches", "8", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["summary"]["failures"] == 0
    assert data["summary"]["batches_per_backend"] == {"TORCH_SDPA": 8}
    served = {(r["kv"], r["layout"]) for r in data["rows"] if r["served"]}
    assert served == {("auto", "NHD"), ("auto", "HND"), ("fp8", "NHD"), ("fp8", "HND")}


@pytest.mark.parametrize("break_it", ["scale", "cache"])
def test_fuzz_catches_a_wrong_backend(break_it: str) -> None:
    """The reference and the cache checks are not vacuous: a wrong softmax scale, or a cache
    slot written outside the step, fails the batch."""
    args = fuzz_backends.parse_args(["--device", "cpu", "--quick"])
    fx = fuzz_backends.make_fixture("TORCH_SDPA", "auto", "NHD", args, [1, 2], torch.device("cpu"), 64)
    assert fx is not None
    rng = np.random.default_rng(0)
    batch = fuzz_backends.random_batch(rng, args, fx.kv.num_blocks)
    gen = torch.Generator().manual_seed(0)
    assert fuzz_backends.fuzz_one(fx, batch, gen) is None
    if break_it == "scale":
        fx.layer.impl.scale *= 1.5
        kind = "mismatch"
    else:
        forward = fx.layer.impl.forward

        def corrupting(*a, **k):  # noqa: ANN002, ANN003
            out = forward(*a, **k)
            fx.cache.view(-1)[-1] += 1.0  # the last slot of the last block: never in a table here
            return out

        fx.layer.impl.forward = corrupting
        kind = "cache"
    fail = fuzz_backends.fuzz_one(fx, fuzz_backends.random_batch(rng, args, fx.kv.num_blocks - 1), gen)
    assert fail is not None and fail["kind"] == kind, fail


def test_soak_quick_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    rc = soak_engine.main(["--device", "cpu", "--quick", "--no-compile", "--layers", "1", "--steps", "40",
                           "--warmup-steps", "10", "--out", str(out)])
    summary = json.loads(out.read_text())["summary"]
    assert rc == 0, summary["failures"]
    assert summary["blocks_free"] == summary["num_blocks"] and summary["soak_steps"] >= 40
    assert summary["soak_requests"] > 0 and summary["preemptions"] > 0  # a 10-block cache: preemption


def test_survey_lists_its_cases_and_runs_one(tmp_path: Path) -> None:
    script = str(ROOT / "tools" / "bad_input_survey.py")
    listing = subprocess.run([sys.executable, script, "--list"], capture_output=True, text=True, check=True).stdout
    assert listing.strip().splitlines()[-1] == "110 cases"
    out = tmp_path / "survey.json"
    subprocess.run([sys.executable, script, str(out), "--only", "fewer_tokens,scale_nan", "-j", "2"],
                   capture_output=True, text=True, check=True, timeout=300)
    data = json.loads(out.read_text())
    assert data["summary"]["total"] == 2
    assert data["summary"]["counts"]["clear_error"] == 2, data["cases"]

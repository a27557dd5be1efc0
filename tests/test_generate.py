"""examples/generate.py runs end to end on CPU (tiny preset) with a few flag combinations."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples import generate  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


SMALL = ["--device", "cpu", "--preset", "tiny", "--num-requests", "3", "--prompt-len", "20",
         "--output-len", "6", "--max-num-batched-tokens", "16", "--no-progress"]


@pytest.mark.parametrize("extra", [
    [],
    ["--temperature", "0.8", "--top-p", "0.9", "--backend", "TORCH_SDPA", "--block-size", "8"],
    ["--preset", "tiny-qwen3", "--num-blocks", "10", "--block-size", "4", "--fixed-lengths"],  # forces preemption
])
def test_generate_eager(extra: list[str]) -> None:
    out = generate.main(SMALL + extra)
    assert out["prefill_tokens"] >= 3 * 10 and out["decode_tokens"] > 0
    assert out["output_tokens"] >= 3 * 3
    assert out["decode_tok_s"] > 0 and out["prefill_tok_s"] > 0
    if "--num-blocks" in extra:
        assert out["preemptions"] > 0


def test_generate_compile_matches_eager() -> None:
    eager = generate.main(SMALL + ["--fixed-lengths"])
    compiled = generate.main(SMALL + ["--fixed-lengths", "--compile", "--compile-backend", "aot_eager"])
    assert compiled["warmup_s"] > 0
    assert compiled["output_tokens"] == eager["output_tokens"] == 3 * 6
    assert compiled["outputs"] == eager["outputs"]


def test_generate_sync_scheduling_same_outputs() -> None:
    """--sync-scheduling (a host sync every step) and the default async scheduling sample the same tokens."""
    extra = ["--temperature", "0.8", "--preset", "tiny-qwen3", "--num-blocks", "10", "--block-size", "4"]
    asynchronous = generate.main(SMALL + extra)
    synchronous = generate.main(SMALL + extra + ["--sync-scheduling"])
    assert asynchronous["preemptions"] > 0
    assert asynchronous["outputs"] == synchronous["outputs"]
    assert all(t >= 0 for out in asynchronous["outputs"] for t in out)


def test_generate_cudagraph_flag_on_cpu() -> None:
    """--cudagraph on CPU: the runner falls back to eager (mode NONE) and the tokens are unchanged."""
    eager = generate.main(SMALL + ["--fixed-lengths"])
    graphs = generate.main(SMALL + ["--fixed-lengths", "--cudagraph"])
    assert eager["cudagraph_mode"] == "off" and graphs["cudagraph_mode"] == "NONE"
    assert graphs["outputs"] == eager["outputs"]


def test_generate_cli_from_repo_root() -> None:
    """`python examples/generate.py` works as a script (no install of examples, no PYTHONPATH)."""
    r = subprocess.run([sys.executable, "examples/generate.py", *SMALL, "--num-requests", "2", "--threads", "1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "decode:" in r.stdout and "tok/s" in r.stdout


def test_generate_rejects_unknown_backend(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        generate.main(SMALL + ["--backend", "NO_SUCH_BACKEND"])
    assert "TORCH_SDPA" in capsys.readouterr().err


def test_bench_engine_cpu_smoke(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """benchmarks/bench_engine.py (engine steps, sync against async scheduling, host phases) runs on
    CPU and writes its JSON; its timers are removed afterwards."""
    from benchmarks import bench_engine
    from examples.engine import Engine

    prepare = Engine._prepare
    monkeypatch.setenv("OUT", str(tmp_path))
    out = bench_engine.main(["--device", "cpu", "--batches", "1,2", "--context", "16", "--steps", "4", "--reps", "1"])
    (path,) = tmp_path.glob("engine-*.json")
    assert {(r["batch"], r["async_scheduling"]) for r in out["rows"]} == {(1, False), (1, True), (2, False), (2, True)}
    for r in out["rows"]:
        assert r["step_ms"] > 0 and r["prepare_ms"] >= r["common_metadata_ms"] > 0 and r["flush_ms"] >= 0
    assert set(out["summary"]["ratios"]) == {"sync/async b1", "sync/async b2"}
    assert json.loads(path.read_text())["benchmark"] == "engine"
    assert Engine._prepare is prepare


def test_bench_e2e_cpu_smoke(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """benchmarks/bench_e2e.py runs end to end on CPU (tiny shapes) and writes its JSON, so a GPU run
    is not the first time its code executes."""
    pytest.importorskip("transformers")
    from benchmarks import bench_e2e

    monkeypatch.setenv("OUT", str(tmp_path))
    out = bench_e2e.main(["--device", "cpu", "--dtype", "float32", "--preset", "tiny", "--batches", "1,2",
                          "--contexts", "16", "--new-tokens", "4", "--reps", "1",
                          "--impls", "vattn-eager,hf-eager,hf-static-compile"])
    (path,) = tmp_path.glob("e2e-*.json")
    assert not out["summary"]["skipped"], out["summary"]["skipped"]  # a failed job says why here
    rows = {(r["impl"], r["batch"]) for r in out["rows"] if "ms_per_step" in r}
    assert {("vattn-eager", 1), ("vattn-eager/loop", 2), ("hf-eager", 2), ("hf-static-compile", 1)} <= rows
    assert all(r["x_floor"] > 0 and r["frac_copy_bw"] > 0 for r in out["rows"] if "ms_per_step" in r)
    assert all("speedup_vs_hf_static" in r for r in out["rows"] if r["impl"].startswith("vattn-"))
    summary = out["summary"]
    assert summary["partial"] is False and summary["roofline"]["copy_tbps"] > 0
    assert {(f["batch"], f["context"]) for f in summary["floor"]} == {(1, 16), (2, 16)}
    vs_static = [t for t in summary["target_checks"] if t["issue"] == 4 and "batch 1," in t["target"]]
    assert len(vs_static) == 2 and all(t["value"] > 0 for t in vs_static)  # engine-step and loop bases
    assert summary["targets"]["vattn/hf-static tok/s b1 p16 (engine step)"].endswith(("met)", "NOT met)"))
    data = json.loads(path.read_text())
    assert data["benchmark"] == "e2e" and len(data["rows"]) == len(out["rows"])
    assert data["plots"] and all((tmp_path / p).stat().st_size > 1000 for p in data["plots"])

    # vattn jobs first; a spent time budget skips every job (and says so) instead of running past it.
    args = bench_e2e.parse_args(["--quick", "--batches", "1,64"])
    order = [impl for _, _, impl in bench_e2e.job_order(args)]
    assert order[: 2 * len(bench_e2e.VATTN_IMPLS)] == [*bench_e2e.VATTN_IMPLS] * 2 and order[-1].startswith("hf-")
    out = bench_e2e.main(["--device", "cpu", "--dtype", "float32", "--preset", "tiny", "--batches", "1",
                          "--contexts", "16", "--new-tokens", "4", "--impls", "vattn-eager,hf-eager",
                          "--time-budget-s", "0.5", "--no-plot"])
    assert [r["impl"] for r in out["rows"]] == ["vattn-eager", "hf-eager"]
    assert all("time budget" in r["skipped"] for r in out["rows"])


def test_decode_loop_counts_host_syncs(monkeypatch: pytest.MonkeyPatch) -> None:
    """DecodeLoop's sync probe counts the warnings of torch.cuda.set_sync_debug_mode("warn") per
    step, by site, and turns the debug mode off again (CUDA itself stubbed)."""
    import warnings

    from benchmarks import bench_e2e

    modes: list[str] = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    class Loop:
        def step(self) -> torch.Tensor:
            assert modes[-1] == "warn"
            warnings.warn("called a synchronizing CUDA operation")
            warnings.warn("an unrelated warning")
            return torch.zeros(2, dtype=torch.long)

    out: list[torch.Tensor] = []
    res = bench_e2e.DecodeLoop._count_syncs(Loop(), out, 2)  # type: ignore[arg-type]
    assert modes == ["warn", "default"] and len(out) == 2
    assert res["syncs_per_step"] == 1.0
    assert "test_generate.py" in res["sync_sites"] and "synchronizing" in res["sync_sites"]

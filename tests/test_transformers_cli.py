"""The command-line side of the transformers adapter on CPU: ``examples/generate.py --hf`` on checkpoints
saved with ``save_pretrained`` (with and without a tokenizer), and a smoke run of ``benchmarks/bench_hf.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

transformers = pytest.importorskip("transformers")

from examples import generate  # noqa: E402
from examples.hf_model import save_random_checkpoint  # noqa: E402


pytestmark = pytest.mark.usefixtures("hf_one_thread")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny random Gemma-3 with a byte-level tokenizer, and a tiny Llama without one."""
    root = tmp_path_factory.mktemp("hf")
    return {"tokenizer": save_random_checkpoint(root / "gemma3", "gemma3", tokenizer=True, seed=1),
            "ids": save_random_checkpoint(root / "llama", "llama", seed=1)}


SMALL = ["--device", "cpu", "--no-progress", "--max-num-batched-tokens", "16", "--block-size", "8"]
PROMPTS = ["Hello, world", "vattn runs transformers models over a paged KV cache"]


def test_generate_hf_prompts_decoded_like_transformers(checkpoints: dict[str, Path],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """With a tokenizer: --prompt texts in, decoded completions out, the tokens of transformers' greedy generate."""
    path = checkpoints["tokenizer"]
    out = generate.main(["--hf", str(path), *SMALL, "--output-len", "6", *[a for p in PROMPTS for a in ("--prompt", p)]])
    printed = capsys.readouterr().out
    tok = transformers.AutoTokenizer.from_pretrained(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    for text, tokens, completion in zip(PROMPTS, out["outputs"], out["texts"]):
        ids = torch.tensor([tok(text)["input_ids"]])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6,
                          do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()
        assert tokens == ref
        assert completion == generate.completion_text(tok, tokens)
        assert f"-> {completion!r}" in printed
    h, i = tok("Hi")["input_ids"]
    assert generate.completion_text(tok, [h, i, tok.eos_token_id, h]) == "Hi"  # cut at end-of-sequence


def test_generate_hf_token_ids_eager_compiled_graphs(checkpoints: dict[str, Path],
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Without a tokenizer: random prompts of token ids, the outputs printed as ids; the same tokens
    eagerly, through torch.compile and through the CUDA-graph runner (eager on CPU)."""
    args = ["--hf", str(checkpoints["ids"]), *SMALL, "--num-requests", "3", "--prompt-len", "20",
            "--output-len", "5", "--fixed-lengths"]
    eager = generate.main(args)
    assert "texts" not in eager and eager["output_tokens"] == 3 * 5
    assert f"-> {eager['outputs'][0]}" in capsys.readouterr().out
    compiled = generate.main(args + ["--compile", "--compile-backend", "aot_eager"])
    graphs = generate.main(args + ["--cudagraph"])
    assert compiled["outputs"] == graphs["outputs"] == eager["outputs"]
    assert graphs["cudagraph_mode"] == "NONE"


def test_generate_hf_errors(checkpoints: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match="needs a tokenizer"):
        generate.main(["--hf", str(checkpoints["ids"]), *SMALL, "--prompt", "hi"])
    with pytest.raises(SystemExit, match="config.json"):
        generate.main(["--hf", str(tmp_path), *SMALL])
    with pytest.raises(SystemExit):
        generate.main([*SMALL, "--prompt", "hi"])  # --prompt without --hf
    assert "--prompt needs --hf" in capsys.readouterr().err


def test_generate_hf_cli_from_repo_root(checkpoints: dict[str, Path]) -> None:
    r = subprocess.run([sys.executable, "examples/generate.py", "--hf", str(checkpoints["tokenizer"]), *SMALL,
                        "--prompt", "Hi", "--output-len", "3", "--threads", "1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "request 0: prompt 2 tokens -> '" in r.stdout and "backend CPU_ATTN" in r.stdout


def test_save_random_checkpoint_cli(tmp_path: Path) -> None:
    from examples import hf_model

    path = hf_model.main([str(tmp_path / "ckpt"), "--family", "gpt_oss", "--tokenizer"])
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in path.iterdir()}
    assert json.loads((path / "config.json").read_text())["model_type"] == "gpt_oss"


def test_bench_hf_cpu_smoke(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """benchmarks/bench_hf.py runs end to end on CPU (a tiny Llama) and writes its JSON and plot,
    so a GPU run is not the first time its code executes."""
    from benchmarks import bench_hf

    monkeypatch.setenv("OUT", str(tmp_path))
    out = bench_hf.main(["--device", "cpu", "--dtype", "float32", "--models", "tiny-llama", "--batches", "1,2",
                         "--context", "16", "--new-tokens", "3", "--reps", "1", "--compile-sizes", "",
                         "--eager-rounds", "2"])
    (path,) = tmp_path.glob("hf-*.json")
    assert not out["summary"]["skipped"], out["summary"]["skipped"]
    rows = {(r["impl"], r["batch"]) for r in out["rows"] if r.get("ms_per_step")}
    assert {(i, b) for i in bench_hf.IMPLS for b in (1, 2)} <= rows
    assert ("vattn-cudagraph-full/loop", 2) in rows
    full = next(r for r in out["rows"] if r["impl"] == "vattn-cudagraph-full" and r["batch"] == 1)
    assert full["x_example"] > 0 and full["speedup_vs_hf_static"] > 0 and full["x_floor"] > 0
    checks = out["summary"]["target_checks"]
    assert len(checks) == 8 and all(c["value"] is not None for c in checks)  # batch 64 not run: 2 checks fewer
    eager = next(r for r in out["rows"] if r["impl"] == "vattn-eager" and r["batch"] == 1)
    hf = next(r for r in out["rows"] if r["impl"] == "hf-eager" and r["batch"] == 1)
    assert len(eager["blocks_ms"]) == len(hf["blocks_ms"]) == 2 and eager["x_hf_eager_paired"] > 0
    assert eager["decode_steps"] == hf["decode_steps"] == 2 * bench_hf.EAGER_BLOCK_STEPS
    (check,) = [c for c in checks if c["rows"] == "vattn-eager vs hf-eager"]
    assert check["value"] == eager["x_hf_eager_paired"] and "interleaved" in check["basis"]
    data = json.loads(path.read_text())
    assert data["benchmark"] == "hf" and data["plots"] and (tmp_path / data["plots"][0]).stat().st_size > 1000


def test_bench_hf_eager_targets_use_the_interleaved_ratios() -> None:
    """The eager targets read the per-block ratio where a row has one (not the ratio of the
    two rows' medians): at most 1.0 at batch 1, below 1.0 at batch 64."""
    from benchmarks import bench_hf

    def rows(b1: float, b64: float) -> list[dict[str, object]]:
        out: list[dict[str, object]] = []
        for batch, paired in ((1, b1), (64, b64)):
            out += [{"model": "m", "impl": "vattn-eager", "batch": batch, "ms_per_step": 10.0, "tok_s": 1.0,
                     "x_hf_eager_paired": paired},
                    {"model": "m", "impl": "hf-eager", "batch": batch, "ms_per_step": 9.0, "tok_s": 1.0}]
        return out

    def met(b1: float, b64: float) -> dict[int, object]:
        checks = [c for c in bench_hf.targets(rows(b1, b64), [1, 64]) if c["rows"] == "vattn-eager vs hf-eager"]
        return {int(c["target"].split(" b")[-1][:2]): (c["value"], c["met"]) for c in checks}

    assert met(1.0, 1.0) == {1: (1.0, True), 64: (1.0, False)}
    assert met(1.01, 0.99) == {1: (1.01, False), 64: (0.99, True)}

"""The front door (issue 56): ``python -m vattn`` per layer and per checkpoint, pipes that close
cleanly, transformers' backend names, the VLLM_ATTENTION_BACKEND hint and the slow-CPU warnings."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vattn
import vattn.selector as selector
from vattn.__main__ import main

ROOT = Path(__file__).resolve().parents[1]
CPU = not torch.cuda.is_available()


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vattn", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, timeout=300)


def test_a_layer_description_says_what_it_gets(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--head-size", "64", "--dtype", "float16", "--sliding-window", "--num-kv-heads", "8", "--json"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)
    assert entry["config"] == {"head_size": 64, "dtype": "float16", "kv_cache_dtype": "auto", "block_size": 16,
                               "sliding_window": True, "num_kv_heads": 8}
    chosen = vattn.get_attn_backend(64, torch.float16, "auto", 16, use_sliding_window=True).get_name()
    assert entry["selected"] == chosen and entry["error"] is None
    for p in entry["passed_over"]:  # each one ranked above the choice, with its reasons
        assert p["reasons"], p


def test_a_layer_no_backend_serves_names_every_reason(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--head-size", "576", "--mla"]) == 0
    text = capsys.readouterr().out
    if CPU:
        assert "no backend:" in text and "passed over TRITON_MLA: TRITON_MLA needs a CUDA GPU" in text


def test_a_checkpoint_groups_its_layers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    transformers = pytest.importorskip("transformers")
    transformers.Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              sliding_window=32).save_pretrained(tmp_path)
    assert main(["--hf", str(tmp_path), "--json"]) == 0
    groups = json.loads(capsys.readouterr().out)
    assert [g["layers"] for g in groups] == [["model.layers.0.self_attn", "model.layers.2.self_attn"],
                                             ["model.layers.1.self_attn", "model.layers.3.self_attn"]]
    assert [g["spec"]["sliding_window"] for g in groups] == [32, None]
    assert all(g["spec"]["logits_soft_cap"] == 50.0 and g["selection"]["selected"] for g in groups)
    assert main(["--hf", str(tmp_path)]) == 0
    assert "model.layers.0.self_attn, model.layers.2.self_attn: head_size=16" in capsys.readouterr().out


def test_a_closed_pipe_ends_quietly() -> None:
    """``vattn | head -1``: no BrokenPipeError traceback, exit status 0."""
    p = subprocess.Popen([sys.executable, "-m", "vattn"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()  # the reader leaves before the report is written (the import takes a second)
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 0 and "Traceback" not in err, err


def test_transformers_names_mean_the_same_backend() -> None:
    assert vattn.backend_name_to_enum("sdpa") is vattn.AttentionBackendEnum.TORCH_SDPA
    assert vattn.backend_name_to_enum("flash_attention_2") is vattn.AttentionBackendEnum.FLASH_ATTN
    assert vattn.backend_name_to_enum("flex_attention") is vattn.AttentionBackendEnum.FLEX_ATTENTION
    cfg = vattn.VattnConfig()
    with vattn.set_current_vattn_config(cfg):
        layer = vattn.Attention(2, 16, 0.25, attn_backend="sdpa", prefix="l0")
        assert layer.attn_backend.get_name() == "TORCH_SDPA"
        with pytest.raises(ValueError, match="implemented: .*TORCH_SDPA") as info:
            vattn.Attention(2, 16, 0.25, attn_backend="eager", prefix="l1")
    msg = str(info.value)
    assert "'sdpa' (TORCH_SDPA) computes the same attention" in msg
    assert "CUTLASS_MLA" not in msg and "FLASHMLA" not in msg.replace("FLASHMLA_", "")  # named-only backends left out


def test_vllm_variable_gets_a_hint() -> None:
    r = _run("--head-size", "64", env={"VLLM_ATTENTION_BACKEND": "FLASHINFER"})
    assert r.returncode == 0
    assert "VLLM_ATTENTION_BACKEND=FLASHINFER is set, but vattn reads VATTN_ATTENTION_BACKEND" in r.stderr
    r = _run("--head-size", "64", env={"VLLM_ATTENTION_BACKEND": "FLASHINFER", "VATTN_ATTENTION_BACKEND": "TORCH_SDPA"})
    assert "VLLM_ATTENTION_BACKEND" not in r.stderr


@pytest.mark.skipif(not CPU, reason="the warning is about the CPU path (a CUDA GPU is visible here)")
@pytest.mark.parametrize("name", ["FLEX_ATTENTION", "TREE_ATTN"])
def test_slow_cpu_paths_warn_once(name: str, caplog: pytest.LogCaptureFixture) -> None:
    selector._warn_once.cache_clear()
    cfg = vattn.VattnConfig()
    with caplog.at_level(logging.WARNING, logger="vattn"), vattn.set_current_vattn_config(cfg):
        vattn.Attention(2, 16, 0.25, attn_backend=name, prefix="a")
        vattn.Attention(2, 16, 0.25, attn_backend=name, prefix="b")
        vattn.Attention(2, 16, 0.25, attn_backend="TORCH_SDPA", prefix="c")
    warned = [r.getMessage() for r in caplog.records if "on the CPU" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith(f"{name} on the CPU: slow") and "TORCH_SDPA" in warned[0]

"""``python -m vattn``: the report (text and JSON), its robustness, and the support matrix."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

import vattn
import vattn.selector as selector
from vattn import info
from vattn.__main__ import main
from vattn.core.enums import AttentionCGSupport, AttentionType
from vattn.core.interface import AttentionBackend
from vattn.core.registry import (
    AttentionBackendEnum,
    MambaAttentionBackendEnum,
    register_backend,
    vattn_version,
)

B = AttentionBackendEnum
ROOT = Path(__file__).resolve().parents[1]
STATUS_WORDS = {"available": "available", "unavailable": "unavailable here", "not_implemented": "not implemented"}


@pytest.fixture(autouse=True)
def _clean_registry_and_selection(clean_registry: None):
    forced = selector.get_global_forced_attn_backend()
    yield
    selector.global_force_attn_backend(forced)
    selector._cached_get_attn_backend.cache_clear()


def run_vattn(*args: str, env: dict[str, str] | None = None, path: str | None = None) -> subprocess.CompletedProcess:
    """``python -m vattn ARGS`` on the CPU (no GPU visible, no vattn variable set unless given)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("VATTN_") and k != "TRITON_INTERPRET"}
    base["CUDA_VISIBLE_DEVICES"] = ""
    base["PYTHONPATH"] = os.pathsep.join(p for p in (path, str(ROOT), base.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-m", "vattn", *args], capture_output=True, text=True,
                          env={**base, **(env or {})}, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc


def expected_status(member: AttentionBackendEnum) -> str:
    """The status every member must have on a CPU without TRITON_INTERPRET (this version's backends)."""
    if not member.is_implemented():
        return "not_implemented"
    return "available" if member in (B.TORCH_SDPA, B.CPU_ATTN, B.FLEX_ATTENTION, B.TREE_ATTN, B.NO_ATTENTION) else "unavailable"


def text_statuses(text: str) -> dict[str, str]:
    section = text.split("Backends (AttentionBackendEnum)\n")[1].split("\n\n")[0]
    found = {}
    for line in section.splitlines():
        m = re.match(r"  ([A-Z0-9_]+) +(available|unavailable here|not implemented)\b", line)
        if m:
            found[m.group(1)] = m.group(2)
    return found


# ---- the command ----------------------------------------------------------------------------


def test_text_report_on_cpu():
    out = run_vattn().stdout
    assert out.startswith(f"vattn {vattn.__version__}: what this installation can run\n")
    assert re.search(rf"^  torch +{re.escape(torch.__version__)}$", out, re.M)
    for label in ("python", "triton", "flashinfer", "flash-attn"):
        assert re.search(rf"^  {label} +\S", out, re.M), label
    assert "CPU only: no CUDA GPU visible" in out
    assert text_statuses(out) == {m.name: STATUS_WORDS[expected_status(m)] for m in B}
    assert re.search(rf"^  ROCM_ATTN +not implemented in {vattn_version()}$", out, re.M)
    assert re.search(r"^  FLASHINFER +unavailable here: .*GPU", out, re.M)
    # An available backend says what it serves.
    after = out.split("\n  TORCH_SDPA ")[1].splitlines()[1:]
    sdpa = "\n".join(line for line in after[: next(i for i, l in enumerate(after) if not l.startswith("    "))])
    assert "dtypes: float16, bfloat16, float32" in sdpa and "KV-cache dtypes: auto" in sdpa
    assert "CUDA graphs: NEVER (piecewise only)" in sdpa
    assert "head_size=128, dtype=torch.float32, kv_cache_dtype='auto', block_size=16" in out
    assert "\n  selected: CPU_ATTN\n" in out
    env = out.split("Environment (vattn.envs)\n")[1]
    assert "  set:\n    (none)\n" in env
    assert "    VATTN_ATTENTION_BACKEND: None\n" in env and "    VATTN_Q_SCALE_CONSTANT: 200" in env


def test_json_report_on_cpu():
    report = json.loads(run_vattn("--json").stdout)
    assert report["vattn"] == vattn.__version__
    versions = report["versions"]
    assert versions["torch"] == torch.__version__ and versions["vattn"] == vattn.__version__
    assert set(versions) == {"python", "vattn", "torch", "triton", "flashinfer", "flash-attn"}
    assert report["device"] == {"platform": "cpu", "torch_cuda": torch.version.cuda, "gpus": []}
    statuses = {e["name"]: e["status"] for e in report["backends"]}
    assert statuses == {m.name: expected_status(m) for m in B}
    assert [e["status"] for e in report["backends"]] == sorted(
        statuses.values(), key=["available", "unavailable", "not_implemented"].index)
    sdpa = next(e for e in report["backends"] if e["name"] == "TORCH_SDPA")
    from vattn.backends.torch_sdpa import TorchSDPABackend

    assert sdpa["serves"]["dtypes"] == [str(d).removeprefix("torch.") for d in TorchSDPABackend.supported_dtypes]
    assert sdpa["serves"]["kv_cache_dtypes"] == list(TorchSDPABackend.supported_kv_cache_dtypes)
    assert sdpa["serves"]["sinks"] is TorchSDPABackend.supports_sink
    assert sdpa["serves"]["notes"] == dict(TorchSDPABackend.feature_notes)
    rocm = next(e for e in report["backends"] if e["name"] == "ROCM_ATTN")
    assert rocm["reason"] == f"not implemented in {vattn_version()}" and rocm["serves"] is None
    flex = next(e for e in report["backends"] if e["name"] == "FLEX_ATTENTION")
    assert flex["status"] == "available" and flex["serves"]["cuda_graphs"] == "UNIFORM_SINGLE_TOKEN_DECODE"
    fi = next(e for e in report["backends"] if e["name"] == "FLASHINFER")
    assert "GPU" in fi["reason"] and fi["serves"]["head_sizes"]  # declared even where it cannot run
    sel = report["default_selection"]
    assert sel["selected"] == "CPU_ATTN" and sel["error"] is None and sel["forced_by"] is None
    assert sel["config"] == {"head_size": 128, "dtype": "torch.float32", "kv_cache_dtype": "auto", "block_size": 16}
    assert sel["priority"] == ["CPU_ATTN", "TORCH_SDPA"]
    env = {r["name"]: r for r in report["environment"]}
    assert set(env) == set(vattn.envs.environment_variables)
    assert not any(r["set"] for r in env.values())
    assert report["mamba_backends"] == [
        {"name": m.name, "status": "not_implemented" if m is MambaAttentionBackendEnum.CUSTOM else "implemented"}
        for m in MambaAttentionBackendEnum]


def test_report_with_forced_backends_and_set_variables():
    report = json.loads(run_vattn("--json", env={"VATTN_ATTENTION_BACKEND": "ROCM_ATTN",
                                                 "VATTN_DEBUG_CHECKS": "1"}).stdout)
    sel = report["default_selection"]
    assert sel["selected"] is None and sel["forced_by"] == "VATTN_ATTENTION_BACKEND"
    assert "ROCM_ATTN (forced by VATTN_ATTENTION_BACKEND='ROCM_ATTN') is not implemented" in sel["error"]
    env = {r["name"]: r for r in report["environment"]}
    assert env["VATTN_DEBUG_CHECKS"] == {"name": "VATTN_DEBUG_CHECKS", "set": True, "raw": "1", "value": True}
    assert env["VATTN_ATTENTION_BACKEND"]["set"] and not env["VATTN_KV_CACHE_LAYOUT"]["set"]
    # Text: an unavailable forced backend gives the selector's reasons; the variable shows as set.
    out = run_vattn(env={"VATTN_ATTENTION_BACKEND": "TRITON_ATTN"}).stdout
    assert "  forced by VATTN_ATTENTION_BACKEND\n  no backend: attention backend TRITON_ATTN" in out
    assert "TRITON_INTERPRET=1" in out.split("no backend:")[1]
    assert "    VATTN_ATTENTION_BACKEND=TRITON_ATTN  (in effect: 'TRITON_ATTN')" in out


def test_versions_come_from_metadata_without_importing(tmp_path):
    """A kernel library that is installed but breaks on import: the report still exits 0 and
    shows its version (read from package metadata; the library is never imported on a CPU)."""
    (tmp_path / "flashinfer").mkdir()
    (tmp_path / "flashinfer" / "__init__.py").write_text("raise RuntimeError('broken flashinfer')\n")
    dist = tmp_path / "flashinfer_python-9.9.9.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: flashinfer-python\nVersion: 9.9.9\n")
    report = json.loads(run_vattn("--json", path=str(tmp_path)).stdout)
    assert report["versions"]["flashinfer"] == "9.9.9"
    fi = next(e for e in report["backends"] if e["name"] == "FLASHINFER")
    assert fi["status"] == "unavailable" and "broken" not in fi["reason"]


def test_help_and_support_matrix_flag(capsys):
    assert main(["--support-matrix"]) == 0
    assert capsys.readouterr().out == info.support_matrix_markdown()
    with pytest.raises(SystemExit) as ei:
        main(["--help"])
    assert ei.value.code == 0
    assert "--json" in capsys.readouterr().out


# ---- robustness, in process ------------------------------------------------------------------


class _Builder:
    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH


def fake_backend(**attrs: Any) -> type[AttentionBackend]:
    """A backend class with the given declarations (``available``: what is_available returns or raises)."""
    available = attrs.pop("available", (True, ""))

    class Fake(AttentionBackend):
        get_name = staticmethod(lambda: "CUSTOM")
        get_impl_cls = get_metadata_cls = staticmethod(lambda: None)
        get_builder_cls = staticmethod(lambda: _Builder)
        get_kv_cache_shape = staticmethod(lambda *a, **k: ())

        @classmethod
        def is_available(cls):
            if isinstance(available, Exception):
                raise available
            return available

    for k, v in attrs.items():
        setattr(Fake, k, classmethod(v) if callable(v) else v)
    return Fake


def test_broken_backends_do_not_break_the_report(capsys):
    register_backend(B.CUSTOM)(fake_backend(available=RuntimeError("driver exploded")))

    @register_backend(B.FLEX_ATTENTION)
    class NotABackend:
        pass

    selector.global_force_attn_backend("CUSTOM")
    report = info.collect()
    entries = {e["name"]: e for e in report["backends"]}
    assert entries["CUSTOM"]["status"] == "unavailable"
    assert entries["CUSTOM"]["reason"] == "probing it raised RuntimeError: driver exploded"
    assert entries["FLEX_ATTENTION"]["status"] == "unavailable"
    assert "not a vattn AttentionBackend subclass" in entries["FLEX_ATTENTION"]["reason"]
    assert report["default_selection"]["selected"] is None
    assert "driver exploded" in report["default_selection"]["error"]
    text = info.render_text(report)
    assert "  CUSTOM           unavailable here: probing it raised RuntimeError: driver exploded" in text
    assert main([]) == 0 and main(["--json"]) == 0
    capsys.readouterr()


def test_too_old_gpu_is_unavailable(monkeypatch):
    cls = fake_backend(min_compute_capability=(9, 0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    assert info.availability(cls) == (False, "GPU too old: compute capability 8.6 < 9.0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert info.availability(cls) == (True, "")


# ---- the support matrix --------------------------------------------------------------------


def test_format_sizes():
    assert info.format_sizes(None) == "any"
    assert info.format_sizes(tuple(range(8, 257, 8))) == "8-256 (multiples of 8)"
    assert info.format_sizes((1, 2, 4, 8, 16, 32)) == "1-32 (powers of 2)"
    assert info.format_sizes((256, 64, 128)) == "64, 128, 256"


def test_support_matrix_rows_follow_declarations():
    register_backend(B.CUSTOM)(fake_backend(
        min_compute_capability=(8, 0), runs_on_cpu=True, supported_dtypes=(torch.float16, torch.bfloat16),
        get_supported_head_sizes=lambda cls: (64, 128, 256), supported_kv_cache_dtypes=("auto", "fp8_e4m3"),
        supports_sliding_window=True, supports_alibi=True,
        supported_attn_types=(AttentionType.DECODER, AttentionType.ENCODER_ONLY),
        feature_notes={"alibi": "a | b", "block_sizes": "multiples of 16", "sinks": "never"},
    ))
    lines = info.support_matrix_markdown().splitlines()
    assert lines[0] == ("| backend | GPUs (compute capability) | CPU | dtypes | head sizes | fp8 KV | "
                        "sliding window | soft cap | ALiBi | sinks | encoder | CUDA graphs |")
    assert lines[1] == "|" + " --- |" * 12
    names = [line.split(" | ")[0].removeprefix("| ") for line in lines[2:] if line.startswith("| ")]
    assert names == [m.name for m in B if m.is_implemented() and m is not B.NO_ATTENTION]
    custom = next(line for line in lines if line.startswith("| CUSTOM "))
    assert custom == ("| CUSTOM | 8.0+ | yes | fp16, bf16 | 64, 128, 256 | fp8_e4m3 | yes | no | yes: a \\| b | "
                      "no: never | encoder-only | uniform batches |")
    assert lines[-1] == "- CUSTOM, block_sizes: multiples of 16"


def test_support_matrix_is_declarations_only(monkeypatch):
    """Same table whatever is installed or visible: probing anything would raise here."""
    expected = info.support_matrix_markdown()
    for member in B:
        if member.is_implemented():
            def boom(*a, **k):
                raise AssertionError("the support matrix must not probe the machine")
            monkeypatch.setattr(member.get_class(), "is_available", classmethod(boom))
            monkeypatch.setattr(member.get_class(), "get_cudagraph_support", classmethod(boom))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    assert info.support_matrix_markdown() == expected
    assert expected.endswith("\n") and "| TORCH_SDPA |" in expected and "ROCM_ATTN" not in expected


def test_support_matrix_shows_each_implemented_backend_as_declared():
    table = info.support_matrix_markdown()
    for member in B:
        if not member.is_implemented() or member is B.NO_ATTENTION:  # a placeholder: no kernel, no row
            continue
        cls = member.get_class()
        row = next(line for line in table.splitlines() if line.startswith(f"| {member.name} |"))
        cells = row.strip("| ").split(" | ")
        assert cells[2].startswith("yes" if cls.runs_on_cpu else "no")
        assert cells[9].startswith("yes" if cls.supports_sink else "no")
        assert cells[6].startswith("yes" if cls.supports_sliding_window else "no")
        for key, note in cls.feature_notes.items():
            assert note.replace("|", "\\|") in table, (member.name, key)


def test_mla_backends_and_selection_in_the_report():
    """FLASHMLA, FLASHMLA_SPARSE and CUTLASS_MLA say which kernels vattn cannot install; an MLA
    layer's selection is reported beside the default layer's (TRITON_MLA under the interpreter)."""
    out = run_vattn().stdout
    lines = {m.group(1): m.group(2) for m in re.finditer(r"^  ([A-Z_]+MLA[A-Z_]*) +unavailable here: (.*)$", out, re.M)}
    assert "flash_mla" in lines["FLASHMLA"] and "cannot install" in lines["FLASHMLA"]
    assert "flash_mla" in lines["FLASHMLA_SPARSE"] and "indexer" in lines["FLASHMLA_SPARSE"]
    assert "vllm._C" in lines["CUTLASS_MLA"] and "cannot install" in lines["CUTLASS_MLA"]
    assert "GPU" in lines["FLASHINFER_MLA"] and "GPU" in lines["FLASH_ATTN_MLA"]
    mla = out.split("Selection for an MLA layer")[1].split("\n\n")[0]
    assert "head_size=576" in mla and "use_mla=True" in mla and "priority on cpu: TRITON_MLA" in mla
    assert "TRITON_INTERPRET=1" in mla
    report = json.loads(run_vattn("--json", env={"TRITON_INTERPRET": "1"}).stdout)
    assert report["mla_selection"]["selected"] == "TRITON_MLA"
    assert report["mla_selection"]["config"]["use_mla"] is True
    assert report["default_selection"]["selected"] == "CPU_ATTN"

"""Each backend's declarations (``AttentionBackend``'s ClassVars) say what its impl really does.

For TORCH_SDPA, TRITON_ATTN, FLASHINFER, FLASH_ATTN, FLEX_ATTENTION and TREE_ATTN: every feature
declared unsupported is refused by the impl's constructor (``NotImplementedError`` naming the
argument, what was expected, what arrived, and backends that do declare the feature), every feature
declared supported is accepted; TORCH_SDPA, TRITON_ATTN (under ``TRITON_INTERPRET=1``) and
FLEX_ATTENTION also through ``vattn.Attention``.
None of this needs a GPU or the optional libraries; the GPU-marked test at the end checks the
FLASH_ATTN qualifiers that depend on the installed interface.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

import vattn
from vattn.core.enums import AttentionType
from vattn.core.interface import AttentionBackend
from vattn.core.registry import AttentionBackendEnum

BACKENDS = ("TORCH_SDPA", "TRITON_ATTN", "FLASHINFER", "FLASH_ATTN", "FLEX_ATTENTION", "TREE_ATTN")
H, HK, D = 4, 2, 32
#: Feature -> (the declaration, the impl keyword arguments that use it).
FEATURES: dict[str, tuple[str, dict[str, Any]]] = {
    "sliding_window": ("supports_sliding_window", dict(sliding_window=8)),
    "logits_soft_cap": ("supports_logits_soft_cap", dict(logits_soft_cap=30.0)),
    "alibi": ("supports_alibi", dict(alibi_slopes=[0.5, 0.25, 0.125, 0.0625])),
    "sinks": ("supports_sink", dict(sinks=torch.zeros(H))),
}
NOTE_KEYS = {*FEATURES, "attn_types", "runs_on_cpu", "min_compute_capability", "dtypes", "fp8_kv",
             "head_sizes", "block_sizes", "cuda_graphs"}
CASES = [(b, f, t) for b in BACKENDS for f, t in [*((f, None) for f in FEATURES),
                                                     *(("attn_type", t) for t in AttentionType.ALL)]]


def backend(name: str) -> type[AttentionBackend]:
    return AttentionBackendEnum[name].get_class()


def declared(cls: type[AttentionBackend], feature: str, attn_type: str | None) -> bool:
    return attn_type in cls.supported_attn_types if feature == "attn_type" else getattr(cls, FEATURES[feature][0])


def kwargs_of(feature: str, attn_type: str | None) -> dict[str, Any]:
    return {"attn_type": attn_type} if feature == "attn_type" else dict(FEATURES[feature][1])


#: How selection names each refused feature (``vattn.core.checks``).
SELECTION_WORDS = {"attn_type": "attn_type", "sliding_window": "sliding window", "logits_soft_cap": "soft cap",
                   "alibi": "ALiBi", "sinks": "sinks"}


def check_refusal(err: BaseException, cls: type[AttentionBackend], feature: str, attn_type: str | None,
                  argument: str) -> None:
    """The message names the backend and argument, the expected and actual value, and only
    backends that declare the feature as the way out."""
    msg = str(err)
    assert msg.startswith(f"{cls.get_name()} {argument}: expected "), msg
    assert " got " in msg and "; use " in msg, msg
    fix = msg.rpartition("; ")[2]
    names = [m.name for m in AttentionBackendEnum if re.search(rf"\b{m.name}\b", fix)]
    assert names, msg
    for name in names:
        assert declared(backend(name), feature, attn_type), f"{msg!r} suggests {name}, which does not declare it"


def _fa_qualified(name: str, feature: str) -> bool:
    """FLASH_ATTN's ALiBi and sinks depend on the installed interface, which a GPU makes the
    constructor consult (covered by the GPU test below)."""
    return name == "FLASH_ATTN" and feature in ("alibi", "sinks") and torch.cuda.is_available()


@pytest.mark.parametrize("name, feature, attn_type", CASES)
def test_impl_constructor_follows_the_declarations(name: str, feature: str, attn_type: str | None) -> None:
    cls = backend(name)
    if _fa_qualified(name, feature):
        pytest.skip("qualified by the installed FlashAttention interface (GPU test below)")
    kwargs = kwargs_of(feature, attn_type)
    make = lambda: cls.get_impl_cls()(H, D, D**-0.5, HK, **kwargs)  # noqa: E731
    if declared(cls, feature, attn_type):
        make()
    else:
        with pytest.raises(NotImplementedError) as e:
            make()
        check_refusal(e.value, cls, feature, attn_type, next(iter(kwargs)))


@pytest.mark.parametrize("name, feature, attn_type", [c for c in CASES if c[0] in ("TORCH_SDPA", "TRITON_ATTN",
                                                                                    "FLEX_ATTENTION")])
def test_attention_layer_follows_the_declarations(monkeypatch: pytest.MonkeyPatch, name: str, feature: str,
                                                  attn_type: str | None) -> None:
    if name == "TRITON_ATTN":
        pytest.importorskip("triton")
        if not torch.cuda.is_available():
            monkeypatch.setenv("TRITON_INTERPRET", "1")  # is_available on CPU; no kernel runs here
    cls = backend(name)
    kwargs = kwargs_of(feature, attn_type)
    argument = next(iter(kwargs))
    if "sliding_window" in kwargs:
        kwargs["per_layer_sliding_window"] = kwargs.pop("sliding_window")
    with vattn.set_current_vattn_config(vattn.VattnConfig()):
        make = lambda: vattn.Attention(H, D, D**-0.5, num_kv_heads=HK, prefix="l0.attn",  # noqa: E731
                                       attn_backend=name, **kwargs)
        if declared(cls, feature, attn_type):
            assert make().attn_backend is cls
        else:  # refused by selection (the declarations), before any impl is built
            with pytest.raises(ValueError) as e:
                make()
            msg = str(e.value)
            assert msg.startswith(f"attn_backend={name} cannot serve this layer: "), msg
            assert SELECTION_WORDS[feature] in msg and "Pick another backend" in msg, msg


@pytest.mark.parametrize("name", BACKENDS)
def test_declarations_are_well_formed(name: str) -> None:
    cls = backend(name)
    assert cls.supported_attn_types and set(cls.supported_attn_types) <= set(AttentionType.ALL)
    assert set(cls.feature_notes) <= NOTE_KEYS, set(cls.feature_notes) - NOTE_KEYS
    assert (cls.min_compute_capability is None) == cls.runs_on_cpu  # the CUDA-only ones name a generation


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU machine")
@pytest.mark.parametrize("name", BACKENDS)
def test_runs_on_cpu_matches_availability(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    cls = backend(name)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert cls.is_available()[0] == cls.runs_on_cpu
    if name == "TRITON_ATTN":  # declared False: the interpreter is for tests, and says so
        pytest.importorskip("triton")
        assert "TRITON_INTERPRET" in cls.feature_notes["runs_on_cpu"]
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert cls.is_available()[0]


def _on_gpu(monkeypatch: pytest.MonkeyPatch, cls: type[AttentionBackend], cap: tuple[int, int]) -> None:
    """Pretend a CUDA GPU of compute capability ``cap`` with the backend's library installed."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: cap)
    monkeypatch.setattr(cls, "is_available", classmethod(lambda c: (True, "")))


@pytest.mark.parametrize("name", ("TORCH_SDPA", "TRITON_ATTN", "FLASHINFER", "FLEX_ATTENTION"))
def test_min_compute_capability_is_enforced(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    cls = backend(name)
    need = cls.min_compute_capability
    older = (3, 0) if need is None else ((need[0], need[1] - 1) if need[1] else (need[0] - 1, 9))
    for cap, refused in ((older, need is not None), (need or (9, 0), False)):
        _on_gpu(monkeypatch, cls, cap)
        reasons = cls.validate_configuration(128, torch.float16, "auto", 16)
        assert any("too old" in r for r in reasons) == refused, (cap, reasons)


def test_flash_attn_minimum_is_the_oldest_generation_a_probe_accepts(monkeypatch: pytest.MonkeyPatch) -> None:
    """FLASH_ATTN's (8, 0): with every interface 'installed', only FA2 accepts SM80, none SM75."""
    import types

    from vattn.backends.flash_attn import interface as fa

    fake = types.SimpleNamespace(__version__="2.8.3", flash_attn_varlen_func=lambda *a, **k: None,
                                 flash_attn_with_kvcache=lambda *a, **k: None)
    monkeypatch.setattr(fa, "importlib", types.SimpleNamespace(import_module=lambda name: fake))
    probes = (fa._fa4, fa._fa3, fa._fa2)
    need = backend("FLASH_ATTN").min_compute_capability
    assert need is not None
    arch = need[0] * 10 + need[1]
    assert any(p(arch) is not None for p in probes)
    assert all(p(arch - 5) is None for p in probes)


@pytest.mark.parametrize("name, dtype, kv, cap, reason", [
    ("FLASHINFER", torch.bfloat16, "auto", (7, 5), "bfloat16 needs compute capability 8.0"),
    ("FLASHINFER", torch.float16, "auto", (7, 5), None),
    ("FLASHINFER", torch.float16, "fp8_e4m3", (8, 6), "needs compute capability 8.9"),
    ("FLASHINFER", torch.float16, "fp8_e5m2", (8, 6), None),
    ("TRITON_ATTN", torch.bfloat16, "fp8", (8, 0), "needs compute capability 8.9"),
    ("TRITON_ATTN", torch.bfloat16, "fp8_e5m2", (8, 0), None),
    ("TRITON_ATTN", torch.bfloat16, "fp8", (8, 9), None),
])
def test_qualified_notes_have_reasons(monkeypatch: pytest.MonkeyPatch, name: str, dtype: torch.dtype, kv: str,
                                      cap: tuple[int, int], reason: str | None) -> None:
    """What ``feature_notes`` qualifies by GPU generation, ``validate_configuration`` refuses there."""
    cls = backend(name)
    assert ("dtypes" if kv == "auto" else "fp8_kv") in cls.feature_notes
    _on_gpu(monkeypatch, cls, cap)
    reasons = cls.validate_configuration(128, dtype, kv, 16)
    assert (reasons == []) if reason is None else any(reason in r for r in reasons), reasons


@pytest.mark.cuda
@pytest.mark.flash_attn
@pytest.mark.parametrize("feature, interface, label", [("alibi", "fa2", "FA2"), ("sinks", "fa4", "flash-attn-4")])
def test_flash_attn_qualified_features_follow_the_installed_interface(feature: str, interface: str, label: str) -> None:
    from vattn.backends.flash_attn import get_flash_attn_interface

    iface, why = get_flash_attn_interface()
    assert iface is not None, why
    cls = backend("FLASH_ATTN")
    assert label in cls.feature_notes[feature]
    make = lambda: cls.get_impl_cls()(H, 64, 0.125, HK, **FEATURES[feature][1])  # noqa: E731
    if iface.name == interface:
        make()
    else:
        with pytest.raises(NotImplementedError) as e:
            make()
        assert f"FLASH_ATTN {next(iter(FEATURES[feature][1]))}: expected None" in str(e.value)

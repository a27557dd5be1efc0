"""One conformance suite over every attention backend: the same random steps through
``vattn.Attention`` and the attention op, each against the float32 reference of
tests/attn_harness.py (``check_layer_step``): mixed decode / prefill batches with padding, odd
lengths, GQA and MQA, half precision, fp8 caches, the layer features, encoder attention, draft
trees; the step's K/V stored exactly and every other cache slot bit-identical. On CUDA, FULL
CUDA-graph replay equals eager at every captured size (``check_graph_replays``).

A backend joins by adding its name to ``BACKENDS`` (with the markers of the library it needs).
A case that a backend's declared ``capabilities`` exclude (``validate_configuration``,
``feature_reasons``) is skipped with the reasons. Without a GPU, backends that run on CPU run
there and Triton backends run in the Triton interpreter (small shapes). ``CUSTOM`` is
tests/minimal_backend.py, or the class given by ``pytest --custom-backend=package.module.Class``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest
import torch

import triton_modules
import vattn
from attn_harness import (DECODES, MIXED, PREFILLS, BatchSpec, check_graph_replays, check_layer_step, layer_features,
                          make_random_batch, skip_unless_served, tree_allowed)
from minimal_backend import MinimalBackend
from vattn.core.enums import AttentionCGSupport, AttentionType
from vattn.core.registry import AttentionBackendEnum
from vattn.metadata import build_common_attn_metadata

HAS_CUDA = torch.cuda.is_available()

BACKENDS = [
    pytest.param("TORCH_SDPA"),
    pytest.param("CPU_ATTN"),
    pytest.param("TRITON_ATTN"),
    pytest.param("FLEX_ATTENTION"),
    pytest.param("TREE_ATTN"),
    pytest.param("FLASH_ATTN", marks=[pytest.mark.cuda, pytest.mark.flash_attn]),
    pytest.param("FLASHINFER", marks=[pytest.mark.cuda, pytest.mark.flashinfer]),
    pytest.param("CUSTOM"),
]

#: Loaded for the interpreter where no GPU is (``triton_modules``), dependencies first.
TRITON_MODULES = ("vattn.kernels.fp8", "vattn.backends.triton.kernels", "vattn.kernels.kv_store",
                  "vattn.backends.triton.paged_attention")

if HAS_CUDA:
    GEOMETRY: dict[str, Any] = dict(num_heads=16, num_kv_heads=4, head_size=128, dtype=torch.bfloat16, device="cuda")
    HALF = torch.float16
else:
    GEOMETRY = dict(num_heads=4, num_kv_heads=2, head_size=32, dtype=torch.float32, device="cpu")
    HALF = torch.bfloat16
H = GEOMETRY["num_heads"]

CASES: dict[str, dict[str, Any]] = {
    "mixed": dict(**MIXED, num_pad_tokens=2),
    "decodes": dict(**DECODES, num_pad_tokens=3),
    "prefills": dict(**PREFILLS),
    "HND": dict(**MIXED, layout="HND"),
    "mqa": dict(**MIXED, num_heads=8, num_kv_heads=1),
    "mha": dict(**MIXED, num_kv_heads=H),
    "small-blocks": dict(**MIXED, block_size=4, num_pad_tokens=1),
    "half": dict(**MIXED, dtype=HALF),
    "fp8": dict(**MIXED, kv_cache_dtype="fp8", k_scale=0.05, v_scale=0.03),
    "fp8-e5m2-HND": dict(**MIXED, kv_cache_dtype="fp8_e5m2", layout="HND", k_scale=0.05, v_scale=0.03),
}
FEATURES = {name: f for name, f in layer_features(H, GEOMETRY["device"]).items()
            if name in ("window", "softcap", "alibi", "sinks", "all")}
#: Draft trees (``tree_parents``): a decode, a chain, two trees over cached context, one from scratch.
PARENTS = [[-1], [-1, 0, 1, 2, 3, 4], [-1, 0, 0, 1, 1, 2, -1], [-1, 0, 1, 0, 3], [-1, -1, 0, 1, 1, 2, 3, 0, 7]]
#: Token counts of the CUDA graphs captured.
SIZES = (1, 2, 4, 8, 16, 24, 32, 64)


class Target(NamedTuple):
    name: str
    cls: Any


@pytest.fixture(params=BACKENDS)
def target(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, clean_registry: None) -> Target:
    name = request.param
    if name == "CUSTOM":
        path = request.config.getoption("--custom-backend")
        if path:
            vattn.register_backend(AttentionBackendEnum.CUSTOM, path)
        else:
            vattn.register_backend(AttentionBackendEnum.CUSTOM)(MinimalBackend)
    cls = AttentionBackendEnum[name].get_class()
    if not HAS_CUDA and not cls.capabilities.runs_on_cpu:
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # a backend of Triton kernels runs in the interpreter
        ok, why = cls.is_available()
        if not ok:
            pytest.skip(f"{name} needs a CUDA GPU: {why}")
        triton_modules.load(TRITON_MODULES)
    return Target(name, cls)


def spec_of(**case: Any) -> BatchSpec:
    return BatchSpec(**{**GEOMETRY, **case})


def factor_of(spec: BatchSpec) -> float:
    """fp8 caches: the reference reads the same fp8 values, but q may be quantized too."""
    if not spec.kv_cache_dtype.startswith("fp8"):
        return 1.0
    return 10.0 if spec.dtype == torch.float32 else 3.0


@pytest.mark.parametrize("case", list(CASES))
def test_step_matches_reference(target: Target, case: str) -> None:
    spec = spec_of(**CASES[case])
    skip_unless_served(target.cls, spec)
    check_layer_step(target.name, make_random_batch(spec, seed=1), factor=factor_of(spec))


@pytest.mark.parametrize("feature", list(FEATURES))
def test_layer_feature_matches_reference(target: Target, feature: str) -> None:
    spec = spec_of(**MIXED, num_pad_tokens=2)
    skip_unless_served(target.cls, spec, **FEATURES[feature])
    check_layer_step(target.name, make_random_batch(spec, seed=2), **FEATURES[feature])


@pytest.mark.parametrize("attn_type", [AttentionType.ENCODER_ONLY, AttentionType.ENCODER])
def test_encoder_self_attention_matches_reference(target: Target, attn_type: str) -> None:
    """Bidirectional over the step's own K/V; no cache is allocated or written."""
    spec = spec_of(context_lens=(0, 0, 0), query_lens=(5, 1, 13), attn_type=attn_type, num_pad_tokens=2)
    skip_unless_served(target.cls, spec)
    assert check_layer_step(target.name, make_random_batch(spec, seed=3)).cache is None


def test_draft_trees_match_explicit_masks(target: Target) -> None:
    """Each new token sees the cached context, its ancestors and itself (backends declaring
    ``tree_parents``; ``kv.build_metadata`` refuses such steps for the others)."""
    if not target.cls.capabilities.tree_parents:
        pytest.skip(f"{target.name} does not declare tree_parents")
    context = (9, 0, 20, 3, 0)
    spec = spec_of(context_lens=context, query_lens=tuple(len(p) for p in PARENTS))
    skip_unless_served(target.cls, spec)
    batch = make_random_batch(spec, seed=4)
    common = build_common_attn_metadata(list(spec.query_lens), list(context), batch.block_tables, spec.block_size,
                                        device=spec.device, tree_parents=[p for ps in PARENTS for p in ps])
    check_layer_step(target.name, batch, common=common, allowed=tree_allowed(context, PARENTS))


def test_impl_refuses_kv_heads_that_do_not_divide_the_heads(target: Target) -> None:
    with pytest.raises(ValueError, match="num_kv_heads: expected a divisor of num_heads = 6, got 4"):
        target.cls.get_impl_cls()(6, 64, 0.1, num_kv_heads=4)


@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_full_cuda_graph_replay_equals_eager(target: Target, layout: str) -> None:
    if target.cls.get_cudagraph_support() == AttentionCGSupport.NEVER:
        pytest.skip(f"{target.name}'s builder declares no full-CUDA-graph support (NEVER)")
    kw = {**GEOMETRY, "layout": layout}
    skip_unless_served(target.cls, BatchSpec(context_lens=(1,), query_lens=(1,), **kw))
    check_graph_replays(target.name, kw, SIZES)


# ---- the minimal backend's registration -------------------------------------------------------


def test_custom_backend_is_registered_selected_and_cleared(clean_registry: None,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """``register_backend(CUSTOM)`` makes the name resolve to the class, ``VATTN_ATTENTION_BACKEND=CUSTOM``
    selects it for layers built without ``attn_backend``, and ``clear_override`` empties the slot again."""
    custom = AttentionBackendEnum.CUSTOM
    assert vattn.register_backend(custom)(MinimalBackend) is MinimalBackend
    assert custom.get_class() is MinimalBackend and custom.is_overridden()
    assert MinimalBackend.get_kv_cache_shape(10, 16, 2, 32) == (2, 10, 16, 2, 32)
    assert MinimalBackend.validate_configuration(32, torch.float32, "auto", 16) == []
    assert MinimalBackend.get_cudagraph_support() == AttentionCGSupport.NEVER
    monkeypatch.setenv("VATTN_ATTENTION_BACKEND", "CUSTOM")
    with vattn.set_current_vattn_config(vattn.VattnConfig()):
        layer = vattn.Attention(4, 32, 32**-0.5, num_kv_heads=2, prefix="l0.attn")
    assert layer.attn_backend is MinimalBackend and layer.op_stores_kv
    custom.clear_override()
    assert not custom.is_implemented()

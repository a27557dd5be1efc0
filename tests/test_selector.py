"""Backend selection: force > env var > platform priority, caching, and the error texts."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import vattn.selector as selector
from vattn.core.interface import AttentionBackend
from vattn.core.registry import _OVERRIDES, AttentionBackendEnum, register_backend, vattn_version
from vattn.platform import CpuPlatform, CudaPlatform, DeviceCapability, Platform, current_platform
from vattn.selector import (
    backend_name_to_enum,
    get_attn_backend,
    get_env_variable_attn_backend,
    get_global_forced_attn_backend,
    global_force_attn_backend,
    global_force_attn_backend_context_manager,
)

B = AttentionBackendEnum
ENV = "VATTN_ATTENTION_BACKEND"
IMPLEMENTED = ("FLASH_ATTN, TRITON_ATTN, FLASHINFER, TORCH_SDPA, FLEX_ATTENTION, CPU_ATTN, TREE_ATTN, FLASHMLA, "
               "FLASHMLA_SPARSE, "
               "FLASHINFER_MLA, TRITON_MLA, CUTLASS_MLA, FLASH_ATTN_MLA")  # this version's, in registry order
F16 = torch.float16


def make_backend(name: str, **attrs: Any) -> type[AttentionBackend]:
    """A fake backend class; ``head_sizes``/``available`` shape its validate_configuration."""
    head_sizes = attrs.pop("head_sizes", None)
    available = attrs.pop("available", (True, ""))

    class Fake(AttentionBackend):
        @staticmethod
        def get_name() -> str:
            return name

        @staticmethod
        def get_impl_cls():
            raise NotImplementedError

        @staticmethod
        def get_metadata_cls():
            raise NotImplementedError

        @staticmethod
        def get_builder_cls():
            raise NotImplementedError

        @staticmethod
        def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
            return (2, num_blocks, block_size, num_kv_heads, head_size)

        @classmethod
        def get_supported_head_sizes(cls):
            return head_sizes

        @classmethod
        def is_available(cls):
            return available

    for k, v in attrs.items():
        setattr(Fake, k, v)
    Fake.__qualname__ = Fake.__name__ = f"Fake_{name}"
    return Fake


class ListPlatform(Platform):
    """A CPU-like platform with a given priority list."""

    device_type = "cpu"

    def __init__(self, *order: AttentionBackendEnum) -> None:
        self.attention_priority = tuple(order)
        self.mla_priority = tuple(order)


@pytest.fixture(autouse=True)
def clean_selection(monkeypatch):
    """No env var, no force, no overrides, a CPU platform and an empty cache around each test."""
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(selector, "current_platform", CpuPlatform())
    forced = get_global_forced_attn_backend()
    saved = dict(_OVERRIDES.paths), dict(_OVERRIDES.classes)
    for member in list(_OVERRIDES.paths):
        member.clear_override()
    global_force_attn_backend(None)
    selector._cached_get_attn_backend.cache_clear()
    yield
    global_force_attn_backend(forced)
    for member in list(_OVERRIDES.paths):
        member.clear_override()
    _OVERRIDES.paths.update(saved[0])
    _OVERRIDES.classes.update(saved[1])
    _OVERRIDES.generation += 1
    selector._cached_get_attn_backend.cache_clear()


def use_platform(monkeypatch, platform: Platform) -> None:
    monkeypatch.setattr(selector, "current_platform", platform)


# ---- default selection and cache ---------------------------------------------------


def test_default_cpu_selection_is_cpu_attn():
    from vattn.backends.cpu_attn import CPUAttentionBackend

    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        assert get_attn_backend(64, dtype, "auto", 16) is CPUAttentionBackend
    assert get_attn_backend(128, torch.bfloat16, None, 32) is CPUAttentionBackend


def test_selection_is_cached_and_cache_clear_works(monkeypatch):
    calls = []
    fake = make_backend("CUSTOM")
    orig = fake.validate_configuration.__func__

    def counting(cls, *args, **kwargs):
        calls.append(args)
        return orig(cls, *args, **kwargs)

    fake.validate_configuration = classmethod(counting)
    register_backend(B.CUSTOM)(fake)
    use_platform(monkeypatch, ListPlatform(B.CUSTOM))
    assert get_attn_backend(64, F16, "auto", 16) is fake
    assert get_attn_backend(64, F16, "auto", 16) is fake
    assert len(calls) == 1  # second call served from the cache
    get_attn_backend(128, F16, "auto", 16)
    assert len(calls) == 2  # a new configuration is a new key
    selector._cached_get_attn_backend.cache_clear()
    get_attn_backend(64, F16, "auto", 16)
    assert len(calls) == 3


# ---- override order ----------------------------------------------------------------


def test_priority_order_takes_first_that_can_serve(monkeypatch):
    unavailable = register_backend(B.FLASH_ATTN)(make_backend("FLASH_ATTN", available=(False, "no GPU")))
    first_ok = register_backend(B.FLASHINFER)(make_backend("FLASHINFER"))
    later = register_backend(B.TRITON_ATTN)(make_backend("TRITON_ATTN"))
    use_platform(monkeypatch, ListPlatform(B.FLASH_ATTN, B.FLASHINFER, B.TRITON_ATTN))
    assert get_attn_backend(64, F16, "auto", 16) is first_ok
    # Once FLASH_ATTN can serve, it wins (override changes invalidate the cache by themselves).
    ok_fa = register_backend(B.FLASH_ATTN)(make_backend("FLASH_ATTN"))
    assert get_attn_backend(64, F16, "auto", 16) is ok_fa
    del unavailable, later


def test_layer_features_are_checked_against_the_declarations(monkeypatch):
    """A backend that declares no ALiBi / window / soft cap / encoder attention is passed over
    for a layer that uses it, and the listing says why."""
    plain = register_backend(B.FLASHINFER)(make_backend("FLASHINFER"))  # the defaults: decoder, nothing else
    rich = register_backend(B.CUSTOM)(make_backend(
        "CUSTOM", supports_alibi=True, supports_sliding_window=True, supports_logits_soft_cap=True,
        supported_attn_types=("decoder", "encoder")))
    use_platform(monkeypatch, ListPlatform(B.FLASHINFER, B.CUSTOM))
    assert get_attn_backend(64, F16, "auto", 16) is plain
    for feature in ({"use_alibi": True}, {"use_sliding_window": True}, {"use_logits_soft_cap": True},
                    {"attn_type": "encoder"}):
        assert get_attn_backend(64, F16, "auto", 16, **feature) is rich, feature
    use_platform(monkeypatch, ListPlatform(B.FLASHINFER))
    with pytest.raises(ValueError, match=r"(?s)use_alibi=True.*FLASHINFER: ALiBi not supported"):
        get_attn_backend(64, F16, "auto", 16, use_alibi=True)


def test_backend_that_fails_to_import_is_skipped(monkeypatch):
    fallback = register_backend(B.CUSTOM)(make_backend("CUSTOM"))
    use_platform(monkeypatch, ListPlatform(B.ROCM_ATTN, B.CUSTOM))  # ROCM_ATTN's module does not exist
    assert get_attn_backend(64, F16, "auto", 16) is fallback


def test_env_var_overrides_priority(monkeypatch):
    prio = register_backend(B.FLASHINFER)(make_backend("FLASHINFER"))
    custom = register_backend(B.CUSTOM)(make_backend("CUSTOM"))
    use_platform(monkeypatch, ListPlatform(B.FLASHINFER))
    assert get_attn_backend(64, F16, "auto", 16) is prio
    monkeypatch.setenv(ENV, "CUSTOM")
    assert get_env_variable_attn_backend() is B.CUSTOM
    assert get_attn_backend(64, F16, "auto", 16) is custom  # no cache clear needed
    monkeypatch.setenv(ENV, "custom")  # case-insensitive
    assert get_attn_backend(64, F16, "auto", 16) is custom
    monkeypatch.delenv(ENV)
    assert get_attn_backend(64, F16, "auto", 16) is prio


def test_global_force_overrides_env(monkeypatch):
    custom = register_backend(B.CUSTOM)(make_backend("CUSTOM"))
    forced = register_backend(B.TRITON_ATTN)(make_backend("TRITON_ATTN"))
    monkeypatch.setenv(ENV, "CUSTOM")
    assert get_attn_backend(64, F16, "auto", 16) is custom
    global_force_attn_backend(B.TRITON_ATTN)
    assert get_global_forced_attn_backend() is B.TRITON_ATTN
    assert get_attn_backend(64, F16, "auto", 16) is forced
    global_force_attn_backend("custom")  # names are accepted
    assert get_global_forced_attn_backend() is B.CUSTOM
    global_force_attn_backend(None)
    assert get_global_forced_attn_backend() is None
    assert get_attn_backend(64, F16, "auto", 16) is custom


def test_forced_backend_bypasses_priority_list(monkeypatch):
    # TRITON_ATTN is not in the CPU priority list but may be forced.
    forced = register_backend(B.TRITON_ATTN)(make_backend("TRITON_ATTN"))
    assert B.TRITON_ATTN not in CpuPlatform().get_attn_backend_priority(64, F16, "auto", 16)
    monkeypatch.setenv(ENV, "TRITON_ATTN")
    assert get_attn_backend(64, F16, "auto", 16) is forced


def test_context_manager_restores_and_clears_cache():
    a = register_backend(B.CUSTOM)(make_backend("CUSTOM"))
    b = register_backend(B.TRITON_ATTN)(make_backend("TRITON_ATTN"))
    global_force_attn_backend(B.CUSTOM)
    assert get_attn_backend(64, F16, "auto", 16) is a
    with global_force_attn_backend_context_manager(B.TRITON_ATTN):
        assert selector._cached_get_attn_backend.cache_info().currsize == 0
        assert get_global_forced_attn_backend() is B.TRITON_ATTN
        assert get_attn_backend(64, F16, "auto", 16) is b
    assert get_global_forced_attn_backend() is B.CUSTOM
    assert selector._cached_get_attn_backend.cache_info().currsize == 0
    with pytest.raises(RuntimeError, match="boom"):
        with global_force_attn_backend_context_manager(B.TRITON_ATTN):
            raise RuntimeError("boom")
    assert get_global_forced_attn_backend() is B.CUSTOM
    assert get_attn_backend(64, F16, "auto", 16) is a
    global_force_attn_backend(None)
    with global_force_attn_backend_context_manager(B.TRITON_ATTN):
        pass
    assert get_global_forced_attn_backend() is None


# ---- errors -----------------------------------------------------------------------


def test_no_backend_serves_groups_candidates(monkeypatch):
    register_backend(B.FLASH_ATTN)(make_backend("FLASH_ATTN", head_sizes=(64, 128)))
    register_backend(B.TRITON_ATTN)(make_backend("TRITON_ATTN", head_sizes=(32, 64, 128, 256)))
    use_platform(monkeypatch, ListPlatform(B.FLASH_ATTN, B.TRITON_ATTN, B.ROCM_ATTN))
    with pytest.raises(ValueError) as ei:
        get_attn_backend(7, F16, "auto", 16)
    lines = str(ei.value).splitlines()
    assert lines[0].startswith("no attention backend on cpu can serve head_size=7")
    assert lines[1:5] == [
        "Candidates that cannot serve here, and why:",
        "  FLASH_ATTN: head_size 7 not in [64, 128]",
        "  TRITON_ATTN: head_size 7 not in [32, 64, 128, 256]",
        f"Candidates not implemented in {vattn_version()}: ROCM_ATTN",
    ]
    assert "register_backend" in lines[5]
    assert "does not exist" not in str(ei.value)  # unimplemented ones are never imported


def test_only_unimplemented_candidates(monkeypatch):
    use_platform(monkeypatch, ListPlatform(B.ROCM_ATTN))
    with pytest.raises(ValueError) as ei:
        get_attn_backend(64, F16, "auto", 16)
    msg = str(ei.value)
    assert f"\nCandidates not implemented in {vattn_version()}: ROCM_ATTN\n" in msg
    assert "cannot serve here" not in msg


def test_missing_override_module_cannot_serve_here(monkeypatch):
    register_backend(B.CUSTOM, "_vattn_no_such_pkg.Backend")
    use_platform(monkeypatch, ListPlatform(B.CUSTOM))
    with pytest.raises(ValueError, match=r"cannot serve here, and why:\n  CUSTOM: .*does not exist") as ei:
        get_attn_backend(64, F16, "auto", 16)
    assert "not implemented" not in str(ei.value)


def test_mla_on_cpu_is_refused_with_reason(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"use_mla=True.*\nCandidates that cannot serve here, and why:\n"
                       r"  TRITON_MLA: .*TRITON_INTERPRET=1"):
        get_attn_backend(576, F16, "auto", 16, use_mla=True)


def test_mla_on_cuda_says_why_each_mla_backend_cannot_serve(monkeypatch):
    """Without a GPU every MLA backend on the list refuses and says why; the backends vattn cannot
    serve (FLASHMLA, CUTLASS_MLA) are on no list, and name the kernels they need when forced."""
    use_platform(monkeypatch, CudaPlatform())
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError) as ei:
        get_attn_backend(576, torch.bfloat16, "auto", 64, use_mla=True)
    msg = str(ei.value)
    reasons = dict(line.strip().split(": ", 1) for line in msg.split("and why:\n")[1].split("\nChange")[0].splitlines())
    assert list(reasons) == ["FLASHINFER_MLA", "FLASH_ATTN_MLA", "TRITON_MLA"]
    for name, needs in (("FLASHMLA", "flash_mla"), ("CUTLASS_MLA", "vllm._C")):
        monkeypatch.setenv(ENV, name)
        with pytest.raises(ValueError, match=f"(?s){needs}.*cannot install"):
            get_attn_backend(576, torch.bfloat16, "auto", 64, use_mla=True)
    assert "GPU" in reasons["FLASHINFER_MLA"] and "GPU" in reasons["FLASH_ATTN_MLA"]
    assert "not implemented" not in msg
    assert "FLASH_ATTN:" not in msg.replace("FLASH_ATTN_MLA", "")


def test_forced_backend_that_cannot_serve_says_why(monkeypatch):
    register_backend(B.TRITON_ATTN)(make_backend("TRITON_ATTN", head_sizes=(64,)))
    global_force_attn_backend(B.TRITON_ATTN)
    with pytest.raises(
        ValueError,
        match=r"TRITON_ATTN \(forced by global_force_attn_backend\) cannot serve head_size=80.*"
        r"head_size 80 not in \[64\]",
    ) as ei:
        get_attn_backend(80, F16, "auto", 16)
    assert "not implemented" not in str(ei.value)


@pytest.mark.parametrize("how", ["env", "global"])
def test_forced_backend_not_implemented_says_so(monkeypatch, how):
    if how == "env":
        monkeypatch.setenv(ENV, "rocm_attn")
        source = "VATTN_ATTENTION_BACKEND='rocm_attn'"
    else:
        global_force_attn_backend("ROCM_ATTN")
        source = "global_force_attn_backend"
    with pytest.raises(ValueError) as ei:
        get_attn_backend(64, F16, "auto", 16)
    msg = str(ei.value)
    assert msg.startswith(f"attention backend ROCM_ATTN (forced by {source}) is not implemented in {vattn_version()}. "
                          f"Implemented backends: {IMPLEMENTED}. ")
    assert "register_backend(AttentionBackendEnum.ROCM_ATTN" in msg
    assert "does not exist" not in msg and "cannot serve" not in msg


def test_forced_unimplemented_name_with_an_override_is_used(monkeypatch):
    mine = register_backend(B.ROCM_ATTN)(make_backend("ROCM_ATTN"))
    monkeypatch.setenv(ENV, "ROCM_ATTN")
    assert get_attn_backend(64, F16, "auto", 16) is mine  # the registry generation is in the cache key
    B.ROCM_ATTN.clear_override()
    with pytest.raises(ValueError, match="ROCM_ATTN .* is not implemented in"):
        get_attn_backend(64, F16, "auto", 16)


def test_forced_unregistered_custom(monkeypatch):
    monkeypatch.setenv(ENV, "CUSTOM")
    with pytest.raises(ValueError, match=r"CUSTOM.*must be registered before use"):
        get_attn_backend(64, F16, "auto", 16)


def test_registered_non_backend_class_is_rejected(monkeypatch):
    @register_backend(B.CUSTOM)
    class NotABackend:
        pass

    monkeypatch.setenv(ENV, "CUSTOM")
    with pytest.raises(ValueError, match="not a subclass of vattn.core.interface.AttentionBackend"):
        get_attn_backend(64, F16, "auto", 16)


def test_unknown_env_name_lists_valid(monkeypatch):
    monkeypatch.setenv(ENV, "FLASH_ATTENTION_9")
    with pytest.raises(ValueError, match=r"VATTN_ATTENTION_BACKEND='FLASH_ATTENTION_9' is not an attention "
                       rf"backend\. Valid options are: {IMPLEMENTED.replace('TREE_ATTN', 'TREE_ATTN, NO_ATTENTION')}, CUSTOM \(register a backend first\); "
                       r"named but not implemented in .*: ROCM_ATTN\. Set it"):
        get_env_variable_attn_backend()
    with pytest.raises(ValueError, match="Valid options are"):
        get_attn_backend(64, F16, "auto", 16)


def test_argument_validation():
    with pytest.raises(ValueError, match="head_size must be a positive int, got 0"):
        get_attn_backend(0, F16, "auto", 16)
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        get_attn_backend(64, F16, "auto", -1)
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        get_attn_backend(64, "float16", "auto", 16)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kv_cache_dtype must be None or one of"):
        get_attn_backend(64, F16, "fp9", 16)


def test_global_force_argument_errors():
    with pytest.raises(ValueError, match="Unknown attention backend: 'NOPE'"):
        global_force_attn_backend("NOPE")
    with pytest.raises(TypeError, match="must be an AttentionBackendEnum"):
        global_force_attn_backend(3)  # type: ignore[arg-type]
    assert get_global_forced_attn_backend() is None


def test_backend_name_to_enum():
    assert backend_name_to_enum("TORCH_SDPA") is B.TORCH_SDPA
    assert backend_name_to_enum(" flash_attn ") is B.FLASH_ATTN
    assert backend_name_to_enum("NOT_A_BACKEND") is None
    with pytest.raises(TypeError, match="backend_name must be a str"):
        backend_name_to_enum(None)  # type: ignore[arg-type]
    assert get_env_variable_attn_backend() is None


# ---- platform ------------------------------------------------------------------------


def test_platform_priority_tables():
    cuda, cpu = CudaPlatform(), CpuPlatform()
    assert CudaPlatform.attention_priority == (B.FLASH_ATTN, B.FLASHINFER, B.TRITON_ATTN, B.TORCH_SDPA)
    assert CudaPlatform.hopper_priority == (B.TRITON_ATTN, B.FLASHINFER, B.FLASH_ATTN, B.TORCH_SDPA)
    mla = cuda.get_attn_backend_priority(576, torch.bfloat16, "auto", 64, use_mla=True)
    assert mla[0] is B.FLASHINFER_MLA and B.TRITON_MLA in mla and B.FLASH_ATTN not in mla
    assert not {B.FLASHMLA, B.FLASHMLA_SPARSE, B.CUTLASS_MLA} & set(mla + list(CudaPlatform.hopper_mla_priority))
    assert cpu.get_attn_backend_priority(64, torch.float32, "auto", 16) == [B.CPU_ATTN, B.TORCH_SDPA]
    assert cuda.device_type == "cuda" and cpu.device_type == "cpu"
    assert cuda.is_cuda() and cpu.is_cpu() and not cpu.is_cuda()
    assert cuda.opaque_attention_op() and cpu.opaque_attention_op()
    assert cpu.get_device_capability() is None
    assert DeviceCapability(9, 0).to_int() == 90


def test_current_platform_matches_machine():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert current_platform.device_type == expected
    assert current_platform.opaque_attention_op() is True
    if expected == "cpu":
        assert current_platform.get_device_capability() is None


@pytest.mark.cuda
def test_cuda_capability():
    cap = CudaPlatform().get_device_capability()
    assert cap is not None and cap.major >= 7


def test_cuda_priority_by_dtype_and_capability(monkeypatch):
    cuda = CudaPlatform()
    B = AttentionBackendEnum
    monkeypatch.setattr(CudaPlatform, "get_device_capability", lambda self, device_id=0: DeviceCapability(9, 0))
    assert cuda.get_attn_backend_priority(128, torch.bfloat16, "auto", 16)[:2] == [B.TRITON_ATTN, B.FLASHINFER]
    assert cuda.get_attn_backend_priority(128, torch.float32, "auto", 16)[0] == B.TORCH_SDPA
    monkeypatch.setattr(CudaPlatform, "get_device_capability", lambda self, device_id=0: DeviceCapability(10, 0))
    assert cuda.get_attn_backend_priority(128, torch.float16, "auto", 16)[0] == B.FLASH_ATTN
    assert cuda.get_attn_backend_priority(128, torch.float16, "auto", 16, use_mla=True)[0] == B.FLASHINFER_MLA


def test_flashinfer_decode_tensor_core_flag(monkeypatch):
    from vattn import envs

    monkeypatch.delenv("VATTN_FLASHINFER_DECODE_TENSOR_CORES", raising=False)
    assert envs.VATTN_FLASHINFER_DECODE_TENSOR_CORES is True  # default: the tensor-core kernel
    monkeypatch.setenv("VATTN_FLASHINFER_DECODE_TENSOR_CORES", "0")
    assert envs.VATTN_FLASHINFER_DECODE_TENSOR_CORES is False

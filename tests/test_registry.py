"""The backend registry: names, lazy class paths, overrides, CUSTOM, errors."""

from __future__ import annotations

import sys
import types

import pytest

from vattn.backends.abstract import AttentionBackend
from vattn.backends.registry import (
    _OVERRIDES,
    MAMBA_TYPE_TO_BACKEND_MAP,
    AttentionBackendEnum,
    MambaAttentionBackendEnum,
    register_backend,
    registry_generation,
)

B = AttentionBackendEnum


@pytest.fixture(autouse=True)
def _restore_overrides():
    """Each test starts without overrides; whatever was registered before is restored after."""
    saved = dict(_OVERRIDES.paths), dict(_OVERRIDES.classes)
    for member in list(_OVERRIDES.paths):
        member.clear_override()
    yield
    for member in list(_OVERRIDES.paths):
        member.clear_override()
    _OVERRIDES.paths.update(saved[0])
    _OVERRIDES.classes.update(saved[1])
    _OVERRIDES.generation += 1


@pytest.fixture
def fake_module(monkeypatch):
    """An importable module ``_vattn_fake_backends`` holding two classes."""
    mod = types.ModuleType("_vattn_fake_backends")

    class FakeA:
        pass

    class FakeB:
        pass

    FakeA.__module__ = FakeB.__module__ = mod.__name__
    mod.FakeA, mod.FakeB = FakeA, FakeB
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return mod


def test_required_members_exist():
    names = set(B.__members__)
    required = {
        "FLASH_ATTN", "TRITON_ATTN", "FLASHINFER", "TORCH_SDPA", "FLEX_ATTENTION", "CPU_ATTN",
        "NO_ATTENTION", "FLASHMLA", "FLASHINFER_MLA", "TRITON_MLA", "CUTLASS_MLA", "FLASH_ATTN_MLA",
        "CUSTOM",
    }
    assert required <= names
    # No two members alias each other (an empty CUSTOM must not swallow another member).
    assert len(list(B)) == len(B.__members__)


def test_default_paths_point_into_vattn_backends():
    assert B.TORCH_SDPA.get_path() == "vattn.backends.torch_sdpa.TorchSDPABackend"
    assert B.TRITON_ATTN.get_path() == "vattn.backends.triton.TritonAttentionBackend"
    assert B.FLASHINFER.get_path() == "vattn.backends.flashinfer.FlashInferBackend"
    assert B.FLASH_ATTN.get_path() == "vattn.backends.flash_attn.FlashAttentionBackend"
    assert B.FLASH_ATTN.get_path(include_classname=False) == "vattn.backends.flash_attn"
    for member in B:
        if member is not B.CUSTOM:
            assert member.get_path().startswith("vattn.backends."), member


def test_unknown_name_lists_valid_options():
    with pytest.raises(ValueError, match=r"Unknown attention backend: 'NOPE'") as ei:
        B["NOPE"]
    msg = str(ei.value)
    assert "Valid options are:" in msg
    for name in ("FLASH_ATTN", "TORCH_SDPA", "CUSTOM"):
        assert name in msg
    with pytest.raises(ValueError, match="Valid options are: MAMBA1"):
        MambaAttentionBackendEnum["NOPE"]
    assert B["TORCH_SDPA"] is B.TORCH_SDPA


def test_unregistered_custom_is_a_clear_error():
    with pytest.raises(ValueError, match=r"CUSTOM must be registered before use.*register_backend"):
        B.CUSTOM.get_path()
    with pytest.raises(ValueError, match="must be registered"):
        B.CUSTOM.get_class()
    with pytest.raises(ValueError, match="MambaAttentionBackendEnum.CUSTOM must be registered"):
        MambaAttentionBackendEnum.CUSTOM.get_class()


def test_missing_module_import_error_names_backend():
    with pytest.raises(ImportError, match=r"FLASHMLA.*'vattn.backends.mla.flashmla' does not exist"):
        B.FLASHMLA.get_class()
    with pytest.raises(ImportError, match="MAMBA2"):
        MambaAttentionBackendEnum.MAMBA2.get_class()


def test_missing_class_and_missing_dependency(monkeypatch, tmp_path, fake_module):
    register_backend(B.CUSTOM, "_vattn_fake_backends.NoSuchClass")
    with pytest.raises(ImportError, match=r"CUSTOM.*has no class 'NoSuchClass'"):
        B.CUSTOM.get_class()
    # A module that exists but whose own import fails on a missing library.
    (tmp_path / "_vattn_broken_backend.py").write_text("import _vattn_not_installed_lib\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    register_backend(B.CUSTOM, "_vattn_broken_backend.X")
    with pytest.raises(ImportError, match=r"CUSTOM: importing '_vattn_broken_backend' failed because "
                       r"'_vattn_not_installed_lib' is not installed"):
        B.CUSTOM.get_class()
    monkeypatch.delitem(sys.modules, "_vattn_broken_backend", raising=False)


def test_class_path_override_and_clear(fake_module):
    assert not B.FLASH_ATTN.is_overridden()
    gen = registry_generation()
    deco = register_backend(B.FLASH_ATTN, "_vattn_fake_backends.FakeA")
    assert registry_generation() != gen
    assert deco(int) is int  # no-op decorator when class_path is given
    assert B.FLASH_ATTN.is_overridden()
    assert B.FLASH_ATTN.get_path() == "_vattn_fake_backends.FakeA"
    assert B.FLASH_ATTN.get_class() is fake_module.FakeA
    B.FLASH_ATTN.clear_override()
    assert not B.FLASH_ATTN.is_overridden()
    assert B.FLASH_ATTN.get_path() == B.FLASH_ATTN.value
    B.FLASH_ATTN.clear_override()  # clearing twice is a no-op


def test_decorator_fills_custom_even_for_local_classes():
    @register_backend(B.CUSTOM)
    class LocalBackend(AttentionBackend):  # qualname has <locals>: not importable by path
        pass

    assert B.CUSTOM.is_overridden()
    assert B.CUSTOM.get_class() is LocalBackend
    assert B.CUSTOM.get_path().endswith("LocalBackend")
    # Re-registering by path replaces the class object.
    register_backend(B.CUSTOM, "vattn.backends.abstract.AttentionBackend")
    assert B.CUSTOM.get_class() is AttentionBackend
    B.CUSTOM.clear_override()
    with pytest.raises(ValueError, match="must be registered"):
        B.CUSTOM.get_class()


def test_override_only_affects_its_member():
    @register_backend(B.TRITON_ATTN)
    class Other:
        pass

    assert B.TRITON_ATTN.get_class() is Other
    assert not B.FLASHINFER.is_overridden()
    assert not MambaAttentionBackendEnum.CUSTOM.is_overridden()


def test_mamba_registration():
    @register_backend(MambaAttentionBackendEnum.LINEAR, is_mamba=True)
    class MyLinear:
        pass

    assert MambaAttentionBackendEnum.LINEAR.get_class() is MyLinear
    assert MambaAttentionBackendEnum.LINEAR.is_overridden()
    assert not B.CUSTOM.is_overridden()
    MambaAttentionBackendEnum.LINEAR.clear_override()
    assert not MambaAttentionBackendEnum.LINEAR.is_overridden()
    assert set(MAMBA_TYPE_TO_BACKEND_MAP.values()) <= set(MambaAttentionBackendEnum.__members__)


def test_register_backend_argument_errors():
    with pytest.raises(TypeError, match="is_mamba=True"):
        register_backend(MambaAttentionBackendEnum.LINEAR, "a.b.C")
    with pytest.raises(TypeError, match="is_mamba=False"):
        register_backend(B.CUSTOM, "a.b.C", is_mamba=True)
    with pytest.raises(TypeError, match="must be an AttentionBackendEnum"):
        register_backend("CUSTOM", "a.b.C")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dotted path"):
        register_backend(B.CUSTOM, "NoDots")
    with pytest.raises(TypeError, match="must decorate a class"):
        register_backend(B.CUSTOM)(lambda: None)  # type: ignore[arg-type]
    assert not B.CUSTOM.is_overridden()


def test_torch_sdpa_resolves():
    pytest.importorskip("vattn.backends.torch_sdpa")
    cls = B.TORCH_SDPA.get_class()
    assert issubclass(cls, AttentionBackend)
    assert cls.get_name() == "TORCH_SDPA"

"""The backend registry: names, lazy class paths, overrides, CUSTOM, errors."""

from __future__ import annotations


import vattn
import subprocess
import sys
import types

import pytest

from vattn.core.interface import AttentionBackend
from vattn.core.registry import (
    MAMBA_TYPE_TO_BACKEND_MAP,
    AttentionBackendEnum,
    MambaAttentionBackendEnum,
    register_backend,
    registry_generation,
    vattn_version,
)

B = AttentionBackendEnum
#: The backends this version ships, and the named ones it does not (later versions may add some).
IMPLEMENTED = ("FLASH_ATTN", "TRITON_ATTN", "FLASHINFER", "TORCH_SDPA", "FLEX_ATTENTION", "CPU_ATTN", "TREE_ATTN",
               "FLASHMLA", "FLASHMLA_SPARSE", "FLASHINFER_MLA", "TRITON_MLA", "CUTLASS_MLA", "FLASH_ATTN_MLA", "NO_ATTENTION")
NAMED_ONLY = ("ROCM_ATTN",)


# Each test starts without overrides; whatever was registered before is restored after.
pytestmark = pytest.mark.usefixtures("clean_registry")


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
        "FLASH_ATTN", "TRITON_ATTN", "FLASHINFER", "TORCH_SDPA", "FLEX_ATTENTION", "CPU_ATTN", "ROCM_ATTN",
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


def test_unknown_name_lists_implemented_then_named_only():
    with pytest.raises(ValueError, match=r"^Unknown attention backend: 'NOPE'\. Valid options are: ") as ei:
        B["NOPE"]
    msg = str(ei.value)
    valid, sep, named_only = msg.partition(f"; named but not implemented in {vattn_version()}: ")
    assert sep, msg
    for name in IMPLEMENTED:
        assert name in valid.split(": ", 2)[-1].split(", "), (name, msg)
        assert name not in named_only.split(", ")
    assert "CUSTOM (register a backend first)" in valid
    assert named_only.split(", ") == [m.name for m in B if m.name in NAMED_ONLY]
    assert B["TORCH_SDPA"] is B.TORCH_SDPA


def test_unknown_name_moves_a_registered_member_to_valid(fake_module):
    register_backend(B.ROCM_ATTN, "_vattn_fake_backends.FakeA")
    with pytest.raises(ValueError) as ei:
        B["NOPE"]
    valid, _, named_only = str(ei.value).partition("named but not implemented")
    assert "ROCM_ATTN" in valid and "ROCM_ATTN" not in named_only
    assert "NO_ATTENTION" in valid and not named_only


def test_unknown_mamba_name():
    with pytest.raises(ValueError) as ei:
        MambaAttentionBackendEnum["NOPE"]
    assert str(ei.value) == (
        "Unknown attention backend: 'NOPE'. Valid options are: MAMBA1, MAMBA2, SHORT_CONV, LINEAR, GDN_ATTN, "
        "CUSTOM (register a backend first)"
    )


def test_is_implemented():
    for name in IMPLEMENTED:
        assert B[name].is_implemented(), name
    for name in NAMED_ONLY:
        assert not B[name].is_implemented(), name
    assert not B.CUSTOM.is_implemented()  # an empty slot until something is registered
    assert all(m.is_implemented() for m in MambaAttentionBackendEnum if m is not MambaAttentionBackendEnum.CUSTOM)


def test_is_implemented_follows_overrides(fake_module):
    register_backend(B.CUSTOM, "_vattn_fake_backends.FakeA")
    assert B.CUSTOM.is_implemented()
    register_backend(B.ROCM_ATTN, "_vattn_fake_backends.FakeB")
    assert B.ROCM_ATTN.is_implemented()
    assert B.ROCM_ATTN.get_class() is fake_module.FakeB
    B.ROCM_ATTN.clear_override()
    B.CUSTOM.clear_override()
    assert not B.ROCM_ATTN.is_implemented() and not B.CUSTOM.is_implemented()

    @register_backend(MambaAttentionBackendEnum.GDN_ATTN, is_mamba=True)
    class MyGDN:
        pass

    assert MambaAttentionBackendEnum.GDN_ATTN.get_class() is MyGDN
    MambaAttentionBackendEnum.GDN_ATTN.clear_override()
    assert MambaAttentionBackendEnum.GDN_ATTN.get_class().__name__ == "GDNAttentionBackend"


def test_is_implemented_imports_nothing():
    """Finding a module must not import it (or the kernel library it would pull in)."""
    code = (
        "import sys, vattn\n"
        "from vattn.core.registry import AttentionBackendEnum as B\n"
        "before = set(sys.modules)\n"
        "print([m.name for m in B if m.is_implemented()])\n"
        "print(sorted(m for m in set(sys.modules) - before if m.startswith(('vattn', 'triton', 'flash'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    implemented, newly_imported = out.strip().splitlines()
    assert implemented == repr([m.name for m in B if m.name in IMPLEMENTED])
    # Finding vattn.backends.mla.<module> imports its parent package: a docstring, nothing else.
    assert newly_imported in ("[]", "['vattn.backends.mla']")


def test_vattn_version():
    assert vattn_version() == f"vattn {vattn.__version__}"


def test_unregistered_custom_is_a_clear_error():
    with pytest.raises(ValueError, match=r"CUSTOM must be registered before use.*register_backend"):
        B.CUSTOM.get_path()
    with pytest.raises(ValueError, match="must be registered"):
        B.CUSTOM.get_class()
    with pytest.raises(ValueError, match="MambaAttentionBackendEnum.CUSTOM must be registered"):
        MambaAttentionBackendEnum.CUSTOM.get_class()


def test_not_implemented_member_says_so():
    with pytest.raises(ImportError) as ei:
        B.ROCM_ATTN.get_class()
    msg = str(ei.value)
    assert msg.startswith(f"ROCM_ATTN is not implemented in {vattn_version()} ")
    assert "'vattn.backends.rocm_attn'" in msg
    implemented = [m.name for m in B if m.name in IMPLEMENTED]
    assert f"Choose one of the implemented ones ({', '.join(implemented)})" in msg
    assert "register_backend(AttentionBackendEnum.ROCM_ATTN, 'your.module.YourBackend')" in msg
    assert "not installed" not in msg  # not to be confused with a missing library


def test_override_with_a_missing_module_is_not_called_unimplemented():
    register_backend(B.CUSTOM, "_vattn_no_such_pkg.mod.Backend")
    with pytest.raises(ImportError) as ei:
        B.CUSTOM.get_class()
    msg = str(ei.value)
    assert "CUSTOM: module '_vattn_no_such_pkg.mod' of the registered class path" in msg
    assert "does not exist" in msg and "not implemented" not in msg


def test_missing_class_and_missing_dependency(monkeypatch, tmp_path, fake_module):
    register_backend(B.CUSTOM, "_vattn_fake_backends.NoSuchClass")
    with pytest.raises(ImportError, match=r"CUSTOM.*has no class 'NoSuchClass'"):
        B.CUSTOM.get_class()
    # A module that exists but whose own import fails on a missing library.
    (tmp_path / "_vattn_broken_backend.py").write_text("import _vattn_not_installed_lib\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    register_backend(B.CUSTOM, "_vattn_broken_backend.X")
    with pytest.raises(ImportError, match=r"CUSTOM: importing '_vattn_broken_backend' failed because "
                       r"'_vattn_not_installed_lib' is not installed") as ei:
        B.CUSTOM.get_class()
    assert "not implemented" not in str(ei.value)
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
    register_backend(B.CUSTOM, "vattn.core.interface.AttentionBackend")
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

"""The attention backend registry: a lazy map from backend names to backend classes.

Each ``AttentionBackendEnum`` member's value is the dotted path of its default class;
nothing is imported until ``get_class()`` is called, so optional kernel libraries
(flash_attn, flashinfer) stay unimported until a backend that needs them is chosen.

``register_backend`` overrides a member's class at run time (or fills ``CUSTOM``):

>>> @register_backend(AttentionBackendEnum.CUSTOM)  # doctest: +SKIP
... class MyBackend(AttentionBackend): ...
>>> AttentionBackendEnum.CUSTOM.get_class() is MyBackend  # doctest: +SKIP
True
>>> AttentionBackendEnum.CUSTOM.clear_override()  # doctest: +SKIP

Members whose module this vattn installation does not ship (the MLA backends, FLEX_ATTENTION,
...) point at the path they will have. ``is_implemented()`` tells them apart without importing
anything; ``get_class()`` on them raises an ``ImportError`` saying the backend is not implemented
in this version, distinct from the ``ImportError`` of a backend whose library is not installed.
"""

from __future__ import annotations

import enum
import importlib
import importlib.util
import logging
from typing import TYPE_CHECKING, Callable, TypeVar

from vattn._version import __version__

if TYPE_CHECKING:
    from vattn.core.interface import AttentionBackend

__all__ = [
    "AttentionBackendEnum",
    "MambaAttentionBackendEnum",
    "MAMBA_TYPE_TO_BACKEND_MAP",
    "register_backend",
    "valid_options",
    "vattn_version",
]

logger = logging.getLogger("vattn.core.registry")

_T = TypeVar("_T", bound=type)


class _Overrides:
    """Run-time overrides of registry members (both enums), and a change counter.

    ``paths`` maps a member to the dotted class path that replaces its default;
    ``classes`` additionally holds the class object when it was registered with the
    decorator (so classes defined inside functions, whose path cannot be imported,
    still resolve). ``generation`` grows on every change; the selector puts it in its
    cache key so a cached selection never outlives an override.
    """

    def __init__(self) -> None:
        self.paths: dict[enum.Enum, str] = {}
        self.classes: dict[enum.Enum, type] = {}
        self.generation = 0

    def set(self, member: enum.Enum, path: str, cls: type | None) -> None:
        self.paths[member] = path
        if cls is None:
            self.classes.pop(member, None)
        else:
            self.classes[member] = cls
        self.generation += 1

    def clear(self, member: enum.Enum) -> None:
        if member in self.paths:
            del self.paths[member]
            self.classes.pop(member, None)
            self.generation += 1


_OVERRIDES = _Overrides()


def registry_generation() -> int:
    """A counter that changes whenever an override is registered or cleared."""
    return _OVERRIDES.generation


def vattn_version() -> str:
    """``"vattn 0.1.0"``: this vattn's version, for messages."""
    return f"vattn {__version__}"


def _module_exists(module_name: str) -> bool:
    """Whether ``module_name`` can be found, without importing it (parent packages are imported)."""
    try:
        return importlib.util.find_spec(module_name) is not None
    except (ImportError, ValueError):  # a missing parent package, or a broken __spec__
        return False


class _AttentionBackendEnumMeta(enum.EnumMeta):
    """Enum metaclass whose ``Enum[name]`` error lists the valid names, implemented ones first."""

    def __getitem__(cls, name: str):  # type: ignore[override]
        try:
            return super().__getitem__(name)
        except KeyError:
            raise ValueError(f"Unknown attention backend: {name!r}. {valid_options(cls)}") from None


def valid_options(enum_cls: type) -> str:
    """``"Valid options are: A, B, CUSTOM (register a backend first); named but not implemented
    in vattn X: C, D"``: the members of ``enum_cls`` by whether they can be used."""
    usable, missing = [], []
    for member in enum_cls:  # type: ignore[attr-defined]
        if member.is_implemented():
            usable.append(member.name)
        elif not member.value:
            usable.append(f"{member.name} (register a backend first)")
        else:
            missing.append(member.name)
    text = f"Valid options are: {', '.join(usable)}"
    if missing:
        text += f"; named but not implemented in {vattn_version()}: {', '.join(missing)}"
    return text


def _import_class(member: enum.Enum, path: str) -> type:
    """Import ``path`` ("pkg.module.Class"), raising an ImportError that names the backend."""
    module_name, _, class_name = path.rpartition(".")
    label = f"{type(member).__name__}.{member.name}"
    if not module_name:
        raise ImportError(
            f"attention backend {label}: class path {path!r} is not of the form "
            "'package.module.ClassName'; re-register it with a full dotted path."
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        # Is the backend's own module (or a parent package) missing, or one of its dependencies?
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ImportError(
                f"attention backend {label}: module {module_name!r} of the registered class path "
                f"{path!r} does not exist. Register the correct path with "
                f"register_backend({label}, 'your.module.YourBackend')."
            ) from e
        raise ImportError(
            f"attention backend {label}: importing {module_name!r} failed because "
            f"{e.name or 'a dependency'!r} is not installed ({e}). Install it or choose another backend."
        ) from e
    except ImportError as e:
        raise ImportError(
            f"attention backend {label}: importing {module_name!r} failed: {e}. "
            "Install the backend's library or choose another backend."
        ) from e
    try:
        return getattr(module, class_name)
    except AttributeError:
        raise ImportError(
            f"attention backend {label}: module {module_name!r} has no class {class_name!r}."
        ) from None


class _RegistryMember:
    """Methods shared by ``AttentionBackendEnum`` and ``MambaAttentionBackendEnum`` members."""

    name: str
    value: str

    def get_path(self, include_classname: bool = True) -> str:
        """The class path of this backend, respecting overrides.

        Args:
            include_classname: ``False`` returns only the module path.

        Raises:
            ValueError: the member is ``CUSTOM`` (or another empty slot) and nothing was registered.
        """
        path = _OVERRIDES.paths.get(self, self.value)  # type: ignore[call-overload]
        if not path:
            cls_name = type(self).__name__
            raise ValueError(
                f"Backend {cls_name}.{self.name} must be registered before use: call "
                f"register_backend({cls_name}.{self.name}, 'your.module.YourBackend') or decorate "
                f"your backend class with @register_backend({cls_name}.{self.name})."
            )
        if not include_classname:
            path = path.rpartition(".")[0]
        return path

    def get_class(self) -> "type[AttentionBackend]":
        """Import and return the backend class, respecting overrides.

        Raises:
            ImportError: the backend is not implemented in this vattn version (see
                ``is_implemented``), or its module or class does not exist, or a library it needs
                is missing; the message names the backend and the reason.
            ValueError: ``CUSTOM`` used before it was registered.
        """
        path = self.get_path()
        cls = _OVERRIDES.classes.get(self)  # type: ignore[call-overload]
        if cls is not None:
            return cls
        if not self.is_implemented():
            label = f"{type(self).__name__}.{self.name}"
            implemented = [m.name for m in type(self) if m.is_implemented()]  # type: ignore[attr-defined]
            mamba = ", is_mamba=True" if isinstance(self, MambaAttentionBackendEnum) else ""
            register = f"register_backend({label}, 'your.module.YourBackend'{mamba})"
            advice = (f"Choose one of the implemented ones ({', '.join(implemented)}) or register your "
                      f"own class with {register}." if implemented else f"Register your own class with {register}.")
            raise ImportError(
                f"{self.name} is not implemented in {vattn_version()} (its module "
                f"{self.get_path(include_classname=False)!r} is not part of this installation). {advice}"
            )
        return _import_class(self, path)  # type: ignore[arg-type]

    def is_implemented(self) -> bool:
        """Whether this installation can provide the backend's class: an override is registered,
        or the default module exists (found without importing it; an unregistered ``CUSTOM``: False).

        ``True`` does not mean it runs here: its library may be missing or the device unsuitable
        (``get_class().is_available()`` says that).
        """
        if self in _OVERRIDES.paths:
            return True
        module_name = self.value.rpartition(".")[0]
        return bool(module_name) and _module_exists(module_name)

    def is_overridden(self) -> bool:
        """Whether ``register_backend`` replaced this member's default class."""
        return self in _OVERRIDES.paths

    def clear_override(self) -> None:
        """Drop any override, reverting to the default class path (no-op if none)."""
        _OVERRIDES.clear(self)  # type: ignore[arg-type]


@enum.unique
class AttentionBackendEnum(_RegistryMember, enum.Enum, metaclass=_AttentionBackendEnumMeta):
    """Every attention backend vattn knows by name.

    The value is the default class path; ``register_backend`` can override it at run
    time. Use ``member.get_class()`` for the class (respects overrides).
    """

    FLASH_ATTN = "vattn.backends.flash_attn.FlashAttentionBackend"
    TRITON_ATTN = "vattn.backends.triton.TritonAttentionBackend"
    FLASHINFER = "vattn.backends.flashinfer.FlashInferBackend"
    TORCH_SDPA = "vattn.backends.torch_sdpa.TorchSDPABackend"
    FLEX_ATTENTION = "vattn.backends.flex_attention.FlexAttentionBackend"
    CPU_ATTN = "vattn.backends.cpu_attn.CPUAttentionBackend"
    ROCM_ATTN = "vattn.backends.rocm_attn.RocmAttentionBackend"  # named (the seeds'), not implemented: AMD GPUs
    TREE_ATTN = "vattn.backends.tree_attn.TreeAttentionBackend"
    NO_ATTENTION = "vattn.backends.no_attention.NoAttentionBackend"
    # Multi-head latent attention (DeepSeek-style); planned, not shipped yet.
    FLASHMLA = "vattn.backends.mla.flashmla.FlashMLABackend"
    FLASHMLA_SPARSE = "vattn.backends.mla.flashmla_sparse.FlashMLASparseBackend"
    FLASHINFER_MLA = "vattn.backends.mla.flashinfer_mla.FlashInferMLABackend"
    TRITON_MLA = "vattn.backends.mla.triton_mla.TritonMLABackend"
    CUTLASS_MLA = "vattn.backends.mla.cutlass_mla.CutlassMLABackend"
    FLASH_ATTN_MLA = "vattn.backends.mla.flashattn_mla.FlashAttnMLABackend"
    # Placeholder for third-party backends: register before use.
    CUSTOM = ""


@enum.unique
class MambaAttentionBackendEnum(_RegistryMember, enum.Enum, metaclass=_AttentionBackendEnumMeta):
    """State-space / linear-attention "backends" (for hybrid models); none ship yet.

    Same API as ``AttentionBackendEnum``; register with ``register_backend(..., is_mamba=True)``.
    """

    MAMBA1 = "vattn.backends.mamba.mamba1_attn.Mamba1AttentionBackend"
    MAMBA2 = "vattn.backends.mamba.mamba2_attn.Mamba2AttentionBackend"
    SHORT_CONV = "vattn.backends.mamba.short_conv_attn.ShortConvAttentionBackend"
    LINEAR = "vattn.backends.mamba.linear_attn.LinearAttentionBackend"
    GDN_ATTN = "vattn.backends.mamba.gdn_attn.GDNAttentionBackend"
    CUSTOM = ""


#: Mamba layer type string -> ``MambaAttentionBackendEnum`` member name.
MAMBA_TYPE_TO_BACKEND_MAP: dict[str, str] = {
    "mamba1": MambaAttentionBackendEnum.MAMBA1.name,
    "mamba2": MambaAttentionBackendEnum.MAMBA2.name,
    "short_conv": MambaAttentionBackendEnum.SHORT_CONV.name,
    "linear_attention": MambaAttentionBackendEnum.LINEAR.name,
    "gdn_attention": MambaAttentionBackendEnum.GDN_ATTN.name,
    "custom": MambaAttentionBackendEnum.CUSTOM.name,
}


def register_backend(
    backend: AttentionBackendEnum | MambaAttentionBackendEnum,
    class_path: str | None = None,
    is_mamba: bool = False,
) -> Callable[[_T], _T]:
    """Override a backend's class, or fill ``CUSTOM``.

    Args:
        backend: the member to (re)bind.
        class_path: ``"package.module.ClassName"``; when given the binding happens now
            and the return value is a no-op decorator.
        is_mamba: ``True`` for ``MambaAttentionBackendEnum`` members (must match ``backend``).

    Returns:
        A class decorator that binds the class it decorates (when ``class_path`` is None).

    Examples::

        @register_backend(AttentionBackendEnum.FLASH_ATTN)       # override an existing backend
        class MyFlashAttn(AttentionBackend): ...

        @register_backend(MambaAttentionBackendEnum.LINEAR, is_mamba=True)
        class MyLinearAttn: ...

        register_backend(AttentionBackendEnum.CUSTOM, "my.module.MyBackend")  # by path

    Undo with ``backend.clear_override()``.
    """
    if not isinstance(backend, (AttentionBackendEnum, MambaAttentionBackendEnum)):
        raise TypeError(
            "register_backend: backend must be an AttentionBackendEnum or MambaAttentionBackendEnum "
            f"member, got {backend!r} ({type(backend).__name__}); e.g. AttentionBackendEnum.CUSTOM."
        )
    member_is_mamba = isinstance(backend, MambaAttentionBackendEnum)
    if bool(is_mamba) != member_is_mamba:
        raise TypeError(
            f"register_backend: is_mamba={is_mamba} does not match {type(backend).__name__}."
            f"{backend.name}; pass is_mamba={member_is_mamba}."
        )

    if class_path is not None:
        if not isinstance(class_path, str) or "." not in class_path.strip(".") or class_path != class_path.strip():
            raise ValueError(
                f"register_backend: class_path must be a dotted path 'package.module.ClassName', "
                f"got {class_path!r}."
            )
        _OVERRIDES.set(backend, class_path, None)
        logger.debug("registered %s -> %s", backend.name, class_path)
        return lambda cls: cls

    def decorator(cls: _T) -> _T:
        if not isinstance(cls, type):
            raise TypeError(
                f"@register_backend({type(backend).__name__}.{backend.name}) must decorate a class, "
                f"got {cls!r}."
            )
        path = f"{cls.__module__}.{cls.__qualname__}"
        _OVERRIDES.set(backend, path, cls)
        logger.debug("registered %s -> %s", backend.name, path)
        return cls

    return decorator

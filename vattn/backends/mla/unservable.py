"""Named MLA backends whose kernels vattn cannot install: they exist to say why they cannot serve.

``is_available`` gives the reason the selector lists and ``python -m vattn`` prints (the kernel
library, where it comes from, why vattn cannot install it, and which backend to use instead);
it looks the library up without importing it. Constructing their impl raises the same reason.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any, ClassVar

from vattn.core.interface import AttentionImpl
from vattn.backends.mla.common import MLACommonBackend, MLACommonMetadataBuilder
from vattn.core.registry import vattn_version

__all__ = ["UnservableMLABackend"]

_INSTEAD = "use FLASHINFER_MLA or TRITON_MLA (or FLASH_ATTN_MLA with FA3 on sm_90)"


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


class UnservableMLABackend(MLACommonBackend):
    """An MLA backend this vattn names but cannot run. Subclasses set ``library`` (the import
    name looked up), ``needs`` (what the kernels are and why vattn cannot install them)."""

    builder_cls = MLACommonMetadataBuilder
    capabilities = dataclasses.replace(MLACommonBackend.capabilities, installable=False, head_sizes=(576,))
    library: ClassVar[str] = ""
    needs: ClassVar[str] = ""
    instead: ClassVar[str] = _INSTEAD

    @classmethod
    def reason(cls) -> str:
        if _installed(cls.library):
            return (f"{cls.get_name()}: {cls.library} is importable here, but {vattn_version()} does not call its "
                    f"kernels ({cls.needs}); {cls.instead}")
        return f"{cls.get_name()} needs {cls.needs}; {cls.instead}"

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        return False, cls.reason()

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        return unservable_impl(cls)


def unservable_impl(backend: type[UnservableMLABackend]) -> type[AttentionImpl]:
    """An impl class whose construction raises ``backend``'s reason (``NotImplementedError``)."""

    class _Unservable(AttentionImpl):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise NotImplementedError(backend.reason())

        def forward(self, *args: Any, **kwargs: Any) -> Any:  # never reached
            raise NotImplementedError(backend.reason())

    _Unservable.__name__ = _Unservable.__qualname__ = f"{backend.__name__.removesuffix('Backend')}Impl"
    return _Unservable

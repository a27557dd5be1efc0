"""FLASHMLA: DeepSeek's FlashMLA decode kernels, which vattn cannot install (see ``unservable``)."""

from __future__ import annotations

from typing import ClassVar

from vattn.core.interface import AttentionImpl
from vattn.backends.mla.unservable import UnservableMLABackend, unservable_impl

__all__ = ["FlashMLABackend"]


class FlashMLABackend(UnservableMLABackend):
    """FlashMLA (``flash_mla_with_kvcache``): not runnable with this vattn; ``is_available`` says why."""

    library: ClassVar[str] = "flash_mla"
    needs: ClassVar[str] = ("DeepSeek's FlashMLA kernels (the flash_mla package of github.com/deepseek-ai/FlashMLA, "
                            "sm_90 / sm_100, block size 64): it compiles its CUDA kernels from source when installed "
                            "(nvcc and a CUDA toolkit matching torch), so vattn cannot install it")
    min_compute_capability: ClassVar[tuple[int, int] | None] = (9, 0)
    feature_notes: ClassVar[dict[str, str]] = {"gpus": "flash_mla, not installable"}

    @staticmethod
    def get_name() -> str:
        return "FLASHMLA"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return unservable_impl(FlashMLABackend)

    @classmethod
    def get_supported_block_sizes(cls) -> tuple[int, ...]:
        return (64,)

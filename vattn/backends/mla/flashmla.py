"""FLASHMLA: DeepSeek's FlashMLA decode kernels, which vattn cannot install (see ``unservable``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from vattn.backends.mla.unservable import UnservableMLABackend

__all__ = ["FlashMLABackend"]


class FlashMLABackend(UnservableMLABackend):
    """FlashMLA (``flash_mla_with_kvcache``): not runnable with this vattn; ``is_available`` says why."""

    name = "FLASHMLA"
    capabilities = dataclasses.replace(UnservableMLABackend.capabilities, min_compute_capability=(9, 0),
                                       notes={"gpus": "flash_mla, not installable"})
    library: ClassVar[str] = "flash_mla"
    needs: ClassVar[str] = ("DeepSeek's FlashMLA kernels (the flash_mla package of github.com/deepseek-ai/FlashMLA, "
                            "sm_90 / sm_100, block size 64): it compiles its CUDA kernels from source when installed "
                            "(nvcc and a CUDA toolkit matching torch), so vattn cannot install it")

    @classmethod
    def get_supported_block_sizes(cls) -> tuple[int, ...]:
        return (64,)

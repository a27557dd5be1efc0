"""FLASHMLA_SPARSE: FlashMLA's sparse (DeepSeek-V3.2) kernels, which vattn cannot install (see ``unservable``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from vattn.backends.mla.unservable import UnservableMLABackend

__all__ = ["FlashMLASparseBackend"]


class FlashMLASparseBackend(UnservableMLABackend):
    """FlashMLA's sparse MLA (``flash_mla_sparse_fwd`` over an indexer's top-k tokens): not runnable
    with this vattn; ``is_available`` says why."""

    name = "FLASHMLA_SPARSE"
    capabilities = dataclasses.replace(UnservableMLABackend.capabilities, sparse=True, min_compute_capability=(9, 0),
                                       notes={"gpus": "flash_mla, not installable"})
    library: ClassVar[str] = "flash_mla"
    needs: ClassVar[str] = ("FlashMLA's sparse kernels (flash_mla_sparse_fwd and the sparse decode of the flash_mla "
                            "package, github.com/deepseek-ai/FlashMLA, sm_90 / sm_100) and the top-k indexer of "
                            "DeepSeek-V3.2 sparse attention: flash_mla compiles its CUDA kernels from source when "
                            "installed, so vattn cannot install it, and vattn.MLAAttention "
                            "runs no indexer")
    instead: ClassVar[str] = "run the model's dense MLA (use_sparse=False) on FLASHINFER_MLA or TRITON_MLA"

    @classmethod
    def get_supported_block_sizes(cls) -> tuple[int, ...]:
        return (64,)

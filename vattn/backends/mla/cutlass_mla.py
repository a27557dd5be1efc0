"""CUTLASS_MLA: vLLM's CUTLASS MLA decode for Blackwell, which vattn cannot install (see ``unservable``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from vattn.backends.mla.unservable import UnservableMLABackend

__all__ = ["CutlassMLABackend"]


class CutlassMLABackend(UnservableMLABackend):
    """CUTLASS MLA (``sm100_cutlass_mla_decode``): not runnable with this vattn; ``is_available`` says why."""

    name = "CUTLASS_MLA"
    capabilities = dataclasses.replace(UnservableMLABackend.capabilities, min_compute_capability=(10, 0),
                                       notes={"gpus": "vllm._C, not installable"})
    library: ClassVar[str] = "vllm"
    needs: ClassVar[str] = ("vLLM's CUTLASS MLA decode kernel (sm100_cutlass_mla_decode, compiled into vLLM's "
                            "own CUDA extension vllm._C; Blackwell sm_100 only, 128 query heads): it ships only "
                            "inside a vLLM build, which vattn cannot install as a kernel library")

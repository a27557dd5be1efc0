"""NO_ATTENTION: the selector's placeholder for attention-free models (the seeds' semantics).

A model made only of mixer layers (Falcon-Mamba, Mamba2) has no attention to run and no paged
K/V to store: ``get_attn_backend(..., is_attention_free=True)`` returns this backend, whose
cache holds nothing and whose impl refuses to run. The mixer layers' state slots come from
``vattn.allocate_kv_cache(cfg, num_blocks=1, num_state_slots=...)`` as for any hybrid.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from vattn.core.enums import AttentionCGSupport
from vattn.core.capabilities import Capabilities
from vattn.core.interface import AttentionBackend, AttentionImpl, AttentionMetadataBuilder
from vattn.core.metadata import AttentionMetadata, CommonAttentionMetadata

__all__ = ["NoAttentionBackend"]

_WHY = ("NO_ATTENTION is the placeholder of attention-free models (get_attn_backend(..., is_attention_free=True)); "
        "it runs no attention")


class NoAttentionImpl(AttentionImpl):
    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
                kv_cache: torch.Tensor, attn_metadata: Any, output: torch.Tensor | None = None,
                **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError(f"{_WHY}; build attention layers with another backend (attn_backend=None selects).")


class NoAttentionMetadataBuilder(AttentionMetadataBuilder[AttentionMetadata]):
    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.ALWAYS

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> AttentionMetadata:
        return AttentionMetadata()


class NoAttentionBackend(AttentionBackend):
    """No KV cache, no kernel: what the selector answers for a model without attention layers."""

    name = "NO_ATTENTION"
    impl_cls = NoAttentionImpl
    metadata_cls = AttentionMetadata
    builder_cls = NoAttentionMetadataBuilder
    capabilities = Capabilities(
        dtypes=(torch.float16, torch.bfloat16, torch.float32), runs_on_cpu=True,
        installable=False,  # never a suggestion for an attention layer
    )

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        return (0,)

    @classmethod
    def validate_configuration(cls, *args: Any, **kwargs: Any) -> list[str]:
        return [_WHY + " (an attention layer needs another backend)"]

"""``FlashAttentionBackend``: what FLASH_ATTN serves (by the installed interface), its KV-cache shape."""

from __future__ import annotations


import torch

from vattn.core.enums import AttentionCGSupport, AttentionType
from vattn.core.capabilities import Capabilities
from vattn.core.interface import AttentionBackend
from vattn.backends.flash_attn import interface as fa_interface
from vattn.backends.flash_attn.impl import SUPPORTED_ATTN_TYPES, FlashAttentionImpl
from vattn.backends.flash_attn.metadata import FlashAttentionMetadata, FlashAttentionMetadataBuilder

__all__ = ["FlashAttentionBackend"]


class FlashAttentionBackend(AttentionBackend):
    """FlashAttention (flash-attn-4, FA3 or FA2, whichever is installed) over a paged KV cache."""

    name = "FLASH_ATTN"
    impl_cls = FlashAttentionImpl
    metadata_cls = FlashAttentionMetadata
    builder_cls = FlashAttentionMetadataBuilder
    capabilities = Capabilities(
        accept_output_buffer=True, sink=True, sliding_window=True, logits_soft_cap=True, alibi=True,
        attn_types=SUPPORTED_ATTN_TYPES, min_compute_capability=(8, 0),
        quant_query_input=True,  # fp8 KV caches attend with fp8 queries
        kv_cache_dtypes=(
            "auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2",
        ),
        notes={
            "alibi": "FA2",
            "sinks": "flash-attn-4",
            "fp8_kv": "FA3 on SM90, flash-attn-4 on SM100; bf16 models",
            "min_compute_capability": "FA3: 9.0, flash-attn-4: 9.0/10.x",
            "block_sizes": "FA2: multiples of 256",
            "head_sizes": "flash-attn-4 on SM100: <= 128 or 256",
            "cuda_graphs": "FA2: uniform batches",
        },
    )

    @classmethod
    def get_supported_head_sizes(cls) -> tuple[int, ...]:
        """Multiples of 8 up to 256, over all interfaces (``interface_reasons`` narrows it per GPU)."""
        return tuple(range(8, 257, 8))

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        iface, why = fa_interface.get_flash_attn_interface()
        return iface is not None, why

    @classmethod
    def validate_configuration(cls, head_size: int, dtype: torch.dtype, kv_cache_dtype: str | None, block_size: int,
                               use_mla: bool = False, has_sink: bool = False, use_sparse: bool = False) -> list[str]:
        """Every reason the installed interface cannot serve the configuration (``interface_reasons``)."""
        iface, why = fa_interface.get_flash_attn_interface()
        if iface is None:
            return [why]
        major, minor = torch.cuda.get_device_capability()
        reasons = fa_interface.interface_reasons(iface.name, major * 10 + minor, head_size, dtype,
                                                 kv_cache_dtype or "auto", block_size, has_sink)
        if use_mla:
            reasons.append("MLA not supported (use an MLA backend)")
        if use_sparse:
            reasons.append("sparse attention not supported")
        return reasons

    @classmethod
    def feature_reasons(cls, attn_type: str = AttentionType.DECODER, **features: bool) -> list[str]:
        """The declarations' reasons, and ALiBi where the installed interface is not FA2 (the
        declaration covers every interface; the impl would refuse the layer)."""
        reasons = super().feature_reasons(attn_type, **features)
        iface, _ = fa_interface.get_flash_attn_interface()
        if features.get("use_alibi") and iface is not None and iface.name != "fa2":
            reasons.append(f"ALiBi needs FA2, the installed interface is {iface.name}")
        return reasons

    @classmethod
    def get_cudagraph_support(cls) -> AttentionCGSupport:
        iface, _ = fa_interface.get_flash_attn_interface()
        return fa_interface.cg_support(iface)

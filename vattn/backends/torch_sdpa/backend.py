"""``TorchSDPABackend``: the reference backend's static facts (see the package docstring)."""

from __future__ import annotations


import torch

from vattn.core.enums import AttentionType
from vattn.core.capabilities import Capabilities
from vattn.core.interface import AttentionBackend
from vattn.backends.torch_sdpa.impl import TorchSDPAImpl
from vattn.backends.torch_sdpa.metadata import TorchSDPAMetadata, TorchSDPAMetadataBuilder
from vattn.core.config import CACHE_DTYPES

__all__ = ["TorchSDPABackend"]


class TorchSDPABackend(AttentionBackend):
    """Reference backend: any head size, fp16/bf16/fp32, every KV-cache dtype and feature, CPU and CUDA."""

    name = "TORCH_SDPA"
    impl_cls = TorchSDPAImpl
    metadata_cls = TorchSDPAMetadata
    builder_cls = TorchSDPAMetadataBuilder
    capabilities = Capabilities(
        accept_output_buffer=True, dtypes=(torch.float16, torch.bfloat16, torch.float32),
        kv_cache_dtypes=CACHE_DTYPES, sink=True, sliding_window=True, logits_soft_cap=True, alibi=True,
        attn_types=AttentionType.ALL, runs_on_cpu=True,
        notes={
            "sliding_window": "not on cross-attention",
            "alibi": "not on cross-attention",
            "fp8_kv": "e4m3 on CUDA: 8.9+",
        },
    )

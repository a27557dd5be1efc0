"""``Capabilities``: what an attention backend serves, declared once as one frozen value.

A backend sets ``capabilities = Capabilities(...)``; the selector, ``vattn.Attention`` and the op
read it (``AttentionBackend.validate_configuration`` and ``feature_reasons`` turn it into reasons).
The seeds' class attributes (``accept_output_buffer``, ``supported_dtypes``, ``supports_sink``,
...) are kept on every backend class as read-only mirrors of it (``LEGACY_NAMES``); a backend
written against those names still declares through them (``AttentionBackend.__init_subclass__``
folds them into its ``capabilities``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch

from vattn.core.enums import AttentionType

__all__ = ["LEGACY_NAMES", "Capabilities"]


@dataclass(frozen=True)
class Capabilities:
    """What a backend serves. Defaults: a CUDA decoder backend of fp16 / bf16, any head and
    block size, none of the optional features."""

    dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
    """Query / output dtypes."""
    kv_cache_dtypes: tuple[str, ...] = ("auto", "bfloat16", "float16")
    """``CacheConfig.cache_dtype`` strings."""
    head_sizes: tuple[int, ...] | None = None
    """Head sizes the kernels take (None: any)."""
    block_sizes: tuple[int, ...] | None = None
    """Tokens per cache block the kernels take (None: any)."""
    attn_types: tuple[str, ...] = (AttentionType.DECODER,)
    accept_output_buffer: bool = False
    """The op allocates the output and the impl writes into it (required for piecewise graphs)."""
    stores_kv: bool = True
    """The impl writes the step's K/V into the cache itself (e.g. fused with its kernels; vLLM's
    ``forward_includes_kv_cache_update``). False: the op writes them into the impl's
    ``split_kv_cache`` views (``vattn.ops.attention.store_layer_kv``) before calling the impl."""
    quant_query_input: bool = False
    """Takes fp8 queries with an fp8 cache (the layer quantizes q)."""
    output_quant: bool = False
    """Writes fp8 output given ``output_scale``."""
    sink: bool = False
    """Per-head attention sinks (``Attention(sinks=...)``)."""
    mla: bool = False
    """Serves MLA layers (``vattn.MLAAttention``), and only those."""
    sparse: bool = False
    """Serves sparse MLA (an indexer's top-k tokens)."""
    sliding_window: bool = False
    logits_soft_cap: bool = False
    alibi: bool = False
    """Layer features: a sliding window, a logits soft cap, ALiBi slopes."""
    mask_mod: bool = False
    """Takes a layer's FlexAttention ``mask_mod``."""
    score_mod: bool = False
    """Takes a layer's FlexAttention ``score_mod``."""
    tree_parents: bool = False
    """Honours ``CommonAttentionMetadata.tree_parents``."""
    runs_on_cpu: bool = False
    """Serves CPU tensors (else CUDA only)."""
    min_compute_capability: tuple[int, int] | None = None
    """The oldest CUDA GPU generation it runs on, e.g. ``(8, 0)``; None: any."""
    installable: bool = True
    """False: vattn names it but cannot install its kernels (it only says why it cannot serve)."""
    notes: Mapping[str, str] = field(default_factory=dict)
    """Qualifiers of the declarations above, by feature name (``{"sinks": "flash-attn-4 only"}``)."""


LEGACY_NAMES: dict[str, str] = {
    "accept_output_buffer": "accept_output_buffer",
    "supports_quant_query_input": "quant_query_input",
    "supports_output_quant": "output_quant",
    "supported_dtypes": "dtypes",
    "supported_kv_cache_dtypes": "kv_cache_dtypes",
    "supports_sink": "sink",
    "supports_mla": "mla",
    "supports_sparse": "sparse",
    "supports_sliding_window": "sliding_window",
    "supports_logits_soft_cap": "logits_soft_cap",
    "supports_alibi": "alibi",
    "supports_mask_mod": "mask_mod",
    "supports_score_mod": "score_mod",
    "supports_tree_parents": "tree_parents",
    "supported_attn_types": "attn_types",
    "runs_on_cpu": "runs_on_cpu",
    "min_compute_capability": "min_compute_capability",
    "installable": "installable",
    "feature_notes": "notes",
}
"""The seeds' class attribute of each ``Capabilities`` field (attribute name -> field)."""

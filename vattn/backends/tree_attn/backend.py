"""``TreeAttentionBackend``: TREE_ATTN, tree-shaped speculative decoding.

Layers without a mask_mod or score_mod run TRITON_ATTN's kernel with its tree mask (the
faster: ``benchmarks/bench_flex.py``'s tree step); layers with them run FLEX_ATTENTION with
each step's draft trees as the base mask, narrowed by the user's mods.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from torch import Tensor

from vattn.backends.flex_attention.backend import FlexAttentionBackend
from vattn.backends.flex_attention.impl import FlexAttentionImpl
from vattn.backends.flex_attention.paging import TREE
from vattn.backends.tree_attn.metadata import TreeAttentionMetadata, TreeAttentionMetadataBuilder

if TYPE_CHECKING:
    from vattn.core.interface import AttentionLayerBase as Attention

__all__ = ["TreeAttentionBackend", "TreeAttentionImpl"]

logger = logging.getLogger("vattn.backends.tree_attn")
#: ``FlexAttentionImpl``'s keyword-only arguments, which TRITON_ATTN's impl does not take.
_FLEX_ONLY = frozenset({"mask_mod", "score_mod", "mask_per_head", "kernel_options", "compiled"})


class TreeAttentionImpl(FlexAttentionImpl):
    """Every new token sees the cached context, itself and its ancestors.

    ``triton_impl``: the ``TritonAttentionImpl`` that serves this layer when the step's metadata
    carries TRITON_ATTN's half (``TreeAttentionMetadata.triton``); None for a layer with a
    mask_mod or score_mod, which FlexAttention serves (window, soft cap, ALiBi and sinks both)."""

    base_mask = TREE
    backend_name = "TREE_ATTN"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """``FlexAttentionImpl``'s arguments; the shared ones (all but its keyword-only mods and
        kernel options) also build ``triton_impl`` for a layer without mods."""
        super().__init__(*args, **kwargs)
        self.triton_impl: Any = None
        if self.mask_spec.mask_mod is None and self.score_mod is None:
            from vattn.backends.triton.impl import TritonAttentionImpl

            shared = {k: v for k, v in kwargs.items() if k not in _FLEX_ONLY}
            try:
                self.triton_impl = TritonAttentionImpl(*args, **shared)
            except (ValueError, NotImplementedError) as e:  # FlexAttention serves what Triton's kernel cannot
                logger.debug("TREE_ATTN: FlexAttention only for this layer (%s)", e)

    def forward(self, layer: "Attention", query: Tensor, key: Tensor | None, value: Tensor | None,
                kv_cache: Tensor, attn_metadata: TreeAttentionMetadata | None, output: Tensor | None = None,
                output_scale: Tensor | None = None) -> Tensor:
        """TRITON_ATTN's kernel where this layer and the metadata allow it, else FlexAttention."""
        md = attn_metadata
        if md is not None and self.triton_impl is not None and getattr(md, "triton", None) is not None:
            return self.triton_impl.forward(layer, query, key, value, kv_cache, md.triton, output, output_scale)
        if md is not None and getattr(md, "flex_skipped", False):
            raise ValueError("TREE_ATTN: this step's metadata has no FlexAttention launches (its builder saw only "
                             "layers TRITON_ATTN serves); build it with this layer registered "
                             "(vattn.Attention(..., prefix=...)) or set the builder's use_triton=False.")
        return super().forward(layer, query, key, value, kv_cache, md, output, output_scale)


class TreeAttentionBackend(FlexAttentionBackend):
    """Tree-shaped speculative decoding: draft tokens attend to the context and their ancestors."""

    name = "TREE_ATTN"
    impl_cls = TreeAttentionImpl
    builder_cls = TreeAttentionMetadataBuilder
    capabilities = dataclasses.replace(FlexAttentionBackend.capabilities, tree_parents=True, notes={
        **FlexAttentionBackend.feature_notes,
        "runs_on_cpu": "slow (a reference path); TORCH_SDPA is far faster for chains of draft tokens",
    })

"""TREE_ATTN's metadata and builder: TRITON_ATTN's metadata of the step (its kernel's tree mask)
for the layers it serves, FLEX_ATTENTION's launches with each launch's ancestor matrix from the
step's ``CommonAttentionMetadata.tree_parents`` for the others."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from vattn.core.metadata import CommonAttentionMetadata
from vattn.backends.draft_tree import ancestors, checked_parents, request_parents
from vattn.backends.flex_attention.metadata import FlexAttentionMetadata, FlexAttentionMetadataBuilder
from vattn.backends.flex_attention.paging import FlexCall

__all__ = ["TreeAttentionMetadata", "TreeAttentionMetadataBuilder", "ancestors"]


@dataclass
class TreeAttentionMetadata(FlexAttentionMetadata):
    """``FlexAttentionMetadata`` plus ``triton``: TRITON_ATTN's metadata of the step, or None
    where the builder does not run Triton (``TreeAttentionMetadataBuilder.use_triton``).
    ``flex_skipped``: no layer of the group needs FlexAttention, so ``calls`` is empty."""

    triton: Any = None
    flex_skipped: bool = False


class TreeAttentionMetadataBuilder(FlexAttentionMetadataBuilder):
    """Builds both halves of ``TreeAttentionMetadata``.

    ``use_triton`` (default: on CUDA): build TRITON_ATTN's metadata too, for the layers whose
    impl runs TRITON_ATTN's kernel (no mask_mod / score_mod). FlexAttention's launches and
    block masks are built unless every layer of the group is such a layer; a group whose
    layers are not registered (an impl driven directly) gets both.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.use_triton = self.device.type == "cuda"
        self._triton_builder: Any = None
        self._all_triton: bool | None = None

    def _triton(self) -> Any:
        if self._triton_builder is None:
            from vattn.backends.triton.metadata import TritonAttentionMetadataBuilder

            self._triton_builder = TritonAttentionMetadataBuilder(self.kv_cache_spec, self.layer_names,
                                                                  self.vattn_config, self.device)
        return self._triton_builder

    def _flex_needed(self) -> bool:
        """Some layer of the group runs FlexAttention (or none is registered yet); found once
        the layers are registered."""
        if self._all_triton is None:
            layers = self._layers()
            if not layers:
                return True
            self._all_triton = all(getattr(layer.impl, "triton_impl", None) is not None for layer in layers)
        return not (self.use_triton and self._all_triton)

    def _assemble(self, cm: CommonAttentionMetadata, triton: Any,
                  flex: FlexAttentionMetadata | None) -> TreeAttentionMetadata:
        skipped = flex is None
        if flex is None:
            # Triton's slot_mapping: the same slots, in its persistent buffer when building for a
            # CUDA graph (the step's own tensor would differ from the one a graph captured).
            slots = cm.slot_mapping if triton is None else triton.slot_mapping
            flex = FlexAttentionMetadata(
                num_actual_tokens=cm.num_actual_tokens, num_reqs=cm.num_reqs, slot_mapping=slots,
                causal=cm.causal, block_size=self.kv_cache_spec.block_size, num_cache_blocks=0, kv_width=1, calls=[])
        return TreeAttentionMetadata(**{f.name: getattr(flex, f.name) for f in dataclasses.fields(flex)},
                                     triton=triton, flex_skipped=skipped)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> TreeAttentionMetadata:
        cm = common_attn_metadata
        triton = self._triton().build(common_prefix_len, cm, fast_build) if self.use_triton else None
        flex = super().build(common_prefix_len, cm, fast_build) if self._flex_needed() else None
        return self._assemble(cm, triton, flex)

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> TreeAttentionMetadata:
        cm = common_attn_metadata
        triton = self._triton().build_for_cudagraph_capture(cm) if self.use_triton else None
        flex = None
        if self._flex_needed():
            self.use_persistent_buffers = True
            flex = FlexAttentionMetadataBuilder.build(self, 0, cm)
            self._captured = True
        return self._assemble(cm, triton, flex)

    def _attach(self, call: FlexCall, common: CommonAttentionMetadata) -> None:
        if common.tree_parents is None or call.query_index is None:  # no trees, or one token per request
            return
        rows = torch.arange(call.query_len, device=call.qlen.device)
        real = rows[None, :] < call.qlen[:, None]
        call.tree = ancestors(request_parents(checked_parents(common), call.query_index, real))

"""TREE_ATTN's builder: FLEX_ATTENTION's, plus each launch's ancestor matrix from the step's
``CommonAttentionMetadata.tree_parents``."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from vattn.backends.abstract import CommonAttentionMetadata
from vattn.backends.batch_checks import fail
from vattn.backends.flex_attention.metadata import FlexAttentionMetadataBuilder
from vattn.backends.flex_attention.paging import FlexCall

__all__ = ["TreeAttentionMetadataBuilder", "ancestors"]


def ancestors(parents: Tensor) -> Tensor:
    """(Bq, Lq, Lq) bool: ``[b, i, k]`` is True when query k is query i or one of its ancestors.

    ``parents``: (Bq, Lq) int, each query's parent row (-1: none, i.e. the cached context).
    Parents come before their children, so paths are shorter than Lq and ``ceil(log2(Lq))``
    squarings of the parent relation (with the identity) close it."""
    bq, lq = parents.shape
    rows = torch.arange(lq, device=parents.device)
    edges = (parents[:, :, None] == rows[None, None, :]) | (rows[:, None] == rows[None, :])
    reach = edges.to(torch.float32)
    for _ in range(math.ceil(math.log2(lq)) if lq > 1 else 0):
        reach = ((reach @ reach) > 0).to(torch.float32)
    return reach > 0


class TreeAttentionMetadataBuilder(FlexAttentionMetadataBuilder):
    """``FlexAttentionMetadataBuilder`` that gives each multi-token launch its draft trees."""

    def _attach(self, call: FlexCall, common: CommonAttentionMetadata) -> None:
        parents = common.tree_parents
        if parents is None or call.query_index is None:  # no trees, or one token per request
            return
        n = common.num_actual_tokens
        if parents.dim() != 1 or parents.shape[0] < n or parents.is_floating_point():
            fail("CommonAttentionMetadata.tree_parents", f"a 1-D int tensor of at least num_actual_tokens = {n} "
                 "entries", f"{parents.dtype} of shape {tuple(parents.shape)}",
                 "pass one parent index per new token (vattn.build_common_attn_metadata(..., tree_parents=...)).")
        if parents.device != call.qlen.device:
            fail("CommonAttentionMetadata.tree_parents", f"a tensor on {call.qlen.device}", f"one on {parents.device}",
                 "put it on the metadata's device.")
        rows = torch.arange(call.query_len, device=parents.device)
        real = rows[None, :] < call.qlen[:, None]
        parent = torch.where(real, parents.long()[call.query_index], -1)
        # An out-of-range parent (only possible for hand-built device tensors) is no parent.
        parent = torch.where((parent >= 0) & (parent < rows[None, :]), parent, -1)
        call.tree = ancestors(parent)

"""Draft trees of speculative decoding: which of its request's new tokens each token attends to.

``CommonAttentionMetadata.tree_parents`` gives each new token its parent's index among its
request's new tokens (-1: it continues the cached context). A token attends to the whole
cached context, to itself and to its ancestors (vLLM's TreeAttention). TREE_ATTN's
FlexAttention masks read ``ancestors`` per launch; TRITON_ATTN's kernel reads one row of
``token_tree_rows`` per query token.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from vattn.core.metadata import CommonAttentionMetadata
from vattn.core.batch_checks import fail

__all__ = ["ancestors", "checked_parents", "request_parents", "token_tree_rows"]


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


def checked_parents(common: CommonAttentionMetadata) -> Tensor:
    """``common.tree_parents`` (not None), checked for what the builders read: a 1-D int tensor
    of at least ``num_actual_tokens`` entries on the metadata's device."""
    parents, n = common.tree_parents, common.num_actual_tokens
    assert parents is not None
    if parents.dim() != 1 or parents.shape[0] < n or parents.is_floating_point():
        fail("CommonAttentionMetadata.tree_parents", f"a 1-D int tensor of at least num_actual_tokens = {n} entries",
             f"{parents.dtype} of shape {tuple(parents.shape)}",
             "pass one parent index per new token (vattn.build_common_attn_metadata(..., tree_parents=...)).")
    device = common.query_start_loc.device
    if parents.device != device:
        fail("CommonAttentionMetadata.tree_parents", f"a tensor on {device}", f"one on {parents.device}",
             "put it on the metadata's device.")
    return parents


def request_parents(parents: Tensor, index: Tensor, real: Tensor) -> Tensor:
    """(B, W) int64: the parent row of each request's new token ``i`` (-1: none), from the flat
    ``parents`` at ``index`` (B, W) where ``real`` (B, W); a parent that is not an earlier token
    of the request (possible only in hand-built device tensors) counts as none."""
    i = torch.arange(index.shape[1], device=index.device)
    parent = torch.where(real, parents.long()[index], -1)
    return torch.where((parent >= 0) & (parent < i[None, :]), parent, -1)


def token_tree_rows(parents: Tensor, query_start_loc: Tensor, query_start_loc_cpu: Tensor, num_reqs: int,
                    num_tokens: int, num_actual_tokens: int) -> Tensor:
    """(num_tokens, W) uint8, ``W`` the longest query: row ``t`` marks the new tokens of t's
    request that token t attends to (itself and its ancestors); padding rows are zero.

    ``parents``: (>= num_actual_tokens,) int, ``CommonAttentionMetadata.tree_parents``
    (``request_parents`` reads them). Device work only: the host copy of ``query_start_loc``
    gives the shapes."""
    b = num_reqs
    qlen_cpu = query_start_loc_cpu[1 : b + 1] - query_start_loc_cpu[:b]
    w = max(1, int(qlen_cpu.max())) if b else 1
    dev = parents.device
    qsl = query_start_loc[: b + 1].to(device=dev, dtype=torch.long)
    i = torch.arange(w, device=dev)
    lens = qsl[1:] - qsl[:-1]
    real = i[None, :] < lens[:, None]
    index = torch.where(real, qsl[:-1, None] + i[None, :], 0).clamp(max=max(num_actual_tokens - 1, 0))
    reach = ancestors(request_parents(parents, index, real))  # (B, W, W)
    tok = torch.arange(num_tokens, device=dev)
    r = torch.searchsorted(qsl[1:], tok, right=True).clamp(max=max(b - 1, 0))
    j = (tok - qsl[r]).clamp(0, w - 1)
    rows = reach[r, j] & (tok < num_actual_tokens)[:, None]
    return rows.to(torch.uint8)

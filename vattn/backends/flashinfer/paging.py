"""FLASHINFER's host-side paging: the CSR page layout FlashInfer plans with, the page-index
gather from vattn's block tables, the float workspace its wrappers share per device, and the
fence that keeps a wrapper's plans in step with the GPU.

Nothing here imports ``flashinfer``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["WORKSPACE_BYTES", "fenced_plan", "gather_page_indices", "paged_kv_layout", "workspace"]

#: Float workspace shared by every wrapper on a device (split-KV partial results).
WORKSPACE_BYTES = 256 * 1024 * 1024
_workspaces: dict[torch.device, torch.Tensor] = {}


def workspace(device: torch.device) -> torch.Tensor:
    """The float workspace of ``device``: ``WORKSPACE_BYTES`` uint8, zero-initialised (as
    FlashInfer requires), allocated once per device."""
    buf = _workspaces.get(device)
    if buf is None:
        buf = _workspaces[device] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return buf


def fenced_plan(wrapper: Any, plan: Callable[[], Any]) -> None:
    """Run ``plan`` (one FlashInfer ``wrapper.plan(...)``) once the GPU has read the wrapper's last plan.

    A plan writes its schedule into the wrapper's pinned host buffer and enqueues an asynchronous
    copy of it to the device. With the host a step ahead of the GPU (an engine that prepares step
    n + 1 while step n runs), planning the wrapper again before that copy ran hands step n the new
    schedule: wrong outputs, or reads past its buffers. An event recorded after each plan is
    waited on before the wrapper's next one; by then it has almost always completed. While a CUDA
    graph is being captured nothing is recorded or waited on.
    """
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    read: torch.cuda.Event | None = getattr(wrapper, "_vattn_plan_read", None)
    if read is not None and not capturing:
        read.synchronize()
    plan()
    if not capturing and torch.cuda.is_available():
        if read is None:
            read = torch.cuda.Event()
            wrapper._vattn_plan_read = read
        read.record()


def paged_kv_layout(seq_lens_cpu: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's CSR page layout of requests with ``seq_lens_cpu`` tokens (host tensors).

    Returns ``(indptr (B+1,), last_page_len (B,))`` int32: request ``r`` owns pages
    ``indptr[r]:indptr[r+1]`` (``ceil(seq_len / page_size)`` of them) and its last page holds
    ``last_page_len[r]`` tokens (1..page_size; 0 for an empty request).
    """
    seq = seq_lens_cpu.to(torch.int32)
    pages = (seq + page_size - 1) // page_size
    indptr = torch.zeros(seq.numel() + 1, dtype=torch.int32)
    torch.cumsum(pages, 0, out=indptr[1:])
    last = torch.where(pages > 0, seq - (pages - 1) * page_size, 0).to(torch.int32)
    return indptr, last


def gather_page_indices(block_table: torch.Tensor, indptr_cpu: torch.Tensor, out: torch.Tensor | None = None,
                        num_blocks: int | None = None) -> torch.Tensor:
    """``out[indptr[r]:indptr[r+1]] = block_table[r, :indptr[r+1] - indptr[r]]`` without a host sync.

    Args:
        block_table: (>= B, W) int32 on the device.
        indptr_cpu: (B+1,) int32 host tensor starting at 0.
        out: optional (indptr[-1],) int32 destination (e.g. a persistent CUDA-graph buffer).
        num_blocks: clamp the ids into ``[0, num_blocks)`` (a table never checked on the host:
            ``AttentionMetadataBuilder.unchecked_block_limit``), so FlashInfer never reads outside the cache.
    """
    num_reqs = indptr_cpu.numel() - 1
    total = int(indptr_cpu[-1])
    dev = block_table.device
    if out is None:
        out = torch.empty(total, dtype=torch.int32, device=dev)
    if total == 0:
        return out
    bt = block_table[:num_reqs].contiguous()
    pages = (indptr_cpu[1:] - indptr_cpu[:-1]).to(dev, non_blocking=True)
    starts = indptr_cpu[:-1].to(dev, non_blocking=True)
    req = torch.repeat_interleave(torch.arange(num_reqs, device=dev), pages, output_size=total)
    flat = req * bt.shape[1] + (torch.arange(total, device=dev) - starts[req])
    torch.index_select(bt.view(-1), 0, flat, out=out)
    if num_blocks is not None:
        out.clamp_(0, num_blocks - 1)
    return out

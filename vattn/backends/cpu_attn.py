"""CPU_ATTN: paged attention on the CPU that reads decode K/V from the paged cache in place.

TORCH_SDPA (which CPU_ATTN extends) gathers a decode batch's blocks into a contiguous copy
before SDPA. On the CPU a request's blocks mostly lie in runs of consecutive ids (allocators hand
them out in order); each run of an NHD cache is one strided view of the cache, (1, Hk, tokens, D),
so CPU_ATTN runs PyTorch's CPU flash-attention kernel on every run's view, no copy, and merges the
runs by their log-sum-exp:

    out = sum_r softmax_r(lse_r) * out_r        (per query head; r over the request's runs)

The runs are found by the builder, on the host, once per step (``CPUAttentionMetadata.decode_runs``:
per request ``(first block, tokens)`` pairs). A batch falls back to TORCH_SDPA's gather where
reading in place does not pay or does not apply: a request with more runs than a quarter of its
blocks (a fragmented table: one kernel call per run costs more than the copy), an HND or fp8
cache, a sliding window, ALiBi, a soft cap or sinks, and prefills (TORCH_SDPA's padded path).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from vattn.backends.torch_sdpa import TorchSDPABackend, TorchSDPAImpl, TorchSDPAMetadata, TorchSDPAMetadataBuilder
from vattn.core.metadata import CommonAttentionMetadata

__all__ = ["CPUAttentionBackend", "CPUAttentionImpl", "CPUAttentionMetadata", "CPUAttentionMetadataBuilder"]

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def decode_runs(blocks: np.ndarray, seq_lens: np.ndarray, block_size: int) -> list[list[tuple[int, int]]] | None:
    """Per request, ``(first block, tokens)`` of each run of consecutive block ids among its first
    ``ceil(seq_len / block_size)`` blocks (``blocks`` (B, nb), ``seq_lens`` (B,)); None when some
    request has more runs than a quarter of its blocks (the gather is then cheaper than a kernel
    call per run). Vectorized over the batch; a Python loop over requests only."""
    n = -(-seq_lens.astype(np.int64) // block_size)  # (B,) blocks in use
    used = np.arange(blocks.shape[1])[None, :] < n[:, None]
    starts = np.ones(blocks.shape, dtype=bool)  # a run starts where the id does not follow its left neighbour
    starts[:, 1:] = blocks[:, 1:] != blocks[:, :-1] + 1
    starts &= used
    if (starts.sum(1) > np.maximum(1, n // 4)).any():
        return None
    rows, cols = np.nonzero(starts)  # every run, request-major
    last = np.append(rows[1:] != rows[:-1], True)  # the request's last run ends at its last token
    end = np.where(last, seq_lens[rows], np.append(cols[1:], 0) * block_size)
    firsts, tokens = blocks[rows, cols].tolist(), (end - cols * block_size).tolist()
    bounds = np.append(0, np.cumsum(starts.sum(1))).tolist()
    return [list(zip(firsts[a:b], tokens[a:b])) for a, b in zip(bounds[:-1], bounds[1:])]


@dataclass
class CPUAttentionMetadata(TorchSDPAMetadata):
    """TORCH_SDPA's metadata, plus ``decode_runs``: for a CPU decode-only batch read in place, per
    request its ``(first block, tokens)`` runs (None: TORCH_SDPA's gather serves the batch)."""

    decode_runs: list[list[tuple[int, int]]] | None = None


class CPUAttentionMetadataBuilder(TorchSDPAMetadataBuilder):
    metadata_cls = CPUAttentionMetadata

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> CPUAttentionMetadata:
        md = super().build(common_prefix_len, common_attn_metadata, fast_build)
        assert isinstance(md, CPUAttentionMetadata)
        if md.decode_first_block is not None:  # one request on consecutive blocks: one run, found already
            md.decode_runs = [[(md.decode_first_block, int(common_attn_metadata.seq_lens_cpu[0]))]]
        elif md.decode_blocks is not None and md.decode_blocks.device.type == "cpu":
            md.decode_runs = decode_runs(md.decode_blocks.numpy(), common_attn_metadata.seq_lens_cpu[: md.num_reqs].numpy(),
                                         self.kv_cache_spec.block_size)
        return md


class CPUAttentionImpl(TorchSDPAImpl):
    """TORCH_SDPA's impl; decode-only CPU batches read the cache in place (``decode_runs``)."""

    backend_name = "CPU_ATTN"

    def _decode(self, query: torch.Tensor, kv_cache: torch.Tensor, md: TorchSDPAMetadata, layer: Any,
                output: torch.Tensor) -> torch.Tensor:
        runs = getattr(md, "decode_runs", None)
        s_kv, s_block, s_tok, s_head, s_dim = kv_cache.stride()
        if (runs is None or not self._plain_decode or self.window is not None or kv_cache.element_size() == 1
                or s_block != kv_cache.shape[2] * s_tok or kv_cache.device.type != "cpu"):
            return super()._decode(query, kv_cache, md, layer, output)
        hk, g, d = self.num_kv_heads, self.num_queries_per_kv, self.head_size
        q_all = query.to(kv_cache.dtype)
        base = kv_cache.storage_offset()

        def view(first: int, tokens: int) -> torch.Tensor:  # (2, 1, Hk, tokens, D): a run's K and V
            return kv_cache.as_strided((2, 1, hk, tokens, d), (s_kv, 0, s_head, s_tok, s_dim), base + first * s_block)

        for b, request in enumerate(runs):
            q = q_all[b].view(1, hk, g, d)  # the G query heads of a KV head as G query rows
            if len(request) == 1:
                kv = view(*request[0])
                out = F.scaled_dot_product_attention(q, kv[0], kv[1], scale=self.scale)  # (1, Hk, G, D)
            else:  # per run (out, log-sum-exp); each run weighs by its share of the total exp-sum
                parts = [_FLASH(q, kv[0], kv[1], scale=self.scale)[:2] for kv in (view(*r) for r in request)]
                w = torch.softmax(torch.stack([lse for _, lse in parts]), dim=0)  # (R, 1, Hk, G)
                out = (torch.stack([o for o, _ in parts]).float() * w[..., None]).sum(0)
            output[b] = out.view(self.num_heads, d).to(output.dtype)
        return output


class CPUAttentionBackend(TorchSDPABackend):
    """TORCH_SDPA's features on the CPU, decodes read from the paged cache in place."""

    name = "CPU_ATTN"
    impl_cls = CPUAttentionImpl
    metadata_cls = CPUAttentionMetadata
    builder_cls = CPUAttentionMetadataBuilder
    capabilities = dataclasses.replace(TorchSDPABackend.capabilities, notes={
        **TorchSDPABackend.feature_notes,
        "decode in place": "CPU, NHD, 16-/32-bit caches, no window / ALiBi / soft cap / sinks; else TORCH_SDPA's path",
    })

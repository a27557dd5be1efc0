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

import torch

from vattn.backends.torch_sdpa import TorchSDPABackend, TorchSDPAImpl, TorchSDPAMetadata, TorchSDPAMetadataBuilder
from vattn.core.metadata import CommonAttentionMetadata

__all__ = ["CPUAttentionBackend", "CPUAttentionImpl", "CPUAttentionMetadata", "CPUAttentionMetadataBuilder"]

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def block_runs(blocks: list[int], seq_len: int, block_size: int) -> list[tuple[int, int]]:
    """``(first block, tokens)`` of each run of consecutive block ids covering ``seq_len`` tokens."""
    runs: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(blocks) + 1):
        if i == len(blocks) or blocks[i] != blocks[i - 1] + 1:
            tokens = min((i - start) * block_size, seq_len - start * block_size)
            runs.append((blocks[start], tokens))
            start = i
    return runs


@dataclass
class CPUAttentionMetadata(TorchSDPAMetadata):
    """TORCH_SDPA's metadata, plus ``decode_runs``: for a CPU decode-only batch read in place, per
    request its ``(first block, tokens)`` runs (None: TORCH_SDPA's gather serves the batch)."""

    decode_runs: list[list[tuple[int, int]]] | None = None


class CPUAttentionMetadataBuilder(TorchSDPAMetadataBuilder):
    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> CPUAttentionMetadata:
        md = super().build(common_prefix_len, common_attn_metadata, fast_build)
        fields = {f.name: getattr(md, f.name) for f in dataclasses.fields(md) if f.init}
        out = CPUAttentionMetadata(**fields, decode_runs=self._runs(md, common_attn_metadata))
        out.checks = md.checks
        return out

    def _runs(self, md: TorchSDPAMetadata, cm: CommonAttentionMetadata) -> list[list[tuple[int, int]]] | None:
        if md.decode_blocks is None or md.decode_blocks.device.type != "cpu":
            return None
        bs = self.kv_cache_spec.block_size
        seq_lens = cm.seq_lens_cpu[: md.num_reqs].tolist()
        out = []
        for row, seq_len in zip(md.decode_blocks.tolist(), seq_lens):
            n = -(-seq_len // bs)
            runs = block_runs(row[:n], seq_len, bs)
            if len(runs) > max(1, n // 4):
                return None  # fragmented: the gather is cheaper than a kernel call per run
            out.append(runs)
        return out


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
        for b, request in enumerate(runs):
            q = q_all[b].view(1, hk, g, d)  # the G query heads of a KV head as G query rows
            outs, lses = [], []
            for first, tokens in request:
                kv = kv_cache.as_strided((2, 1, hk, tokens, d), (s_kv, 0, s_head, s_tok, s_dim), base + first * s_block)
                o, lse = _FLASH(q, kv[0], kv[1], scale=self.scale)[:2]  # (1, Hk, G, D), (1, Hk, G) float32
                outs.append(o)
                lses.append(lse)
            if len(outs) == 1:
                out = outs[0]
            else:  # merge the runs: each run's softmax weighs by its share of the total exp-sum
                w = torch.softmax(torch.stack(lses), dim=0)
                out = (torch.stack(outs).float() * w[..., None]).sum(0)
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

"""FLASH_ATTN's per-step metadata and its builder (persistent buffers for CUDA graphs).

For CUDA graphs (the contract in ``vattn.cudagraph``) the builder keeps persistent
``cu_seqlens_q`` / ``seqused_k`` / page-table / slot buffers: a step of ``T <= max capture size``
tokens runs as ``T`` requests (the extra ones empty) with ``max_seqlen_q = T`` and
``max_seqlen_k = width * block_size``, launch parameters that depend on ``T`` only, so any batch
of ``T`` tokens replays the graph captured for ``T`` (and the eager warm-up before a capture
compiles the very kernel the capture records).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from vattn.core.enums import AttentionCGSupport
from vattn.core.metadata import AttentionMetadata
from vattn.backends.flash_attn import interface as fa_interface
from vattn.core.interface import AttentionMetadataBuilder
from vattn.core.metadata import AttentionSpec, CommonAttentionMetadata
from vattn.core.config import CUDAGraphMode

if TYPE_CHECKING:
    from vattn.core.config import VattnConfig

__all__ = ["FlashAttentionMetadata", "FlashAttentionMetadataBuilder"]

_FULL_GRAPH_MODES = (CUDAGraphMode.FULL, CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL_AND_PIECEWISE)
_MAX_GRAPH_TABLE_ENTRIES = 1 << 22  # persistent page-table cap (entries) unless the cache is smaller


@dataclass
class FlashAttentionMetadata(AttentionMetadata):
    """One step's metadata; B = requests the kernel sees (the padded ``T`` in graph mode).

    | field | shape | meaning |
    | --- | --- | --- |
    | query_start_loc | (B+1,) int32 | cu_seqlens_q |
    | seq_lens | (B,) int32 | seqused_k (cached + new tokens) |
    | block_table | (B, W) int32 | page table |
    | cu_seqlens_k | (B+1,) int32 or None | FA2 only |

    ``use_cuda_graph``: ``T`` is a (captured) CUDA-graph size, so the fields are views of the
    persistent buffers (small eager batches on CUDA use them too, with ``use_cuda_graph`` False).
    """

    num_actual_tokens: int
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    max_query_len: int
    max_seq_len: int
    causal: bool = True
    cu_seqlens_k: torch.Tensor | None = None
    use_cuda_graph: bool = False


class FlashAttentionMetadataBuilder(AttentionMetadataBuilder[FlashAttentionMetadata]):
    """Persistent buffers and launch params fixed per token count ``T`` for every batch up to the
    largest capture size (on CUDA; capture sizes only elsewhere), the caller's tensors with exact
    launch params above it. ``cudagraph_support`` follows the interface (``fa_interface.cg_support``)."""

    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.ALWAYS
    reorder_batch_threshold: ClassVar[int | None] = 1

    def __init__(
        self, kv_cache_spec: AttentionSpec, layer_names: list[str], vattn_config: "VattnConfig", device: torch.device
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vattn_config, device)
        iface, _ = fa_interface.get_flash_attn_interface() if torch.cuda.is_available() else (None, "")
        self.iface = iface
        self.cudagraph_support = fa_interface.cg_support(iface)  # type: ignore[misc]  (per interface)
        comp = vattn_config.compilation
        self._capture_sizes = set(comp.capture_sizes()) if comp.cudagraph_mode in _FULL_GRAPH_MODES else set()
        self._max_graph_tokens = max([comp.max_capture_size, *comp.capture_sizes()])
        self._graph_sizes: set[int] = set()
        self._buffers: dict[str, torch.Tensor] | None = None
        # On CUDA every batch of at most the largest capture size takes the persistent path, so an
        # eager warm-up runs the very launch parameters (and JIT-compiled kernel) a capture will.
        self.use_persistent_buffers = self.device.type == "cuda"
        context = vattn_config.compilation.static_forward_context
        self._layer = context.get(layer_names[0]) if layer_names else None

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> FlashAttentionMetadata:
        return self._build(common_attn_metadata, force_graph=True)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> FlashAttentionMetadata:
        return self._build(common_attn_metadata, force_graph=False)

    def _build(self, cm: CommonAttentionMetadata, force_graph: bool) -> FlashAttentionMetadata:
        rows = cm.slot_mapping.shape[0]
        if force_graph or rows in self._graph_sizes or rows in self._capture_sizes:
            return self._build_graph(cm, rows)
        b = cm.num_reqs
        if self.use_persistent_buffers and b <= rows <= self._max_graph_tokens and self._fits(cm):
            return self._build_graph(cm, rows, mark=False)
        qsl, seq, table = cm.query_start_loc[: b + 1], cm.seq_lens[:b], cm.block_table_tensor[:b]
        limit = self.unchecked_block_limit(cm)
        if limit is not None:
            qsl, seq, table = _bounded(qsl, seq, table, limit, rows, self.kv_cache_spec.block_size)
        md = FlashAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens, slot_mapping=cm.slot_mapping,
            query_start_loc=qsl, seq_lens=seq, block_table=table,
            max_query_len=max(cm.max_query_len, 1), max_seq_len=max(cm.max_seq_len, 1), causal=cm.causal,
        )
        if self.iface is not None and self.iface.name == "fa2":
            md.cu_seqlens_k = torch.zeros(b + 1, dtype=torch.int32, device=seq.device)
            torch.cumsum(seq, 0, out=md.cu_seqlens_k[1:])
        return md

    def _persistent(self, cm: CommonAttentionMetadata) -> dict[str, torch.Tensor]:
        if self._buffers is None:
            n = self._max_graph_tokens
            cache = getattr(self._layer, "kv_cache", [None])[0]
            num_blocks = cache.shape[1] if cache is not None and cache.dim() == 5 else cm.block_table_tensor.shape[1]
            width = min(num_blocks, max(cm.block_table_tensor.shape[1], _MAX_GRAPH_TABLE_ENTRIES // n))
            z = functools.partial(torch.zeros, dtype=torch.int32, device=self.device)
            self._buffers = {"qsl": z(n + 1), "seq": z(n), "cu_k": z(n + 1), "table": z((n, width)),
                             "slots": torch.full((n,), -1, dtype=torch.int64, device=self.device)}
        return self._buffers

    def _pages_needed(self, cm: CommonAttentionMetadata) -> int:
        n = cm.num_reqs
        return -(-int(cm.seq_lens_cpu[:n].max()) // self.kv_cache_spec.block_size) if n else 0

    def _fits(self, cm: CommonAttentionMetadata) -> bool:
        return self._pages_needed(cm) <= self._persistent(cm)["table"].shape[1]

    def _build_graph(self, cm: CommonAttentionMetadata, rows: int, mark: bool = True) -> FlashAttentionMetadata:
        """Copy the batch into the persistent buffers as ``rows`` requests (the extra ones empty)."""
        if rows > self._max_graph_tokens:
            raise ValueError(
                f"FLASH_ATTN: a CUDA-graph step of {rows} tokens exceeds the largest capture size "
                f"{self._max_graph_tokens}; raise CompilationConfig.max_capture_size."
            )
        buf = self._persistent(cm)
        table = buf["table"]
        qsl_cpu = cm.query_start_loc_cpu
        n = min(cm.num_reqs, rows)
        if int(qsl_cpu[n]) != int(qsl_cpu[cm.num_reqs]):
            raise ValueError(
                f"FLASH_ATTN: {cm.num_reqs} requests with tokens beyond the first {rows} cannot run as a "
                f"CUDA-graph step of {rows} tokens; pad requests only with empty (query length 0) ones."
            )
        pages = self._pages_needed(cm)
        if pages > table.shape[1]:
            raise ValueError(
                f"FLASH_ATTN: a request needs {pages} blocks but the CUDA-graph page table holds "
                f"{table.shape[1]}; allocate the KV cache before capturing (its size bounds the table)."
            )
        w = min(cm.block_table_tensor.shape[1], table.shape[1])
        buf["qsl"][: n + 1].copy_(cm.query_start_loc[: n + 1], non_blocking=True)
        buf["qsl"][n + 1 : rows + 1].fill_(int(qsl_cpu[n]))
        buf["seq"][:n].copy_(cm.seq_lens[:n], non_blocking=True)
        buf["seq"][n:rows].zero_()
        table[:n, :w].copy_(cm.block_table_tensor[:n, :w], non_blocking=True)
        buf["slots"][:rows].copy_(cm.slot_mapping, non_blocking=True)
        limit = self.unchecked_block_limit(cm)
        if limit is not None:  # in place: the buffers are what a captured graph reads
            _bounded(buf["qsl"][: n + 1], buf["seq"][:n], table[:n], limit, rows, self.kv_cache_spec.block_size,
                     out=True)
        cu_k = None
        if self.iface is not None and self.iface.name == "fa2":
            cu_k = buf["cu_k"][: rows + 1]
            torch.cumsum(buf["seq"][:rows], 0, out=cu_k[1:])
        if mark:
            self._graph_sizes.add(rows)
        return FlashAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens, slot_mapping=buf["slots"][:rows],
            query_start_loc=buf["qsl"][: rows + 1], seq_lens=buf["seq"][:rows], block_table=table[:rows],
            max_query_len=rows, max_seq_len=table.shape[1] * self.kv_cache_spec.block_size,
            causal=cm.causal, cu_seqlens_k=cu_k, use_cuda_graph=mark,
        )


def _bounded(qsl: torch.Tensor, seq: torch.Tensor, table: torch.Tensor, num_blocks: int, num_tokens: int,
             block_size: int, out: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Device metadata no host check read (``unchecked_block_limit``), made safe for FlashAttention
    without a sync: ``qsl`` (B+1,) non-decreasing in ``[0, num_tokens]``, ``seq`` (B,) within the
    table's ``W * block_size`` keys, ``table`` (B, W) ids in ``[0, num_blocks)``. Wrong metadata then
    gives wrong output, never a read or write outside q, the output or the cache. ``out``: in place."""
    if out:
        qsl.clamp_(0, num_tokens)
        qsl.copy_(torch.cummax(qsl, 0).values)
        seq.clamp_(0, table.shape[1] * block_size)
        table.clamp_(0, num_blocks - 1)
        return qsl, seq, table
    qsl = torch.cummax(qsl.clamp(0, num_tokens), 0).values
    return qsl, seq.clamp(0, table.shape[1] * block_size), table.clamp(0, num_blocks - 1)

"""TRITON_ATTN's per-step metadata and its builder (persistent buffers for CUDA graphs)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from vattn.core.enums import AttentionCGSupport
from vattn.core.metadata import AttentionMetadata
from vattn.backends.draft_tree import checked_parents, token_tree_rows
from vattn.backends.triton.config import (
    UnifiedAttentionConfig,
    default_max_split_rows,
    device_num_sms,
    select_unified_attention_config,
    split_scratch_numel,
)
from vattn.core.interface import AttentionMetadataBuilder
from vattn.core.metadata import AttentionSpec, CommonAttentionMetadata

if TYPE_CHECKING:
    from vattn.core.config import VattnConfig

__all__ = ["FUSED_METADATA_COPY", "TritonAttentionMetadata", "TritonAttentionMetadataBuilder"]

logger = logging.getLogger("vattn.backends.triton")

#: Write a step's metadata into the persistent (CUDA-graph) buffers with one kernel
#: (``vattn.backends.triton.metadata_copy``) instead of one copy per array; False: ``copy_`` each.
FUSED_METADATA_COPY = True


@dataclass
class TritonAttentionMetadata(AttentionMetadata):
    """One step's metadata. T = token rows of the step (padded), Bk = requests the kernel sees.

    Under CUDA graphs (T <= the largest capture size) every tensor is a view of the builder's
    persistent buffers and ``Bk = T``: requests past ``num_reqs`` are empty padding
    (``query_start_loc`` repeats the token count, ``seq_lens`` is 0).

    | field | shape / type | meaning |
    | --- | --- | --- |
    | num_actual_tokens | int | real tokens (rows of output written) |
    | num_tokens | int | T: rows of slot_mapping (= query rows, except for cross-attention) |
    | num_reqs | int | requests in the batch (as given) |
    | max_query_len, max_seq_len | int | batch maxima |
    | query_start_loc | (Bk + 1,) int32 | cumulative query lengths |
    | seq_lens | (Bk,) int32 | cached + new tokens per request |
    | block_table | (Bk, max_blocks) int32 | block ids per request |
    | slot_mapping | (T,) int64 | cache slot of each new token, -1 = padding |
    | causal | bool | the batch's causal flag |
    | config | UnifiedAttentionConfig | launch config (tiles, splits), fixed per captured size |
    | partial_out, partial_lse | fp32 or None | split-KV scratch (the builder's, persistent) |
    | tree | (T, W) uint8 or None | draft trees (``CommonAttentionMetadata.tree_parents``): row t marks the new tokens of its request token t sees |
    """

    num_actual_tokens: int
    num_tokens: int
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool
    config: UnifiedAttentionConfig
    partial_out: torch.Tensor | None = None
    partial_lse: torch.Tensor | None = None
    tree: torch.Tensor | None = None
    #: Per layer signature: the launches the step's first such layer made (``LaunchPlan``).
    launch_plans: dict[Any, Any] = dataclasses.field(default_factory=dict, repr=False, compare=False)


class TritonAttentionMetadataBuilder(AttentionMetadataBuilder[TritonAttentionMetadata]):
    """Builds ``TritonAttentionMetadata``; full CUDA graphs for any batch (``ALWAYS``).

    On CUDA, batches of at most ``max_graph_tokens`` rows (the largest capture size) are
    copied into persistent buffers, updated in place every step, so a captured graph reads
    this step's data (the ``vattn.cudagraph`` builder contract). The kernel then sees
    ``Bk = T`` requests (past ``num_reqs``: empty) and a config chosen from ``T`` and whether
    the batch is decode-only, so each captured size holds one kernel path that is valid for
    every batch of that size. Larger batches run on the caller's tensors. The split-KV
    scratch is allocated once and every metadata carries it.
    """

    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.ALWAYS

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vattn_config: "VattnConfig",
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vattn_config, device)
        from vattn.backends.triton.metadata_copy import copy_decode_metadata  # imports Triton

        self._copy_metadata = copy_decode_metadata
        comp = vattn_config.compilation
        layers = comp.static_forward_context
        heads = [getattr(layers.get(n), "num_heads", None) for n in layer_names]
        heads = [h for h in heads if isinstance(h, int)]
        # Query heads size the split scratch; unknown (no registered layer): assume 8 per KV head.
        self.num_q_heads = max(heads) if heads else 8 * kv_cache_spec.num_kv_heads
        self.num_sms = device_num_sms(self.device)
        self.max_split_rows = default_max_split_rows(self.num_q_heads, kv_cache_spec.head_size)
        n_o, n_lse = split_scratch_numel(self.max_split_rows, self.num_q_heads, kv_cache_spec.head_size)
        self.partial_out = torch.empty(n_o, dtype=torch.float32, device=self.device)
        self.partial_lse = torch.empty(n_lse, dtype=torch.float32, device=self.device)
        # CUDA graphs exist only on CUDA; elsewhere skip the copies (tests may turn this on).
        self.use_persistent_buffers = self.device.type == "cuda"
        self.max_graph_tokens = max([comp.max_capture_size, *comp.capture_sizes()])
        self._captured = False
        self._configs: dict[tuple[int, int, int], UnifiedAttentionConfig] = {}
        self._allocate(self.max_graph_tokens, 1)

    def _allocate(self, num_tokens: int, width: int) -> None:
        """(Re)allocate the persistent buffers: ``num_tokens`` rows, block tables ``width`` wide."""
        dev = self.device
        self.max_graph_tokens = num_tokens
        self._qsl = torch.zeros(num_tokens + 1, dtype=torch.int32, device=dev)
        self._seq_lens = torch.zeros(num_tokens, dtype=torch.int32, device=dev)
        self._slots = torch.full((num_tokens,), -1, dtype=torch.int64, device=dev)
        self._block_table = torch.zeros((num_tokens, width), dtype=torch.int32, device=dev)

    def can_run_in_cudagraph(self, common_attn_metadata: CommonAttentionMetadata) -> bool:
        """Any batch but one with draft trees over several tokens of a request (its tree mask
        is a kernel variant no graph holds: such a step runs eagerly, or piecewise)."""
        return not _has_trees(common_attn_metadata)

    def _fits(self, cm: CommonAttentionMetadata) -> bool:
        t = cm.slot_mapping.shape[0]
        return (self.use_persistent_buffers and 0 < t and max(t, cm.num_reqs) <= self.max_graph_tokens
                and cm.block_table_tensor.shape[1] <= self._block_table.shape[1])

    def _config(self, num_tokens: int, num_seqs: int, max_query_len: int) -> UnifiedAttentionConfig:
        """The launch config for these static sizes (chosen once per distinct triple)."""
        key = (num_tokens, num_seqs, max_query_len)
        config = self._configs.get(key)
        if config is None:
            spec = self.kv_cache_spec
            config = self._configs[key] = select_unified_attention_config(
                num_tokens=num_tokens, num_seqs=num_seqs, num_q_heads=self.num_q_heads,
                num_kv_heads=spec.num_kv_heads, head_size=spec.head_size, max_seqlen_q=max_query_len,
                num_sms=self.num_sms, max_split_rows=self.max_split_rows,
                kv_fp8=spec.cache_dtype_str.startswith("fp8"),
            )
        return config

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> TritonAttentionMetadata:
        cm = common_attn_metadata
        num_tokens, b = cm.slot_mapping.shape[0], cm.num_reqs
        if not self._captured and self.use_persistent_buffers and 0 < num_tokens <= self.max_graph_tokens:
            # Before any capture the block-table buffer may still widen (capture batches are widest).
            width = cm.block_table_tensor.shape[1]
            if width > self._block_table.shape[1]:
                self._block_table = torch.zeros((self.max_graph_tokens, width), dtype=torch.int32,
                                                device=self.device)
        if self._fits(cm):
            bk = max(num_tokens, b)
            bt = cm.block_table_tensor
            if (FUSED_METADATA_COPY and self.device.type == "cuda" and bt.stride(1) == 1 and bt.is_cuda
                    and cm.query_start_loc.is_cuda and cm.seq_lens.is_cuda and cm.slot_mapping.is_cuda):
                # One launch instead of four to six copies (vattn.backends.triton.metadata_copy).
                self._copy_metadata(cm.query_start_loc, cm.seq_lens, cm.slot_mapping, bt[:b],
                                     self._qsl[: bk + 1], self._seq_lens[:bk], self._slots[:num_tokens],
                                     self._block_table[:b, : bt.shape[1]])
            else:
                self._qsl[: b + 1].copy_(cm.query_start_loc[: b + 1], non_blocking=True)
                self._seq_lens[:b].copy_(cm.seq_lens[:b], non_blocking=True)
                if bk > b:  # padded requests (a launch each; none for a batch of exactly bk requests)
                    self._qsl[b + 1 : bk + 1].fill_(int(cm.query_start_loc_cpu[b]))
                    self._seq_lens[b:bk].fill_(0)
                self._slots[:num_tokens].copy_(cm.slot_mapping, non_blocking=True)
                self._block_table[:b, : bt.shape[1]].copy_(bt[:b], non_blocking=True)
            qsl, seq_lens = self._qsl[: bk + 1], self._seq_lens[:bk]
            block_table, slots = self._block_table[:bk], self._slots[:num_tokens]
        else:
            bk = b
            qsl, seq_lens = cm.query_start_loc[: b + 1], cm.seq_lens[:b]
            block_table, slots = cm.block_table_tensor[:b], cm.slot_mapping
        tree = None
        if _has_trees(cm):
            tree = token_tree_rows(checked_parents(cm), cm.query_start_loc, cm.query_start_loc_cpu, b, num_tokens,
                                   cm.num_actual_tokens)
        return TritonAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            num_tokens=num_tokens,
            num_reqs=b,
            max_query_len=cm.max_query_len,
            max_seq_len=cm.max_seq_len,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_table=block_table,
            slot_mapping=slots,
            causal=cm.causal,
            config=self._config(num_tokens, bk, cm.max_query_len),
            partial_out=self.partial_out,
            partial_lse=self.partial_lse,
            tree=tree,
        )

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> TritonAttentionMetadata:
        """Capture-time metadata through the persistent buffers (grown first if this batch is larger)."""
        cm = common_attn_metadata
        t, width = cm.slot_mapping.shape[0], cm.block_table_tensor.shape[1]
        if not self.use_persistent_buffers:
            raise ValueError(f"CUDA graphs need a CUDA device; this TRITON_ATTN builder is on {self.device}.")
        if max(t, cm.num_reqs) > self.max_graph_tokens or width > self._block_table.shape[1]:
            if self._captured:
                logger.warning(
                    "TRITON_ATTN: capturing %d tokens / %d block-table columns after smaller captures; "
                    "the persistent buffers grow and graphs captured before must be captured again "
                    "(capture the largest size, with the widest block table, first).", t, width)
            self._allocate(max(t, cm.num_reqs, self.max_graph_tokens), max(width, self._block_table.shape[1]))
        self._captured = True
        return self.build(0, cm)


def _has_trees(cm: CommonAttentionMetadata) -> bool:
    """The step carries draft trees that matter: parents given, and a request with several tokens."""
    return cm.tree_parents is not None and cm.max_query_len > 1

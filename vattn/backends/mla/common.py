"""What every MLA backend shares: the backend base (the latent cache's shape), the per-step
metadata, and its builder, which splits a batch into decodes (absorbed attention over the
latent) and prefills (up-projected attention over new tokens and, chunk by chunk, their
cached context).

The builder does the host work once per step for all MLA layers of a group: the decode /
prefill split (``split_decodes_and_prefills``), the context chunks (which cache slots each
chunk reads, computed on the device from the block table: no sync), and whatever a backend
plans on top (``_decode_extras`` / ``_prefill_extras``). Pure-decode steps of at most the
largest capture size go through persistent buffers, so full CUDA graphs replay them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from vattn.backends.utils import split_decodes_and_prefills
from vattn.core.enums import AttentionCGSupport
from vattn.core.capabilities import Capabilities
from vattn.core.interface import AttentionBackend, AttentionMetadataBuilder
from vattn.core.layout import check_kv_cache_shape_args
from vattn.core.metadata import AttentionMetadata, AttentionSpec, CommonAttentionMetadata, MLAAttentionSpec, to_device

if TYPE_CHECKING:
    from vattn.core.config import VattnConfig

__all__ = [
    "MLACommonBackend",
    "MLACommonMetadata",
    "MLACommonMetadataBuilder",
    "MLADecodeMetadata",
    "MLAPrefillChunk",
    "MLAPrefillMetadata",
    "merge_attn_states",
]

logger = logging.getLogger("vattn.backends.mla")


class MLACommonBackend(AttentionBackend):
    """Base of the MLA backends: a latent cache ``(num_blocks, block_size, kv_lora_rank +
    qk_rope_head_dim)``, an output buffer, MLA only. Subclasses name the impl and builder."""

    capabilities = Capabilities(
        accept_output_buffer=True, mla=True, dtypes=(torch.float16, torch.bfloat16),
        kv_cache_dtypes=("auto", "bfloat16", "float16"),
    )

    @classmethod
    def mla_dims_reasons(cls, kv_lora_rank: int, qk_rope_head_dim: int, qk_nope_head_dim: int,
                         v_head_dim: int) -> list[str]:
        """Every reason this backend's kernels cannot serve an MLA layer of these sizes (empty:
        they can). The selector asks before choosing; the impl raises with the same reasons."""
        return []

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        """``(num_blocks, block_size, head_size)``: one latent row per token (``num_kv_heads`` is 1,
        ``head_size`` is ``kv_lora_rank + qk_rope_head_dim``)."""
        check_kv_cache_shape_args(num_blocks, block_size, num_kv_heads, head_size)
        if num_kv_heads != 1:
            raise ValueError(f"num_kv_heads: expected 1 for an MLA latent cache (one row per token), got "
                             f"{num_kv_heads}; MLA layers cache kv_lora_rank + qk_rope_head_dim per token.")
        return (num_blocks, block_size, head_size)

    @staticmethod
    def get_kv_cache_stride_order() -> tuple[int, ...]:
        return (0, 1, 2)

    @classmethod
    def get_metadata_cls(cls) -> type[AttentionMetadata]:
        return MLACommonMetadata  # defined below


@dataclass
class MLADecodeMetadata:
    """The decodes of a step (requests ``[0, num_decodes)``, one query row each).

    | field | shape / type | meaning |
    | --- | --- | --- |
    | query_start_loc | (B + 1,) int32 | query row of decode ``b`` is ``query_start_loc[b]`` (0 rows: padding) |
    | seq_lens | (B,) int32 | tokens in the cache after this step's store |
    | block_table | (B, max_blocks) int32 | block ids |
    | num_decodes | int | B |
    | num_decode_tokens | int | query rows the decodes cover (``query_start_loc[B]``) |
    | max_seq_len | int | longest seq_len (host) |
    | cuda_graph | bool | the tensors are persistent buffers (a full CUDA graph may replay them) |
    | plan | any | what the backend's builder prepared (split count, a planned wrapper, ...) |
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    num_decodes: int
    num_decode_tokens: int
    max_seq_len: int
    cuda_graph: bool = False
    plan: Any = None


@dataclass
class MLAPrefillChunk:
    """One chunk of the prefills' cached context, up-projected and attended at once.

    | field | shape / type | meaning |
    | --- | --- | --- |
    | slots | (C,) int64 | cache slots of the chunk's tokens, request by request |
    | cu_seqlens | (P + 1,) int32 | each prefill's token range in ``slots`` (empty ranges allowed) |
    | cu_seqlens_cpu | (P + 1,) int32 | host copy |
    | max_seqlen | int | longest range |
    | plan | any | the backend's plan for this chunk's attention |
    """

    slots: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor
    max_seqlen: int
    plan: Any = None


@dataclass
class MLAPrefillMetadata:
    """The prefills of a step (requests after the decodes), rows ``[start, start + num_tokens)``.

    | field | shape / type | meaning |
    | --- | --- | --- |
    | query_start_loc | (P + 1,) int32 | each prefill's rows, relative to ``start`` |
    | query_start_loc_cpu | (P + 1,) int32 | host copy |
    | max_query_len | int | longest prefill |
    | start, num_tokens | int | the prefill rows of the step |
    | context_lens_cpu | (P,) int64 | tokens each prefill has in the cache before this step |
    | chunks | list of MLAPrefillChunk | the cached context, in order (empty: no context) |
    | plan | any | the backend's plan for the new tokens' causal attention |
    """

    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    max_query_len: int
    start: int
    num_tokens: int
    context_lens_cpu: torch.Tensor
    chunks: list[MLAPrefillChunk] = field(default_factory=list)
    plan: Any = None


@dataclass
class MLACommonMetadata(AttentionMetadata):
    """One step's MLA metadata. Requests are ordered decodes first.

    | field | shape / type | meaning |
    | --- | --- | --- |
    | num_actual_tokens | int | real tokens (rows of output written) |
    | num_reqs | int | requests (padded ones included) |
    | max_query_len, max_seq_len | int | batch maxima |
    | slot_mapping | (T,) int64 | latent-row slot of each new token, -1 = padding |
    | query_start_loc, seq_lens, block_table | int32 | the batch's, or their persistent copies |
    | num_decodes, num_decode_tokens | int | decode requests and rows |
    | num_prefills, num_prefill_tokens | int | prefill requests and rows |
    | decode, prefill | MLADecodeMetadata / MLAPrefillMetadata or None | the two parts |
    """

    num_actual_tokens: int
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    decode: MLADecodeMetadata | None = None
    prefill: MLAPrefillMetadata | None = None


def merge_attn_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                      lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over keys A and B from the attention over each: out (T, H, D), lse (T, H)
    (natural log of the softmax denominators). A row with no keys has lse -inf (or +inf, as
    FlashAttention writes it) and any out. Returns float32 (out, lse); device ops only."""
    inf = float("inf")
    lse_a = torch.where(lse_a == inf, -inf, lse_a.float())
    lse_b = torch.where(lse_b == inf, -inf, lse_b.float())
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(m == -inf, 0.0, m)
    wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = wa + wb
    norm = torch.where(total == 0, 1.0, total)
    out = (out_a.float() * (wa / norm)[..., None]) + (out_b.float() * (wb / norm)[..., None])
    return out, m + torch.log(total)


class MLACommonMetadataBuilder(AttentionMetadataBuilder[MLACommonMetadata]):
    """Builds ``MLACommonMetadata``; full CUDA graphs for pure-decode steps.

    Context chunks: each chunk up-projects at most ``prefill_chunk_tokens`` cached tokens
    (``PREFILL_CHUNK_BYTES`` of per-head keys and values), shared evenly by the prefills
    that have context. Subclasses add their plans in ``_decode_extras`` / ``_prefill_extras``.
    """

    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    reorder_batch_threshold: ClassVar[int | None] = 1
    cache_blocks_dim: ClassVar[int] = 0  # (num_blocks, block_size, L + P)
    #: Bytes of up-projected context (keys and values of every head) one chunk may hold.
    PREFILL_CHUNK_BYTES: ClassVar[int] = 256 << 20

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vattn_config: "VattnConfig",
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vattn_config, device)
        if not isinstance(kv_cache_spec, MLAAttentionSpec):
            raise TypeError(f"kv_cache_spec: expected an MLAAttentionSpec (an MLA layer's), got "
                            f"{type(kv_cache_spec).__name__}; MLA backends serve vattn.MLAAttention layers.")
        context = vattn_config.compilation.static_forward_context
        self.layers = [context[n] for n in layer_names if n in context]
        impls = [layer.impl for layer in self.layers]
        self.num_heads = max((i.num_heads for i in impls), default=16)
        self.qk_nope_head_dim = max((i.qk_nope_head_dim for i in impls), default=128)
        self.v_head_dim = max((i.v_head_dim for i in impls), default=128)
        self.kv_lora_rank = kv_cache_spec.kv_lora_rank
        self.qk_rope_head_dim = kv_cache_spec.qk_rope_head_dim
        self.model_dtype = self.layers[0].dtype if self.layers else torch.bfloat16
        itemsize = torch.empty((), dtype=self.model_dtype).element_size()
        width = self.num_heads * (self.qk_nope_head_dim + self.v_head_dim) * itemsize  # bytes per cached token
        #: Cached tokens up-projected per context chunk (tests may lower it).
        self.prefill_chunk_tokens = max(kv_cache_spec.block_size, self.PREFILL_CHUNK_BYTES // width)
        comp = vattn_config.compilation
        # CUDA graphs exist only on CUDA; elsewhere (tests may switch this on) no copies.
        self.use_persistent_buffers = self.device.type == "cuda"
        self._captured = False
        self._allocate(max([comp.max_capture_size, *comp.capture_sizes()]), 1)

    # ---- persistent buffers (CUDA graphs) ----------------------------------------------------

    def _allocate(self, num_reqs: int, width: int) -> None:
        dev = self.device
        self.max_graph_reqs = num_reqs
        self._qsl = torch.zeros(num_reqs + 1, dtype=torch.int32, device=dev)
        self._seq_lens = torch.zeros(num_reqs, dtype=torch.int32, device=dev)
        self._block_table = torch.zeros((num_reqs, width), dtype=torch.int32, device=dev)
        self._slots = torch.full((num_reqs,), -1, dtype=torch.int64, device=dev)

    def _fits(self, cm: CommonAttentionMetadata) -> bool:
        t = cm.slot_mapping.shape[0]
        return (self.use_persistent_buffers and 0 < max(t, cm.num_reqs) <= self.max_graph_reqs
                and cm.block_table_tensor.shape[1] <= self._block_table.shape[1])

    def _to_buffers(self, cm: CommonAttentionMetadata) -> tuple[torch.Tensor, ...]:
        b, t = cm.num_reqs, cm.slot_mapping.shape[0]
        bt = cm.block_table_tensor
        self._qsl[: b + 1].copy_(cm.query_start_loc[: b + 1], non_blocking=True)
        self._seq_lens[:b].copy_(cm.seq_lens[:b], non_blocking=True)
        self._block_table[:b, : bt.shape[1]].copy_(bt[:b], non_blocking=True)
        self._slots[:t].copy_(cm.slot_mapping, non_blocking=True)
        return self._qsl[: b + 1], self._seq_lens[:b], self._block_table[:b], self._slots[:t]

    def can_run_in_cudagraph(self, common_attn_metadata: CommonAttentionMetadata) -> bool:
        """Pure-decode steps (query lengths <= 1; 0 for CUDA-graph padding requests)."""
        n = common_attn_metadata.num_reqs
        return bool((common_attn_metadata.query_lens_cpu[:n] <= 1).all())

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> MLACommonMetadata:
        cm = common_attn_metadata
        if not self.can_run_in_cudagraph(cm):
            raise ValueError(f"{type(self).__name__} captures pure-decode steps (UNIFORM_SINGLE_TOKEN_DECODE), got "
                             f"max_query_len={cm.max_query_len}; capture decode batches (query length 1).")
        if not self.use_persistent_buffers:
            raise ValueError(f"CUDA graphs need a CUDA device; this {type(self).__name__} is on {self.device}.")
        size, width = max(cm.slot_mapping.shape[0], cm.num_reqs), cm.block_table_tensor.shape[1]
        if size > self.max_graph_reqs or width > self._block_table.shape[1]:
            if self._captured:
                logger.warning("%s: capturing %d rows / %d block-table columns after smaller captures; graphs "
                               "captured before must be captured again (capture the largest size first).",
                               type(self).__name__, size, width)
            self._allocate(max(size, self.max_graph_reqs), max(width, self._block_table.shape[1]))
        self._captured = True
        return self.build(0, cm)

    # ---- build --------------------------------------------------------------------------

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> MLACommonMetadata:
        cm = common_attn_metadata
        b = cm.num_reqs
        nd, np_, ndt, npt = split_decodes_and_prefills(cm, decode_threshold=self.reorder_batch_threshold or 1)
        if not self._captured and self.use_persistent_buffers and np_ == 0:
            # Before any capture the block-table buffer may still widen (capture batches are widest).
            if cm.block_table_tensor.shape[1] > self._block_table.shape[1]:
                self._block_table = torch.zeros((self.max_graph_reqs, cm.block_table_tensor.shape[1]),
                                                dtype=torch.int32, device=self.device)
        graph = np_ == 0 and self._fits(cm)
        if graph:
            qsl, seq_lens, block_table, slots = self._to_buffers(cm)
        else:
            qsl, seq_lens, block_table = cm.query_start_loc[: b + 1], cm.seq_lens[:b], cm.block_table_tensor[:b]
            slots = cm.slot_mapping
        limit = self.unchecked_block_limit(cm)
        if limit is not None:  # a device table never seen on the host: keep every read inside the cache
            block_table, seq_lens = self._bounded(block_table, seq_lens, limit, in_place=graph)
        decode = None
        if nd:
            qsl_cpu = cm.query_start_loc_cpu
            decode = MLADecodeMetadata(
                query_start_loc=qsl[: nd + 1], seq_lens=seq_lens[:nd], block_table=block_table[:nd],
                num_decodes=nd, num_decode_tokens=int(qsl_cpu[nd] - qsl_cpu[0]),
                max_seq_len=int(cm.seq_lens_cpu[:nd].max()), cuda_graph=graph)
            self._decode_extras(decode, cm)
        prefill = self._build_prefill(cm, nd, block_table) if np_ else None
        return MLACommonMetadata(
            num_actual_tokens=cm.num_actual_tokens, num_reqs=b, max_query_len=cm.max_query_len,
            max_seq_len=cm.max_seq_len, slot_mapping=slots, query_start_loc=qsl, seq_lens=seq_lens,
            block_table=block_table, num_decodes=nd, num_decode_tokens=ndt, num_prefills=np_,
            num_prefill_tokens=npt, decode=decode, prefill=prefill)

    def _bounded(self, block_table: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int,
                 in_place: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ids clamped into ``[0, num_blocks)`` and sequence lengths to what the table's
        columns cover (device ops, no sync; ``in_place`` for the persistent CUDA-graph buffers)."""
        cover = block_table.shape[1] * self.kv_cache_spec.block_size
        if in_place:
            return block_table.clamp_(0, num_blocks - 1), seq_lens.clamp_(0, cover)
        return block_table.clamp(0, num_blocks - 1), seq_lens.clamp(0, cover)

    def _build_prefill(self, cm: CommonAttentionMetadata, nd: int, block_table: torch.Tensor) -> MLAPrefillMetadata:
        """Prefill rows and context chunks (host arithmetic; slots gathered on the device from
        ``block_table``, the step's (B, W) table)."""
        b = cm.num_reqs
        qsl = cm.query_start_loc_cpu[: b + 1].numpy().astype(np.int64)
        start = int(qsl[nd])
        qlens = np.diff(qsl[nd:])
        ctx = np.maximum(cm.seq_lens_cpu[nd:b].numpy().astype(np.int64) - qlens, 0)
        q_indptr = (qsl[nd:] - start).astype(np.int32)
        with_ctx = int((ctx > 0).sum())
        arrays: list[np.ndarray] = [q_indptr]
        spans: list[tuple[np.ndarray, int]] = []  # per chunk: (cu_seqlens, tokens)
        if with_ctx:
            width = max(1, self.prefill_chunk_tokens // with_ctx)
            req_parts, pos_parts = [], []
            for lo in range(0, int(ctx.max()), width):
                lens = np.clip(ctx - lo, 0, width)
                cu = np.zeros(lens.size + 1, dtype=np.int32)
                np.cumsum(lens, out=cu[1:])
                req = np.repeat(np.arange(lens.size), lens)
                pos = lo + np.arange(req.size) - cu[:-1][req]
                req_parts.append(req)
                pos_parts.append(pos)
                arrays.append(cu)
                spans.append((cu, int(cu[-1])))
            arrays += [np.concatenate(req_parts) + nd, np.concatenate(pos_parts)]
        dev = to_device(arrays, cm.query_start_loc.device)
        chunks: list[MLAPrefillChunk] = []
        if with_ctx:
            req_t, pos_t = dev[-2], dev[-1]
            bs = self.kv_cache_spec.block_size
            blocks = block_table[req_t, pos_t // bs].long()
            slots = blocks * bs + pos_t % bs
            offset = 0
            for (cu, n), cu_dev in zip(spans, dev[1:-2]):
                chunks.append(MLAPrefillChunk(slots=slots[offset : offset + n], cu_seqlens=cu_dev,
                                              cu_seqlens_cpu=torch.from_numpy(cu),
                                              max_seqlen=int(np.diff(cu).max())))
                offset += n
        prefill = MLAPrefillMetadata(
            query_start_loc=dev[0], query_start_loc_cpu=torch.from_numpy(q_indptr), max_query_len=int(qlens.max()),
            start=start, num_tokens=int(qsl[b] - start), context_lens_cpu=torch.from_numpy(ctx), chunks=chunks)
        self._prefill_extras(prefill, cm)
        return prefill

    # ---- backend hooks ------------------------------------------------------------------

    def _decode_extras(self, decode: MLADecodeMetadata, cm: CommonAttentionMetadata) -> None:
        """Fill ``decode.plan`` (host work for the decode kernel); default: nothing."""

    def _prefill_extras(self, prefill: MLAPrefillMetadata, cm: CommonAttentionMetadata) -> None:
        """Fill ``prefill.plan`` and each chunk's ``plan``; default: nothing."""

"""FLASHINFER's per-step metadata and its builder: one ``plan`` per step for all layers of a group.

The builder splits the batch (decodes first) and plans a ``BatchDecodeWithPagedKVCacheWrapper``
(tensor-core decode unless ``VATTN_FLASHINFER_DECODE_TENSOR_CORES=0``) for the decodes and a
``BatchPrefillWithPagedKVCacheWrapper`` for the rest. A pure-decode step whose padded token
count is a capture size (or was captured) goes through one CUDA-graph decode wrapper per size,
over persistent indptr / indices / last-page-length / slot buffers shared by all sizes; a later
step of that size writes only the host-side entries that changed (and the page indices) and
re-plans without copies (``flashinfer.decode.fast_decode_plan``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from vattn import envs
from vattn.core.enums import AttentionCGSupport
from vattn.core.interface import AttentionImpl
from vattn.core.metadata import AttentionMetadata, is_fp8_kv_cache
from vattn.backends.flashinfer.paging import fenced_plan, gather_page_indices, paged_kv_layout, workspace
from vattn.backends.utils import get_per_layer_parameters, infer_global_hyperparameters, split_decodes_and_prefills
from vattn.core.interface import AttentionMetadataBuilder
from vattn.core.layout import get_kv_cache_layout
from vattn.core.metadata import AttentionSpec, CommonAttentionMetadata
from vattn.core.config import CUDAGraphMode

if TYPE_CHECKING:
    from vattn.core.config import VattnConfig

__all__ = ["FlashInferMetadata", "FlashInferMetadataBuilder"]

#: Entries of the persistent CUDA-graph page-index buffer beyond 4 x num_blocks (64 MiB).
_MAX_GRAPH_INDEX_ENTRIES = 1 << 24
_FULL_GRAPH_MODES = (CUDAGraphMode.FULL, CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL_AND_PIECEWISE)


@dataclass
class FlashInferMetadata(AttentionMetadata):
    """One step's metadata (the wrappers are planned; ``run`` only launches kernels).

    Query rows ``[0, decode_rows)`` go to ``decode_wrapper`` and rows
    ``[prefill_start, prefill_start + prefill_rows)`` to ``prefill_wrapper`` (either may be None).
    ``decode_rows`` is the padded batch size when ``use_cuda_graph``.
    """

    num_actual_tokens: int
    slot_mapping: torch.Tensor
    kv_layout: str
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    decode_rows: int = 0
    prefill_start: int = 0
    prefill_rows: int = 0
    decode_wrapper: Any = None
    prefill_wrapper: Any = None
    use_cuda_graph: bool = False


@dataclass
class _GraphBuffers:
    """Persistent device buffers read by every CUDA-graph decode wrapper, and host mirrors."""

    indptr: torch.Tensor  # (max_bs + 1,) int32
    indices: torch.Tensor  # (capacity,) int32
    last_page_len: torch.Tensor  # (max_bs,) int32
    slots: torch.Tensor  # (max_bs,) int64: the step's slot_mapping (the graph's KV write reads it)
    host_indptr: torch.Tensor
    host_last_page_len: torch.Tensor


class FlashInferMetadataBuilder(AttentionMetadataBuilder[FlashInferMetadata]):
    """Plans FlashInfer's wrappers once per step for all layers of a KV-cache group."""

    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    reorder_batch_threshold: ClassVar[int | None] = 1
    cache_blocks_dim: ClassVar[int] = 0  # (num_blocks, 2, block_size, Hk, D)

    def __init__(
        self, kv_cache_spec: AttentionSpec, layer_names: list[str], vattn_config: "VattnConfig", device: torch.device
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vattn_config, device)
        # The group's layers share this backend (KV-cache groups are per backend): any impl will do.
        params = infer_global_hyperparameters(get_per_layer_parameters(vattn_config, AttentionImpl, layer_names))
        self.window_left = params.window_left
        self.logits_soft_cap = params.logits_soft_cap
        self.sm_scale = params.sm_scale
        context = vattn_config.compilation.static_forward_context
        layers = [context[n] for n in layer_names]
        heads = {layer.impl.num_heads for layer in layers}
        if len(heads) != 1:
            raise ValueError(
                f"FLASHINFER plans one num_qo_heads per KV-cache group, but layers {layer_names} have "
                f"{sorted(heads)}; give them equal head counts or use TRITON_ATTN / FLASH_ATTN."
            )
        self.num_qo_heads = heads.pop()
        self.num_kv_heads = kv_cache_spec.num_kv_heads
        self.head_dim = kv_cache_spec.head_size
        self.page_size = kv_cache_spec.block_size
        self.kv_dtype = kv_cache_spec.dtype
        fp8 = is_fp8_kv_cache(kv_cache_spec.cache_dtype_str)
        self.q_dtype = getattr(layers[0], "dtype", torch.bfloat16) if fp8 else kv_cache_spec.dtype
        self.kv_layout = get_kv_cache_layout()
        self._layers = layers
        comp = vattn_config.compilation
        self._capture_sizes = set(comp.capture_sizes()) if comp.cudagraph_mode in _FULL_GRAPH_MODES else set()
        self._max_graph_bs = max([comp.max_capture_size, *comp.capture_sizes()])
        #: Decode through FlashInfer's tensor-core kernel (default) or its CUDA-core decode kernel.
        self.decode_tensor_cores = envs.VATTN_FLASHINFER_DECODE_TENSOR_CORES
        self._prefill_wrapper: Any = None
        self._decode_wrapper: Any = None
        self._graph_wrappers: dict[int, Any] = {}
        self._graph: _GraphBuffers | None = None

    # ---- build ------------------------------------------------------------------------

    def can_run_in_cudagraph(self, common_attn_metadata: CommonAttentionMetadata) -> bool:
        """Pure-decode steps (query lengths <= 1; 0 for CUDA-graph padding requests)."""
        n = common_attn_metadata.num_reqs
        return bool((common_attn_metadata.query_lens_cpu[:n] <= 1).all())

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> FlashInferMetadata:
        cm = common_attn_metadata
        if cm.max_query_len > 1:
            raise ValueError(
                f"FLASHINFER captures only pure-decode steps (UNIFORM_SINGLE_TOKEN_DECODE), got a batch "
                f"with max_query_len={cm.max_query_len}; capture decode batches (query length 1)."
            )
        return self._build(cm, force_graph=True)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> FlashInferMetadata:
        return self._build(common_attn_metadata, force_graph=False)

    def _build(self, cm: CommonAttentionMetadata, force_graph: bool) -> FlashInferMetadata:
        num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = split_decodes_and_prefills(
            cm, decode_threshold=1
        )
        md = FlashInferMetadata(
            num_actual_tokens=cm.num_actual_tokens, slot_mapping=cm.slot_mapping, kv_layout=self.kv_layout,
            num_decodes=num_decodes, num_decode_tokens=num_decode_tokens,
            num_prefills=num_prefills, num_prefill_tokens=num_prefill_tokens,
        )
        rows = cm.slot_mapping.shape[0]  # padded token count = query rows
        if num_prefills == 0 and (force_graph or rows in self._graph_wrappers or rows in self._capture_sizes):
            self._plan_graph_decode(cm, rows, md)
            return md
        qsl = cm.query_start_loc_cpu
        decode_rows = int(qsl[num_decodes] - qsl[0])  # decodes have one row each (0-row padding excluded)
        if decode_rows:
            self._plan_decode(cm, decode_rows, md)
        if num_prefills:
            self._plan_prefill(cm, num_decodes, md)
        return md

    def _plan_kwargs(self) -> dict[str, Any]:
        return dict(
            window_left=self.window_left, logits_soft_cap=self.logits_soft_cap, sm_scale=self.sm_scale,
            q_data_type=self.q_dtype, kv_data_type=self.kv_dtype, non_blocking=True,
        )

    def _plan_prefill(self, cm: CommonAttentionMetadata, start: int, md: FlashInferMetadata) -> None:
        from flashinfer import BatchPrefillWithPagedKVCacheWrapper

        end = cm.num_reqs
        qsl = cm.query_start_loc_cpu
        indptr, last = paged_kv_layout(cm.seq_lens_cpu[start:end], self.page_size)
        indices = gather_page_indices(cm.block_table_tensor[start:end], indptr, num_blocks=self.unchecked_block_limit(cm))
        qo_indptr = (qsl[start : end + 1] - qsl[start]).to(torch.int32)
        if self._prefill_wrapper is None:
            self._prefill_wrapper = BatchPrefillWithPagedKVCacheWrapper(workspace(self.device), self.kv_layout)
        fenced_plan(self._prefill_wrapper, lambda: self._prefill_wrapper.plan(
            qo_indptr, indptr, indices, last, self.num_qo_heads, self.num_kv_heads, self.head_dim,
            self.page_size, causal=cm.causal, o_data_type=self.q_dtype, **self._plan_kwargs(),
        ))
        md.prefill_wrapper = self._prefill_wrapper
        md.prefill_start = int(qsl[start])
        md.prefill_rows = int(qo_indptr[-1])

    def _new_decode_wrapper(self, graph: _GraphBuffers | None = None, batch_size: int = 0) -> Any:
        from flashinfer import BatchDecodeWithPagedKVCacheWrapper

        tc = self.decode_tensor_cores
        if graph is None:
            return BatchDecodeWithPagedKVCacheWrapper(workspace(self.device), self.kv_layout, use_tensor_cores=tc)
        return BatchDecodeWithPagedKVCacheWrapper(
            workspace(self.device), self.kv_layout, use_cuda_graph=True, use_tensor_cores=tc,
            paged_kv_indptr_buffer=graph.indptr[: batch_size + 1],
            paged_kv_indices_buffer=graph.indices,
            paged_kv_last_page_len_buffer=graph.last_page_len[:batch_size],
        )

    def _decode_plan_args(self) -> tuple[int, int, int, int]:
        return (self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size)

    def _plan_decode(self, cm: CommonAttentionMetadata, rows: int, md: FlashInferMetadata) -> None:
        indptr, last = paged_kv_layout(cm.seq_lens_cpu[:rows].clamp(min=1), self.page_size)
        indices = gather_page_indices(cm.block_table_tensor, indptr, num_blocks=self.unchecked_block_limit(cm))
        if self._decode_wrapper is None:
            self._decode_wrapper = self._new_decode_wrapper()
        fenced_plan(self._decode_wrapper, lambda: self._decode_wrapper.plan(
            indptr, indices, last, *self._decode_plan_args(), pos_encoding_mode="NONE",
            o_data_type=self.q_dtype, **self._plan_kwargs(),
        ))
        md.decode_wrapper, md.decode_rows = self._decode_wrapper, rows

    def _graph_buffers(self, cm: CommonAttentionMetadata) -> _GraphBuffers:
        if self._graph is None:
            cache = self._layers[0].kv_cache[0] if self._layers and hasattr(self._layers[0], "kv_cache") else None
            num_blocks = cache.shape[0] if cache is not None and cache.dim() == 5 else cm.block_table_tensor.shape[1]
            n = self._max_graph_bs  # pages of a batch: <= n * num_blocks, in practice <= num_blocks
            capacity = min(n * num_blocks, max(4 * num_blocks, _MAX_GRAPH_INDEX_ENTRIES)) + n
            self._graph = _GraphBuffers(
                indptr=torch.zeros(n + 1, dtype=torch.int32, device=self.device),
                indices=torch.zeros(capacity, dtype=torch.int32, device=self.device),
                last_page_len=torch.ones(n, dtype=torch.int32, device=self.device),
                slots=torch.full((n,), -1, dtype=torch.int64, device=self.device),
                host_indptr=torch.zeros(n + 1, dtype=torch.int32),
                host_last_page_len=torch.ones(n, dtype=torch.int32),
            )
        return self._graph

    def _plan_graph_decode(self, cm: CommonAttentionMetadata, bs: int, md: FlashInferMetadata) -> None:
        """Pure decode of ``bs`` padded rows through the CUDA-graph wrapper of that size."""
        if bs > self._max_graph_bs:
            raise ValueError(
                f"FLASHINFER: a CUDA-graph decode of {bs} rows exceeds the largest capture size "
                f"{self._max_graph_bs}; raise CompilationConfig.max_capture_size or capture smaller sizes."
            )
        g = self._graph_buffers(cm)
        n = min(cm.num_reqs, bs)
        seq = torch.ones(bs, dtype=torch.int32)  # rows past the requests: one page (block 0), one token
        seq[:n] = cm.seq_lens_cpu[:n].clamp(min=1)
        indptr, last = paged_kv_layout(seq, self.page_size)
        total = int(indptr[-1])
        if total > g.indices.numel():
            raise ValueError(
                f"FLASHINFER: this decode batch needs {total} page entries but the CUDA-graph index buffer "
                f"holds {g.indices.numel()}; allocate the KV cache before capturing, or capture with block "
                "tables as wide as the longest request will need."
            )
        # Only what changed reaches the persistent buffers (the captured graphs read them).
        if not torch.equal(g.host_indptr[: bs + 1], indptr):
            g.indptr[: bs + 1].copy_(indptr, non_blocking=True)
            g.host_indptr[: bs + 1] = indptr
        if not torch.equal(g.host_last_page_len[:bs], last):
            g.last_page_len[:bs].copy_(last, non_blocking=True)
            g.host_last_page_len[:bs] = last
        g.slots[:bs].copy_(cm.slot_mapping, non_blocking=True)
        md.slot_mapping = g.slots[:bs]
        real = int(indptr[n])
        gather_page_indices(cm.block_table_tensor, indptr[: n + 1], out=g.indices[:real],
                            num_blocks=self.unchecked_block_limit(cm))
        if total > real:
            g.indices[real:total].zero_()
        wrapper = self._graph_wrappers.get(bs)
        args = (indptr, g.indices[:total], last, *self._decode_plan_args())
        if wrapper is None:
            wrapper = self._graph_wrappers[bs] = self._new_decode_wrapper(g, bs)
            fenced_plan(wrapper, lambda: wrapper.plan(*args, pos_encoding_mode="NONE", o_data_type=self.q_dtype,
                                                      **self._plan_kwargs()))
        else:
            fenced_plan(wrapper, lambda: _fast_decode_plan(wrapper, args, self._plan_kwargs()))
        md.decode_wrapper, md.decode_rows, md.use_cuda_graph = wrapper, bs, True


def _fast_decode_plan(wrapper: Any, args: tuple, kwargs: dict[str, Any]) -> None:
    """Re-plan a CUDA-graph decode wrapper whose persistent buffers are already written."""
    try:
        from flashinfer.decode import fast_decode_plan
    except ImportError:  # older FlashInfer: the full plan (copies the buffers onto themselves)
        wrapper.plan(*args, pos_encoding_mode="NONE", **kwargs)
        return
    fast_decode_plan(wrapper, *args, pos_encoding_mode="NONE", global_override_indptr_cpu=args[0], **kwargs)


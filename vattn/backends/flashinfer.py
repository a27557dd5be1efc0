"""FLASHINFER: FlashInfer's paged prefill and decode kernels behind the vattn backend interface.

The only vattn module that imports ``flashinfer`` (lazily, inside functions). Written against
flashinfer-python 0.7.2.

* KV cache: logical shape ``(num_blocks, 2, block_size, Hk, D)``; ``[:, 0]`` keys, ``[:, 1]``
  values; physical layout NHD or HND (``vattn.backends.utils.get_kv_cache_layout``).
* One step: the builder splits the batch (decodes first) and ``plan``s a
  ``BatchDecodeWithPagedKVCacheWrapper`` (tensor-core decode) for the decodes and a
  ``BatchPrefillWithPagedKVCacheWrapper`` for the rest, once for all layers of the group; the
  impl stores the new K/V and ``run``s both into slices of the caller's output.
* CUDA graphs (``UNIFORM_SINGLE_TOKEN_DECODE``; the contract in ``vattn.cudagraph``): a
  pure-decode step whose padded token count is a capture size (or was captured) uses one decode
  wrapper per size built with ``use_cuda_graph=True`` over persistent indptr / indices /
  last-page-length / slot buffers shared by all sizes. A later step of that size writes only the
  host-side entries that changed (and the page indices) and re-plans without copies
  (``flashinfer.decode.fast_decode_plan``); the replayed graph reads the new plan.
* Every layer of a group must share window, soft cap and scale (FlashInfer plans them), fp8 KV
  caches use the layer's host scales, sinks and ALiBi are not supported (the Hopper kernels of
  0.7.2 ignore ``sinks``; use FLASH_ATTN or TRITON_ATTN for them).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from vattn import envs
from vattn.backends.abstract import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadata,
    AttentionType,
    is_fp8_kv_cache,
)
from vattn.backends.utils import (
    check_kv_cache_shape_args,
    paged_kv_stride_order,
    AttentionMetadataBuilder,
    AttentionSpec,
    CommonAttentionMetadata,
    get_kv_cache_layout,
    get_per_layer_parameters,
    infer_global_hyperparameters,
    split_decodes_and_prefills,
)
from vattn.config import CUDAGraphMode
from vattn.ops.kv_store import fp8_dtype_for, store_kv

if TYPE_CHECKING:
    from vattn.config import VattnConfig
    from vattn.layer import Attention

__all__ = [
    "FlashInferBackend",
    "FlashInferImpl",
    "FlashInferMetadata",
    "FlashInferMetadataBuilder",
    "gather_page_indices",
    "paged_kv_layout",
]

logger = logging.getLogger("vattn.backends.flashinfer")

#: Float workspace shared by every wrapper on a device (split-KV partial results).
WORKSPACE_BYTES = 256 * 1024 * 1024
#: Entries of the persistent CUDA-graph page-index buffer beyond 4 x num_blocks (64 MiB).
_MAX_GRAPH_INDEX_ENTRIES = 1 << 24
_FULL_GRAPH_MODES = (CUDAGraphMode.FULL, CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL_AND_PIECEWISE)
_workspaces: dict[torch.device, torch.Tensor] = {}


@functools.lru_cache(maxsize=1)
def _availability() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "FLASHINFER needs a CUDA GPU and none is visible"
    try:
        import flashinfer  # noqa: F401
    except Exception as e:  # ImportError, or a broken CUDA/JIT setup raising at import
        return False, f"flashinfer is not importable ({type(e).__name__}: {e}); pip install flashinfer-python"
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        return False, f"FLASHINFER needs compute capability >= 8.0, this GPU has {major}.{minor}"
    return True, ""


def _workspace(device: torch.device) -> torch.Tensor:
    """The float workspace of ``device`` (zero-initialised, as FlashInfer requires)."""
    buf = _workspaces.get(device)
    if buf is None:
        buf = _workspaces[device] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return buf


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


def gather_page_indices(block_table: torch.Tensor, indptr_cpu: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out[indptr[r]:indptr[r+1]] = block_table[r, :indptr[r+1] - indptr[r]]`` without a host sync.

    Args:
        block_table: (>= B, W) int32 on the device.
        indptr_cpu: (B+1,) int32 host tensor starting at 0.
        out: optional (indptr[-1],) int32 destination (e.g. a persistent CUDA-graph buffer).
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
    return out


class FlashInferBackend(AttentionBackend):
    """FlashInfer paged attention: fp16/bf16, head sizes 64/128/256, fp8 KV caches, NHD/HND."""

    accept_output_buffer: ClassVar[bool] = True
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16)
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = (
        "auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2",
    )
    supports_sink: ClassVar[bool] = False

    @staticmethod
    def get_name() -> str:
        return "FLASHINFER"

    @staticmethod
    def get_impl_cls() -> type["FlashInferImpl"]:
        return FlashInferImpl

    @staticmethod
    def get_metadata_cls() -> type["FlashInferMetadata"]:
        return FlashInferMetadata

    @staticmethod
    def get_builder_cls() -> type["FlashInferMetadataBuilder"]:
        return FlashInferMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, cache_dtype_str: str = "auto"
    ) -> tuple[int, ...]:
        """``(num_blocks, 2, block_size, num_kv_heads, head_size)``: FlashInfer's paged layout."""
        check_kv_cache_shape_args(num_blocks, block_size, num_kv_heads, head_size)
        return (num_blocks, 2, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_kv_cache_stride_order() -> tuple[int, ...]:
        """Identity for NHD; ``(0, 1, 3, 2, 4)`` for HND (heads before tokens in memory)."""
        return paged_kv_stride_order()

    @classmethod
    def get_supported_head_sizes(cls) -> tuple[int, ...]:
        return (64, 128, 256)

    @classmethod
    def get_supported_block_sizes(cls) -> tuple[int, ...]:
        return (1, 2, 4, 8, 16, 32, 64, 128)

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        return _availability()


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

    def __init__(
        self, kv_cache_spec: AttentionSpec, layer_names: list[str], vattn_config: "VattnConfig", device: torch.device
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vattn_config, device)
        params = infer_global_hyperparameters(get_per_layer_parameters(vattn_config, FlashInferImpl, layer_names))
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
        indices = gather_page_indices(cm.block_table_tensor[start:end], indptr)
        qo_indptr = (qsl[start : end + 1] - qsl[start]).to(torch.int32)
        if self._prefill_wrapper is None:
            self._prefill_wrapper = BatchPrefillWithPagedKVCacheWrapper(_workspace(self.device), self.kv_layout)
        self._prefill_wrapper.plan(
            qo_indptr, indptr, indices, last, self.num_qo_heads, self.num_kv_heads, self.head_dim,
            self.page_size, causal=cm.causal, o_data_type=self.q_dtype, **self._plan_kwargs(),
        )
        md.prefill_wrapper = self._prefill_wrapper
        md.prefill_start = int(qsl[start])
        md.prefill_rows = int(qo_indptr[-1])

    def _new_decode_wrapper(self, graph: _GraphBuffers | None = None, batch_size: int = 0) -> Any:
        from flashinfer import BatchDecodeWithPagedKVCacheWrapper

        tc = self.decode_tensor_cores
        if graph is None:
            return BatchDecodeWithPagedKVCacheWrapper(_workspace(self.device), self.kv_layout, use_tensor_cores=tc)
        return BatchDecodeWithPagedKVCacheWrapper(
            _workspace(self.device), self.kv_layout, use_cuda_graph=True, use_tensor_cores=tc,
            paged_kv_indptr_buffer=graph.indptr[: batch_size + 1],
            paged_kv_indices_buffer=graph.indices,
            paged_kv_last_page_len_buffer=graph.last_page_len[:batch_size],
        )

    def _decode_plan_args(self) -> tuple[int, int, int, int]:
        return (self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size)

    def _plan_decode(self, cm: CommonAttentionMetadata, rows: int, md: FlashInferMetadata) -> None:
        indptr, last = paged_kv_layout(cm.seq_lens_cpu[:rows].clamp(min=1), self.page_size)
        indices = gather_page_indices(cm.block_table_tensor, indptr)
        if self._decode_wrapper is None:
            self._decode_wrapper = self._new_decode_wrapper()
        self._decode_wrapper.plan(
            indptr, indices, last, *self._decode_plan_args(), pos_encoding_mode="NONE",
            o_data_type=self.q_dtype, **self._plan_kwargs(),
        )
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
        gather_page_indices(cm.block_table_tensor, indptr[: n + 1], out=g.indices[:real])
        if total > real:
            g.indices[real:total].zero_()
        wrapper = self._graph_wrappers.get(bs)
        args = (indptr, g.indices[:total], last, *self._decode_plan_args())
        if wrapper is None:
            wrapper = self._graph_wrappers[bs] = self._new_decode_wrapper(g, bs)
            wrapper.plan(*args, pos_encoding_mode="NONE", o_data_type=self.q_dtype, **self._plan_kwargs())
        else:
            _fast_decode_plan(wrapper, args, self._plan_kwargs())
        md.decode_wrapper, md.decode_rows, md.use_cuda_graph = wrapper, bs, True


def _fast_decode_plan(wrapper: Any, args: tuple, kwargs: dict[str, Any]) -> None:
    """Re-plan a CUDA-graph decode wrapper whose persistent buffers are already written."""
    try:
        from flashinfer.decode import fast_decode_plan
    except ImportError:  # older FlashInfer: the full plan (copies the buffers onto themselves)
        wrapper.plan(*args, pos_encoding_mode="NONE", **kwargs)
        return
    fast_decode_plan(wrapper, *args, pos_encoding_mode="NONE", global_override_indptr_cpu=args[0], **kwargs)


class FlashInferImpl(AttentionImpl[FlashInferMetadata]):
    """Stores new K/V, then runs the planned decode and prefill wrappers into ``output``."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        super().__init__(
            num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
            logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks,
        )
        unsupported = {
            "alibi_slopes": alibi_slopes is not None,
            "sinks": sinks is not None,
            f"attn_type={attn_type!r}": attn_type != AttentionType.DECODER,
        }
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise NotImplementedError(
                f"FLASHINFER does not support {', '.join(bad)} (only decoder self-attention without "
                "ALiBi or sinks); use TORCH_SDPA, TRITON_ATTN or FLASH_ATTN for this layer."
            )
        self._fp8_dtype = fp8_dtype_for(kv_cache_dtype)

    def forward(
        self,
        layer: "Attention",
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: FlashInferMetadata | None,
        output: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query (T, H, D), key/value (T, Hk, D), kv_cache (num_blocks, 2, block_size, Hk, D) -> output (T, H, D)."""
        if output is None:
            raise ValueError("FLASHINFER writes into a caller-allocated output (T, H, D); pass output=.")
        if output_scale is not None:
            raise NotImplementedError("FLASHINFER does not write quantized output; leave output_scale=None.")
        md = attn_metadata
        if md is None:
            return output
        if self.kv_sharing_target_layer_name is None and key is not None and value is not None:
            store_kv(key, value, kv_cache[:, 0], kv_cache[:, 1], md.slot_mapping, self.kv_cache_dtype,
                     layer._k_scale, layer._v_scale)
        if self._fp8_dtype is not None:
            if kv_cache.dtype != self._fp8_dtype:
                kv_cache = kv_cache.view(self._fp8_dtype)
            k_scale, v_scale = layer._k_scale_float, layer._v_scale_float
        else:
            k_scale = v_scale = None
        paged = kv_cache.permute(0, 1, 3, 2, 4) if md.kv_layout == "HND" else kv_cache
        if md.decode_wrapper is not None:
            n = md.decode_rows
            md.decode_wrapper.run(query[:n], paged, k_scale=k_scale, v_scale=v_scale, out=output[:n])
        if md.prefill_wrapper is not None:
            s, e = md.prefill_start, md.prefill_start + md.prefill_rows
            md.prefill_wrapper.run(query[s:e], paged, k_scale=k_scale, v_scale=v_scale, out=output[s:e])
        return output

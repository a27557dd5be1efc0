"""FLASHINFER_MLA: FlashInfer's MLA paged attention for decodes, its ragged prefill for prefills.

* Decodes: ``flashinfer.mla.BatchMLAPagedAttentionWrapper`` (``plan`` once per step in the
  builder, ``run`` per layer) over the latent cache viewed as its two parts, ``ckv_cache``
  ``(num_blocks, block_size, L)`` and ``kpe_cache`` ``(num_blocks, block_size, P)`` (strided
  views, no copy). Pure-decode steps of a captured size go through one CUDA-graph wrapper per
  batch size over persistent ``qo_indptr`` / ``kv_indptr`` / ``kv_indices`` / ``kv_len``
  buffers (``use_cuda_graph=True``): ``plan`` writes them in place, ``run`` only launches.
* Prefills: ``flashinfer.BatchPrefillWithRaggedKVCacheWrapper`` with ``head_dim_qk = N + P``
  and ``head_dim_vo = V``, one planned wrapper for the new tokens (causal) and one per
  context chunk; its log-sum-exp is base 2 (FlashInfer's convention) and is converted.

Kernel sizes: FlashInfer's MLA kernels take ``kv_lora_rank`` 512 and ``qk_rope_head_dim`` 64
(DeepSeek's), fp16 / bf16, no fp8 latent cache here.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import torch

from vattn.core.checks import library_availability
from vattn.core.metadata import CommonAttentionMetadata
from vattn.backends.flashinfer.paging import fenced_plan, gather_page_indices, paged_kv_layout, workspace
from vattn.backends.mla.common import (
    MLACommonBackend,
    MLACommonMetadataBuilder,
    MLADecodeMetadata,
    MLAPrefillMetadata,
)
from vattn.backends.mla.impl import MLACommonImpl

__all__ = ["FlashInferMLABackend", "FlashInferMLAImpl", "FlashInferMLAMetadataBuilder"]

_LN2 = math.log(2.0)
_LORA, _ROPE = 512, 64
# (q/k head size, v head size) of the up-projected prefill: DeepSeek's 192 / 128, or equal sizes.
_PREFILL_DIMS = frozenset({(192, 128), (64, 64), (128, 128), (256, 256)})


@functools.lru_cache(maxsize=1)
def _availability() -> tuple[bool, str]:
    return library_availability("FLASHINFER_MLA", "flashinfer.mla", "pip install flashinfer-python")


class FlashInferMLAMetadataBuilder(MLACommonMetadataBuilder):
    """Plans FlashInfer's MLA decode wrapper and its ragged prefill wrappers once per step."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        scales = {layer.impl.scale for layer in self.layers}
        heads = {layer.impl.num_heads for layer in self.layers}
        if len(scales) > 1 or len(heads) > 1:
            raise ValueError(f"FLASHINFER_MLA plans one softmax scale and head count per KV-cache group, but layers "
                             f"{self.layer_names} have scales {sorted(scales)} and heads {sorted(heads)}; give them "
                             "equal values or use TRITON_MLA.")
        self.sm_scale = scales.pop() if scales else (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        self._decode_wrapper: Any = None
        self._graph_wrappers: dict[int, Any] = {}
        self._graph_bufs: dict[str, torch.Tensor] | None = None
        self._prefill_wrappers: list[Any] = []

    # ---- decode -------------------------------------------------------------------------

    def _graph_buffers(self, width: int) -> dict[str, torch.Tensor]:
        """Persistent plan buffers of the CUDA-graph wrappers (all batch sizes share them); the
        page-index buffer holds ``max_graph_reqs`` block-table rows of ``width`` (the capture's)."""
        if self._graph_bufs is None:
            n, dev = self.max_graph_reqs, self.device
            cache = self.layers[0].kv_cache[0] if self.layers else None
            capacity = n * max(width, 1)
            if cache is not None and cache.dim() == 3:  # no batch can use more pages than the cache has
                capacity = min(capacity, cache.shape[0] + n)
            self._graph_bufs = {
                "qo_indptr": torch.zeros(n + 1, dtype=torch.int32, device=dev),
                "kv_indptr": torch.zeros(n + 1, dtype=torch.int32, device=dev),
                "kv_indices": torch.zeros(capacity, dtype=torch.int32, device=dev),
                "kv_len": torch.ones(n, dtype=torch.int32, device=dev),
            }
        return self._graph_bufs

    def _new_wrapper(self, bs: int | None, width: int = 1) -> Any:
        from flashinfer.mla import BatchMLAPagedAttentionWrapper

        if bs is None:
            return BatchMLAPagedAttentionWrapper(workspace(self.device))
        g = self._graph_buffers(width)
        return BatchMLAPagedAttentionWrapper(
            workspace(self.device), use_cuda_graph=True, qo_indptr=g["qo_indptr"][: bs + 1],
            kv_indptr=g["kv_indptr"][: bs + 1], kv_indices=g["kv_indices"], kv_len_arr=g["kv_len"][:bs])

    def _decode_extras(self, decode: MLADecodeMetadata, cm: CommonAttentionMetadata) -> None:
        nd = decode.num_decodes
        qsl = cm.query_start_loc_cpu[: nd + 1]
        qo_indptr = (qsl - qsl[0]).to(torch.int32)
        seq = cm.seq_lens_cpu[:nd].to(torch.int32)
        if decode.cuda_graph:
            seq = seq.clamp(min=1)  # padding requests: one token on block 0
        kv_indptr, _ = paged_kv_layout(seq, self.kv_cache_spec.block_size)
        indices = gather_page_indices(decode.block_table, kv_indptr)
        if decode.cuda_graph:
            wrapper = self._graph_wrappers.get(nd)
            if wrapper is None:
                wrapper = self._graph_wrappers[nd] = self._new_wrapper(nd, decode.block_table.shape[1])
            capacity = self._graph_bufs["kv_indices"].numel() if self._graph_bufs else 0
            if int(kv_indptr[-1]) > capacity:
                raise ValueError(f"FLASHINFER_MLA: this decode batch needs {int(kv_indptr[-1])} page entries but the "
                                 f"CUDA-graph index buffer holds {capacity}; capture with block tables as wide as "
                                 "the longest request will need (CUDAGraphRunner's max_model_len).")
        else:
            if self._decode_wrapper is None:
                self._decode_wrapper = self._new_wrapper(None)
            wrapper = self._decode_wrapper
        fenced_plan(wrapper, lambda: wrapper.plan(
            qo_indptr, kv_indptr, indices, seq, self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim,
            self.kv_cache_spec.block_size, True, self.sm_scale, self.model_dtype, self.kv_cache_spec.dtype))
        decode.plan = wrapper

    # ---- prefill ------------------------------------------------------------------------

    def _plan_ragged(self, index: int, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, causal: bool) -> Any:
        from flashinfer import BatchPrefillWithRaggedKVCacheWrapper

        while len(self._prefill_wrappers) <= index:
            self._prefill_wrappers.append(BatchPrefillWithRaggedKVCacheWrapper(workspace(self.device), "NHD"))
        wrapper = self._prefill_wrappers[index]
        fenced_plan(wrapper, lambda: wrapper.plan(
            qo_indptr, kv_indptr, self.num_heads, self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim,
            head_dim_vo=self.v_head_dim, causal=causal, sm_scale=self.sm_scale, q_data_type=self.model_dtype,
            kv_data_type=self.model_dtype))
        return wrapper

    def _prefill_extras(self, prefill: MLAPrefillMetadata, cm: CommonAttentionMetadata) -> None:
        q_indptr = prefill.query_start_loc_cpu
        prefill.plan = self._plan_ragged(0, q_indptr, q_indptr, True)
        for i, chunk in enumerate(prefill.chunks):
            chunk.plan = self._plan_ragged(i + 1, q_indptr, chunk.cu_seqlens_cpu, False)


class FlashInferMLAImpl(MLACommonImpl):
    """MLA through FlashInfer: ``run`` of the wrappers the builder planned (no host work here)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        reasons = FlashInferMLABackend.mla_dims_reasons(self.kv_lora_rank, self.qk_rope_head_dim,
                                                        self.qk_nope_head_dim, self.v_head_dim)
        if reasons:
            raise ValueError(f"FLASHINFER_MLA: {'; '.join(reasons)}; use TRITON_MLA.")

    def _forward_decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                        md: MLADecodeMetadata, layer: Any) -> torch.Tensor:
        lora = self.kv_lora_rank
        out = torch.empty(q_nope.shape, dtype=q_nope.dtype, device=q_nope.device)
        # The kernel takes the queries' token and head strides: the absorbed q_nope (a transposed
        # bmm output) and q_pe (a slice of the query) go in as views, without a copy each.
        q_nope, q_pe = (q if q.stride(-1) == 1 else q.contiguous() for q in (q_nope, q_pe))
        md.plan.run(q_nope, q_pe, kv_cache[..., :lora], kv_cache[..., lora:], out=out)
        return out

    def _prefill_attend(self, q: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor,
                        cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                        max_seqlen_k: int, causal: bool, plan: Any) -> tuple[torch.Tensor, torch.Tensor]:
        k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, self.num_heads, -1)], dim=-1)
        out, lse = plan.run(q.contiguous(), k, v.contiguous(), return_lse=True)
        return out, lse * _LN2  # FlashInfer's log-sum-exp is base 2


class FlashInferMLABackend(MLACommonBackend):
    """FlashInfer's MLA kernels: fp16/bf16, ``kv_lora_rank`` 512 / ``qk_rope_head_dim`` 64."""

    name = "FLASHINFER_MLA"
    impl_cls = FlashInferMLAImpl
    builder_cls = FlashInferMLAMetadataBuilder
    capabilities = dataclasses.replace(MLACommonBackend.capabilities,
        min_compute_capability=(8, 0), head_sizes=(_LORA + _ROPE,),
        notes={
            "head_sizes": "L 512 + P 64; prefill q/k + v head sizes 192 + 128, or equal 64, 128, 256"},
    )

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        return _availability()

    @classmethod
    def mla_dims_reasons(cls, kv_lora_rank: int, qk_rope_head_dim: int, qk_nope_head_dim: int,
                         v_head_dim: int) -> list[str]:
        reasons = []
        if (kv_lora_rank, qk_rope_head_dim) != (_LORA, _ROPE):
            reasons.append(f"kv_lora_rank / qk_rope_head_dim: expected {_LORA} / {_ROPE} (FlashInfer's MLA "
                           f"kernels), got {kv_lora_rank} / {qk_rope_head_dim}")
        dims = (qk_nope_head_dim + qk_rope_head_dim, v_head_dim)
        if dims not in _PREFILL_DIMS:
            reasons.append(f"(qk_nope_head_dim + qk_rope_head_dim, v_head_dim): expected one of "
                           f"{sorted(_PREFILL_DIMS)} (the q/k and v head sizes FlashInfer's ragged prefill "
                           f"kernels serve), got {dims}")
        return reasons

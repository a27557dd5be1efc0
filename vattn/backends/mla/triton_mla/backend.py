"""TRITON_MLA: vattn's own Triton kernels for MLA, behind the backend interface.

| feature | support |
| --- | --- |
| decode | absorbed, split-KV over the paged latent (``_mla_decode_kernel`` + ``_mla_combine_kernel``); on sm_90 with more than 16 heads of a 512 + 64 bf16 / fp16 latent, the warpgroup-MMA kernel (``wgmma``) |
| prefill | up-projected, ragged, causal over new tokens and chunked over cached context (``_mla_prefill_kernel``) |
| latent sizes | any ``kv_lora_rank`` / ``qk_rope_head_dim`` (computed padded to powers of two) |
| block sizes | any (the kernels read the block table per token) |
| dtypes | fp16, bf16, fp32 |
| latent cache | auto, bfloat16, float16, float32, fp8 / fp8_e4m3, fp8_e5m2 (one per-layer scale) |
| CUDA graphs | ``UNIFORM_SINGLE_TOKEN_DECODE``: persistent metadata, splits fixed per batch size |

The store of the new latent rows is ``vattn.ops.mla.store_latent`` (a Triton kernel on CUDA).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from vattn.core.metadata import CommonAttentionMetadata
from vattn.core.checks import triton_availability
from vattn.backends.mla.common import MLACommonBackend, MLACommonMetadataBuilder, MLADecodeMetadata
from vattn.backends.mla.impl import MLACommonImpl
from vattn.backends.mla.triton_mla.config import (
    MAX_SPLITS,
    SPLIT_SCRATCH_BYTES,
    DecodeTiles,
    decode_num_splits,
    decode_tiles,
    device_capability,
    device_smem_bytes,
    split_scratch_numel,
)
from vattn.backends.triton.config import device_num_sms
from vattn.core.config import CACHE_DTYPES

__all__ = ["TritonMLABackend", "TritonMLAImpl", "TritonMLAMetadataBuilder", "TritonMLADecodePlan"]


def _launcher() -> Any:
    """``vattn.backends.mla.triton_mla.launch`` (imports Triton), looked up in ``sys.modules`` on
    every call: tests reload it for the Triton interpreter."""
    import sys

    mod = sys.modules.get("vattn.backends.mla.triton_mla.launch")
    if mod is None:
        from vattn.backends.mla.triton_mla import launch as mod
    return mod


@dataclass(frozen=True)
class TritonMLADecodePlan:
    """The decode launch: its tiles and split count (from static sizes) and the builder's fp32 scratch."""

    tiles: DecodeTiles
    num_splits: int
    partial_out: torch.Tensor | None
    partial_lse: torch.Tensor | None


class TritonMLAMetadataBuilder(MLACommonMetadataBuilder):
    """``MLACommonMetadataBuilder`` plus the decode's split count and scratch (allocated once,
    sized for the largest capture, so CUDA graphs read fixed addresses)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.num_sms = device_num_sms(self.device)
        self.tiles = decode_tiles(self.num_heads, self.kv_lora_rank, device_smem_bytes(self.device),
                                  capability=device_capability(self.device))
        n_o, n_lse = split_scratch_numel(self.max_graph_reqs, self.num_heads, self.kv_lora_rank, MAX_SPLITS)
        shrink = max(1, -(-n_o // (SPLIT_SCRATCH_BYTES // 4)))  # both cut to the budget alike
        self.partial_out = torch.empty(n_o // shrink, dtype=torch.float32, device=self.device)
        self.partial_lse = torch.empty(n_lse // shrink, dtype=torch.float32, device=self.device)

    def _decode_extras(self, decode: MLADecodeMetadata, cm: CommonAttentionMetadata) -> None:
        """The split count of ``num_decode_tokens`` rows (a function of static sizes) that fits the scratch."""
        rows = decode.num_decode_tokens
        splits = decode_num_splits(max(rows, decode.num_decodes), self.num_heads, self.kv_lora_rank, self.num_sms,
                                   scratch_numel=self.partial_out.numel(), block_h=self.tiles.block_h,
                                   one_wave=self.tiles.wgmma)
        decode.plan = TritonMLADecodePlan(self.tiles, splits, self.partial_out, self.partial_lse)


class TritonMLAImpl(MLACommonImpl):
    """MLA through vattn's Triton kernels (``vattn.backends.mla.triton_mla.launch``)."""

    def _forward_decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                        md: MLADecodeMetadata, layer: Any) -> torch.Tensor:
        plan: TritonMLADecodePlan = md.plan
        out = torch.empty(q_nope.shape, dtype=q_nope.dtype, device=q_nope.device)
        _launcher().mla_decode(
            q_nope, q_pe, kv_cache, out, query_start_loc=md.query_start_loc, seq_lens=md.seq_lens,
            block_table=md.block_table, softmax_scale=self.scale, kv_lora_rank=self.kv_lora_rank,
            num_splits=plan.num_splits, kv_scale=layer._k_scale, partial_out=plan.partial_out,
            partial_lse=plan.partial_lse, tiles=plan.tiles)
        return out

    def _prefill_attend(self, q: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor,
                        cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                        max_seqlen_k: int, causal: bool, plan: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return _launcher().mla_prefill(q, k_nope, k_pe, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                       max_seqlen_q=max_seqlen_q, softmax_scale=self.scale, causal=causal)


class TritonMLABackend(MLACommonBackend):
    """vattn's Triton MLA: portable wherever Triton runs (GPU, or CPU under TRITON_INTERPRET=1)."""

    name = "TRITON_MLA"
    impl_cls = TritonMLAImpl
    builder_cls = TritonMLAMetadataBuilder
    capabilities = dataclasses.replace(MLACommonBackend.capabilities,
        dtypes=(torch.float16, torch.bfloat16, torch.float32), kv_cache_dtypes=CACHE_DTYPES,
        min_compute_capability=(8, 0),
        notes={
            "runs_on_cpu": "TRITON_INTERPRET=1 (tests)",
            "fp8_kv": "e4m3: 8.9+",
        },
    )

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        return triton_availability("TRITON_MLA")

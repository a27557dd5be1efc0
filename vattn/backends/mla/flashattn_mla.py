"""FLASH_ATTN_MLA: FlashAttention for MLA, where the installed interface serves its shapes.

| part | interface | call |
| --- | --- | --- |
| decode (absorbed) | FA3 (``flash_attn_interface``, sm_90) | ``flash_attn_with_kvcache(q_pe, kpe_cache, ckv_cache, qv=q_nope, page_table=..., cache_seqlens=..., cu_seqlens_q=...)``: scores ``q_pe . k_pe + q_nope . c``, values ``c`` |
| prefill (up-projected) | FA3 | ``flash_attn_varlen_func(q, k, v, ..., return_attn_probs=True)`` with ``head_dim_qk = N + P``, ``head_dim_v = V`` |
| prefill (up-projected) | FA2 (``flash_attn`` 2.x, sm_80+) | the same, ``v`` zero-padded to ``N + P`` (FA2 takes one head size) |

FA2 and flash-attn-4 have no ``qv`` (the absorbed decode's 576-wide heads exceed their head
sizes), so without FA3 on sm_90 this backend states that as its reason. The FA3 decode kernel
takes ``kv_lora_rank`` 512 and ``qk_rope_head_dim`` 64 (DeepSeek's). Every FlashAttention
log-sum-exp is a natural log (+inf for a row without keys, which the merge treats as empty).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from vattn.backends.mla.common import MLACommonBackend, MLACommonMetadataBuilder, MLADecodeMetadata
from vattn.backends.mla.impl import MLACommonImpl

__all__ = ["FlashAttnMLABackend", "FlashAttnMLAImpl", "MLAFlashAttnInterface", "get_mla_interface"]

_LORA, _ROPE = 512, 64


@dataclass(frozen=True)
class MLAFlashAttnInterface:
    """The FlashAttention entry points MLA uses: ``decode`` (FA3 ``flash_attn_with_kvcache`` with
    ``qv``) and ``prefill`` (a varlen function returning the log-sum-exp); ``pad_v``: pad v to
    the qk head size (FA2)."""

    name: str
    decode: Callable[..., Any] | None
    prefill: Callable[..., Any] | None
    pad_v: bool = False


def _fa3() -> MLAFlashAttnInterface:
    mod = importlib.import_module("flash_attn_interface")
    decode = mod.flash_attn_with_kvcache
    if "qv" not in inspect.signature(decode).parameters:
        decode = None
    return MLAFlashAttnInterface("fa3", decode, mod.flash_attn_varlen_func)


def _fa2() -> MLAFlashAttnInterface | None:
    mod = importlib.import_module("flash_attn")
    if not str(getattr(mod, "__version__", "")).startswith("2.") or not hasattr(mod, "flash_attn_varlen_func"):
        return None
    return MLAFlashAttnInterface("fa2", None, mod.flash_attn_varlen_func, pad_v=True)


@functools.lru_cache(maxsize=1)
def get_mla_interface() -> tuple[MLAFlashAttnInterface | None, str]:
    """The interface to use here and ``""``, or ``(None or a prefill-only interface, why it cannot serve)``."""
    if not torch.cuda.is_available():
        return None, "FLASH_ATTN_MLA needs a CUDA GPU and none is visible"
    major, minor = torch.cuda.get_device_capability()
    why: list[str] = []
    found: MLAFlashAttnInterface | None = None
    if major == 9:
        try:
            found = _fa3()
        except Exception as e:  # not installed, or fails to import
            why.append(f"FA3 (flash_attn_interface): {type(e).__name__}: {e}")
    else:
        why.append(f"FA3's MLA decode (qv) runs on sm_90 only, this GPU is {major}.{minor}")
    if found is None and major >= 8:
        try:
            found = _fa2()
        except Exception as e:
            why.append(f"FA2 (flash_attn 2.x): {type(e).__name__}: {e}")
    if found is not None and found.decode is not None:
        return found, ""
    if found is not None:
        why.append(f"{found.name} serves the up-projected prefill but not the absorbed decode: that needs "
                   "FA3's flash_attn_with_kvcache with qv (flash_attn_interface on sm_90); FA2 and flash-attn-4 "
                   "take no qv and at most 256-wide heads")
    return found, "FLASH_ATTN_MLA cannot run here: " + "; ".join(why) + "; use FLASHINFER_MLA or TRITON_MLA"


class FlashAttnMLAImpl(MLACommonImpl):
    """MLA through FlashAttention (no host work in ``forward``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if (self.kv_lora_rank, self.qk_rope_head_dim) != (_LORA, _ROPE):
            raise ValueError(f"FLASH_ATTN_MLA: kv_lora_rank / qk_rope_head_dim: expected {_LORA} / {_ROPE} (FA3's MLA "
                             f"decode), got {self.kv_lora_rank} / {self.qk_rope_head_dim}; use TRITON_MLA.")
        if max(self.qk_head_dim, self.v_head_dim) > 256:
            raise ValueError(f"FLASH_ATTN_MLA: qk / v head dims {self.qk_head_dim} / {self.v_head_dim}: expected at "
                             "most 256 (FlashAttention's prefill); use TRITON_MLA.")
        self._iface: MLAFlashAttnInterface | None = None

    def _interface(self) -> MLAFlashAttnInterface:
        if self._iface is None:
            iface, why = get_mla_interface()
            if iface is None or iface.decode is None:
                raise RuntimeError(why)
            self._iface = iface
        return self._iface

    def _forward_decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                        md: MLADecodeMetadata, layer: Any) -> torch.Tensor:
        lora = self.kv_lora_rank
        kpe = kv_cache[..., lora:].unsqueeze(2)  # (num_blocks, block_size, 1, P): the keys' RoPE part
        ckv = kv_cache[..., :lora].unsqueeze(2)  # (num_blocks, block_size, 1, L): the latent (values)
        res = self._interface().decode(
            q_pe.contiguous(), kpe, ckv, qv=q_nope.contiguous(), cache_seqlens=md.seq_lens,
            page_table=md.block_table, cu_seqlens_q=md.query_start_loc, max_seqlen_q=1,
            softmax_scale=self.scale, causal=True)
        out = res[0] if isinstance(res, tuple) else res
        return out.view(q_nope.shape)

    def _prefill_attend(self, q: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor,
                        cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                        max_seqlen_k: int, causal: bool, plan: Any) -> tuple[torch.Tensor, torch.Tensor]:
        iface = self._interface()
        k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, self.num_heads, -1)], dim=-1)
        vd = v.shape[-1]
        if iface.pad_v and vd != k.shape[-1]:
            v = F.pad(v, (0, k.shape[-1] - vd))
        res = iface.prefill(q.contiguous(), k, v.contiguous(), cu_seqlens_q, cu_seqlens_k, max(max_seqlen_q, 1),
                            max(max_seqlen_k, 1), softmax_scale=self.scale, causal=causal, return_attn_probs=True)
        out, lse = res[0], res[1]  # lse: (H, T)
        return out[..., :vd], lse.transpose(0, 1)


class FlashAttnMLABackend(MLACommonBackend):
    """FlashAttention MLA: FA3 on sm_90 (decode with ``qv``, prefill); fp16/bf16; L 512 + P 64."""

    name = "FLASH_ATTN_MLA"
    impl_cls = FlashAttnMLAImpl
    builder_cls = MLACommonMetadataBuilder
    capabilities = dataclasses.replace(MLACommonBackend.capabilities,
        min_compute_capability=(9, 0), head_sizes=(_LORA + _ROPE,),
        notes={
            "gpus": "FA3 only",
            "head_sizes": "L 512 + P 64",
        },
    )

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        iface, why = get_mla_interface()
        return (iface is not None and iface.decode is not None), why

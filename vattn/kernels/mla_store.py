"""Triton store of MLA's latent rows: ``cache[slot] = cat(kv_c, k_pe)`` for every new token.

An MLA cache holds one row per token, ``kv_lora_rank + qk_rope_head_dim`` wide (the
normalized compressed KV, then the RoPE key shared by all heads). ``slot = block_id *
block_size + offset``; negative slots are padding and write nothing. fp8 caches store
``clamp(x / scale, -max, max)`` rounded to nearest, with one scale for the whole row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vattn.kernels.fp8 import FP8_DTYPES, fp8_round_fix, to_cache_dtype
from vattn.kernels.launch import FastLaunch, next_power_of_2

__all__ = ["triton_store_latent"]


@triton.jit
def _store_latent_kernel(
    kv_c_ptr, k_pe_ptr, cache_ptr, slot_ptr, scale_ptr, num_slots,
    stride_ct, stride_cd, stride_pt, stride_pd,
    stride_cb, stride_cs, stride_cw,
    LORA: tl.constexpr, LORA_PAD: tl.constexpr, ROPE: tl.constexpr, ROPE_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr, FP8_ROUND_FIX: tl.constexpr,
):
    """One program per token: copies its ``kv_c`` and ``k_pe`` into one cache row. Slots outside
    ``[0, num_slots)`` are skipped: padding (< 0), or a hand-built slot mapping past the cache,
    which must not fault the GPU (``VATTN_DEBUG_CHECKS=1`` rejects it)."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if (slot < 0) | (slot >= num_slots):
        return
    row = cache_ptr + (slot // PAGE_SIZE) * stride_cb + (slot % PAGE_SIZE) * stride_cs
    ty = cache_ptr.dtype.element_ty
    offs_l = tl.arange(0, LORA_PAD)
    c = tl.load(kv_c_ptr + t * stride_ct + offs_l * stride_cd, mask=offs_l < LORA)
    tl.store(row + offs_l * stride_cw, to_cache_dtype(c, scale_ptr, ty, FP8, FP8_MAX, FP8_ROUND_FIX),
             mask=offs_l < LORA)
    offs_r = tl.arange(0, ROPE_PAD)
    p = tl.load(k_pe_ptr + t * stride_pt + offs_r * stride_pd, mask=offs_r < ROPE)
    tl.store(row + (LORA + offs_r) * stride_cw, to_cache_dtype(p, scale_ptr, ty, FP8, FP8_MAX, FP8_ROUND_FIX),
             mask=offs_r < ROPE)


_STORE_LATENT = FastLaunch(_store_latent_kernel)


def triton_store_latent(kv_c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                        scale: torch.Tensor) -> None:
    """Write latent rows into an MLA cache (no host sync).

    | tensor | shape | notes |
    | --- | --- | --- |
    | kv_c | (T, L) | any strides |
    | k_pe | (T, R) | any strides |
    | cache | (num_blocks, block_size, L + R) | fp16 / bf16 / fp32, or fp8 (stores ``x / scale``) |
    | slot_mapping | (T',) int64 (int32 accepted) | ``< 0`` or past the cache: skip the token; the first ``min(T, T')`` count |
    | scale | 0-dim float32 | read on the device, fp8 caches only |
    """
    num_tokens = min(kv_c.shape[0], slot_mapping.shape[0])
    if num_tokens == 0:
        return
    lora, rope = kv_c.shape[1], k_pe.shape[1]
    fp8 = cache.dtype in FP8_DTYPES
    _STORE_LATENT[(num_tokens,)](
        kv_c, k_pe, cache, slot_mapping, scale if fp8 else kv_c, cache.shape[0] * cache.shape[1],
        *kv_c.stride(), *k_pe.stride(), *cache.stride(),
        LORA=lora, LORA_PAD=next_power_of_2(lora), ROPE=rope, ROPE_PAD=next_power_of_2(rope),
        PAGE_SIZE=cache.shape[1], FP8=fp8, FP8_MAX=float(torch.finfo(cache.dtype).max) if fp8 else 0.0,
        FP8_ROUND_FIX=fp8_round_fix(cache.dtype, cache.device), num_warps=4 if lora >= 256 else 1,
    )

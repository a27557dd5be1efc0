"""Triton KV-cache store: write new K/V rows into the paged cache at ``slot_mapping``.

``slot = block_id * block_size + offset_in_block``; negative slots are padding (CUDA-graph
padded tokens) and write nothing. The cache views may have any strides (NHD or HND
physical layout). fp8 caches store ``clamp(x / scale, -max, max)`` rounded to nearest.
Given rotary rows, keys are stored rotated (``vattn.kernels.rotary``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vattn.kernels.fp8 import FP8_DTYPES, fp8_round_fix, to_cache_dtype
from vattn.kernels.launch import FastLaunch, next_power_of_2
from vattn.kernels.rotary import rotate_half_load

__all__ = ["triton_store_kv"]

_FP8_BY_NAME = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_FP8_MAX = {dt: float(torch.finfo(dt).max) for dt in FP8_DTYPES}


@triton.jit
def _store_kv_kernel(key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr, cos_ptr,
                     sin_ptr, num_slots, stride_rope, stride_kt, stride_kh, stride_kd, stride_vt, stride_vh,
                     stride_vd, stride_kcb, stride_kcs, stride_kch, stride_kcd, stride_vcb, stride_vcs, stride_vch,
                     stride_vcd, NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
                     BLOCK_H: tl.constexpr, PAGE_SIZE: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr,
                     FP8_ROUND_FIX: tl.constexpr, ROPE: tl.constexpr = False):
    """One program per (token, group of BLOCK_H heads): copies a (BLOCK_H, D) tile of K and V.
    Slots outside ``[0, num_slots)`` are skipped: padding (< 0), or a hand-built slot mapping
    past the cache, which must not fault the GPU (``VATTN_DEBUG_CHECKS=1`` rejects it).
    ``ROPE``: rotate K by row ``t`` of ``cos_ptr`` / ``sin_ptr`` (token stride ``stride_rope``)."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if (slot < 0) | (slot >= num_slots):
        return
    blk = slot // PAGE_SIZE
    off = slot % PAGE_SIZE
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_PAD)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_SIZE)[None, :]

    k_rows = key_ptr + t * stride_kt + offs_h[:, None] * stride_kh
    if ROPE:
        k = rotate_half_load(k_rows, stride_kd, offs_d[None, :], cos_ptr + t * stride_rope, sin_ptr + t * stride_rope,
                             mask, HEAD_SIZE, key_ptr.dtype.element_ty)
    else:
        k = tl.load(k_rows + offs_d[None, :] * stride_kd, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd,
                mask=mask)
    kc = (key_cache_ptr + blk * stride_kcb + off * stride_kcs
          + offs_h[:, None] * stride_kch + offs_d[None, :] * stride_kcd)
    vc = (value_cache_ptr + blk * stride_vcb + off * stride_vcs
          + offs_h[:, None] * stride_vch + offs_d[None, :] * stride_vcd)
    tl.store(kc, to_cache_dtype(k, k_scale_ptr, key_cache_ptr.dtype.element_ty, FP8, FP8_MAX, FP8_ROUND_FIX),
             mask=mask)
    tl.store(vc, to_cache_dtype(v, v_scale_ptr, value_cache_ptr.dtype.element_ty, FP8, FP8_MAX, FP8_ROUND_FIX),
             mask=mask)


_STORE_KV = FastLaunch(_store_kv_kernel)


def _cache_view(cache: torch.Tensor, kv_cache_dtype: str, name: str) -> torch.Tensor:
    fp8 = _FP8_BY_NAME.get(kv_cache_dtype)
    if fp8 is None:
        return cache
    if cache.dtype == torch.uint8:
        return cache.view(fp8)
    if cache.dtype != fp8:
        raise TypeError(f"{name} must be {fp8} (or uint8) for kv_cache_dtype={kv_cache_dtype!r}, "
                        f"got {cache.dtype}; allocate the cache with the backend's dtype.")
    return cache


def triton_store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, kv_cache_dtype: str, k_scale: torch.Tensor, v_scale: torch.Tensor,
                    rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Write ``key``/``value`` rows into the paged caches at ``slot_mapping`` (no host sync).

    | tensor | shape | notes |
    | --- | --- | --- |
    | key, value | (T, Hk, D) | any strides |
    | key_cache, value_cache | (num_blocks, block_size, Hk, D) | any strides (NHD / HND views) |
    | slot_mapping | (T',) int64 (int32 accepted) | ``< 0``: skip the token |

    Only the first ``min(T, T')`` rows are written.
    | k_scale, v_scale | 0-dim float32 | read on the device, used for fp8 caches only |

    ``kv_cache_dtype`` is the ``CacheConfig.cache_dtype`` string: ``"fp8"``/``"fp8_e4m3"``
    (float8_e4m3fn) and ``"fp8_e5m2"`` quantize ``x / scale`` with saturation; anything else
    stores ``x`` cast to the cache dtype. ``rope``: (T, D) cos / sin rows; keys are stored
    rotated by them (``vattn.ops.rotary.apply_rotary``), values as given.
    """
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape:
        raise ValueError(f"key_cache and value_cache must both be (num_blocks, block_size, Hk, D), got "
                         f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}.")
    _, page_size, num_kv_heads, head_size = key_cache.shape
    for name, t in (("key", key), ("value", value)):
        if t.dim() != 3 or t.shape[1:] != (num_kv_heads, head_size) or t.shape[0] != key.shape[0]:
            raise ValueError(f"{name} must be (T, {num_kv_heads}, {head_size}) to match the cache (and "
                             f"key and value the same T), got {tuple(t.shape)}.")
    num_tokens = min(key.shape[0], slot_mapping.shape[0])
    if num_tokens == 0:
        return
    key_cache = _cache_view(key_cache, kv_cache_dtype, "key_cache")
    value_cache = _cache_view(value_cache, kv_cache_dtype, "value_cache")
    fp8 = key_cache.dtype in FP8_DTYPES
    head_pad = next_power_of_2(head_size)
    block_h = max(1, min(next_power_of_2(num_kv_heads), 2048 // head_pad))
    grid = (num_tokens, -(-num_kv_heads // block_h))
    cos, sin = rope if rope is not None else (key, key)
    if rope is not None and (cos.stride(1) != 1 or sin.stride() != cos.stride()):
        cos, sin = cos.contiguous(), sin.contiguous()
    _STORE_KV[grid](
        key, value, key_cache, value_cache, slot_mapping,
        k_scale if fp8 else key, v_scale if fp8 else key, cos, sin, key_cache.shape[0] * page_size,
        cos.stride(0) if rope is not None else 0,
        *key.stride(), *value.stride(), *key_cache.stride(), *value_cache.stride(),
        NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size, HEAD_PAD=head_pad,
        BLOCK_H=block_h, PAGE_SIZE=page_size,
        FP8=fp8, FP8_MAX=_FP8_MAX[key_cache.dtype] if fp8 else 0.0,
        FP8_ROUND_FIX=fp8_round_fix(key_cache.dtype, key_cache.device), ROPE=rope is not None,
        num_warps=4 if block_h * head_pad >= 1024 else 1,
    )

"""Writing new K/V into the paged cache: ``store_kv``, which every backend calls, and the
``vattn::reshape_and_cache_flash`` op around it.

On CUDA it launches the Triton KV-store kernel (``vattn.kernels.kv_store``: no host sync,
negative slots skipped in the kernel); elsewhere it uses torch indexing.
"""

from __future__ import annotations

import torch

from vattn.ops.library import register_op

__all__ = ["fp8_dtype_for", "kv_cache_torch_dtype", "reshape_and_cache_flash", "store_kv"]

_FP8 = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
_PLAIN = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def fp8_dtype_for(kv_cache_dtype: str) -> torch.dtype | None:
    """The fp8 torch dtype stored for a ``cache_dtype`` string, or None for non-fp8 caches."""
    return _FP8.get(kv_cache_dtype)


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype a cache of ``kv_cache_dtype`` ("auto" = model dtype) stores."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in _FP8:
        return _FP8[kv_cache_dtype]
    if kv_cache_dtype in _PLAIN:
        return _PLAIN[kv_cache_dtype]
    raise ValueError(
        f"kv_cache_dtype must be one of {['auto', *_PLAIN, *_FP8]}, got {kv_cache_dtype!r}."
    )


def quantize_to_cache(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Saturating fp8 quantization ``x / scale`` (plain torch ops)."""
    finfo = torch.finfo(dtype)
    return (x.float() / scale.float()).clamp(finfo.min, finfo.max).to(dtype)


def _torch_store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    n = min(key.shape[0], slot_mapping.shape[0])
    slots = slot_mapping[:n].long()
    k, v = key[:n], value[:n]
    valid = slots >= 0  # boolean indexing: syncs on CUDA, fine on CPU
    if not bool(valid.all()):
        slots, k, v = slots[valid], k[valid], v[valid]
    if key_cache.dtype != k.dtype and key_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        k = quantize_to_cache(k, k_scale, key_cache.dtype)
        v = quantize_to_cache(v, v_scale, value_cache.dtype)
    with torch.no_grad():  # the cache never carries autograd history
        for cache, x in ((key_cache, k), (value_cache, v)):
            if cache.stride(0) == cache.shape[1] * cache.stride(1) and cache.element_size() > 1:
                # NHD: slots are rows of a flat view (index_copy_ has no fp8 kernel on CPU)
                cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, x.to(cache.dtype))
            else:
                cache[slots // cache.shape[1], slots % cache.shape[1]] = x.to(cache.dtype)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    """Write ``key``/``value`` rows into the paged cache at ``slot_mapping``.

    | tensor | shape |
    | --- | --- |
    | key, value | (T, Hk, D) |
    | key_cache, value_cache | (num_blocks, block_size, Hk, D), any strides (NHD or HND) |
    | slot_mapping | (>= T,) int; slot = block * block_size + offset; < 0 skips the row |
    | k_scale, v_scale | 0-dim float32; fp8 caches store ``x / scale`` |

    Only the first ``min(T, len(slot_mapping))`` rows are considered.
    """
    if key_cache.is_cuda:
        from vattn.kernels.kv_store import triton_store_kv

        triton_store_kv(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)
        return
    _torch_store_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


# ---- KV-cache write -------------------------------------------------------------------


def reshape_and_cache_flash(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    """Write key/value (T, Hk, D) into key_cache/value_cache (num_blocks, block_size, Hk, D) at slot_mapping."""
    store_kv(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)


def _reshape_and_cache_flash_fake(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    return None


register_op(
    "reshape_and_cache_flash",
    reshape_and_cache_flash,
    mutates_args=["key_cache", "value_cache"],
    fake_impl=_reshape_and_cache_flash_fake,
)

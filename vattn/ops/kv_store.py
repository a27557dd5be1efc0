"""Writing new K/V into the paged cache: ``store_kv``, which every backend calls, and the
``vattn::reshape_and_cache_flash`` op around it.

On CUDA it launches the Triton KV-store kernel (``vattn.kernels.kv_store``: no host sync,
negative slots skipped in the kernel); elsewhere it uses torch indexing.
"""

from __future__ import annotations

from typing import Any

import torch

from vattn.ops.library import register_op

__all__ = ["fp8_dtype_for", "kv_cache_torch_dtype", "layer_scales", "reshape_and_cache_flash", "store_kv", "store_rows", "valid_slots"]

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


def valid_slots(slot_mapping: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(slots, rows): the int64 slots of the first ``num_rows`` entries of ``slot_mapping`` that
    are >= 0, and the row of each (None when every one of them is valid: rows 0..len(slots)).
    Boolean indexing: a host sync on CUDA, free on the CPU (where ``store_rows`` serves)."""
    slots = slot_mapping[:num_rows].long()
    valid = slots >= 0
    if bool(valid.all()):
        return slots, None
    return slots[valid], valid.nonzero().squeeze(1)


def store_rows(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               slots: torch.Tensor, rows: torch.Tensor | None, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    """The torch write of ``store_kv``, for slots already filtered (``valid_slots``): rows
    ``rows`` of key/value (T, Hk, D) (None: the first ``len(slots)``) go to ``slots`` (int64,
    all >= 0). TORCH_SDPA's metadata computes (slots, rows) once per step on the CPU."""
    if rows is None:
        k, v = key[: slots.shape[0]], value[: slots.shape[0]]
    else:
        k, v = key[rows], value[rows]
    if key_cache.dtype != k.dtype and key_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        k = quantize_to_cache(k, k_scale, key_cache.dtype)
        v = quantize_to_cache(v, v_scale, value_cache.dtype)
    if torch.is_grad_enabled():
        with torch.no_grad():  # the cache never carries autograd history
            _write(key_cache, value_cache, k, v, slots)
    else:
        _write(key_cache, value_cache, k, v, slots)


def _write(key_cache: torch.Tensor, value_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           slots: torch.Tensor) -> None:
    for cache, x in ((key_cache, k), (value_cache, v)):
        if x.dtype != cache.dtype:
            x = x.to(cache.dtype)
        if cache.stride(0) == cache.shape[1] * cache.stride(1) and cache.element_size() > 1:
            # NHD: slots are rows of a flat view (index_copy_ has no fp8 kernel on CPU)
            cache.view(-1, cache.shape[2], cache.shape[3]).index_copy_(0, slots, x)
        else:
            cache[slots // cache.shape[1], slots % cache.shape[1]] = x


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor, kv_cache_dtype: str, k_scale: torch.Tensor, v_scale: torch.Tensor,
             rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Write ``key``/``value`` rows into the paged cache at ``slot_mapping``.

    | tensor | shape |
    | --- | --- |
    | key, value | (T, Hk, D) |
    | key_cache, value_cache | (num_blocks, block_size, Hk, D), any strides (NHD or HND) |
    | slot_mapping | (>= T,) int; slot = block * block_size + offset; < 0 skips the row |
    | k_scale, v_scale | 0-dim float32; fp8 caches store ``x / scale`` |
    | rope | optional (cos, sin), each (>= T, D): keys are stored rotated (``vattn.ops.rotary``) |

    Only the first ``min(T, len(slot_mapping))`` rows are considered.
    """
    if key_cache.is_cuda:
        from vattn.kernels.kv_store import triton_store_kv

        triton_store_kv(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale, rope)
        return
    if rope is not None:
        from vattn.ops.rotary import apply_rotary

        key = apply_rotary(key, *rope)
    slots, rows = valid_slots(slot_mapping, min(key.shape[0], slot_mapping.shape[0]))
    store_rows(key, value, key_cache, value_cache, slots, rows, k_scale, v_scale)


# ---- KV-cache write -------------------------------------------------------------------


def reshape_and_cache_flash(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, slot_mapping: torch.Tensor, kv_cache_dtype: str,
                            k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    """Write key/value (T, Hk, D) into key_cache/value_cache (num_blocks, block_size, Hk, D) at slot_mapping."""
    store_kv(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)


def _reshape_and_cache_flash_fake(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                                  value_cache: torch.Tensor, slot_mapping: torch.Tensor, kv_cache_dtype: str,
                                  k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    return None


register_op(
    "reshape_and_cache_flash",
    reshape_and_cache_flash,
    mutates_args=["key_cache", "value_cache"],
    fake_impl=_reshape_and_cache_flash_fake,
)


def layer_scales(layer: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's fp8 scale tensors ``(_k_scale, _v_scale, _q_scale)``, each a 0-d float32.

    ``vattn.Attention`` keeps them as buffers, which attribute access finds only through
    ``nn.Module.__getattr__``, a Python fallback; impls read them on every eager call, so they
    come from the module's ``_buffers`` here (other layer objects: by attribute)."""
    buffers = layer.__dict__.get("_buffers")
    if buffers is not None and "_q_scale" in buffers:
        return buffers["_k_scale"], buffers["_v_scale"], buffers["_q_scale"]
    return layer._k_scale, layer._v_scale, layer._q_scale

"""The paged KV cache's physical layout (NHD or HND) and the standard cache shape's checks."""

from __future__ import annotations

from vattn import envs

__all__ = ["KV_CACHE_LAYOUTS", "check_kv_cache_shape_args", "get_kv_cache_layout", "paged_kv_stride_order",
           "set_kv_cache_layout"]

KV_CACHE_LAYOUTS = ("NHD", "HND")


class _LayoutOverride:
    layout: str | None = None


def _check_layout(value: str, source: str) -> str:
    layout = value.strip().upper() if isinstance(value, str) else value
    if layout not in KV_CACHE_LAYOUTS:
        raise ValueError(
            f"{source} must be one of {KV_CACHE_LAYOUTS} (NHD: blocks x tokens x heads x dim; "
            f"HND: blocks x heads x tokens x dim), got {value!r}."
        )
    return layout


def get_kv_cache_layout() -> str:
    """The paged KV cache's physical layout, ``"NHD"`` (default) or ``"HND"``.

    ``set_kv_cache_layout`` wins over the ``VATTN_KV_CACHE_LAYOUT`` environment variable.
    """
    if _LayoutOverride.layout is not None:
        return _LayoutOverride.layout
    env = envs.VATTN_KV_CACHE_LAYOUT
    if env is not None:
        return _check_layout(env, "VATTN_KV_CACHE_LAYOUT")
    return "NHD"


def set_kv_cache_layout(cache_layout: str | None) -> None:
    """Override the KV-cache layout (``"NHD"``/``"HND"``); ``None`` removes the override."""
    _LayoutOverride.layout = None if cache_layout is None else _check_layout(cache_layout, "cache_layout")


def check_kv_cache_shape_args(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> None:
    """Shared argument check of every backend's ``get_kv_cache_shape``."""
    for name, v in (("num_blocks", num_blocks), ("block_size", block_size),
                    ("num_kv_heads", num_kv_heads), ("head_size", head_size)):
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"get_kv_cache_shape: {name} must be a positive int, got {v!r}.")


def paged_kv_stride_order() -> tuple[int, int, int, int, int]:
    """Stride order of a 5-D paged cache whose dims 2, 3 are (block_size, num_kv_heads).

    Identity for ``NHD``; ``(0, 1, 3, 2, 4)`` (heads before tokens in memory) for ``HND``.
    """
    return (0, 1, 3, 2, 4) if get_kv_cache_layout() == "HND" else (0, 1, 2, 3, 4)

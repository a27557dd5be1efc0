"""Static fp8 quantization in plain torch ops (so Inductor can fuse it into the producer of q)."""

from __future__ import annotations

import enum

import torch
from torch import nn

__all__ = ["GroupShape", "QuantFP8"]


class GroupShape(enum.Enum):
    """Granularity of a static quantization scale."""

    PER_TENSOR = "per_tensor"
    PER_HEAD = "per_head"


class QuantFP8(nn.Module):
    """Static fp8 quantization: ``q = saturate(x / scale).to(fp8)``.

    Args:
        static: only static (precomputed) scales are supported.
        group_shape: ``PER_TENSOR`` (scale is 0-dim) or ``PER_HEAD`` (scale is (H,), x is (T, H*D)).
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.

    ``forward(x, scale) -> (x_fp8, scale)``, x: (T, H*D) or (T, H, D).
    """

    def __init__(
        self,
        static: bool = True,
        group_shape: GroupShape = GroupShape.PER_TENSOR,
        dtype: torch.dtype = torch.float8_e4m3fn,
        num_heads: int | None = None,
    ) -> None:
        super().__init__()
        if not static:
            raise NotImplementedError("QuantFP8(static=False): dynamic scales are not supported; pass static=True.")
        if dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"QuantFP8 dtype must be float8_e4m3fn or float8_e5m2, got {dtype}.")
        if group_shape is GroupShape.PER_HEAD and not num_heads:
            raise ValueError("QuantFP8(group_shape=PER_HEAD) needs num_heads.")
        self.group_shape = group_shape
        self.dtype = dtype
        self.num_heads = num_heads
        finfo = torch.finfo(dtype)
        self.fp8_min, self.fp8_max = finfo.min, finfo.max

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.group_shape is GroupShape.PER_HEAD:
            shape = x.shape
            xh = x.reshape(shape[0], self.num_heads, -1)
            q = (xh.float() / scale.float().view(1, -1, 1)).clamp(self.fp8_min, self.fp8_max)
            return q.to(self.dtype).reshape(shape), scale
        q = (x.float() / scale.float()).clamp(self.fp8_min, self.fp8_max)
        return q.to(self.dtype), scale

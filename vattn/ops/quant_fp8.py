"""Static fp8 quantization: plain torch ops (fusable by Inductor) and an opaque custom op.

``q = saturate(x / scale).to(fp8)``, with ``scale`` per tensor (0-dim) or per head ((H,),
``x`` (T, H*D) or (T, H, D)), for ``float8_e4m3fn`` and ``float8_e5m2``. Two implementations,
bitwise identical on the same device:

* ``quantize_fp8_native`` (``QuantFP8(use_custom_op=False)``): plain torch ops. Traced by
  ``torch.compile`` they become ``convert -> div -> clamp -> convert`` nodes that Inductor
  fuses into the kernel producing ``x`` (RoPE, the QKV split).
* ``torch.ops.vattn.static_scaled_fp8_quant(out!, x, scale)`` (``QuantFP8(use_custom_op=True)``,
  the default): one Triton kernel on CUDA (``vattn.kernels.quant_fp8``), the torch
  ops elsewhere. Opaque to Inductor: under ``vattn.compile`` the ``query_quant_fusion`` pass
  rewrites it back into plain ops (or folds it into the attention op), so the compiled graph
  keeps no standalone quant kernel.

Division is IEEE (correctly rounded) in both, the clamp propagates NaN, the final cast
rounds to nearest even.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import nn

from vattn.ops.library import register_op

__all__ = ["FP8_DTYPES", "GroupShape", "QuantFP8", "QuantKey", "quantize_fp8_native", "static_scaled_fp8_quant"]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class GroupShape(enum.Enum):
    """Granularity of a static quantization scale."""

    PER_TENSOR = "per_tensor"
    PER_HEAD = "per_head"


@dataclass(frozen=True)
class QuantKey:
    """What a quantization produces: fp8 dtype, static scales, scale granularity.

    Passed to ``AttentionImpl.fused_output_quant_supported(quant_key)`` by the
    attention + output-quant fusion pass.
    """

    dtype: torch.dtype
    static: bool = True
    group_shape: GroupShape = GroupShape.PER_TENSOR


def _check_fp8(dtype: torch.dtype, what: str) -> None:
    if dtype not in FP8_DTYPES:
        raise ValueError(f"{what} must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}.")


def quantize_fp8_native(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``saturate(x / scale).to(dtype)`` in plain torch ops; returns a new tensor of ``x``'s shape.

    | tensor | shape |
    | --- | --- |
    | x | (T, ...) any float dtype |
    | scale | 0-dim / (1,) (per tensor) or (G,) (per group: ``x[t]`` flattened splits into G equal groups, e.g. heads) |
    """
    finfo = torch.finfo(dtype)
    xf = x.float()
    if scale.numel() == 1:
        y = xf / scale.float()
    else:
        g = scale.numel()
        y = (xf.reshape(x.shape[0], g, -1) / scale.float().view(1, g, 1)).reshape(x.shape)
    return y.clamp(finfo.min, finfo.max).to(dtype)


# ---- the opaque op ---------------------------------------------------------------------


def _check_op_args(out: torch.Tensor, x: torch.Tensor, scale: torch.Tensor) -> None:
    _check_fp8(out.dtype, "static_scaled_fp8_quant: out.dtype")
    if out.shape != x.shape:
        raise ValueError(
            f"static_scaled_fp8_quant: out must have x's shape {tuple(x.shape)}, got {tuple(out.shape)}; "
            "allocate it with torch.empty(x.shape, dtype=<fp8>, device=x.device)."
        )
    n = scale.numel()
    per_row = x[0].numel() if x.dim() > 0 and x.shape[0] > 0 else 0
    if n != 1 and (x.dim() < 2 or per_row % n):
        raise ValueError(
            f"static_scaled_fp8_quant: scale must have 1 element (per tensor) or G elements dividing "
            f"each row of x (per head); got scale {tuple(scale.shape)} for x {tuple(x.shape)}."
        )


def static_scaled_fp8_quant(out: torch.Tensor, x: torch.Tensor, scale: torch.Tensor) -> None:
    """Write ``saturate(x / scale)`` into the fp8 tensor ``out`` (same shape as ``x``).

    ``scale``: float32, 0-dim / (1,) per tensor, or (G,) per group of each row (heads).
    The Triton kernel on CUDA, ``quantize_fp8_native`` elsewhere (bitwise identical).
    """
    _check_op_args(out, x, scale)
    if x.is_cuda:
        from vattn.kernels.quant_fp8 import triton_static_fp8_quant

        triton_static_fp8_quant(out, x, scale)
        return
    out.copy_(quantize_fp8_native(x, scale, out.dtype))


def _static_scaled_fp8_quant_fake(out: torch.Tensor, x: torch.Tensor, scale: torch.Tensor) -> None:
    return None


register_op(
    "static_scaled_fp8_quant",
    static_scaled_fp8_quant,
    mutates_args=["out"],
    fake_impl=_static_scaled_fp8_quant_fake,
)


# ---- the module ------------------------------------------------------------------------


class QuantFP8(nn.Module):
    """Static fp8 quantization: ``q = saturate(x / scale).to(fp8)``.

    Args:
        static: only static (precomputed) scales are supported.
        group_shape: ``PER_TENSOR`` (scale is 0-dim) or ``PER_HEAD`` (scale is (H,), x is (T, H*D)).
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        num_heads: H, required for ``PER_HEAD``.
        use_custom_op: True (default): the opaque ``vattn::static_scaled_fp8_quant`` op (one
            kernel in eager; the ``query_quant_fusion`` pass makes it fusable under
            ``vattn.compile``); False: plain torch ops (``quantize_fp8_native``).

    ``forward(x, scale) -> (x_fp8, scale)``, x: (T, H*D) or (T, H, D); ``x_fp8`` is contiguous.
    """

    def __init__(
        self,
        static: bool = True,
        group_shape: GroupShape = GroupShape.PER_TENSOR,
        dtype: torch.dtype = torch.float8_e4m3fn,
        num_heads: int | None = None,
        *,
        use_custom_op: bool = True,
    ) -> None:
        super().__init__()
        if not static:
            raise NotImplementedError("QuantFP8(static=False): dynamic scales are not supported; pass static=True.")
        _check_fp8(dtype, "QuantFP8 dtype")
        if group_shape is GroupShape.PER_HEAD and not num_heads:
            raise ValueError("QuantFP8(group_shape=PER_HEAD) needs num_heads (the number of scales).")
        self.group_shape = group_shape
        self.dtype = dtype
        self.num_heads = num_heads
        self.use_custom_op = use_custom_op
        finfo = torch.finfo(dtype)
        self.fp8_min, self.fp8_max = finfo.min, finfo.max

    @property
    def quant_key(self) -> QuantKey:
        return QuantKey(self.dtype, True, self.group_shape)

    def _check_scale(self, scale: torch.Tensor) -> None:
        want = 1 if self.group_shape is GroupShape.PER_TENSOR else self.num_heads
        if scale.numel() != want:
            raise ValueError(
                f"QuantFP8({self.group_shape.name}): scale must have {want} element(s), got shape "
                f"{tuple(scale.shape)}; pass the layer's 0-dim scale (per tensor) or (num_heads,) scales."
            )

    def forward_native(self, x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Plain torch ops (what Inductor fuses)."""
        self._check_scale(scale)
        return quantize_fp8_native(x, scale, self.dtype), scale

    def forward_custom(self, x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The opaque ``vattn::static_scaled_fp8_quant`` op."""
        self._check_scale(scale)
        out = torch.empty(x.shape, dtype=self.dtype, device=x.device)
        torch.ops.vattn.static_scaled_fp8_quant(out, x, scale)
        return out, scale

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.use_custom_op:
            return self.forward_custom(x, scale)
        return self.forward_native(x, scale)

    def extra_repr(self) -> str:
        return f"dtype={self.dtype}, group_shape={self.group_shape.name}, use_custom_op={self.use_custom_op}"

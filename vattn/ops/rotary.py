"""Rotary position embedding in torch: the reference of the kernels' fused rotation, and the
path of backends that do not rotate q and k in their own kernels.

``apply_rotary`` computes ``x * cos + rotate_half(x) * sin`` (rotate-half / NeoX form, as
transformers' ``apply_rotary_pos_emb``) in fp32 and rounds once to ``x``'s dtype, as Inductor
computes the expression: a layer gets the same q and k whether the rotation was compiled into
the model or handed to the attention op (``vattn.compile_passes.rope_fusion``).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["apply_rotary", "check_rope", "rope_args"]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """(T, H, D) ``x`` rotated by (T, D) ``cos`` / ``sin`` rows; returns (T, H, D) in ``x.dtype``."""
    half = x.shape[-1] // 2
    xf = x.float()
    rot = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    out = xf * cos[: x.shape[0], None, :].float() + rot * sin[: x.shape[0], None, :].float()
    return out.to(x.dtype)


def check_rope(cos: torch.Tensor | None, sin: torch.Tensor | None, query: torch.Tensor, head_size: int,
               where: str) -> None:
    """The rotary rows a layer gets (``rope_cos`` / ``rope_sin``): both or neither, (>= T, D) on the
    query's device, D = ``head_size`` and even. Raises ``ValueError`` naming ``where``."""
    if cos is None and sin is None:
        return
    if cos is None or sin is None:
        raise ValueError(f"{where}: rope_cos and rope_sin come together; got only "
                         f"{'rope_cos' if cos is not None else 'rope_sin'}. Pass both (T, head_size) rows, or neither.")
    t = query.shape[0]
    for name, x in (("rope_cos", cos), ("rope_sin", sin)):
        if (x.dim() != 2 or x.shape[0] < t or x.shape[1] != head_size or head_size % 2
                or x.device != query.device or not x.dtype.is_floating_point):
            raise ValueError(
                f"{where}: {name} must be (T >= {t}, head_size = {head_size}) floating rows on {query.device} "
                f"(rotate-half RoPE over the whole, even head dim), got {tuple(x.shape)} {x.dtype} on {x.device}; "
                "pass the cos / sin of each token's position, as transformers' rotary embedding returns them.")


def rope_args(layer: Any, query: torch.Tensor, key: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor] | None
              ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, Any]]:
    """What ``vattn.Attention.forward(q, k, v, rope=(cos, sin))`` hands the attention op: (q, key,
    keyword arguments). The op takes the rows (``rope_cos`` / ``rope_sin``) and its backend rotates
    q and key, in its kernels where it can (``AttentionImpl.fuses_rope``); a layer that quantizes
    its query (fp8) rotates q and key here, before quantizing, and passes no rows."""
    if rope is None:
        return query, key, {}
    if getattr(layer, "query_quant", None) is None:
        return query, key, {"rope_cos": rope[0], "rope_sin": rope[1]}
    q = query.view(query.shape[0], layer.num_heads, layer.head_size)
    check_rope(*rope, q, layer.head_size, layer.layer_name)
    k = None if key is None else key.view(key.shape[0], layer.num_kv_heads, layer.head_size)
    return apply_rotary(q, *rope), None if k is None else apply_rotary(k, *rope), {}

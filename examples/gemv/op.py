"""``torch.ops.vattn_examples.gemv``: a decoder layer's projection for one token, as one op.

The 1-token rewrite (``examples.gemv.rewrite``) puts this op in place of a model's bias-free
``F.linear`` calls. One bf16/fp16 row on CUDA runs the Triton GEMV (``examples.gemv.kernel``,
with programmatic dependent launch on sm_90+); anything else runs the same steps in torch, so
the rewrite never changes what a graph computes.
"""

from __future__ import annotations

import torch
from torch.library import Library, infer_schema

from vattn.kernels.launch import pdl_supported

__all__ = ["gemv", "gemv_group"]


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    silu_mul: bool,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    rope_cos: torch.Tensor | None = None,
    rope_sin: torch.Tensor | None = None,
    rope_cols: int = 0,
    rope_unsigned_sin: bool = False,
    up: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ weight.T`` (x (..., K), weight (N, K) -> (..., N)), with the input and output
    transforms of a decoder layer's projections:

    * ``silu_mul``: x is (T, 2K) ``[gate | up]`` and enters as ``silu(gate) * up``; or, with
      ``up`` (T, K) given, x is the gate (T, K) (separate gate and up projections);
    * ``norm_weight`` (K,): x enters RMSNorm'd, ``norm_weight * (x.float() *
      rsqrt(mean(x.float()**2, -1) + eps)).to(x.dtype)`` (the example model's and
      ``transformers``' RMSNorm);
    * ``residual``: the result is ``x @ weight.T + residual`` (the projection in x's dtype,
      then the add);
    * ``rope_cos`` / ``rope_sin`` (broadcastable to (T, rope_cols // D, D), D their last
      dim), ``rope_cols``: the first ``rope_cols`` outputs, viewed as heads of D, leave
      rotated by neox-style RoPE, ``y * cos + y.roll(D // 2, -1) * sin`` (``sin`` signed as
      rotate-half needs it: its first half ``-sin``); the rest as projected. Not with ``residual``.
      ``rope_unsigned_sin``: ``sin`` is the plain table ``transformers``' ``rotate_half`` takes,
      ``y * cos + cat(-y2, y1) * sin`` (the same rotation).

    One bf16/fp16 row on CUDA (x (1, K), or (1, 1, K) as ``transformers`` models carry their
    batch dim) runs ``examples.gemv.kernel.launch_gemv`` (with programmatic dependent launch on
    sm_90+); anything else the same steps in torch.
    """
    n, k = weight.shape
    dt = x.dtype
    rope = rope_cos is not None
    if rope and (rope_sin is None or residual is not None or not 0 < rope_cols <= n
                 or rope_cols % rope_cos.shape[-1] or n % rope_cos.shape[-1] or rope_cos.shape[-1] % 2):
        raise ValueError(
            f"vattn_examples::gemv: RoPE needs rope_cos and rope_sin of one even head size D, 0 < rope_cols <= N with "
            f"rope_cols and N multiples of D, and no residual; got rope_sin {'None' if rope_sin is None else 'set'}, "
            f"D={rope_cos.shape[-1]}, rope_cols={rope_cols}, N={n}, residual {'set' if residual is not None else 'None'}.")
    lead = x.shape[:-1]
    if up is not None and (not silu_mul or up.shape != x.shape or up.dtype != dt):
        raise ValueError(f"vattn_examples::gemv: up (the SwiGLU up projection) needs silu_mul and x's shape and "
                         f"dtype; got silu_mul={silu_mul}, x {tuple(x.shape)} {dt}, up {tuple(up.shape)} {up.dtype}.")
    if (x.is_cuda and x.dim() >= 2 and x.numel() == x.shape[-1] and dt in (torch.float16, torch.bfloat16)
            and (up is None or up.stride(-1) == 1)
            and weight.dtype == dt and weight.stride(1) == 1 and x.stride(-1) == 1
            and (residual is None or (residual.shape == (*lead, n) and residual.dtype == dt
                                      and residual.is_contiguous()))
            and (norm_weight is None or (norm_weight.shape == (k,) and norm_weight.dtype == dt
                                         and norm_weight.stride(0) == 1 and not silu_mul))
            and (not rope or all(t.dtype == dt and t.numel() == t.shape[-1] and t.stride(-1) == 1
                                 for t in (rope_cos, rope_sin)))):
        from examples.gemv.kernel import launch_gemv

        out = torch.empty(*lead, n, dtype=dt, device=x.device)
        launch_gemv(x.view(1, -1), weight, out.view(1, n), silu_mul=silu_mul,
                    residual=None if residual is None else residual.view(1, n), norm_weight=norm_weight, eps=eps,
                    rope_cos=rope_cos, rope_sin=rope_sin, rope_cols=rope_cols, rope_unsigned_sin=rope_unsigned_sin,
                    up=None if up is None else up.view(1, -1), pdl=pdl_supported(x.device))
        return out
    if silu_mul:
        x = torch.nn.functional.silu(x[..., :k]) * (x[..., k:] if up is None else up)
    if norm_weight is not None:
        xf = x.float()
        x = norm_weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dt)
    out = torch.nn.functional.linear(x, weight)
    if rope:
        half = rope_cos.shape[-1] // 2
        flat = out.reshape(-1, n)  # (T, N): cos / sin broadcast over (T, heads, D)
        heads = flat[:, :rope_cols].unflatten(-1, (-1, 2 * half))
        cos, sin = rope_cos.reshape(-1, 1, 2 * half), rope_sin.reshape(-1, 1, 2 * half)
        if rope_unsigned_sin:
            heads = heads * cos + torch.cat((-heads[..., half:], heads[..., :half]), dim=-1) * sin
        else:
            heads = heads * cos + heads.roll(half, -1) * sin
        return torch.cat([heads.flatten(1).to(out.dtype), flat[:, rope_cols:]], dim=1).view(out.shape)
    return out if residual is None else out + residual


def gemv_group(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    rope_cos: torch.Tensor | None = None,
    rope_sin: torch.Tensor | None = None,
    rope_segs: int = 0,
    rope_unsigned_sin: bool = False,
) -> torch.Tensor:
    """``cat([gemv(x, w, False, None, norm_weight, eps, ...) for w in weights], -1)``: a model's
    separate q / k / v or gate / up projections of one input (2 or 3 weights (N_i, K)), their
    outputs side by side, (..., sum N_i). The first ``rope_segs`` outputs are rotated in full.

    One bf16/fp16 row on CUDA runs one launch: where the weights are consecutive rows of one
    buffer (``vattn.compile_passes.packed_linears.packed_rows``, as
    ``vattn.integrations.transformers.wrap`` packs them), the plain GEMV over those
    ``(sum N_i, K)`` rows, the fused projection's kernel; otherwise
    ``examples.gemv.kernel.launch_gemv_group``. Anything else runs ``gemv`` per weight."""
    if len(weights) not in (2, 3) or not 0 <= rope_segs <= len(weights):
        raise ValueError(f"vattn_examples::gemv_group: 2 or 3 weights and 0 <= rope_segs <= their count; got "
                         f"{len(weights)} weights, rope_segs={rope_segs}.")
    if rope_segs and (rope_cos is None or rope_sin is None):
        raise ValueError("vattn_examples::gemv_group: rope_segs needs rope_cos and rope_sin.")
    dt = x.dtype
    ns = [w.shape[0] for w in weights]
    if (x.is_cuda and x.dim() >= 2 and x.numel() == x.shape[-1] and dt in (torch.float16, torch.bfloat16)
            and x.stride(-1) == 1 and all(w.dtype == dt and w.stride(1) == 1 and w.shape[1] == x.shape[-1]
                                          for w in weights)
            and (norm_weight is None or (norm_weight.shape == (x.shape[-1],) and norm_weight.dtype == dt
                                         and norm_weight.stride(0) == 1))
            and (not rope_segs or all(t.dtype == dt and t.numel() == t.shape[-1] and t.stride(-1) == 1
                                      for t in (rope_cos, rope_sin)))):
        from examples.gemv.kernel import launch_gemv, launch_gemv_group
        from vattn.compile_passes.packed_linears import packed_rows

        out = torch.empty(*x.shape[:-1], sum(ns), dtype=dt, device=x.device)
        rope = dict(rope_cos=rope_cos, rope_sin=rope_sin) if rope_segs else {}
        if packed_rows(weights) and (not rope_segs or sum(ns) % rope_cos.shape[-1] == 0):
            k = x.shape[-1]
            launch_gemv(x.view(1, -1), weights[0].as_strided((sum(ns), k), (k, 1)), out.view(1, -1),
                        silu_mul=False, norm_weight=norm_weight, eps=eps, rope_cols=sum(ns[:rope_segs]),
                        rope_unsigned_sin=rope_unsigned_sin, pdl=pdl_supported(x.device), **rope)
        else:
            launch_gemv_group(x.view(1, -1), weights, out.view(1, -1).split(ns, -1), norm_weight=norm_weight,
                              eps=eps, rope_segs=rope_segs, rope_unsigned_sin=rope_unsigned_sin,
                              pdl=pdl_supported(x.device), **rope)
        return out
    return torch.cat([gemv(x, w, False, None, norm_weight, eps,
                           *((rope_cos, rope_sin, w.shape[0], rope_unsigned_sin) if i < rope_segs else ()))
                      for i, w in enumerate(weights)], -1)


def _gemv_group_fake(x: torch.Tensor, weights: list[torch.Tensor], norm_weight: torch.Tensor | None = None,
                     eps: float = 0.0, rope_cos: torch.Tensor | None = None, rope_sin: torch.Tensor | None = None,
                     rope_segs: int = 0, rope_unsigned_sin: bool = False) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], sum(w.shape[0] for w in weights))


def _gemv_fake(x: torch.Tensor, weight: torch.Tensor, silu_mul: bool, residual: torch.Tensor | None = None,
               norm_weight: torch.Tensor | None = None, eps: float = 0.0, rope_cos: torch.Tensor | None = None,
               rope_sin: torch.Tensor | None = None, rope_cols: int = 0,
               rope_unsigned_sin: bool = False, up: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


_lib = Library("vattn_examples", "FRAGMENT")
_lib.define("gemv" + infer_schema(gemv, mutates_args=[]))
_lib.impl("gemv", gemv, "CompositeExplicitAutograd")
torch.library.register_fake("vattn_examples::gemv", _gemv_fake, lib=_lib)
_lib.define("gemv_group" + infer_schema(gemv_group, mutates_args=[]))
_lib.impl("gemv_group", gemv_group, "CompositeExplicitAutograd")
torch.library.register_fake("vattn_examples::gemv_group", _gemv_group_fake, lib=_lib)

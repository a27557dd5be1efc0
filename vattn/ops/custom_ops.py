"""The ``vattn::`` custom ops: attention (an opaque graph split point) and the KV-cache write.

Every op is registered through ``register_op`` on one ``Library("vattn", "FRAGMENT")``
(define + impl + fake, no decorator machinery on the call path); its fake is right below
the real implementation. Mutating ops mutate a caller-allocated tensor and return nothing.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch.library import Library, infer_schema

from vattn.backends.abstract import AttentionType
from vattn.config import get_current_vattn_config
from vattn.forward_context import get_forward_context, is_forward_context_available

__all__ = ["python_impl", "register_op", "vattn_lib"]

vattn_lib = Library("vattn", "FRAGMENT")
_IMPLS: dict[str, Callable[..., object]] = {}


def register_op(
    name: str,
    impl: Callable[..., object],
    *,
    mutates_args: Sequence[str],
    fake_impl: Callable[..., object],
    dispatch_key: str = "CompositeExplicitAutograd",
    tags: tuple[torch.Tag, ...] = (),
) -> None:
    """Define ``vattn::<name>`` from ``impl``'s type hints, with its fake implementation.

    ``CompositeExplicitAutograd`` serves every device with one kernel and keeps the op opaque
    to autograd and Dynamo.
    """
    schema = infer_schema(impl, mutates_args=list(mutates_args))
    vattn_lib.define(name + schema, tags=tags)
    vattn_lib.impl(name, impl, dispatch_key)
    torch.library.register_fake(f"vattn::{name}", fake_impl, lib=vattn_lib)
    if dispatch_key == "CompositeExplicitAutograd":
        _IMPLS[f"vattn::{name}"] = impl


def python_impl(op: object) -> Callable[..., object] | None:
    """The Python function behind a ``vattn::`` op (``OpOverload`` or packet) that serves every
    device, or None. Calling it skips the dispatcher (a few microseconds a call): the
    compile backend does so for the attention ops between compiled pieces, at run time."""
    if isinstance(op, torch._ops.OpOverload):
        return _IMPLS.get(op._schema.name)
    if isinstance(op, torch._ops.OpOverloadPacket):
        return _IMPLS.get(op._qualified_op_name)
    return None


# ---- attention ------------------------------------------------------------------------


def _run_layer(
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    output: torch.Tensor | None,
    layer_name: str,
    output_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    ctx = get_forward_context()
    layer = ctx.layer(layer_name)
    attn_metadata = ctx.metadata_for(layer_name)
    kv_cache = layer.kv_cache[ctx.virtual_engine]
    if attn_metadata is None:  # warm-up / profile run: cache untouched, zeros out
        if output is None:
            return torch.zeros_like(query)
        output.zero_()
        return output
    _check_cache(layer, query, key, kv_cache)
    if output is None and layer.use_output:
        output = torch.empty_like(query)
    return layer.impl.forward(
        layer, query, key, value, kv_cache, attn_metadata, output=output, output_scale=output_scale
    )


def _check_cache(layer, query: torch.Tensor, key: torch.Tensor | None, kv_cache: torch.Tensor) -> None:  # type: ignore[no-untyped-def]
    """Cheap host checks (no sync) that the layer's cache is bound and matches the inputs."""
    if layer.attn_type in (AttentionType.ENCODER, AttentionType.ENCODER_ONLY):  # no cache
        return
    if kv_cache.numel() == 0:
        raise RuntimeError(
            f"{layer.layer_name}: KV cache not allocated/bound; call "
            "vattn.allocate_kv_cache(cfg, num_blocks=..., device=...) after building the model."
        )
    if kv_cache.device != query.device:
        raise ValueError(
            f"{layer.layer_name}: KV cache is on {kv_cache.device} but the query is on {query.device}; "
            "allocate the cache on the model's device."
        )
    if key is not None and kv_cache.dtype != key.dtype and not layer.kv_cache_dtype.startswith("fp8"):
        raise TypeError(
            f"{layer.layer_name}: KV cache dtype {kv_cache.dtype} does not match key dtype {key.dtype}; "
            "allocate the cache with dtype= the model dtype (vattn.allocate_kv_cache(..., dtype=...))."
        )


def unified_attention_with_output(
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    output: torch.Tensor,
    layer_name: str,
    output_scale: torch.Tensor | None = None,
) -> None:
    """Attention of layer ``layer_name`` written into ``output`` (T, H, D); see ``vattn.Attention``."""
    _run_layer(query, key, value, output, layer_name, output_scale)


def _check_traced(query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None, layer_name: str) -> None:
    """The layer's input checks at trace time (``Attention.check_traced_inputs``), when the
    layer can be found (a forward context, or the current config, names it)."""
    layer = None
    if is_forward_context_available():
        layer = get_forward_context().no_compile_layers.get(layer_name)
    if layer is None:
        layer = get_current_vattn_config().compilation.static_forward_context.get(layer_name)
    if layer is not None:
        layer.check_traced_inputs(query, key, value)


def _unified_attention_with_output_fake(
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    output: torch.Tensor,
    layer_name: str,
    output_scale: torch.Tensor | None = None,
) -> None:
    _check_traced(query, key, value, layer_name)


register_op(
    "unified_attention_with_output",
    unified_attention_with_output,
    mutates_args=["output"],
    fake_impl=_unified_attention_with_output_fake,
)


def unified_attention(
    query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None, layer_name: str
) -> torch.Tensor:
    """Attention of layer ``layer_name`` for backends without an output buffer; returns (T, H, D)."""
    return _run_layer(query, key, value, None, layer_name).clone()


def _unified_attention_fake(
    query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None, layer_name: str
) -> torch.Tensor:
    _check_traced(query, key, value, layer_name)
    return torch.empty_like(query).contiguous()


register_op(
    "unified_attention",
    unified_attention,
    mutates_args=[],
    fake_impl=_unified_attention_fake,
)


# ---- fp8 scales -----------------------------------------------------------------------


def maybe_calc_kv_scales(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    q_scale: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    layer_name: str,
) -> None:
    """Compute the layer's fp8 q/k/v scales from this batch, once (writes the three scale tensors)."""
    ctx = get_forward_context()
    layer = ctx.layer(layer_name)
    if ctx.metadata_for(layer_name) is None or not layer.calculate_kv_scales:
        return
    layer.calc_kv_scales(query, key, value)


def _maybe_calc_kv_scales_fake(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    q_scale: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    layer_name: str,
) -> None:
    return None


register_op(
    "maybe_calc_kv_scales",
    maybe_calc_kv_scales,
    mutates_args=["q_scale", "k_scale", "v_scale"],
    fake_impl=_maybe_calc_kv_scales_fake,
)


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
    from vattn.ops.kv_store import store_kv

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


# ---- one-token linear layers ----------------------------------------------------------


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
) -> torch.Tensor:
    """``x @ weight.T`` (x (T, K), weight (N, K) -> (T, N)), with the input and output
    transforms of a decoder layer's projections:

    * ``silu_mul``: x is (T, 2K) ``[gate | up]`` and enters as ``silu(gate) * up``;
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

    One bf16/fp16 row on CUDA runs ``vattn.ops.triton_gemv.gemv`` (with programmatic
    dependent launch on sm_90+); anything else the same steps in torch. The 1-token code of
    ``vattn.compile`` calls it in place of the model's linear layers
    (``CompilationConfig.one_token_gemv``).
    """
    n, k = weight.shape
    dt = x.dtype
    rope = rope_cos is not None
    if rope and (rope_sin is None or residual is not None or not 0 < rope_cols <= n
                 or rope_cols % rope_cos.shape[-1] or n % rope_cos.shape[-1] or rope_cos.shape[-1] % 2):
        raise ValueError(
            f"vattn::gemv: RoPE needs rope_cos and rope_sin of one even head size D, 0 < rope_cols <= N with "
            f"rope_cols and N multiples of D, and no residual; got rope_sin {'None' if rope_sin is None else 'set'}, "
            f"D={rope_cos.shape[-1]}, rope_cols={rope_cols}, N={n}, residual {'set' if residual is not None else 'None'}.")
    if (x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and dt in (torch.float16, torch.bfloat16)
            and weight.dtype == dt and weight.stride(1) == 1 and x.stride(1) == 1
            and (residual is None or (residual.shape == (1, n) and residual.dtype == dt
                                      and residual.is_contiguous()))
            and (norm_weight is None or (norm_weight.shape == (k,) and norm_weight.dtype == dt
                                         and norm_weight.stride(0) == 1 and not silu_mul))
            and (not rope or all(t.dtype == dt and t.numel() == t.shape[-1] and t.stride(-1) == 1
                                 for t in (rope_cos, rope_sin)))):
        from vattn.ops.triton_gemv import gemv as triton_gemv
        from vattn.ops.triton_launch import pdl_supported

        out = torch.empty(1, n, dtype=dt, device=x.device)
        triton_gemv(x, weight, out, silu_mul=silu_mul, residual=residual, norm_weight=norm_weight, eps=eps,
                    rope_cos=rope_cos, rope_sin=rope_sin, rope_cols=rope_cols, rope_unsigned_sin=rope_unsigned_sin,
                    pdl=pdl_supported(x.device))
        return out
    if silu_mul:
        x = torch.nn.functional.silu(x[..., :k]) * x[..., k:]
    if norm_weight is not None:
        xf = x.float()
        x = norm_weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dt)
    out = torch.nn.functional.linear(x, weight)
    if rope:
        half = rope_cos.shape[-1] // 2
        heads = out[:, :rope_cols].unflatten(-1, (-1, 2 * half))
        if rope_unsigned_sin:
            heads = heads * rope_cos + torch.cat((-heads[..., half:], heads[..., :half]), dim=-1) * rope_sin
        else:
            heads = heads * rope_cos + heads.roll(half, -1) * rope_sin
        return torch.cat([heads.flatten(1).to(out.dtype), out[:, rope_cols:]], dim=1)
    return out if residual is None else out + residual


def _gemv_fake(x: torch.Tensor, weight: torch.Tensor, silu_mul: bool, residual: torch.Tensor | None = None,
               norm_weight: torch.Tensor | None = None, eps: float = 0.0, rope_cos: torch.Tensor | None = None,
               rope_sin: torch.Tensor | None = None, rope_cols: int = 0,
               rope_unsigned_sin: bool = False) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


register_op("gemv", gemv, mutates_args=[], fake_impl=_gemv_fake)

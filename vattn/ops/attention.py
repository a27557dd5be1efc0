"""The attention ops: ``vattn::unified_attention_with_output``, ``vattn::unified_attention``
and ``vattn::maybe_calc_kv_scales``.

Each looks its layer up by name in the forward context and runs the layer's backend impl.
To ``torch.compile`` they are opaque (only their fakes are traced), so the step's metadata
never becomes a graph input and ``vattn.compile`` splits the graph at them.

``rope_cos`` / ``rope_sin`` ((T, D) rows, rotate-half RoPE): q and key arrive unrotated. A
backend that rotates in its own kernels (``AttentionImpl.fuses_rope``) gets them as ``rope``;
for the others the op rotates q and key first (``vattn.ops.rotary.apply_rotary``).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from vattn.core.enums import AttentionType
from vattn.core.metadata import AttentionMetadata, CommonAttentionMetadata
from vattn.core.batch_checks import cache_geometry, fail
from vattn.core.debug_checks import check_backend_metadata
from vattn.core.config import get_current_vattn_config
from vattn.forward_context import get_forward_context, is_forward_context_available
from vattn.ops.kv_store import layer_scales, store_kv
from vattn.ops.library import register_op
from vattn.ops.rotary import apply_rotary, check_rope

__all__ = ["check_call", "check_traced", "maybe_calc_kv_scales", "run_layer", "store_layer_kv", "unified_attention",
           "unified_attention_with_output"]

_NO_CACHE = (AttentionType.ENCODER, AttentionType.ENCODER_ONLY)

# ---- attention ------------------------------------------------------------------------


def run_layer(query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None, output: torch.Tensor | None,
              layer_name: str, output_scale: torch.Tensor | None = None, rope_cos: torch.Tensor | None = None,
              rope_sin: torch.Tensor | None = None) -> torch.Tensor:
    ctx = get_forward_context()
    layer = ctx.layer(layer_name)
    attn_metadata = ctx.metadata_for(layer_name)
    kv_cache = layer.kv_cache[0]
    if attn_metadata is None:  # a warm-up / profile run (ctx.dummy_run): cache untouched, zeros out
        ctx.check_dummy_run(layer_name)
        if output is None:
            return torch.zeros_like(query)
        output.zero_()
        return output
    check_call(layer, query, key, value, kv_cache, attn_metadata, ctx.debug_checks)
    if output_scale is not None and not layer.output_quant:
        raise NotImplementedError(f"{layer_name}: {layer.attn_backend.get_name()} does not write quantized output; "
                                  "pass output_scale=None (or disable the attention+quant fusion pass).")
    if output is None and layer.use_output:
        output = torch.empty_like(query)
    if rope_cos is not None or rope_sin is not None:
        check_rope(rope_cos, rope_sin, query, layer.head_size, layer_name)
        if layer.impl.fuses_rope:
            return layer.impl.forward(layer, query, key, value, kv_cache, attn_metadata, output=output,
                                      output_scale=output_scale, rope=(rope_cos, rope_sin))
        query = apply_rotary(query, rope_cos, rope_sin)
        key = None if key is None else apply_rotary(key, rope_cos, rope_sin)
    if layer.op_stores_kv and key is not None and layer.attn_type not in _NO_CACHE:
        store_layer_kv(layer, key, value, kv_cache, attn_metadata.slot_mapping)
    return layer.impl.forward(
        layer, query, key, value, kv_cache, attn_metadata, output=output, output_scale=output_scale
    )


def store_layer_kv(layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Write the step's key / value (T, Hk, D) into the layer's cache at ``slot_mapping`` (T,)
    (-1: skip), for backends whose impl does not (``Capabilities.stores_kv`` False). The impl's
    ``split_kv_cache`` names the key and value caches, (num_blocks, block_size, Hk, D) each."""
    key_cache, value_cache = layer.impl.split_kv_cache(kv_cache)
    k_scale, v_scale, _ = layer_scales(layer)
    store_kv(key, value, key_cache, value_cache, slot_mapping, layer.impl.kv_cache_dtype, k_scale, v_scale)


def check_call(layer: Any, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
               kv_cache: torch.Tensor, md: Any, debug: bool = False) -> None:
    """Host checks of one layer's call before anything is written (no device sync): the
    metadata's kind and device, q/k/v token counts against it, the bound cache (its shape once
    per tensor), and the step's batch against that cache (``StepChecks``: once per step per
    cache geometry, then a tuple comparison). ``debug``: metadata that ``PagedKVCache`` did not
    build is checked on the device too (``VATTN_DEBUG_CHECKS``)."""
    name = layer.layer_name
    if not isinstance(md, AttentionMetadata):
        hint = (" (the batch description: pass kv.build_metadata(common) instead)"
                if isinstance(md, CommonAttentionMetadata) else "")
        raise TypeError(
            f"{name}: attn_metadata: expected the backend metadata kv.build_metadata(common) returns (an "
            f"AttentionMetadata, or a dict of them by layer name), got {type(md).__name__}{hint}; set it with "
            "vattn.set_forward_context(kv.build_metadata(common), cfg)."
        )
    if (key is None) != (value is None):
        fail(f"{name}: key/value", "both tensors, or both None (K/V from the cache only)",
             f"key={'None' if key is None else 'a tensor'}, value={'None' if value is None else 'a tensor'}",
             "pass the new tokens' key and value together.")
    n, slots = getattr(md, "num_actual_tokens", None), getattr(md, "slot_mapping", None)
    t = query.shape[0]
    cross = layer.attn_type == AttentionType.ENCODER_DECODER
    if isinstance(slots, torch.Tensor) and isinstance(n, int):
        rows = slots.shape[0]
        if t < n or (not cross and t != rows):
            fail(f"{name}: query", f"{n} tokens, the metadata's num_actual_tokens" + (
                 f" (or {rows}: with its padding)" if rows != n and not cross else ""),
                 f"{t} tokens", "pass q, k and v for exactly the tokens of the batch the metadata was built for "
                 "(its query_lens sum to num_actual_tokens).")
        if key is not None and not cross and key.shape[0] != t:
            fail(f"{name}: key", f"{t} tokens, as many as query", f"{key.shape[0]}",
                 "pass the same tokens' q, k and v.")
        if slots.device != query.device:
            fail(f"{name}: attn_metadata", f"tensors on the query's device {query.device}",
                 f"slot_mapping on {slots.device}", "build the metadata with device= the model's device.")
    if layer.attn_type in _NO_CACHE:
        return
    _check_cache(layer, query, key, kv_cache)
    ref = getattr(layer, "_checked_cache", None)
    if ref is None or ref() is not kv_cache:  # once per bound tensor
        layer._cache_geometry = cache_geometry(
            layer.attn_backend, kv_cache, block_size=layer.block_size, num_kv_heads=layer.num_kv_heads,
            head_size=layer.head_size, cache_dtype=layer.kv_cache_dtype, name=name)
        layer._checked_cache = weakref.ref(kv_cache)
        layer._cache_where = f"layer {name!r}'s KV cache"  # named in StepChecks' messages; built once
    checks = md.checks
    if checks is not None:
        checks.check(*layer._cache_geometry, layer._cache_where)
    elif debug:
        check_backend_metadata(md, *layer._cache_geometry, name)


def _check_cache(layer, query: torch.Tensor, key: torch.Tensor | None, kv_cache: torch.Tensor) -> None:  # type: ignore[no-untyped-def]
    """Cheap host checks (no sync) that the layer's cache is bound and matches the inputs."""
    if kv_cache.numel() == 0:
        raise RuntimeError(
            f"{layer.layer_name}: KV cache not allocated/bound; call "
            "vattn.allocate_kv_cache(cfg, num_blocks=..., device=...) after building the model."
        )
    if kv_cache.device != query.device:
        raise ValueError(
            f"{layer.layer_name}: kv_cache is on {kv_cache.device} but the query is on {query.device}; "
            "allocate the cache on the model's device."
        )
    fp8 = layer.kv_cache_dtype.startswith("fp8")
    if key is not None and kv_cache.dtype != key.dtype and not fp8:
        _dtype_mismatch(layer, query, key, kv_cache)
    if fp8 and kv_cache.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8):
        raise TypeError(
            f"{layer.layer_name}: kv_cache dtype: expected an fp8 (or uint8) cache for cache_dtype="
            f"{layer.kv_cache_dtype!r}, got {kv_cache.dtype}; allocate it with vattn.allocate_kv_cache."
        )


def _dtype_mismatch(layer: Any, query: torch.Tensor, key: torch.Tensor, kv_cache: torch.Tensor) -> None:
    """The ``TypeError`` for inputs whose dtype is not the cache's, saying which side is off:
    the inputs when the cache holds the layer's dtype (its construction dtype), else the cache."""
    name, want = layer.layer_name, kv_cache.dtype
    layer_dtype = getattr(layer, "dtype", None)
    if layer_dtype == want or layer_dtype != key.dtype:
        raise TypeError(
            f"{name}: query/key/value dtype: expected {want}, the dtype of this layer's KV cache"
            f"{' and of the layer (built under it)' if layer_dtype == want else ''}, got query {query.dtype}, key "
            f"{key.dtype}; cast the inputs to {want} (e.g. run the model in {want}), or build the model under "
            f"torch.set_default_dtype({key.dtype}) and allocate the cache with "
            f"vattn.allocate_kv_cache(..., dtype={key.dtype})."
        )
    raise TypeError(
        f"{name}: kv_cache dtype: expected {key.dtype}, the dtype of the layer (built under it) and of its "
        f"query/key/value, got a cache of {want}; allocate the cache with vattn.allocate_kv_cache(..., "
        f"dtype={key.dtype})."
    )


def unified_attention_with_output(query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
                                  output: torch.Tensor, layer_name: str, output_scale: torch.Tensor | None = None,
                                  rope_cos: torch.Tensor | None = None, rope_sin: torch.Tensor | None = None) -> None:
    """Attention of layer ``layer_name`` written into ``output`` (T, H, D); see ``vattn.Attention``."""
    run_layer(query, key, value, output, layer_name, output_scale, rope_cos, rope_sin)


def check_traced(query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None, layer_name: str,
                 rope_cos: torch.Tensor | None = None, rope_sin: torch.Tensor | None = None) -> None:
    """The layer's input checks at trace time (``Attention`` or ``MLAAttention.check_traced_inputs``), when the
    layer can be found (a forward context, or the current config, names it)."""
    layer = None
    if is_forward_context_available():
        layer = get_forward_context().no_compile_layers.get(layer_name)
    if layer is None:
        layer = get_current_vattn_config().compilation.static_forward_context.get(layer_name)
    if layer is not None:
        layer.check_traced_inputs(query, key, value)
        if rope_cos is not None or rope_sin is not None:
            check_rope(rope_cos, rope_sin, query, layer.head_size, layer_name)


def _unified_attention_with_output_fake(query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
                                        output: torch.Tensor, layer_name: str,
                                        output_scale: torch.Tensor | None = None,
                                        rope_cos: torch.Tensor | None = None,
                                        rope_sin: torch.Tensor | None = None) -> None:
    check_traced(query, key, value, layer_name, rope_cos, rope_sin)


register_op(
    "unified_attention_with_output",
    unified_attention_with_output,
    mutates_args=["output"],
    fake_impl=_unified_attention_with_output_fake,
)


def unified_attention(
    query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None, layer_name: str,
    rope_cos: torch.Tensor | None = None, rope_sin: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of layer ``layer_name`` for backends without an output buffer; returns (T, H, D)."""
    return run_layer(query, key, value, None, layer_name, None, rope_cos, rope_sin).clone()


def _unified_attention_fake(
    query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None, layer_name: str,
    rope_cos: torch.Tensor | None = None, rope_sin: torch.Tensor | None = None,
) -> torch.Tensor:
    check_traced(query, key, value, layer_name, rope_cos, rope_sin)
    return torch.empty_like(query).contiguous()


register_op(
    "unified_attention",
    unified_attention,
    mutates_args=[],
    fake_impl=_unified_attention_fake,
)


# ---- fp8 scales -----------------------------------------------------------------------


def maybe_calc_kv_scales(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_scale: torch.Tensor,
                         k_scale: torch.Tensor, v_scale: torch.Tensor, layer_name: str) -> None:
    """Compute the layer's fp8 q/k/v scales from this batch, once (writes the three scale tensors)."""
    ctx = get_forward_context()
    layer = ctx.layer(layer_name)
    if ctx.metadata_for(layer_name) is None or not layer.calculate_kv_scales:
        return
    layer.calc_kv_scales(query, key, value)


def _maybe_calc_kv_scales_fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_scale: torch.Tensor,
                               k_scale: torch.Tensor, v_scale: torch.Tensor, layer_name: str) -> None:
    return None


register_op(
    "maybe_calc_kv_scales",
    maybe_calc_kv_scales,
    mutates_args=["q_scale", "k_scale", "v_scale"],
    fake_impl=_maybe_calc_kv_scales_fake,
)



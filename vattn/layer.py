"""``vattn.Attention``: the drop-in attention layer over a paged KV cache (seed 002)."""

from __future__ import annotations

import logging
from typing import Any, Callable, Protocol

import torch
from torch import nn

import vattn.ops  # noqa: F401  (registers the vattn:: ops)
from vattn import envs
from vattn.core.enums import AttentionType
from vattn.core.interface import AttentionBackend, AttentionLayerBase
from vattn.core.metadata import is_fp8_kv_cache
from vattn.core.checks import check_layer_args, check_mods, validate_kv_sharing_target
from vattn.core.config import CACHE_DTYPES, CacheConfig, get_current_vattn_config
from vattn.ops.attention import run_layer
from vattn.ops.kv_store import fp8_dtype_for
from vattn.ops.library import eager_direct_ok
from vattn.ops.quant_fp8 import GroupShape, QuantFP8
from vattn.ops.rotary import rope_args
from vattn.platform import current_platform
from vattn.selector import TRANSFORMERS_NAMES, backend_name_to_enum, get_attn_backend, implemented_names, warn_if_slow_here

__all__ = ["Attention", "KVCacheQuantMethod", "QuantizationConfig"]

logger = logging.getLogger("vattn")


class KVCacheQuantMethod(Protocol):
    """What an fp8 checkpoint's KV-cache quantization method does to a layer."""

    def create_weights(self, layer: "Attention") -> None:
        """Add loadable scale parameters (e.g. ``k_scale``, ``v_scale``) to the layer."""

    def process_weights_after_loading(self, layer: "Attention") -> None:
        """Copy the loaded scales into ``layer._k_scale`` etc. and their ``*_float`` copies."""


class QuantizationConfig(Protocol):
    """The part of a quantization config the attention layer uses."""

    def get_quant_method(self, layer: nn.Module, prefix: str) -> KVCacheQuantMethod | None: ...


def _resolve_backend(attn_backend: type[AttentionBackend] | str | None, features: dict[str, Any],
                     **select: Any) -> type[AttentionBackend]:
    """The selected backend, or the given one after checking it can serve the layer
    (``select``: ``validate_configuration``'s arguments; ``features``: ``feature_reasons``')."""
    if attn_backend is None:
        return warn_if_slow_here(get_attn_backend(**select, **features))
    backend = warn_if_slow_here(_backend_class(attn_backend))
    reasons = backend.validate_configuration(**select) + backend.feature_reasons(**features)
    if reasons:
        raise ValueError(
            f"attn_backend={backend.get_name()} cannot serve this layer: {'; '.join(reasons)}. "
            "Pick another backend (or attn_backend=None to select automatically)."
        )
    return backend


def _backend_class(attn_backend: type[AttentionBackend] | str) -> type[AttentionBackend]:
    if isinstance(attn_backend, str):
        backend = backend_name_to_enum(attn_backend)
        if backend is None:
            raise ValueError(
                f"attn_backend={attn_backend!r} is not a backend name; implemented: {implemented_names()} "
                f"(transformers' names {sorted(TRANSFORMERS_NAMES)} are taken too), or None to select automatically"
                + ("; transformers' 'eager' attention has no kernel of its own here: 'sdpa' (TORCH_SDPA) computes "
                   "the same attention." if attn_backend.strip().lower() == "eager" else ".")
            )
        return backend.get_class()
    if isinstance(attn_backend, type) and issubclass(attn_backend, AttentionBackend):
        return attn_backend
    raise TypeError(
        f"attn_backend must be None, a backend name or an AttentionBackend subclass, got {attn_backend!r}."
    )


def _as_heads(x: torch.Tensor | None, heads: int, head_size: int) -> torch.Tensor | None:
    """``x`` as (T, heads, head_size): (T, heads * head_size) is viewed, a 3-D tensor passes as is
    (a strided q/k/v slice is not re-viewed, so a compiled graph never guards on T == 1). The
    token count is kept, so a wrong width fails here instead of changing the token count."""
    if x is None or x.dim() == 3:
        return x
    return x.view(x.shape[0], heads, head_size)


class Attention(nn.Module, AttentionLayerBase):
    """Paged attention layer: stores new K/V in the cache, then attends.

    Args:
        num_heads: query heads H.
        head_size: head dimension D.
        scale: softmax scale (usually ``D ** -0.5``).
        num_kv_heads: KV heads Hk (GQA/MQA); must divide ``num_heads``. Default: ``num_heads``.
        alibi_slopes: per-head ALiBi slopes, length H.
        cache_config: block size, cache dtype, sliding window; default: the current config's.
        quant_config: fp8 checkpoint config providing k/v scales (see ``QuantizationConfig``).
        logits_soft_cap: ``cap * tanh(s / cap)`` applied to the scores.
        per_layer_sliding_window: this layer's window (overrides ``cache_config.sliding_window``).
        use_mla / use_sparse: select among MLA (sparse MLA) backends; ``vattn.MLAAttention`` sets them.
        prefix: unique layer name, e.g. ``"model.layers.0.self_attn.attn"``.
        attn_type: one of ``AttentionType``.
        kv_sharing_target_layer_name: reuse an earlier layer's KV cache.
        attn_backend: force a backend class (or name); default: ``vattn.get_attn_backend``.
        mask_mod, score_mod: FlexAttention mods over logical positions (``b`` the request, ``q_idx`` /
            ``kv_idx`` positions in its sequence); a mask_mod replaces the causal mask. Served by
            FLEX_ATTENTION (selected for them); see ``vattn.backends.flex_attention.mods``.
        **extra_impl_args: passed to the backend impl, e.g. ``sinks`` (H,) float tensor.

    ``forward(query (T, H*D), key (T, Hk*D), value (T, Hk*D), output_shape=None, rope=None) -> (T, H*D)``
    (``output_shape``: the output's shape when it differs, as vLLM's MLA passes it); with
    ``rope=(cos, sin)``, each (T, D), q and key are unrotated; the step's
    metadata comes from ``vattn.set_forward_context``. The model dtype is
    ``torch.get_default_dtype()`` at construction (build the model under the dtype it runs in).
    """

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, cache_config: CacheConfig | None = None,
                 quant_config: QuantizationConfig | None = None, logits_soft_cap: float | None = None,
                 per_layer_sliding_window: int | None = None, use_mla: bool = False, use_sparse: bool = False,
                 prefix: str = "", attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None,
                 attn_backend: type[AttentionBackend] | str | None = None,
                 mask_mod: Callable[..., torch.Tensor] | None = None,
                 score_mod: Callable[..., torch.Tensor] | None = None, **extra_impl_args: Any) -> None:
        super().__init__()
        vattn_config = get_current_vattn_config()
        cache_config = cache_config if cache_config is not None else vattn_config.cache
        if num_kv_heads is None:
            num_kv_heads = num_heads
        sliding_window = (
            per_layer_sliding_window if per_layer_sliding_window is not None else cache_config.sliding_window
        )
        check_layer_args(num_heads, head_size, scale, num_kv_heads, logits_soft_cap, sliding_window, alibi_slopes,
                         where=f"vattn.Attention({prefix!r})")
        check_mods(mask_mod, score_mod, where=f"vattn.Attention({prefix!r})")
        if attn_type not in AttentionType.ALL:
            raise ValueError(f"attn_type must be one of {AttentionType.ALL}, got {attn_type!r}.")
        if not prefix:
            raise ValueError("prefix must be a unique non-empty layer name, e.g. 'model.layers.0.self_attn.attn'.")
        if cache_config.cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"cache_dtype must be one of {CACHE_DTYPES}, got {cache_config.cache_dtype!r}.")

        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.kv_cache_dtype = cache_config.cache_dtype
        self.block_size = cache_config.block_size
        self.calculate_kv_scales = cache_config.calculate_kv_scales
        self.use_mla = use_mla
        self.use_sparse = use_sparse
        self.has_sink = extra_impl_args.get("sinks") is not None
        self.layer_name = prefix
        self.attn_type = attn_type
        self.dtype = torch.get_default_dtype()

        # fp8 scales: device tensors (buffers, so .to(device) moves them) and host copies.
        for name in ("_q_scale", "_k_scale", "_v_scale", "_prob_scale"):
            self.register_buffer(name, torch.tensor(1.0, dtype=torch.float32), persistent=False)
        self._q_scale_float = 1.0
        self._k_scale_float = 1.0
        self._v_scale_float = 1.0
        self._o_scale_float: float | None = None
        self.q_range = float(envs.VATTN_Q_SCALE_CONSTANT)
        self.k_range = float(envs.VATTN_K_SCALE_CONSTANT)
        self.v_range = float(envs.VATTN_V_SCALE_CONSTANT)

        self.quant_method = quant_config.get_quant_method(self, prefix=prefix) if quant_config else None
        if self.quant_method is not None:
            if self.kv_cache_dtype == "fp8_e5m2":
                raise ValueError(
                    "cache_dtype='fp8_e5m2' is not supported with fp8 checkpoints (their scales are "
                    "for e4m3); use cache_dtype='fp8' or 'fp8_e4m3'."
                )
            self.quant_method.create_weights(self)

        features = dict(attn_type=attn_type, use_sliding_window=sliding_window is not None,
                        use_logits_soft_cap=bool(logits_soft_cap), use_alibi=alibi_slopes is not None)
        # Named only when used: a custom backend's feature_reasons may predate them.
        features.update({f"use_{k}": True for k, v in (("mask_mod", mask_mod), ("score_mod", score_mod)) if v})
        self.attn_backend = _resolve_backend(
            attn_backend,
            features,
            head_size=head_size,
            dtype=self.dtype,
            kv_cache_dtype=self.kv_cache_dtype,
            block_size=self.block_size,
            use_mla=use_mla,
            has_sink=self.has_sink,
            use_sparse=use_sparse,
        )
        mods = {k: v for k, v in (("mask_mod", mask_mod), ("score_mod", score_mod)) if v is not None}
        self.impl = self.attn_backend.get_impl_cls()(
            num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, self.kv_cache_dtype,
            logits_soft_cap, attn_type, kv_sharing_target_layer_name, **mods, **extra_impl_args)
        self.backend = backend_name_to_enum(self.attn_backend.get_name())
        self.use_direct_call = not current_platform.opaque_attention_op()
        caps = self.attn_backend.capabilities
        self.use_output = caps.accept_output_buffer
        # The op stores the step's K/V unless the impl does (read once here, not per step).
        self.op_stores_kv = not caps.stores_kv and kv_sharing_target_layer_name is None
        self.output_quant = caps.output_quant

        context = vattn_config.compilation.static_forward_context
        if prefix in context:
            raise ValueError(
                f"Duplicate layer name: {prefix!r} is already registered in the current vattn config; "
                "give every vattn.Attention a unique prefix (e.g. f'model.layers.{i}.self_attn.attn')."
            )
        if kv_sharing_target_layer_name is not None:
            validate_kv_sharing_target(prefix, kv_sharing_target_layer_name, context)
            target = context[kv_sharing_target_layer_name]
            if target.attn_type != attn_type:
                raise ValueError(
                    f"kv_sharing_target_layer_name={kv_sharing_target_layer_name!r} has attn_type "
                    f"{target.attn_type!r}, but layer {prefix!r} has {attn_type!r}; KV sharing needs "
                    "the same attention type."
                )
        context[prefix] = self
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        # Replaced by vattn.allocate_kv_cache / bind_kv_cache (one entry per virtual engine).
        self.kv_cache: list[torch.Tensor] = [torch.tensor([])]
        self._checked_cache: Any = None  # weakref to the bound tensor whose shape was checked (the op's check_call)
        self._checked_inputs: tuple[Any, ...] | None = None  # the last q/k/v signature _check_inputs passed
        self._cache_geometry: tuple[int, int] | None = None
        self._cache_where = ""

        self.query_quant: QuantFP8 | None = None
        if is_fp8_kv_cache(self.kv_cache_dtype) and self.attn_backend.supports_quant_query_input:
            fp8 = fp8_dtype_for(self.kv_cache_dtype)
            assert fp8 is not None
            self.query_quant = QuantFP8(static=True, group_shape=GroupShape.PER_TENSOR, dtype=fp8)

    # ---- forward ----------------------------------------------------------------------

    def _check_inputs(self, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None) -> None:
        hq, hk = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        if query.shape[-1] != hq and tuple(query.shape[-2:]) != (self.num_heads, self.head_size):
            raise ValueError(
                f"{self.layer_name}: query last dim must be num_heads * head_size = {self.num_heads} * "
                f"{self.head_size} = {hq}, got shape {tuple(query.shape)}; check the q projection's width."
            )
        if (key is None) != (value is None):
            raise ValueError(
                f"{self.layer_name}: key/value: expected both tensors or both None (K/V from the cache only), "
                f"got key={'None' if key is None else 'a tensor'}, value={'None' if value is None else 'a tensor'}; "
                "pass the new tokens' key and value together."
            )
        for name, t in (("key", key), ("value", value)):
            if t is None:
                continue
            if t.shape[-1] != hk and tuple(t.shape[-2:]) != (self.num_kv_heads, self.head_size):
                raise ValueError(
                    f"{self.layer_name}: {name} last dim must be num_kv_heads * head_size = "
                    f"{self.num_kv_heads} * {self.head_size} = {hk}, got shape {tuple(t.shape)}."
                )
            if t.dtype != query.dtype and self.query_quant is None:
                raise TypeError(
                    f"{self.layer_name}: {name} dtype {t.dtype} differs from query dtype {query.dtype}; "
                    "cast q, k and v to the model dtype."
                )
            tokens = (t.shape[0], query.shape[0])
            if all(type(n) is int for n in tokens) and tokens[0] != tokens[1]:  # symbolic: check_traced_inputs
                raise ValueError(
                    f"{self.layer_name}: {name} has {t.shape[0]} tokens but query has {query.shape[0]}; "
                    "pass the same tokens' q, k and v."
                )
            if t.device != query.device:
                raise ValueError(
                    f"{self.layer_name}: {name} is on {t.device} but query is on {query.device}; "
                    "move the inputs to one device."
                )

    def check_traced_inputs(self, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None) -> None:
        """``_check_inputs`` on the (T, heads, D) tensors the attention op gets at trace time
        (the op's fake implementation calls it); token counts are compared without adding
        guards (an error only where they differ for every size)."""
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        self._check_inputs(query, key, value)
        for name, t in (("key", key), ("value", value)):
            if t is not None and statically_known_true(t.shape[0] != query.shape[0]):
                raise ValueError(
                    f"{self.layer_name}: {name} has {t.shape[0]} tokens but query has {query.shape[0]}; "
                    "pass the same tokens' q, k and v."
                )

    def forward(self, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
                output_shape: torch.Size | None = None, *,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Attend over the paged cache. Shapes in the class docstring; returns (T, H*D). ``rope``: (cos, sin)
        (T, head_size) rotate-half rows for an unrotated q / key (``vattn.ops.rotary.rope_args``)."""
        direct = self.use_direct_call
        if not torch.compiler.is_compiling():
            # Under torch.compile the attention op's fake implementation runs the same checks
            # (``check_traced_inputs``) natively, where Dynamo would trace every comparison in
            # every layer (tens of ms each). Eagerly they run once per input signature: they
            # depend on nothing else, and every layer of every step repeats the last one's.
            sig = None if key is None or value is None else (
                query.shape, key.shape, value.shape, query.dtype, key.dtype, value.dtype,
                query.device, key.device, value.device)
            if sig is None or sig != self._checked_inputs:
                self._check_inputs(query, key, value)
                self._checked_inputs = sig
            direct = direct or eager_direct_ok(query, key, value)
        if self.calculate_kv_scales:
            torch.ops.vattn.maybe_calc_kv_scales(
                query, key, value, self._q_scale, self._k_scale, self._v_scale, self.layer_name
            )
        output_dtype = query.dtype
        query, key, rope_kw = rope_args(self, query, key, rope)
        if self.query_quant is not None:
            # Opaque quant op in eager; vattn.compile's query_quant_fusion pass turns it into
            # plain torch ops that Inductor fuses into the kernel producing q.
            query, _ = self.query_quant(query, self._q_scale)
        hidden_size = self.num_heads * self.head_size
        query = _as_heads(query, self.num_heads, self.head_size)
        key = _as_heads(key, self.num_kv_heads, self.head_size)
        value = _as_heads(value, self.num_kv_heads, self.head_size)

        if self.use_output:
            if direct and output_shape is None:  # eager: (T, H, D) made as such, one view less
                output = torch.empty((query.shape[0], self.num_heads, self.head_size), dtype=output_dtype,
                                     device=query.device)
                run_layer(query, key, value, output, self.layer_name, **rope_kw)  # the op's body, no dispatcher
                return output.view(-1, hidden_size)
            if output_shape is None:
                output_shape = torch.Size((query.shape[0], hidden_size))
            output = torch.empty(output_shape, dtype=output_dtype, device=query.device)
            output = output.view(-1, self.num_heads, self.head_size)
            if direct:
                run_layer(query, key, value, output, self.layer_name, **rope_kw)
            else:
                torch.ops.vattn.unified_attention_with_output(query, key, value, output, self.layer_name, **rope_kw)
            return output.view(-1, output_shape[-1])
        if direct:
            out = run_layer(query, key, value, None, self.layer_name, **rope_kw)
        else:
            out = torch.ops.vattn.unified_attention(query, key, value, self.layer_name, **rope_kw)
        return out.reshape(-1, hidden_size)

    # ---- fp8 scales and loading ---------------------------------------------------------

    def calc_kv_scales(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Set the fp8 q/k/v scales from this batch's absolute maxima (done once)."""
        self._q_scale.copy_(query.abs().max().float() / self.q_range)
        self._k_scale.copy_(key.abs().max().float() / self.k_range)
        self._v_scale.copy_(value.abs().max().float() / self.v_range)
        for name in ("_q_scale", "_k_scale", "_v_scale"):  # a zero batch must not give scale 0
            getattr(self, name).clamp_(min=torch.finfo(torch.float32).tiny)
        self._q_scale_float = self._q_scale.item()
        self._k_scale_float = self._k_scale.item()
        self._v_scale_float = self._v_scale.item()
        self.calculate_kv_scales = False

    def set_kv_scales(self, k_scale: float, v_scale: float, q_scale: float | None = None) -> None:
        """Set checkpoint-provided fp8 scales (device tensors and host copies)."""
        for name, val in (("_k_scale", k_scale), ("_v_scale", v_scale), ("_q_scale", q_scale)):
            if val is None:
                continue
            if not val > 0:
                raise ValueError(f"{self.layer_name}: {name[1:]} must be > 0, got {val}.")
            getattr(self, name).fill_(float(val))
            setattr(self, name + "_float", float(val))

    def extra_repr(self) -> str:
        return (
            f"head_size={self.head_size}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"scale={self.impl.scale}, backend={self.impl.__class__.__name__}, name={self.layer_name!r}"
        )

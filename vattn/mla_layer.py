"""``vattn.MLAAttention``: multi-head latent attention over a paged latent cache (vLLM's ``MLAAttention``).

DeepSeek-V2/V3/R1 and Kimi K2 attend with MLA: keys and values are up-projected per head from
a small latent (``kv_lora_rank``, 512 for DeepSeek) by ``kv_b_proj``, and a RoPE key
(``qk_rope_head_dim``, 64) is shared by all heads. The cache keeps only the latent row
(``kv_lora_rank + qk_rope_head_dim`` per token). The model computes the projections and RoPE;
the layer stores the latent rows and attends (absorbed for decodes, up-projected for prefills;
see ``vattn.backends.mla.impl``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import vattn.ops  # noqa: F401  (registers the vattn:: ops)
from vattn.core.enums import AttentionType
from vattn.core.interface import AttentionBackend, AttentionLayerBase
from vattn.core.checks import check_layer_args, fail
from vattn.core.metadata import MLAAttentionSpec
from vattn.core.registry import AttentionBackendEnum
from vattn.core.config import CACHE_DTYPES, CacheConfig, get_current_vattn_config
from vattn.ops.mla import unified_mla_attention_with_output
from vattn.ops.library import eager_direct_ok
from vattn.platform import current_platform
from vattn.selector import backend_name_to_enum, get_attn_backend

__all__ = ["MLAAttention"]


def _resolve_backend(attn_backend: type[AttentionBackend] | str | None, mla_dims: tuple[int, int, int, int],
                     **config: Any) -> type[AttentionBackend]:
    """The selected MLA backend, or the given one after checking it can serve the layer
    (``mla_dims``: kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim)."""
    if attn_backend is None:
        return get_attn_backend(**config, use_mla=True, mla_dims=mla_dims)
    if isinstance(attn_backend, str):
        member = backend_name_to_enum(attn_backend)
        if member is None:
            raise ValueError(f"attn_backend={attn_backend!r} is not a backend name; valid: "
                             f"{[m.name for m in AttentionBackendEnum]}.")
        backend = member.get_class()
    elif isinstance(attn_backend, type) and issubclass(attn_backend, AttentionBackend):
        backend = attn_backend
    else:
        raise TypeError(f"attn_backend must be None, a backend name or an AttentionBackend subclass, got "
                        f"{attn_backend!r}.")
    reasons = backend.validate_configuration(**config, use_mla=True)
    if hasattr(backend, "mla_dims_reasons"):
        reasons = [*reasons, *backend.mla_dims_reasons(*mla_dims)]
    if reasons:
        raise ValueError(f"attn_backend={backend.get_name()} cannot serve this MLA layer: {'; '.join(reasons)}. "
                         "Pick another MLA backend (or attn_backend=None to select automatically).")
    return backend


class MLAAttention(nn.Module, AttentionLayerBase):
    """Multi-head latent attention layer: stores the new latent rows in the cache, then attends.

    Args:
        num_heads: query heads H.
        scale: softmax scale, ``qk_head_dim ** -0.5`` (times DeepSeek's YaRN ``mscale ** 2``).
        qk_nope_head_dim: N, the per-head query/key dimension without RoPE (128 for DeepSeek).
        qk_rope_head_dim: P, the RoPE dimension, one key shared by every head (64).
        v_head_dim: V, the per-head value dimension (128).
        q_lora_rank: the query's low rank (None: a full q projection); recorded, not used here.
        kv_lora_rank: L, the latent width (512).
        kv_b_proj: the model's ``nn.Linear(L, H * (N + V), bias=False)``; its weight is read at
            every step (absorbed for decodes, applied for prefills), so load weights as usual.
        cache_config: block size and cache dtype; default: the current config's.
        quant_config: fp8 checkpoint config providing the latent cache's scale.
        prefix: unique layer name, e.g. ``"model.layers.0.self_attn.attn"``.
        use_sparse: DeepSeek-V3.2 sparse attention (no vattn backend serves it).
        attn_backend: force an MLA backend class (or name); default: ``vattn.get_attn_backend``.

    ``forward(q (T, H * (N + P)), kv_c_normed (T, L), k_pe (T, P)) -> (T, H * V)``: RoPE
    already applied to the last P dims of each head's q and to ``k_pe``. The step's metadata
    comes from ``vattn.set_forward_context``; the model dtype is ``torch.get_default_dtype()``
    at construction.
    """

    def __init__(self, num_heads: int, scale: float, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                 q_lora_rank: int | None, kv_lora_rank: int, kv_b_proj: nn.Module, cache_config: CacheConfig | None = None,
                 quant_config: Any = None, prefix: str = "", use_sparse: bool = False, indexer: Any = None,
                 attn_backend: type[AttentionBackend] | str | None = None, **extra_impl_args: Any) -> None:
        super().__init__()
        vattn_config = get_current_vattn_config()
        cache_config = cache_config if cache_config is not None else vattn_config.cache
        where = f"vattn.MLAAttention({prefix!r})"
        for name, value in (("qk_nope_head_dim", qk_nope_head_dim), ("qk_rope_head_dim", qk_rope_head_dim),
                            ("v_head_dim", v_head_dim), ("kv_lora_rank", kv_lora_rank)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                fail(f"{where}: {name}", "a positive int", repr(value), "pass the model config's value.")
        check_layer_args(num_heads, qk_nope_head_dim + qk_rope_head_dim, scale, 1, None, None, None, where=where)
        if not prefix:
            raise ValueError("prefix must be a unique non-empty layer name, e.g. 'model.layers.0.self_attn.attn'.")
        if cache_config.cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"cache_dtype must be one of {CACHE_DTYPES}, got {cache_config.cache_dtype!r}.")
        if cache_config.sliding_window is not None or cache_config.calculate_kv_scales:
            raise NotImplementedError(f"{where}: CacheConfig.sliding_window / calculate_kv_scales are not supported "
                                      "by MLA layers; leave them at None / False (set fp8 scales with set_kv_scales).")
        self.num_heads = num_heads
        self.qk_nope_head_dim, self.qk_rope_head_dim = qk_nope_head_dim, qk_rope_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.v_head_dim, self.q_lora_rank, self.kv_lora_rank = v_head_dim, q_lora_rank, kv_lora_rank
        # The cache's view of the layer: one "KV head" of the latent row's width.
        self.num_kv_heads, self.head_size = 1, kv_lora_rank + qk_rope_head_dim
        self.sliding_window = None
        self.kv_cache_dtype = cache_config.cache_dtype
        self.block_size = cache_config.block_size
        self.calculate_kv_scales = False
        self.use_mla, self.use_sparse = True, use_sparse
        self.attn_type = AttentionType.DECODER
        self.kv_sharing_target_layer_name = None
        self.layer_name = prefix
        self.dtype = torch.get_default_dtype()
        for name in ("_q_scale", "_k_scale", "_v_scale", "_prob_scale"):  # fp8: _k_scale scales the latent
            self.register_buffer(name, torch.tensor(1.0, dtype=torch.float32), persistent=False)
        self._q_scale_float = self._k_scale_float = self._v_scale_float = 1.0
        self.quant_method = quant_config.get_quant_method(self, prefix=prefix) if quant_config else None
        if self.quant_method is not None:
            self.quant_method.create_weights(self)

        mla_dims = (kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim)
        self.attn_backend = _resolve_backend(attn_backend, mla_dims, head_size=self.head_size, dtype=self.dtype,
                                             kv_cache_dtype=self.kv_cache_dtype, block_size=self.block_size,
                                             use_sparse=use_sparse)
        self.impl = self.attn_backend.get_impl_cls()(
            num_heads, self.head_size, scale, 1, None, None, self.kv_cache_dtype, None, AttentionType.DECODER, None,
            q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank, qk_nope_head_dim=qk_nope_head_dim,
            qk_rope_head_dim=qk_rope_head_dim, qk_head_dim=self.qk_head_dim, v_head_dim=v_head_dim,
            kv_b_proj=kv_b_proj, indexer=indexer, **extra_impl_args)
        self.backend = backend_name_to_enum(self.attn_backend.get_name())
        self.use_direct_call = not current_platform.opaque_attention_op()
        self.use_output = True

        context = vattn_config.compilation.static_forward_context
        if prefix in context:
            raise ValueError(f"Duplicate layer name: {prefix!r} is already registered in the current vattn config; "
                             "give every attention layer a unique prefix (e.g. f'model.layers.{i}.self_attn.attn').")
        context[prefix] = self
        # Replaced by vattn.allocate_kv_cache / bind_kv_cache (one entry per virtual engine).
        self.kv_cache: list[torch.Tensor] = [torch.tensor([])]
        self._checked_cache: Any = None
        self._cache_geometry: tuple[int, int] | None = None
        self._cache_where = ""

    # ---- forward ----------------------------------------------------------------------

    def _check_inputs(self, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor) -> None:
        h, d, lora, rope = self.num_heads, self.qk_head_dim, self.kv_lora_rank, self.qk_rope_head_dim
        name = self.layer_name
        if q.shape[-1] != h * d and tuple(q.shape[-2:]) != (h, d):
            fail(f"{name}: q", f"last dim num_heads * (qk_nope_head_dim + qk_rope_head_dim) = {h} * {d} = {h * d}",
                 f"shape {tuple(q.shape)}", "pass the q projection's output (RoPE applied to each head's last dims).")
        if kv_c_normed.shape[-1] != lora or kv_c_normed.dim() != 2:
            fail(f"{name}: kv_c_normed", f"(T, kv_lora_rank = {lora})", f"shape {tuple(kv_c_normed.shape)}",
                 "pass the normalized compressed KV (kv_a_layernorm of kv_a_proj_with_mqa's first part).")
        if k_pe.shape[-1] != rope or not (k_pe.dim() == 2 or (k_pe.dim() == 3 and k_pe.shape[1] == 1)):
            fail(f"{name}: k_pe", f"(T, qk_rope_head_dim = {rope}) or (T, 1, {rope})", f"shape {tuple(k_pe.shape)}",
                 "pass the RoPE'd key part of kv_a_proj_with_mqa's output.")
        for arg, t in (("kv_c_normed", kv_c_normed), ("k_pe", k_pe)):
            if t.dtype != q.dtype:
                raise TypeError(f"{name}: {arg} dtype {t.dtype} differs from q dtype {q.dtype}; cast to the model dtype.")
            if t.device != q.device:
                fail(f"{name}: {arg}", f"a tensor on q's device {q.device}", f"one on {t.device}",
                     "move the inputs to one device.")
            tokens = (t.shape[0], q.shape[0])
            if all(type(n) is int for n in tokens) and tokens[0] != tokens[1]:
                fail(f"{name}: {arg}", f"{q.shape[0]} tokens, as many as q", t.shape[0], "pass the same tokens' inputs.")

    def check_traced_inputs(self, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor) -> None:
        """``_check_inputs`` at trace time (the op's fake calls it), without adding guards."""
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        self._check_inputs(q, kv_c_normed, k_pe)
        for arg, t in (("kv_c_normed", kv_c_normed), ("k_pe", k_pe)):
            if statically_known_true(t.shape[0] != q.shape[0]):
                fail(f"{self.layer_name}: {arg}", "as many tokens as q", t.shape[0], "pass the same tokens' inputs.")

    def forward(self, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                output_shape: torch.Size | None = None) -> torch.Tensor:
        """Attend over the paged latent cache; shapes in the class docstring. Returns (T, H * V)."""
        direct = self.use_direct_call
        if not torch.compiler.is_compiling():
            self._check_inputs(q, kv_c_normed, k_pe)
            direct = direct or eager_direct_ok(q, kv_c_normed, k_pe)
        t = q.shape[0]
        if output_shape is None:
            output_shape = torch.Size((t, self.num_heads * self.v_head_dim))
        if q.dim() != 3:
            q = q.view(t, self.num_heads, self.qk_head_dim)
        if k_pe.dim() == 3:
            k_pe = k_pe.squeeze(1)
        output = torch.empty(output_shape, dtype=q.dtype, device=q.device).view(-1, self.num_heads, self.v_head_dim)
        if direct:  # the op's implementation, without the dispatcher
            unified_mla_attention_with_output(q, kv_c_normed, k_pe, output, self.layer_name)
        else:
            torch.ops.vattn.unified_mla_attention_with_output(q, kv_c_normed, k_pe, output, self.layer_name)
        return output.view(output_shape)

    # ---- cache, scales, loading ---------------------------------------------------------

    def get_kv_cache_spec(self, dtype: torch.dtype) -> MLAAttentionSpec:
        """One latent row (``kv_lora_rank + qk_rope_head_dim``) per token, stored as ``dtype``."""
        return MLAAttentionSpec(block_size=self.block_size, num_kv_heads=1, head_size=self.head_size, dtype=dtype,
                                cache_dtype_str=self.kv_cache_dtype, kv_lora_rank=self.kv_lora_rank,
                                qk_rope_head_dim=self.qk_rope_head_dim)

    def set_kv_scales(self, k_scale: float, v_scale: float | None = None, q_scale: float | None = None) -> None:
        """Set the fp8 latent cache's scale (``k_scale``; MLA caches one latent, so ``v_scale`` is
        accepted and ignored, as ``q_scale``: the query stays in the model dtype)."""
        if not k_scale > 0:
            raise ValueError(f"{self.layer_name}: k_scale must be > 0, got {k_scale}.")
        self._k_scale.fill_(float(k_scale))
        self._k_scale_float = float(k_scale)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, qk_nope_head_dim={self.qk_nope_head_dim}, "
                f"qk_rope_head_dim={self.qk_rope_head_dim}, v_head_dim={self.v_head_dim}, "
                f"kv_lora_rank={self.kv_lora_rank}, scale={self.impl.scale}, backend={self.impl.__class__.__name__}, "
                f"name={self.layer_name!r}")

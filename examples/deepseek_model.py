"""A DeepSeek-V3-style decoder whose attention is ``vattn.MLAAttention`` (multi-head latent attention).

Same step interface as ``examples.model`` (one flattened batch per step; the batch structure
reaches attention through ``vattn.set_forward_context``), so ``examples.engine.Engine``,
``vattn.compile`` and ``vattn.CUDAGraphRunner`` run it unchanged:

| input / output | shape | meaning |
| --- | --- | --- |
| ``input_ids``, ``positions`` | (T,) int64 | the step's new tokens and their positions |
| ``forward`` returns | (T, hidden_size) | final hidden states |
| ``compute_logits(hidden)`` | (N, hidden) -> (N, vocab_size) | the LM head |

Modules and parameters carry ``transformers``' ``DeepseekV3ForCausalLM`` names, so its state dict
loads as is. Attention per layer (H heads, N = qk_nope_head_dim, P = qk_rope_head_dim, V =
v_head_dim, L = kv_lora_rank)::

    q           = q_proj(x)  or  q_b_proj(q_a_layernorm(q_a_proj(x)))     (T, H, N + P)
    kv_c, k_pe  = kv_a_proj_with_mqa(x).split([L, P]);  kv_c = kv_a_layernorm(kv_c)
    RoPE on q[..., N:] and k_pe (DeepSeek's interleaved pairs, or halves with rope_interleave=False)
    o_proj(MLAAttention(q, kv_c, k_pe))                                   (kv_b_proj is the layer's)

RoPE: ``default`` and ``yarn`` (DeepSeek's long-context scaling: its cos/sin factor, and
``mscale_all_dim`` folded into the softmax scale), as ``transformers`` computes them. The MLP is
dense in every layer: configs with MoE layers (``first_k_dense_replace < num_hidden_layers``)
raise ``NotImplementedError``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn

from examples.model import RMSNorm
from vattn.mla_layer import MLAAttention

__all__ = ["DeepseekConfig", "DeepseekV3ForCausalLM", "DeepseekRotary", "softmax_scale"]


@dataclass(frozen=True)
class DeepseekConfig:
    """The shape of a DeepSeek-V3-style model (``from_hf`` reads a ``transformers`` DeepseekV3Config)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    rope_interleave: bool = True
    attention_bias: bool = False
    tie_word_embeddings: bool = False

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, hf: Any) -> "DeepseekConfig":
        dense = getattr(hf, "first_k_dense_replace", 0)
        if dense < hf.num_hidden_layers:
            raise NotImplementedError(
                f"first_k_dense_replace = {dense} < num_hidden_layers = {hf.num_hidden_layers}: this example runs "
                "dense MLPs only (no MoE); use a config whose layers are all dense.")
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {hf.hidden_act!r}: the example's MLP is SwiGLU (silu).")
        return cls(
            vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size,
            num_hidden_layers=hf.num_hidden_layers, num_attention_heads=hf.num_attention_heads,
            q_lora_rank=hf.q_lora_rank, kv_lora_rank=hf.kv_lora_rank, qk_nope_head_dim=hf.qk_nope_head_dim,
            qk_rope_head_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim, rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=hf.max_position_embeddings, rope_parameters=dict(hf.rope_parameters),
            rope_interleave=bool(getattr(hf, "rope_interleave", True)), attention_bias=bool(hf.attention_bias),
            tie_word_embeddings=bool(hf.tie_word_embeddings))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(cfg: DeepseekConfig) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under YaRN (DeepSeek's)."""
    scale = cfg.qk_head_dim ** -0.5
    rope = cfg.rope_parameters
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        scale *= _yarn_mscale(rope["factor"], rope["mscale_all_dim"]) ** 2
    return scale


def _inv_freq(cfg: DeepseekConfig) -> tuple[torch.Tensor, float]:
    """(P // 2,) float32 inverse frequencies and the cos/sin factor, as transformers computes them."""
    rope, dim = cfg.rope_parameters, cfg.qk_rope_head_dim
    base = float(rope.get("rope_theta", 10000.0))
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return 1.0 / pos_freqs, 1.0
    if kind != "yarn":
        raise NotImplementedError(f"rope_type {kind!r}: the example implements 'default' and 'yarn'.")
    orig = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or cfg.max_position_embeddings / orig
    mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")
    attention = rope.get("attention_factor")
    if attention is None:
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all) if mscale and mscale_all
                     else _yarn_mscale(factor))
    fast, slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def corr_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr_dim(fast), corr_dim(slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation, float(attention)


class DeepseekRotary(nn.Module):
    """RoPE of the P RoPE dims from float32 tables: ``cos_sin(positions)`` once per step, then
    ``apply(table, x (T, h, P))``; pairs ``(x0, x1), (x2, x3), ...`` (interleaved, DeepSeek's
    checkpoint layout, written out as evens then odds like transformers) or halves."""

    def __init__(self, cfg: DeepseekConfig) -> None:
        super().__init__()
        inv_freq, factor = _inv_freq(cfg)
        freqs = torch.arange(cfg.max_position_embeddings, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        self.register_buffer("cos_cache", freqs.cos() * factor, persistent=False)
        self.register_buffer("sin_cache", freqs.sin() * factor, persistent=False)
        self.interleave = cfg.rope_interleave

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each (T, 1, P // 2) in ``dtype`` (transformers casts its table to the model dtype)."""
        return (self.cos_cache.index_select(0, positions).to(dtype)[:, None],
                self.sin_cache.index_select(0, positions).to(dtype)[:, None])

    def apply(self, table: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        cos, sin = table
        if self.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class DeepseekAttention(nn.Module):
    """DeepSeek's MLA projections around ``vattn.MLAAttention``."""

    def __init__(self, cfg: DeepseekConfig, layer_idx: int, rotary: DeepseekRotary, attn_backend: Any = None) -> None:
        super().__init__()
        h, hid, bias = cfg.num_attention_heads, cfg.hidden_size, cfg.attention_bias
        self.num_heads, self.cfg = h, cfg
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(hid, h * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hid, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hid, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * cfg.v_head_dim, hid, bias=bias)
        self.rotary = [rotary]  # shared table; a list so it is not registered once per layer
        extra = {} if attn_backend is None else {"attn_backend": attn_backend}
        self.attn = MLAAttention(
            h, softmax_scale(cfg), cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.q_lora_rank,
            cfg.kv_lora_rank, self.kv_b_proj, prefix=f"model.layers.{layer_idx}.self_attn.attn", **extra)

    def forward(self, table: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        cfg, t = self.cfg, x.shape[0]
        q = self.q_proj(x) if cfg.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_pass, q_rot = q.view(t, self.num_heads, cfg.qk_head_dim).split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], -1)
        kv_c, k_pe = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        rope = self.rotary[0]
        q = torch.cat([q_pass, rope.apply(table, q_rot)], dim=-1)
        k_pe = rope.apply(table, k_pe[:, None])
        return self.o_proj(self.attn(q, self.kv_a_layernorm(kv_c), k_pe))


class DeepseekMLP(nn.Module):
    def __init__(self, cfg: DeepseekConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, cfg: DeepseekConfig, layer_idx: int, rotary: DeepseekRotary, attn_backend: Any = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DeepseekAttention(cfg, layer_idx, rotary, attn_backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DeepseekMLP(cfg)

    def forward(self, table: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(table, self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekModel(nn.Module):
    def __init__(self, cfg: DeepseekConfig, attn_backend: Any = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary_emb = DeepseekRotary(cfg)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(cfg, i, self.rotary_emb, attn_backend)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        table = self.rotary_emb.cos_sin(positions, x.dtype)  # once per step, shared by the layers
        for layer in self.layers:
            x = layer(table, x)
        return self.norm(x)


class DeepseekV3ForCausalLM(nn.Module):
    """The decoder plus LM head. Build it inside ``vattn.set_current_vattn_config(cfg)``, in the
    model's default dtype and device, then ``load_hf_state_dict`` and ``vattn.allocate_kv_cache``.

    Args:
        config: the model shape (``DeepseekConfig.from_hf``).
        attn_backend: forwarded to every ``vattn.MLAAttention`` (an MLA backend class or name).
    """

    def __init__(self, config: DeepseekConfig, attn_backend: Any = None) -> None:
        super().__init__()
        self.config = config
        self.model = DeepseekModel(config, attn_backend)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def from_hf_config(cls, hf_config: Any, attn_backend: Any = None) -> "DeepseekV3ForCausalLM":
        """Build from a ``transformers`` DeepseekV3Config whose layers are all dense (uninitialised weights)."""
        return cls(DeepseekConfig.from_hf(hf_config), attn_backend)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(T,) token ids and (T,) positions -> (T, hidden_size)."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @torch.no_grad()
    def load_hf_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Copy a ``transformers`` DeepseekV3ForCausalLM state dict in (same names); ``ValueError``
        listing missing / unexpected keys when ``strict``."""
        sd = {k: v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
        result = self.load_state_dict(sd, strict=False)
        missing = [k for k in result.missing_keys if not (self.config.tie_word_embeddings and k == "lm_head.weight")]
        if strict and (missing or result.unexpected_keys):
            raise ValueError(f"load_hf_state_dict: missing keys {missing[:8]}, unexpected keys "
                             f"{result.unexpected_keys[:8]}; is the checkpoint a dense DeepseekV3 model of this config?")

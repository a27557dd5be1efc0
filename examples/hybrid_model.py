"""A Qwen3-Next-style hybrid decoder: Gated DeltaNet (``vattn.GatedDeltaNet``) in three layers of
every four, gated attention (``vattn.Attention``) in the fourth.

Same step interface as ``examples.model`` (one flattened batch per step; the batch structure
reaches the layers through ``vattn.set_forward_context``), so ``examples.engine.Engine``,
``vattn.compile`` and ``vattn.CUDAGraphRunner`` run it unchanged:

| input / output | shape | meaning |
| --- | --- | --- |
| ``input_ids``, ``positions`` | (T,) int64 | the step's new tokens and their positions |
| ``forward`` returns | (T, hidden_size) | final hidden states |
| ``compute_logits(hidden)`` | (N, hidden) -> (N, vocab_size) | the LM head |

The mixer of each layer (HK / HV key / value heads of Dk / Dv dims in the GDN layers; H / Hk
query / KV heads of D dims in the attention layers)::

    GDN:       q, k, v, z, b, a = in_proj(x)       (T, 2*HK*Dk + HV*Dv) | (T, HV*Dv) | (T, HV) | (T, HV)
               o = GatedDeltaNet(qkv, conv_weight, g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b))
               out_proj(RMSNorm(o) * silu(z))      (norm and gate per value head)
    attention: q, gate, k, v = qkv_proj(x);  q, k = RoPE(RMSNorm(q)), RoPE(RMSNorm(k))  (RoPE on the first
               rotary_dim = partial_rotary_factor * D dims);  o_proj(Attention(q, k, v) * sigmoid(gate))

then a SwiGLU MLP in every layer. Qwen3-Next's MoE is left out: the MLP is dense (the big preset
gives it the active width of Qwen3-Next-80B-A3B, 10 routed experts of 512 plus a shared one of 512).
The pre-norms, the final norm and q/k norms are Qwen3-Next's zero-centred ones (``x / rms * (1 + w)``).

Each request keeps the GDN layers' conv and recurrent states in a state slot: allocate the cache
with ``vattn.allocate_kv_cache(cfg, num_blocks, num_state_slots=max_num_seqs)``; the engine's
``InputBatch`` row of a request is its slot. Weights load from ``transformers``'
``Qwen3NextForCausalLM`` built with ``num_experts=0`` (``HybridConfig.to_hf``; ``load_hf_state_dict``
reorders its interleaved projections into the contiguous ones here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

import vattn
from examples.model import RotaryEmbedding
from examples.model import init_random_weights as _init_dense

__all__ = ["HYBRID_PRESETS", "HybridConfig", "HybridForCausalLM", "get_hybrid_preset", "init_random_weights"]


@dataclass(frozen=True)
class HybridConfig:
    """Shape of a Qwen3-Next-style model (``transformers.Qwen3NextConfig``'s field names).

    ``layer_types``: "linear_attention" (GDN) or "full_attention" per layer; empty: attention in
    every ``full_attention_interval``-th layer (layers 3, 7, ... for 4), as Qwen3-Next."""

    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 16
    linear_value_head_dim: int = 16
    linear_conv_kernel_dim: int = 4
    full_attention_interval: int = 4
    layer_types: tuple[str, ...] = ()
    partial_rotary_factor: float = 0.25
    rope_theta: float = 10_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_types", tuple(self.layer_types) or tuple(
            "full_attention" if (i + 1) % self.full_attention_interval == 0 else "linear_attention"
            for i in range(self.num_hidden_layers)))
        if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= {
                "full_attention", "linear_attention"}:
            raise ValueError(f"layer_types: expected {self.num_hidden_layers} entries of 'full_attention' / "
                             f"'linear_attention', got {self.layer_types}; leave it empty for the interval pattern.")
        for a, b, what in ((self.num_attention_heads, self.num_key_value_heads, "num_attention_heads"),
                           (self.linear_num_value_heads, self.linear_num_key_heads, "linear_num_value_heads")):
            if a % b:
                raise ValueError(f"{what} ({a}): expected a multiple of the key heads ({b}).")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"partial_rotary_factor ({self.partial_rotary_factor}): expected head_dim * factor an "
                             f"even number in (0, head_dim = {self.head_dim}], got {self.rotary_dim}.")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf(cls, hf: Any) -> "HybridConfig":
        """Read a ``transformers`` Qwen3NextConfig whose MLPs are dense (``num_experts=0``)."""
        if getattr(hf, "model_type", None) != "qwen3_next":
            raise NotImplementedError(f"hf_config.model_type {getattr(hf, 'model_type', None)!r}: expected "
                                      "'qwen3_next' (transformers.Qwen3NextConfig).")
        if moe := [i for i in range(hf.num_hidden_layers) if hf.num_experts > 0 and i not in hf.mlp_only_layers
                   and (i + 1) % hf.decoder_sparse_step == 0]:
            raise NotImplementedError(f"layers {moe[:8]} are MoE; this example runs dense MLPs only: build the "
                                      "config with num_experts=0.")
        if (rope := dict(hf.rope_parameters)).get("rope_type", "default") != "default":
            raise NotImplementedError(f"rope_type {rope['rope_type']!r}: the example implements 'default' only.")
        return cls(vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size,
                   num_hidden_layers=hf.num_hidden_layers, num_attention_heads=hf.num_attention_heads,
                   num_key_value_heads=hf.num_key_value_heads, head_dim=hf.head_dim,
                   linear_num_key_heads=hf.linear_num_key_heads, linear_num_value_heads=hf.linear_num_value_heads,
                   linear_key_head_dim=hf.linear_key_head_dim, linear_value_head_dim=hf.linear_value_head_dim,
                   linear_conv_kernel_dim=hf.linear_conv_kernel_dim, layer_types=tuple(hf.layer_types),
                   partial_rotary_factor=float(rope.get("partial_rotary_factor", 1.0)),
                   rope_theta=float(rope["rope_theta"]), rms_norm_eps=hf.rms_norm_eps,
                   max_position_embeddings=hf.max_position_embeddings, tie_word_embeddings=hf.tie_word_embeddings)

    def to_hf(self, **overrides: Any) -> Any:
        """The matching ``transformers.Qwen3NextConfig`` (dense MLPs; for tests and benchmarks)."""
        import transformers

        kwargs = {k: getattr(self, k) for k in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
            "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "rms_norm_eps",
            "max_position_embeddings", "tie_word_embeddings")}
        kwargs.update(layer_types=list(self.layer_types), num_experts=0, rope_parameters={
            "rope_type": "default", "rope_theta": self.rope_theta, "partial_rotary_factor": self.partial_rotary_factor})
        kwargs.update(overrides)
        return transformers.Qwen3NextConfig(**kwargs)


HYBRID_PRESETS: dict[str, HybridConfig] = {
    # CPU tests and demos: 4 layers (GDN, GDN, GDN, attention).
    "qwen3-next-tiny": HybridConfig(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                                    linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32),
    # Qwen3-Next-80B-A3B's widths (attention 16 q / 2 KV heads of 256, GDN 16 k / 32 v heads of 128,
    # conv 4, partial RoPE 0.25) in 16 layers (12 GDN, 4 attention), dense MLP of the active width.
    "qwen3-next-16l": HybridConfig(vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                                   num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                                   linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                                   linear_value_head_dim=128, max_position_embeddings=32768),
}


def get_hybrid_preset(name: str, **overrides: Any) -> HybridConfig:
    """A preset by name (``HYBRID_PRESETS``), with optional field overrides."""
    if name not in HYBRID_PRESETS:
        raise ValueError(f"unknown hybrid preset {name!r}; choose one of {sorted(HYBRID_PRESETS)}.")
    if "layer_types" not in overrides and {"num_hidden_layers", "full_attention_interval"} & overrides.keys():
        overrides["layer_types"] = ()  # the interval pattern over the new depth
    return replace(HYBRID_PRESETS[name], **overrides)


class OffsetRMSNorm(nn.Module):
    """Qwen3-Next's zero-centred RMSNorm: ``x / rms(x) * (1 + weight)`` in float32, cast back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.zeros(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """``weight * RMSNorm(x) * silu(z)`` over the last dim (the GDN output gate), as transformers rounds it."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (y * F.silu(z.float())).to(x.dtype)


class GatedAttention(nn.Module):
    """q / output-gate / k / v in one projection (rows: H*D q, H*D gate, Hk*D k, Hk*D v), per-head
    q/k norms, partial RoPE, ``vattn.Attention``, ``o_proj(out * sigmoid(gate))``."""

    def __init__(self, cfg: HybridConfig, layer_idx: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.h, self.hk, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.rot = cfg.rotary_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, (2 * self.h + 2 * self.hk) * self.d, bias=False)
        self.q_norm, self.k_norm = OffsetRMSNorm(self.d, cfg.rms_norm_eps), OffsetRMSNorm(self.d, cfg.rms_norm_eps)
        self.o_proj = nn.Linear(self.h * self.d, cfg.hidden_size, bias=False)
        self.rope = [rope]  # shared table; a list so it is not registered once per layer
        self.attn = vattn.Attention(self.h, self.d, self.d**-0.5, num_kv_heads=self.hk,
                                    prefix=f"model.layers.{layer_idx}.self_attn.attn")

    def _rope(self, cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """(T, heads, D) with its first ``rotary_dim`` dims rotated (the rest passes)."""
        return torch.cat((self.rope[0].apply(cos_sin, x[..., : self.rot]), x[..., self.rot :]), dim=-1)

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        t, h, hk, d = x.shape[0], self.h, self.hk, self.d
        qkv = self.qkv_proj(x)
        gate = qkv[:, h * d : 2 * h * d]  # a 2-D slice: no reshape of a strided view
        q, _, k, v = qkv.view(t, 2 * h + 2 * hk, d).split([h, h, hk, hk], dim=1)
        out = self.attn(self._rope(cos_sin, self.q_norm(q)), self._rope(cos_sin, self.k_norm(k)), v)
        return self.o_proj(out * torch.sigmoid(gate))


class GatedDeltaNetMixer(nn.Module):
    """The GDN block: one input projection (rows: q, k, v (the conv's channels), z, b, a), the
    ``vattn.GatedDeltaNet`` layer (conv + silu + gated delta rule, state per request slot), the
    gated norm per value head and the output projection."""

    def __init__(self, cfg: HybridConfig, layer_idx: int) -> None:
        super().__init__()
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv, kernel = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
        self.hv, self.dv, self.conv_dim = hv, dv, 2 * hk * dk + hv * dv
        self.in_proj = nn.Linear(cfg.hidden_size, self.conv_dim + hv * dv + 2 * hv, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, kernel))
        self.dt_bias, self.A_log = nn.Parameter(torch.ones(hv)), nn.Parameter(torch.zeros(hv))
        self.norm = GatedRMSNorm(dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(hv * dv, cfg.hidden_size, bias=False)
        self.gdn = vattn.GatedDeltaNet(hk, hv, dk, dv, kernel, prefix=f"model.layers.{layer_idx}.linear_attn.gdn")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, hv, dv = x.shape[0], self.hv, self.dv
        mixed_qkv, z, b, a = self.in_proj(x).split([self.conv_dim, hv * dv, hv, hv], dim=-1)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # log decay, (T, HV) float32
        o = self.gdn(mixed_qkv, self.conv_weight, None, g, b.sigmoid())  # (T, HV, Dv)
        return self.out_proj(self.norm(o, z.view(t, hv, dv)).view(t, hv * dv))


class MLP(nn.Module):
    """SwiGLU with gate and up fused: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class HybridLayer(nn.Module):
    """Pre-norm mixer (GDN or gated attention, by ``layer_types``) and MLP, each added to the residual."""

    def __init__(self, cfg: HybridConfig, layer_idx: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.is_attention = cfg.layer_types[layer_idx] == "full_attention"
        if self.is_attention:
            self.self_attn = GatedAttention(cfg, layer_idx, rope)
        else:
            self.linear_attn = GatedDeltaNetMixer(cfg, layer_idx)
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(x)
        x = x + (self.self_attn(cos_sin, h) if self.is_attention else self.linear_attn(h))
        return x + self.mlp(self.post_attention_layernorm(x))


class HybridModel(nn.Module):
    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary_emb = RotaryEmbedding(cfg.rotary_dim, cfg.max_position_embeddings, cfg.rope_theta)
        self.layers = nn.ModuleList(HybridLayer(cfg, i, self.rotary_emb) for i in range(cfg.num_hidden_layers))
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos_sin = self.rotary_emb.cos_sin(positions, x.dtype)  # once per step, shared by the attention layers
        for layer in self.layers:
            x = layer(cos_sin, x)
        return self.norm(x)


class HybridForCausalLM(nn.Module):
    """The hybrid decoder plus LM head. Build it inside ``vattn.set_current_vattn_config(cfg)``;
    parameters are created in ``torch.get_default_dtype()`` on the default device (then
    ``load_hf_state_dict`` or ``init_random_weights``)."""

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.config = config
        self.model = HybridModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> "HybridForCausalLM":
        return cls(HybridConfig.from_hf(hf_config))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(T,) token ids and (T,) positions -> (T, hidden_size) final hidden states."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden_size) -> (N, vocab_size) logits, in the model dtype."""
        return self.lm_head(hidden)

    @torch.no_grad()
    def load_hf_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Copy a ``transformers`` Qwen3NextForCausalLM state dict (dense MLPs) in.

        Reordered on the way: q_proj's per-head [q; gate] rows into all q then all gates (k, v
        appended: ``qkv_proj``), in_proj_qkvz / in_proj_ba's per-key-head groups into q, k, v, z,
        b, a (``in_proj``), gate/up fused, the conv weight (C, 1, K) as (C, K). Raises
        ``ValueError`` naming missing / unexpected keys (when ``strict``) or a mis-shaped tensor."""
        sd = {k: v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
        if self.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        ours, missing = _from_hf(sd, self.config)
        for name, p in self.named_parameters():
            if name not in ours:
                missing.append(name)
            elif tuple(ours[name].shape) != tuple(p.shape):
                raise ValueError(f"state_dict tensor for {name} has shape {tuple(ours[name].shape)}, expected "
                                 f"{tuple(p.shape)}; build the model from the checkpoint's config (from_hf_config).")
            else:
                p.copy_(ours[name])
        if strict and (missing or sd):
            raise ValueError(f"load_hf_state_dict: missing keys {missing[:8]} (total {len(missing)}), unexpected keys "
                             f"{sorted(sd)[:8]} (total {len(sd)}); is the checkpoint a Qwen3-Next model of this config "
                             "with dense MLPs?")


def _from_hf(sd: dict[str, torch.Tensor], cfg: HybridConfig) -> tuple[dict[str, torch.Tensor], list[str]]:
    """This model's tensors from a transformers state dict; the keys used are popped from ``sd``
    (what stays is unexpected). Returns (tensors by parameter name, missing transformers keys)."""
    out: dict[str, torch.Tensor] = {}
    missing: list[str] = []

    def put(name: str, *keys: str, fn: Any = lambda x: x) -> None:  # out[name] = fn(*sd.pop(keys))
        missing.extend(absent := [k for k in keys if k not in sd])
        parts = [sd.pop(k) for k in keys if k in sd]
        if not absent:
            out[name] = fn(*parts)

    h, d = cfg.num_attention_heads, cfg.head_dim
    hk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = cfg.linear_num_value_heads // hk

    def qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # q: per head [q (D); gate (D)]
        qg = q.reshape(h, 2, d, -1)
        return torch.cat([qg[:, 0].reshape(h * d, -1), qg[:, 1].reshape(h * d, -1), k, v])

    def in_proj(qkvz: torch.Tensor, ba: torch.Tensor) -> torch.Tensor:  # per key head [q k v z], [b a]
        g = qkvz.reshape(hk, 2 * dk + 2 * r * dv, -1)
        q, k, v, z = g.split([dk, dk, r * dv, r * dv], dim=1)
        b, a = ba.reshape(hk, 2 * r, -1).split([r, r], dim=1)
        return torch.cat([x.reshape(-1, x.shape[-1]) for x in (q, k, v, z, b, a)])

    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")[: 3 - cfg.tie_word_embeddings]:
        put(name, name)
    for i, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{i}."
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight", "mlp.down_proj.weight"):
            put(p + name, p + name)
        put(p + "mlp.gate_up_proj.weight", p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight",
            fn=lambda g, u: torch.cat([g, u]))
        if kind == "full_attention":
            a = p + "self_attn."
            put(a + "qkv_proj.weight", a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight", fn=qkv)
            for name in ("q_norm.weight", "k_norm.weight", "o_proj.weight"):
                put(a + name, a + name)
        else:
            a = p + "linear_attn."
            put(a + "in_proj.weight", a + "in_proj_qkvz.weight", a + "in_proj_ba.weight", fn=in_proj)
            put(a + "conv_weight", a + "conv1d.weight", fn=lambda w: w.reshape(w.shape[0], -1))
            for name in ("dt_bias", "A_log", "norm.weight", "out_proj.weight"):
                put(a + name, a + name)
    return out, missing


@torch.no_grad()
def init_random_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Seeded random weights for this model or a transformers Qwen3NextForCausalLM (same names where
    they share them): ``examples.model.init_random_weights`` (linear ~ N(0, std)), then the
    zero-centred norms near 0 (scale near 1), the GDN conv ~ N(0, 1/K) (a unit-gain filter) and
    decays ``A = exp(A_log)`` ~ U(0.01, 1) (memories from about one to a hundred tokens)."""
    _init_dense(model, seed=seed, std=std)
    g = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")) or name == "model.norm.weight":
            p.sub_(1.0)  # 1 + jitter -> jitter
        elif "conv" in name.rpartition(".")[2] or name.endswith("conv1d.weight"):
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
        elif name.endswith("A_log"):
            p.copy_(torch.empty(p.shape).uniform_(0.01, 1.0, generator=g).log())
        elif name.endswith("dt_bias"):
            p.fill_(1.0)

"""A Llama / Qwen3-style decoder whose attention is ``vattn.Attention``.

The model takes one flattened batch per step, the way a paged-attention engine runs it:

| input / output | shape | meaning |
| --- | --- | --- |
| ``input_ids`` | (T,) int64 | new tokens of every request in the step, concatenated (decodes first) |
| ``positions`` | (T,) int64 | each token's position in its own sequence |
| ``forward`` returns | (T, hidden_size) | final hidden states (after the last RMSNorm) |
| ``compute_logits(hidden)`` | (N, hidden) -> (N, vocab_size) | the LM head, on the rows you sample from |

The batch structure (which tokens belong to which request, where their K/V live) never
enters the model: it reaches the attention op through ``vattn.set_forward_context``. So
``forward`` has no data-dependent Python branches and no host syncs, and
``torch.compile(model, fullgraph=True, dynamic=True)`` traces it once for every batch.

Weights use Hugging Face names, with q/k/v and gate/up fused::

    model = DecoderForCausalLM.from_hf_config(hf_model.config)   # inside vattn.set_current_vattn_config
    model.load_hf_state_dict(hf_model.state_dict())

Tensor parallelism: pass ``tp=`` (``examples.tp.TensorParallel``, from ``init_tensor_parallel``
under ``torchrun``) and every rank builds its shard: column-parallel QKV and gate/up, row-parallel
o_proj / down_proj, vocab-parallel embedding and LM head (see ``examples/tp.py``).
``load_hf_state_dict`` and ``init_random_weights`` take the full tensors and keep this rank's
slices, so every TP size runs the same model. The residual stream is carried beside the hidden
states, as in vLLM's models: a layer returns its MLP's un-reduced output and the residual, and the
next step (the next layer's input norm, or the final norm) does ``all-reduce -> + residual ->
RMSNorm`` in one call, one kernel where FlashInfer's fused all-reduce is enabled
(``TensorParallel.enable_fused_norm``).

RoPE: ``default``, ``linear`` and ``llama3`` (Llama 3.1/3.2) scaling are implemented and
match ``transformers``; other ``rope_type``s (yarn, dynamic, longrope) raise
``NotImplementedError``. Sliding-window layers (Qwen3 ``use_sliding_window=True``) are
not supported by this example and raise too.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Mapping

import torch
from torch import nn

import vattn
from examples.allreduce import rms_norm
from examples.tp import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear, ShardedModule, TensorParallel,
                         VocabParallelEmbedding, attention_shards, split_rows)

__all__ = [
    "ModelConfig",
    "PRESETS",
    "DecoderForCausalLM",
    "RMSNorm",
    "RotaryEmbedding",
    "get_preset",
    "rotate_half",
    "init_random_weights",
]


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama / Qwen3-style decoder.

    Args:
        arch: ``"llama"`` or ``"qwen3"`` (Qwen3 adds an RMSNorm over each q/k head: ``qk_norm``).
        max_position_embeddings: rows of the RoPE cos/sin table (the longest supported sequence).
        rope_scaling: the Hugging Face ``rope_scaling`` dict (``rope_type`` default, linear, llama3) or None.
    """

    arch: str = "llama"
    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False

    @property
    def qk_norm(self) -> bool:
        return self.arch == "qwen3"

    def __post_init__(self) -> None:
        if self.arch not in ("llama", "qwen3"):
            raise ValueError(f"ModelConfig.arch must be 'llama' or 'qwen3', got {self.arch!r}.")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})."
            )

    @classmethod
    def from_hf(cls, hf_config: Any) -> "ModelConfig":
        """Read a ``transformers`` LlamaConfig / Qwen3Config (4.x or 5.x spelling of RoPE)."""
        model_type = getattr(hf_config, "model_type", "llama")
        if model_type not in ("llama", "qwen3"):
            raise NotImplementedError(
                f"hf_config.model_type {model_type!r} is not supported; the example model "
                "implements 'llama' and 'qwen3' (LlamaConfig, Qwen3Config)."
            )
        layer_types = getattr(hf_config, "layer_types", None) or []
        if getattr(hf_config, "use_sliding_window", False) or "sliding_attention" in layer_types:
            raise NotImplementedError(
                "sliding-window layers (use_sliding_window=True) are not supported by the example "
                "model; build the config with use_sliding_window=False."
            )
        rope = _hf_rope_parameters(hf_config)
        theta = float(rope.pop("rope_theta"))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        flags = {k: bool(getattr(hf_config, k, False)) for k in ("tie_word_embeddings", "attention_bias", "mlp_bias")}
        return cls(
            arch=model_type, vocab_size=hf_config.vocab_size, hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size, num_hidden_layers=hf_config.num_hidden_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim, rms_norm_eps=hf_config.rms_norm_eps, rope_theta=theta,
            rope_scaling=None if rope_type == "default" else rope,
            max_position_embeddings=hf_config.max_position_embeddings, **flags,
        )

    def to_hf(self, **overrides: Any) -> Any:
        """The matching ``transformers`` config (needs transformers; for tests and benchmarks)."""
        import transformers

        kwargs = {k: v for k, v in asdict(self).items() if k not in ("arch", "mlp_bias", "rope_scaling")}
        if self.rope_scaling is not None:
            kwargs["rope_scaling"] = dict(self.rope_scaling)
        if self.arch == "llama":
            kwargs["mlp_bias"] = self.mlp_bias
            cls = transformers.LlamaConfig
        else:
            if self.mlp_bias:
                raise ValueError("Qwen3 has no mlp_bias; set ModelConfig.mlp_bias=False.")
            cls = transformers.Qwen3Config
            kwargs["use_sliding_window"] = False
        kwargs.update(overrides)
        return cls(**kwargs)


def _hf_rope_parameters(hf_config: Any) -> dict[str, Any]:
    """``{"rope_type": ..., "rope_theta": ..., ...}`` from a 5.x ``rope_parameters`` or a 4.x config."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return dict(params)
    params = dict(getattr(hf_config, "rope_scaling", None) or {})
    params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    return params


PRESETS: dict[str, ModelConfig] = {
    # CPU default: small enough that generate.py runs in seconds.
    "tiny": ModelConfig(
        vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
    ),
    "tiny-qwen3": ModelConfig(
        arch="qwen3", vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
        tie_word_embeddings=True,
    ),
    "llama-3.2-1b": ModelConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ),
    "llama-3-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=8192,
    ),
}


def get_preset(name: str, **overrides: Any) -> ModelConfig:
    """A preset by name (``PRESETS``), with optional field overrides."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}.")
    return replace(PRESETS[name], **overrides)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, computed in float32 like ``transformers`` (weight applied after the cast back)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def _inv_freq(head_dim: int, theta: float, scaling: Mapping[str, Any] | None) -> torch.Tensor:
    """(head_dim // 2,) float32 inverse frequencies, with ``linear`` / ``llama3`` scaling as in transformers."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    assert scaling is not None
    if float(scaling.get("partial_rotary_factor", 1.0)) != 1.0:
        raise NotImplementedError("partial_rotary_factor != 1 is not supported by the example model.")
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise NotImplementedError(
        f"rope_type {rope_type!r} is not supported by the example model; use 'default', 'linear' or 'llama3'."
    )


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``cat(-x2, x1)`` of the two halves of the last dim (neox-style RoPE, as transformers writes it)."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE from a precomputed float32 cos/sin table.

    ``forward(positions (T,), q (T, H, D), k (T, Hk, D)) -> (q, k)`` rotated, in the input dtype.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        inv_freq = _inv_freq(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, D)
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each (T, 1, D) in ``dtype``: gathered once per step and shared by all layers.

        Positions must lie in ``[0, max_position_embeddings)``: CPU positions are checked when not
        compiling (a device's would cost a sync; ``Engine.add_request`` refuses requests that
        would run past the table)."""
        if not torch.compiler.is_compiling() and positions.device.type == "cpu" and positions.numel():
            lo, hi, rows = int(positions.min()), int(positions.max()), self.cos_cache.shape[0]
            if lo < 0 or hi >= rows:
                raise ValueError(
                    f"positions: expected values in [0, max_position_embeddings = {rows}), got {lo}..{hi}; "
                    "shorten the sequence or build the model with a larger max_position_embeddings.")
        return (self.cos_cache.index_select(0, positions).to(dtype)[:, None, :],
                self.sin_cache.index_select(0, positions).to(dtype)[:, None, :])

    @staticmethod
    def apply(cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """``x`` (T, heads, D) rotated: ``x * cos + rotate_half(x) * sin``."""
        cos, sin = cos_sin
        return x * cos + rotate_half(x) * sin

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos_sin = self.cos_sin(positions, q.dtype)
        return self.apply(cos_sin, q), self.apply(cos_sin, k)


class SelfAttention(nn.Module):
    """Fused QKV projection, optional per-head q/k RMSNorm, RoPE, ``vattn.Attention``, output projection.

    Under tensor parallelism the heads here are this rank's (``examples.tp.attention_shards``).
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int, rope: RotaryEmbedding,
                 attn_backend: Any = None, tp: TensorParallel | None = None) -> None:
        super().__init__()
        tp = tp or TensorParallel()
        q_rows, kv_rows = attention_shards(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, tp)
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = q_rows.size, kv_rows.size
        self.num_heads, self.num_kv_heads = self.q_size // self.head_dim, self.kv_size // self.head_dim
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [q_rows, kv_rows, kv_rows], bias=cfg.attention_bias)
        self.o_proj = RowParallelLinear(q_rows, cfg.hidden_size, tp, bias=cfg.attention_bias, reduce_results=False)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rope = [rope]  # shared table; a list so it is not registered once per layer
        extra = {} if attn_backend is None else {"attn_backend": attn_backend}
        self.attn = vattn.Attention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, num_kv_heads=self.num_kv_heads,
            prefix=f"model.layers.{layer_idx}.self_attn.attn", **extra,
        )

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """``cos_sin``: the step's RoPE table rows (``RotaryEmbedding.cos_sin``); x (T, hidden) ->
        (T, hidden) o_proj output, this rank's partial sums under tensor parallelism."""
        T, H, Hk = x.shape[0], self.num_heads, self.num_kv_heads
        # Heads split on the contiguous projection output: no reshape of a strided slice
        # (which would make a compiled graph guard on the token count being 1).
        qkv = self.qkv_proj(x).view(T, H + 2 * Hk, self.head_dim)
        if self.qk_norm:
            q, k, v = qkv.split([H, Hk, Hk], dim=1)
            q, k = self.rope[0].apply(cos_sin, self.q_norm(q)), self.rope[0].apply(cos_sin, self.k_norm(k))
        else:
            # q and k rotated as one (T, H + Hk, D) tensor: one kernel, and fewer ops for
            # Dynamo to trace in every layer (compile time grows with depth).
            q, k = self.rope[0].apply(cos_sin, qkv[:, : H + Hk]).split([H, Hk], dim=1)
            v = qkv[:, H + Hk :]
        out = self.attn(q, k, v)
        return self.o_proj(out)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` with gate and up fused into one matmul (this rank's
    slice); under tensor parallelism it returns this rank's partial sums (not all-reduced)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        tp = tp or TensorParallel()
        rows = split_rows(cfg.intermediate_size, tp, "intermediate_size")
        self.intermediate_size = rows.size
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [rows, rows], bias=cfg.mlp_bias)
        self.down_proj = RowParallelLinear(rows, cfg.hidden_size, tp, bias=cfg.mlp_bias, reduce_results=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks over a residual stream carried beside the hidden states."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rope: RotaryEmbedding, attn_backend: Any = None,
                 tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.tp = tp or TensorParallel()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg, layer_idx, rope, attn_backend, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, hidden): the embeddings (``residual`` None, first layer) or the previous layer's
        MLP output (partial sums under tensor parallelism); residual (T, hidden): the stream before
        that output. Returns this layer's MLP output (not yet reduced) and its residual."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.tp.all_reduce_add_rms_norm(x, residual, self.input_layernorm)
        h, residual = self.tp.all_reduce_add_rms_norm(self.self_attn(cos_sin, h), residual,
                                                      self.post_attention_layernorm)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, attn_backend: Any = None, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.tp = tp = tp or TensorParallel()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                          cfg.rope_scaling)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, self.rotary_emb, attn_backend, tp) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos_sin = self.rotary_emb.cos_sin(positions, x.dtype)  # once per step, as transformers does
        residual = None
        for layer in self.layers:
            x, residual = layer(cos_sin, x, residual)
        if residual is None:  # no layers
            return self.norm(x)
        return self.tp.all_reduce_add_rms_norm(x, residual, self.norm)[0]


class DecoderForCausalLM(nn.Module):
    """The decoder plus LM head. Build it inside ``vattn.set_current_vattn_config(cfg)``.

    Args:
        config: the model shape (``ModelConfig``; see ``from_hf_config`` and ``PRESETS``).
        attn_backend: forwarded to every ``vattn.Attention`` (a backend class or name) to force one.
        tp: this rank's ``examples.tp.TensorParallel``; default: one process, no parallelism.

    Parameters are created uninitialised in ``torch.get_default_dtype()`` on the default device
    (use ``with torch.device("cuda")``; then ``load_hf_state_dict`` or ``init_random_weights``);
    the RoPE table stays float32.
    """

    def __init__(self, config: ModelConfig, attn_backend: Any = None, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp or TensorParallel()
        self.model = DecoderModel(config, attn_backend, self.tp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, self.tp)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def from_hf_config(cls, hf_config: Any, attn_backend: Any = None,
                       tp: TensorParallel | None = None) -> "DecoderForCausalLM":
        """Build from a ``transformers`` LlamaConfig or Qwen3Config (uninitialised weights)."""
        return cls(ModelConfig.from_hf(hf_config), attn_backend, tp)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(T,) token ids and (T,) positions -> (T, hidden_size) final hidden states."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden_size) -> (N, vocab_size) logits, in the model dtype (all of them, on every rank)."""
        return self.lm_head(hidden)

    @torch.no_grad()
    def load_hf_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Copy a ``transformers`` Llama/Qwen3 state dict in (q/k/v and gate/up are fused here).

        ``state_dict`` holds the full (unsharded) tensors; under tensor parallelism each rank
        keeps its slices (``ShardedModule.shard``). Raises ``ValueError`` listing missing /
        unexpected keys when ``strict``.
        """
        sd = dict(state_dict)
        fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
        missing: list[str] = []
        for name, module, leaf, param in _params_with_owner(self, remove_duplicate=False):
            if name == "lm_head.weight" and self.config.tie_word_embeddings and name not in sd:
                continue  # tied to embed_tokens, loaded there
            parent, _, proj = name.rpartition(".")[0].rpartition(".")
            keys = [f"{parent}.{part}.{leaf}" for part in fused[proj]] if proj in fused else [name]
            if any(k not in sd for k in keys):
                missing += [k for k in keys if k not in sd]
                continue
            src = torch.cat([sd.pop(k) for k in keys], dim=0)
            sharded = isinstance(module, ShardedModule)
            full = module.full_shape(leaf) if sharded else tuple(param.shape)
            if tuple(src.shape) != full:
                raise ValueError(
                    f"state_dict {keys} has shape {tuple(src.shape)}, expected {full} for "
                    f"{name}; build the model from the same config as the checkpoint."
                )
            param.copy_(module.shard(leaf, src) if sharded else src)
        unexpected = [k for k in sd if not k.endswith("rotary_emb.inv_freq")]
        if self.config.tie_word_embeddings:
            unexpected = [k for k in unexpected if k != "lm_head.weight"]
        if strict and (missing or unexpected):
            raise ValueError(
                f"load_hf_state_dict: missing keys {missing[:8]} (total {len(missing)}), unexpected keys "
                f"{unexpected[:8]} (total {len(unexpected)}); is the checkpoint a Llama/Qwen3 model of "
                "this config?"
            )


def _params_with_owner(model: nn.Module, remove_duplicate: bool = True
                       ) -> list[tuple[str, nn.Module, str, nn.Parameter]]:
    """(name, owning module, leaf name, parameter) in ``named_parameters`` order."""
    out, seen = [], set()
    for mod_name, module in model.named_modules(remove_duplicate=remove_duplicate):
        for leaf, p in module.named_parameters(recurse=False, remove_duplicate=remove_duplicate):
            if remove_duplicate and id(p) in seen:
                continue
            seen.add(id(p))
            out.append((f"{mod_name}.{leaf}" if mod_name else leaf, module, leaf, p))
    return out


@torch.no_grad()
def init_random_weights(model: nn.Module, seed: int = 0, std: float = 0.02, norm_jitter: float = 0.1) -> None:
    """Seeded random weights: linear/embedding ~ N(0, std), norms ~ 1 + U(-jitter, jitter), biases ~ N(0, std).

    Draws on each parameter's device (so large GPU models initialise fast); the same seed and
    device give the same weights. Tensor-parallel parameters (``ShardedModule``) draw the full
    tensor and keep this rank's slice, so every TP size gets the TP=1 model's weights.
    """
    gens: dict[torch.device, torch.Generator] = {}
    for name, module, leaf, p in _params_with_owner(model):
        g = gens.get(p.device)
        if g is None:
            g = gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
        sharded = isinstance(module, ShardedModule)
        shape = module.full_shape(leaf) if sharded else p.shape
        if name.endswith("norm.weight") or "_norm." in name or "layernorm" in name:
            full = 1 + norm_jitter * (2 * torch.rand(shape, generator=g, device=p.device) - 1)
        else:
            full = std * torch.randn(shape, generator=g, device=p.device, dtype=torch.float32)
        p.copy_(module.shard(leaf, full) if sharded else full)

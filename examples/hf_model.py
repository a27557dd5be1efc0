#!/usr/bin/env python
"""transformers models for vattn's adapter (``vattn.integrations.transformers``): tiny random
configs of nine families, the benchmark's full-size shapes, and random checkpoints on disk.

| name | what |
| --- | --- |
| ``FAMILIES`` | the families the adapter is tested on, each a tiny config (``tiny_config``) exercising its attention features |
| ``SHAPES`` | Llama-3.2-1B, Qwen3-0.6B and Gemma-3-1B shapes (``shape_config``), random weights for benchmarks |
| ``random_model`` | a ``*ForCausalLM`` of a config with seeded random weights (eager attention, compile-friendly MoE experts) |
| ``save_random_checkpoint`` | ``save_pretrained`` of a random model (config.json + safetensors), with a byte-level tokenizer if asked |

    python examples/hf_model.py /tmp/tiny-llama --family llama --tokenizer   # then:
    python examples/generate.py --hf /tmp/tiny-llama --prompt "Hello"

Needs transformers (>= 4.56); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python examples/hf_model.py` from anywhere
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from examples.model import init_random_weights

__all__ = ["FAMILIES", "SHAPES", "random_model", "save_random_checkpoint", "shape_config", "tiny_config"]

_SMALL = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False)

#: family -> (transformers config class, overrides of ``_SMALL``): what each tiny config exercises.
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    # GQA, Llama-3 RoPE scaling with an original context shorter than the sequences.
    "llama": ("LlamaConfig", dict(rope_theta=10000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    # Sliding window on every layer (config.sliding_window, no layer types).
    "mistral": ("MistralConfig", dict(sliding_window=16, head_dim=16)),
    # q/k/v biases; layer 0 full, layer 1 sliding (use_sliding_window, max_window_layers).
    "qwen2": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1)),
    # Per-head q/k RMSNorm, head_dim != hidden / heads, MQA, tied embeddings.
    "qwen3": ("Qwen3Config", dict(head_dim=32, num_key_value_heads=1, tie_word_embeddings=True)),
    # Attention and final logit soft caps, alternating sliding / full layers, query_pre_attn_scalar != head_dim.
    "gemma2": ("Gemma2Config", dict(head_dim=16, sliding_window=16, attn_logit_softcapping=0.5,
                                    final_logit_softcapping=2.0, query_pre_attn_scalar=24, tie_word_embeddings=True)),
    # Local and global layers (their own RoPE bases), q/k norm, query_pre_attn_scalar != head_dim.
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, num_hidden_layers=3, sliding_window=16, query_pre_attn_scalar=24,
                                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                        tie_word_embeddings=True)),
    # Fused qkv_proj and gate_up_proj, a sliding window on every layer.
    "phi3": ("Phi3Config", dict(sliding_window=24)),
    # RMSNorm over the whole q / k projections, norms after the sublayers.
    "olmo2": ("Olmo2Config", dict()),
    # Attention sinks, alternating sliding / full layers, YaRN RoPE, a mixture of experts.
    "gpt_oss": ("GptOssConfig", dict(head_dim=16, sliding_window=16, num_local_experts=4, num_experts_per_tok=2,
                                     intermediate_size=64)),
}

#: Full-size shapes (random weights) for benchmarks.
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-3.2-1b": ("LlamaConfig", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
        tie_word_embeddings=True, rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    "qwen3-0.6b": ("Qwen3Config", dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
        tie_word_embeddings=True)),
    # 5 sliding (window 512) : 1 global layers, as the checkpoint's layer_types; RoPE bases from the config defaults.
    "gemma-3-1b": ("Gemma3TextConfig", dict(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512, rms_norm_eps=1e-6,
        max_position_embeddings=32768, tie_word_embeddings=True,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)])),
}

#: Families whose experts the adapter's tests and compile need as batched matmuls, not the
#: eager loop over the experts a batch hits (data-dependent: no fullgraph compile).
_MOE_EXPERTS = "batched_mm"


def _config(table: dict[str, tuple[str, dict[str, Any]]], name: str, base: dict[str, Any], **overrides: Any) -> Any:
    import transformers

    if name not in table:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(table)}.")
    cls_name, kwargs = table[name]
    return getattr(transformers, cls_name)(**{**base, **kwargs, **overrides})


def tiny_config(family: str, **overrides: Any) -> Any:
    """The tiny transformers config of ``family`` (``FAMILIES``), with field overrides."""
    return _config(FAMILIES, family, _SMALL, **overrides)


def shape_config(name: str, **overrides: Any) -> Any:
    """A full-size config of ``SHAPES`` (e.g. ``"llama-3.2-1b"``), with field overrides."""
    return _config(SHAPES, name, {}, **overrides)


def random_model(config: Any, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 seed: int = 0, std: float = 0.05, attn_implementation: str = "eager") -> Any:
    """``AutoModelForCausalLM`` of ``config`` built in ``dtype`` on ``device``, seeded random weights
    (``examples.model.init_random_weights``), in eval mode. Mixture-of-experts layers use batched
    matmuls where transformers lets one choose (``set_experts_implementation``, transformers 5)."""
    import transformers

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    finally:
        torch.set_default_dtype(old)
    # Norm weights: transformers' own initial value (1, or 0 where the norm scales by 1 + w, as
    # Gemma's) plus init_random_weights' jitter, so every family's norms start near identity.
    initial = {n: p.detach().clone() for n, p in model.named_parameters() if _is_norm(n)}
    init_random_weights(model, seed=seed, std=std)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in initial:
                p.copy_(initial[name] + (p - 1))
    set_experts = getattr(model, "set_experts_implementation", None)
    if callable(set_experts) and getattr(model.config, "num_local_experts", None):
        set_experts(_MOE_EXPERTS)
    model.generation_config.pad_token_id = config.pad_token_id
    return model.eval()


def _is_norm(name: str) -> bool:
    """The parameters ``init_random_weights`` treats as norm weights (1 + jitter)."""
    return name.endswith("norm.weight") or "_norm." in name or "layernorm" in name


def byte_tokenizer() -> Any:
    """A byte-level tokenizer (256 byte tokens, then ``<pad>``, ``<s>``, ``</s>``), built offline."""
    import tokenizers
    import transformers
    from tokenizers import decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{ch: i + 3 for i, ch in enumerate(sorted(alphabet))}}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                                eos_token="</s>")


def save_random_checkpoint(path: str | Path, family: str = "llama", *, tokenizer: bool = False, seed: int = 0,
                           **overrides: Any) -> Path:
    """A tiny random ``family`` model saved with ``save_pretrained`` (config.json + safetensors) in
    ``path``, and a byte-level tokenizer beside it when ``tokenizer``. Returns the directory."""
    path = Path(path)
    model = random_model(tiny_config(family, **overrides), seed=seed)
    model.save_pretrained(path)
    if tokenizer:
        byte_tokenizer().save_pretrained(path)
    return path


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description="Save a tiny random transformers checkpoint (for generate.py --hf).")
    p.add_argument("path", help="directory to write config.json, model.safetensors (and tokenizer files)")
    p.add_argument("--family", default="llama", choices=sorted(FAMILIES))
    p.add_argument("--tokenizer", action="store_true", help="also save a byte-level tokenizer")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    out = save_random_checkpoint(args.path, args.family, tokenizer=args.tokenizer, seed=args.seed)
    print(f"saved a random {args.family} checkpoint to {out}")
    return out


if __name__ == "__main__":
    main()

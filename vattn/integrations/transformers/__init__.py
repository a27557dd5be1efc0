"""Hugging Face ``transformers`` models on vattn: ``attn_implementation="vattn"`` and a step adapter.

Importing this module registers the attention implementation "vattn" with transformers
(``AttentionInterface``). ``wrap`` (or ``from_pretrained``) gives every attention module of a
causal LM its own ``vattn.Attention``, built from the model's config and modules (heads, head
size, scale, per-layer sliding window, soft cap, sinks), and returns a ``VattnCausalLM``: one
flattened step of many requests, as vattn runs a model::

    import torch, vattn
    from vattn.integrations import transformers as vt

    cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=16))
    model = vt.from_pretrained("path/to/checkpoint", cfg, dtype=torch.bfloat16, device="cuda")
    kv = vattn.allocate_kv_cache(cfg, num_blocks=2048, device="cuda", dtype=torch.bfloat16)
    common = kv.common_metadata(query_lens=[5], num_computed_tokens=[0], block_tables=[[0]])
    with vattn.set_forward_context(kv.build_metadata(common), cfg):
        hidden = model(input_ids, positions)            # (T,), (T,) -> (T, hidden_size)
    logits = model.compute_logits(hidden[-1:])          # the rows you sample from

``vattn.compile(model, cfg)``, ``vattn.CUDAGraphRunner`` and ``examples/engine.py`` take the
result as they take the example model. Hybrids (Qwen3-Next, Qwen3.5, OLMo-Hybrid, Mamba, Mamba-2,
Bamba, Granite-4, Nemotron-H, Falcon-H1, Falcon-Mamba, Jamba, LFM2, MiniMax) run their mixers on
vattn's mixer layers (``mixers.py``), a state slot per request: allocate the cache with
``num_state_slots`` and pass ``state_indices=`` to ``kv.common_metadata``. The transformers model's own ``generate()`` runs on a
paged cache allocated for each call (``generate.py``): its tokens are transformers' own. Needs transformers >= 4.56 (``pip install "vattn[transformers]"``).
"""

from __future__ import annotations

try:
    import transformers as _transformers
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "vattn.integrations.transformers needs the transformers package (>= 4.56); install it with "
        "pip install 'vattn[transformers]'."
    ) from e

_MIN_VERSION = (4, 56)
if tuple(int(p) for p in _transformers.__version__.split(".")[:2] if p.isdigit()) < _MIN_VERSION:
    raise ImportError(
        f"vattn.integrations.transformers needs transformers >= 4.56, found {_transformers.__version__}; "
        "upgrade with pip install -U 'transformers>=4.56'."
    )

from vattn.integrations.transformers.layers import (
    SUPPORTED_LAYER_TYPES,
    LayerSpec,
    UnsupportedAttentionError,
    attention_modules,
    layer_spec,
)
from vattn.integrations.transformers.mixers import MIXER_CLASSES, MixerSpec, mixer_modules
from vattn.integrations.transformers.model import (
    ATTN_IMPLEMENTATION,
    VattnCausalLM,
    from_pretrained,
    register,
    vattn_attention_forward,
    wrap,
)

register()

__all__ = [
    "ATTN_IMPLEMENTATION",
    "LayerSpec",
    "MIXER_CLASSES",
    "MixerSpec",
    "SUPPORTED_LAYER_TYPES",
    "UnsupportedAttentionError",
    "VattnCausalLM",
    "attention_modules",
    "from_pretrained",
    "layer_spec",
    "mixer_modules",
    "register",
    "vattn_attention_forward",
    "wrap",
]

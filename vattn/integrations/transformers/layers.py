"""What each attention module of a ``transformers`` model asks of ``vattn.Attention``, read at build time.

Everything comes from the model's own modules and config, the way its attention code reads
them: heads and head size, the softmax scale (``module.scaling``: Gemma's
``query_pre_attn_scalar`` is already in it), the layer's sliding window (``config.layer_types``
with ``config.sliding_window``; models without layer types slide every layer when
``config.sliding_window`` is set, as their mask code does), the logit soft cap
(``attn_logit_softcapping``), attention sinks (``module.sinks``, gpt-oss) and ALiBi slopes
(``module.alibi_slopes``, where a module has them). Nothing here runs per step.

What the adapter cannot run is refused here, before the model is touched, by an
``UnsupportedAttentionError`` naming the module path and the reason.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

import vattn
from vattn.integrations.transformers.mixers import UnsupportedAttentionError, mixer_kind
from vattn.layer import Attention

if TYPE_CHECKING:
    from vattn.integrations.transformers.mixers import MixerSpec

__all__ = ["LayerSpec", "SUPPORTED_LAYER_TYPES", "UnsupportedAttentionError", "attention_modules", "build_layers",
           "layer_spec"]

#: ``config.layer_types`` entries of attention modules the adapter runs ("hybrid": Falcon-H1's layers of full
#: attention beside a Mamba mixer); any other (chunked, linear, ...) is refused. Mixer modules: ``mixers.py``.
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention", "hybrid")

#: Attributes of multi-head latent attention modules (DeepSeek-V2/V3 style).
_MLA_ATTRIBUTES = ("kv_a_proj_with_mqa", "kv_b_proj", "q_a_proj")


#: Module names transformers gives a decoder's cross-attention (BART / Whisper ``encoder_attn``,
#: BERT ``crossattention``).
_CROSS_ATTENTION_NAMES = ("encoder_attn", "crossattention", "cross_attn", "cross_attention")


@dataclass(frozen=True)
class LayerSpec:
    """One attention module's ``vattn.Attention`` arguments.

    | field | meaning |
    | --- | --- |
    | path | the module's path in the model, e.g. ``"model.layers.3.self_attn"`` (the vattn layer is ``path + ".attn"``) |
    | num_heads, num_kv_heads, head_size | H, Hk, D |
    | scale | the softmax scale (``module.scaling``) |
    | sliding_window | keys a query sees, itself included; None for full attention |
    | logits_soft_cap | ``cap * tanh(s / cap)`` on the scores, or None |
    | sinks | the module's (H,) sink logits (a parameter of the model), or None |
    | alibi_slopes | H slopes, or None |
    """

    path: str
    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    sinks: torch.Tensor | None = None
    alibi_slopes: tuple[float, ...] | None = None

    @property
    def prefix(self) -> str:
        """The ``vattn.Attention`` layer name: the module path of the layer attached to the module."""
        return f"{self.path}.attn"


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) of each attention module: a class named ``*Attention`` (transformers'
    convention), outermost only (an attention module inside another is the other's business);
    the linear-attention mixers ``mixers.py`` serves are left out."""
    found: list[tuple[str, nn.Module]] = []
    for path, module in model.named_modules():
        if isinstance(module, Attention) or not type(module).__name__.endswith("Attention"):
            continue
        if mixer_kind(module) is not None:  # MiniMax's lightning attention: a mixer (mixers.py)
            continue
        if any(path.startswith(outer + ".") for outer, _ in found):
            continue
        found.append((path, module))
    return found


def _refuse(path: str, module: nn.Module, reason: str) -> UnsupportedAttentionError:
    return UnsupportedAttentionError(f"{path} ({type(module).__name__}): {reason}")


@functools.lru_cache(maxsize=None)
def _dispatches_through_interface(cls: type) -> bool | None:
    """Whether ``cls.forward`` calls transformers' ``AttentionInterface`` (None: source unavailable)."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return None
    return "ALL_ATTENTION_FUNCTIONS" in source or "attention_interface" in source


@functools.lru_cache(maxsize=None)
def _gates_output(cls: type) -> bool:
    """Whether ``cls.forward`` splits an output gate off ``q_proj`` and applies it after attention
    (Qwen3-Next's and Qwen3.5's gated attention: ``torch.chunk(q_proj(x), 2)``, ``* sigmoid(gate)``)."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return "torch.sigmoid(gate)" in source and "self.q_proj(hidden_states)" in source and "chunk" in source


def _layer_type(module: nn.Module, config: Any) -> str | None:
    layer_types = getattr(config, "layer_types", None)
    layer_idx = getattr(module, "layer_idx", None)
    if not layer_types or not isinstance(layer_idx, int) or not 0 <= layer_idx < len(layer_types):
        return None
    return layer_types[layer_idx]


def _check_supported(path: str, module: nn.Module, config: Any) -> None:
    """Raise ``UnsupportedAttentionError`` for what the adapter cannot run."""
    name = type(module).__name__
    if (getattr(module, "is_cross_attention", False) or "CrossAttention" in name
            or path.rsplit(".", 1)[-1] in _CROSS_ATTENTION_NAMES):
        raise _refuse(path, module, "cross-attention (encoder-decoder) is not supported by the vattn adapter; "
                                    "it runs decoder-only causal LMs")
    if getattr(config, "is_encoder_decoder", False):
        raise _refuse(path, module, "an encoder-decoder model (its encoder attends both ways, its decoder reads "
                                    "the encoder through cross-attention) is not supported by the vattn adapter; "
                                    "it runs decoder-only causal LMs")
    if any(hasattr(module, a) for a in _MLA_ATTRIBUTES) or getattr(config, "kv_lora_rank", None):
        raise _refuse(path, module, "multi-head latent attention (MLA) is not adapted yet; build the model "
                                    "with vattn.MLAAttention layers (examples/deepseek_model.py loads "
                                    "DeepseekV3ForCausalLM weights) or use standard (GQA/MQA/MHA) attention")
    if getattr(module, "is_causal", True) is False:
        raise _refuse(path, module, "non-causal (bidirectional) attention; the adapter runs causal decoder "
                                    "self-attention only")
    if getattr(module, "is_kv_shared_layer", False):
        raise _refuse(path, module, "KV sharing across layers is not supported by the adapter")
    layer_type = _layer_type(module, config)
    if layer_type is not None and layer_type not in SUPPORTED_LAYER_TYPES:
        raise _refuse(path, module, f"layer type {layer_type!r} (config.layer_types) is not supported; the "
                                    f"adapter runs {list(SUPPORTED_LAYER_TYPES)}")
    if not isinstance(getattr(module, "head_dim", None), int):
        raise _refuse(path, module, "no integer head_dim attribute: not a transformers attention module the "
                                    "adapter can read")
    if _dispatches_through_interface(type(module)) is False:
        raise _refuse(path, module, "its forward does not dispatch through transformers' AttentionInterface, "
                                    "so attn_implementation='vattn' cannot replace its attention")
    if getattr(config, "alibi", False) and getattr(module, "alibi_slopes", None) is None:
        raise _refuse(path, module, "ALiBi given as an attention-mask bias; the adapter builds no mask and "
                                    "needs the slopes on the module (alibi_slopes)")


def _sliding_window(module: nn.Module, config: Any) -> int | None:
    layer_type = _layer_type(module, config)
    if layer_type is not None:
        window = getattr(config, "sliding_window", None) if layer_type == "sliding_attention" else None
    elif hasattr(module, "sliding_window"):
        window = module.sliding_window
    else:
        window = getattr(config, "sliding_window", None)
    return int(window) if window else None


def layer_spec(path: str, module: nn.Module, config: Any) -> LayerSpec:
    """The ``LayerSpec`` of the attention module at ``path``; ``config`` is the model's (text)
    config, used where the module has no config of its own. Raises ``UnsupportedAttentionError``."""
    own = getattr(module, "config", None)
    config = own if own is not None else config
    _check_supported(path, module, config)
    head_size = module.head_dim
    num_heads = (getattr(module, "num_heads", None) or getattr(module, "num_attention_heads", None)
                 or config.num_attention_heads)
    num_kv_heads = (getattr(module, "num_key_value_heads", None) or getattr(config, "num_key_value_heads", None)
                    or num_heads)
    q_proj = getattr(module, "q_proj", None)
    width = num_heads * head_size * (2 if _gates_output(type(module)) else 1)  # Qwen3-Next: [query; gate] per head
    if isinstance(q_proj, nn.Linear) and q_proj.out_features != width:
        raise _refuse(path, module, f"q_proj has {q_proj.out_features} outputs, expected {width} (num_heads * "
                                    f"head_dim = {num_heads} * {head_size}, twice that with an output gate); "
                                    "tensor-parallel shards are not supported")
    sinks = getattr(module, "sinks", None)
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (num_heads,)):
        raise _refuse(path, module, f"sinks must be a ({num_heads},) tensor (one logit per query head), got "
                                    f"{getattr(sinks, 'shape', type(sinks).__name__)}")
    cap = getattr(module, "attn_logit_softcapping", getattr(config, "attn_logit_softcapping", None))
    alibi = getattr(module, "alibi_slopes", None)
    return LayerSpec(
        path=path, num_heads=int(num_heads), num_kv_heads=int(num_kv_heads), head_size=head_size,
        scale=float(getattr(module, "scaling", head_size**-0.5)), sliding_window=_sliding_window(module, config),
        logits_soft_cap=float(cap) if cap else None, sinks=sinks,
        alibi_slopes=None if alibi is None else tuple(float(s) for s in torch.as_tensor(alibi).flatten().tolist()),
    )


def build_layers(specs: list[LayerSpec], mixer_specs: list["MixerSpec"], vattn_config: "vattn.VattnConfig",
                 dtype: torch.dtype, device: torch.device, attn_backend: Any, prefix: str) -> list[nn.Module]:
    """One ``vattn.Attention`` per spec, then one mixer layer per mixer spec, built in the model
    dtype on its device; on error none stays registered."""
    layers: list[nn.Module] = []
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with vattn.set_current_vattn_config(vattn_config), torch.device(device):
            for s in specs:
                extra: dict[str, Any] = {} if s.sinks is None else {"sinks": s.sinks}
                if attn_backend is not None:
                    extra["attn_backend"] = attn_backend
                layers.append(Attention(
                    s.num_heads, s.head_size, s.scale, num_kv_heads=s.num_kv_heads,
                    alibi_slopes=None if s.alibi_slopes is None else list(s.alibi_slopes),
                    logits_soft_cap=s.logits_soft_cap, per_layer_sliding_window=s.sliding_window,
                    prefix=prefix + s.prefix, **extra))
            layers += [m.build(prefix) for m in mixer_specs]
    except Exception:
        context = vattn_config.compilation.static_forward_context
        for layer in layers:
            context.pop(layer.layer_name, None)
        raise
    finally:
        torch.set_default_dtype(old)
    return layers

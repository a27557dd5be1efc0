"""The stateful token mixers of transformers hybrids (Mamba, Gated DeltaNet, short convolutions,
lightning attention) on vattn's mixer layers, found and built at wrap time.

Each mixer module transformers ships for a family below gets a ``vattn`` mixer layer at
``module.mixer`` (layer name ``<module path>.mixer``) and a subclass of its class whose
``forward`` runs the module's own projections, norms and gating (``mixer_forwards.py``: a
re-statement of transformers' code with the module's weights) around that layer, which keeps each
request's conv and recurrent state in its state slot:

| kind | vattn layer | transformers modules |
| --- | --- | --- |
| ``gdn`` | ``GatedDeltaNet`` | Qwen3-Next, Qwen3.5 (dense and MoE), OLMo-Hybrid ``*GatedDeltaNet`` |
| ``mamba2`` | ``Mamba2Mixer`` | Mamba-2, Bamba, Granite-4 (GraniteMoeHybrid), Nemotron-H, Falcon-H1 |
| ``mamba1`` | ``Mamba1Mixer`` | Mamba, Falcon-Mamba, Jamba |
| ``short_conv`` | ``ShortConv`` | LFM2, LFM2-MoE |
| ``linear_attention`` | ``LinearAttention`` | MiniMax (lightning attention) |

A request's state lives in the slot the step's metadata names (``state_indices``: the engine's
row of the request); a request whose ``num_computed_tokens`` is 0 starts from zeros. Mixer
modules of other classes (e.g. Kimi-Linear, Zamba, LFM3) are refused by name, before the
model is touched: their formulas were not checked against these layers.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

import vattn
from vattn.integrations.transformers import mixer_forwards as fw
from vattn.mixers.base import MambaBase

__all__ = ["MIXER_CLASSES", "MixerSpec", "attach_mixers", "mixer_kind", "mixer_modules", "mixer_spec"]

#: transformers mixer classes the adapter serves, by kind (the name of the class; subclasses by name too).
MIXER_CLASSES: dict[str, str] = {
    "Qwen3NextGatedDeltaNet": "gdn", "Qwen3_5GatedDeltaNet": "gdn", "Qwen3_5MoeGatedDeltaNet": "gdn",
    "OlmoHybridGatedDeltaNet": "gdn",
    "Mamba2Mixer": "mamba2", "BambaMixer": "mamba2", "GraniteMoeHybridMambaLayer": "mamba2",
    "NemotronHMamba2Mixer": "mamba2", "FalconH1Mixer": "mamba2",
    "MambaMixer": "mamba1", "FalconMambaMixer": "mamba1", "JambaMambaMixer": "mamba1",
    "Lfm2ShortConv": "short_conv", "Lfm2MoeShortConv": "short_conv",
    "MiniMaxLightningAttention": "linear_attention",
}

# Class names of stateful mixers in general: one of these that MIXER_CLASSES does not list is refused.
_MIXER_NAME = re.compile(r"(GatedDeltaNet|Mixer|MambaLayer|ShortConv|ShortConvolution|LightningAttention|"
                         r"LinearAttention)$")

#: What each kind reads from the module (weights, submodules, sizes), besides per-class projections.
_NEEDS = {
    "gdn": ("conv1d", "A_log", "dt_bias", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim"),
    "mamba2": ("in_proj", "conv1d", "dt_bias", "A_log", "D", "norm", "out_proj", "num_heads", "head_dim",
               "ssm_state_size", "n_groups", "intermediate_size", "conv_dim"),
    "mamba1": ("in_proj", "conv1d", "x_proj", "dt_proj", "A_log", "D", "out_proj", "intermediate_size",
               "ssm_state_size", "time_step_rank"),
    "short_conv": ("in_proj", "conv", "out_proj"),
    "linear_attention": ("qkv_proj", "output_gate", "norm", "out_proj", "slope_rate", "act_fn",
                         "num_attention_heads", "head_dim"),
}

_FORWARDS: dict[str, Callable[[nn.Module, torch.Tensor], torch.Tensor]] = {
    "gdn": fw.gdn, "mamba2": fw.mamba2, "mamba1": fw.mamba1, "short_conv": fw.short_conv,
    "linear_attention": fw.lightning,
}


class UnsupportedAttentionError(NotImplementedError):
    """An attention or mixer module the vattn adapter cannot run; the message names its path and why
    (defined here, below ``layers``, which imports this module)."""


def _refuse(path: str, module: nn.Module, reason: str) -> Exception:
    return UnsupportedAttentionError(f"{path} ({type(module).__name__}): {reason}")


def mixer_kind(module: nn.Module) -> str | None:
    """The kind of a transformers mixer module the adapter serves (``MIXER_CLASSES``), else None."""
    for cls in type(module).__mro__:
        if cls.__name__ in MIXER_CLASSES:
            return MIXER_CLASSES[cls.__name__]
    return None


def _looks_stateful(module: nn.Module) -> bool:
    """A mixer the adapter does not list: its class name, or an ``A_log`` parameter of its own."""
    return bool(_MIXER_NAME.search(type(module).__name__)) or isinstance(module._parameters.get("A_log"), torch.Tensor)


def mixer_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) of each stateful mixer module of ``model``, outermost only; raises
    ``UnsupportedAttentionError`` for one whose class the adapter does not serve."""
    found: list[tuple[str, nn.Module]] = []
    for path, module in model.named_modules():
        if isinstance(module, MambaBase) or any(path.startswith(p + ".") for p, _ in found):
            continue
        if mixer_kind(module) is not None:
            found.append((path, module))
        elif _looks_stateful(module):
            raise _refuse(path, module, "a stateful token mixer the vattn adapter does not serve (it serves "
                                        f"{sorted(MIXER_CLASSES)}); its recurrence was not checked against vattn's "
                                        "mixer layers. Run the model with transformers itself, or build it from "
                                        "vattn.GatedDeltaNet / Mamba2Mixer / Mamba1Mixer / ShortConv / "
                                        "LinearAttention layers.")
    return found


@dataclass(frozen=True)
class MixerSpec:
    """One mixer module's vattn layer: its kind, the layer class and its arguments.

    | field | meaning |
    | --- | --- |
    | path | the module's path, e.g. ``"model.layers.0.linear_attn"`` (the layer is ``path + ".mixer"``) |
    | kind | ``"gdn"``, ``"mamba2"``, ``"mamba1"``, ``"short_conv"`` or ``"linear_attention"`` |
    | layer | the vattn layer class name (``"GatedDeltaNet"`` ...) |
    | args, kwargs | its constructor's arguments (besides ``prefix``) |
    """

    path: str
    kind: str
    layer: str
    args: tuple[int, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def prefix(self) -> str:
        return f"{self.path}.mixer"

    def build(self, prefix: str = "") -> MambaBase:
        return getattr(vattn, self.layer)(*self.args, prefix=prefix + self.prefix, **self.kwargs)


def _silu_conv(path: str, module: nn.Module) -> None:
    act = getattr(module, "activation", "silu")
    if act not in ("silu", "swish"):
        raise _refuse(path, module, f"conv activation {act!r}; vattn's mixer layers apply silu after the conv "
                                    "(the activation of every released checkpoint of this family)")


def mixer_spec(path: str, module: nn.Module) -> MixerSpec:
    """The ``MixerSpec`` of the mixer module at ``path``; raises ``UnsupportedAttentionError`` for
    a variant the adapter cannot run (a missing weight, an activation other than silu)."""
    kind = mixer_kind(module)
    if kind is None:
        raise _refuse(path, module, "not a mixer module the adapter serves")
    missing = [n for n in _NEEDS[kind] if not hasattr(module, n)]
    if missing:
        raise _refuse(path, module, f"no {missing} attribute: not the transformers module layout the adapter reads "
                                    "(a forward replaced by a hub kernel, or another version of the class)")
    m: Any = module
    if kind == "gdn":
        _silu_conv(path, module)
        k = m.conv1d.weight.shape[-1]
        return MixerSpec(path, kind, "GatedDeltaNet", (m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim, k))
    if kind == "mamba2":
        _silu_conv(path, module)
        if m.intermediate_size != m.num_heads * m.head_dim:
            raise _refuse(path, module, f"intermediate_size {m.intermediate_size} != num_heads * head_dim = "
                                        f"{m.num_heads} * {m.head_dim}")
        low, high = getattr(m, "time_step_limit", None) or (0.0, math.inf)
        return MixerSpec(path, kind, "Mamba2Mixer", (m.num_heads, m.head_dim, m.ssm_state_size, m.n_groups,
                                                     m.conv1d.weight.shape[-1]), {"dt_limit": (low, high)})
    if kind == "mamba1":
        _silu_conv(path, module)
        return MixerSpec(path, kind, "Mamba1Mixer", (m.intermediate_size, m.ssm_state_size, m.conv1d.weight.shape[-1]))
    if kind == "short_conv":
        w = m.conv.weight
        return MixerSpec(path, kind, "ShortConv", (w.shape[0], w.shape[-1]))
    h, d = m.num_attention_heads, m.head_dim
    if m.qkv_proj.out_features != 3 * h * d:
        raise _refuse(path, module, f"qkv_proj has {m.qkv_proj.out_features} outputs, expected 3 * heads * head_dim "
                                    f"= {3 * h * d}")
    return MixerSpec(path, kind, "LinearAttention", (h, d))


def attach_mixers(found: list[tuple[str, nn.Module]], specs: list[MixerSpec], layers: list[MambaBase]) -> None:
    """Give each module its layer (``module.mixer``) and the class whose forward runs it."""
    for (_, module), spec, layer in zip(found, specs, layers):
        module.mixer = layer
        module.__class__ = _served_class(type(module), spec.kind)


#: The served classes by their attribute name here: a class made at run time is found by name
#: (``__getattr__``), as pickle and a stored Dynamo trace's type guards look classes up.
_SERVED: dict[str, type] = {}


@functools.lru_cache(maxsize=None)
def _served_class(cls: type, kind: str) -> type:
    """A subclass of transformers' mixer class whose ``forward`` runs the vattn layer (the module
    keeps its parameters, state dict and ``isinstance`` checks, and prints under transformers'
    name); found here by a name of its own (``copy.deepcopy``, ``torch.save``, stored traces)."""
    params = list(inspect.signature(cls.forward).parameters)[2:]  # after self, hidden_states
    mask_at = params.index("attention_mask") if "attention_mask" in params else None
    returns_tuple = kind == "linear_attention"  # MiniMax's decoder unpacks (output, weights)
    core = _FORWARDS[kind]

    def forward(self: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        mask = args[mask_at] if mask_at is not None and len(args) > mask_at else kwargs.get("attention_mask")
        cache = kwargs.get("cache", kwargs.get("cache_params", kwargs.get("past_key_values")))
        out = fw.run(self, core, hidden_states, mask, cache)
        return (out, None) if returns_tuple else out

    forward.__doc__ = f"transformers' {cls.__name__}.forward with its state on vattn ({kind}): (B, q, hidden) -> same."
    digest = hashlib.sha256(f"{cls.__module__}.{cls.__qualname__}".encode()).hexdigest()[:12]
    key = f"_Vattn{cls.__name__}_{digest}"
    _SERVED[key] = type(key, (cls,), {"forward": forward, "__module__": __name__, "_vattn_kind": kind,
                                      "_get_name": lambda self: cls.__name__})
    return _SERVED[key]


def __getattr__(name: str) -> type:
    if name in _SERVED:
        return _SERVED[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""``attn_implementation="vattn"`` and the model adapter that runs a transformers causal LM as vattn's step.

transformers calls an attention implementation as ``fn(module, query, key, value,
attention_mask, scaling=..., dropout=..., **kwargs)`` with query (B, H, T, D) and key/value
(B, Hk, T, D), and expects ((B, T, H, D), weights). With vattn's flattened step B is 1 and T is
every token of the step: ``vattn_attention_forward`` hands (T, H, D) views to the
``vattn.Attention`` attached to the module (``module.attn``), which writes K/V into the paged
cache and attends with the step's metadata from ``vattn.set_forward_context``.

No attention mask is built: transformers skips mask creation for an implementation that has no
mask function registered (``AttentionMaskInterface``), so "vattn" registers none. The step
therefore costs no O(T^2) mask and nothing data-dependent reaches ``torch.compile``; the batch
structure lives in vattn's metadata. The per-call ``scaling`` / ``sliding_window`` / ``softcap``
/ ``s_aux`` keyword arguments are ignored: each layer was built with them (``layers.py``).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from torch import nn

import vattn
from vattn.compile_passes.packed_linears import pack_linear_weights
from vattn.forward_context import get_forward_context, is_forward_context_available
from vattn.integrations.transformers.generate import generate
from vattn.integrations.transformers.inputs import check_hidden, check_positions, check_step_inputs
from vattn.integrations.transformers.layers import (LayerSpec, UnsupportedAttentionError, attention_modules,
                                                     build_layers, layer_spec)
from vattn.integrations.transformers.mixers import MixerSpec, attach_mixers, mixer_modules, mixer_spec
from vattn.integrations.transformers.norms import fuse_rms_norms
from vattn.layer import Attention
from vattn.mixers.base import MambaBase

__all__ = ["ATTN_IMPLEMENTATION", "VattnCausalLM", "from_pretrained", "register", "vattn_attention_forward", "wrap"]

logger = logging.getLogger("vattn")

#: The ``attn_implementation`` name this module registers with transformers.
ATTN_IMPLEMENTATION = "vattn"


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    logger.warning(message)


def vattn_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None,
                            dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract on vattn.

    | tensor | shape |
    | --- | --- |
    | query | (1, H, T, D) |
    | key, value | (1, Hk, T, D) |
    | returns | ((1, T, H, D), None) |
    """
    layer = module._modules.get("attn")  # a submodule: not through nn.Module.__getattr__'s Python fallback
    if not torch.compiler.is_compiling():
        if not isinstance(layer, Attention) or query.shape[0] != 1:
            raise ValueError(
                f"{type(module).__name__}: attn_implementation='vattn' runs one flattened step (batch 1) through "
                f"the vattn.Attention at module.attn; got query {tuple(query.shape)} and attn "
                f"{type(layer).__name__}. Wrap the model first (vattn.integrations.transformers.wrap(model, cfg)): "
                "then its generate() runs on vattn's paged cache, and the VattnCausalLM wrap returns runs steps.")
        if not is_forward_context_available():
            raise RuntimeError(
                f"{type(module).__name__}: the model runs its attention on vattn, which reads each step's batch "
                "from vattn.set_forward_context; it was called without one (a plain forward of the transformers "
                f"model). {_USE_INSTEAD}")
        if key.shape[2] != query.shape[2]:
            raise NotImplementedError(
                f"{type(module).__name__}: key: expected as many tokens as the query ({query.shape[2]}), got "
                f"{key.shape[2]}: transformers' own KV cache is in use (past_key_values, use_cache=True: generate() "
                "or a decoding loop over the transformers model), and vattn keeps the cache itself. "
                f"{_USE_INSTEAD}")
        if kwargs.get("use_cache") and getattr(module, "layer_idx", 0) == 0:
            _check_direct_call(kwargs.get("position_ids"))
        if attention_mask is not None:
            _warn_once("attn_implementation='vattn' got an attention mask from transformers: it is ignored (the "
                       "step's metadata defines what each token attends to), but building it costs time.")
    out = layer(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1))  # (T, H * D)
    return out.view(1, -1, layer.num_heads, layer.head_size), None


_USE_INSTEAD = ("Generate with the transformers model's generate() (wrap installs one that runs on vattn's cache), "
                "examples/generate.py --hf DIR or examples.engine.Engine, or run steps yourself: call the "
                "VattnCausalLM as model(input_ids, positions) inside "
                "vattn.set_forward_context(kv.build_metadata(common), cfg).")


def _check_direct_call(position_ids: Any) -> None:
    """A forward of the transformers model itself inside a forward context (transformers' default
    ``use_cache=True``; ``VattnCausalLM`` passes False and checks its own inputs): its position ids
    (transformers counts from 0 without a cache of its own) against the step's metadata."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.device.type != "cpu" or position_ids.dim() != 2:
        return
    check_positions(position_ids[0], _metadata_of(get_forward_context()), name="position_ids",
                    fix="a forward of the transformers model counts positions from 0 unless given position_ids; "
                        "call the VattnCausalLM as model(input_ids, positions) with each token's position")


def register() -> None:
    """Register ``attn_implementation="vattn"`` with transformers (idempotent; importing
    ``vattn.integrations.transformers`` does it). No mask function is registered: see the module docstring."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, vattn_attention_forward)


class VattnCausalLM(nn.Module):
    """A transformers causal LM whose attention runs on vattn, as one flattened step of many requests.

    | call | shapes |
    | --- | --- |
    | ``forward(input_ids, positions)`` | (T,) int64, (T,) int64 -> (T, hidden_size) final hidden states |
    | ``compute_logits(hidden)`` | (N, hidden_size) -> (N, vocab_size), with the model's final logit soft cap / scale |

    The batch structure reaches attention through ``vattn.set_forward_context``; no attention
    mask and no transformers cache are used. Works with ``vattn.allocate_kv_cache``,
    ``vattn.compile``, ``vattn.CUDAGraphRunner`` and ``examples/engine.py`` as the example model
    does. Build it with ``wrap`` or ``from_pretrained``.

    Hybrids (Mamba, Gated DeltaNet, short-conv and lightning-attention layers, ``mixers.py``)
    keep a state per request: allocate the cache with ``num_state_slots`` and give each request a
    slot (``kv.common_metadata(..., state_indices=...)``; the engine uses its row).

    Attributes: ``hf_model`` (the transformers model, attention now "vattn"), ``config`` (its
    config), ``vattn_config``, ``layer_specs`` (one ``LayerSpec`` per attention module),
    ``mixer_specs`` (one ``MixerSpec`` per mixer module).
    """

    def __init__(self, hf_model: nn.Module, vattn_config: vattn.VattnConfig, layer_specs: tuple[LayerSpec, ...],
                 decoder_path: tuple[str, ...], head_name: str, mixer_specs: tuple[MixerSpec, ...] = ()) -> None:
        super().__init__()
        self.hf_model = hf_model
        self.config = hf_model.config
        self.vattn_config = vattn_config
        self.layer_specs = layer_specs
        self.mixer_specs = mixer_specs
        self._decoder_path = decoder_path  # attribute names from hf_model to its decoder (the base model)
        self._head_name = head_name
        text = _text_config(hf_model)
        self._logit_scale = getattr(text, "logit_scale", None)  # Cohere: logits * scale
        self._logits_scaling = getattr(text, "logits_scaling", None)  # Granite: logits / scaling
        self._softcap = getattr(text, "final_logit_softcapping", None)  # Gemma 2/3
        embed = hf_model.get_input_embeddings() if hasattr(hf_model, "get_input_embeddings") else None
        self._vocab_size: int | None = getattr(embed, "num_embeddings", None) or getattr(text, "vocab_size", None)
        self._hidden_size: int | None = getattr(getattr(hf_model, head_name, None), "in_features", None)
        self._embedding = (embed,)  # in a tuple: not registered a second time as a submodule
        weight = getattr(getattr(hf_model, head_name, None), "weight", None)
        self._head_dtype = weight.dtype if isinstance(weight, torch.Tensor) and weight.is_floating_point() else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(T,) token ids and (T,) positions -> (T, hidden_size) final hidden states.

        Eager calls check the inputs first (``inputs.py``: shapes, dtypes and devices; ids and
        positions that are on the host, against the vocabulary and the step's metadata), before
        anything is written to the KV cache."""
        if not torch.compiler.is_compiling():
            if not is_forward_context_available():
                raise RuntimeError(
                    "VattnCausalLM: called outside vattn.set_forward_context; the step's batch (which tokens belong "
                    "to which request, where their K/V go) comes from it. Call model(input_ids, positions) inside "
                    "`with vattn.set_forward_context(kv.build_metadata(common), cfg):`, or inside "
                    "vattn.set_forward_context(None, cfg, dummy_run=True) for a warm-up run that writes nothing.")
            ctx = get_forward_context()
            weight = getattr(self._embedding[0], "weight", None)
            check_step_inputs(input_ids, positions, self._vocab_size, _metadata_of(ctx),
                              device=weight.device if isinstance(weight, torch.Tensor) else None,
                              debug=ctx.debug_checks)
        decoder = self.hf_model
        for name in self._decoder_path:
            decoder = getattr(decoder, name)
        out = decoder(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)
        hidden = out[0][0]  # last_hidden_state (1, T, hidden) -> (T, hidden); a tuple where return_dict is off
        # Mamba's residual_in_fp32 leaves float32 states, which its LM head casts to its own dtype.
        return hidden if self._head_dtype in (None, hidden.dtype) else hidden.to(self._head_dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden_size) -> (N, vocab_size) logits in the model dtype, as the model's own forward computes them."""
        head = getattr(self.hf_model, self._head_name)
        if not torch.compiler.is_compiling():
            weight = getattr(head, "weight", None)
            check_hidden(hidden, self._hidden_size,
                         weight if isinstance(weight, torch.Tensor) and weight.is_floating_point() else None)
        logits = head(hidden)
        if self._logit_scale is not None:
            logits = logits * self._logit_scale
        if self._logits_scaling is not None:
            logits = logits / self._logits_scaling
        if self._softcap is not None:
            logits = logits / self._softcap
            logits = torch.tanh(logits)
            logits = logits * self._softcap
        return logits

    def attention_layers(self) -> dict[str, Attention]:
        """The ``vattn.Attention`` layers by layer name (``wrap``'s prefix + ``LayerSpec.prefix``), in model order."""
        return {m.layer_name: m for m in self.hf_model.modules() if isinstance(m, Attention)}

    def mixer_layers(self) -> dict[str, MambaBase]:
        """The vattn mixer layers by layer name (``wrap``'s prefix + ``MixerSpec.prefix``), in model order."""
        return {m.layer_name: m for m in self.hf_model.modules() if isinstance(m, MambaBase)}


def _unsupported_model(model: nn.Module) -> str | None:
    """What makes ``model`` a model the adapter cannot run, said plainly (None: nothing known)."""
    config = getattr(model, "config", None)
    text = _text_config(model) if config is not None else None
    name = type(model).__name__
    if getattr(config, "is_encoder_decoder", False):
        return None  # refused per attention module (layers._check_supported), naming it
    if getattr(text, "attention_chunk_size", None):
        return (f"a model with chunked local attention (attention_chunk_size={text.attention_chunk_size}, "
                "Llama-4's), which no vattn backend serves yet; vattn's adapter runs full and sliding-window "
                "causal attention")
    if "MaskedLM" in name or (getattr(config, "is_decoder", True) is False and "CausalLM" not in name):
        return ("an encoder (bidirectional attention, masked-LM or task head); vattn's adapter runs decoder-only "
                "causal LMs (*ForCausalLM). For an encoder, build the model with "
                "vattn.Attention(..., attn_type=vattn.AttentionType.ENCODER_ONLY) layers")
    return None


def _missing_part(model: nn.Module, head: Any, decoder_path: tuple[str, ...] | None) -> str:
    """What ``wrap`` did not find in ``model`` and what to do, said for its message."""
    load = "load the checkpoint with transformers.AutoModelForCausalLM"
    if head is None:
        return ("which has no LM head (get_output_embeddings() is None: a base model or a task head such as "
                f"*ForSequenceClassification); {load}")
    if decoder_path is None:
        return f"whose decoder was not found (get_decoder(), its base_model_prefix, or a child named 'model'); {load}"
    path = next((p for p, m in model.named_modules() if m is head), "?")
    return (f"whose LM head's output layer ({path}) is not a child module of the model (a head of several "
            "layers); the adapter runs causal LMs whose LM head is one child module (lm_head), as Llama's")


def _metadata_of(ctx: Any) -> Any:
    """One layer's metadata of the step (None in a warm-up): the step's batch is the same for every
    layer; an attention layer's where there is one (its slot mapping checks the token count)."""
    md = ctx.attn_metadata
    if not isinstance(md, dict):
        return md
    return next((m for m in md.values() if hasattr(m, "slot_mapping")), next(iter(md.values()), None))


def _decoder_path(model: nn.Module) -> tuple[str, ...] | None:
    """Attribute names leading from ``model`` to its decoder (``get_decoder()``, else the base model,
    else the child ``model``: Llama-4's text model names a base prefix it does not use)."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    if not isinstance(decoder, nn.Module) or decoder is model:
        decoder = getattr(model, getattr(model, "base_model_prefix", ""), None)
    if not isinstance(decoder, nn.Module) or decoder is model:
        decoder = model._modules.get("model")
    if not isinstance(decoder, nn.Module) or decoder is model:
        return None
    path = next((p for p, m in model.named_modules() if m is decoder), None)
    return tuple(path.split(".")) if path else None


def _text_config(model: nn.Module) -> Any:
    config = model.config
    get_text = getattr(config, "get_text_config", None)
    return get_text() if callable(get_text) else config


def _set_attn_implementation(model: nn.Module, modules: list[tuple[str, nn.Module]]) -> None:
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        setter(ATTN_IMPLEMENTATION)
    else:
        model.config._attn_implementation = ATTN_IMPLEMENTATION
    for _, module in modules:  # a sub-config the setter did not reach
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
            config._attn_implementation = ATTN_IMPLEMENTATION


def wrap(model: nn.Module, vattn_config: vattn.VattnConfig, *, attn_backend: Any = None,
         prefix: str = "", pack_projections: bool = True, fuse_norms: bool = True) -> VattnCausalLM:
    """Run a transformers causal LM (``*ForCausalLM``) on vattn; returns a ``VattnCausalLM``.

    Changes ``model`` in place: every attention module gets a ``vattn.Attention`` at
    ``module.attn`` (layer name ``prefix + "<module path>.attn"``, e.g. ``"model.layers.3.self_attn.attn"``)
    built from the model's own config and modules (``layers.py``), every mixer module of a hybrid
    (Mamba, Gated DeltaNet, ...) a vattn mixer layer at ``module.mixer`` and a forward that runs it
    (``mixers.py``), its attention implementation becomes "vattn", and it is put in eval mode.
    With ``pack_projections``, the bias-free ``q_proj`` / ``k_proj`` / ``v_proj`` and
    ``gate_proj`` / ``up_proj`` of each module get one weight buffer each (the same parameters,
    now consecutive row views of it; values unchanged), which ``vattn.compile`` runs as one GEMM
    (``vattn.compile_passes.packed_linears``). With ``fuse_norms``, RMSNorm modules of
    transformers' usual forms run as one ``F.rms_norm`` in eager inference (``norms.py``; same
    arithmetic, fewer kernel launches). ``model.generate`` runs transformers' generate() on a
    paged cache of its own (``generate.py``). Then allocate the cache with
    ``vattn.allocate_kv_cache(vattn_config, ...)`` (hybrids: with ``num_state_slots``).

    Args:
        model: a transformers ``PreTrainedModel`` with an LM head, on its device and in its dtype.
        vattn_config: the config the layers register into (block size, cache dtype, compilation).
        attn_backend: force a vattn backend (class or name) for every layer; default: vattn's selector.
        prefix: put before every layer name, e.g. ``"draft."`` for a second model in the same config.
        pack_projections: pack the projections of one input as above (off: leave the weights as they are).
        fuse_norms: the eager RMSNorm as above (off: leave the norm modules as they are).

    Mixture-of-experts models compile (``vattn.compile``) only with an experts implementation
    that does not loop over the experts a batch hits: on transformers 5 choose one with
    ``model.set_experts_implementation("grouped_mm")`` (or ``"batched_mm"``) before wrapping.

    Raises ``UnsupportedAttentionError`` (a ``NotImplementedError``) naming the module and the
    reason for attention or a mixer the adapter cannot run (cross-attention, MLA, non-causal,
    other layer types, mixer classes it does not serve), before anything is changed.
    """
    if not isinstance(vattn_config, vattn.VattnConfig):
        raise TypeError(f"wrap: vattn_config must be a vattn.VattnConfig, got {type(vattn_config).__name__}.")
    if not isinstance(model, nn.Module):
        raise TypeError(f"wrap: model: expected a transformers model (an nn.Module), got {type(model).__name__}; "
                        "pass transformers.AutoModelForCausalLM.from_pretrained(...), or a path to from_pretrained.")
    if isinstance(model, VattnCausalLM) or any(isinstance(m, (Attention, MambaBase)) for m in model.modules()):
        raise ValueError(f"wrap: {type(model).__name__} already has vattn layers; wrap a model once.")
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    head_name = next((n for n, m in model.named_children() if m is head), None)
    decoder_path = _decoder_path(model)
    why = _unsupported_model(model)
    if why is not None:
        raise UnsupportedAttentionError(f"wrap: {type(model).__name__} is {why}.")
    if head is None or head_name is None or decoder_path is None:
        error = TypeError if head is None or decoder_path is None else NotImplementedError  # nested head: a gap
        raise error(f"wrap: model: expected a transformers causal LM (*ForCausalLM: a decoder and an LM head "
                    f"child module), got {type(model).__name__}, {_missing_part(model, head, decoder_path)}.")
    register()
    mixers = mixer_modules(model)  # refuses stateful mixers it does not serve
    found = attention_modules(model)
    if not found and not mixers:
        raise UnsupportedAttentionError(f"{type(model).__name__}: no attention modules (classes named *Attention) "
                                        "and no mixer modules found; the adapter runs transformers decoder LMs.")
    specs = [layer_spec(path, module, _text_config(model)) for path, module in found]
    mixer_specs = [mixer_spec(path, module) for path, module in mixers]
    taken = [(p, n) for n, ms in (("attn", found), ("mixer", mixers)) for p, m in ms if hasattr(m, n)]
    if taken:
        raise ValueError(f"wrap: {taken[0][0]} already has an attribute {taken[0][1]!r}; the adapter attaches its "
                         "layer there.")
    param = next(model.parameters())
    dtype = getattr(model, "dtype", param.dtype)
    if not dtype.is_floating_point:
        raise TypeError(f"wrap: the model dtype must be a floating dtype (the attention and KV-cache dtype), got "
                        f"{dtype}; load the model in bfloat16, float16 or float32.")
    layers = build_layers(specs, mixer_specs, vattn_config, dtype, param.device, attn_backend, prefix)
    try:
        if found:
            _set_attn_implementation(model, found)
    except Exception:
        for layer in layers:
            vattn_config.compilation.static_forward_context.pop(layer.layer_name, None)
        raise
    for (_, module), layer in zip(found, layers):
        module.attn = layer
    attach_mixers(mixers, mixer_specs, layers[len(found):])
    if callable(getattr(model, "generate", None)):  # transformers' loop over vattn's cache (generate.py)
        model.generate = functools.update_wrapper(functools.partial(generate, model, vattn_config), generate)
    if pack_projections:
        pack_linear_weights(model)
    if fuse_norms:
        fuse_rms_norms(model)
    model.eval()
    return VattnCausalLM(model, vattn_config, tuple(specs), decoder_path, head_name, tuple(mixer_specs))


def from_pretrained(path_or_model: str | nn.Module, vattn_config: vattn.VattnConfig, *,
                    dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                    attn_backend: Any = None, **hf_kwargs: Any) -> VattnCausalLM:
    """Load a checkpoint directory or hub id with ``transformers.AutoModelForCausalLM`` (or take a
    model), move it to ``device`` / ``dtype``, and ``wrap`` it. ``hf_kwargs`` go to transformers'
    ``from_pretrained`` (e.g. ``revision``, ``trust_remote_code``)."""
    if isinstance(path_or_model, nn.Module):
        model = path_or_model
    else:
        import transformers

        register()
        kwargs = dict(hf_kwargs)
        if dtype is not None:
            kwargs["dtype"] = dtype
        kwargs.setdefault("attn_implementation", ATTN_IMPLEMENTATION)
        model = transformers.AutoModelForCausalLM.from_pretrained(path_or_model, **kwargs)
    if device is not None or dtype is not None:
        model = model.to(device=device, dtype=dtype)
    return wrap(model, vattn_config, attn_backend=attn_backend)

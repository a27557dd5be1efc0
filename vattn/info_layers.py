"""Which backend each layer of a model would get here, and why (``python -m vattn --head-size ...``
or ``python -m vattn --hf DIR``).

``layer_selection`` asks the selector about one layer description and, for each backend the
platform ranks above the chosen one, why it was passed over. ``checkpoint_layers`` reads a
transformers checkpoint's config (no weights: the model is built on the meta device) and turns
each attention module into such a description, as ``vattn.integrations.transformers.wrap`` would.
"""

from __future__ import annotations

from typing import Any

import torch

from vattn.core.enums import AttentionType
from vattn.platform import current_platform
from vattn import envs
from vattn.selector import _reasons_against, get_attn_backend, get_global_forced_attn_backend

__all__ = ["checkpoint_layers", "layer_selection", "render_layers"]

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def layer_selection(head_size: int, dtype: torch.dtype, *, kv_cache_dtype: str = "auto", block_size: int = 16,
                    use_mla: bool = False, has_sink: bool = False, sliding_window: bool = False,
                    soft_cap: bool = False, alibi: bool = False) -> dict[str, Any]:
    """{config, selected (a name, or None), error, passed_over: [{name, reasons}]} for one layer."""
    config = (head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink, False)
    features = (AttentionType.DECODER, sliding_window, soft_cap, alibi, False, False)
    out: dict[str, Any] = {"config": {"head_size": head_size, "dtype": str(dtype).removeprefix("torch."),
                                      "kv_cache_dtype": kv_cache_dtype, "block_size": block_size,
                                      **{k: True for k, on in (("use_mla", use_mla), ("sinks", has_sink),
                                                               ("sliding_window", sliding_window),
                                                               ("soft_cap", soft_cap), ("alibi", alibi)) if on}},
                           "selected": None, "error": None, "passed_over": []}
    try:
        out["selected"] = get_attn_backend(head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink,
                                           use_sliding_window=sliding_window, use_logits_soft_cap=soft_cap,
                                           use_alibi=alibi).get_name()
    except Exception as e:  # ValueError naming every reason (or a forced backend that cannot serve)
        out["error"] = str(e)
    forced = get_global_forced_attn_backend() or envs.VATTN_ATTENTION_BACKEND
    if forced is not None:  # no ranking is consulted
        out["forced_by"] = str(getattr(forced, "name", forced))
        return out
    for member in current_platform.get_attn_backend_priority(*config):
        if member.name == out["selected"]:
            break
        _, reasons = _reasons_against(member, config, features)
        out["passed_over"].append({"name": member.name, "reasons": reasons})
    return out


def checkpoint_layers(path: str, dtype: torch.dtype | None = None, **selection: Any) -> list[dict[str, Any]]:
    """One entry per group of attention modules with the same description in the checkpoint at
    ``path`` (a folder with a transformers ``config.json``): {layers, spec, selection}."""
    import transformers

    from vattn.integrations.transformers import attention_modules, layer_spec

    config = transformers.AutoConfig.from_pretrained(path)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if dtype is None:
        dtype = getattr(text, "dtype", None)
        dtype = DTYPES.get(str(dtype).removeprefix("torch."), None) if not isinstance(dtype, torch.dtype) else dtype
        dtype = dtype or (torch.bfloat16 if torch.cuda.is_available() else torch.float32)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    groups: dict[tuple[Any, ...], dict[str, Any]] = {}
    for path_, module in attention_modules(model):
        spec = layer_spec(path_, module, text)
        key = (spec.head_size, spec.num_heads, spec.num_kv_heads, spec.sliding_window, spec.logits_soft_cap,
               spec.sinks is not None)
        if key not in groups:
            groups[key] = {"layers": [], "spec": {"head_size": spec.head_size, "num_heads": spec.num_heads,
                                                  "num_kv_heads": spec.num_kv_heads,
                                                  "sliding_window": spec.sliding_window,
                                                  "logits_soft_cap": spec.logits_soft_cap,
                                                  "sinks": spec.sinks is not None},
                           "selection": layer_selection(spec.head_size, dtype, has_sink=spec.sinks is not None,
                                                        sliding_window=spec.sliding_window is not None,
                                                        soft_cap=bool(spec.logits_soft_cap), **selection)}
        groups[key]["layers"].append(path_)
    return list(groups.values())


def _selection_lines(sel: dict[str, Any], indent: str) -> list[str]:
    lines = [f"{indent}forced: {sel['forced_by']}"] if sel.get("forced_by") else []
    for p in sel["passed_over"]:
        lines.append(f"{indent}passed over {p['name']}: {'; '.join(p['reasons']) or 'not chosen'}")
    lines.append(f"{indent}-> {sel['selected']}" if sel["selected"] else f"{indent}no backend: {sel['error']}")
    return lines


def render_layers(entries: list[dict[str, Any]]) -> str:
    """The text ``python -m vattn`` prints for ``layer_selection`` / ``checkpoint_layers`` results."""
    out = [f"Selection on {current_platform.device_name} (the platform's priority, best first):"]
    for e in entries:
        sel = e.get("selection", e)
        if "layers" in e:
            names = e["layers"]
            shown = ", ".join(names[:2]) + (f", ... ({len(names)} modules)" if len(names) > 2 else "")
            out.append(f"  {shown}: " + ", ".join(f"{k}={v}" for k, v in e["spec"].items() if v not in (None, False)))
        else:
            out.append("  layer: " + ", ".join(f"{k}={v}" for k, v in sel["config"].items()))
        out += _selection_lines(sel, "    ")
    return "\n".join(out)

"""What this vattn installation can run, for a user choosing a backend (``python -m vattn``).

``collect()`` gathers the facts as a JSON-ready dict: versions, the device, every registry
backend's status (available here and what it serves, unavailable here and why, or not
implemented in this version), the backend the selector picks for a default layer, and the
``vattn.envs`` variables. ``render_text`` prints them for a person. ``support_matrix_markdown()``
renders what the implemented backends *declare* (never what is installed here) as the
Markdown support table of README.md.

Versions come from package metadata, so no kernel library is imported to print one; a
backend's ``is_available`` may import its library, and any error it raises becomes that
backend's reason.
"""

from __future__ import annotations

import importlib.metadata
import sys
from typing import Any, Callable

import torch

from vattn import __version__, envs
from vattn.core.enums import AttentionCGSupport
from vattn.core.interface import AttentionBackend
from vattn.core.registry import AttentionBackendEnum, MambaAttentionBackendEnum, vattn_version
from vattn.backends.support import CG_WORDS, format_sizes, support_matrix_markdown
from vattn.backends.support import yes as _yes
from vattn.platform import current_platform
from vattn.selector import STR_BACKEND_ENV_VAR, get_attn_backend, get_global_forced_attn_backend

__all__ = ["collect", "render_text", "support_matrix_markdown"]

AVAILABLE, UNAVAILABLE, NOT_IMPLEMENTED = "available", "unavailable", "not_implemented"

#: Report label -> the distributions (package metadata names) that provide it (torch is
#: already imported: its ``__version__`` is shown, which keeps the local tag, e.g. ``+cu130``).
PACKAGES: dict[str, tuple[str, ...]] = {
    "triton": ("triton",),
    "flashinfer": ("flashinfer-python",),
    "flash-attn": ("flash-attn-4", "flash-attn-3", "flash-attn"),
}

#: The default layer the report asks the selector about (dtype: bfloat16 on CUDA, else float32).
DEFAULT_LAYER = {"head_size": 128, "kv_cache_dtype": "auto", "block_size": 16}
#: The MLA layer it asks about: DeepSeek's latent row (kv_lora_rank 512 + qk_rope_head_dim 64).
MLA_LAYER = {"head_size": 576, "kv_cache_dtype": "auto", "block_size": 64}

_GENERATIONS = {(7, 0): "Volta", (7, 5): "Turing", (8, 0): "Ampere", (8, 6): "Ampere", (8, 9): "Ada",
                (9, 0): "Hopper", (10, 0): "Blackwell", (12, 0): "Blackwell"}


# ---- facts --------------------------------------------------------------------------------


def package_versions() -> dict[str, str | None]:
    """Label -> version (``None``: not installed). Several providers: ``"4.0 (flash-attn-4)"``."""
    out: dict[str, str | None] = {"python": sys.version.split()[0], "vattn": __version__,
                                  "torch": torch.__version__}
    for label, dists in PACKAGES.items():
        found = []
        for dist in dists:
            try:
                version = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                continue
            found.append(version if len(dists) == 1 else f"{version} ({dist})")
        out[label] = "; ".join(found) or None
    return out


def device_info() -> dict[str, Any]:
    """The platform vattn runs on, torch's CUDA version, and each visible GPU."""
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            gpus.append({"index": i, "name": props.name, "compute_capability": f"{props.major}.{props.minor}"})
    return {"platform": current_platform.device_type, "torch_cuda": torch.version.cuda, "gpus": gpus}


def declared_support(cls: type[AttentionBackend]) -> dict[str, Any]:
    """What backend ``cls`` declares it serves (its class attributes; nothing is probed)."""
    head_sizes, block_sizes = cls.get_supported_head_sizes(), cls.get_supported_block_sizes()
    need = cls.min_compute_capability
    return {
        "dtypes": [str(d).removeprefix("torch.") for d in cls.supported_dtypes],
        "head_sizes": None if head_sizes is None else list(head_sizes),
        "block_sizes": None if block_sizes is None else list(block_sizes),
        "kv_cache_dtypes": list(cls.supported_kv_cache_dtypes),
        "sliding_window": cls.supports_sliding_window,
        "logits_soft_cap": cls.supports_logits_soft_cap,
        "alibi": cls.supports_alibi,
        "sinks": cls.supports_sink,
        "mask_mod": cls.supports_mask_mod, "score_mod": cls.supports_score_mod,
        "mla": cls.supports_mla,
        "sparse": cls.supports_sparse,
        "attn_types": list(cls.supported_attn_types),
        "runs_on_cpu": cls.runs_on_cpu,
        "min_compute_capability": None if need is None else ".".join(map(str, need)),
        "cuda_graphs": AttentionCGSupport(cls.get_builder_cls().cudagraph_support).name,
        "notes": dict(cls.feature_notes),
    }


def availability(cls: type[AttentionBackend]) -> tuple[bool, str]:
    """``(ok, reason)``: ``is_available()``, then the declared oldest GPU generation."""
    try:
        ok, why = cls.is_available()
    except Exception as e:  # a library that is installed but fails to import or initialise
        return False, f"probing it raised {type(e).__name__}: {e}"
    if not ok:
        return False, why or "is_available() says no"
    need = cls.min_compute_capability
    if need is not None and torch.cuda.is_available():
        cap = tuple(torch.cuda.get_device_capability())
        if cap < tuple(need):
            return False, f"GPU too old: compute capability {cap[0]}.{cap[1]} < {need[0]}.{need[1]}"
    return True, ""


def backend_entry(member: AttentionBackendEnum) -> dict[str, Any]:
    """One registry member: its status, reason, class path and (if it imports) what it serves."""
    entry: dict[str, Any] = {"name": member.name, "status": NOT_IMPLEMENTED, "reason": "", "class": None,
                             "serves": None}
    if not member.is_implemented():
        entry["reason"] = (f"not implemented in {vattn_version()}" if member.value else
                           "a slot for your own backend: vattn.register_backend(AttentionBackendEnum."
                           f"{member.name}, 'your.module.YourBackend')")
        return entry
    entry["status"] = UNAVAILABLE
    try:
        cls = member.get_class()
        if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
            raise TypeError(f"{cls!r} is not a vattn AttentionBackend subclass")
        entry["class"] = f"{cls.__module__}.{cls.__qualname__}"
        entry["serves"] = declared_support(cls)
    except Exception as e:
        entry["reason"] = f"{type(e).__name__}: {e}"
        return entry
    ok, entry["reason"] = availability(cls)
    if ok:
        entry["status"] = AVAILABLE
        try:  # the level on this machine (FLASH_ATTN's depends on the installed interface)
            entry["serves"]["cuda_graphs"] = AttentionCGSupport(cls.get_cudagraph_support()).name
        except Exception:
            pass
    return entry


def backends() -> list[dict[str, Any]]:
    """Every ``AttentionBackendEnum`` member: available ones first, then unavailable, then not implemented."""
    entries = [backend_entry(m) for m in AttentionBackendEnum]
    order = {AVAILABLE: 0, UNAVAILABLE: 1, NOT_IMPLEMENTED: 2}
    return sorted(entries, key=lambda e: order[e["status"]])  # stable: registry order within a status


def default_selection(use_mla: bool = False) -> dict[str, Any]:
    """The backend ``get_attn_backend`` picks for ``DEFAULT_LAYER`` (``MLA_LAYER``) here, or its error."""
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    layer = MLA_LAYER if use_mla else DEFAULT_LAYER
    args = (layer["head_size"], dtype, layer["kv_cache_dtype"], layer["block_size"], use_mla)
    forced = get_global_forced_attn_backend()
    out: dict[str, Any] = {
        "config": {**layer, "dtype": str(dtype), **({"use_mla": True} if use_mla else {})},
        "priority": [b.name for b in current_platform.get_attn_backend_priority(*args)],
        "forced_by": ("global_force_attn_backend" if forced is not None else
                      STR_BACKEND_ENV_VAR if envs.VATTN_ATTENTION_BACKEND is not None else None),
        "selected": None,
        "error": None,
    }
    try:
        out["selected"] = get_attn_backend(*args).get_name()
    except Exception as e:  # ValueError with the selector's reasons, or a broken backend
        out["error"] = str(e)
    return out


def environment() -> list[dict[str, Any]]:
    """Every variable of ``vattn.envs``: whether it is set, its raw text, and the value in effect.

    """
    rows = []
    for name, read in envs.environment_variables.items():
        try:
            value = read()
        except Exception as e:  # e.g. a non-integer in an integer variable
            value = f"invalid ({type(e).__name__}: {e})"
        rows.append({"name": name, "set": envs.is_set(name), "raw": envs.raw(name), "value": value})
    return rows


def collect() -> dict[str, Any]:
    """Every section of the report; a section that fails records its error instead of raising."""
    sections: dict[str, Callable[[], Any]] = {
        "versions": package_versions,
        "device": device_info,
        "backends": backends,
        "mamba_backends": lambda: [
            {"name": m.name, "status": "implemented" if m.is_implemented() else NOT_IMPLEMENTED}
            for m in MambaAttentionBackendEnum
        ],
        "default_selection": default_selection,
        "mla_selection": lambda: default_selection(use_mla=True),
        "environment": environment,
    }
    report: dict[str, Any] = {"vattn": __version__}
    for key, build in sections.items():
        try:
            report[key] = build()
        except Exception as e:
            report[key] = {"error": f"{type(e).__name__}: {e}"}
    return report


# ---- text -------------------------------------------------------------------------------------


def _serves_lines(s: dict[str, Any]) -> list[str]:
    cap = s["min_compute_capability"]
    if cap is None:
        gpus = "any"
    else:
        generation = _GENERATIONS.get(tuple(int(x) for x in cap.split(".")))
        gpus = f"compute capability {cap}+" + (f" ({generation} or newer)" if generation else "")
    lines = [
        f"dtypes: {', '.join(s['dtypes'])}; head sizes: {format_sizes(s['head_sizes'])}; "
        f"block sizes: {format_sizes(s['block_sizes'])}",
        f"KV-cache dtypes: {', '.join(s['kv_cache_dtypes'])}",
        f"sliding window: {_yes(s['sliding_window'])}; soft cap: {_yes(s['logits_soft_cap'])}; "
        f"ALiBi: {_yes(s['alibi'])}; sinks: {_yes(s['sinks'])}; MLA: {_yes(s['mla'])}; mods: {_yes(s['mask_mod'])}",
        f"attention types: {', '.join(s['attn_types'])}",
        f"CUDA graphs: {s['cuda_graphs']} ({CG_WORDS[AttentionCGSupport[s['cuda_graphs']]]}); GPUs: {gpus}; "
        f"CPU: {_yes(s['runs_on_cpu'])}",
    ]
    lines += [f"note ({key}): {note}" for key, note in s["notes"].items()]
    return lines


def _section_error(value: Any) -> str | None:
    return value["error"] if isinstance(value, dict) and set(value) == {"error"} else None


def render_text(report: dict[str, Any]) -> str:
    """The report of ``collect()`` as the text ``python -m vattn`` prints."""
    out = [f"vattn {report['vattn']}: what this installation can run", "", "Versions"]
    versions = report["versions"]
    if _section_error(versions) is None:
        out += [f"  {k:<11} {v or 'not installed'}" for k, v in versions.items()]
    dev = report["device"]
    out += ["", "Device"]
    if _section_error(dev) is None:
        out.append(f"  torch CUDA runtime: {dev['torch_cuda'] or 'none (a CPU build of torch)'}")
        out += [f"  GPU {g['index']}: {g['name']}, compute capability {g['compute_capability']}" for g in dev["gpus"]]
        if not dev["gpus"]:
            out.append("  CPU only: no CUDA GPU visible")
    out += ["", "Backends (AttentionBackendEnum)"]
    if _section_error(report["backends"]) is None:
        width = max(len(e["name"]) for e in report["backends"]) + 2
        for e in report["backends"]:
            name = f"  {e['name']:<{width}}"
            if e["status"] == AVAILABLE:
                out.append(f"{name}available ({e['class']})")
                out += [" " * (width + 4) + line for line in _serves_lines(e["serves"])]
            elif e["status"] == UNAVAILABLE:
                out.append(f"{name}unavailable here: {e['reason']}")
            elif e["reason"].startswith("not implemented"):
                out.append(name + e["reason"])
            else:
                out.append(f"{name}not implemented ({e['reason']})")
        out.append("  (what every implemented backend declares: python -m vattn --support-matrix)")
    mamba = report["mamba_backends"]
    if _section_error(mamba) is None:
        done = [m["name"] for m in mamba if m["status"] != NOT_IMPLEMENTED]
        missing = [m["name"] for m in mamba if m["status"] == NOT_IMPLEMENTED and m["name"] != "CUSTOM"]
        out += ["", "Mamba backends (MambaAttentionBackendEnum)",
                f"  implemented: {', '.join(done) or 'none'}",
                f"  not implemented in {vattn_version()}: {', '.join(missing) or 'none'}"]
    for key, title in (("default_selection", "a default layer"), ("mla_selection", "an MLA layer (DeepSeek's latent)")):
        sel = report.get(key)
        out += ["", f"Selection for {title}"]
        if sel is None or _section_error(sel) is not None:
            continue
        cfg = sel["config"]
        out.append(f"  head_size={cfg['head_size']}, dtype={cfg['dtype']}, "
                   f"kv_cache_dtype={cfg['kv_cache_dtype']!r}, block_size={cfg['block_size']}"
                   + (", use_mla=True" if cfg.get("use_mla") else ""))
        out.append(f"  priority on {report['device'].get('platform', '?')}: {', '.join(sel['priority']) or '(none)'}")
        if sel["forced_by"]:
            out.append(f"  forced by {sel['forced_by']}")
        if sel["selected"]:
            out.append(f"  selected: {sel['selected']}")
        else:
            out.append("  no backend: " + sel["error"].replace("\n", "\n    "))
    env = report["environment"]
    out += ["", "Environment (vattn.envs)"]
    if _section_error(env) is None:
        set_rows = [r for r in env if r["set"]]
        out += ["  set:"] + ([f"    {r['name']}={r['raw']}  (in effect: {r['value']!r})" for r in set_rows]
                            or ["    (none)"])
        out += ["  at their defaults:"] + [f"    {r['name']}: {r['value']!r}" for r in env if not r["set"]]
    for key, value in report.items():
        if (err := _section_error(value)) is not None:
            out.append(f"\n(section {key!r} failed: {err})")
    return "\n".join(out)

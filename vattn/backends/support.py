"""The backend support matrix, rendered from the implemented backends' own declarations.

Built from class declarations only (``supported_dtypes``, ``supports_*``, the builder's
``cudagraph_support``, ``feature_notes``, ...), so it is the same on every machine:
``python -m vattn --support-matrix`` prints the full table, README.md holds the compact one
(``compact=True``: qualified cells marked ``*``; backends whose kernels vattn cannot install
named below the table instead of listed).
"""

from __future__ import annotations

import torch

from vattn.core.enums import AttentionCGSupport, AttentionType
from vattn.core.interface import AttentionBackend
from vattn.core.registry import AttentionBackendEnum

__all__ = ["MATRIX_NOTE_KEYS", "format_sizes", "support_matrix_markdown", "yes"]

SHORT_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
ENCODER_TYPES = {
    AttentionType.ENCODER: "encoder",
    AttentionType.ENCODER_ONLY: "encoder-only",
    AttentionType.ENCODER_DECODER: "cross",
}
CG_WORDS = {
    AttentionCGSupport.ALWAYS: "always",
    AttentionCGSupport.UNIFORM_BATCH: "uniform batches",
    AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE: "1-token decodes",
    AttentionCGSupport.NEVER: "piecewise only",
}

def format_sizes(sizes: list[int] | tuple[int, ...] | None) -> str:
    """``None`` -> ``"any"``; ``8, 16, ..., 256`` -> ``"8-256 (multiples of 8)"``; else the list."""
    if sizes is None:
        return "any"
    s = sorted(sizes)
    if len(s) >= 4 and s[0] == s[1] - s[0] and all(b - a == s[0] for a, b in zip(s, s[1:])):
        return f"{s[0]}-{s[-1]} (multiples of {s[0]})"
    if len(s) >= 4 and s[0] > 0 and all(b == 2 * a for a, b in zip(s, s[1:])):
        return f"{s[0]}-{s[-1]} (powers of 2)"
    return ", ".join(map(str, s))


def yes(flag: bool) -> str:
    return "yes" if flag else "no"




#: Matrix column -> the ``feature_notes`` keys whose note it shows (the first is the canonical key).
MATRIX_NOTE_KEYS: dict[str, tuple[str, ...]] = {
    "GPUs (compute capability)": ("gpus", "min_compute_capability"),
    "CPU": ("cpu", "runs_on_cpu"),
    "dtypes": ("dtypes", "supported_dtypes"),
    "head sizes": ("head_sizes",),
    "fp8 KV": ("fp8_kv", "kv_cache_dtypes", "fp8"),
    "sliding window": ("sliding_window",),
    "soft cap": ("logits_soft_cap", "soft_cap"),
    "ALiBi": ("alibi",),
    "sinks": ("sinks", "sink"),
    "encoder": ("encoder", "encoder_attention", "attn_types"),
    "CUDA graphs": ("cuda_graphs", "cudagraph", "cudagraph_support"),
}


def _matrix_cells(cls: type[AttentionBackend]) -> dict[str, str]:
    need = cls.min_compute_capability
    fp8 = [d for d in cls.supported_kv_cache_dtypes if d.startswith("fp8")]
    enc = [label for t, label in ENCODER_TYPES.items() if t in cls.supported_attn_types]
    return {
        "GPUs (compute capability)": "any" if need is None else f"{need[0]}.{need[1]}+",
        "CPU": yes(cls.runs_on_cpu),
        "dtypes": ", ".join(SHORT_DTYPES.get(d, str(d).removeprefix("torch.")) for d in cls.supported_dtypes),
        "head sizes": format_sizes(cls.get_supported_head_sizes()),
        "fp8 KV": "yes" if set(fp8) >= {"fp8", "fp8_e4m3", "fp8_e5m2"} else ", ".join(fp8) or "no",
        "sliding window": yes(cls.supports_sliding_window),
        "soft cap": yes(cls.supports_logits_soft_cap),
        "ALiBi": yes(cls.supports_alibi),
        "sinks": yes(cls.supports_sink),
        "encoder": "yes" if len(enc) == len(ENCODER_TYPES) else ", ".join(enc) or "no",
        "CUDA graphs": CG_WORDS[AttentionCGSupport(cls.get_builder_cls().cudagraph_support)],
    }


def support_matrix_markdown(compact: bool = False) -> str:
    """The implemented backends' declared support as a Markdown table (registry order).

    A cell whose feature has a note shows it after a colon (``yes: FA2 only``); notes under
    keys no column shows (``MATRIX_NOTE_KEYS``) follow the table as a list. ``compact``: a
    noted cell gets a ``*`` instead of its note, no note list, and backends whose kernels
    vattn cannot install (``installable = False``) are named after the table, not listed.
    """
    header = ["backend", *MATRIX_NOTE_KEYS]
    if compact:
        header[1], header[6] = "GPUs", "window"
    rows = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    extra: list[str] = []
    named: list[str] = []
    for member in AttentionBackendEnum:
        if not member.is_implemented() or member is AttentionBackendEnum.NO_ATTENTION:  # a placeholder, no kernel
            continue
        cls = member.get_class()
        if compact and not cls.installable:
            named.append(member.name)
            continue
        cells, notes = _matrix_cells(cls), dict(cls.feature_notes)
        if compact:
            cells["head sizes"] = cells["head sizes"].replace(" (multiples of ", ", step ").rstrip(")")
        for column, keys in MATRIX_NOTE_KEYS.items():
            key = next((k for k in keys if k in notes), None)
            if key is not None:
                note = notes.pop(key)
                cells[column] += "*" if compact else f": {note}"
        row = [member.name, *cells.values()]
        rows.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in row) + " |")
        extra += [f"- {member.name}, {key}: {note}" for key, note in sorted(notes.items())]
    if compact:
        extra = ["`*`: qualified (`python -m vattn --support-matrix` says how)."
                 + (f" Named, not installable by vattn: {', '.join(named)}." if named else "")]
    return "\n".join(rows) + ("\n\n" + "\n".join(extra) if extra else "") + "\n"

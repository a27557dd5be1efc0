#!/usr/bin/env python
"""Write docs/api.md: vattn's public API (``vattn.__all__`` and the transformers integration's),
each name with its signature and docstring, generated from the code.

    python tools/api_reference.py            # rewrite docs/api.md
    python tools/api_reference.py --check    # exit 1 if docs/api.md is stale

``tests/test_docs.py`` fails when the committed page differs from what this writes.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "api.md"


def _signature(obj: Any) -> str:
    try:
        sig = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return ""
    return sig if len(sig) <= 400 else sig[:397] + "..."


def _kind(obj: Any) -> str:
    if inspect.isclass(obj):
        return "class"
    if inspect.ismodule(obj):
        return "module"
    return "function" if callable(obj) else "object"


def _section(module: ModuleType, names: list[str], title: str) -> list[str]:
    out = [f"## {title}", ""]
    for name in sorted(names, key=str.lower):
        obj = getattr(module, name)
        kind = _kind(obj)
        head = f"### `{title.split()[0]}.{name}`" if kind != "object" else f"### `{title.split()[0]}.{name}` (value)"
        out += [head, ""]
        if kind in ("class", "function"):
            out += ["```python", f"{'class ' if kind == 'class' else ''}{name}{_signature(obj)}", "```", ""]
        doc = inspect.getdoc(obj) if kind != "object" else None
        if kind == "object":  # a literal as written; anything else by its type (its repr may name this machine)
            literal = isinstance(obj, (str, int, float, tuple, list, dict, frozenset))
            doc = f"`{obj!r}`" if literal else f"A `{type(obj).__name__}`: {inspect.getdoc(type(obj)) or ''}".rstrip(": ")
        out += [doc or "(no docstring)", ""]
        if kind == "class":
            for attr, member in sorted(vars(obj).items()):
                if attr.startswith("_") or not (inspect.isfunction(member) or isinstance(member, (property, staticmethod, classmethod))):
                    continue
                fn = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
                mdoc = inspect.getdoc(fn)
                if not mdoc:
                    continue
                sig = "" if isinstance(member, property) else _signature(fn)
                out += [f"- `{name}.{attr}{sig}`: {mdoc.splitlines()[0]}"]
            out += [""]
    return out


def render() -> str:
    import vattn
    from vattn.integrations import transformers as vt

    lines = ["# API reference", "",
             "Generated from the docstrings by `python tools/api_reference.py`; the README shows how the pieces fit.", ""]
    lines += _section(vattn, list(vattn.__all__), "vattn")
    lines += _section(vt, list(vt.__all__), "vattn.integrations.transformers")
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if docs/api.md is stale")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        return 0 if OUT.exists() and OUT.read_text() == text else 1
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)} ({len(text)} bytes)")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())

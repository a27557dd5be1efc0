"""The generated sections of README.md, and a command that rewrites them.

README.md marks each section with ``<!-- NAME:begin -->`` / ``<!-- NAME:end -->``:

| section | source |
| --- | --- |
| ``support-matrix`` | the backends' own declarations (``vattn.backends.support.support_matrix_markdown``, compact) |
| ``envs`` | the variable table in ``vattn/envs.py``'s docstring |
| ``figures`` | the "Headline figures" table of ``docs/performance-notes.md`` (less its file column) |

``python tools/readme_sections.py`` rewrites them in place; ``--check`` exits 1 when README.md is
stale (tests/test_readme.py runs the same check).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _table_after(text: str, heading: str | None = None) -> str:
    """The first Markdown table in ``text`` (after ``heading`` when given)."""
    if heading is not None:
        text = text[text.index(heading):]
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "\n".join(lines[start:end]) + "\n"


def support_matrix() -> str:
    from vattn.backends.support import support_matrix_markdown

    return support_matrix_markdown(compact=True)


def envs_table() -> str:
    import vattn.envs

    return _table_after(vattn.envs.__doc__ or "").replace("``", "`")


def figures_table() -> str:
    """The headline table without its last column (the result file: the notes page links it)."""
    table = _table_after((ROOT / "docs" / "performance-notes.md").read_text(), "## Headline figures")
    return "".join(row.rsplit(" |", 2)[0] + " |\n" for row in table.splitlines())


SECTIONS = {"support-matrix": support_matrix, "envs": envs_table, "figures": figures_table}


def render(text: str) -> str:
    """``text`` (README.md) with every generated section rewritten."""
    for name, make in SECTIONS.items():
        pattern = re.compile(rf"(<!-- {name}:begin -->\n).*?(<!-- {name}:end -->)", re.S)
        if not pattern.search(text):
            raise ValueError(f"README.md has no <!-- {name}:begin --> ... <!-- {name}:end --> section")
        body = make()
        text = pattern.sub(lambda m: m.group(1) + body + m.group(2), text)
    return text


def main(argv: list[str]) -> int:
    current = README.read_text()
    wanted = render(current)
    if "--check" in argv:
        if wanted != current:
            print("README.md's generated sections are stale: run python tools/readme_sections.py")
            return 1
        return 0
    README.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

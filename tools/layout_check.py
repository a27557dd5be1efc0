"""Checks of vattn's layout that the tests run (tests/test_layout.py) and a maintainer can run:

* no import cycle among vattn's modules, counting imports inside functions (a function-local
  import that hides a cycle is still a cycle) and type-only imports (``if TYPE_CHECKING:``);
* the floor plan (``FLOORS``): each top-level module or folder of vattn (a *unit*) has a floor,
  and an import from a unit to one on a higher floor runs *back up*; at most
  ``MAX_BACK_EDGES`` of those, and no unit left off the plan;
* no module over 400 lines, except kernel files (modules defining ``@triton.jit`` functions);
* no measured figure (ms, us, TB/s) or GPU model name in vattn's docstrings and comments.

``python tools/layout_check.py`` prints every finding and exits 1 if there is one.
"""

from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "vattn"
MAX_LINES = 400
MAX_BACK_EDGES = 2

#: vattn's floor plan, bottom up: a unit imports units on its own floor or below. ``core`` holds
#: the contract (interface, capabilities, enums, registry, metadata types, checks, config); ops
#: and the layers sit on it; backends plug in above them; engines' helpers, compile and graphs
#: on top; ``vattn`` is the package's ``__init__`` (the public names).
FLOORS: tuple[tuple[str, ...], ...] = (
    ("_version", "_compat", "envs"),
    ("kernels",),
    ("core",),
    ("platform", "forward_context"),
    ("ops",),
    ("selector",),
    ("layer", "mla_layer", "mixers"),
    ("backends",),
    ("metadata", "input_batch", "kv_cache"),
    ("compile_passes",),
    ("cudagraph",),
    ("vattn",),
    ("integrations", "info", "info_layers"),
    ("__main__",),
)
FIGURE = re.compile(r"\d\s?(ms|us|µs)\b|TB/s|GB/s|TFLOP/s|\bH100\b|\bH200\b|\bA100\b|\bB200\b")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(name: str, path: Path, known: set[str], type_only: bool = True) -> set[str]:
    """The vattn modules ``name`` imports anywhere in the file (``type_only``: also inside
    ``if TYPE_CHECKING:`` blocks)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def resolve(mod: str) -> str | None:
        while mod and mod not in known:
            mod = mod.rpartition(".")[0]
        return mod or None

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node) and not type_only:
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "vattn" and (target := resolve(alias.name)):
                    found.add(target)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "vattn":
                return
            for alias in node.names:  # "from pkg import module" imports the submodule
                sub = f"{base}.{alias.name}"
                target = sub if sub in known else resolve(base)
                if target:
                    found.add(target)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def unit_of(module: str) -> str:
    """``vattn.core.interface`` -> ``core``; ``vattn`` (the package itself) -> ``vattn``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def unit_graph() -> dict[str, set[str]]:
    """Imports between units (type-only imports included), self-imports left out."""
    out: dict[str, set[str]] = {}
    for a, targets in import_graph().items():
        ua = unit_of(a)
        out.setdefault(ua, set()).update(unit_of(b) for b in targets if unit_of(b) != ua)
    return out


def floor_of() -> dict[str, int]:
    return {unit: i for i, floor in enumerate(FLOORS) for unit in floor}


def back_edges() -> list[tuple[str, str]]:
    """Imports running back up the floor plan, as ``(importer, imported)`` units."""
    floors = floor_of()
    return sorted((a, b) for a, targets in unit_graph().items() for b in targets
                  if a in floors and b in floors and floors[b] > floors[a])


def units_off_plan() -> list[str]:
    floors = floor_of()
    return sorted(u for u in unit_graph() if u not in floors)


def import_cycles() -> list[list[str]]:
    """Every strongly connected group of modules larger than one (Tarjan), each sorted."""
    graph = import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def is_kernel_file(path: Path) -> bool:
    return "@triton.jit" in path.read_text()


def long_modules() -> list[tuple[str, int]]:
    out = []
    for name, path in modules().items():
        n = len(path.read_text().splitlines())
        if n > MAX_LINES and not is_kernel_file(path):
            out.append((name, n))
    return out


def measured_figures() -> list[str]:
    """``path:line: text`` of every docstring or comment in vattn that quotes a figure."""
    out = []
    for name, path in modules().items():
        source = path.read_text()
        texts: list[tuple[int, str]] = []
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                texts.append((tok.start[0], tok.string))
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc and node.body:
                    start = node.body[0].lineno
                    texts += [(start + i, line) for i, line in enumerate(doc.splitlines())]
            elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                texts += [(node.lineno + i, line) for i, line in enumerate(node.value.value.splitlines())]
        for line, text in sorted(set(texts)):
            if FIGURE.search(text):
                out.append(f"{path.relative_to(ROOT)}:{line}: {text.strip()}")
    return out


def main() -> int:
    findings = [f"import cycle: {' <-> '.join(c)}" for c in import_cycles()]
    back = back_edges()
    if len(back) > MAX_BACK_EDGES:
        findings.append(f"{len(back)} imports run back up the floor plan (at most {MAX_BACK_EDGES}): "
                        + ", ".join(f"{a} -> {b}" for a, b in back))
    findings += [f"unit {u} is not on the floor plan (tools/layout_check.py FLOORS)" for u in units_off_plan()]
    findings += [f"{name}: {n} lines (> {MAX_LINES}, not a kernel file)" for name, n in long_modules()]
    findings += [f"measured figure: {f}" for f in measured_figures()]
    graph = unit_graph()
    print(f"{len(graph)} units, {sum(map(len, graph.values()))} imports between them, "
          f"{len(back)} back up: {back or 'none'}")
    print("\n".join(findings) or "layout: no findings")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())

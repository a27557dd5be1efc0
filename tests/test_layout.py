"""The library's layout rules (tools/layout_check.py): no import cycle inside vattn (type-only
imports counted), the floor plan (at most two imports running back up), no
non-kernel module over 400 lines, no measured figure in vattn's docstrings and comments, and
importing vattn pulls in no optional library and no Inductor internals."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import layout_check  # noqa: E402


def test_no_import_cycle_inside_vattn() -> None:
    assert layout_check.import_cycles() == []


TYPE_ONLY = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    {}\n"


def fake_package(tmp_path, monkeypatch, files: dict[str, str]) -> None:
    """A package ``vattn`` of ``files`` (path -> source) that layout_check reads instead."""
    pkg = tmp_path / "vattn"
    for name, source in {"__init__.py": "", **files}.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(source)
    monkeypatch.setattr(layout_check, "ROOT", tmp_path)
    monkeypatch.setattr(layout_check, "PACKAGE", pkg)


def test_the_cycle_check_sees_function_local_imports(tmp_path, monkeypatch) -> None:
    """A back-edge hidden in a function body is still found."""
    fake_package(tmp_path, monkeypatch, {"a.py": "from vattn import b\n",
                                         "b.py": "def f():\n    from vattn.a import x\n"})
    assert layout_check.import_cycles() == [["vattn.a", "vattn.b"]]


def test_the_cycle_check_counts_type_only_imports(tmp_path, monkeypatch) -> None:
    """An import under ``if TYPE_CHECKING:`` still ties the modules together."""
    fake_package(tmp_path, monkeypatch, {"a.py": "from vattn import b\n",
                                         "b.py": TYPE_ONLY.format("from vattn.a import x")})
    assert layout_check.import_cycles() == [["vattn.a", "vattn.b"]]


def test_floor_plan_holds() -> None:
    """Every unit of vattn is on the floor plan, and at most ``MAX_BACK_EDGES`` imports run back
    up it (the core imports nothing above it)."""
    assert layout_check.units_off_plan() == []
    assert len(layout_check.back_edges()) <= layout_check.MAX_BACK_EDGES, layout_check.back_edges()
    graph = layout_check.unit_graph()
    floors = layout_check.floor_of()
    assert all(floors[b] <= floors["core"] for b in graph["core"]), graph["core"]


def test_back_edges_are_found(tmp_path, monkeypatch) -> None:
    fake_package(tmp_path, monkeypatch, {"core/__init__.py": "", "core/x.py": TYPE_ONLY.format("from vattn import layer"),
                                         "layer.py": "from vattn.core import x\n"})
    assert layout_check.back_edges() == [("core", "layer")]


def test_modules_are_small_except_kernel_files() -> None:
    assert layout_check.long_modules() == []


def test_no_measured_figures_in_the_library() -> None:
    assert layout_check.measured_figures() == []


def test_importing_vattn_imports_no_optional_library() -> None:
    code = ("import sys, vattn; bad = [m for m in ('flashinfer', 'flash_attn', 'triton', 'transformers', "
            "'torch._inductor.compile_fx') if m in sys.modules]; print(bad); sys.exit(bool(bad))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr

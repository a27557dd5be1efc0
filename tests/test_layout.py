"""The library's layout rules (tools/layout_check.py): no import cycle inside vattn, no
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


def test_the_cycle_check_sees_function_local_imports(tmp_path, monkeypatch) -> None:
    """A back-edge hidden in a function body is still found."""
    pkg = tmp_path / "vattn"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from vattn import b\n")
    (pkg / "b.py").write_text("def f():\n    from vattn.a import x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from vattn import a\n")
    monkeypatch.setattr(layout_check, "ROOT", tmp_path)
    monkeypatch.setattr(layout_check, "PACKAGE", pkg)
    assert layout_check.import_cycles() == [["vattn.a", "vattn.b"]]


def test_modules_are_small_except_kernel_files() -> None:
    assert layout_check.long_modules() == []


def test_no_measured_figures_in_the_library() -> None:
    assert layout_check.measured_figures() == []


def test_importing_vattn_imports_no_optional_library() -> None:
    code = ("import sys, vattn; bad = [m for m in ('flashinfer', 'flash_attn', 'triton', 'transformers', "
            "'torch._inductor.compile_fx') if m in sys.modules]; print(bad); sys.exit(bool(bad))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr

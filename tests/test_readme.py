"""README.md is a user's page: at most 10 KB, every Python block runs as written on a CPU-only
machine (and prints what its comment says), its generated sections (support matrix, environment
variables, headline figures) match their sources, and no path points outside the repository."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
sys.path.insert(0, str(ROOT / "tools"))

import readme_sections  # noqa: E402

BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)


def test_readme_is_at_most_10_kb() -> None:
    assert len(README.encode()) <= 10240


def test_no_path_outside_the_repository() -> None:
    for path in (ROOT / "README.md", *ROOT.glob("docs/*.md"), ROOT / "benchmarks" / "README.md"):
        assert "../shared" not in path.read_text(), path


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_python_block_runs_on_cpu(index: int) -> None:
    """Each block in a fresh process, as a user would paste it (CUDA hidden), from the repo root."""
    block = BLOCKS[index]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, cwd=ROOT, env=env,
                       timeout=600)
    assert r.returncode == 0, f"README block {index} failed:\n{block}\n{r.stderr[-3000:]}"
    # A ``print(...)  # expected`` line states what the block prints.
    for expected in re.findall(r"^print\(.*\)\s+#\s*(.+)$", block, re.M):
        assert expected.strip() in r.stdout, (expected, r.stdout)


def test_there_are_python_blocks() -> None:
    assert len(BLOCKS) >= 2


def test_generated_sections_match_their_sources() -> None:
    """Support matrix from the backends' declarations, the variable table from vattn/envs.py,
    the headline figures from docs/performance-notes.md (python tools/readme_sections.py)."""
    assert readme_sections.render(README) == README


def test_variable_table_lists_every_variable_of_envs() -> None:
    import vattn.envs

    table = readme_sections.envs_table()
    named = set(re.findall(r"^\| `([A-Z_]+)`", table, re.M))
    assert named == set(vattn.envs.environment_variables)


def test_support_matrix_lists_every_implemented_backend() -> None:
    from vattn.core.registry import AttentionBackendEnum

    members = [m for m in AttentionBackendEnum if m.value and m.is_implemented()
               and m is not AttentionBackendEnum.NO_ATTENTION]  # a placeholder without kernels
    installable = {m.name for m in members if m.get_class().installable}
    matrix = readme_sections.support_matrix()
    rows = set(re.findall(r"^\| ([A-Z_]+) \|", matrix, re.M))
    assert rows == installable
    for m in members:  # the others are named below the table
        assert m.name in installable or m.name in matrix.splitlines()[-1]


def test_at_most_six_headline_figures_with_device_and_date() -> None:
    rows = readme_sections.figures_table().splitlines()[2:]
    assert 1 <= len(rows) <= 6
    for row in rows:
        assert re.search(r"(H100|H200|B200|A100)[^|]*, 20\d\d-\d\d-\d\d \|$", row), row

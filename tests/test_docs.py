"""The API reference (docs/api.md) is generated from the docstrings and kept current; docs/backends.md
shows tests/minimal_backend.py (which tests/test_conformance.py runs) as it is; LICENSE and CHANGELOG
exist."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import api_reference  # noqa: E402


def test_api_reference_is_current() -> None:
    assert (ROOT / "docs" / "api.md").read_text() == api_reference.render(), \
        "docs/api.md is stale: run python tools/api_reference.py"


def test_every_public_name_is_documented() -> None:
    text = api_reference.render()
    assert "(no docstring)" not in text
    import vattn

    for name in vattn.__all__:
        assert f"### `vattn.{name}`" in text


def test_license_and_changelog() -> None:
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    assert (ROOT / "CHANGELOG.md").read_text().startswith("# Changelog")


def test_backends_doc_shows_the_minimal_backend_verbatim() -> None:
    doc = (ROOT / "docs" / "backends.md").read_text()
    source = (ROOT / "tests" / "minimal_backend.py").read_text()
    assert f"```python\n{source}```\n" in doc, "docs/backends.md: paste tests/minimal_backend.py into its code block"
    assert len(doc.encode()) <= 8192

"""The API reference (docs/api.md) is generated from the docstrings and kept current; LICENSE and
CHANGELOG exist."""

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

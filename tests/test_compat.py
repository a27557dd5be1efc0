"""The supported torch range: declared in pyproject.toml, checked at import with a message that says what to do."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

from vattn._compat import TORCH_NEWEST, TORCH_OLDEST, check_torch


def test_older_torch_is_refused_with_the_range_and_a_pip_line() -> None:
    with pytest.raises(ImportError, match=r'torch 2\.11 - 2\.14, found torch 2\.10\.1.*pip install "torch>=2\.11,<2\.15"'):
        check_torch("2.10.1+cu128")


def test_newer_torch_warns_and_supported_ones_are_silent() -> None:
    with pytest.warns(UserWarning, match=r"tested with torch 2\.11 - 2\.14, found torch 2\.15\.0"):
        check_torch("2.15.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for v in ("2.11.0", "2.13.0+cpu", "2.14.1+cu130", "2.14.0a0+git1234", "weird"):
            check_torch(v)


def test_pyproject_declares_the_same_range() -> None:
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    lo, hi = re.search(r'"torch>=(\d+\.\d+),<(\d+\.\d+)"', text).groups()
    assert lo == "%d.%d" % TORCH_OLDEST and hi == "%d.%d" % (TORCH_NEWEST[0], TORCH_NEWEST[1] + 1)

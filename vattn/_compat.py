"""The torch releases vattn supports, checked once at import (``vattn/__init__.py``)."""

from __future__ import annotations

import re
import warnings

#: The oldest and newest torch minor releases vattn is tested with (pyproject.toml declares the same).
TORCH_OLDEST, TORCH_NEWEST = (2, 11), (2, 14)


def check_torch(version: str) -> None:
    """``ImportError`` for a torch older than ``TORCH_OLDEST`` (vattn uses its APIs); a warning
    for one newer than ``TORCH_NEWEST`` (untested, usually fine). ``version``: ``torch.__version__``,
    e.g. ``"2.13.0+cpu"``."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        return  # a source build with an unusual version string: nothing to say
    found = (int(m.group(1)), int(m.group(2)))
    supported = f"torch {TORCH_OLDEST[0]}.{TORCH_OLDEST[1]} - {TORCH_NEWEST[0]}.{TORCH_NEWEST[1]}"
    pin = f'pip install "torch>={TORCH_OLDEST[0]}.{TORCH_OLDEST[1]},<{TORCH_NEWEST[0]}.{TORCH_NEWEST[1] + 1}"'
    if found < TORCH_OLDEST:
        raise ImportError(f"vattn needs {supported}, found torch {version}: the attention ops use APIs older "
                          f"releases lack. Upgrade torch ({pin}).")
    if found > TORCH_NEWEST:
        warnings.warn(f"vattn is tested with {supported}, found torch {version}; it may work, but if something "
                      f"fails, try a supported release ({pin}).", stacklevel=3)

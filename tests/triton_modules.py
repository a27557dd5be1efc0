"""Import vattn's Triton op modules for tests: compiled on a GPU, for the interpreter on CPU.

``triton.jit`` decides interpreter vs compiler when a kernel is defined (at module import),
reading ``TRITON_INTERPRET``. Without CUDA, ``load`` sets it for the (re)import only, so other
tests see no change, and re-imports modules that an earlier import built in compiled mode.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Sequence

import torch


def load(names: Sequence[str]) -> dict[str, ModuleType]:
    """The modules by name. Give dependencies before the modules that import from them: on
    a rebuild they are reloaded in this order."""
    if torch.cuda.is_available():
        return {n: importlib.import_module(n) for n in names}
    from triton.runtime.jit import JITFunction

    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        mods = {n: importlib.import_module(n) for n in names}
        compiled = any(isinstance(v, JITFunction) for m in mods.values() for v in vars(m).values())
        if compiled:  # imported earlier without the interpreter
            mods = {n: importlib.reload(m) for n, m in mods.items()}
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old
    return mods

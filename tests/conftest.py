"""Shared test setup: markers that skip cleanly where hardware or libraries are missing."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch

from vattn.core.config import VattnConfig, set_current_vattn_config

# The repository root: tests import examples/ and benchmarks/ (shared helpers) as packages.
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


def _has(mod: str) -> bool:
    try:
        return importlib.util.find_spec(mod) is not None
    except (ImportError, ValueError):
        return False


# vattn.compile keeps Dynamo's trace in ~/.cache/vattn by default; tests compile fresh
# (test_compile_cache.py sets the directory, or the variable, itself).
os.environ["VATTN_DISABLE_COMPILE_CACHE"] = "1"

HAS_CUDA = torch.cuda.is_available()
HAS_FLASHINFER = HAS_CUDA and _has("flashinfer")
HAS_FLASH_ATTN = HAS_CUDA and (_has("flash_attn") or _has("flash_attn_interface"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--custom-backend", default=None, metavar="PACKAGE.MODULE.CLASS",
                     help="the backend class tests/test_conformance.py registers as CUSTOM "
                          "(default: tests/minimal_backend.py's MinimalBackend)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skips = {
        "cuda": (HAS_CUDA, "needs a CUDA GPU (none is visible to torch here)"),
        "flashinfer": (HAS_FLASHINFER, "needs flashinfer-python and a CUDA GPU"),
        "flash_attn": (HAS_FLASH_ATTN, "needs flash-attn-4, FA3 or FA2 and a CUDA GPU"),
    }
    for item in items:
        for name, (ok, why) in skips.items():
            if not ok and item.get_closest_marker(name) is not None:
                item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(autouse=True, scope="session")
def _room_for_many_compiled_models() -> None:
    """Every test model of one class shares its ``forward`` code object, and Dynamo keeps at
    most ``recompile_limit`` (8) compiled entries per code object before a fullgraph compile
    fails; one test process builds and compiles far more models than that."""
    with torch._dynamo.config.patch(recompile_limit=256):
        yield


@pytest.fixture(scope="module")
def one_cpu_thread() -> Iterator[None]:
    """For modules running tiny models: one intra-op thread (as fast at these shapes, and many
    times faster on a loaded 2-core box under xdist). ``pytestmark = pytest.mark.usefixtures(...)``."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def hf_one_thread(one_cpu_thread: None) -> Iterator[None]:
    """``one_cpu_thread`` for tiny transformers models, with transformers' warnings off."""
    import transformers

    transformers.logging.set_verbosity_error()
    yield


@pytest.fixture
def clean_registry() -> Iterator[None]:
    """The backend registry without overrides during the test; what was registered before
    (``register_backend``) is restored after, and cached selections are dropped."""
    from vattn.core.registry import _OVERRIDES

    saved = dict(_OVERRIDES.paths), dict(_OVERRIDES.classes)
    for member in list(_OVERRIDES.paths):
        member.clear_override()
    yield
    for member in list(_OVERRIDES.paths):
        member.clear_override()
    _OVERRIDES.paths.update(saved[0])
    _OVERRIDES.classes.update(saved[1])
    _OVERRIDES.generation += 1


@pytest.fixture
def vattn_config() -> VattnConfig:
    """A fresh config made current for the test (layers built in the test register into it)."""
    cfg = VattnConfig()
    with set_current_vattn_config(cfg):
        yield cfg

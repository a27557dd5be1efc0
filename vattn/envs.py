"""The only module in vattn that reads ``os.environ``.

Every variable is read lazily (``vattn.envs.VATTN_ATTENTION_BACKEND`` reads the
environment at access time), so tests and users may change them at run time.

| variable | meaning |
| --- | --- |
| ``VATTN_ATTENTION_BACKEND`` | force a backend by name (``TRITON_ATTN``, ...) |
| ``VATTN_KV_CACHE_LAYOUT`` | ``NHD`` (default) or ``HND`` cache layout |
| ``VATTN_DEBUG_CHECKS`` | ``1``: check each step's device metadata too; one host sync a step |
| ``VATTN_CUDAGRAPH_DEBUG`` | ``1``: check every replay's input and metadata addresses |
| ``VATTN_FLASHINFER_DECODE_TENSOR_CORES`` | ``0``: FLASHINFER decodes on CUDA cores |
| ``VATTN_TRITON_FAST_LAUNCH`` | ``0``: Triton's own (slower) kernel launches |
| ``VATTN_TRITON_FUSED_KV_STORE`` | ``0``: TRITON_ATTN stores decode K/V apart |
| ``VATTN_CACHE_ROOT`` | vattn's cache folder (default ``~/.cache/vattn``) |
| ``VATTN_DISABLE_COMPILE_CACHE`` | ``1``: ``vattn.compile`` stores no Dynamo trace |
| ``VATTN_COMPILE_CHECK_GUARDS`` | ``1``: every compiled call goes through Dynamo's guards |
| ``TRITON_INTERPRET`` | ``1``: Triton kernels on CPU (tests) |
| ``VATTN_Q_SCALE_CONSTANT`` | fp8 q-scale divisor (default 200) |
| ``VATTN_K_SCALE_CONSTANT`` | same for k (default 100) |
| ``VATTN_V_SCALE_CONSTANT`` | same for v (default 100) |
"""

from __future__ import annotations

import os
from typing import Any, Callable

__all__ = ["environment_variables", "is_set", "raw"]


def _opt_str(name: str) -> Callable[[], str | None]:
    return lambda: os.environ.get(name) or None


def _flag(name: str, default: str = "0") -> Callable[[], bool]:
    return lambda: os.environ.get(name, default).strip().lower() in ("1", "true", "yes", "on")


def _cache_root() -> str:
    root = os.environ.get("VATTN_CACHE_ROOT")
    if root:
        return os.path.expanduser(root)
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vattn")


def _int(name: str, default: int) -> Callable[[], int]:
    def read() -> int:
        raw = os.environ.get(name, "").strip()
        if not raw:
            return default
        try:
            return int(raw)
        except ValueError:
            raise ValueError(
                f"{name}: expected an integer, got {raw!r}; set it to an integer such as {default}, or unset it "
                f"for the default {default}."
            ) from None

    return read


environment_variables: dict[str, Callable[[], Any]] = {
    "VATTN_ATTENTION_BACKEND": _opt_str("VATTN_ATTENTION_BACKEND"),
    "VATTN_KV_CACHE_LAYOUT": _opt_str("VATTN_KV_CACHE_LAYOUT"),
    "VATTN_DEBUG_CHECKS": _flag("VATTN_DEBUG_CHECKS"),
    "VATTN_CUDAGRAPH_DEBUG": _flag("VATTN_CUDAGRAPH_DEBUG"),
    "VATTN_FLASHINFER_DECODE_TENSOR_CORES": _flag("VATTN_FLASHINFER_DECODE_TENSOR_CORES", default="1"),
    "VATTN_TRITON_FAST_LAUNCH": _flag("VATTN_TRITON_FAST_LAUNCH", default="1"),
    "VATTN_TRITON_FUSED_KV_STORE": _flag("VATTN_TRITON_FUSED_KV_STORE", default="1"),
    "VATTN_CACHE_ROOT": _cache_root,
    "VATTN_DISABLE_COMPILE_CACHE": _flag("VATTN_DISABLE_COMPILE_CACHE"),
    "VATTN_COMPILE_CHECK_GUARDS": _flag("VATTN_COMPILE_CHECK_GUARDS"),
    "TRITON_INTERPRET": _flag("TRITON_INTERPRET"),
    "VATTN_Q_SCALE_CONSTANT": _int("VATTN_Q_SCALE_CONSTANT", 200),
    "VATTN_K_SCALE_CONSTANT": _int("VATTN_K_SCALE_CONSTANT", 100),
    "VATTN_V_SCALE_CONSTANT": _int("VATTN_V_SCALE_CONSTANT", 100),
}

if __debug__:  # static names for type checkers
    VATTN_ATTENTION_BACKEND: str | None
    VATTN_KV_CACHE_LAYOUT: str | None
    VATTN_DEBUG_CHECKS: bool
    VATTN_CUDAGRAPH_DEBUG: bool
    VATTN_FLASHINFER_DECODE_TENSOR_CORES: bool
    VATTN_TRITON_FAST_LAUNCH: bool
    VATTN_TRITON_FUSED_KV_STORE: bool
    VATTN_CACHE_ROOT: str
    VATTN_DISABLE_COMPILE_CACHE: bool
    VATTN_COMPILE_CHECK_GUARDS: bool
    TRITON_INTERPRET: bool
    VATTN_Q_SCALE_CONSTANT: int
    VATTN_K_SCALE_CONSTANT: int
    VATTN_V_SCALE_CONSTANT: int


def is_set(name: str) -> bool:
    """Whether variable ``name`` (one of ``environment_variables``) is set, as opposed to at its default."""
    if name not in environment_variables:
        raise KeyError(f"{name!r} is not a vattn environment variable; known: {list(environment_variables)}.")
    return name in os.environ


def raw(name: str) -> str | None:
    """The text variable ``name`` is set to, or None when it is unset."""
    if name not in environment_variables:
        raise KeyError(f"{name!r} is not a vattn environment variable; known: {list(environment_variables)}.")
    return os.environ.get(name)


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)

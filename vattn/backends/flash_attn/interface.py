"""FLASH_ATTN's FlashAttention generations: which one is installed and usable here, and its limits.

The only vattn module that imports ``flash_attn`` / ``flash_attn_interface`` (lazily, inside
the probes). ``get_flash_attn_interface`` takes the first generation that is installed and
runs paged KV on this GPU, in this order:

| interface | call | paged KV | CUDA graphs |
| --- | --- | --- | --- |
| flash-attn-4 (``flash_attn.cute``) | varlen fwd with ``page_table``, ``seqused_k``, ``cu_seqlens_q``, ``out=`` | SM90, SM100/110 | ALWAYS |
| FA3 (``flash_attn_interface``) | ``flash_attn_with_kvcache`` with ``page_table``, ``cache_seqlens``, ``cu_seqlens_q`` | SM90 | ALWAYS |
| FA2 (``flash_attn`` 2.x) | ``flash_attn_varlen_func`` with ``block_table`` | SM80+, block size % 256 == 0 | UNIFORM_BATCH |
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch

from vattn.core.enums import AttentionCGSupport
from vattn.core.metadata import is_fp8_kv_cache

__all__ = ["FlashAttnInterface", "cg_support", "get_flash_attn_interface", "interface_reasons"]

_PLAIN_KV = ("auto", "bfloat16", "float16")


@dataclass(frozen=True)
class FlashAttnInterface:
    """The FlashAttention generation in use: ``"fa4"``, ``"fa3"`` or ``"fa2"``."""

    name: str
    version: str
    fn: Callable[..., Any]  # the paged varlen entry point
    has_out: bool = False  # ``fn`` takes ``out=`` (no copy of the result)


def _fa4(arch: int) -> FlashAttnInterface | None:
    if arch // 10 not in (9, 10, 11):  # no paged KV on SM80 / SM120 in flash-attn-4
        return None
    mod = importlib.import_module("flash_attn.cute.interface")
    from importlib.metadata import version

    fwd = getattr(mod, "_flash_attn_fwd", None)
    if fwd is not None and {"out", "page_table", "seqused_k"} <= set(inspect.signature(fwd).parameters):
        return FlashAttnInterface("fa4", version("flash-attn-4"), fwd, has_out=True)
    return FlashAttnInterface("fa4", version("flash-attn-4"), mod.flash_attn_varlen_func)


def _fa3(arch: int) -> FlashAttnInterface | None:
    if arch // 10 != 9:
        return None
    mod = importlib.import_module("flash_attn_interface")
    return FlashAttnInterface("fa3", str(getattr(mod, "__version__", "3")), mod.flash_attn_with_kvcache)


def _fa2(arch: int) -> FlashAttnInterface | None:
    mod = importlib.import_module("flash_attn")
    ver = str(getattr(mod, "__version__", ""))
    if arch < 80 or not ver.startswith("2.") or not hasattr(mod, "flash_attn_varlen_func"):
        return None
    return FlashAttnInterface("fa2", ver, mod.flash_attn_varlen_func)


@functools.lru_cache(maxsize=1)
def get_flash_attn_interface() -> tuple[FlashAttnInterface | None, str]:
    """The interface to use on this machine, or ``(None, why not)``."""
    if not torch.cuda.is_available():
        return None, "FLASH_ATTN needs a CUDA GPU and none is visible"
    major, minor = torch.cuda.get_device_capability()
    arch = major * 10 + minor
    why: list[str] = []
    for probe, label in ((_fa4, "flash-attn-4"), (_fa3, "FA3 (flash_attn_interface)"), (_fa2, "FA2 (flash_attn 2.x)")):
        try:
            iface = probe(arch)
        except Exception as e:  # not installed, or fails to import (e.g. a CUDA/torch ABI mismatch)
            why.append(f"{label}: {type(e).__name__}: {e}")
            continue
        if iface is not None:
            return iface, ""
        why.append(f"{label}: no paged KV on compute capability {major}.{minor}")
    return None, "no usable FlashAttention (" + "; ".join(why) + "); pip install flash-attn-4"


def interface_reasons(
    name: str, arch: int, head_size: int, dtype: torch.dtype, kv_cache_dtype: str, block_size: int, has_sink: bool
) -> list[str]:
    """Why interface ``name`` on compute capability ``arch`` (e.g. 90) cannot serve a configuration."""
    out: list[str] = []
    if dtype not in (torch.float16, torch.bfloat16):
        out.append(f"dtype {dtype} not in [torch.float16, torch.bfloat16]")
    sm100 = name == "fa4" and arch // 10 in (10, 11)  # flash-attn-4 on Blackwell: <= 128, or 256
    if head_size % 8 or not (8 <= head_size <= (128 if sm100 else 256) or head_size == 256):
        allowed = "multiples of 8 in [8, 128], or 256" if sm100 else "multiples of 8 in [8, 256]"
        out.append(f"{name} on sm{arch}: head_size {head_size} not in {allowed}")
    if name == "fa2" and block_size % 256:
        out.append(f"fa2 paged KV needs block_size % 256 == 0, got {block_size} (install flash-attn-4 or FA3)")
    fp8_ok = (name == "fa3" and kv_cache_dtype in ("fp8", "fp8_e4m3")) or (name == "fa4" and arch // 10 in (10, 11))
    if is_fp8_kv_cache(kv_cache_dtype):
        if not fp8_ok:
            out.append(f"{name} on sm{arch} has no fp8 KV cache '{kv_cache_dtype}' (FA3 on SM90: fp8_e4m3; "
                       "flash-attn-4 on SM100); use FLASHINFER or TRITON_ATTN")
        elif dtype != torch.bfloat16:
            out.append(f"fp8 KV with {name} writes bfloat16 output: the model dtype must be bfloat16, got {dtype}")
    elif kv_cache_dtype not in _PLAIN_KV:
        out.append(f"kv_cache_dtype {kv_cache_dtype!r} not in {list(_PLAIN_KV)} (or fp8)")
    if has_sink and name != "fa4":
        out.append(f"attention sinks need flash-attn-4 (learnable_sink), {name} has none")
    return out


def cg_support(iface: FlashAttnInterface | None) -> AttentionCGSupport:
    """The full-CUDA-graph level of ``iface`` (FA2 needs a uniform batch; no interface: the default)."""
    if iface is not None and iface.name == "fa2":
        return AttentionCGSupport.UNIFORM_BATCH
    return AttentionCGSupport.ALWAYS

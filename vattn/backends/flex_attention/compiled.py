"""Run FlexAttention compiled: one ``torch.compile``'d callable per static shape.

FlexAttention is fast only compiled (eager FlexAttention materializes every score). vattn calls
it from inside the opaque attention op, so the model's own graph never sees it. Shapes are
static and the builder pads them to powers of two (``bucket``), which bounds the compiles
per process: static batch sizes let Inductor pick its split-KV decoding kernel on CUDA for
1-query launches, and Inductor's CPU template does not compile every dynamic-shape variant.
Each shape key gets its own callable made from a fresh code object: Dynamo keeps its cache per
code object, so no key ever *re*compiles (nor counts against ``recompile_limit``, nor trips
``error_on_recompile``), and a call checks one key's guards.

``compiled=False`` runs FlexAttention's reference implementation (every score materialized)
through Dynamo's ``eager`` backend, keyed the same way: plain eager FlexAttention would trace
one shared wrapper that recompiles as shapes change. The reference also serves log-sum-exp on
CPU, which Inductor's CPU template does not return.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import types
from typing import Any, Callable

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

__all__ = ["bucket", "compiled_flex_count", "default_kernel_options", "flash_available", "run_flex",
           "with_decode_fallback"]

_COMPILED: dict[tuple[Any, ...], tuple[Callable[..., Any], dict[str, Any] | None]] = {}
logger = logging.getLogger("vattn.backends.flex_attention")


def bucket(n: int, floor: int = 1) -> int:
    """The power of two at least ``max(n, floor)``: the padded size of a launch dimension."""
    n = max(int(n), floor, 1)
    return 1 << (n - 1).bit_length()


def compiled_flex_count() -> int:
    """How many compiled FlexAttention callables this process holds (one per shape key)."""
    return len(_COMPILED)


#: Inductor Triton tiles of a gathered launch (its defaults for 128-key blocks can ask for more
#: shared memory than a GPU has once a mask_mod reads tensors).
GATHERED_TRITON: dict[str, Any] = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}


def default_kernel_options(device: torch.device, kv_block: int, *, gathered: bool = False,
                           dtype: torch.dtype | None = None, lse: bool = False) -> dict[str, Any]:
    """Kernel options vattn passes unless the layer overrides them.

    On CUDA, a key tile (``BLOCK_N``) that divides the key block of the block mask (a cache
    block; Inductor's default tiles go up to 128 keys); blocks of a multiple of 128 keep the
    default. A gathered launch (``FlexCall.kv_slots``) asks for FlashAttention's kernel
    (``BACKEND="FLASH"``) where ``flash_available`` says it may serve and the launch needs no
    log-sum-exp (``lse``: sinks; FLASH's does not match the reference), else ``GATHERED_TRITON``;
    ``run_flex`` falls back to the latter if FLASH cannot compile the launch's mods."""
    if device.type != "cuda":
        return {}
    if gathered:
        flash = not lse and dtype is not None and flash_available(device, dtype)
        return {"BACKEND": "FLASH"} if flash else dict(GATHERED_TRITON)
    if kv_block % 128 == 0:
        return {}
    return {"BLOCK_N": min(64, kv_block & -kv_block)}  # the largest power of two dividing it, at most 64


@functools.lru_cache(maxsize=None)
def _flash_importable() -> bool:
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except (ImportError, ValueError):  # flash_attn absent, or a broken install
        return False


@functools.lru_cache(maxsize=None)
def flash_available(device: torch.device, dtype: torch.dtype) -> bool:
    """FlexAttention's FlashAttention backend (flash-attn-4's CuTe kernels) may serve queries of
    ``dtype`` on ``device``: flash-attn-4 is installed, the GPU is Hopper or Blackwell, the dtype
    16-bit (cached: a forward asks once per launch)."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    if torch.cuda.get_device_capability(device)[0] not in (9, 10):
        return False
    return _flash_importable()


def with_decode_fallback(kernel_options: dict[str, Any] | None, q_len: int, group: int,
                         q_block: int) -> dict[str, Any] | None:
    """``kernel_options`` plus ``FORCE_USE_FLEX_ATTENTION`` where FlexAttention's decoding kernel
    would have no tile: it serves queries shorter than 128 and packs the ``group`` query heads of
    a KV head into one tile of ``next_pow2(q_len * group)`` rows (at least 16), which must divide
    the block mask's query block ``q_block``. A tree step of 64 drafts with 4 query heads per KV
    head (256 rows, blocks of 128) is such a case; the main kernel serves it."""
    rows = max(16, 1 << max(q_len * group - 1, 0).bit_length())
    if q_len < 128 and q_block % rows and "FORCE_USE_FLEX_ATTENTION" not in (kernel_options or {}):
        return {**(kernel_options or {}), "FORCE_USE_FLEX_ATTENTION": True}
    return kernel_options


def _flex(query: Tensor, key: Tensor, value: Tensor, score_mod: Any, block_mask: BlockMask, scale: float,
          kernel_options: dict[str, Any] | None, return_lse: bool) -> tuple[Tensor, Tensor | None]:
    if return_lse:
        out, aux = flex_attention(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale,
                                  enable_gqa=True, kernel_options=kernel_options, return_aux=AuxRequest(lse=True))
        return out, aux.lse
    out = flex_attention(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale,
                         enable_gqa=True, kernel_options=kernel_options)
    return out, None


def _new_callable(tag: int, backend: str) -> Callable[..., Any]:
    """``_flex`` compiled with ``backend``, from a code object of its own (its own Dynamo cache)."""
    code = _flex.__code__.replace(co_name=f"_flex_{tag}")
    fn = types.FunctionType(code, _flex.__globals__, code.co_name, _flex.__defaults__, _flex.__closure__)
    return torch.compile(fn, fullgraph=True, dynamic=False, backend=backend)


def _shape_key(query: Tensor, key: Tensor, block_mask: BlockMask) -> tuple[Any, ...]:
    masks = (block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
             block_mask.full_kv_indices)
    return (query.shape, query.stride(), query.dtype, query.device, key.shape, key.stride(), key.dtype,
            tuple(None if t is None else tuple(t.shape) for t in masks), block_mask.BLOCK_SIZE,
            block_mask.seq_lengths)


def run_flex(query: Tensor, key: Tensor, value: Tensor, *, score_mod: Any, block_mask: BlockMask, scale: float,
             kernel_options: dict[str, Any] | None, return_lse: bool, compiled: bool,
             mods_key: tuple[Any, ...]) -> tuple[Tensor, Tensor | None]:
    """``flex_attention(query, key, value, ...)`` with GQA, and its log-sum-exp when asked.

    | tensor | shape |
    | --- | --- |
    | query | (Bq, H, Lq, D) |
    | key, value | (1, Hk, num_blocks * block_size, D) |
    | returns | (Bq, H, Lq, D) in query's dtype; log-sum-exp (Bq, H, Lq) float32 or None |

    ``mods_key`` identifies the mods (and their captured shapes) beyond what the tensors say;
    ``compiled=False`` runs FlexAttention's reference implementation (slow).
    """
    inductor = compiled and not (return_lse and query.device.type == "cpu")
    backend = "inductor" if inductor else "eager"
    if inductor and query.device.type == "cuda":
        kernel_options = with_decode_fallback(kernel_options, query.shape[-2], query.shape[1] // key.shape[1],
                                              block_mask.BLOCK_SIZE[0])
    options = tuple(sorted((kernel_options or {}).items())) if inductor else ()
    cache_key = (_shape_key(query, key, block_mask), mods_key, options, return_lse, backend)
    entry = _COMPILED.get(cache_key)
    if entry is not None:
        fn, opts = entry
        return fn(query, key, value, score_mod, block_mask, scale, opts, return_lse)
    fn, opts = _new_callable(len(_COMPILED), backend), kernel_options if inductor else None
    args = (query, key, value, score_mod, block_mask, scale)
    if opts is not None and opts.get("BACKEND") == "FLASH":
        try:
            result = fn(*args, opts, return_lse)
        except Exception as e:  # noqa: BLE001  (Inductor raises several kinds for an unservable kernel)
            logger.warning("FlexAttention's FLASH backend cannot compile this launch (%s: %s); using its Triton "
                           "kernel instead.", type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
            opts = {**GATHERED_TRITON, **{k: v for k, v in opts.items() if k != "BACKEND"}}
            fn = _new_callable(len(_COMPILED) + 1, backend)
        else:
            _COMPILED[cache_key] = (fn, opts)
            return result
    _COMPILED[cache_key] = (fn, opts)
    return fn(*args, opts, return_lse)

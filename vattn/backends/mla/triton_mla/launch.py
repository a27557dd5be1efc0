"""TRITON_MLA's launchers (importing this module imports Triton): ``mla_decode`` and ``mla_prefill``.

Neither synchronizes the host. ``mla_decode``'s grid depends only on the number of decodes,
heads and splits, so a CUDA graph captured for a batch size replays for any sequence lengths.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from vattn.backends.mla.triton_mla.config import (
    DecodeTiles,
    decode_tiles,
    device_capability,
    device_smem_bytes,
    split_scratch_numel,
)
from vattn.backends.mla.triton_mla.kernels import _mla_combine_kernel, _mla_decode_kernel, _mla_prefill_kernel
from vattn.kernels.fp8 import FP8_DTYPES
from vattn.kernels.launch import FastLaunch, next_power_of_2

__all__ = ["mla_decode", "mla_prefill"]

logger = logging.getLogger("vattn.backends.mla")

_DECODE = FastLaunch(_mla_decode_kernel)
_COMBINE = FastLaunch(_mla_combine_kernel)
_PREFILL = FastLaunch(_mla_prefill_kernel)


def _pad(n: int) -> int:
    return max(16, next_power_of_2(n))


@functools.lru_cache(maxsize=None)
def _wgmma() -> Any:
    """``triton_mla.wgmma`` (Gluon), or None where this Triton has no Gluon for Hopper (the Triton kernel runs)."""
    try:
        from vattn.backends.mla.triton_mla import wgmma
    except (ImportError, AttributeError) as e:  # no Gluon, or one without the names the kernel uses
        logger.info("TRITON_MLA: no warpgroup-MMA decode (%s); the Triton kernel runs", e)
        return None
    return wgmma


@functools.lru_cache(maxsize=None)
def _seesaw() -> Any:
    """``triton_mla.seesaw`` (Gluon, warp-specialized), or None where this Triton lacks what it uses."""
    try:
        from vattn.backends.mla.triton_mla import seesaw
    except (ImportError, AttributeError) as e:
        logger.info("TRITON_MLA: no warp-specialized decode (%s); the warpgroup-MMA kernel runs", e)
        return None
    return seesaw


def _hopper_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
                   tiles: DecodeTiles, num_splits: int) -> Any:
    """The Gluon decode for these tensors (bf16 / fp16; the caller checks the device and fp8):
    ``seesaw.mla_decode_seesaw`` for a launch without splits over pages of 64-row multiples,
    else ``wgmma.mla_decode_wgmma``; None where ``tiles`` or the tensors allow neither (the
    Triton kernel runs)."""
    wgmma = _wgmma() if tiles.wgmma else None
    if wgmma is None or wgmma.wgmma_unsupported(q_nope, q_pe, kv_cache, out) is not None:
        return None
    seesaw = _seesaw() if tiles.seesaw and num_splits == 1 else None
    if seesaw is not None and seesaw.seesaw_unsupported(kv_cache) is None:
        return seesaw.mla_decode_seesaw
    return wgmma.mla_decode_wgmma


def mla_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, *,
               query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
               softmax_scale: float, kv_lora_rank: int, num_splits: int = 1, kv_scale: torch.Tensor | None = None,
               partial_out: torch.Tensor | None = None, partial_lse: torch.Tensor | None = None,
               tiles: DecodeTiles | None = None) -> None:
    """Absorbed MLA decode over a paged latent cache, written into ``out``.

    | tensor | shape | dtype |
    | --- | --- | --- |
    | q_nope | (R, H, L): the query with ``W_UK`` absorbed; any strides | fp16 / bf16 / fp32 |
    | q_pe | (R, H, P): the RoPE part of the query; any strides | as q_nope |
    | kv_cache | (num_blocks, block_size, L + P) | q's, or fp8 with ``kv_scale`` |
    | out | (R, H, L) | any float |
    | query_start_loc | (B + 1,): decode ``b``'s row is ``query_start_loc[b]`` (none if equal to the next) | int32 |
    | seq_lens, block_table | (B,), (B, max_blocks) | int32 |

    ``num_splits > 1`` writes fp32 partials into ``partial_out`` / ``partial_lse`` (allocated when
    not given; ``split_scratch_numel`` sizes them) and merges them into ``out``. ``tiles``:
    the launch's tiles (None: ``decode_tiles`` for this device); ``tiles.wgmma`` runs the
    Hopper warpgroup-MMA kernel (``triton_mla.wgmma``) where these tensors allow it, and
    ``tiles.seesaw`` the warp-specialized one (``triton_mla.seesaw``) for launches without
    splits where the cache allows it.
    """
    rows, num_heads, lora = q_nope.shape
    rope = q_pe.shape[2]
    num_reqs = seq_lens.shape[0]
    if kv_cache.dim() != 3 or kv_cache.shape[2] != lora + rope:
        raise ValueError(f"kv_cache must be (num_blocks, block_size, L + P = {lora + rope}), got {tuple(kv_cache.shape)}.")
    if rows == 0 or num_reqs == 0:
        return
    fp8 = kv_cache.dtype in FP8_DTYPES
    if fp8 and kv_scale is None:
        raise ValueError("kv_scale is required for an fp8 latent cache; pass the layer's _k_scale.")
    lora_pad = _pad(lora)
    if num_splits > 1:
        n_o, n_lse = split_scratch_numel(rows, num_heads, lora, num_splits)
        if partial_out is None or partial_lse is None:
            partial_out = torch.empty(n_o, dtype=torch.float32, device=q_nope.device)
            partial_lse = torch.empty(n_lse, dtype=torch.float32, device=q_nope.device)
        if partial_out.numel() < n_o or partial_lse.numel() < n_lse:
            raise ValueError(f"split scratch too small for {num_splits} splits of {rows} rows: need {n_o} / {n_lse} "
                             f"fp32 elements, got {partial_out.numel()} / {partial_lse.numel()}.")
    else:
        partial_out = partial_lse = out
    dot_fp32 = q_nope.device.type != "cuda" or q_nope.dtype == torch.float32
    if tiles is None:
        tiles = decode_tiles(num_heads, lora, device_smem_bytes(q_nope.device),
                             capability=device_capability(q_nope.device))
    hopper = _hopper_decode(q_nope, q_pe, kv_cache, out, tiles, num_splits) if not fp8 and q_nope.is_cuda else None
    if hopper is not None:
        hopper(q_nope, q_pe, kv_cache, out, query_start_loc=query_start_loc, seq_lens=seq_lens,
               block_table=block_table, softmax_scale=softmax_scale, num_splits=num_splits,
               partial_out=partial_out, partial_lse=partial_lse)
    else:
        grid = (num_reqs, -(-num_heads // tiles.block_h), num_splits)
        _DECODE[grid](
            q_nope, q_pe, kv_cache, out, partial_out, partial_lse,
            query_start_loc, seq_lens, block_table, kv_scale if fp8 else out,
            float(softmax_scale), num_heads, rows,
            *q_nope.stride(), *q_pe.stride(), *kv_cache.stride(), *out.stride(), block_table.stride(0),
            LORA=lora, LORA_PAD=lora_pad, ROPE=rope, ROPE_PAD=_pad(rope), PAGE_SIZE=kv_cache.shape[1],
            BLOCK_H=tiles.block_h, BLOCK_N=tiles.block_n, NUM_SPLITS=num_splits, KV_FP8=fp8, DOT_FP32=dot_fp32,
            num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        )
    if num_splits > 1:
        _COMBINE[(rows, num_heads)](
            out, partial_out, partial_lse, num_heads, rows, *out.stride(),
            LORA=lora, LORA_PAD=lora_pad, NUM_SPLITS=num_splits, num_warps=4 if lora_pad <= 256 else 8,
        )


def mla_prefill(q: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor, *,
                cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, softmax_scale: float,
                causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Up-projected MLA attention over ragged keys: returns (out (T, H, V) fp32, lse (T, H) fp32).

    | tensor | shape |
    | --- | --- |
    | q | (T, H, NOPE + ROPE), RoPE part last |
    | k_nope | (S, H, NOPE) |
    | k_pe | (S, ROPE), shared by the heads |
    | v | (S, H, V) |
    | cu_seqlens_q, cu_seqlens_k | (B + 1,) int32: request ``b``'s query rows and keys |

    ``causal``: query ``i`` of a request with ``n`` queries and ``m`` keys sees keys ``j <= m - n + i``.
    Rows with no key get lse -inf and a zero output.
    """
    t, num_heads, _ = q.shape
    nope, rope, vd = k_nope.shape[2], k_pe.shape[1], v.shape[2]
    out = torch.empty((t, num_heads, vd), dtype=torch.float32, device=q.device)
    lse = torch.empty((t, num_heads), dtype=torch.float32, device=q.device)
    b = cu_seqlens_q.shape[0] - 1
    if t == 0 or b == 0:
        return out, lse
    block_m = 64 if q.device.type == "cuda" else 16
    dot_fp32 = q.device.type != "cuda" or q.dtype == torch.float32
    grid = (-(-max_seqlen_q // block_m), b, num_heads)
    _PREFILL[grid](
        q, k_nope, k_pe, v, out, lse, cu_seqlens_q, cu_seqlens_k, float(softmax_scale),
        *q.stride(), *k_nope.stride(), *k_pe.stride(), *v.stride(), *out.stride(), *lse.stride(),
        NOPE=nope, NOPE_PAD=_pad(nope), ROPE=rope, ROPE_PAD=_pad(rope), V=vd, V_PAD=_pad(vd),
        BLOCK_M=block_m, BLOCK_N=64 if q.device.type == "cuda" else 16, CAUSAL=bool(causal), DOT_FP32=dot_fp32,
        num_warps=4, num_stages=2,
    )
    return out, lse

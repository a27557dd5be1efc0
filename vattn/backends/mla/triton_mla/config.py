"""TRITON_MLA's launch choices from static sizes only (nothing here imports Triton).

``decode_tiles`` picks the absorbed decode's tiles from the number of query heads, the latent
width and the device's shared memory; ``decode_num_splits`` picks its split-KV count from the
number of decodes, heads and SMs, never from sequence lengths: every replay of a CUDA graph
captured for a batch size takes the path its capture took.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from vattn.kernels.launch import next_power_of_2

__all__ = ["DecodeTiles", "LARGE_TILE_SMEM", "MAX_SPLITS", "ONE_WAVE_MAX_SPLITS", "SPLIT_SCRATCH_BYTES", "WGMMA_LORA",
           "decode_num_splits", "decode_tiles", "device_capability", "device_smem_bytes", "split_scratch_numel"]

MAX_SPLITS = 32
"""Most KV splits of one decode (a power of two)."""
ONE_WAVE_MAX_SPLITS = 64
"""Most KV splits of one decode on the warpgroup-MMA kernel, whose programs fill one SM each."""
SPLIT_SCRATCH_BYTES = 64 << 20
"""Budget of the fp32 split partials (``splits * rows * heads * pad(kv_lora_rank)``)."""


@dataclass(frozen=True)
class DecodeTiles:
    """One absorbed-decode launch's tiles.

    ``block_h``: query heads per program (the M of its ``tl.dot``; 16 to 64): each key tile is
    read once for that many heads, so ``H / block_h`` programs read every latent row.
    ``block_n``: latent rows per key tile. ``num_warps`` / ``num_stages``: Triton's.
    """

    block_h: int
    block_n: int
    num_warps: int
    num_stages: int
    wgmma: bool = False
    """Hopper: launch the warpgroup-MMA kernel (``triton_mla.wgmma``) where the tensors allow it
    (bf16 / fp16, latent 512 + RoPE 64), else the Triton kernel with these tiles; its split
    count targets one wave of programs (``decode_num_splits(one_wave=True)``)."""
    seesaw: bool = False
    """With ``wgmma``: launch the warp-specialized kernel (``triton_mla.seesaw``) for launches
    without splits where the cache allows it (pages of a multiple of 64 rows), else the
    warpgroup-MMA kernel."""


#: Shared memory per block (bytes) the large tiles need: Hopper's 227 KiB, not Ampere's 164.
LARGE_TILE_SMEM = 200 << 10
#: The latent width the warpgroup-MMA kernel serves (``triton_mla.wgmma.LORA``).
WGMMA_LORA = 512


def decode_tiles(num_heads: int, kv_lora_rank: int, smem_bytes: int = 0, *, capability: tuple[int, int] = (0, 0)
                 ) -> DecodeTiles:
    """The decode tiles for ``num_heads`` query heads over a ``kv_lora_rank``-wide latent, on a
    device with ``smem_bytes`` of shared memory per block (``device_smem_bytes``; 0: small tiles)
    and compute ``capability`` (``device_capability``; sm_90 takes the warpgroup-MMA kernel).

    A key tile of a 512-wide latent is 64 rows where shared memory holds two of them beside the
    query block: few heads (16 per GPU under tensor parallelism) then read the cache once with
    16-row MMAs; many heads (128) take 64 a program (one Hopper warpgroup MMA), so the cache is
    read twice instead of eight times. Elsewhere (Ampere, Ada) 16 heads and 32-row key tiles fit.
    """
    wide = next_power_of_2(kv_lora_rank) >= 512
    if not wide:
        return DecodeTiles(block_h=16, block_n=64, num_warps=4, num_stages=2)
    if smem_bytes < LARGE_TILE_SMEM:
        return DecodeTiles(block_h=16, block_n=32, num_warps=8, num_stages=2)
    if num_heads <= 16:
        return DecodeTiles(block_h=16, block_n=64, num_warps=4, num_stages=2)
    wgmma = capability[0] == 9 and kv_lora_rank == WGMMA_LORA
    return DecodeTiles(block_h=64, block_n=64, num_warps=8, num_stages=2, wgmma=wgmma, seesaw=wgmma)


def device_capability(device: torch.device | str) -> tuple[int, int]:
    """(major, minor) compute capability of a CUDA ``device`` (``current_platform``'s); (0, 0) elsewhere."""
    from vattn.platform import current_platform

    device = torch.device(device)
    if device.type != "cuda":
        return (0, 0)
    cap = current_platform.get_device_capability(device.index if device.index is not None
                                                 else torch.cuda.current_device())
    return (0, 0) if cap is None else (cap.major, cap.minor)


@functools.lru_cache(maxsize=None)
def _smem(index: int) -> int:
    props = torch.cuda.get_device_properties(index)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or 0)


def device_smem_bytes(device: torch.device | str) -> int:
    """Shared memory one block may use on ``device`` (0 off CUDA: the interpreter takes small tiles); cached."""
    device = torch.device(device)
    if device.type != "cuda":
        return 0
    return _smem(device.index if device.index is not None else torch.cuda.current_device())


def split_scratch_numel(rows: int, num_heads: int, kv_lora_rank: int, num_splits: int) -> tuple[int, int]:
    """Elements of the (partial_out, partial_lse) fp32 scratch for ``num_splits`` splits."""
    return num_splits * rows * num_heads * max(16, next_power_of_2(kv_lora_rank)), num_splits * rows * num_heads


def decode_num_splits(num_decodes: int, num_heads: int, kv_lora_rank: int, num_sms: int,
                      scratch_numel: int | None = None, block_h: int = 16, one_wave: bool = False) -> int:
    """Split KV until about one program runs per SM: ``num_decodes * cdiv(H, block_h)``
    programs without splits (``block_h``: the launch's ``DecodeTiles.block_h``); capped by
    ``MAX_SPLITS`` and by the scratch (``scratch_numel`` fp32 elements of partial output; None:
    ``SPLIT_SCRATCH_BYTES``). More splits than that only add partials to merge. ``one_wave``
    (the warpgroup-MMA kernel, one program an SM by its shared memory): at most one program per
    SM, so a second, nearly empty wave never runs."""
    programs = max(1, num_decodes) * -(-num_heads // block_h)
    splits = 1
    if one_wave:
        while splits < ONE_WAVE_MAX_SPLITS and programs * splits * 2 <= num_sms:
            splits *= 2
    elif programs < num_sms:
        splits = min(MAX_SPLITS, next_power_of_2(-(-num_sms // programs)))
    budget = SPLIT_SCRATCH_BYTES // 4 if scratch_numel is None else scratch_numel
    while splits > 1 and split_scratch_numel(num_decodes, num_heads, kv_lora_rank, splits)[0] > budget:
        splits //= 2
    return splits

"""Launch configurations of TRITON_ATTN's unified kernel, chosen from static sizes only.

``select_unified_attention_config`` maps a batch's static sizes (tokens, requests, heads,
head size, whether it is decode-only) to an ``UnifiedAttentionConfig``; the builder calls it
once per distinct size, so every replay of a CUDA graph captured for a size takes the same
kernel path. The split-KV scratch is sized here too (``default_max_split_rows``,
``split_scratch_numel``). Nothing in this module imports Triton.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from vattn.kernels.launch import next_power_of_2

__all__ = [
    "MAX_SPLITS",
    "SPLIT_SCRATCH_BYTES",
    "SPLIT_TARGET_PROGRAMS_PER_SM",
    "UnifiedAttentionConfig",
    "default_max_split_rows",
    "device_num_sms",
    "head_pad",
    "select_unified_attention_config",
    "split_scratch_numel",
]

MAX_SPLITS = 64
"""Most KV splits of one q block (a power of two)."""
SPLIT_TARGET_PROGRAMS_PER_SM: float = 1
"""Split KV until about this many programs per SM run (chosen with ``benchmarks/profile_step.py``,
``benchmarks/results/profile-split-target-*``): fewer splits leave fewer partials for the
combine to read, while a split still holds 16 - 128 keys."""
SPLIT_SCRATCH_BYTES = 16 << 20
"""Budget of the split-KV partial-output scratch (fp32), bounding ``num_splits * num_tokens``."""


@dataclass(frozen=True)
class UnifiedAttentionConfig:
    """Launch configuration of the unified kernel (all fields are compile-time constants).

    Args:
        block_m: rows of a query tile: ``block_m // qpk`` tokens x the ``qpk`` query heads of
            one KV head (power of two, at least 16 for ``tl.dot``).
        tile_n: key tokens per inner iteration (power of two, at least 16).
        num_splits: KV splits per q block (1 = write the output directly; else a power of
            two and a combine kernel merges the partials).
        num_warps, num_stages: Triton launch options of the attention kernel.
        maxnreg: register cap per thread (Triton's ``maxnreg``; None = the compiler's
            choice), to fit more programs per SM.
        one_loop: run every key tile through the masked path in one loop (decode) instead
            of unmasked interior tiles plus masked edge tiles in separate loops (prefill).
    """

    block_m: int
    tile_n: int
    num_splits: int = 1
    num_warps: int = 4
    num_stages: int = 3
    maxnreg: int | None = None
    one_loop: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "tile_n", "num_splits"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"UnifiedAttentionConfig.{name} must be a power of two, got {v}.")
        if self.block_m < 16 or self.tile_n < 16:
            raise ValueError(
                f"UnifiedAttentionConfig needs block_m >= 16 and tile_n >= 16 (tl.dot minimum), "
                f"got block_m={self.block_m}, tile_n={self.tile_n}."
            )
        if self.num_splits > MAX_SPLITS:
            raise ValueError(f"num_splits must be <= {MAX_SPLITS}, got {self.num_splits}.")

    def block_q(self, qpk: int) -> int:
        """Query tokens per tile when ``qpk`` query heads share a KV head."""
        return max(1, self.block_m // qpk)


def head_pad(head_size: int) -> int:
    """The power-of-two head dimension the kernels compute with (at least 16)."""
    return max(16, next_power_of_2(head_size))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=None)
def _num_sms(device_type: str, index: int | None) -> int:
    if device_type == "cuda":
        return torch.cuda.get_device_properties(index if index is not None else 0).multi_processor_count
    return 4  # the interpreter: a small pretend machine


def device_num_sms(device: torch.device | str) -> int:
    """Streaming multiprocessors of ``device`` (4 for CPU / the Triton interpreter); cached."""
    device = torch.device(device)
    index = device.index
    if device.type == "cuda" and index is None:
        index = torch.cuda.current_device()
    return _num_sms(device.type, index)


def default_max_split_rows(num_q_heads: int, head_size: int) -> int:
    """Largest ``num_splits * num_tokens`` whose fp32 partials fit ``SPLIT_SCRATCH_BYTES``."""
    return max(MAX_SPLITS, SPLIT_SCRATCH_BYTES // (num_q_heads * head_pad(head_size) * 4))


def split_scratch_numel(max_split_rows: int, num_q_heads: int, head_size: int) -> tuple[int, int]:
    """Elements of the (partial_out, partial_lse) fp32 scratch for ``max_split_rows`` rows."""
    return max_split_rows * num_q_heads * head_pad(head_size), max_split_rows * num_q_heads


def select_unified_attention_config(
    *,
    num_tokens: int,
    num_seqs: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
    max_seqlen_q: int,
    num_sms: int,
    max_split_rows: int | None = None,
    kv_fp8: bool = False,
) -> UnifiedAttentionConfig:
    """Pick the launch config from static sizes only (deterministic: CUDA-graph safe).

    Decode-only batches (``max_seqlen_q <= 1``) get a small M tile (one token x the query
    heads of a KV head), every key tile in one masked, software-pipelined loop, and split
    KV when ``num_seqs * num_kv_heads`` programs would leave SMs idle; batches with longer
    queries get 64/128-row tiles (wgmma on Hopper) with unmasked interior tiles.
    ``num_splits * num_tokens`` never exceeds ``max_split_rows`` (the scratch size).

    The decode tiles are chosen by ``benchmarks/sweep_triton_attn.py``: bf16 decode is
    load-bound and takes 32-token tiles with 3 stages (two tiles in flight), which fit 4
    programs per SM; fp8 decode does more work per byte (the cast) and takes 64-token tiles
    capped at 128 registers, so 4 programs still fit an SM.
    """
    qpk = num_q_heads // num_kv_heads
    hp = head_pad(head_size)
    min_m = max(16, next_power_of_2(qpk))
    maxnreg = None
    one_loop = False
    if max_seqlen_q <= 1:
        block_m = min_m
        tile_n = 64 if kv_fp8 and hp <= 128 else 32
        num_warps, num_stages, one_loop = 4, 3, True
        if kv_fp8 and hp <= 128 and block_m == 16:
            maxnreg = 128
    else:
        big_m = 128 if hp <= 128 else 64
        block_m = max(min_m, min(big_m, next_power_of_2(qpk * max_seqlen_q)))
        tile_n = 64 if hp <= 128 else 32
        num_warps = 8 if block_m >= 128 or hp > 128 else 4  # D 256 at 4 warps spills
        num_stages = 3
    block_q = max(1, block_m // qpk)
    programs = max(num_seqs, _cdiv(num_tokens, block_q)) * num_kv_heads
    target = max(1, int(SPLIT_TARGET_PROGRAMS_PER_SM * num_sms))
    num_splits = 1
    if 0 < programs < target:
        num_splits = min(MAX_SPLITS, next_power_of_2(_cdiv(target, programs)))
        rows = max_split_rows if max_split_rows is not None else default_max_split_rows(
            num_q_heads, head_size)
        while num_splits > 1 and num_splits * num_tokens > rows:
            num_splits //= 2
    return UnifiedAttentionConfig(block_m, tile_n, num_splits, num_warps, num_stages, maxnreg, one_loop)

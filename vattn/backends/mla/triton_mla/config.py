"""TRITON_MLA's launch choices from static sizes only (nothing here imports Triton).

``decode_num_splits`` picks the split-KV count of the absorbed decode from the number of
decodes, heads and SMs, never from sequence lengths: every replay of a CUDA graph captured
for a batch size takes the path its capture took.
"""

from __future__ import annotations

from vattn.kernels.launch import next_power_of_2

__all__ = ["BLOCK_H", "MAX_SPLITS", "SPLIT_SCRATCH_BYTES", "decode_block_n", "decode_num_splits",
           "split_scratch_numel"]

BLOCK_H = 16
"""Query heads per decode program (the M dimension of its ``tl.dot``; at least 16)."""
MAX_SPLITS = 32
"""Most KV splits of one decode (a power of two)."""
SPLIT_SCRATCH_BYTES = 64 << 20
"""Budget of the fp32 split partials (``splits * rows * heads * pad(kv_lora_rank)``)."""


def decode_block_n(kv_lora_rank: int) -> int:
    """Latent rows per decode key tile: fewer for wide latents (the tile and the (16, L)
    accumulator share the registers)."""
    return 32 if next_power_of_2(kv_lora_rank) >= 512 else 64


def split_scratch_numel(rows: int, num_heads: int, kv_lora_rank: int, num_splits: int) -> tuple[int, int]:
    """Elements of the (partial_out, partial_lse) fp32 scratch for ``num_splits`` splits."""
    return num_splits * rows * num_heads * max(16, next_power_of_2(kv_lora_rank)), num_splits * rows * num_heads


def decode_num_splits(num_decodes: int, num_heads: int, kv_lora_rank: int, num_sms: int,
                      scratch_numel: int | None = None) -> int:
    """Split KV until about two programs run per SM: ``num_decodes * cdiv(H, BLOCK_H)``
    programs without splits; capped by ``MAX_SPLITS`` and by the scratch (``scratch_numel``
    fp32 elements of partial output; None: ``SPLIT_SCRATCH_BYTES``)."""
    programs = max(1, num_decodes) * -(-num_heads // BLOCK_H)
    target = 2 * num_sms
    splits = 1
    if programs < target:
        splits = min(MAX_SPLITS, next_power_of_2(-(-target // programs)))
    budget = SPLIT_SCRATCH_BYTES // 4 if scratch_numel is None else scratch_numel
    while splits > 1 and split_scratch_numel(num_decodes, num_heads, kv_lora_rank, splits)[0] > budget:
        splits //= 2
    return splits

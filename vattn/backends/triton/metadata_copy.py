"""One launch that writes a step's attention metadata into CUDA-graph persistent buffers.

Before a graph replay the TRITON_ATTN builder copies ``query_start_loc``, ``seq_lens``,
``slot_mapping`` and the block table into the buffers the graph reads, and fills the rows of
padded requests: four to six small copies, each a launch with its own gap on the GPU.
``copy_decode_metadata`` does them in one kernel: program 0 writes the 1-D arrays, program
``1 + r`` block-table row ``r`` (measured with ``benchmarks/profile_step.py``,
``benchmarks/results/profile-metadata-copy-*``).

| argument | shape | dtype |
| --- | --- | --- |
| ``qsl_src`` / ``qsl_dst`` | (B + 1,) / (Bk + 1,) | int32 |
| ``seq_src`` / ``seq_dst`` | (B,) / (Bk,) | int32 |
| ``slot_src`` / ``slot_dst`` | (T,) / (T,) | int64 |
| ``bt_src`` / ``bt_dst`` | (B, W) / (B, W), unit stride along W | int32 |

Rows ``B..Bk`` of the destinations are padded requests: empty (``query_start_loc`` repeats its
last entry, ``seq_lens`` is 0), as ``CUDAGraphRunner`` pads a batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vattn.kernels.launch import FastLaunch, next_power_of_2

__all__ = ["copy_decode_metadata"]

_BLOCK = 1024


@triton.jit
def _copy_metadata_kernel(qsl_src, qsl_dst, seq_src, seq_dst, slot_src, slot_dst, bt_src, bt_dst,
                          num_reqs, padded_reqs, num_tokens, bt_cols, stride_bt_src, stride_bt_dst,
                          BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    if pid == 0:
        last = tl.load(qsl_src + num_reqs)  # padded requests start (and end) where the batch ends
        for i0 in range(0, padded_reqs + 1, BLOCK):
            i = i0 + offs
            v = tl.load(qsl_src + i, mask=i <= num_reqs, other=0)
            tl.store(qsl_dst + i, tl.where(i <= num_reqs, v, last), mask=i <= padded_reqs)
        for i0 in range(0, padded_reqs, BLOCK):
            i = i0 + offs
            tl.store(seq_dst + i, tl.load(seq_src + i, mask=i < num_reqs, other=0), mask=i < padded_reqs)
        for i0 in range(0, num_tokens, BLOCK):
            i = i0 + offs
            tl.store(slot_dst + i, tl.load(slot_src + i, mask=i < num_tokens), mask=i < num_tokens)
    else:
        row = pid - 1
        for c0 in range(0, bt_cols, BLOCK):
            c = c0 + offs
            v = tl.load(bt_src + row.to(tl.int64) * stride_bt_src + c, mask=c < bt_cols)
            tl.store(bt_dst + row.to(tl.int64) * stride_bt_dst + c, v, mask=c < bt_cols)


_launch = FastLaunch(_copy_metadata_kernel)


def copy_decode_metadata(qsl_src: torch.Tensor, seq_src: torch.Tensor, slot_src: torch.Tensor,
                         bt_src: torch.Tensor, qsl_dst: torch.Tensor, seq_dst: torch.Tensor,
                         slot_dst: torch.Tensor, bt_dst: torch.Tensor) -> None:
    """Copy a batch's metadata into persistent buffers in one launch (shapes in the module docstring).

    ``B`` is ``bt_src.shape[0]``, ``Bk`` is ``seq_dst.shape[0]`` (>= B) and ``T`` is
    ``slot_src.shape[0]``; every tensor is 1-D contiguous except the block tables, whose rows
    may be strided (``bt_dst`` a slice of a wider buffer). The caller checks the shapes: this
    runs on every step, before a graph replay.
    """
    b, width = bt_src.shape
    _launch[(1 + b,)](
        qsl_src, qsl_dst, seq_src, seq_dst, slot_src, slot_dst, bt_src, bt_dst,
        b, seq_dst.shape[0], slot_src.shape[0], width, bt_src.stride(0), bt_dst.stride(0),
        BLOCK=min(_BLOCK, next_power_of_2(max(width, seq_dst.shape[0] + 1, slot_src.shape[0]))),
        num_warps=4,
    )

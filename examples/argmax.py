"""Row-wise argmax of logits in Triton: greedy sampling's ``logits.argmax(-1)`` in two kernels.

torch reduces each row of an argmax in one thread block (one row of a 128k vocabulary: tens of
microseconds), and a chunked torch argmax (the maxima of chunks, then the argmax of those) is
four kernels. Here the first kernel reduces chunks of ``BLOCK`` logits, one per program over
``rows x chunks`` programs, to a partial (key, index); the second reduces each row's partials.
On sm_90+ both launch with programmatic dependent launch inside CUDA graphs, so each one's
launch hides under the kernel before it (the LM head, then the first).
Two kernels, no atomics and no state kept between calls, so calls on different streams
cannot interfere. On an H200, inside a CUDA graph: ``profile-greedy``.

Ties and special values follow ``torch.argmax``: the first maximum wins, NaN counts as larger
than everything (the first NaN wins), and -0.0 equals 0.0. Each logit becomes an int32 key
ordered like its float value (the sign-magnitude bits flipped for negatives; NaN the largest
key), so the reductions compare integers.

| argument | shape | layout |
| --- | --- | --- |
| ``logits`` | (N, V) float16 / bfloat16 / float32 | unit stride along V |
| result | (N,) int64 | contiguous |
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vattn.kernels.launch import FastLaunch, next_power_of_2, pdl_supported

__all__ = ["argmax"]

#: Logits a program of the first kernel reads (one load each: a chunk).
_BLOCK = 4096
_INT32_MAX = 2**31 - 1


@triton.jit
def _order_key(v):
    """float -> int32 ordered as the float: NaN the largest, -0.0 and 0.0 equal."""
    f = v.to(tl.float32)
    f = tl.where(f == 0.0, 0.0, f)
    bits = f.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return tl.where(f != f, 0x7FFFFFFF, key)


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _minimum(a, b):
    return tl.minimum(a, b)


@triton.jit
def _first_max(key, idx):
    """The largest key and the smallest index holding it, over a 1-D block. (``tl.reduce``
    with local combines, as ``tl.max`` does: it also runs under the CPU tests' interpreter.)"""
    best = tl.reduce(key, 0, _maximum)
    return best, tl.reduce(tl.where(key == best, idx, 0x7FFFFFFF), 0, _minimum)


@triton.jit
def _chunk_argmax_kernel(x_ptr, key_ptr, idx_ptr, V, stride_x, num_chunks,
                         BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    c = tl.program_id(0)
    row = tl.program_id(1)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the logits' kernel (the LM head) has finished
        tl.extra.cuda.gdc_launch_dependents()  # the row reduction may launch now (it waits for us)
    idx = c * BLOCK + tl.arange(0, BLOCK)
    ok = idx < V
    v = tl.load(x_ptr + row.to(tl.int64) * stride_x + idx, mask=ok, other=0.0)
    k, i = _first_max(tl.where(ok, _order_key(v), -2147483648), idx)
    tl.store(key_ptr + row * num_chunks + c, k)
    tl.store(idx_ptr + row * num_chunks + c, i)


@triton.jit
def _row_argmax_kernel(key_ptr, idx_ptr, out_ptr, num_chunks, CHUNKS: tl.constexpr, USE_PDL: tl.constexpr):
    row = tl.program_id(0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    cs = tl.arange(0, CHUNKS)
    ok = cs < num_chunks
    key = tl.load(key_ptr + row * num_chunks + cs, mask=ok, other=-2147483648)
    idx = tl.load(idx_ptr + row * num_chunks + cs, mask=ok, other=2147483647)
    _, i = _first_max(key, idx)
    tl.store(out_ptr + row, i.to(tl.int64))


_chunks_launch = FastLaunch(_chunk_argmax_kernel)
_rows_launch = FastLaunch(_row_argmax_kernel)


def argmax(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``logits.argmax(-1)`` of (N, V) logits as (N,) int64 (into ``out`` if given).

    Args:
        logits: (N, V) float16, bfloat16 or float32 with unit stride along V, V >= 1 (N may be 0).
        out: optional (N,) int64 result, contiguous.

    Returns:
        The index of each row's first maximum; NaN counts as the maximum, as in ``torch.argmax``.
    """
    if logits.dim() != 2 or logits.dtype not in (torch.float16, torch.bfloat16, torch.float32) \
            or logits.stride(1) != 1 or logits.shape[1] == 0:
        raise ValueError(f"argmax: expected (N, V) float16/bfloat16/float32 logits with V >= 1 and unit stride "
                         f"along V; got shape {tuple(logits.shape)}, dtype {logits.dtype}, strides {logits.stride()}.")
    n, vocab = logits.shape
    if vocab >= _INT32_MAX:
        raise ValueError(f"argmax: V must be below 2**31 (int32 indices); got {vocab}.")
    if out is None:
        out = torch.empty(n, dtype=torch.int64, device=logits.device)
    elif out.shape != (n,) or out.dtype != torch.int64 or not out.is_contiguous() or out.device != logits.device:
        raise ValueError(f"argmax: out must be a contiguous ({n},) int64 tensor on {logits.device}; got shape "
                         f"{tuple(out.shape)}, dtype {out.dtype}, device {out.device}.")
    if n == 0:  # a step where no row samples
        return out
    block = min(_BLOCK, next_power_of_2(vocab))
    chunks = triton.cdiv(vocab, block)
    partial = torch.empty(2, n * chunks, dtype=torch.int32, device=logits.device)
    pdl = pdl_supported(logits.device)
    _chunks_launch[(chunks, n)](logits, partial[0], partial[1], vocab, logits.stride(0), chunks,
                                BLOCK=block, USE_PDL=pdl, num_warps=4, launch_pdl=pdl)
    _rows_launch[(n,)](partial[0], partial[1], out, chunks, CHUNKS=next_power_of_2(chunks), USE_PDL=pdl,
                       num_warps=1 if chunks <= 32 else 4, launch_pdl=pdl)
    return out

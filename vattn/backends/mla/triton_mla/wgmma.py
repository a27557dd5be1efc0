"""TRITON_MLA's absorbed decode on Hopper warpgroup MMAs, written in Gluon (Triton's tile-level language).

The Triton kernel (``kernels._mla_decode_kernel``) at 64 query heads a program keeps the query,
the (64, 512) fp32 accumulator and the score tile in registers and spills. This kernel places
what the MMAs read in shared memory and leaves the registers to the accumulator:

* ``q_nope`` (64 heads, 512) and ``q_pe`` (64, 64) are loaded once into shared memory.
* The latent cache comes in tiles of ``BLOCK_N = 64`` rows: ``c`` (64, 512) and ``k_pe``
  (64, 64), gathered through the block table with ``cp.async`` into two buffers (the next tile
  loads while this one computes). One shared copy of ``c`` serves both MMAs: transposed as the
  keys of ``S = q_nope c^T + q_pe k_pe^T`` and as the values of ``O += P c``.
* Two warpgroups (8 warps) split the N dimension of both MMAs: S (64, 64) by key columns,
  O (64, 512) by latent columns (an fp32 (64, 256) accumulator each, 128 registers a thread).
  The softmax runs in the log2 domain; P reaches the second MMA through registers.

Grid ``(B, cdiv(H, 64), NUM_SPLITS)`` as the Triton kernel; with splits it writes the same
normalized partials and natural-log LSE (``(split, row, head)`` slots, ``LORA`` wide) that
``kernels._mla_combine_kernel`` merges. bf16 / fp16 only, latent 512 and RoPE 64 (DeepSeek's).
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

__all__ = ["BLOCK_H", "BLOCK_N", "LORA", "ROPE", "mla_decode_wgmma", "wgmma_unsupported"]

LORA = 512
"""Latent width the kernel serves (``kv_lora_rank``)."""
ROPE = 64
"""RoPE width it serves (``qk_rope_head_dim``)."""
BLOCK_H = 64
"""Query heads a program (one warpgroup MMA's M)."""
BLOCK_N = 64
"""Latent rows a tile."""
NUM_WARPS = 8
LOG2E = 1.4426950408889634

# Names that changed across the Triton versions vattn supports: the CTA barrier (3.6:
# ``thread_barrier``, later ``barrier``) and cp.async (3.6: ``async_copy_global_to_shared``,
# later ``async_load``).
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
_cp_async = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared


@gluon.jit
def split_keys(seq_len, split, NUM_SPLITS: gl.constexpr, BLOCK_N: gl.constexpr):
    """Split ``split``'s keys ``[start, end)`` and their tile count: ``NUM_SPLITS`` equal parts of
    ``seq_len`` rounded up to whole tiles, as ``kernels._mla_decode_kernel`` splits them (the
    combine reads the partials in that order). Depends on static sizes only (CUDA-graph safe)."""
    per_split = ((seq_len + NUM_SPLITS - 1) // NUM_SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = split * per_split
    end = gl.minimum(start + per_split, seq_len)
    return start, end, gl.maximum(end - start + BLOCK_N - 1, 0) // BLOCK_N


@gluon.jit
def _load_tile(c_buf, r_buf, cache_ptr, bt_row, n0, end, stride_cb, stride_cs,
               LORA: gl.constexpr, ROPE: gl.constexpr, BLOCK_N: gl.constexpr, PAGE: gl.constexpr,
               ld: gl.constexpr, ldr: gl.constexpr):
    """Start copying latent rows ``[n0, n0 + BLOCK_N)`` (rows past ``end`` zero) into ``c_buf`` / ``r_buf``."""
    offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
    offs_nr = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ldr))
    if PAGE % BLOCK_N == 0:  # the tile lies in one page: one block id
        blk = gl.load(bt_row + n0 // PAGE).to(gl.int64)
        rows = blk * stride_cb + (offs_n % PAGE).to(gl.int64) * stride_cs
        rows_r = blk * stride_cb + (offs_nr % PAGE).to(gl.int64) * stride_cs
    else:
        blk = gl.load(bt_row + offs_n // PAGE, mask=offs_n < end, other=0).to(gl.int64)
        rows = blk * stride_cb + (offs_n % PAGE).to(gl.int64) * stride_cs
        blk_r = gl.load(bt_row + offs_nr // PAGE, mask=offs_nr < end, other=0).to(gl.int64)
        rows_r = blk_r * stride_cb + (offs_nr % PAGE).to(gl.int64) * stride_cs
    offs_l = gl.arange(0, LORA, layout=gl.SliceLayout(0, ld))
    _cp_async(c_buf, cache_ptr + rows[:, None] + offs_l[None, :], mask=(offs_n < end)[:, None])
    offs_r = LORA + gl.arange(0, ROPE, layout=gl.SliceLayout(0, ldr))
    _cp_async(r_buf, cache_ptr + rows_r[:, None] + offs_r[None, :], mask=(offs_nr < end)[:, None])


@gluon.jit
def _mla_decode_wgmma_kernel(
    q_nope_ptr, q_pe_ptr, cache_ptr, out_ptr, part_o_ptr, part_lse_ptr, qsl_ptr, seq_lens_ptr, bt_ptr,
    sm_scale_log2, num_heads, num_rows,
    stride_qt, stride_qh, stride_pt, stride_ph, stride_cb, stride_cs, stride_ot, stride_oh, stride_bt,
    LORA: gl.constexpr, ROPE: gl.constexpr, PAGE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
    NUM_SPLITS: gl.constexpr, num_warps: gl.constexpr,
):
    b = gl.program_id(0)
    hg = gl.program_id(1)
    split = gl.program_id(2)
    row = gl.load(qsl_ptr + b)
    if gl.load(qsl_ptr + b + 1) == row:
        return  # a padding request without a query row
    seq_len = gl.load(seq_lens_ptr + b)
    row64 = row.to(gl.int64)
    dtype: gl.constexpr = q_nope_ptr.dtype.element_ty

    wn: gl.constexpr = num_warps // 4  # warpgroups, side by side along N
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, wn],
                                                       instr_shape=[16, BLOCK_N // wn, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, wn],
                                                       instr_shape=[16, LORA // wn, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])  # 16-byte chunks of a row
    ldr: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    offs_h = hg * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ld))
    offs_l = gl.arange(0, LORA, layout=gl.SliceLayout(0, ld))
    q = gl.load(q_nope_ptr + row64 * stride_qt + offs_h[:, None].to(gl.int64) * stride_qh + offs_l[None, :],
                mask=(offs_h < num_heads)[:, None], other=0.0)
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, LORA], smem, q)
    offs_hr = hg * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ldr))
    offs_r = gl.arange(0, ROPE, layout=gl.SliceLayout(0, ldr))
    qp = gl.load(q_pe_ptr + row64 * stride_pt + offs_hr[:, None].to(gl.int64) * stride_ph + offs_r[None, :],
                 mask=(offs_hr < num_heads)[:, None], other=0.0)
    qp_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, ROPE], smem, qp)
    c_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, LORA], smem)
    r_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, ROPE], smem)

    # This split's keys; the grid depends on static sizes only (CUDA-graph safe).
    start, end, n_tiles = split_keys(seq_len, split, NUM_SPLITS, BLOCK_N)
    bt_row = bt_ptr + b.to(gl.int64) * stride_bt
    if start < end:
        _load_tile(c_smem.index(0), r_smem.index(0), cache_ptr, bt_row, start, end, stride_cb, stride_cs,
                   LORA, ROPE, BLOCK_N, PAGE, ld, ldr)
    cp.commit_group()

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.full([BLOCK_H], 0.0, gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_H, LORA], gl.float32, layout=o_layout)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    s_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout)
    for i in range(0, n_tiles):
        n0 = start + i * BLOCK_N
        if n0 + BLOCK_N < end:  # the next tile into the buffer the previous iteration finished with
            _load_tile(c_smem.index((i + 1) % 2), r_smem.index((i + 1) % 2), cache_ptr, bt_row, n0 + BLOCK_N, end,
                       stride_cb, stride_cs, LORA, ROPE, BLOCK_N, PAGE, ld, ldr)
        cp.commit_group()
        cp.wait_group(1)  # this tile's copies (the next tile's may still run)
        fence_async_shared()
        _cta_barrier()
        c_buf = c_smem.index(i % 2)
        s = warpgroup_mma(q_smem, c_buf.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma(qp_smem, r_smem.index(i % 2).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        s = gl.where(((n0 + offs_n) < end)[None, :], s * sm_scale_log2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), c_buf, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        _cta_barrier()  # every warp is done with this buffer before the next iteration refills it

    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    has = l_o != 0.0  # no key: 0; NaN stays NaN through the split merge
    o = acc / gl.where(has, l_o, 1.0)[:, None]
    offs_ho = hg * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_layout))
    offs_lo = gl.arange(0, LORA, layout=gl.SliceLayout(0, o_layout))
    h_ok = offs_ho < num_heads
    if NUM_SPLITS == 1:
        gl.store(out_ptr + row64 * stride_ot + offs_ho[:, None].to(gl.int64) * stride_oh + offs_lo[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])
    else:
        slot = (split * num_rows + row64) * num_heads + offs_ho  # (split, row, head)
        gl.store(part_o_ptr + slot[:, None] * LORA + offs_lo[None, :], o, mask=h_ok[:, None])
        m_o = gl.convert_layout(m_i, gl.SliceLayout(1, o_layout))
        lse = gl.where(has, (m_o + gl.log2(gl.where(has, l_o, 1.0))) / 1.4426950408889634, float("-inf"))
        gl.store(part_lse_ptr + slot, lse, mask=h_ok)


def wgmma_unsupported(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor) -> str | None:
    """Why these tensors cannot take the kernel (None: they can). The caller checks the device."""
    if q_nope.dtype not in (torch.bfloat16, torch.float16) or kv_cache.dtype != q_nope.dtype:
        return f"needs a bf16 / fp16 query and latent cache of one dtype, got {q_nope.dtype} / {kv_cache.dtype}"
    if q_nope.shape[2] != LORA or q_pe.shape[2] != ROPE or q_pe.dtype != q_nope.dtype:
        return f"serves latent {LORA} + RoPE {ROPE}, got {q_nope.shape[2]} + {q_pe.shape[2]}"
    if q_nope.stride(2) != 1 or q_pe.stride(2) != 1 or out.stride(2) != 1 or kv_cache.stride(2) != 1:
        return "needs unit strides along the latent / RoPE width"
    if kv_cache.stride(1) % 16 or kv_cache.stride(0) % 16 or kv_cache.data_ptr() % 16:
        return "needs latent rows at multiples of 16 elements from a 16-byte aligned cache (16-byte cp.async)"
    return None


@functools.lru_cache(maxsize=None)
def _launcher() -> object:
    from vattn.kernels.launch import FastLaunch

    return FastLaunch(_mla_decode_wgmma_kernel)


def mla_decode_wgmma(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, *,
                     query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                     softmax_scale: float, num_splits: int, partial_out: torch.Tensor,
                     partial_lse: torch.Tensor) -> None:
    """Launch the kernel (shapes as ``launch.mla_decode``; ``wgmma_unsupported`` is None for these
    tensors). With ``num_splits > 1`` it writes ``partial_out`` / ``partial_lse`` for the combine."""
    rows, num_heads, _ = q_nope.shape
    grid = (seq_lens.shape[0], -(-num_heads // BLOCK_H), num_splits)
    _launcher()[grid](
        q_nope, q_pe, kv_cache, out, partial_out, partial_lse, query_start_loc, seq_lens, block_table,
        float(softmax_scale) * LOG2E, num_heads, rows,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), kv_cache.stride(0), kv_cache.stride(1),
        out.stride(0), out.stride(1), block_table.stride(0),
        LORA=LORA, ROPE=ROPE, PAGE=kv_cache.shape[1], BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, NUM_SPLITS=num_splits,
        num_warps=NUM_WARPS,
    )

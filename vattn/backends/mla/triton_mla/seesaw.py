"""TRITON_MLA's absorbed decode on Hopper with two warp-specialized warpgroups ("seesaw" order), in Gluon.

``wgmma.py`` runs both warpgroups through one instruction stream: every tile waits for its
loads, its score MMA, a softmax whose row maxima cross the two warpgroups, and its PV MMA,
one after the other. Here the two warpgroups run their own streams (``gl.warp_specialize``)
over tiles taken in pairs, the schedule of FlashMLA's write-up ("seesaw"):

* warpgroup 0 owns the left half of the output ``O_L = O[:, :256]`` (fp32, 128 registers a
  thread) and computes the scores of the pair's first tile; warpgroup 1 owns ``O_R`` and the
  second tile. Each score tile (64 heads, 64 keys) lies in one warpgroup, so row maxima and
  sums stay inside it.
* Per pair ``(K0, K1)`` with running max ``m`` (log2 domain): [0] ``S0 = Q K0^T``,
  ``m0 = max(m, rowmax S0)``, ``P0 = exp2(S0 - m0)``, ``O_L = O_L 2^(m - m0) + P0 V0_L``;
  [1] ``S1 = Q K1^T``, ``m1 = max(m0, rowmax S1)``, ``P1 = exp2(S1 - m1)``,
  ``O_R = (O_R 2^(m - m0) + P0 V0_R) 2^(m0 - m1) + P1 V1_R``; [0] ``O_L = O_L 2^(m0 - m1) + P1 V1_L``.
  ``m0``, ``m1`` and each ``P`` (bf16) cross through shared memory under mbarriers; a ``P``
  takes the place of its tile's RoPE columns, which only the score MMA reads. Row sums run per
  warpgroup and are added at the end.
* Latent tiles (``c`` as two 256-wide halves, and ``k_pe``) come in by TMA, one page a tile,
  into two buffers; each part is reloaded by the warpgroup that reads it last, as soon as it is
  done (the left half of ``K0`` right after ``P0 V0_L``), and the score MMA takes the parts in
  the order they arrive.

Needs pages of a multiple of ``BLOCK_N`` rows (a tile is one TMA box) and a cache whose rows
are evenly spaced; ``seesaw_unsupported`` says when a cache cannot take it. Grid, partial
outputs and LSE as ``wgmma.py`` (``kernels._mla_combine_kernel`` merges splits). The kernel
pays for its pipeline once per program, so ``launch.mla_decode`` takes it only for launches
without splits (long keys per program); with splits the warpgroup-MMA kernel runs.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from vattn.backends.mla.triton_mla.wgmma import BLOCK_H, BLOCK_N, LOG2E, LORA, ROPE, split_keys

__all__ = ["mla_decode_seesaw", "seesaw_unsupported"]

HALF = LORA // 2
"""Latent columns a warpgroup accumulates (its half of the output)."""

# The TMA load's name changed across the Triton versions vattn supports (3.6:
# ``async_copy_global_to_shared``, later ``async_load``).
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
# A barrier of the calling warpgroup's threads (``thread_barrier`` in Triton 3.6, ``barrier`` later).
_sync_warpgroup = getattr(gl, "barrier", None) or gl.thread_barrier

# The sizes as constexpr globals, which Gluon functions may read.
_BLOCK_H_C = gl.constexpr(BLOCK_H)
_BLOCK_N_C = gl.constexpr(BLOCK_N)
_HALF_C = gl.constexpr(HALF)
_LORA_C = gl.constexpr(LORA)
_ROPE_C = gl.constexpr(ROPE)
_WORKER_REGS_C = gl.constexpr(240)  # the worker warpgroup's register budget (setmaxnreg)
# mbarrier slots: 0 - 5 the TMA "ready" barriers of buffer b's parts (3 b + 0 / 1 / 2: L, R, E),
# then the hand-offs between the warpgroups.
_M0_C, _S1_C, _P0_C, _P1_C = gl.constexpr(6), gl.constexpr(7), gl.constexpr(8), gl.constexpr(9)
_L0_C, _L1_C = gl.constexpr(10), gl.constexpr(11)
_NUM_BARS_C = gl.constexpr(12)
# One warpgroup's MMA layouts: a score tile (64 heads, 64 keys), its half of O (64, 256), P as
# the A operand of O's MMA, and a row (head) vector of the score tile.
_S_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]))
_O_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16]))
_P_LAYOUT = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_O_LAYOUT.value, k_width=2))
_ROWS = gl.constexpr(gl.SliceLayout(1, _S_LAYOUT.value))


@gluon.jit
def _block(bt_row, n, ok, PAGE: gl.constexpr):
    """The block holding key ``n`` (0 where not ``ok``). Loaded before the MMA that precedes its
    TMA copies, so the block-table read overlaps the MMA."""
    return gl.load(bt_row + n // PAGE, mask=ok, other=0)


@gluon.jit
def _issue(desc, buf, bar, blk, n, col, PAGE: gl.constexpr):
    """TMA the tile of keys ``[n, n + BLOCK_N)`` (in block ``blk``), columns ``[col, col + width)``,
    into ``buf``; ``bar`` completes when it lands."""
    mbarrier.expect(bar, desc.block_type.nbytes)
    _tma_load(desc, [blk * PAGE + n % PAGE, col], bar, buf)


@gluon.jit
def _zero_tail(buf, valid, num_warps: gl.constexpr):
    """Zero the rows from ``valid`` on of a (BLOCK_N, HALF) tile (memory past a request's end may
    hold NaN, and 0 * NaN is NaN in the PV MMA), 16 rows at a time to spare registers."""
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    for r0 in gl.static_range(0, _BLOCK_N_C, 16):
        part = buf.slice(r0, 16)
        x = part.load(ld)
        rows = r0 + gl.arange(0, 16, layout=gl.SliceLayout(1, ld))
        part.store(gl.where((rows < valid)[:, None], x, gl.zeros_like(x)))
    fence_async_shared()


@gluon.jit
def _scores(ql, qr, qp, cl, cr, ce, bars, b: gl.constexpr, phase, n0, end, sm_scale_log2,
            num_warps: gl.constexpr):
    """S = Q K^T of buffer ``b``'s tile in the log2 domain (keys past ``end`` -inf), the parts
    taken as their TMA copies land."""
    if n0 + _BLOCK_N_C > end:  # the request's last, partial tile: zero what lies past its end
        mbarrier.wait(bars.index(3 * b), phase)
        mbarrier.wait(bars.index(3 * b + 1), phase)
        _zero_tail(cl, end - n0, num_warps)
        _zero_tail(cr, end - n0, num_warps)
    s = gl.zeros([_BLOCK_H_C, _BLOCK_N_C], gl.float32, layout=_S_LAYOUT)
    mbarrier.wait(bars.index(3 * b), phase)
    s = warpgroup_mma(ql, cl.permute((1, 0)), s, use_acc=False, is_async=True)
    mbarrier.wait(bars.index(3 * b + 1), phase)
    s = warpgroup_mma(qr, cr.permute((1, 0)), s, is_async=True)
    mbarrier.wait(bars.index(3 * b + 2), phase)
    s = warpgroup_mma(qp, ce.permute((1, 0)), s, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    offs_n = n0 + gl.arange(0, _BLOCK_N_C, layout=gl.SliceLayout(0, _S_LAYOUT))
    return gl.where((offs_n < end)[None, :], s * sm_scale_log2, float("-inf"))


@gluon.jit
def _finish(acc, m_i, l_i, l_other, col0: gl.constexpr, write_lse: gl.constexpr, out_ptr, part_o_ptr, part_lse_ptr,
            row64, hg, split, num_heads, num_rows, stride_ot, stride_oh):
    """Normalize this warpgroup's half of O and store it (with splits: the partial and its LSE).

    The split count is read from the grid: Triton 3.6 passes the partitions' constexpr arguments
    as constants, and a branch on one leaves a dead block its LLVM lowering cannot analyze."""
    l = l_i + l_other
    has = l != 0.0  # no key: 0; NaN stays NaN through the split merge
    l_o = gl.convert_layout(gl.where(has, l, 1.0), gl.SliceLayout(1, _O_LAYOUT))
    o = acc / l_o[:, None]
    offs_h = hg * _BLOCK_H_C + gl.arange(0, _BLOCK_H_C, layout=gl.SliceLayout(1, _O_LAYOUT))
    offs_l = col0 + gl.arange(0, _HALF_C, layout=gl.SliceLayout(0, _O_LAYOUT))
    h_ok = offs_h < num_heads
    if gl.num_programs(2) == 1:
        gl.store(out_ptr + row64 * stride_ot + offs_h[:, None].to(gl.int64) * stride_oh + offs_l[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])
    else:
        slot = (split * num_rows + row64) * num_heads + offs_h  # (split, row, head)
        gl.store(part_o_ptr + slot[:, None] * _LORA_C + offs_l[None, :], o, mask=h_ok[:, None])
        if write_lse:
            offs_hs = hg * _BLOCK_H_C + gl.arange(0, _BLOCK_H_C, layout=gl.SliceLayout(1, _S_LAYOUT))
            slot_s = (split * num_rows + row64) * num_heads + offs_hs
            lse = gl.where(has, (m_i + gl.log2(gl.where(has, l, 1.0))) / 1.4426950408889634, float("-inf"))
            gl.store(part_lse_ptr + slot_s, lse, mask=offs_hs < num_heads)


@gluon.jit
def _pair_views(ql, qr, qp, cl, cr, ce, j):
    """Pair ``j``'s shared-memory views: the query's three parts, then buffer 0's and buffer 1's
    ``c`` halves and RoPE part.

    All are indexed by ``j >> 30``, which is 0 but, as far as the compiler knows, changes with
    the loop. Each MMA then rebuilds its shared-memory descriptors (one 64-bit word per operand
    and 16-wide k step) from the base address every pair; with constant indices the compiler
    hoists them all out of the loop and they spill, the reloads sitting between a wait and its
    MMA."""
    z = j >> 30
    return (ql.index(z), qr.index(z), qp.index(z), cl.index(z), cr.index(z), ce.index(z),
            cl.index(z + 1), cr.index(z + 1), ce.index(z + 1))


@gluon.jit
def _fresh_state():
    """A warpgroup's running max, row sum and half of O before the first pair."""
    m_i = gl.full([_BLOCK_H_C], float("-inf"), gl.float32, layout=_ROWS)
    l_i = gl.zeros([_BLOCK_H_C], gl.float32, layout=_ROWS)
    return m_i, l_i, gl.zeros([_BLOCK_H_C, _HALF_C], gl.float32, layout=_O_LAYOUT)


@gluon.jit
def _warpgroup0(ql, qr, qp, cl, cr, ce, stats, bars, desc_c, desc_e, bt_row, start, end, n_tiles, sm_scale_log2,
                out_ptr, part_o_ptr, part_lse_ptr, row64, hg, split, num_heads, num_rows, stride_ot, stride_oh,
                PAGE: gl.constexpr):
    """Tile 0 of each pair, and ``O_L``."""
    dtype: gl.constexpr = ql.dtype
    m_i, l_i, acc = _fresh_state()
    for j in range(0, (n_tiles + 1) // 2):
        phase = j & 1
        q_l, q_r, q_p, l0, r0, e0, l1, r1, e1 = _pair_views(ql, qr, qp, cl, cr, ce, j)
        n0 = start + 2 * j * _BLOCK_N_C
        s = _scores(q_l, q_r, q_p, l0, r0, e0, bars, 0, phase, n0, end, sm_scale_log2, 4)
        m0 = gl.maximum(m_i, gl.max(s, axis=1))
        stats.slice(0 * _BLOCK_H_C, _BLOCK_H_C).store(m0)
        _sync_warpgroup()  # every thread's shared stores / reads done before one thread arrives
        mbarrier.arrive(bars.index(_M0_C), count=1)
        alpha = gl.exp2(m_i - m0)
        p = gl.exp2(s - m0[:, None]).to(dtype)
        e0.store(p)  # P0 for warpgroup 1, in the RoPE columns S0 has read
        fence_async_shared()
        _sync_warpgroup()
        mbarrier.arrive(bars.index(_P0_C), count=1)
        l_i = l_i * alpha + gl.sum(p.to(gl.float32), axis=1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, _O_LAYOUT))[:, None]
        blk2 = _block(bt_row, n0 + 2 * _BLOCK_N_C, 2 * j + 2 < n_tiles, PAGE)
        acc = warpgroup_mma(gl.convert_layout(p, _P_LAYOUT), l0, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        if 2 * j + 2 < n_tiles:  # V0_L read: the next pair's first tile, left half
            _issue(desc_c, l0, bars.index(0), blk2, n0 + 2 * _BLOCK_N_C, 0, PAGE)
        mbarrier.wait(bars.index(_S1_C), phase)
        m1 = stats.slice(1 * _BLOCK_H_C, _BLOCK_H_C).load(_ROWS)
        scale1 = gl.exp2(m0 - m1)
        l_i = l_i * scale1
        acc = acc * gl.convert_layout(scale1, gl.SliceLayout(1, _O_LAYOUT))[:, None]
        m_i = m1
        blk3 = _block(bt_row, n0 + 3 * _BLOCK_N_C, 2 * j + 3 < n_tiles, PAGE)
        mbarrier.wait(bars.index(_P1_C), phase)
        if 2 * j + 1 < n_tiles:
            acc = warpgroup_mma(e1, l1, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        if 2 * j + 3 < n_tiles:  # V1_L and P1 read: the next pair's second tile, left half and RoPE
            _issue(desc_c, l1, bars.index(3), blk3, n0 + 3 * _BLOCK_N_C, 0, PAGE)
            _issue(desc_e, e1, bars.index(5), blk3, n0 + 3 * _BLOCK_N_C, _LORA_C, PAGE)
    stats.slice(2 * _BLOCK_H_C, _BLOCK_H_C).store(l_i)
    _sync_warpgroup()
    mbarrier.arrive(bars.index(_L0_C), count=1)
    mbarrier.wait(bars.index(_L1_C), 0)
    l_other = stats.slice(3 * _BLOCK_H_C, _BLOCK_H_C).load(_ROWS)
    _finish(acc, m_i, l_i, l_other, 0, True, out_ptr, part_o_ptr, part_lse_ptr, row64, hg, split, num_heads, num_rows,
            stride_ot, stride_oh)


@gluon.jit
def _warpgroup1(ql, qr, qp, cl, cr, ce, stats, bars, desc_c, desc_e, bt_row, start, end, n_tiles, sm_scale_log2,
                out_ptr, part_o_ptr, part_lse_ptr, row64, hg, split, num_heads, num_rows, stride_ot, stride_oh,
                PAGE: gl.constexpr):
    """Tile 1 of each pair, and ``O_R``."""
    dtype: gl.constexpr = ql.dtype
    m_i, l_i, acc = _fresh_state()
    for j in range(0, (n_tiles + 1) // 2):
        phase = j & 1
        q_l, q_r, q_p, l0, r0, e0, l1, r1, e1 = _pair_views(ql, qr, qp, cl, cr, ce, j)
        n1 = start + (2 * j + 1) * _BLOCK_N_C
        has1 = 2 * j + 1 < n_tiles
        if has1:
            s = _scores(q_l, q_r, q_p, l1, r1, e1, bars, 1, phase, n1, end, sm_scale_log2, 4)
        else:
            s = gl.full([_BLOCK_H_C, _BLOCK_N_C], float("-inf"), gl.float32, layout=_S_LAYOUT)
        mbarrier.wait(bars.index(_M0_C), phase)
        m0 = stats.slice(0 * _BLOCK_H_C, _BLOCK_H_C).load(_ROWS)
        m1 = gl.maximum(m0, gl.max(s, axis=1))
        stats.slice(1 * _BLOCK_H_C, _BLOCK_H_C).store(m1)
        _sync_warpgroup()
        mbarrier.arrive(bars.index(_S1_C), count=1)
        p = gl.exp2(s - m1[:, None]).to(dtype)
        e1.store(p)  # P1 for warpgroup 0, in the RoPE columns S1 has read
        fence_async_shared()
        _sync_warpgroup()
        mbarrier.arrive(bars.index(_P1_C), count=1)
        l_i = l_i * gl.exp2(m_i - m1) + gl.sum(p.to(gl.float32), axis=1)
        # O_R = (O_R 2^(m - m0) + P0 V0_R) 2^(m0 - m1) + P1 V1_R: P0 as warpgroup 0 wrote it
        acc = acc * gl.convert_layout(gl.exp2(m_i - m0), gl.SliceLayout(1, _O_LAYOUT))[:, None]
        blk2 = _block(bt_row, n1 + _BLOCK_N_C, 2 * j + 2 < n_tiles, PAGE)
        mbarrier.wait(bars.index(_P0_C), phase)
        acc = warpgroup_mma(e0, r0, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        if 2 * j + 2 < n_tiles:  # V0_R and P0 read: the next pair's first tile, right half and RoPE
            _issue(desc_c, r0, bars.index(1), blk2, n1 + _BLOCK_N_C, _HALF_C, PAGE)
            _issue(desc_e, e0, bars.index(2), blk2, n1 + _BLOCK_N_C, _LORA_C, PAGE)
        acc = acc * gl.convert_layout(gl.exp2(m0 - m1), gl.SliceLayout(1, _O_LAYOUT))[:, None]
        m_i = m1
        if has1:
            blk3 = _block(bt_row, n1 + 2 * _BLOCK_N_C, 2 * j + 3 < n_tiles, PAGE)
            acc = warpgroup_mma(gl.convert_layout(p, _P_LAYOUT), r1, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            if 2 * j + 3 < n_tiles:  # V1_R read: the next pair's second tile, right half
                _issue(desc_c, r1, bars.index(4), blk3, n1 + 2 * _BLOCK_N_C, _HALF_C, PAGE)
    stats.slice(3 * _BLOCK_H_C, _BLOCK_H_C).store(l_i)
    _sync_warpgroup()
    mbarrier.arrive(bars.index(_L1_C), count=1)
    mbarrier.wait(bars.index(_L0_C), 0)
    l_other = stats.slice(2 * _BLOCK_H_C, _BLOCK_H_C).load(_ROWS)
    _finish(acc, m_i, l_i, l_other, _HALF_C, False, out_ptr, part_o_ptr, part_lse_ptr, row64, hg, split, num_heads,
            num_rows, stride_ot, stride_oh)


@gluon.jit
def _mla_decode_seesaw_kernel(
    q_nope_ptr, q_pe_ptr, desc_c, desc_e, out_ptr, part_o_ptr, part_lse_ptr, qsl_ptr, seq_lens_ptr, bt_ptr,
    sm_scale_log2, num_heads, num_rows, stride_qt, stride_qh, stride_pt, stride_ph, stride_ot, stride_oh, stride_bt,
    PAGE: gl.constexpr, NUM_SPLITS: gl.constexpr, num_warps: gl.constexpr,
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

    smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    cl = gl.allocate_shared_memory(dtype, [2, _BLOCK_N_C, _HALF_C], smem)
    cr = gl.allocate_shared_memory(dtype, [2, _BLOCK_N_C, _HALF_C], smem)
    ce = gl.allocate_shared_memory(dtype, [2, _BLOCK_N_C, _ROPE_C], smem)
    stats = gl.allocate_shared_memory(gl.float32, [4 * _BLOCK_H_C], plain)  # m0, m1, l0, l1
    bars = gl.allocate_shared_memory(gl.int64, [_NUM_BARS_C, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(_NUM_BARS_C):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()

    start, end, n_tiles = split_keys(seq_len, split, NUM_SPLITS, _BLOCK_N_C)
    bt_row = bt_ptr + b.to(gl.int64) * stride_bt
    for t in gl.static_range(2):  # the first pair's loads go out before the query is read
        if t < n_tiles:
            n = start + t * _BLOCK_N_C
            blk = gl.load(bt_row + n // PAGE)
            _issue(desc_c, cl.index(t), bars.index(3 * t), blk, n, 0, PAGE)
            _issue(desc_c, cr.index(t), bars.index(3 * t + 1), blk, n, _HALF_C, PAGE)
            _issue(desc_e, ce.index(t), bars.index(3 * t + 2), blk, n, _LORA_C, PAGE)

    ld: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    offs_h = hg * _BLOCK_H_C + gl.arange(0, _BLOCK_H_C, layout=gl.SliceLayout(1, ld))
    h_ok = (offs_h < num_heads)[:, None]
    q_rows = q_nope_ptr + row64 * stride_qt + offs_h[:, None].to(gl.int64) * stride_qh
    offs_c = gl.arange(0, _HALF_C, layout=gl.SliceLayout(0, ld))
    ql = gl.allocate_shared_memory(dtype, [1, _BLOCK_H_C, _HALF_C], smem)  # one-deep: see _pair_views
    ql.index(0).store(gl.load(q_rows + offs_c[None, :], mask=h_ok, other=0.0))
    qr = gl.allocate_shared_memory(dtype, [1, _BLOCK_H_C, _HALF_C], smem)
    qr.index(0).store(gl.load(q_rows + _HALF_C + offs_c[None, :], mask=h_ok, other=0.0))
    offs_r = gl.arange(0, _ROPE_C, layout=gl.SliceLayout(0, ld))
    qp = gl.allocate_shared_memory(dtype, [1, _BLOCK_H_C, _ROPE_C], smem)
    qp.index(0).store(gl.load(
        q_pe_ptr + row64 * stride_pt + offs_h[:, None].to(gl.int64) * stride_ph + offs_r[None, :], mask=h_ok, other=0.0))
    fence_async_shared()

    args = (ql, qr, qp, cl, cr, ce, stats, bars, desc_c, desc_e, bt_row, start, end, n_tiles, sm_scale_log2,
            out_ptr, part_o_ptr, part_lse_ptr, row64, hg, split, num_heads, num_rows, stride_ot, stride_oh, PAGE)
    gl.warp_specialize([(_warpgroup0, args), (_warpgroup1, args)], [4], [_WORKER_REGS_C])


def seesaw_unsupported(kv_cache: torch.Tensor) -> str | None:
    """Why this cache cannot take the kernel, beyond ``wgmma_unsupported`` (None: it can)."""
    page = kv_cache.shape[1]
    if page % BLOCK_N:
        return f"needs pages of a multiple of {BLOCK_N} rows (one TMA box a tile), got {page}"
    if kv_cache.stride(0) != page * kv_cache.stride(1):
        return "needs evenly spaced latent rows (a cache block's stride equal to page size x row stride)"
    return None


@functools.lru_cache(maxsize=None)
def _smem_layout() -> object:
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)


def mla_decode_seesaw(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, *,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                      softmax_scale: float, num_splits: int, partial_out: torch.Tensor,
                      partial_lse: torch.Tensor) -> None:
    """Launch the kernel (shapes as ``launch.mla_decode``; ``wgmma_unsupported`` and
    ``seesaw_unsupported`` are None for these tensors). With ``num_splits > 1`` it writes
    ``partial_out`` / ``partial_lse`` for the combine."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    rows, num_heads, _ = q_nope.shape
    num_blocks, page, width = kv_cache.shape
    shape, strides = [num_blocks * page, width], [kv_cache.stride(1), 1]
    desc_c = TensorDescriptor(kv_cache, shape, strides, [BLOCK_N, HALF], _smem_layout())
    desc_e = TensorDescriptor(kv_cache, shape, strides, [BLOCK_N, ROPE], _smem_layout())
    grid = (seq_lens.shape[0], -(-num_heads // BLOCK_H), num_splits)
    _mla_decode_seesaw_kernel[grid](
        q_nope, q_pe, desc_c, desc_e, out, partial_out, partial_lse, query_start_loc, seq_lens, block_table,
        float(softmax_scale) * LOG2E, num_heads, rows,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), out.stride(0), out.stride(1),
        block_table.stride(0),
        PAGE=page, NUM_SPLITS=num_splits, num_warps=4,
    )

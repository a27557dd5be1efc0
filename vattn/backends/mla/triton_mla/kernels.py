"""TRITON_MLA's Triton kernels (the launchers are in ``vattn.backends.mla.triton_mla.launch``).

* ``_mla_decode_kernel``: absorbed decode, multi-query attention over the paged latent cache.
  Grid ``(B, cdiv(H, BLOCK_H), NUM_SPLITS)``: a program takes ``BLOCK_H`` query heads of one
  decode (their absorbed ``q_nope`` (L) and ``q_pe`` (R) rows) and a slice of its keys; each
  key tile of ``BLOCK_N`` latent rows is read once for all those heads, gathered through the
  block table (one entry per tile where ``BLOCK_N`` divides the page size, else per token: any
  page size). Scores are ``q_nope . c + q_pe . k_pe``;
  the values are the latent ``c`` itself. With one split it writes the output, else a
  normalized partial and its log-sum-exp per split, which ``_mla_combine_kernel`` merges.
  The split of a request covers ``cdiv(cdiv(seq_len, NUM_SPLITS), BLOCK_N)`` tiles: the grid
  depends on static sizes only (CUDA-graph safe); a split past the sequence writes lse -inf.
* ``_mla_prefill_kernel``: up-projected attention of the prefills over contiguous (ragged)
  keys: ``q (T, H, NOPE + ROPE)`` against ``k_nope (S, H, NOPE)`` and the shared
  ``k_pe (S, ROPE)``, values ``(S, H, V)``; causal bottom-right aligned or not; writes a
  float32 output and the log-sum-exp, so context chunks merge (``merge_attn_states``).

fp8 latent caches are read as ``stored * scale``. ``DOT_FP32`` multiplies in exact fp32
(fp32 models, and the CPU interpreter, whose 16-bit ``tl.dot`` is not exact).
"""

from __future__ import annotations

import triton
import triton.language as tl

from vattn.kernels.reduce import MAX as _MAX
from vattn.kernels.reduce import SUM as _SUM


@triton.jit
def _mla_decode_kernel(
    q_nope_ptr, q_pe_ptr, cache_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    qsl_ptr, seq_lens_ptr, bt_ptr, scale_ptr,
    sm_scale, num_heads, num_rows,
    stride_qt, stride_qh, stride_qd, stride_pt, stride_ph, stride_pd,
    stride_cb, stride_cs, stride_cw, stride_ot, stride_oh, stride_od, stride_bt,
    LORA: tl.constexpr, LORA_PAD: tl.constexpr, ROPE: tl.constexpr, ROPE_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    KV_FP8: tl.constexpr, DOT_FP32: tl.constexpr,
):
    b = tl.program_id(0)
    hg = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(qsl_ptr + b)
    if tl.load(qsl_ptr + b + 1) == row:
        return  # a padding request without a query row
    seq_len = tl.load(seq_lens_ptr + b)
    offs_h = hg * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < num_heads
    offs_l = tl.arange(0, LORA_PAD)
    offs_r = tl.arange(0, ROPE_PAD)
    l_ok = offs_l < LORA
    r_ok = offs_r < ROPE
    row64 = row.to(tl.int64)
    q = tl.load(q_nope_ptr + row64 * stride_qt + offs_h[:, None] * stride_qh + offs_l[None, :] * stride_qd,
                mask=h_ok[:, None] & l_ok[None, :], other=0.0)
    qp = tl.load(q_pe_ptr + row64 * stride_pt + offs_h[:, None] * stride_ph + offs_r[None, :] * stride_pd,
                 mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    compute = q.dtype
    if DOT_FP32:
        compute = tl.float32
    q = q.to(compute)
    qp = qp.to(compute)
    if KV_FP8:
        kv_scale = tl.load(scale_ptr)

    per_split = ((seq_len + NUM_SPLITS - 1) // NUM_SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_H], 0.0, tl.float32)
    acc = tl.full([BLOCK_H, LORA_PAD], 0.0, tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        if PAGE_SIZE % BLOCK_N == 0:  # the tile lies in one page: one block id, contiguous rows
            blk = tl.load(bt_row + n0 // PAGE_SIZE).to(tl.int64)
            base = blk * stride_cb + (n0 % PAGE_SIZE + tl.arange(0, BLOCK_N)) * stride_cs
        else:
            blk = tl.load(bt_row + offs_n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
            base = blk * stride_cb + (offs_n % PAGE_SIZE) * stride_cs
        c = tl.load(cache_ptr + base[:, None] + offs_l[None, :] * stride_cw, mask=n_ok[:, None] & l_ok[None, :],
                    other=0.0)
        kp = tl.load(cache_ptr + base[:, None] + (LORA + offs_r)[None, :] * stride_cw,
                     mask=n_ok[:, None] & r_ok[None, :], other=0.0)
        if KV_FP8:
            c = (c.to(tl.float32) * kv_scale).to(compute)
            kp = (kp.to(tl.float32) * kv_scale).to(compute)
        else:
            c = c.to(compute)
            kp = kp.to(compute)
        if DOT_FP32:
            s = tl.dot(q, tl.trans(c), input_precision="ieee") + tl.dot(qp, tl.trans(kp), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(c)) + tl.dot(qp, tl.trans(kp))
        s = tl.where(n_ok[None, :], s * sm_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _MAX))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, _SUM)
        if DOT_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, c, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(compute), c)
        m_i = m_new

    has = l_i != 0.0  # no key: 0; NaN (a NaN query or key) stays NaN through the split merge
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + row64 * stride_ot + offs_h[:, None] * stride_oh + offs_l[None, :] * stride_od,
                 o.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & l_ok[None, :])
    else:
        slot = (split * num_rows + row64) * num_heads + offs_h  # (split, row, head)
        tl.store(part_o_ptr + slot[:, None] * LORA_PAD + offs_l[None, :], o, mask=h_ok[:, None])
        tl.store(part_lse_ptr + slot, tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf")),
                 mask=h_ok)


@triton.jit
def _mla_combine_kernel(
    out_ptr, part_o_ptr, part_lse_ptr, num_heads, num_rows, stride_ot, stride_oh, stride_od,
    LORA: tl.constexpr, LORA_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    """Merge the splits of one (query row, head): ``sum_s e^lse_s o_s / sum_s e^lse_s``; splits
    that saw no key (lse -inf) are not read."""
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_l = tl.arange(0, LORA_PAD)
    slot = (offs_s * num_rows + r) * num_heads + h
    lse = tl.load(part_lse_ptr + slot)
    m = tl.reduce(lse, 0, _MAX)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m)
    o = tl.load(part_o_ptr + slot[:, None] * LORA_PAD + offs_l[None, :], mask=(w > 0.0)[:, None], other=0.0)
    denom = tl.reduce(w, 0, _SUM)
    o = tl.reduce(o * w[:, None], 0, _SUM) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(out_ptr + r * stride_ot + h * stride_oh + offs_l * stride_od, o.to(out_ptr.dtype.element_ty),
             mask=offs_l < LORA)


@triton.jit
def _mla_prefill_kernel(
    q_ptr, k_nope_ptr, k_pe_ptr, v_ptr, out_ptr, lse_ptr, cu_q_ptr, cu_k_ptr, sm_scale,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd, stride_pt, stride_pd,
    stride_vt, stride_vh, stride_vd, stride_ot, stride_oh, stride_od, stride_lt, stride_lh,
    NOPE: tl.constexpr, NOPE_PAD: tl.constexpr, ROPE: tl.constexpr, ROPE_PAD: tl.constexpr,
    V: tl.constexpr, V_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """One program per (block of BLOCK_M queries of a request, request, head)."""
    mblk = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + b)
    len_q = tl.load(cu_q_ptr + b + 1) - q_start
    if mblk * BLOCK_M >= len_q:
        return
    k_start = tl.load(cu_k_ptr + b)
    len_k = tl.load(cu_k_ptr + b + 1) - k_start
    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < len_q
    offs_d = tl.arange(0, NOPE_PAD)
    offs_r = tl.arange(0, ROPE_PAD)
    offs_v = tl.arange(0, V_PAD)
    rows = (q_start + offs_m).to(tl.int64)
    q_base = q_ptr + rows[:, None] * stride_qt + h * stride_qh
    qn = tl.load(q_base + offs_d[None, :] * stride_qd, mask=m_ok[:, None] & (offs_d < NOPE)[None, :], other=0.0)
    qp = tl.load(q_base + (NOPE + offs_r)[None, :] * stride_qd, mask=m_ok[:, None] & (offs_r < ROPE)[None, :],
                 other=0.0)
    compute = qn.dtype
    if DOT_FP32:
        compute = tl.float32
    qn = qn.to(compute)
    qp = qp.to(compute)
    q_pos = len_k - len_q + offs_m  # bottom-right aligned positions among the keys
    hi = len_k
    if CAUSAL:
        hi = tl.minimum(len_k, len_k - len_q + (mblk + 1) * BLOCK_M)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, V_PAD], 0.0, tl.float32)
    for n0 in range(0, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < len_k
        keys = (k_start + offs_n).to(tl.int64)
        kn = tl.load(k_nope_ptr + keys[:, None] * stride_kt + h * stride_kh + offs_d[None, :] * stride_kd,
                     mask=n_ok[:, None] & (offs_d < NOPE)[None, :], other=0.0).to(compute)
        kp = tl.load(k_pe_ptr + keys[:, None] * stride_pt + offs_r[None, :] * stride_pd,
                     mask=n_ok[:, None] & (offs_r < ROPE)[None, :], other=0.0).to(compute)
        vv = tl.load(v_ptr + keys[:, None] * stride_vt + h * stride_vh + offs_v[None, :] * stride_vd,
                     mask=n_ok[:, None] & (offs_v < V)[None, :], other=0.0).to(compute)
        if DOT_FP32:
            s = tl.dot(qn, tl.trans(kn), input_precision="ieee") + tl.dot(qp, tl.trans(kp), input_precision="ieee")
        else:
            s = tl.dot(qn, tl.trans(kn)) + tl.dot(qp, tl.trans(kp))
        ok = n_ok[None, :]
        if CAUSAL:
            ok = ok & (offs_n[None, :] <= q_pos[:, None])
        s = tl.where(ok, s * sm_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _MAX))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, _SUM)
        if DOT_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, vv, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(compute), vv)
        m_i = m_new
    has = l_i != 0.0  # no key: 0; NaN (a NaN query or key) stays NaN through the split merge
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_v[None, :] * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & (offs_v < V)[None, :])
    tl.store(lse_ptr + rows * stride_lt + h * stride_lh,
             tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf")), mask=m_ok)

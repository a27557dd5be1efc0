"""The varlen state kernels in Triton: the CUDA path of every mixer backend (same names and
signatures as ``vattn.backends.mamba.torch_ops``, whose docstring has the table of recurrences).

Every launch reads the batch from device tensors only (``query_start_loc``, ``state_indices``,
``has_initial_state``; ``num_reqs`` a scalar), so it is captured in a CUDA graph once and replays
for any batch of the captured size. The grid covers B requests (the tensors' length, padding
included); programs of requests ``>= num_reqs`` or without tokens return at once. State slots
are clamped into the state tensor, so bad metadata cannot reach outside it.

| kernel | grid | per program |
| --- | --- | --- |
| ``_conv_kernel`` | (B, D / BD, T / BT) | BT tokens x BD channels; chunk 0 also writes the new conv state |
| ``_delta_rule_kernel`` | (B, HV, Dv / BV) | the (Dk, BV) state slice in registers, the request's tokens in order |
| ``_ssd_kernel`` | (B, H, P / BP) | the (BP, N) state slice, tokens in order |
| ``_scan_kernel`` | (B, D / BD) | the (BD, N) state slice, tokens in order |
| ``_linear_kernel`` | (B, H, Dv / BV) | the (D, BV) state slice, tokens in order |

The recurrences step through each request's tokens one at a time: a decode (one token) is one
step, a long prefill is as many steps as tokens (parallel over requests, heads and state slices).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vattn.kernels.reduce import SUM as _SUM

__all__ = ["causal_conv1d", "gated_delta_rule", "linear_attention", "selective_scan", "ssd_scan"]


def _rows(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """Each tensor with unit-stride trailing dims (rows may be strided views, e.g. splits of one
    projection): the kernels index ``row * stride(0) + offset``."""
    out: list[torch.Tensor | None] = []
    for x in tensors:
        if x is not None and not x[0:1].is_contiguous():
            x = x.contiguous()
        out.append(x)
    return out


@triton.jit
def _softplus(x):
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def _request(qsl, slots, initial, num_reqs, num_slots):
    """(start, length, slot, has initial state as 0 / 1) of this program's request (length 0: nothing
    to do). The flag enters masks through comparisons (``i < n * init``), not as a boolean operand."""
    b = tl.program_id(0)
    start = tl.load(qsl + b)
    length = tl.load(qsl + b + 1) - start
    length = tl.where(b < num_reqs, tl.maximum(length, 0), 0)  # a decreasing query_start_loc: nothing
    slot = tl.minimum(tl.maximum(tl.load(slots + b).to(tl.int64), 0), num_slots - 1)
    return start.to(tl.int64), length, slot, (tl.load(initial + b) != 0).to(tl.int32)


@triton.jit(do_not_specialize=["num_reqs"])
def _conv_kernel(x, sx, w, bias, state, ss0, ss1, out, so, qsl, slots, initial, num_reqs, num_slots, D,
                 K: tl.constexpr, KP: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                 BD: tl.constexpr, BT: tl.constexpr):
    start, length, slot, init = _request(qsl, slots, initial, num_reqs, num_slots)
    t0 = tl.program_id(2) * BT
    if t0 >= length:
        return
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    dm = d < D
    t = t0 + tl.arange(0, BT)
    tm = t < length
    acc = tl.full((BT, BD), 0.0, tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias + d, mask=dm, other=0.0).to(tl.float32)[None, :]
    srow = state + slot * ss0
    for j in tl.static_range(K):
        p = t - (K - 1) + j  # the input position this tap reads (< 0: the conv state's column K-1+p)
        wj = tl.load(w + d * K + j, mask=dm, other=0.0).to(tl.float32)
        xv = tl.load(x + (start + p)[:, None] * sx + d[None, :], mask=(tm & (p >= 0))[:, None] & dm[None, :], other=0.0)
        sv = tl.load(srow + d[None, :] * ss1 + (K - 1 + p)[:, None], mask=(tm & (p < (init - 1) * K))[:, None] & dm[None, :],
                     other=0.0)
        acc += (xv.to(tl.float32) + sv.to(tl.float32)) * wj[None, :]
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(out + (start + t)[:, None] * so + d[None, :], acc.to(out.dtype.element_ty), mask=tm[:, None] & dm[None, :])
    if tl.program_id(2) == 0:  # only this program read the old state: it writes the new one
        _conv_new_state(x, sx, srow, ss1, start, length, init, d, dm, K, KP)


@triton.jit
def _conv_new_state(x, sx, srow, ss1, start, length, init, d, dm, K: tl.constexpr, KP: tl.constexpr):
    """Write the K-1 inputs before the request's next token (from x, or from the old state when the
    request had fewer than K-1 tokens) into its conv state row."""
    col = tl.arange(0, KP)
    cm = col < K - 1
    pos = length - (K - 1) + col
    xv = tl.load(x + (start + pos)[None, :] * sx + d[:, None], mask=(cm & (pos >= 0))[None, :] & dm[:, None], other=0.0)
    sv = tl.load(srow + d[:, None] * ss1 + (K - 1 + pos)[None, :], mask=(cm & (pos < (init - 1) * K))[None, :] & dm[:, None],
                 other=0.0)
    new = xv.to(tl.float32) + sv.to(tl.float32)
    tl.store(srow + d[:, None] * ss1 + col[None, :], new.to(srow.dtype.element_ty), mask=cm[None, :] & dm[:, None])


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                  query_start_loc: torch.Tensor, state_indices: torch.Tensor, has_initial_state: torch.Tensor,
                  num_reqs: int, activation: str | None, out: torch.Tensor) -> None:
    """x (T, D) rows (unit stride in D), weight (D, K), conv_state (S, D, K-1), out (T, D)."""
    t, d = x.shape
    k = weight.shape[1]
    b = state_indices.shape[0]
    if b == 0 or t == 0:
        return
    if activation not in (None, "silu"):
        raise ValueError(f"causal_conv1d: activation: expected None or 'silu', got {activation!r}; apply other "
                         "activations to the output instead.")
    weight = weight.contiguous()
    (x,) = _rows(x)
    bias = None if bias is None else bias.contiguous()  # a strided 1-D view (e.g. w[:, 0]) would be misread
    bd, bt = 64, max(16, triton.next_power_of_2(k - 1))  # chunks after the first never read the conv state
    grid = (b, triton.cdiv(d, bd), triton.cdiv(t, bt))
    _conv_kernel[grid](x, x.stride(0), weight, bias if bias is not None else weight, conv_state, conv_state.stride(0),
                       conv_state.stride(1), out, out.stride(0), query_start_loc, state_indices, has_initial_state,
                       num_reqs, conv_state.shape[0], d, K=k, KP=triton.next_power_of_2(max(k - 1, 1)),
                       HAS_BIAS=bias is not None, SILU=activation == "silu", BD=bd, BT=bt)


@triton.jit(do_not_specialize=["num_reqs"])
def _delta_rule_kernel(q, sq, k, sk, v, sv, g, sg, beta, sb, state, s0, s1, out, so, qsl, slots, initial, num_reqs,
                       num_slots, scale, rep, DK, DV, L2: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    start, length, slot, init = _request(qsl, slots, initial, num_reqs, num_slots)
    if length == 0:
        return
    h = tl.program_id(1)
    kh = h // rep
    i = tl.arange(0, BK)
    c = tl.program_id(2) * BV + tl.arange(0, BV)
    im, cm = i < DK, c < DV
    sm = im[:, None] & cm[None, :]
    sp = state + slot * s0 + h * s1 + i[:, None] * DV + c[None, :]
    s = tl.load(sp, mask=sm & (i < DK * init)[:, None], other=0.0).to(tl.float32)
    for t in range(length):
        row = start + t
        qt = tl.load(q + row * sq + kh * DK + i, mask=im, other=0.0).to(tl.float32)
        kt = tl.load(k + row * sk + kh * DK + i, mask=im, other=0.0).to(tl.float32)
        if L2:
            qt = qt / tl.sqrt(tl.reduce(qt * qt, 0, _SUM) + 1e-6)
            kt = kt / tl.sqrt(tl.reduce(kt * kt, 0, _SUM) + 1e-6)
        vt = tl.load(v + row * sv + h * DV + c, mask=cm, other=0.0).to(tl.float32)
        gt = tl.load(g + row * sg + h).to(tl.float32)
        bt = tl.load(beta + row * sb + h).to(tl.float32)
        s = s * tl.exp(gt)
        u = bt * (vt - tl.reduce(s * kt[:, None], 0, _SUM))
        s += kt[:, None] * u[None, :]
        o = tl.reduce(s * (qt * scale)[:, None], 0, _SUM)
        tl.store(out + row * so + h * DV + c, o.to(out.dtype.element_ty), mask=cm)
    tl.store(sp, s.to(state.dtype.element_ty), mask=sm)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     scale: float, use_qk_l2norm: bool, state: torch.Tensor, query_start_loc: torch.Tensor,
                     state_indices: torch.Tensor, has_initial_state: torch.Tensor, num_reqs: int,
                     out: torch.Tensor) -> None:
    """q, k (T, HK, Dk), v (T, HV, Dv) (head and dim contiguous), g, beta (T, HV), state (S, HV, Dk, Dv)
    contiguous per slot, out (T, HV, Dv)."""
    _, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    b = state_indices.shape[0]
    if b == 0 or q.shape[0] == 0:
        return
    q, k, v, g, beta = _rows(q, k, v, g, beta)
    bk = triton.next_power_of_2(dk)
    bv = min(triton.next_power_of_2(dv), max(16, 8192 // bk))
    grid = (b, hv, triton.cdiv(dv, bv))
    _delta_rule_kernel[grid](q, q.stride(0), k, k.stride(0), v, v.stride(0), g, g.stride(0), beta, beta.stride(0),
                             state, state.stride(0), state.stride(1), out, out.stride(0), query_start_loc,
                             state_indices, has_initial_state, num_reqs, state.shape[0], float(scale), hv // hk, dk, dv,
                             L2=bool(use_qk_l2norm), BK=bk, BV=bv, num_warps=4)


@triton.jit(do_not_specialize=["num_reqs"])
def _ssd_kernel(x, sx, dt, sdt, a, bm, sbm, cm_, scm, dskip, dt_bias, state, s0, s1, out, so, qsl, slots, initial,
                num_reqs, num_slots, rep, P, N, G, lo, hi, HAS_D: tl.constexpr, HAS_BIAS: tl.constexpr,
                SOFTPLUS: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr):
    start, length, slot, init = _request(qsl, slots, initial, num_reqs, num_slots)
    if length == 0:
        return
    h = tl.program_id(1)
    grp = h // rep
    p = tl.program_id(2) * BP + tl.arange(0, BP)
    n = tl.arange(0, BN)
    pm, nm = p < P, n < N
    sm = pm[:, None] & nm[None, :]
    sp = state + slot * s0 + h * s1 + p[:, None] * N + n[None, :]
    hs = tl.load(sp, mask=sm & (n < N * init)[None, :], other=0.0).to(tl.float32)
    ah = tl.load(a + h).to(tl.float32)
    dh = 0.0
    if HAS_D:
        dh = tl.load(dskip + h).to(tl.float32)
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(dt_bias + h).to(tl.float32)
    for t in range(length):
        row = start + t
        d = tl.load(dt + row * sdt + h).to(tl.float32) + bias
        if SOFTPLUS:
            d = _softplus(d)
        d = tl.minimum(tl.maximum(d, lo), hi)
        xt = tl.load(x + row * sx + h * P + p, mask=pm, other=0.0).to(tl.float32)
        bt = tl.load(bm + row * sbm + grp * N + n, mask=nm, other=0.0).to(tl.float32)
        ct = tl.load(cm_ + row * scm + grp * N + n, mask=nm, other=0.0).to(tl.float32)
        hs = hs * tl.exp(d * ah) + (d * xt)[:, None] * bt[None, :]
        y = tl.reduce(hs * ct[None, :], 1, _SUM) + dh * xt
        tl.store(out + row * so + h * P + p, y.to(out.dtype.element_ty), mask=pm)
    tl.store(sp, hs.to(state.dtype.element_ty), mask=sm)


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,  # noqa: N803
             D: torch.Tensor | None, dt_bias: torch.Tensor | None, dt_softplus: bool,  # noqa: N803
             dt_limit: tuple[float, float], ssm_state: torch.Tensor, query_start_loc: torch.Tensor,
             state_indices: torch.Tensor, has_initial_state: torch.Tensor, num_reqs: int, out: torch.Tensor) -> None:
    """x (T, H, P), dt (T, H), A (H,), B, C (T, G, N), D, dt_bias (H,), ssm_state (S, H, P, N), out (T, H, P)."""
    _, h, p = x.shape
    g, n = B.shape[1], B.shape[2]
    b = state_indices.shape[0]
    if b == 0 or x.shape[0] == 0:
        return
    x, dt, B, C = _rows(x, dt, B, C)  # noqa: N806
    A, D, dt_bias = (None if v is None else v.contiguous() for v in (A, D, dt_bias))  # noqa: N806
    bn = triton.next_power_of_2(n)
    bp = min(triton.next_power_of_2(p), max(8, 4096 // bn))
    grid = (b, h, triton.cdiv(p, bp))
    lo, hi = float(dt_limit[0]), float(dt_limit[1])
    _ssd_kernel[grid](x, x.stride(0), dt, dt.stride(0), A, B, B.stride(0), C, C.stride(0), D if D is not None else A,
                      dt_bias if dt_bias is not None else A, ssm_state, ssm_state.stride(0), ssm_state.stride(1), out,
                      out.stride(0), query_start_loc, state_indices, has_initial_state, num_reqs, ssm_state.shape[0],
                      h // g, p, n, g, lo, min(hi, 3.0e38), HAS_D=D is not None, HAS_BIAS=dt_bias is not None,
                      SOFTPLUS=bool(dt_softplus), BP=bp, BN=bn, num_warps=4)


@triton.jit(do_not_specialize=["num_reqs"])
def _scan_kernel(u, su, delta, sdl, a, bm, sbm, cm_, scm, dskip, z, sz, dbias, state, s0, out, so, qsl, slots,
                 initial, num_reqs, num_slots, D, N, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr,
                 SOFTPLUS: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr):
    start, length, slot, init = _request(qsl, slots, initial, num_reqs, num_slots)
    if length == 0:
        return
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    n = tl.arange(0, BN)
    dm, nm = d < D, n < N
    sm = dm[:, None] & nm[None, :]
    sp = state + slot * s0 + d[:, None] * N + n[None, :]
    hs = tl.load(sp, mask=sm & (n < N * init)[None, :], other=0.0).to(tl.float32)
    av = tl.load(a + d[:, None] * N + n[None, :], mask=sm, other=0.0).to(tl.float32)
    dd = tl.full((BD,), 0.0, tl.float32)
    if HAS_D:
        dd = tl.load(dskip + d, mask=dm, other=0.0).to(tl.float32)
    bias = tl.full((BD,), 0.0, tl.float32)
    if HAS_BIAS:
        bias = tl.load(dbias + d, mask=dm, other=0.0).to(tl.float32)
    for t in range(length):
        row = start + t
        ut = tl.load(u + row * su + d, mask=dm, other=0.0).to(tl.float32)
        dt = tl.load(delta + row * sdl + d, mask=dm, other=0.0).to(tl.float32) + bias
        if SOFTPLUS:
            dt = _softplus(dt)
        bt = tl.load(bm + row * sbm + n, mask=nm, other=0.0).to(tl.float32)
        ct = tl.load(cm_ + row * scm + n, mask=nm, other=0.0).to(tl.float32)
        hs = tl.exp(dt[:, None] * av) * hs + (dt * ut)[:, None] * bt[None, :]
        y = tl.reduce(hs * ct[None, :], 1, _SUM) + dd * ut
        if HAS_Z:
            zt = tl.load(z + row * sz + d, mask=dm, other=0.0).to(tl.float32)
            y = y * zt / (1.0 + tl.exp(-zt))
        tl.store(out + row * so + d, y.to(out.dtype.element_ty), mask=dm)
    tl.store(sp, hs.to(state.dtype.element_ty), mask=sm)


def selective_scan(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor,  # noqa: N803
                   C: torch.Tensor, D_skip: torch.Tensor | None, z: torch.Tensor | None,  # noqa: N803
                   delta_bias: torch.Tensor | None, delta_softplus: bool, ssm_state: torch.Tensor,
                   query_start_loc: torch.Tensor, state_indices: torch.Tensor, has_initial_state: torch.Tensor,
                   num_reqs: int, out: torch.Tensor) -> None:
    """u, delta, z (T, D), A (D, N), B, C (T, N), D_skip, delta_bias (D,), ssm_state (S, D, N), out (T, D)."""
    t, d = u.shape
    n = A.shape[1]
    b = state_indices.shape[0]
    if b == 0 or t == 0:
        return
    u, delta, B, C, z = _rows(u, delta, B, C, z)  # noqa: N806
    D_skip, delta_bias = (None if v is None else v.contiguous() for v in (D_skip, delta_bias))  # noqa: N806
    bn = triton.next_power_of_2(n)
    bd = max(16, min(128, 2048 // bn))
    grid = (b, triton.cdiv(d, bd))
    A = A.contiguous()  # noqa: N806
    _scan_kernel[grid](u, u.stride(0), delta, delta.stride(0), A, B, B.stride(0), C, C.stride(0),
                       D_skip if D_skip is not None else A, z if z is not None else u, (z if z is not None else u).stride(0),
                       delta_bias if delta_bias is not None else A, ssm_state, ssm_state.stride(0), out, out.stride(0),
                       query_start_loc, state_indices, has_initial_state, num_reqs, ssm_state.shape[0], d, n,
                       HAS_D=D_skip is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None,
                       SOFTPLUS=bool(delta_softplus), BD=bd, BN=bn, num_warps=4)


@triton.jit(do_not_specialize=["num_reqs"])
def _linear_kernel(q, sq, k, sk, v, sv, slope, state, s0, s1, out, so, qsl, slots, initial, num_reqs, num_slots,
                   DK, DV, BK: tl.constexpr, BV: tl.constexpr):
    start, length, slot, init = _request(qsl, slots, initial, num_reqs, num_slots)
    if length == 0:
        return
    h = tl.program_id(1)
    i = tl.arange(0, BK)
    c = tl.program_id(2) * BV + tl.arange(0, BV)
    im, cm = i < DK, c < DV
    sm = im[:, None] & cm[None, :]
    sp = state + slot * s0 + h * s1 + i[:, None] * DV + c[None, :]
    s = tl.load(sp, mask=sm & (i < DK * init)[:, None], other=0.0).to(tl.float32)
    decay = tl.exp(-tl.load(slope + h).to(tl.float32))
    for t in range(length):
        row = start + t
        qt = tl.load(q + row * sq + h * DK + i, mask=im, other=0.0).to(tl.float32)
        kt = tl.load(k + row * sk + h * DK + i, mask=im, other=0.0).to(tl.float32)
        vt = tl.load(v + row * sv + h * DV + c, mask=cm, other=0.0).to(tl.float32)
        s = s * decay + kt[:, None] * vt[None, :]
        o = tl.reduce(s * qt[:, None], 0, _SUM)
        tl.store(out + row * so + h * DV + c, o.to(out.dtype.element_ty), mask=cm)
    tl.store(sp, s.to(state.dtype.element_ty), mask=sm)


def linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor, state: torch.Tensor,
                     query_start_loc: torch.Tensor, state_indices: torch.Tensor, has_initial_state: torch.Tensor,
                     num_reqs: int, out: torch.Tensor) -> None:
    """q, k (T, H, D), v (T, H, Dv) (head and dim contiguous), slope (H,), state (S, H, D, Dv), out (T, H, Dv)."""
    _, h, dk = q.shape
    dv = v.shape[2]
    b = state_indices.shape[0]
    if b == 0 or q.shape[0] == 0:
        return
    q, k, v = _rows(q, k, v)
    slope = slope.contiguous()
    bk = triton.next_power_of_2(dk)
    bv = min(triton.next_power_of_2(dv), max(16, 8192 // bk))
    grid = (b, h, triton.cdiv(dv, bv))
    _linear_kernel[grid](q, q.stride(0), k, k.stride(0), v, v.stride(0), slope, state, state.stride(0), state.stride(1),
                         out, out.stride(0), query_start_loc, state_indices, has_initial_state, num_reqs,
                         state.shape[0], dk, dv, BK=bk, BV=bv, num_warps=4)

"""Batch-1 linear layers (GEMV) in Triton: ``out = x @ W.T`` for one row of ``x``.

A batch-1 decode step reads every weight once and does almost no arithmetic: its matmuls
are a chain of GEMVs, each short (a 2048 x 2048 bf16 weight streams in under 3 us on an
H100), so a kernel's launch and ramp-up cost about as much as its streaming. ``gemv`` hides
them with programmatic dependent launch (PDL, sm_90+): launched with ``pdl=True`` a GEMV may
start while the kernel before it is still running, loads its first weight block (which no
kernel writes), and only then waits (``gdc_wait``) for the previous kernel's output ``x``.
It also lets the kernel after it start early (``gdc_launch_dependents``). Writes come
after the wait, so the overlap cannot clobber buffers the previous kernel still reads. The
weight must not be written by the kernel right before the GEMV (in a model it never is: the
kernel before is a norm, attention or another GEMV).

| argument | shape | layout |
| --- | --- | --- |
| ``x`` | (1, K), or (1, 2K) ``[gate | up]`` with ``silu_mul`` | contiguous |
| ``up`` | (1, K): with ``silu_mul``, an up projection apart from the gate ``x`` | contiguous |
| ``weight`` | (N, K) | ``nn.Linear`` layout, row-major |
| ``out``, ``residual`` | (1, N) | contiguous |
| ``norm_weight`` | (K,) | contiguous |
| ``rope_cos``, ``rope_sin`` | (D,) | contiguous |

``silu_mul=True`` computes ``(silu(gate) * up) @ W.T`` (a SwiGLU MLP's down projection) on
the gate/up output, rounding the activation to the input dtype first as an unfused model
would. ``norm_weight`` applies RMSNorm to ``x`` as it is read (every program takes the mean
square of the whole row first: K elements from L2), and ``residual`` is added to the
result: a decoder layer's norm -> projection and projection -> residual add then need no
kernels of their own, and its GEMVs follow each other directly. ``rope_cos``/``rope_sin``
rotate the first ``rope_cols`` outputs (a fused QKV projection's q and k heads) with
neox-style RoPE as they are stored: each program computes rows in rotation pairs, so the
attention kernel reads q and k straight from the projection (100 instead of 116 kernels in
a batch-1 step of the Llama-3.2-1B shape; replay 0.873 -> 0.861 ms on an H100).
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch
import triton
import triton.language as tl

from vattn.kernels.launch import FastLaunch, next_power_of_2

__all__ = ["default_tiles", "launch_gemv", "launch_gemv_group"]


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _transform(x, up, nw, rstd, SILU_MUL: tl.constexpr, RMS_NORM: tl.constexpr):
    """Input elements as loaded (``x``; with SwiGLU ``x`` = gate and ``up``; with RMSNorm its
    weight ``nw`` and ``rstd``) -> float32, each intermediate rounded to the input dtype."""
    dtype = x.dtype
    if SILU_MUL:
        gate = x.to(tl.float32)
        x = (gate / (1.0 + tl.exp(-gate)) * up.to(tl.float32)).to(dtype)
    if RMS_NORM:  # weight * (x * rstd).to(dtype)
        x = (nw.to(tl.float32) * (x.to(tl.float32) * rstd).to(dtype).to(tl.float32)).to(dtype)
    return x.to(tl.float32)


@triton.jit
def _gemv_rows(
    pid, x_ptr, up_ptr, w_ptr, out_ptr, res_ptr, nw_ptr, cos_ptr, sin_ptr, N, K, stride_wn, eps, rope_cols,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SILU_MUL: tl.constexpr, RMS_NORM: tl.constexpr,
    RESIDUAL: tl.constexpr, ROPE_DIM: tl.constexpr, USE_PDL: tl.constexpr, UNSIGNED_SIN: tl.constexpr,
):
    """Program ``pid``'s rows of one GEMV. ``ROPE_DIM`` (0: none): the program's rows are
    ``BLOCK_N // 2`` rotation pairs, rows (head, j) for consecutive j < ROPE_DIM / 2 and their
    partners (head, j + ROPE_DIM / 2), each half with its own weight tile and accumulator, so
    the epilogue rotates element-wise."""
    HALF: tl.constexpr = ROPE_DIM // 2
    ROWS: tl.constexpr = BLOCK_N // 2 if ROPE_DIM else BLOCK_N
    if ROPE_DIM:
        pair = pid * ROWS + tl.arange(0, ROWS)
        offs_n = (pair // HALF) * ROPE_DIM + pair % HALF
    else:
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_p = offs_n + HALF  # the partner rows (ROPE_DIM only)
    n_ok = offs_n < N
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    p_rows = w_ptr + offs_p[:, None].to(tl.int64) * stride_wn
    offs_k = tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    # Before the wait: what no kernel writes (the first weight block, the norm weight).
    w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0,
                eviction_policy="evict_first")
    wp = w  # unused unless ROPE_DIM
    if ROPE_DIM:
        wp = tl.load(p_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0,
                     eviction_policy="evict_first")
    nw = w  # unused unless RMS_NORM
    if RMS_NORM:
        nw = tl.load(nw_ptr + offs_k, mask=k_ok, other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        if not ROPE_DIM:
            # The next kernel may start now. Not after a RoPE projection: the next kernel is
            # attention, and started this early it slowed a batch-1 step of the 1B model on
            # an H100 (replay 0.871 ms without, 0.906 ms with the early start).
            tl.extra.cuda.gdc_launch_dependents()
    # After it: the activations (and RoPE's table, which the kernel before may have written),
    # all issued before any use.
    x = tl.load(x_ptr + offs_k, mask=k_ok, other=0.0)
    up = x  # unused unless SILU_MUL
    if SILU_MUL:
        up = tl.load(up_ptr + offs_k, mask=k_ok, other=0.0)
    res = tl.full([ROWS], 0.0, tl.float32)
    if RESIDUAL:
        res = tl.load(res_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    j = offs_n % HALF if ROPE_DIM else offs_n
    cos_n = res
    sin_n = res
    cos_p = res
    sin_p = res
    if ROPE_DIM:
        cos_n = tl.load(cos_ptr + j).to(tl.float32)
        sin_n = tl.load(sin_ptr + j).to(tl.float32)
        if UNSIGNED_SIN:  # rotate-half's cat(-y2, y1) * sin: the first half's sin negated
            sin_n = -sin_n
        cos_p = tl.load(cos_ptr + j + HALF).to(tl.float32)
        sin_p = tl.load(sin_ptr + j + HALF).to(tl.float32)
    rstd = 1.0
    if RMS_NORM:  # every program takes the mean square of the whole row (K elements, from L2)
        xf = x.to(tl.float32)
        sq = xf * xf
        for k0 in range(BLOCK_K, K, BLOCK_K):
            xs = tl.load(x_ptr + k0 + offs_k, mask=k0 + offs_k < K, other=0.0).to(tl.float32)
            sq += xs * xs
        rstd = tl.rsqrt(tl.reduce(sq, 0, _add) / K + eps)
    xt = _transform(x, up, nw, rstd, SILU_MUL, RMS_NORM)[None, :]
    part = w.to(tl.float32) * xt
    part_p = part  # unused unless ROPE_DIM
    if ROPE_DIM:
        part_p = wp.to(tl.float32) * xt
    for k0 in range(BLOCK_K, K, BLOCK_K):
        offs = k0 + offs_k
        ok = offs < K
        w = tl.load(w_rows + offs[None, :], mask=n_ok[:, None] & ok[None, :], other=0.0,
                    eviction_policy="evict_first")
        if ROPE_DIM:
            wp = tl.load(p_rows + offs[None, :], mask=n_ok[:, None] & ok[None, :], other=0.0,
                         eviction_policy="evict_first")
        x = tl.load(x_ptr + offs, mask=ok, other=0.0)
        if SILU_MUL:
            up = tl.load(up_ptr + offs, mask=ok, other=0.0)
        if RMS_NORM:
            nw = tl.load(nw_ptr + offs, mask=ok, other=0.0)
        xt = _transform(x, up, nw, rstd, SILU_MUL, RMS_NORM)[None, :]
        part += w.to(tl.float32) * xt
        if ROPE_DIM:
            part_p += wp.to(tl.float32) * xt
    # tl.reduce with a local combine (what tl.sum does) also runs under the CPU tests' interpreter
    acc = tl.reduce(part, 1, _add).to(out_ptr.dtype.element_ty)
    if RESIDUAL:  # the projection rounded to the dtype, then the residual added (and rounded)
        acc = (acc.to(tl.float32) + res).to(out_ptr.dtype.element_ty)
    if ROPE_DIM:
        # y * cos + swap_halves(y) * sin on the projection y in the dtype, in float32, rounded
        # once (as Inductor computes the unfused RoPE); heads from rope_cols on stay as projected.
        ya = acc.to(tl.float32)
        yp = tl.reduce(part_p, 1, _add).to(out_ptr.dtype.element_ty).to(tl.float32)
        rotate = offs_n < rope_cols
        tl.store(out_ptr + offs_n, tl.where(rotate, ya * cos_n + yp * sin_n, ya).to(out_ptr.dtype.element_ty),
                 mask=n_ok)
        tl.store(out_ptr + offs_p, tl.where(rotate, yp * cos_p + ya * sin_p, yp).to(out_ptr.dtype.element_ty),
                 mask=n_ok)
    else:
        tl.store(out_ptr + offs_n, acc, mask=n_ok)


@triton.jit
def _gemv_kernel(
    x_ptr, up_ptr, w_ptr, out_ptr, res_ptr, nw_ptr, cos_ptr, sin_ptr, N, K, stride_wn, eps, rope_cols,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SILU_MUL: tl.constexpr, RMS_NORM: tl.constexpr,
    RESIDUAL: tl.constexpr, ROPE_DIM: tl.constexpr, USE_PDL: tl.constexpr, UNSIGNED_SIN: tl.constexpr = False,
):
    _gemv_rows(tl.program_id(0), x_ptr, up_ptr, w_ptr, out_ptr, res_ptr, nw_ptr, cos_ptr, sin_ptr, N, K, stride_wn,
               eps, rope_cols, BLOCK_N, BLOCK_K, SILU_MUL, RMS_NORM, RESIDUAL, ROPE_DIM, USE_PDL, UNSIGNED_SIN)


@triton.jit
def _gemv_group_kernel(
    x_ptr, nw_ptr, cos_ptr, sin_ptr, w0_ptr, w1_ptr, w2_ptr, out0_ptr, out1_ptr, out2_ptr,
    N0, N1, N2, P0, P1, K, stride_w0, stride_w1, stride_w2, eps,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, RMS_NORM: tl.constexpr, NUM_SEGS: tl.constexpr,
    ROPE_DIM: tl.constexpr, ROPE_SEGS: tl.constexpr, USE_PDL: tl.constexpr, UNSIGNED_SIN: tl.constexpr,
):
    """Two or three GEMVs of one input in one launch (separate q / k / v, or gate / up,
    projections): programs [0, P0) compute weight 0, [P0, P0 + P1) weight 1, the rest weight 2.
    The first ``ROPE_SEGS`` segments leave rotated (all their heads)."""
    pid = tl.program_id(0)
    R0: tl.constexpr = ROPE_DIM if ROPE_SEGS > 0 else 0
    R1: tl.constexpr = ROPE_DIM if ROPE_SEGS > 1 else 0
    R2: tl.constexpr = ROPE_DIM if ROPE_SEGS > 2 else 0
    if pid < P0:
        _gemv_rows(pid, x_ptr, x_ptr, w0_ptr, out0_ptr, out0_ptr, nw_ptr, cos_ptr, sin_ptr, N0, K, stride_w0, eps,
                   N0, BLOCK_N, BLOCK_K, False, RMS_NORM, False, R0, USE_PDL, UNSIGNED_SIN)
    elif NUM_SEGS == 2:
        _gemv_rows(pid - P0, x_ptr, x_ptr, w1_ptr, out1_ptr, out1_ptr, nw_ptr, cos_ptr, sin_ptr, N1, K, stride_w1,
                   eps, N1, BLOCK_N, BLOCK_K, False, RMS_NORM, False, R1, USE_PDL, UNSIGNED_SIN)
    elif pid < P0 + P1:
        _gemv_rows(pid - P0, x_ptr, x_ptr, w1_ptr, out1_ptr, out1_ptr, nw_ptr, cos_ptr, sin_ptr, N1, K, stride_w1,
                   eps, N1, BLOCK_N, BLOCK_K, False, RMS_NORM, False, R1, USE_PDL, UNSIGNED_SIN)
    else:
        _gemv_rows(pid - P0 - P1, x_ptr, x_ptr, w2_ptr, out2_ptr, out2_ptr, nw_ptr, cos_ptr, sin_ptr, N2, K,
                   stride_w2, eps, N2, BLOCK_N, BLOCK_K, False, RMS_NORM, False, R2, USE_PDL, UNSIGNED_SIN)


_launch = FastLaunch(_gemv_kernel)
_launch_group = FastLaunch(_gemv_group_kernel)


def _h100_tiles(n: int, k: int) -> tuple[int, int, int]:
    """H100 (and the default): 4 rows a program (8 for an LM head), whole 2048-wide K steps
    (4096 from K = 8192), 8 warps."""
    return (8 if n >= 65536 else 4), (4096 if k >= 8192 else 2048), 8


def _h200_tiles(n: int, k: int) -> tuple[int, int, int]:
    """H200: K steps of 1024 for the fused QKV and gate/up projections, 2048 for the rest, 4 rows
    a program for an LM head too. The 1B model's batch-1 replay 0.739 -> 0.725 ms, with the LM
    head and greedy sampling 0.883 -> 0.863 ms; the same tiles on an H100 cost it 0.882 -> 0.899 ms."""
    if n >= 65536 or k >= 8192 or n <= k:  # an LM head, a down projection, o_proj
        return 4, 2048, 8
    return (4, 1024, 4) if n >= 8 * k else (8, 1024, 8)  # fused gate/up, fused QKV


#: Default tiles ``(block_n, block_k, num_warps)`` by GPU name (``torch.cuda.get_device_name``), as
#: a function of the weight's (N, K); other GPUs use ``_h100_tiles``. Measured on the
#: Llama-3.2-1B decode step (FULL CUDA graph, batch 1, 16 layers), one GPU each:
#: ``benchmarks/results/profile-gemv-tiles-*``.
_TILES_BY_GPU: dict[str, Callable[[int, int], tuple[int, int, int]]] = {"NVIDIA H200": _h200_tiles}


@functools.lru_cache(maxsize=None)
def _gpu_tiles(device: torch.device) -> Callable[[int, int], tuple[int, int, int]]:
    if device.type != "cuda":
        return _h100_tiles
    return _TILES_BY_GPU.get(torch.cuda.get_device_name(device), _h100_tiles)


def default_tiles(n: int, k: int, device: torch.device) -> tuple[int, int, int]:
    """``(block_n, block_k, num_warps)`` ``gemv`` uses for an (N, K) weight on ``device``."""
    return _gpu_tiles(device)(n, k)


def launch_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    *,
    silu_mul: bool = False,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    rope_cos: torch.Tensor | None = None,
    rope_sin: torch.Tensor | None = None,
    rope_cols: int = 0,
    rope_unsigned_sin: bool = False,
    up: torch.Tensor | None = None,
    pdl: bool = False,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
) -> None:
    """``out = x @ weight.T`` for one row, into ``out``; optionally SwiGLU or RMSNorm on ``x``
    first and a residual added after.

    Args:
        x: (1, K) or, with ``silu_mul``, (1, 2K) as ``[gate | up]`` (or the gate (1, K) with ``up``); contiguous.
        weight: (N, K) with unit stride along K.
        out: (1, N) contiguous, the dtype of ``x``.
        silu_mul: apply SwiGLU's ``silu(gate) * up`` to ``x`` first.
        residual: (1, N) contiguous, the dtype of ``x``: ``out = (x @ weight.T) + residual``,
            the projection rounded to the dtype before the add, as an unfused model computes it.
        norm_weight: (K,) in the dtype of ``x``: RMSNorm ``x`` first, computed as
            ``transformers`` does (float32 ``x * rsqrt(mean(x**2) + eps)``, cast to the
            dtype, times ``norm_weight``); not with ``silu_mul``.
        eps: the RMSNorm epsilon.
        rope_cos / rope_sin: (D,) contiguous, the dtype of ``x``: neox-style RoPE on the first
            ``rope_cols`` outputs, head by head (D outputs each): ``y * cos + swap_halves(y) * sin``
            (``swap_halves(y) = y.roll(D // 2, -1)``; ``sin`` carries rotate-half's sign, i.e. its
            first half is ``-sin``), with ``y`` the projection in the dtype, computed in float32
            and rounded once. ``N`` and ``rope_cols`` must be multiples of D; not with ``residual``.
        rope_cols: how many leading outputs (whole heads) RoPE rotates; the rest are stored as
            projected (a fused QKV projection's v heads).
        rope_unsigned_sin: ``rope_sin`` is the plain table of ``transformers``' rotate-half
            form, ``y * cos + cat(-y2, y1) * sin``: the kernel negates its first half.
        up: with ``silu_mul``, the up projection (1, K) contiguous when it is not x's second half
            (a model with separate gate and up projections).
        pdl: launch with programmatic dependent launch (sm_90+; see the module docstring).
        block_n / block_k / num_warps: output features per program, inputs per step (at most
            K rounded up to a power of two), warps. Defaults: ``default_tiles(N, K, device)``,
            per GPU: on an H100 (and GPUs without a table of their own) 8 rows for N >= 65536
            (an LM head), else 4; K steps of 4096 from K = 8192, else 2048; 8 warps, the fastest
            there for the Llama-3.2-1B projections in a dependent chain and its LM head
            (``benchmarks/bench_gemv.py``); an H200 has its own table (``_h200_tiles``).
    """
    if silu_mul and norm_weight is not None:
        raise ValueError("gemv: silu_mul and norm_weight are exclusive (one input transform).")
    n, k = weight.shape
    if block_n is None or block_k is None or num_warps is None:
        tiles = default_tiles(n, k, weight.device)
        block_n, block_k, num_warps = block_n or tiles[0], block_k or tiles[1], num_warps or tiles[2]
    rope_dim = _check_rope(rope_cos, rope_sin, rope_cols, n, block_n, residual)
    if up is not None and not silu_mul:
        raise ValueError("gemv: up is the SwiGLU up projection; pass it with silu_mul=True.")
    _launch[(triton.cdiv(n, block_n),)](
        x, up if up is not None else (x[:, k:] if silu_mul else x), weight, out,
        residual if residual is not None else out,
        norm_weight if norm_weight is not None else weight,
        rope_cos if rope_dim else weight, rope_sin if rope_dim else weight,
        n, k, weight.stride(0), float(eps), rope_cols,
        BLOCK_N=block_n, BLOCK_K=min(block_k, next_power_of_2(k)), SILU_MUL=silu_mul,
        RMS_NORM=norm_weight is not None, RESIDUAL=residual is not None, ROPE_DIM=rope_dim, USE_PDL=pdl,
        UNSIGNED_SIN=bool(rope_unsigned_sin and rope_dim),
        num_warps=num_warps, launch_pdl=pdl,
    )


def _check_rope(cos: torch.Tensor | None, sin: torch.Tensor | None, cols: int, n: int, block_n: int,
                residual: torch.Tensor | None) -> int:
    """The RoPE head size (0: no RoPE), after checking ``gemv``'s RoPE arguments."""
    if cos is None and sin is None:
        if cols:
            raise ValueError(f"gemv: rope_cols={cols} needs rope_cos and rope_sin; pass them or rope_cols=0.")
        return 0
    if cos is None or sin is None:
        raise ValueError("gemv: pass rope_cos and rope_sin together (one of them is None).")
    d = cos.shape[-1]
    if cos.numel() != d or sin.shape[-1] != d or sin.numel() != d or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError(f"gemv: rope_cos and rope_sin must each hold one contiguous row of the head size; got "
                         f"shapes {tuple(cos.shape)} and {tuple(sin.shape)}.")
    if d % 2 or n % d or cols % d or not 0 < cols <= n:
        raise ValueError(f"gemv: RoPE rotates whole heads of an even size: the output features ({n}) and "
                         f"rope_cols ({cols}) must be multiples of the head size {d}, with 0 < rope_cols <= {n}.")
    if block_n < 2 or next_power_of_2(block_n) != block_n:
        raise ValueError(f"gemv: with RoPE, block_n (rows per program, in rotation pairs) must be a power of "
                         f"two of at least 2; got {block_n}.")
    if residual is not None:
        raise ValueError("gemv: RoPE and residual are exclusive (rotate the projection or add to it, not both).")
    return d


def launch_gemv_group(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor],
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    rope_cos: torch.Tensor | None = None,
    rope_sin: torch.Tensor | None = None,
    rope_segs: int = 0,
    rope_unsigned_sin: bool = False,
    pdl: bool = False,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
) -> None:
    """``outs[i] = x @ weights[i].T`` for one row ``x`` (1, K) and 2 or 3 weights (N_i, K), in one
    launch: a model's separate q / k / v (or gate / up) projections cost one kernel, as a fused
    projection does. ``norm_weight`` RMSNorms ``x`` as ``launch_gemv`` does; ``rope_cos`` /
    ``rope_sin`` rotate every head of the first ``rope_segs`` outputs (q and k). ``outs[i]``: (1, N_i)
    contiguous. Tiles: ``default_tiles`` of the summed N."""
    if len(weights) not in (2, 3) or len(outs) != len(weights):
        raise ValueError(f"gemv_group: 2 or 3 weights and as many outputs; got {len(weights)} and {len(outs)}.")
    k = x.shape[-1]
    if any(w.shape[1] != k or w.stride(1) != 1 for w in weights):
        raise ValueError(f"gemv_group: every weight must be (N_i, {k}) with unit stride along K; got "
                         f"{[tuple(w.shape) for w in weights]}.")
    ns = [w.shape[0] for w in weights]
    if block_n is None or block_k is None or num_warps is None:
        tiles = default_tiles(sum(ns), k, x.device)
        block_n, block_k, num_warps = block_n or tiles[0], block_k or tiles[1], num_warps or tiles[2]
    rope_dim = 0
    if rope_segs:
        if not 0 < rope_segs <= len(weights):
            raise ValueError(f"gemv_group: rope_segs must be in [1, {len(weights)}]; got {rope_segs}.")
        rope_dim = max(_check_rope(rope_cos, rope_sin, n, n, block_n, None) for n in ns[:rope_segs])
    progs = [triton.cdiv(n, block_n) for n in ns]  # BLOCK_N rows a program (with RoPE: BLOCK_N / 2 pairs)
    w = [*weights, weights[-1]][:3]
    o = [*outs, outs[-1]][:3]
    n3 = [*ns, ns[-1]][:3]
    _launch_group[(sum(progs),)](
        x, norm_weight if norm_weight is not None else w[0],
        rope_cos if rope_dim else w[0], rope_sin if rope_dim else w[0],
        w[0], w[1], w[2], o[0], o[1], o[2], n3[0], n3[1], n3[2], progs[0], progs[1], k,
        w[0].stride(0), w[1].stride(0), w[2].stride(0), float(eps),
        BLOCK_N=block_n, BLOCK_K=min(block_k, next_power_of_2(k)), RMS_NORM=norm_weight is not None,
        NUM_SEGS=len(weights), ROPE_DIM=rope_dim, ROPE_SEGS=rope_segs if rope_dim else 0, USE_PDL=pdl,
        UNSIGNED_SIN=bool(rope_unsigned_sin and rope_dim), num_warps=num_warps, launch_pdl=pdl,
    )

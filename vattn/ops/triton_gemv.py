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
| ``weight`` | (N, K) | ``nn.Linear`` layout, row-major |
| ``out``, ``residual`` | (1, N) | contiguous |
| ``norm_weight`` | (K,) | contiguous |

``silu_mul=True`` computes ``(silu(gate) * up) @ W.T`` (a SwiGLU MLP's down projection) on
the gate/up output, rounding the activation to the input dtype first as an unfused model
would. ``norm_weight`` applies RMSNorm to ``x`` as it is read (every program takes the mean
square of the whole row first: K elements from L2), and ``residual`` is added to the
result: a decoder layer's norm -> projection and projection -> residual add then need no
kernels of their own, and its GEMVs follow each other directly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vattn.ops.triton_launch import FastLaunch, next_power_of_2

__all__ = ["gemv"]


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
def _gemv_kernel(
    x_ptr, w_ptr, out_ptr, res_ptr, nw_ptr, N, K, stride_wn, eps,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SILU_MUL: tl.constexpr, RMS_NORM: tl.constexpr,
    RESIDUAL: tl.constexpr, USE_PDL: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    offs_k = tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    # Before the wait: what no kernel writes (the first weight block, the norm weight).
    w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0,
                eviction_policy="evict_first")
    nw = w  # unused unless RMS_NORM
    if RMS_NORM:
        nw = tl.load(nw_ptr + offs_k, mask=k_ok, other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # After it: the activations, all issued before any use.
    x = tl.load(x_ptr + offs_k, mask=k_ok, other=0.0)
    up = x  # unused unless SILU_MUL
    if SILU_MUL:
        up = tl.load(x_ptr + K + offs_k, mask=k_ok, other=0.0)
    res = tl.full([BLOCK_N], 0.0, tl.float32)
    if RESIDUAL:
        res = tl.load(res_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    rstd = 1.0
    if RMS_NORM:  # every program takes the mean square of the whole row (K elements, from L2)
        xf = x.to(tl.float32)
        sq = xf * xf
        for k0 in range(BLOCK_K, K, BLOCK_K):
            xs = tl.load(x_ptr + k0 + offs_k, mask=k0 + offs_k < K, other=0.0).to(tl.float32)
            sq += xs * xs
        rstd = tl.rsqrt(tl.reduce(sq, 0, _add) / K + eps)
    part = w.to(tl.float32) * _transform(x, up, nw, rstd, SILU_MUL, RMS_NORM)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        offs = k0 + offs_k
        ok = offs < K
        w = tl.load(w_rows + offs[None, :], mask=n_ok[:, None] & ok[None, :], other=0.0,
                    eviction_policy="evict_first")
        x = tl.load(x_ptr + offs, mask=ok, other=0.0)
        if SILU_MUL:
            up = tl.load(x_ptr + K + offs, mask=ok, other=0.0)
        if RMS_NORM:
            nw = tl.load(nw_ptr + offs, mask=ok, other=0.0)
        part += w.to(tl.float32) * _transform(x, up, nw, rstd, SILU_MUL, RMS_NORM)[None, :]
    # tl.reduce with a local combine (what tl.sum does) also runs under the CPU tests' interpreter
    acc = tl.reduce(part, 1, _add).to(out_ptr.dtype.element_ty)
    if RESIDUAL:  # the projection rounded to the dtype, then the residual added (and rounded)
        acc = (acc.to(tl.float32) + res).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_n, acc, mask=n_ok)


_launch = FastLaunch(_gemv_kernel)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    *,
    silu_mul: bool = False,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    pdl: bool = False,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int = 8,
) -> None:
    """``out = x @ weight.T`` for one row, into ``out``; optionally SwiGLU or RMSNorm on ``x``
    first and a residual added after.

    Args:
        x: (1, K) or, with ``silu_mul``, (1, 2K) as ``[gate | up]``; contiguous.
        weight: (N, K) with unit stride along K.
        out: (1, N) contiguous, the dtype of ``x``.
        silu_mul: apply SwiGLU's ``silu(gate) * up`` to ``x`` first.
        residual: (1, N) contiguous, the dtype of ``x``: ``out = (x @ weight.T) + residual``,
            the projection rounded to the dtype before the add, as an unfused model computes it.
        norm_weight: (K,) in the dtype of ``x``: RMSNorm ``x`` first, computed as
            ``transformers`` does (float32 ``x * rsqrt(mean(x**2) + eps)``, cast to the
            dtype, times ``norm_weight``); not with ``silu_mul``.
        eps: the RMSNorm epsilon.
        pdl: launch with programmatic dependent launch (sm_90+; see the module docstring).
        block_n / block_k / num_warps: output features per program (default 8 for N >= 65536,
            an LM head; else 4), inputs per step (default 4096 for K >= 8192, else 2048; at
            most K rounded up to a power of two), warps. The defaults were the fastest on an
            H100 for the Llama-3.2-1B projections in a dependent chain and its LM head
            (``benchmarks/bench_gemv.py``).
    """
    if silu_mul and norm_weight is not None:
        raise ValueError("gemv: silu_mul and norm_weight are exclusive (one input transform).")
    n, k = weight.shape
    if block_n is None:
        block_n = 8 if n >= 65536 else 4
    if block_k is None:
        block_k = 4096 if k >= 8192 else 2048
    _launch[(triton.cdiv(n, block_n),)](
        x, weight, out, residual if residual is not None else out,
        norm_weight if norm_weight is not None else weight, n, k, weight.stride(0), float(eps),
        BLOCK_N=block_n, BLOCK_K=min(block_k, next_power_of_2(k)), SILU_MUL=silu_mul,
        RMS_NORM=norm_weight is not None, RESIDUAL=residual is not None, USE_PDL=pdl,
        num_warps=num_warps, launch_pdl=pdl,
    )

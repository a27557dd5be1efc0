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
| ``out`` | (1, N) | contiguous |

``silu_mul=True`` computes ``(silu(gate) * up) @ W.T`` (a SwiGLU MLP's down projection) on
the gate/up output, rounding the activation to the input dtype first as an unfused model
would.
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
def _load_x(x_ptr, offs_k, k_ok, K, SILU_MUL: tl.constexpr):
    x = tl.load(x_ptr + offs_k, mask=k_ok, other=0.0)
    if SILU_MUL:
        gate = x.to(tl.float32)
        up = tl.load(x_ptr + K + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        x = (gate / (1.0 + tl.exp(-gate)) * up).to(x_ptr.dtype.element_ty)
    return x.to(tl.float32)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, out_ptr, N, K, stride_wn,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SILU_MUL: tl.constexpr, USE_PDL: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    offs_k = tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0,
                eviction_policy="evict_first")
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    part = w.to(tl.float32) * _load_x(x_ptr, offs_k, k_ok, K, SILU_MUL)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        offs = k0 + offs_k
        ok = offs < K
        w = tl.load(w_rows + offs[None, :], mask=n_ok[:, None] & ok[None, :], other=0.0,
                    eviction_policy="evict_first")
        part += w.to(tl.float32) * _load_x(x_ptr, offs, ok, K, SILU_MUL)[None, :]
    # tl.reduce with a local combine (what tl.sum does) also runs under the CPU tests' interpreter
    tl.store(out_ptr + offs_n, tl.reduce(part, 1, _add).to(out_ptr.dtype.element_ty), mask=n_ok)


_launch = FastLaunch(_gemv_kernel)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    *,
    silu_mul: bool = False,
    pdl: bool = False,
    block_n: int = 4,
    block_k: int | None = None,
    num_warps: int = 8,
) -> None:
    """``out = x @ weight.T`` (or ``(silu(gate) * up) @ weight.T``) for one row, into ``out``.

    Args:
        x: (1, K) or, with ``silu_mul``, (1, 2K) as ``[gate | up]``; contiguous.
        weight: (N, K) with unit stride along K.
        out: (1, N) contiguous, the dtype of ``x``.
        silu_mul: apply SwiGLU's ``silu(gate) * up`` to ``x`` first.
        pdl: launch with programmatic dependent launch (sm_90+; see the module docstring).
        block_n / block_k / num_warps: output features per program, inputs per step (default
            4096 for K >= 8192, else 2048; at most K rounded up to a power of two), warps.
            The defaults were the fastest on an H100 for the Llama-3.2-1B projections in a
            dependent chain (``benchmarks/bench_gemv.py``).
    """
    n, k = weight.shape
    if block_k is None:
        block_k = 4096 if k >= 8192 else 2048
    _launch[(triton.cdiv(n, block_n),)](
        x, weight, out, n, k, weight.stride(0),
        BLOCK_N=block_n, BLOCK_K=min(block_k, next_power_of_2(k)), SILU_MUL=silu_mul, USE_PDL=pdl,
        num_warps=num_warps, launch_pdl=pdl,
    )

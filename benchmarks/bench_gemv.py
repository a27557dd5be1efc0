"""Batch-1 decoder-layer matmuls of the Llama-3.2-1B shape as one dependent chain: cuBLAS vs ``triton_gemv``.

Per layer: qkv (3072 x 2048) -> o (2048 x 2048) -> gate_up (16384 x 2048) -> down (2048 x 8192,
SwiGLU on its input), each GEMV reading the previous one's output, ``--layers`` layers with
their own weights in one CUDA graph (weights stream from HBM). Providers: ``cublas``
(``torch.mm``, SwiGLU as two eager kernels), ``triton/<cfg>`` (``gemv`` with the tile
configurations of ``CONFIGS``) and ``triton+pdl/<cfg>`` (the same with programmatic dependent
launch, as ``vattn_examples::gemv`` runs it on sm_90+). Correctness is tested in ``tests/test_gemv.py``;
the chain's values are not meaningful (random weights, no norms).

Columns: ``us_per_layer`` (the four GEMVs), ``tbps`` (weight bytes / time), ``frac_copy_bw``
(of the copy bandwidth measured in the same run).

The ``lm_head`` rows time the batch-1 LM head (128256 x 2048, tied to the embedding) alone:
cuBLAS (``F.linear``) against ``gemv`` with the tile configurations of ``LM_HEAD_CONFIGS``.

Run on the GPU machine: ``PYTHONPATH=$PWD python benchmarks/bench_gemv.py [--quick]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common, roofline  # noqa: E402
from examples.gemv.kernel import launch_gemv as gemv  # noqa: E402

SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}


class Chain:
    """``layers`` layers of the four projections' weights and the activations between them."""

    def __init__(self, layers: int) -> None:
        g = torch.Generator(device="cuda").manual_seed(0)
        self.w = [{k: torch.randn(n, kk, device="cuda", dtype=torch.bfloat16, generator=g) / kk**0.5
                   for k, (n, kk) in SHAPES.items()} for _ in range(layers)]
        self.buf = {k: torch.empty(1, n, device="cuda", dtype=torch.bfloat16) for k, (n, _) in SHAPES.items()}
        self.x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16, generator=g)
        self.act = torch.empty(1, 8192, device="cuda", dtype=torch.bfloat16)

    def cublas(self) -> None:
        """The chain through cuBLAS, SwiGLU as two eager kernels."""
        x, b = self.x, self.buf
        for w in self.w:
            torch.mm(x, w["qkv"].T, out=b["qkv"])
            torch.mm(b["qkv"][:, :2048], w["o"].T, out=b["o"])
            torch.mm(b["o"], w["gate_up"].T, out=b["gate_up"])
            torch.mul(F.silu(b["gate_up"][:, :8192]), b["gate_up"][:, 8192:], out=self.act)
            torch.mm(self.act, w["down"].T, out=b["down"])
            x = b["down"]

    def triton(self, pdl: bool, cfg: dict[str, dict[str, int]]) -> Callable[[], None]:
        """The chain through ``gemv`` with per-projection tile configurations."""
        def run() -> None:
            x, b = self.x, self.buf
            for w in self.w:
                gemv(x, w["qkv"], b["qkv"], pdl=pdl, **cfg["qkv"])
                gemv(b["qkv"][:, :2048], w["o"], b["o"], pdl=pdl, **cfg["o"])
                gemv(b["o"], w["gate_up"], b["gate_up"], pdl=pdl, **cfg["gate_up"])
                gemv(b["gate_up"], w["down"], b["down"], silu_mul=True, pdl=pdl, **cfg["down"])
                x = b["down"]
        return run


# Tile configurations (block_n, block_k, num_warps) per projection; "b" is gemv's default.
CONFIGS = {
    "a": {"qkv": dict(block_n=2, block_k=2048, num_warps=8), "o": dict(block_n=2, block_k=2048, num_warps=8),
          "gate_up": dict(block_n=2, block_k=2048, num_warps=8), "down": dict(block_n=4, block_k=2048, num_warps=4)},
    "b": {"qkv": dict(block_n=4, block_k=2048, num_warps=8), "o": dict(block_n=4, block_k=2048, num_warps=8),
          "gate_up": dict(block_n=4, block_k=2048, num_warps=8), "down": dict(block_n=4, block_k=4096, num_warps=8)},
    "c": {"qkv": dict(block_n=1, block_k=2048, num_warps=4), "o": dict(block_n=1, block_k=2048, num_warps=4),
          "gate_up": dict(block_n=2, block_k=2048, num_warps=4), "down": dict(block_n=2, block_k=4096, num_warps=8)},
    "d": {"qkv": dict(block_n=8, block_k=1024, num_warps=4), "o": dict(block_n=8, block_k=1024, num_warps=4),
          "gate_up": dict(block_n=8, block_k=1024, num_warps=4), "down": dict(block_n=8, block_k=1024, num_warps=4)},
}


LM_HEAD = (128256, 2048)
LM_HEAD_CONFIGS = {"4x2048/8w": dict(block_n=4, block_k=2048, num_warps=8),
                   "8x2048/8w": dict(block_n=8, block_k=2048, num_warps=8),
                   "8x1024/4w": dict(block_n=8, block_k=1024, num_warps=4),
                   "16x1024/8w": dict(block_n=16, block_k=1024, num_warps=8)}


def lm_head_rows(warmup: int, rep: int, roof: Any) -> list[dict[str, Any]]:
    """The batch-1 LM head alone: cuBLAS against ``gemv`` (see the module docstring)."""
    n, k = LM_HEAD
    g = torch.Generator(device="cuda").manual_seed(1)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / k**0.5
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=g)
    out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    provs: list[tuple[str, Callable[[], Any]]] = [("cublas", lambda: torch.mm(x, w.T, out=out))]
    provs += [(f"triton/{name}", lambda cfg=cfg: gemv(x, w, out, **cfg)) for name, cfg in LM_HEAD_CONFIGS.items()]
    rows = []
    for prov, fn in provs + provs[:1]:
        us = 1e3 * common.bench_cuda_graph(fn, warmup=warmup, rep=rep)["median_ms"]
        tbps = n * k * 2 / (us * 1e-6) / 1e12
        rows.append({"part": "lm_head", "provider": prov, "us": us, "tbps": tbps, **roof.fractions(tbps=tbps)})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--quick", action="store_true", help="shorter timing (the chain is the same)")
    args = p.parse_args(argv)
    warmup, rep = (10, 50) if args.quick else (25, 200)
    if not torch.cuda.is_available():
        print("bench_gemv needs a CUDA GPU (run it on the device machine).", file=sys.stderr)
        return 2
    roof = roofline.measure(quick=True)
    chain = Chain(args.layers)
    nbytes = sum(n * k * 2 for n, k in SHAPES.values())
    rows: list[dict[str, Any]] = []
    provs: list[tuple[str, Callable[[], None]]] = [("cublas", chain.cublas)]
    for name, cfg in CONFIGS.items():
        provs += [(f"triton/{name}", chain.triton(False, cfg)), (f"triton+pdl/{name}", chain.triton(True, cfg))]
    for prov, fn in common.progress(provs, "providers"):
        us = 1e3 * common.bench_cuda_graph(fn, warmup=warmup, rep=rep)["median_ms"] / args.layers
        tbps = nbytes / (us * 1e-6) / 1e12
        rows.append({"part": "chain", "provider": prov, "us_per_layer": us, "tbps": tbps, **roof.fractions(tbps=tbps)})
    for prov, fn in provs[:3]:  # the first ones again: clock drift over the run
        us = 1e3 * common.bench_cuda_graph(fn, warmup=warmup, rep=rep)["median_ms"] / args.layers
        rows.append({"part": "chain", "provider": prov + " (again)", "us_per_layer": us,
                     "tbps": nbytes / (us * 1e-6) / 1e12})
    rows += lm_head_rows(warmup, rep, roof)
    table = common.Table(["part", "provider", "us_per_layer", "us", "tbps", "frac_copy_bw"],
                         title="batch-1 matmuls: layer chain, LM head")
    table.extend(rows)
    print(table.to_markdown())
    print(common.write_results("gemv-chain", {"rows": rows, "summary": {"roofline": roof.to_dict(), "layers": args.layers}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

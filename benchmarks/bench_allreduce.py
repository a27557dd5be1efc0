#!/usr/bin/env python
"""All-reduce latency by message size: one-shot and two-shot symmetric memory against NCCL.

The thresholds of ``examples.allreduce.AllReducePolicy`` come from this. Launch one process per
GPU; groups of 2, 4, ... consecutive ranks (``--group-sizes``, default every power of two up to the
world) run side by side, rank 0's group reports::

    torchrun --nproc-per-node 4 benchmarks/bench_allreduce.py

A message is ``tokens x hidden`` (``--hidden`` 4096, bf16) for ``--tokens`` 1 .. 4096. Per group
size, message and algorithm: ``--chain`` all-reduces back to back (each the last one's output, as a
decoder's are) captured in one CUDA graph; the figure is the graph's median replay (CUDA events)
over ``--chain``, in microseconds. Every result is checked against the exact sum first (integer
data). ``summary.best`` names the fastest algorithm per size and ``summary.policy`` the
thresholds that follow: one-shot up to the largest message where it is fastest, then two-shot up
to the largest where two-shot beats NCCL. Writes ``allreduce-<device>-<date>.json`` to $OUT or
benchmarks/results/.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.bench_tp import capture, time_gpu  # noqa: E402
from benchmarks.common import Table, env_info, progress, write_results  # noqa: E402
from examples.tp import TensorParallel, tensor_parallel_run  # noqa: E402

ALGORITHMS = ("one_shot", "two_shot", "nccl")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256,512,1024,2048,4096")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--group-sizes", default=None, help="comma-separated (default: 2, 4, ... up to the world)")
    p.add_argument("--chain", type=int, default=32, help="all-reduces per captured graph")
    p.add_argument("--reps", type=int, default=50)
    args = p.parse_args(argv)
    args.tokens = sorted({int(t) for t in args.tokens.split(",")})
    args.group_sizes = sorted({int(n) for n in args.group_sizes.split(",")}) if args.group_sizes else None
    return args


def time_chain(tp: TensorParallel, x: torch.Tensor, chain: int, reps: int) -> float:
    """Median us per all-reduce of a captured chain of ``chain`` all-reduces of ``x`` (bench_tp's
    fixed-count timing: every rank replays as many graphs, each waiting for the peers)."""
    scale = x.new_tensor(1.0 / tp.size)

    def many() -> torch.Tensor:
        y = x
        for _ in range(chain):
            y = tp.all_reduce(y) * scale  # the sum over ranks of equal values, scaled back: finite
        return y

    return 1e3 * time_gpu(capture(many, x.device), reps, x.device, tp.group) / chain


def check(tp: TensorParallel, tokens: int, hidden: int, device: torch.device) -> float:
    """Max error of one all-reduce on integer data (exact in bf16)."""
    g = torch.Generator().manual_seed(tokens)
    parts = torch.randint(-8, 8, (tp.size, tokens, hidden), generator=g).to(device, torch.bfloat16)
    got = tp.all_reduce(parts[tp.rank].clone())
    return (got.float() - parts.float().sum(0)).abs().max().item()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if not torch.cuda.is_available() or not dist.is_torchelastic_launched():
        raise SystemExit("launch on GPUs with torchrun: `torchrun --nproc-per-node 4 benchmarks/bench_allreduce.py`.")
    with tensor_parallel_run(None, "cuda", timeout=timedelta(minutes=20)) as (world_tp, device):
        return run(args, world_tp, device)


def run(args: argparse.Namespace, world_tp: TensorParallel, device: torch.device) -> dict[str, Any]:
    lead = world_tp.rank == 0
    sizes = args.group_sizes or [n for n in (2, 4, 8, 16) if n <= world_tp.size]
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    max_tokens = max(args.tokens)
    for n in sizes:
        tp = world_tp.subgroup(n)
        if not tp.enable_symm_mem(max_tokens, args.hidden, torch.bfloat16, device):
            raise SystemExit("symmetric memory is unavailable here (see the warning); nothing to compare.")
        for tokens in progress(args.tokens, desc=f"group of {n}", disable=not lead):
            x = torch.randn(tokens, args.hidden, device=device, dtype=torch.bfloat16)
            row: dict[str, Any] = {"group": n, "tokens": tokens, "bytes": x.numel() * x.element_size()}
            for algo in ALGORITHMS:
                tp.algorithm = algo
                row[f"{algo}_error"] = check(tp, tokens, args.hidden, device)
                row[f"{algo}_us"] = time_chain(tp, x, args.chain, args.reps)
            tp.algorithm = "auto"
            row["auto_picks"] = tp.symm_mem.choose(x)
            row["best"] = min(ALGORITHMS, key=lambda a: row[f"{a}_us"])
            rows.append(row)
        tp.disable_symm_mem()
    summary = {"hidden": args.hidden, "dtype": "bfloat16", "chain": args.chain, "group_sizes": sizes,
               "seconds": time.perf_counter() - t0, "max_error": max(r[f"{a}_error"] for r in rows for a in ALGORITHMS),
               "best": {n: {r["tokens"]: r["best"] for r in rows if r["group"] == n} for n in sizes},
               "policy": {n: policy_from(rows, n) for n in sizes}}
    out = {"rows": rows, "summary": summary}
    if lead:
        path = write_results("allreduce", {**out, "env": env_info(device)})
        table = Table(["group", "tokens", "bytes", "one_shot_us", "two_shot_us", "nccl_us", "best", "auto_picks"],
                      title=f"all-reduce, us per call (bf16, hidden {args.hidden}, chains of {args.chain})")
        table.extend(rows)
        table.print()
        print(f"policy from these: {summary['policy']}\nwrote {path}")
    return out


def policy_from(rows: list[dict[str, Any]], n: int) -> dict[str, int]:
    """One-shot up to the last message of the run of smallest sizes where it is the fastest; then
    two-shot up to the last message of the run where it beats NCCL (bytes; a tie within 1% is
    no win, so equal timings at the largest sizes hand over to NCCL)."""
    mine = sorted((r for r in rows if r["group"] == n), key=lambda r: r["bytes"])
    one = two = 0
    i = 0
    while i < len(mine) and mine[i]["best"] == "one_shot" and mine[i]["one_shot_us"] < 0.99 * mine[i]["nccl_us"]:
        one = two = mine[i]["bytes"]
        i += 1
    while i < len(mine) and mine[i]["two_shot_us"] < 0.99 * mine[i]["nccl_us"]:
        two = mine[i]["bytes"]
        i += 1
    return {"one_shot_max_bytes": one, "two_shot_max_bytes": two}


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Tensor-parallel decode: ms/step at TP=1 and TP=N, and the all-reduce share of the step.

Model: the Llama-3-8B shape (32 layers, hidden 4096, 32 q / 8 KV heads, head dim 128, vocab
128256), random weights, bf16, ``examples.model.DecoderForCausalLM`` on ``examples.tp``. Launch
one process per GPU::

    torchrun --nproc-per-node 4 benchmarks/bench_tp.py --compile  # TP 1, 2, 4; batch 1 and 64, context 1024
    torchrun --nproc-per-node 2 benchmarks/bench_tp.py            # TP 1, 2; the eager model

Every rank first measures TP=1 on its own GPU (its own full model; only rank 0's figures are
kept). Then for each TP size n of ``--tp-sizes`` (default 2, 4, ... up to the world) the world
splits into groups of n consecutive ranks that run side by side (rank 0's group reports), once per
all-reduce (``--allreduce``): ``fused`` (FlashInfer's all-reduce fused with the residual add and the
next RMSNorm for the o_proj / down_proj sums, ``auto`` for the embedding's; skipped where FlashInfer
is missing), ``auto`` (``examples/allreduce.py``: PyTorch's symmetric-memory one-shot or two-shot
all-reduce by message size, P2P over NVLink, no multicast, NCCL above; NCCL throughout where
symmetric memory is unavailable), ``nccl`` (c10d's functional all-reduce alone) and ``none`` (the
collectives removed: wrong numbers, the step's compute alone, for the in-situ communication cost).

A step is a uniform decode batch (``--batches``) of requests with ``--context`` tokens of random
K/V already in their paged caches, run through ``vattn.CUDAGraphRunner`` (FULL graphs: the
all-reduces are inside the captured graph). Per row:

| column | meaning |
| --- | --- |
| ``graph_ms`` | median replay of the captured forward graph (CUDA events) |
| ``step_ms`` | median wall time of a whole step: runner call (metadata, replay) + LM head (vocab all-gather) + argmax, synchronised |
| ``allreduce_ms`` | the step's ``2 * layers + 1`` all-reduces of (batch, hidden) alone, captured back to back in one graph (``fused``: ``2 * layers`` fused all-reduce + add + RMSNorm calls and one all-reduce) |
| ``allreduce_share`` | ``allreduce_ms / graph_ms`` |
| ``comm_in_situ_ms`` / ``comm_in_situ_share`` | ``graph_ms`` minus the ``none`` row's ``graph_ms`` (waiting for the slower rank included), and over ``graph_ms`` |
| ``x_tp1_graph`` / ``x_tp1_step`` | the row's time over the TP=1 row of the same batch |

``summary.targets``: TP=2 at batch 1 at most 0.65x the TP=1 step time (``graph_ms``, the best real
all-reduce), TP=4 at batch 1 at most 0.45x, TP=2 at batch 64 at most 0.6x. Timing loops run a fixed number of iterations on every rank (collectives must match),
after a barrier. Writes ``tp-<device>-<date>.json`` (rank 0) to $OUT or benchmarks/results/.
``--device cpu --preset tiny`` runs the same code with gloo and no CUDA graphs (a smoke test).
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import vattn  # noqa: E402
from examples.gemv import OneTokenGemv  # noqa: E402
from benchmarks.common import (Table, default_dtype, env_info, fill_random_kv_, free_memory, progress,  # noqa: E402
                               split_kv_cache, token_counts, write_results)
from examples.model import DecoderForCausalLM, RMSNorm, get_preset, init_random_weights  # noqa: E402
from examples.tp import TensorParallel, tensor_parallel_run  # noqa: E402

BLOCK = 16


TARGETS = ((2, 1, 0.65), (4, 1, 0.45), (2, 64, 0.6))  # (tp, batch, most graph_ms over TP=1's)
IMPLS = ("fused", "auto", "nccl", "none")


class _NoComm(TensorParallel):
    """Collectives removed (timing only: every rank computes with its own partial sums)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        return x

    @property
    def fused_norm(self) -> None:
        return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--preset", default="llama-3-8b")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--context", type=int, default=1024, help="tokens already in each request's KV cache")
    p.add_argument("--allreduce", default=",".join(IMPLS), help="all-reduces to measure: fused, auto, nccl, none")
    p.add_argument("--tp-sizes", default=None, help="TP sizes above 1, comma-separated (default: 2, 4, ... up to the world)")
    p.add_argument("--fused-pdl", default="auto", choices=["auto", "on", "off"],
                   help="programmatic dependent launch of the fused all-reduce (auto: on Hopper and newer)")
    p.add_argument("--compile", action="store_true", help="vattn.compile the model (FULL_AND_PIECEWISE graphs)")
    p.add_argument("--backend", default=None, help="force a vattn attention backend")
    p.add_argument("--compile-sizes", default="1", help="CompilationConfig.compile_sizes, comma-separated token counts (\"\" for none): pieces also compiled for exactly these sizes (Inductor GEMV at 1)")
    p.add_argument("--reps", type=int, default=100, help="timed iterations per figure (after reps // 5 warm-up)")
    p.add_argument("--quick", action="store_true", help="30 timed iterations")
    args = p.parse_args(argv)
    args.batches = sorted({int(b) for b in args.batches.split(",")})
    args.allreduce = [a for a in args.allreduce.split(",") if a]
    unknown = set(args.allreduce) - set(IMPLS)
    if unknown:
        p.error(f"--allreduce: unknown {sorted(unknown)}; choose from {', '.join(IMPLS)}.")
    args.tp_sizes = sorted({int(n) for n in args.tp_sizes.split(",")}) if args.tp_sizes else None
    args.dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    args.reps = 30 if args.quick else args.reps
    return args


# ---- timing (fixed counts: every rank runs the same collectives) ------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_gpu(fn: Callable[[], Any], reps: int, device: torch.device, group: Any = None) -> float:
    """Median ms of ``fn`` (CUDA events around each call; perf_counter on the CPU)."""
    for _ in range(max(2, reps // 5)):
        fn()
    _sync(device)
    if group is not None:
        dist.barrier(group=group)
    if device.type != "cuda":
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times)
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for s, e in ev:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize(device)
    return statistics.median(s.elapsed_time(e) for s, e in ev)


def time_wall(fn: Callable[[], Any], reps: int, device: torch.device, group: Any = None) -> float:
    """Median wall ms of ``fn`` followed by a device synchronisation."""
    def call() -> None:
        fn()
        _sync(device)

    for _ in range(max(2, reps // 5)):
        call()
    if group is not None:
        dist.barrier(group=group)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def capture(fn: Callable[[], Any], device: torch.device) -> Callable[[], Any]:
    """``fn`` captured in a CUDA graph (after one eager run); on the CPU ``fn`` itself."""
    fn()
    if device.type != "cuda":
        return fn
    _sync(device)
    from vattn.compile_passes.piecewise import capture_graph

    graph, _ = capture_graph(fn)  # its own pool and cuBLAS workspace (see capture_graph)
    _sync(device)
    return graph.replay


# ---- the model and a decode batch -------------------------------------------------------------


def build(args: argparse.Namespace, tp: TensorParallel, device: torch.device, num_blocks: int
          ) -> tuple[DecoderForCausalLM, vattn.VattnConfig, Any]:
    mcfg = get_preset(args.preset, max_position_embeddings=args.context + 64)
    cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=BLOCK),
                            compilation=vattn.CompilationConfig(compile_sizes=token_counts(args.compile_sizes),
                                                                piece_passes=(OneTokenGemv(),)))
    with vattn.global_force_attn_backend_context_manager(args.backend), vattn.set_current_vattn_config(cfg), \
            torch.device(device), default_dtype(args.dtype):
        model = DecoderForCausalLM(mcfg, tp=tp)
    init_random_weights(model, seed=0)
    model.eval()
    kv = vattn.allocate_kv_cache(cfg, num_blocks=num_blocks, device=device, dtype=args.dtype)
    for i, t in enumerate(kv.tensors.values()):
        fill_random_kv_(*split_kv_cache(t, num_blocks), seed=i)
    return model, cfg, kv


def decode_batch(kv: Any, batch: int, context: int, vocab: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor, vattn.CommonAttentionMetadata]:
    """``batch`` requests of ``context`` cached tokens and one new token each; blocks from 1 up."""
    per = math.ceil((context + 1) / BLOCK)
    tables = [list(range(1 + i * per, 1 + (i + 1) * per)) for i in range(batch)]
    common = kv.common_metadata([1] * batch, [context] * batch, tables)
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, vocab, (batch,), generator=g).to(device)
    return ids, torch.full((batch,), context, dtype=torch.long, device=device), common


def set_tp(model: torch.nn.Module, tp: TensorParallel) -> None:
    """Point every parallel layer of ``model`` at ``tp`` (switches the all-reduce implementation)."""
    for m in model.modules():
        if isinstance(getattr(m, "tp", None), TensorParallel):
            m.tp = tp


def measure(model: DecoderForCausalLM, cfg: vattn.VattnConfig, kv: Any, tp: TensorParallel, impl: str,
            args: argparse.Namespace, device: torch.device, group: Any) -> list[dict[str, Any]]:
    """Rows for every batch size with ``model`` switched to ``tp`` (``impl`` names its all-reduce)."""
    set_tp(model, tp)
    torch._dynamo.reset()
    fn = vattn.compile(model, cfg) if args.compile else model
    mode = vattn.CUDAGraphMode.FULL_AND_PIECEWISE if args.compile else vattn.CUDAGraphMode.FULL_DECODE_ONLY
    runner = vattn.CUDAGraphRunner(fn, cfg, kv, capture_sizes=args.batches, mode=mode,
                                   max_model_len=args.context + 2 * BLOCK, show_progress=False)
    rows = []
    for batch in args.batches:
        ids, pos, common = decode_batch(kv, batch, args.context, model.config.vocab_size, device)

        def step() -> torch.Tensor:
            return model.compute_logits(runner(ids, pos, common)).argmax(dim=-1)

        step()  # captures every size on the first call
        graph = runner.full_graphs.get(batch)
        used = runner.last_batch_descriptor.mode.name if runner.last_batch_descriptor else "NONE"
        if graph is not None:
            graph_ms = time_gpu(graph.graph.replay, args.reps, device, group)
        else:  # no full graph (CPU, or a backend that declines): time the runner's forward
            graph_ms = time_gpu(lambda: runner(ids, pos, common), args.reps, device, group)
        row: dict[str, Any] = {"tp": tp.size, "allreduce": impl if tp.size > 1 else "-", "batch": batch,
                               "context": args.context, "graph_mode": used, "graph_ms": graph_ms,
                               "step_ms": time_wall(step, args.reps, device, group)}
        if tp.size > 1 and impl != "none":
            row.update(allreduce_ms=allreduce_alone(tp, batch, model.config, args, device, group),
                       num_allreduces=2 * model.config.num_hidden_layers + 1)
            row["allreduce_share"] = row["allreduce_ms"] / graph_ms
        rows.append(row)
    runner.release()
    return rows


def allreduce_alone(tp: TensorParallel, batch: int, mcfg: Any, args: argparse.Namespace, device: torch.device,
                    group: Any) -> float:
    """ms of the step's all-reduces of (batch, hidden), back to back, captured in one graph (with
    the fused all-reduce enabled: the layers' fused all-reduce + add + RMSNorm calls and the
    embedding's plain all-reduce)."""
    count = 2 * mcfg.num_hidden_layers + 1
    x = torch.randn(batch, mcfg.hidden_size, device=device).mul_(2.0**-60).to(args.dtype)
    norm = RMSNorm(mcfg.hidden_size, mcfg.rms_norm_eps).to(device, args.dtype)

    def many() -> torch.Tensor:
        y = x
        if tp.fused_norm is not None:
            y = tp.all_reduce(y)
            residual = y
            for _ in range(count - 1):  # normed outputs and a residual that grows by their sum: finite
                y, residual = tp.all_reduce_add_rms_norm(y, residual, norm)
            return y + 0
        for _ in range(count):  # chained like the model's; values stay finite (x ~ 2^-60, doubled each time)
            y = tp.all_reduce(y)
        return y + 0  # waits for the last one

    return time_gpu(capture(many, device), args.reps, device, group)


# ---- main ---------------------------------------------------------------------------------------


def topology(device: torch.device, world: int) -> dict[str, Any]:
    if device.type != "cuda":
        return {}
    peer = {f"{a}->{b}": torch.cuda.can_device_access_peer(a, b)
            for a in range(torch.cuda.device_count()) for b in range(torch.cuda.device_count()) if a != b}
    try:
        topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        topo = None
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else None
    return {"peer_access": peer, "nvidia_smi_topo": topo, "nccl": nccl, "world": world}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Ratios to TP=1 on every row; the issue's targets (best real all-reduce per TP size and batch)."""
    tp1 = {r["batch"]: r for r in rows if r["tp"] == 1}
    none = {(r["tp"], r["batch"]): r for r in rows if r["tp"] > 1 and r["allreduce"] == "none"}
    for r in rows:
        if r["batch"] in tp1:
            r["x_tp1_graph"] = r["graph_ms"] / tp1[r["batch"]]["graph_ms"]
            r["x_tp1_step"] = r["step_ms"] / tp1[r["batch"]]["step_ms"]
        base = none.get((r["tp"], r["batch"]))
        if r["tp"] > 1 and r["allreduce"] != "none" and base is not None:
            r["comm_in_situ_ms"] = r["graph_ms"] - base["graph_ms"]
            r["comm_in_situ_share"] = r["comm_in_situ_ms"] / r["graph_ms"]
    targets = []
    for n, batch, most in TARGETS:
        real = [r for r in rows if r["tp"] == n and r["batch"] == batch and r["allreduce"] not in ("none", "-")
                and "x_tp1_graph" in r]
        best = min(real, key=lambda r: r["graph_ms"], default=None)
        targets.append({"what": f"TP={n} at batch {batch} at most {most}x the TP=1 step (graph_ms, best all-reduce)",
                        "tp": n, "batch": batch, "at_most": most,
                        "ratio": best["x_tp1_graph"] if best else None,
                        "ratio_step_ms": best["x_tp1_step"] if best else None,
                        "allreduce": best["allreduce"] if best else None,
                        "met": None if best is None else bool(best["x_tp1_graph"] <= most)})
    return {"targets": targets}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_tp.py needs CUDA GPUs (or --device cpu --preset tiny for a smoke run).")
    if not dist.is_torchelastic_launched():
        raise SystemExit("launch with torchrun: `torchrun --nproc-per-node 2 benchmarks/bench_tp.py`.")
    with tensor_parallel_run(None, args.device, timeout=timedelta(minutes=30)) as (world_tp, device):
        return run(args, world_tp, device)


def run(args: argparse.Namespace, world_tp: TensorParallel, device: torch.device) -> dict[str, Any]:
    lead, world = world_tp.rank == 0, world_tp.size
    sizes = args.tp_sizes or [n for n in (2, 4, 8, 16) if n <= world]
    bad = [n for n in sizes if n < 2 or world % n]
    if bad:
        raise SystemExit(f"--tp-sizes {bad}: each must be above 1 and divide the {world} ranks torchrun started.")
    groups = {n: world_tp.subgroup(n) for n in sizes}
    hidden = get_preset(args.preset).hidden_size
    num_blocks = 1 + max(args.batches) * math.ceil((args.context + 1) / BLOCK)
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    t0 = time.perf_counter()
    backend = "?"
    jobs = [(1, "-"), *((n, impl) for n in sizes for impl in args.allreduce)]
    model = cfg = kv = None
    built_for = None
    for n, impl in progress(jobs, desc="tp", disable=not lead):
        tp = groups.get(n, TensorParallel())
        if built_for != n:  # one model per TP size, its layers pointed at each all-reduce in turn
            model = cfg = kv = None
            free_memory()
            model, cfg, kv = build(args, tp, device, num_blocks)
            backend = model.model.layers[0].self_attn.attn.attn_backend.get_name()
            built_for = n
        if impl == "none":
            tp = _NoComm(tp.rank, n, tp.group)
        elif impl in ("auto", "fused"):
            tp.algorithm = "auto"
            if not tp.enable_symm_mem(max(args.batches), hidden, args.dtype, device):
                skipped[f"tp{n} auto"] = "symmetric memory unavailable here (see the log): auto is NCCL throughout"
            pdl = {"auto": None, "on": True, "off": False}[args.fused_pdl]
            if impl == "fused" and not tp.enable_fused_norm(max(args.batches), hidden, args.dtype, device, pdl):
                skipped[f"tp{n} fused"] = "FlashInfer's fused all-reduce unavailable here (see the log)"
                tp.disable_symm_mem()
                continue
        elif impl == "nccl":
            tp.disable_symm_mem()
            tp.algorithm = "nccl"
        try:
            new = measure(model, cfg, kv, tp, impl, args, device, tp.group)
        except Exception as e:  # keep the other all-reduces' figures (every rank fails alike)
            skipped[f"tp{n} {impl}"] = f"{type(e).__name__}: {e}"[:800]
            if lead:
                print(f"tp{n} {impl}: failed: {skipped[f'tp{n} {impl}']}", flush=True)
            continue
        finally:
            if n > 1 and impl != "none":
                tp.disable_symm_mem()
        rows += new
        if lead:
            for r in new:
                print(f"tp{n} {impl} b{r['batch']}: graph {r['graph_ms']:.3f} ms, step {r['step_ms']:.3f} ms", flush=True)
        if n == 1:
            dist.barrier()  # TP=1 ran on every rank alone; the groups start together
    model = cfg = kv = None
    free_memory()
    summary = {"preset": args.preset, "dtype": str(args.dtype), "context": args.context, "compile": args.compile,
               "compile_sizes": args.compile_sizes, "tp_sizes": [1, *sizes], "fused_pdl": args.fused_pdl,
               "attention_backend": backend, "world": world, "skipped": skipped,
               "seconds": time.perf_counter() - t0, "topology": topology(device, world), **summarize(rows),
               "notes": ["TP=1 rows: every rank measured alone on its own GPU at the same time; rank 0's kept",
                         "TP=n < world: the world's groups of n ranks ran side by side; rank 0's group reported",
                         "allreduce 'fused': FlashInfer's all-reduce + residual add + RMSNorm kernel for the "
                         "layers' sums ('auto' for the embedding's); "
                         "'auto': symmetric-memory one-/two-shot by message size, NCCL above; "
                         "'nccl': c10d functional all-reduce; 'none': collectives removed (the compute alone; "
                         "wrong numbers)",
                         "graph_ms: CUDA-event median of the full-graph replay; step_ms: wall median of "
                         "runner call + LM head (vocab all-gather) + argmax, synchronised"]}
    out: dict[str, Any] = {"rows": rows, "summary": summary}
    if lead:
        path = write_results("tp", {**out, "env": env_info(device)})
        table = Table(["tp", "allreduce", "batch", "graph_mode", "graph_ms", "step_ms", "allreduce_ms",
                       "allreduce_share", "comm_in_situ_share", "x_tp1_graph", "x_tp1_step"],
                      title=f"tensor-parallel decode ({args.preset}, context {args.context}, {backend})")
        table.extend(rows)
        table.print()
        for t in summary["targets"]:
            print(f"target: {t['what']}: {t['ratio']} ({t['allreduce']}) met={t['met']}")
        print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()

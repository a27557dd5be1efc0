#!/usr/bin/env python
"""The example engine's decode step, async against synchronous scheduling, and where its host time goes.

Model: the Llama-3.2-1B shape (``examples/model.py``, random weights, bf16) through
``vattn.compile`` and a ``CUDAGraphRunner`` (``FULL_DECODE_ONLY``), as ``bench_e2e``'s
``vattn-cudagraph-full`` impl. Per batch size, ``--reps`` times, in one process:
``examples.engine.Engine`` with ``async_scheduling=False`` (one host sync per step) and
``True`` (each step launched while the GPU runs the previous one) prefills ``batch`` prompts of
``--context`` tokens, then times ``--steps`` decode steps.

| figure | meaning |
| --- | --- |
| ``step_ms`` | median wall time of ``Engine.step`` (no timers inside) |
| ``<phase>_ms`` | a second pass with each part of the step timed on the host (medians; the timers add a little): ``schedule``, ``prepare`` (of it ``common_metadata``, ``vattn.InputBatch.prepare``), ``runner`` (graph runner: pad, metadata build, replay), ``logits``, ``sample``, ``to_host`` (start the tokens' copy), ``update`` (the scheduler's bookkeeping), ``flush`` (wait for the tokens of the step before: with async scheduling, the time the host waits for the GPU) |

A step whose ``flush`` waits is GPU-bound; one whose ``flush`` is near zero with async
scheduling is host-bound.

    PYTHONPATH=$PWD python benchmarks/bench_engine.py                    # batch 1 and 64, context 512
    PYTHONPATH=$PWD python benchmarks/bench_engine.py --quick --batches 1

Writes ``engine-<device>-<date>.json`` to $OUT (if set) or benchmarks/results/.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import vattn  # noqa: E402
from benchmarks import bench_e2e, common  # noqa: E402
from examples import engine as engine_mod  # noqa: E402
from examples.engine import Engine, SamplingParams  # noqa: E402
from examples.gemv import OneTokenGemv  # noqa: E402

BLOCK = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="40 steps, one round")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=None, help="timed decode steps per engine (default 80; --quick 40)")
    p.add_argument("--reps", type=int, default=None, help="rounds over (batch, scheduling) (default 2; --quick 1)")
    p.add_argument("--preset", default="llama-3.2-1b")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda", help="cuda (the benchmark); cpu only to smoke-test the script "
                   "(tiny model, eager, float32)")
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    args.steps = args.steps or (40 if args.quick else 80)
    args.reps = args.reps or (1 if args.quick else 2)
    return args


class PhaseTimer:
    """Wraps named callables so each call's host time is recorded (``times[name]``, seconds)."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = collections.defaultdict(list)

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.times[name].append(time.perf_counter() - t)

        return timed

    def medians_ms(self) -> dict[str, float]:
        return {k: 1e3 * statistics.median(v) for k, v in self.times.items()}


@contextlib.contextmanager
def instrumented(timer: PhaseTimer, graph_runner: Any, model: Any) -> Iterator[None]:
    """Time the parts of ``Engine.step`` while inside (the patches are undone on exit)."""
    parts = [(Engine, "_prepare", "prepare"), (Engine, "flush", "flush"), (Engine, "_send_to_host", "to_host"),
             (engine_mod, "sample", "sample"), (vattn.InputBatch, "prepare", "common_metadata"),
             (engine_mod.Scheduler, "schedule", "schedule"), (engine_mod.Scheduler, "update", "update"),
             (model, "compute_logits", "logits")]
    if graph_runner is not None:
        parts.append((type(graph_runner), "__call__", "runner"))
    with contextlib.ExitStack() as stack:
        for owner, attr, name in parts:
            stack.enter_context(mock.patch.object(owner, attr, timer.wrap(name, getattr(owner, attr))))
        yield


def decode_engine(model: Any, cfg: vattn.VattnConfig, kv: Any, runner: dict[str, Any], batch: int,
                  context: int, async_scheduling: bool, seed: int, steps: int) -> Engine:
    """An engine whose ``batch`` requests have prefilled ``context`` tokens and decode (``steps``
    more steps at least) from now on."""
    engine = Engine(model, cfg, kv, device=bench_e2e.kv_device(kv), max_num_batched_tokens=8192, max_num_seqs=batch,
                    async_scheduling=async_scheduling, seed=seed, **runner)
    g = torch.Generator().manual_seed(seed)
    for _ in range(batch):
        engine.add_request(torch.randint(0, model.config.vocab_size, (context,), generator=g).tolist(),
                           SamplingParams(max_tokens=steps + 8))
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()
    for _ in range(4):  # warm-up decode steps
        engine.step()
    return engine


def timed_steps(engine: Engine, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    engine.flush()
    return times


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("bench_engine.py needs a CUDA GPU (run it on the device machine), or --device cpu to smoke-test.")
    env = common.env_info(args.device)
    preset = args.preset if cuda else "tiny"
    e2e_args = bench_e2e.parse_args(["--quick", "--preset", preset, "--seed", str(args.seed), "--device", args.device])
    impl = "vattn-cudagraph-full" if cuda else "vattn-eager"
    e2e_args.impls = ["vattn-compile", impl] if cuda else [impl]
    e2e_args.batches = args.batches
    max_len = args.context + 2 * args.steps + 64
    mcfg = bench_e2e.get_preset(preset, max_position_embeddings=max_len + 1024)
    cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=BLOCK),
                            compilation=vattn.CompilationConfig(compile_sizes=(1,), piece_passes=(OneTokenGemv(),)))
    dtype = torch.bfloat16 if cuda else torch.float32
    model, _ = bench_e2e.build_models(e2e_args, mcfg, torch.device(args.device), dtype, cfg)
    # The engines run one after another, each over the whole cache.
    num_blocks = max(args.batches) * -(-(args.context + 2 * args.steps + 16) // BLOCK) + 16
    kv = vattn.allocate_kv_cache(cfg, num_blocks=num_blocks, device=args.device, dtype=dtype)
    impls = bench_e2e.VattnImpls(model, cfg, kv, e2e_args, max_len, {"cudagraph": {}})
    runner, setup_s = impls.runner(impl)
    timer = PhaseTimer()

    rows = []
    jobs = [(rep, b, a) for rep in range(args.reps) for b in args.batches for a in (False, True)]
    for rep, batch, async_scheduling in common.progress(jobs, "engine"):
        engine = decode_engine(model, cfg, kv, runner, batch, args.context, async_scheduling, args.seed + rep,
                               2 * args.steps)
        step_ms = 1e3 * statistics.median(timed_steps(engine, args.steps))
        timer.times.clear()
        with instrumented(timer, runner.get("graph_runner"), model):
            timed_steps(engine, args.steps)
        rows.append({"rep": rep, "batch": batch, "context": args.context, "async_scheduling": async_scheduling,
                     "impl": impl, "step_ms": step_ms, "tok_s": batch * 1e3 / step_ms,
                     "graph_mode": bench_e2e.graph_mode(runner),
                     **{f"{k}_ms": v for k, v in timer.medians_ms().items()}})
        del engine
    summary: dict[str, Any] = {"setup_s": setup_s, "steps": args.steps, "reps": args.reps, "ratios": {}}
    for b in args.batches:
        sync = [r["step_ms"] for r in rows if r["batch"] == b and not r["async_scheduling"]]
        asyn = [r["step_ms"] for r in rows if r["batch"] == b and r["async_scheduling"]]
        summary["ratios"][f"sync/async b{b}"] = statistics.median(sync) / statistics.median(asyn)
    path = common.write_results("engine", {"benchmark": "engine", "env": env, "summary": summary, "rows": rows},
                                path=common.result_path("engine", env))
    for r in rows:
        phases = ", ".join(f"{k[:-3]} {v:.3f}" for k, v in r.items() if k.endswith("_ms") and k != "step_ms")
        print(f"rep {r['rep']} batch {r['batch']} async {r['async_scheduling']}: step {r['step_ms']:.3f} ms "
              f"({phases})")
    print("sync / async step:", ", ".join(f"{k} {v:.2f}" for k, v in summary["ratios"].items()))
    print(f"wrote {path}")
    return {"summary": summary, "rows": rows}


if __name__ == "__main__":
    main()

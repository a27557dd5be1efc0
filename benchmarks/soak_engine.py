"""Soak: thousands of engine steps of random traffic under FULL_AND_PIECEWISE CUDA graphs.

``examples/engine.py`` runs a ``vattn.compile``d ``examples/model.py`` model (the ``tiny`` preset,
or ``llama-3.2-1b``'s shapes with ``--layers`` decoder layers) through ``vattn.CUDAGraphRunner``
in mode ``FULL_AND_PIECEWISE``: requests arrive at random steps with random prompt lengths and
output budgets (some sampled with temperature), a KV cache too small for all of them forces
preemption (recomputation), and requests finish when their budget is spent. After a warm-up
(compiles, captures, one drained round of traffic) the soak runs ``--steps`` engine steps, then
drains. It checks that

* every KV-cache block is free again (the engine's ``BlockAllocator``, and its invariants on
  every step);
* every request finished with its full output;
* GPU memory did not grow: ``torch.cuda.memory_allocated`` after the drained soak vs after the
  drained warm-up (``--memory-slack-mib`` allowed);
* nothing recompiled: Dynamo's graph count and the vattn backend's compile counters are the
  same after the soak as after the warm-up.

Usage (results via ``benchmarks.common.write_results`` as ``soak-<device>-<date>.json``, or ``$OUT``)::

    python benchmarks/soak_engine.py --steps 10000                     # GPU
    python benchmarks/soak_engine.py --steps 10000 --preset llama-3.2-1b --layers 4
    python benchmarks/soak_engine.py --device cpu --quick              # CPU smoke run (no graphs on CPU)

Exit status 1 when a check failed.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import vattn  # noqa: E402
from benchmarks.common import env_info, write_results  # noqa: E402
from examples.engine import Engine, SamplingParams  # noqa: E402
from examples.model import DecoderForCausalLM, get_preset, init_random_weights  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (the soak), or cpu for a smoke run (no CUDA graphs)")
    p.add_argument("--steps", type=int, default=None, help="engine steps after the warm-up (default 10000; --quick 60)")
    p.add_argument("--warmup-steps", type=int, default=None, help="steps of traffic before the baseline (default 300; "
                   "--quick 20)")
    p.add_argument("--preset", default="tiny", help="examples/model.py preset (tiny, llama-3.2-1b, ...)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the preset's)")
    p.add_argument("--backend", default=None, help="force an attention backend (default: vattn's choice)")
    p.add_argument("--num-blocks", type=int, default=None, help="KV-cache blocks (small: preemption; default 160)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=200)
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--arrival", type=float, default=0.35, help="chance of new requests at a step")
    p.add_argument("--max-waiting", type=int, default=48, help="no arrivals while this many requests wait")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--capture-sizes", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--memory-slack-mib", type=float, default=1.0)
    p.add_argument("--no-compile", action="store_true", help="run the eager model (smoke tests); no piecewise graphs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="60 steps of a small cache (a smoke run)")
    p.add_argument("--out", default=None, help="JSON path (default: write_results' place)")
    args = p.parse_args(argv)
    args.steps = args.steps if args.steps is not None else (60 if args.quick else 10000)
    args.warmup_steps = args.warmup_steps if args.warmup_steps is not None else (20 if args.quick else 300)
    if args.num_blocks is None:
        args.num_blocks = 10 if args.quick else 160
    if args.quick:
        args.max_prompt, args.max_new = min(args.max_prompt, 40), min(args.max_new, 12)
        args.max_num_batched_tokens = min(args.max_num_batched_tokens, 64)
        args.arrival = max(args.arrival, 0.6)
    return args


class Traffic:
    """Random arrivals: prompts of 1..max_prompt tokens, budgets of 1..max_new tokens, a third sampled."""

    def __init__(self, engine: Engine, args: argparse.Namespace, vocab: int, seed: int) -> None:
        self.engine, self.args, self.vocab = engine, args, vocab
        self.rng = np.random.default_rng(seed)
        self.requests: list[Any] = []

    def maybe_arrive(self) -> None:
        a, sched = self.args, self.engine.scheduler
        if len(sched.waiting) >= a.max_waiting or self.rng.random() >= a.arrival:
            return
        for _ in range(int(self.rng.integers(1, 4))):
            n = int(self.rng.integers(1, a.max_prompt + 1))
            prompt = self.rng.integers(0, self.vocab, n).tolist()
            temp = 0.8 if self.rng.random() < 0.33 else 0.0
            sampling = SamplingParams(max_tokens=int(self.rng.integers(1, a.max_new + 1)), temperature=temp, top_p=0.9)
            self.requests.append(self.engine.add_request(prompt, sampling, arrival_step=self.engine.step_count))

    def run(self, steps: int, modes: Counter[str], runner: Any) -> int:
        """``steps`` engine steps with arrivals, then until every request finished; returns the steps run."""
        done = 0
        for _ in range(steps):
            self.maybe_arrive()
            self.engine.step()
            done += 1
            _count_mode(modes, runner)
        while self.engine.scheduler.has_unfinished():
            self.engine.step()
            done += 1
            _count_mode(modes, runner)
        self.engine.flush()
        return done


def _count_mode(modes: Counter[str], runner: Any) -> None:
    bd = getattr(runner, "last_batch_descriptor", None)
    modes[bd.mode.name if bd is not None else "eager"] += 1


def _compile_state(compiled: Any) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    state: dict[str, Any] = {"dynamo_unique_graphs": int(counters["stats"].get("unique_graphs", 0))}
    backend = getattr(compiled, "backend", None)
    if backend is not None:
        c = backend.counter
        state.update(num_graphs_seen=c.num_graphs_seen, num_inductor_compiles=c.num_inductor_compiles,
                     num_static_compiles=c.num_static_compiles)
    return state


def _memory(device: torch.device) -> int | None:
    gc.collect()
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return int(torch.cuda.memory_allocated(device))


def build(args: argparse.Namespace, device: torch.device) -> tuple[Any, ...]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    mcfg = get_preset(args.preset, **({"num_hidden_layers": args.layers} if args.layers else {}))
    sizes = tuple(int(s) for s in args.capture_sizes.split(","))
    comp = vattn.CompilationConfig(cudagraph_mode=vattn.CUDAGraphMode.FULL_AND_PIECEWISE,
                                   cudagraph_capture_sizes=sizes, max_capture_size=max(sizes))
    cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=args.block_size), compilation=comp)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with vattn.set_current_vattn_config(cfg), torch.device(device):
            model = DecoderForCausalLM(mcfg, attn_backend=args.backend)
    finally:
        torch.set_default_dtype(old)
    init_random_weights(model, seed=args.seed)
    kv = vattn.allocate_kv_cache(cfg, num_blocks=args.num_blocks, device=device, dtype=dtype)
    compiled = model if args.no_compile else vattn.compile(model, cfg)
    runner = vattn.CUDAGraphRunner(compiled, cfg, kv, mode=vattn.CUDAGraphMode.FULL_AND_PIECEWISE,
                                   capture_sizes=sizes, show_progress=False)
    engine = Engine(model, cfg, kv, device=device, graph_runner=runner, max_num_batched_tokens=args.max_num_batched_tokens,
                    max_num_seqs=args.max_num_seqs, seed=args.seed, check_invariants=True)
    return mcfg, cfg, kv, compiled, runner, engine


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("soak_engine.py needs a CUDA GPU (run it on the device machine), or --device cpu to smoke-test.")
    t0 = time.perf_counter()
    mcfg, cfg, kv, compiled, runner, engine = build(args, device)
    traffic = Traffic(engine, args, mcfg.vocab_size, args.seed)
    warm_modes: Counter[str] = Counter()
    warm_steps = traffic.run(args.warmup_steps, warm_modes, runner)
    # A lone request last: its one-row decode steps make the engine capture its LM-head graph
    # (on the second such step) now, not during the soak.
    traffic.requests.append(engine.add_request([1, 2, 3], SamplingParams(max_tokens=6), arrival_step=engine.step_count))
    warm_steps += traffic.run(0, warm_modes, runner)
    mem0, state0 = _memory(device), _compile_state(compiled)
    warm_s = time.perf_counter() - t0
    n_warm_requests = len(traffic.requests)
    modes: Counter[str] = Counter()
    t1 = time.perf_counter()
    soak_steps = traffic.run(args.steps, modes, runner)
    soak_s = time.perf_counter() - t1
    mem1, state1 = _memory(device), _compile_state(compiled)

    alloc = engine.allocator
    failures = []
    if alloc.num_free != kv.num_blocks:
        failures.append(f"{kv.num_blocks - alloc.num_free} of {kv.num_blocks} blocks still allocated")
    try:
        alloc.check([])
    except AssertionError as e:
        failures.append(f"allocator invariants: {e}")
    unfinished = [r.req_id for r in traffic.requests if len(r.output_token_ids) != r.sampling.max_tokens]
    if unfinished:
        failures.append(f"{len(unfinished)} requests without their full output, e.g. {unfinished[:5]}")
    if engine.scheduler.has_unfinished():
        failures.append("the scheduler still holds requests")
    growth = None if mem0 is None or mem1 is None else mem1 - mem0
    if growth is not None and growth > args.memory_slack_mib * 2**20:
        failures.append(f"GPU memory grew by {growth} bytes over the soak")
    changed = {k: (state0[k], state1[k]) for k in state0 if state0[k] != state1.get(k)}
    if changed:
        failures.append(f"recompiled during the soak: {changed}")
    soak_requests = traffic.requests[n_warm_requests:]
    summary = {
        "passed": not failures, "failures": failures, "args": vars(args),
        "model": {"preset": args.preset, "layers": mcfg.num_hidden_layers, "hidden": mcfg.hidden_size},
        "runner_mode": runner.mode.name, "runner_downgrades": runner.downgrade_reasons,
        "backend": next(iter(cfg.compilation.static_forward_context.values())).attn_backend.get_name(),
        "warmup_steps": warm_steps, "soak_steps": soak_steps, "warmup_seconds": round(warm_s, 1),
        "soak_seconds": round(soak_s, 1), "soak_requests": len(soak_requests),
        "soak_tokens_out": sum(len(r.output_token_ids) for r in soak_requests),
        "preemptions": sum(r.num_preemptions for r in soak_requests),
        "step_modes": dict(modes), "warmup_step_modes": dict(warm_modes),
        "memory_allocated_after_warmup": mem0, "memory_allocated_after_soak": mem1, "memory_growth_bytes": growth,
        "compile_state_after_warmup": state0, "compile_state_after_soak": state1,
        "blocks_free": alloc.num_free, "num_blocks": kv.num_blocks,
    }
    rows = [{"phase": "warmup", "steps": warm_steps, "seconds": round(warm_s, 1), **{f"mode_{k}": v for k, v in warm_modes.items()}},
            {"phase": "soak", "steps": soak_steps, "seconds": round(soak_s, 1), **{f"mode_{k}": v for k, v in modes.items()}}]
    path = write_results("soak", {"rows": rows, "summary": summary, "env": env_info(device)}, path=args.out)
    print(f"{'PASSED' if not failures else 'FAILED'}: {soak_steps} steps ({dict(modes)}), {len(soak_requests)} requests, "
          f"{summary['preemptions']} preemptions, memory growth {growth}, compile state {state1} -> {path}")
    for f in failures:
        print("  ", f)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())

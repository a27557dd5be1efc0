#!/usr/bin/env python
"""Host work of one engine step, with a stub model: what the host spends per step when the GPU costs nothing.

The example engine (``examples.engine.Engine``, async scheduling) runs ``batch`` requests that
decode (prompt lengths spread over a block, so requests start new blocks on different steps).
The model is a stub: its layers are real ``vattn.Attention`` layers of ``--backend`` bound to a
paged cache, so the scheduler, ``InputBatch.prepare``, ``kv.build_metadata`` (checks and the
backend's builder), ``set_forward_context``, sampling and the bookkeeping all run as in a real
step; its forward returns a preallocated hidden state and its LM head preallocated logits. No
kernel runs (on CUDA only the metadata copy and sampling).

| figure | meaning |
| --- | --- |
| ``step_us`` | median wall time of ``Engine.step`` (no timers inside) |
| ``<phase>_us`` | a second pass with each part timed (medians; the timers add a little): ``schedule``, ``prepare`` (of it ``input_batch``: ``InputBatch.prepare``), ``build_metadata`` (``kv.build_metadata``), ``sample``, ``update``, ``flush`` |

Targets (issue 55): ``step_us`` <= 100 at b64 and <= 250 at b256, b256 / b64 under 2.5.

    PYTHONPATH=$PWD python benchmarks/bench_host_step.py                  # CPU, batches 1, 64, 256
    PYTHONPATH=$PWD python benchmarks/bench_host_step.py --device cuda    # the GPU machine's host path

Writes ``host-step-<device>-<date>.json`` to $OUT (if set) or benchmarks/results/.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Iterator
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

if not torch.cuda.is_available():  # the stub never launches a kernel: Triton backends' layers may be built
    os.environ.setdefault("TRITON_INTERPRET", "1")

import vattn  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks.bench_engine import PhaseTimer  # noqa: E402
from examples import engine as engine_mod  # noqa: E402
from examples.engine import Engine, SamplingParams  # noqa: E402
from examples.model import DecoderForCausalLM, ModelConfig  # noqa: E402

BLOCK = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,64,256")
    p.add_argument("--steps", type=int, default=200, help="timed steps per batch size and round")
    p.add_argument("--rounds", type=int, default=5, help="rounds over the batch sizes")
    p.add_argument("--context", type=int, default=256, help="prompt tokens (spread over one block)")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--backend", default="TRITON_ATTN")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="100 steps, 2 rounds")
    args = p.parse_args(argv)
    args.batches = [int(b) for b in str(args.batches).split(",")]
    if args.quick:
        args.steps, args.rounds = min(args.steps, 100), min(args.rounds, 2)
    return args


class StubModel(DecoderForCausalLM):
    """A ``DecoderForCausalLM`` whose forward and LM head return preallocated tensors (its
    attention layers exist and are bound to the cache, so every host step of the engine runs)."""

    def setup_stub(self, max_tokens: int, device: torch.device) -> None:
        self._hidden = torch.zeros(max_tokens, self.config.hidden_size, device=device)
        self._logits = torch.zeros(max_tokens, self.config.vocab_size, device=device)
        self._logits[:, 7] = 1.0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self._hidden[: input_ids.shape[0]]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self._logits[: hidden.shape[0]]


def build(args: argparse.Namespace, batch: int) -> Engine:
    """An engine whose ``batch`` requests have prefilled and decode from now on."""
    device = torch.device(args.device)
    # Early requests decode while later ones prefill: none may finish before the last timed step.
    budget = max(512, batch)
    decode_steps = -(-batch * (args.context + BLOCK) // budget) + 20 + 2 * args.rounds * args.steps + 16
    max_len = args.context + BLOCK + decode_steps + 64
    cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=BLOCK))
    mc = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=args.layers,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=max_len)
    with vattn.set_current_vattn_config(cfg):
        model = StubModel(mc, attn_backend=args.backend).to(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kv = vattn.allocate_kv_cache(cfg, num_blocks=batch * -(-max_len // BLOCK) + 8, device=device, dtype=dtype)
    model.setup_stub(max(512, batch), device)
    engine = Engine(model, cfg, kv, device=device, max_num_batched_tokens=budget, max_num_seqs=batch)
    for i in range(batch):
        engine.add_request([1 + (j % 100) for j in range(args.context + i % BLOCK)],
                           SamplingParams(max_tokens=decode_steps))
    while engine.scheduler.waiting or any(r.num_computed_tokens < len(r.prompt_token_ids)
                                          for r in engine.scheduler.running):
        engine.step()
    for _ in range(20):
        engine.step()
    return engine


@contextlib.contextmanager
def _timed(engine: Engine, timer: PhaseTimer) -> Iterator[None]:
    """Time the parts of ``engine.step`` while inside (instance attributes, taken off on exit)."""
    sch = engine.scheduler
    parts = [(sch, "schedule", "schedule"), (engine, "_prepare", "prepare"),
             (engine.kv, "build_metadata", "build_metadata"), (sch, "update", "update"), (engine, "flush", "flush"),
             (engine.model, "compute_logits", "logits")]
    if hasattr(sch, "batch"):  # (an engine before vattn.InputBatch has no such part)
        parts.append((sch.batch, "prepare", "input_batch"))
    for owner, attr, name in parts:
        setattr(owner, attr, timer.wrap(name, getattr(owner, attr)))
    try:
        with mock.patch.object(engine_mod, "sample", timer.wrap("sample", engine_mod.sample)):
            yield
    finally:
        for owner, attr, _ in parts:
            delattr(owner, attr)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    env = common.env_info(args.device)
    # The host's speed drifts by tens of percent within seconds: the batch sizes take turns,
    # ``--rounds`` rounds of ``--steps`` steps each, and each figure is the median over all rounds.
    engines = {b: build(args, b) for b in common.progress(args.batches, "prefill")}
    times: dict[int, list[float]] = {b: [] for b in args.batches}
    rounds: dict[int, list[float]] = {b: [] for b in args.batches}
    timers = {b: PhaseTimer() for b in args.batches}
    for _ in common.progress(range(args.rounds), "rounds"):
        for batch, engine in engines.items():
            t_round = []
            for _ in range(args.steps):
                t = time.perf_counter()
                engine.step()
                t_round.append(time.perf_counter() - t)
            times[batch] += t_round
            rounds[batch].append(statistics.median(t_round))
            with _timed(engine, timers[batch]):
                for _ in range(args.steps // 2):
                    engine.step()
    rows = []
    for batch, engine in engines.items():
        engine.flush()
        rows.append({"batch": batch, "backend": args.backend, "layers": args.layers, "context": args.context,
                     "step_us": 1e6 * statistics.median(times[batch]),
                     "round_medians_us": [1e6 * x for x in rounds[batch]],
                     **{f"{k}_us": 1e3 * v for k, v in timers[batch].medians_ms().items()}})
    by = {r["batch"]: r["step_us"] for r in rows}
    summary: dict[str, Any] = {"steps": args.steps, "step_us": by}
    if 64 in by and 256 in by:
        summary["b256/b64"] = by[256] / by[64]
    path = common.write_results("host-step", {"benchmark": "host-step", "env": env, "summary": summary, "rows": rows},
                                path=common.result_path("host-step", env))
    for r in rows:
        phases = ", ".join(f"{k[:-3]} {v:.1f}" for k, v in r.items() if k.endswith("_us") and k not in ("step_us", "round_medians_us"))
        print(f"batch {r['batch']}: step {r['step_us']:.1f} us ({phases})")
    print(f"wrote {path}")
    return {"summary": summary, "rows": rows}


if __name__ == "__main__":
    main()

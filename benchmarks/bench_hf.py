#!/usr/bin/env python
"""transformers models on vattn (``vattn.integrations.transformers``), beside transformers itself.

Models: the Llama-3.2-1B, Qwen3-0.6B and Gemma-3-1B shapes (``examples/hf_model.py`` SHAPES),
random weights, bf16, built by transformers. For each model, batch size and prompt length it
measures ms per decode step and tokens/s for:

| impl | what runs |
| --- | --- |
| vattn-eager | the transformers model with ``attn_implementation="vattn"`` (``vt.wrap``), ``examples.engine.Engine``, eager |
| vattn-cudagraph-full | the same through ``vattn.compile`` + ``vattn.CUDAGraphRunner(mode=FULL_DECODE_ONLY)`` |
| example-cudagraph-full | (Llama shape only) ``examples/model.py``'s decoder with the same weights, the same way |
| hf-eager | transformers ``generate`` with its dynamic cache (sdpa attention) |
| hf-static-compile | ``generate`` with a ``StaticCache`` (transformers compiles the decode forward) |

vattn rows are engine steps (``bench_e2e.vattn_decode``: the period from one step's start to
the next, async scheduling) and ``/loop`` rows (``bench_e2e.DecodeLoop``: device-resident
decode, no per-step sync); transformers rows are ``(t(generate N+1) - t(generate 1)) / N``
(``bench_e2e.hf_decode``). Every compiled model is warmed up (compiled, graphs captured)
outside the timings. ``floor_ms`` = (weight bytes + KV bytes read, sliding layers reading their
window only) / the copy bandwidth measured in the same run. Row columns ``speedup_vs_hf_static``,
``speedup_vs_hf_eager`` (tokens/s ratios) and ``x_example`` (ms over ``example-cudagraph-full``'s,
same basis and batch). ``summary.targets`` checks issue 35's targets on the Llama shape: FULL
graphs >= 3x (batch 1) and >= 4x (batch 64) the static cache's tokens/s and <= 1.15x the
example model's step; eager <= 1.0x transformers eager's step at batch 1 and < 1.0x at batch 64.
Eager steps are host-bound and a host's speed drifts by tens of percent within seconds, so
vattn-eager and hf-eager are interleaved in ``--eager-rounds`` blocks of 12 steps each, every
step timed (``ModelBench.measure_eager_pair``): their rows are medians, and the eager targets
the medians of the per-block ratios (``x_hf_eager_paired``).

    PYTHONPATH=$PWD python benchmarks/bench_hf.py --quick                      # Llama shape, batch 1 and 64 (< 9 min)
    PYTHONPATH=$PWD python benchmarks/bench_hf.py --models qwen3-0.6b --name hf-qwen3   # one model per call (< 10 min)
    PYTHONPATH=$PWD python benchmarks/bench_hf.py --device cpu --dtype float32 --models tiny-llama \\
        --batches 1,2 --context 16 --new-tokens 4 --reps 1                      # CPU smoke run

Order of work per model: impl by impl (as ``IMPLS`` lists them), batch sizes within each, so
every compile and capture is paid once. Writes ``<name>-<device>-<date>.json`` (default name
``hf``) and its PNG to $OUT (if set) or benchmarks/results/ after every job; ``--time-budget-s``
(counted from process start) skips jobs that would end past the budget (the row says so). The
three models take about 25 minutes together: run them one per call where a call is limited.
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()  # the time budget counts from process start, imports included

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

if __package__ in (None, ""):  # run as a script: make `benchmarks`, `examples` and `vattn` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import vattn  # noqa: E402
from benchmarks import common, roofline  # noqa: E402
from benchmarks.bench_e2e import DecodeLoop, VattnImpls, hf_decode, say  # noqa: E402
from examples.gemv import OneTokenGemv, gemv_lm_head  # noqa: E402
from examples.hf_model import FAMILIES, SHAPES, random_model, shape_config, tiny_config  # noqa: E402
from examples.engine import Engine, SamplingParams  # noqa: E402
from examples.model import DecoderForCausalLM  # noqa: E402

BLOCK = 16
#: Decode steps per interleaved block of the eager comparison (``ModelBench.measure_eager_pair``).
EAGER_BLOCK_STEPS = 12
IMPLS = ("vattn-cudagraph-full", "example-cudagraph-full", "vattn-eager", "hf-static-compile", "hf-eager")
MODELS = (*SHAPES, *(f"tiny-{f}" for f in FAMILIES))
#: Seconds a job is assumed to take before one of its impl ran (compile / capture included).
DEFAULT_ESTIMATE_S = {"vattn-cudagraph-full": 120.0, "example-cudagraph-full": 90.0, "vattn-eager": 20.0,
                      "hf-static-compile": 60.0, "hf-eager": 20.0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the Llama shape only, 32 new tokens, 2 repeats")
    p.add_argument("--models", default=None, help=f"comma-separated, of {', '.join(MODELS)} (default: the 3 shapes; "
                                                  "--quick: llama-3.2-1b)")
    p.add_argument("--name", default="hf", help="result name: the JSON is <name>-<device>-<date>.json")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--context", type=int, default=512, help="prompt length")
    p.add_argument("--new-tokens", type=int, default=None, help="timed decode steps (default 64; --quick 32)")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated, of {', '.join(IMPLS)}")
    p.add_argument("--backend", default=None, help="force a vattn backend by name")
    p.add_argument("--compile-sizes", default="1", help="CompilationConfig.compile_sizes (\"\" for none)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--reps", type=int, default=None, help="transformers repeats per timing (default 3; --quick 2)")
    p.add_argument("--time-budget-s", type=float, default=None, help="default 560 (--quick 500)")
    p.add_argument("--eager-rounds", type=int, default=10,
                   help="vattn-eager and hf-eager interleaved in this many blocks of 12 decode steps each per batch "
                        "(their rows: medians; the eager targets: the median of the per-block ratios); 1: measured "
                        "once each, in impl order, as the other impls")
    p.add_argument("--sync-scheduling", action="store_true", help="engine rows sync every step")
    p.add_argument("--no-loop", action="store_true", help="skip the device-resident decode loop rows")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda", help="cuda (the benchmark); cpu only to smoke-test the script")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = p.parse_args(argv)
    args.models = [m for m in (args.models or ("llama-3.2-1b" if args.quick else ",".join(SHAPES))).split(",") if m]
    args.impls = [i for i in args.impls.split(",") if i]
    args.batches = [int(x) for x in args.batches.split(",")]
    args.contexts = [args.context]  # bench_e2e.VattnImpls reads it
    for what, got, known in (("--models", args.models, MODELS), ("--impls", args.impls, IMPLS)):
        if any(x not in known for x in got):
            p.error(f"{what}: unknown {[x for x in got if x not in known]}; choose from {list(known)}")
    args.new_tokens = args.new_tokens or (32 if args.quick else 64)
    args.reps = args.reps or (2 if args.quick else 3)
    args.time_budget_s = args.time_budget_s or (500.0 if args.quick else 560.0)
    return args


def model_config(name: str, max_len: int) -> Any:
    if name.startswith("tiny-"):
        return tiny_config(name[len("tiny-"):], max_position_embeddings=max(512, max_len))
    return shape_config(name)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters a decode step reads (a shared tensor once; an untied embedding table not at all)."""
    tied = getattr(model.config, "tie_word_embeddings", False)
    seen: dict[int, int] = {}
    for name, p in model.named_parameters():
        if name.endswith("embed_tokens.weight") and not tied:
            continue
        seen[p.data_ptr()] = p.numel() * p.element_size()
    return sum(seen.values())


def kv_bytes(specs: Any, batch: int, kv_len: float, elem: int) -> float:
    """Bytes of K and V a decode step reads: every layer, a sliding layer its window only."""
    return batch * sum(2 * s.num_kv_heads * s.head_size * elem * min(kv_len, s.sliding_window or kv_len)
                       for s in specs)


class ModelBench:
    """One model's transformers original, its vattn wrap and (Llama) the example model, with KV caches."""

    def __init__(self, name: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype,
                 report: dict[str, Any]) -> None:
        from vattn.integrations import transformers as vt

        budget = args.max_num_batched_tokens
        per_req = (args.context + 2 * args.new_tokens + math.ceil(max(args.batches) * args.context / budget) + 16
                   + (args.eager_rounds + 1) * (EAGER_BLOCK_STEPS + 1) + 8)  # + the interleaved eager blocks
        self.max_model_len = per_req + 16
        self.hf = random_model(model_config(name, self.max_model_len), dtype=dtype, device=device, seed=args.seed,
                               std=0.02, attn_implementation="sdpa")
        num_blocks = max(args.batches) * math.ceil(per_req / BLOCK) + 16
        cfg = self._config(args)
        with vattn.global_force_attn_backend_context_manager(args.backend):
            self.model = vt.wrap(copy.deepcopy(self.hf), cfg)
        gemv_lm_head(self.model)  # a 1-row LM head on the GEMV, as the example model's
        self.kv = vattn.allocate_kv_cache(cfg, num_blocks=num_blocks, device=device, dtype=dtype)
        self.impls = VattnImpls(self.model, cfg, self.kv, args, self.max_model_len, report)
        self.example = None
        if "example-cudagraph-full" in args.impls and self.hf.config.model_type == "llama" and not any(
                s.sliding_window for s in self.model.layer_specs):
            ex_cfg = self._config(args)
            old = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            try:
                with vattn.global_force_attn_backend_context_manager(args.backend), \
                        vattn.set_current_vattn_config(ex_cfg), torch.device(device):
                    example = DecoderForCausalLM.from_hf_config(self.hf.config)
            finally:
                torch.set_default_dtype(old)
            example.load_hf_state_dict(self.hf.state_dict())
            ex_kv = vattn.allocate_kv_cache(ex_cfg, num_blocks=num_blocks, device=device, dtype=dtype)
            self.example = VattnImpls(example.eval(), ex_cfg, ex_kv, args, self.max_model_len, {"cudagraph": {}})
        self.backend = next(iter(cfg.attention_layers().values())).attn_backend.get_name()

    @staticmethod
    def _config(args: argparse.Namespace) -> vattn.VattnConfig:
        return vattn.VattnConfig(cache=vattn.CacheConfig(block_size=BLOCK), compilation=vattn.CompilationConfig(
            compile_sizes=common.token_counts(args.compile_sizes), piece_passes=(OneTokenGemv(),)))

    def measure_eager_pair(self, batch: int, args: argparse.Namespace
                           ) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any]]:
        """vattn-eager and hf-eager interleaved: ``args.eager_rounds`` blocks of each (ABBA order),
        every block ``EAGER_BLOCK_STEPS`` decode steps timed one by one. Returns (vattn figures,
        its ``/loop`` figures (one ``DecodeLoop`` run, not interleaved) or None, transformers
        figures); ``ms_per_step`` is the median over every timed step, ``blocks_ms`` each block's
        median, and the vattn row's ``x_hf_eager_paired`` the median of the per-block-pair ratios.

        Eager steps are host-bound, and a host's speed drifts by tens of percent within seconds:
        blocks of a fraction of a second, side by side, compare the two under the same host. A
        vattn step is the period between engine step starts (async scheduling); a transformers
        step is the period between two calls of a logits processor that ``generate`` runs once
        per new token (forward, sampling and bookkeeping between them)."""
        import transformers

        steps, blocks = EAGER_BLOCK_STEPS, args.eager_rounds
        device = self.hf.device
        g = torch.Generator().manual_seed(args.seed)
        prompts = torch.randint(0, self.hf.config.vocab_size, (batch, args.context), generator=g)
        r, _ = self.impls.runner("vattn-eager")
        engine = Engine(self.model, self.impls.cfg, self.kv, device=device,
                        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=batch, seed=args.seed,
                        async_scheduling=not args.sync_scheduling, **r)
        for row in prompts.tolist():
            engine.add_request(row, SamplingParams(max_tokens=(blocks + 1) * (steps + 1) + 8))  # + the warm-up block
        while engine.scheduler.waiting or any(q.num_computed_tokens < len(q.prompt_token_ids)
                                              for q in engine.scheduler.running):
            engine.step()  # prefill (chunked where the budget says so)

        class Stamps(transformers.LogitsProcessor):
            def __init__(self) -> None:
                self.t: list[float] = []

            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
                self.t.append(time.perf_counter())
                return scores

        ids, mask = prompts.to(device), torch.ones(batch, args.context, dtype=torch.long, device=device)

        def hf_block() -> list[float]:
            stamps = Stamps()
            self.hf.generate(ids, attention_mask=mask, max_new_tokens=steps + 1, min_new_tokens=steps + 1,
                             do_sample=False, pad_token_id=0, logits_processor=transformers.LogitsProcessorList([stamps]))
            return [b - a for a, b in zip(stamps.t, stamps.t[1:])]

        def vattn_block() -> list[float]:
            t = []
            for _ in range(steps + 1):
                t.append(time.perf_counter())
                engine.step()
            return [b - a for a, b in zip(t, t[1:])]

        hf_block(), vattn_block()  # warm-up
        per: dict[str, list[list[float]]] = {"vattn": [], "hf": []}
        for i in range(blocks):
            for name in (("vattn", "hf") if i % 2 == 0 else ("hf", "vattn")):
                per[name].append(vattn_block() if name == "vattn" else hf_block())
        engine.flush()
        loop = None
        if not args.no_loop:
            loop, _ = DecodeLoop(engine, r, args.new_tokens + 4).run()

        def figures(times: list[list[float]]) -> dict[str, Any]:
            ms = 1e3 * statistics.median([x for b in times for x in b])
            return {"ms_per_step": ms, "tok_s": batch * 1e3 / ms, "decode_steps": sum(map(len, times)),
                    "blocks_ms": [1e3 * statistics.median(b) for b in times]}

        v, h = figures(per["vattn"]), figures(per["hf"])
        v["x_hf_eager_paired"] = statistics.median(a / b for a, b in zip(v["blocks_ms"], h["blocks_ms"]))
        return v, loop, h

    def measure(self, impl: str, batch: int, args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """(engine-step or transformers figures, ``/loop`` figures or None)."""
        if impl.startswith("hf-"):
            return hf_decode(self.hf, batch, args.context, args.new_tokens, impl == "hf-static-compile",
                             args.reps, args.seed), None
        if impl == "example-cudagraph-full":
            if self.example is None:
                raise RuntimeError("the example-model rows run for Llama configs only (the issue's comparison; "
                                   "examples/model.py has no sliding-window layers)")
            return self.example.measure("vattn-cudagraph-full", batch, args.context)
        return self.impls.measure(impl, batch, args.context)


def annotate(rows: list[dict[str, Any]]) -> None:
    """``speedup_vs_hf_static`` / ``speedup_vs_hf_eager`` (tokens/s ratios) and ``x_example`` (ms ratio,
    same basis) for every vattn row, against the rows of the same model and batch."""
    tok = {(r["model"], r["impl"], r["batch"]): r["tok_s"] for r in rows if r.get("tok_s")}
    ms = {(r["model"], r["impl"], r["batch"]): r["ms_per_step"] for r in rows if r.get("ms_per_step")}
    for r in rows:
        if not r.get("tok_s") or r["impl"].startswith("hf-"):
            continue
        for impl, col in (("hf-static-compile", "speedup_vs_hf_static"), ("hf-eager", "speedup_vs_hf_eager")):
            ref = tok.get((r["model"], impl, r["batch"]))
            if ref:
                r[col] = r["tok_s"] / ref
        loop = "/loop" if r["impl"].endswith("/loop") else ""
        ex = ms.get((r["model"], "example-cudagraph-full" + loop, r["batch"]))
        if ex and not r["impl"].startswith("example-"):
            r["x_example"] = r["ms_per_step"] / ex


def targets(rows: list[dict[str, Any]], batches: list[int]) -> list[dict[str, Any]]:
    """Issue 35's targets on the Llama shape (engine steps, and ``/loop`` rows where both sides have them)."""
    find = {(r["model"], r["impl"], r["batch"]): r for r in rows if r.get("ms_per_step")}
    out: list[dict[str, Any]] = []
    model = "llama-3.2-1b" if any(r["model"] == "llama-3.2-1b" for r in rows) else rows[0]["model"] if rows else ""
    for loop, basis in (("", "engine step"), ("/loop", "decode loop")):
        checks = [(f"vattn FULL tok/s / hf-static-compile b{b}", "vattn-cudagraph-full" + loop, "hf-static-compile",
                   b, g, ">=") for b, g in ((1, 3.0), (64, 4.0))]
        checks += [(f"vattn FULL ms / example FULL ms b{b}", "vattn-cudagraph-full" + loop,
                    "example-cudagraph-full" + loop, b, 1.15, "<=") for b in batches]
        checks += [("vattn eager ms / hf-eager ms b1", "vattn-eager" + loop, "hf-eager", 1, 1.0, "<="),
                   ("vattn eager ms / hf-eager ms b64 (faster)", "vattn-eager" + loop, "hf-eager", 64, 1.0, "<")]
        for name, impl, ref_impl, batch, goal, op in checks:  # ">=": a tokens/s ratio; else an ms ratio
            if batch not in batches:
                continue
            a, b = find.get((model, impl, batch)), find.get((model, ref_impl, batch))
            value = None if not (a and b) else (
                a["tok_s"] / b["tok_s"] if op == ">=" else a.get("x_hf_eager_paired", a["ms_per_step"] / b["ms_per_step"]))
            met = None if value is None else {">=": value >= goal, "<=": value <= goal, "<": value < goal}[op]
            paired = a is not None and "x_hf_eager_paired" in a
            out.append({"target": f"{model}: {name}", "basis": basis + (", interleaved blocks" if paired else ""),
                        "value": value, "goal": f"{op} {goal}", "met": met, "rows": f"{impl} vs {ref_impl}"})
    return out


def plot(path: Path, rows: list[dict[str, Any]], title: str) -> Path | None:
    """Per model: ms per decode step vs batch per impl, engine steps and decode loop side by side."""
    panels = []
    for model in dict.fromkeys(r["model"] for r in rows):
        for loop in (False, True):
            series: dict[str, tuple[list[float], list[float]]] = {}
            for r in rows:
                keep = r["impl"].endswith("/loop") == loop or r["impl"].startswith("hf-")
                if r["model"] == model and keep and r.get("ms_per_step"):
                    xs, ys = series.setdefault(r["impl"], ([], []))
                    xs.append(r["batch"])
                    ys.append(r["ms_per_step"])
            panels.append({"title": f"{model}: ms per decode step ({'decode loop' if loop else 'engine step'})",
                           "xlabel": "batch", "ylabel": "ms/step", "logx": True, "series": series})
    return common.plot_panels(path, panels, title=title, ncols=2)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_hf.py needs a CUDA GPU (run it on the device machine), or --device cpu to smoke-test.")
    env = common.env_info(device)
    path = common.result_path(args.name, env)
    roof = roofline.measure(device, quick=True, tiny=device.type != "cuda")
    elem = torch.tensor([], dtype=dtype).element_size()
    rows: list[dict[str, Any]] = []
    plots: list[str] = []
    report: dict[str, Any] = {
        "models": args.models, "dtype": str(dtype), "context": args.context, "new_tokens": args.new_tokens,
        "block_size": BLOCK, "max_num_batched_tokens": args.max_num_batched_tokens, "quick": args.quick,
        "async_scheduling": not args.sync_scheduling, "compile_sizes": args.compile_sizes,
        "time_budget_s": args.time_budget_s, "roofline": roof.to_dict(), "model_facts": {}, "cudagraph": {},
        "targets": {}, "target_checks": [], "skipped": {}, "partial": True,
        "notes": ["vattn rows: engine steps (period between step starts, async scheduling); /loop rows: "
                  "bench_e2e.DecodeLoop; hf rows: (t(generate N+1) - t(generate 1)) / N, medians over --reps",
                  "x_example: ms_per_step over example-cudagraph-full's at the same batch and basis"],
    }

    def write(redraw: bool) -> None:
        annotate(rows)
        report["target_checks"] = targets(rows, args.batches)
        report["targets"] = {f"{c['target']} ({c['basis']})": (
            "not measured" if c["value"] is None else f"{c['value']:.3g} ({c['goal']}: {'met' if c['met'] else 'NOT met'})")
            for c in report["target_checks"]}
        if redraw and not args.no_plot:
            png = plot(path.with_suffix(".png"), rows, f"transformers models on vattn, {args.dtype}, prompt "
                                                       f"{args.context} ({env['device_name']})")
            plots[:] = [png.name] if png is not None else []
        common.write_results(args.name, {"env": env, "summary": report, "rows": rows, "plots": plots}, path=path)

    estimates: dict[str, float] = {}
    for name in args.models:
        try:
            bench = ModelBench(name, args, device, dtype, report)
        except Exception as e:  # a model that cannot be built: its rows say why
            traceback.print_exc()
            report["skipped"][name] = f"build: {type(e).__name__}: {e}"[:800]
            continue
        wbytes = weight_bytes(bench.hf)
        report["model_facts"][name] = {"weight_bytes": wbytes, "backend": bench.backend,
                                       "layers": len(bench.model.layer_specs),
                                       "sliding_layers": sum(bool(s.sliding_window) for s in bench.model.layer_specs)}
        pair = args.eager_rounds > 1 and {"vattn-eager", "hf-eager"} <= set(args.impls)
        for impl in args.impls:  # impl-major: each compile and capture is paid once, before its rows
            if pair and impl == "hf-eager":
                continue  # measured in blocks interleaved with vattn-eager's
            for batch in args.batches:
                row: dict[str, Any] = {"model": name, "impl": impl, "batch": batch, "context": args.context}
                loop = hf_row = None
                elapsed, t_job = time.perf_counter() - _T0, time.perf_counter()
                estimate = estimates.get(impl, DEFAULT_ESTIMATE_S[impl])
                if pair and impl == "vattn-eager":
                    estimate += DEFAULT_ESTIMATE_S["hf-eager"] + 2.0 * args.eager_rounds  # both impls, every block
                try:
                    if elapsed + estimate > args.time_budget_s:
                        row["skipped"] = (f"time budget: {elapsed:.0f} s used + about {estimate:.0f} s for this job "
                                          f"> {args.time_budget_s:.0f} s (--time-budget-s)")
                    elif pair and impl == "vattn-eager":
                        figures, loop, hf = bench.measure_eager_pair(batch, args)
                        row.update(figures)
                        hf_row = {**{k: row[k] for k in ("model", "batch", "context")}, "impl": "hf-eager", **hf}
                    else:
                        figures, loop = bench.measure(impl, batch, args)
                        row.update(figures)
                except torch.cuda.OutOfMemoryError as e:
                    row["skipped"] = f"out of memory: {str(e).splitlines()[0]}"
                except Exception as e:  # keep measuring the other rows; the error is in the JSON
                    traceback.print_exc()
                    row["error"] = f"{type(e).__name__}: {e}"[:800]
                if "ms_per_step" in row:
                    estimates[impl] = max(estimates.get(impl, 0.0), time.perf_counter() - t_job - row.get("setup_s", 0))
                if "skipped" in row or "error" in row:
                    report["skipped"][f"{name}/{impl}/b{batch}"] = row.get("skipped") or row.get("error")
                new = [row] + ([{**{k: row[k] for k in ("model", "batch", "context")}, "impl": impl + "/loop", **loop}]
                               if loop is not None else []) + ([hf_row] if hf_row is not None else [])
                for rr in new:
                    if rr.get("ms_per_step"):
                        nbytes = wbytes + kv_bytes(bench.model.layer_specs, batch, rr.get("kv_len", args.context), elem)
                        rr["floor_ms"] = 1e3 * nbytes / (roof.copy_tbps * 1e12)
                        rr["x_floor"] = rr["ms_per_step"] / rr["floor_ms"]
                    rows.append(rr)
                    say(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rr.items()}))
                write(redraw="ms_per_step" in row)
        del bench
        common.free_memory()

    report["wall_s"], report["partial"] = time.perf_counter() - _T0, False
    write(redraw=True)
    print(f"wrote {path}" + (f" and {plots[0]}" if plots else ""))
    table = common.Table(["model", "impl", "batch", "ms_per_step", "tok_s", "x_floor", "speedup_vs_hf_static",
                          "x_example", "host_ms", "skipped", "error"], title="transformers models on vattn")
    table.extend(rows)
    table.print()
    tt = common.Table(["target", "basis", "value", "goal", "met", "rows"], title="targets (issue 35)")
    tt.extend(report["target_checks"])
    tt.print()
    return {"env": env, "summary": report, "rows": rows}


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""fp8 KV cache decode step: fused (vattn's fp8 passes) vs unfused (passes off) vs a bf16 KV cache.

Model: the Llama-3.2-1B shape (``examples.model`` preset ``llama-3.2-1b``: 16 layers, hidden
2048, 32 q / 8 KV heads, head dim 64), random weights, bf16 activations. One decode step of
``--batch`` requests (default 64), each with ``--context`` tokens (default 4096) already in
the paged cache (random values), one new token each. For each backend (TRITON_ATTN, FLASHINFER):

| variant | KV cache | ``cfg.compilation.passes`` |
| --- | --- | --- |
| bf16 | bf16 | noop_elimination, query_quant_fusion, defunctionalize |
| fp8-unfused | fp8 (e4m3) | none |
| fp8-fused | fp8 (e4m3) | noop_elimination, query_quant_fusion, defunctionalize |

all through ``vattn.compile`` (split at attention, Inductor per piece). Per row:

* ``ms_graph``: the step captured in one CUDA graph, replays timed (``common.bench_cuda_graph``):
  GPU time only, no launch overhead;
* ``ms_launch``: the compiled step launched from Python (``common.bench``, GPU timeline);
* ``kernels_per_step`` / ``kernels_per_layer``: CUDA kernels in a torch-profiler trace of one
  step (memcpy / memset excluded), and ``quant_kernels``: launches of the standalone q-quant kernel
  (``vattn.kernels.quant_fp8``);
* ``max_diff_vs_unfused``: max |hidden| difference to the fp8-unfused step (same backend).

``summary.targets``: per backend, the fused fp8 step is faster than the bf16 step
(``ms_graph``), and the passes remove one kernel launch per layer (unfused - fused kernels ==
num_layers; TRITON_ATTN only: FLASHINFER reads the bf16 query, so its layer never quantizes q
and there is nothing to remove). ``attn_quant_fusion`` is left out: it needs the attention op
inside the Inductor graph (``splitting_ops=()``), and this model has no fp8 consumer of the
attention output.

    PYTHONPATH=$PWD python benchmarks/bench_fp8.py            # both backends (< 5 min on an H200)
    PYTHONPATH=$PWD python benchmarks/bench_fp8.py --quick    # 4 layers, context 1024
    PYTHONPATH=$PWD python benchmarks/bench_fp8.py --device cpu --quick --preset tiny --batch 4 --backends TORCH_SDPA

Writes ``fp8-<device>-<date>.json`` (``benchmarks.common.write_results``) to $OUT or
benchmarks/results/ after every row.
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import vattn  # noqa: E402
from benchmarks import common  # noqa: E402
from examples.model import DecoderForCausalLM, get_preset, init_random_weights  # noqa: E402

PASSES = ("noop_elimination", "query_quant_fusion", "defunctionalize")
VARIANTS = {"bf16": ("auto", PASSES), "fp8-unfused": ("fp8", ()), "fp8-fused": ("fp8", PASSES)}
BLOCK = 16


def say(msg: str) -> None:
    print(f"[bench_fp8 {time.perf_counter() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", nargs="+", default=["TRITON_ATTN", "FLASHINFER"])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--preset", default="llama-3.2-1b", help="examples.model preset (tiny: CPU smoke runs)")
    ap.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="4 layers, context 1024, short timings")
    ap.add_argument("--time-budget-s", type=float, default=280.0)
    args = ap.parse_args(argv)
    if args.quick:
        args.layers = args.layers or 4
        args.context = min(args.context, 1024)
    return args


class Step:
    """One decode step of ``batch`` requests at ``context`` tokens, through ``vattn.compile`` (``passes``)."""

    def __init__(self, model: DecoderForCausalLM, cfg: vattn.VattnConfig, kv: vattn.PagedKVCache,
                 passes: tuple[str, ...], batch: int, context: int, seed: int) -> None:
        self.cfg = dataclasses.replace(cfg, compilation=dataclasses.replace(cfg.compilation, passes=passes))
        torch._dynamo.reset()
        self.compiled = vattn.compile(model, self.cfg)
        per = math.ceil(context / BLOCK)
        tables = [list(range(1 + i * per, 1 + (i + 1) * per)) for i in range(batch)]
        common_md = kv.common_metadata([1] * batch, [context - 1] * batch, tables)
        dev = kv.tensors[next(iter(kv.tensors))].device
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.ids = torch.randint(0, model.config.vocab_size, (batch,), generator=g).to(dev)
        self.positions = torch.full((batch,), context - 1, dtype=torch.long, device=dev)
        # Metadata in the builders' persistent (CUDA-graph) buffers, valid for every replay.
        self.md = (kv.build_metadata_for_cudagraph_capture(common_md) if dev.type == "cuda"
                   else kv.build_metadata(common_md))

    def __call__(self) -> torch.Tensor:
        with vattn.set_forward_context(self.md, self.cfg):
            return self.compiled(self.ids, self.positions)


def count_kernels(fn: Callable[[], Any], device: torch.device) -> list[str]:
    """Names of the CUDA kernels one call of ``fn`` launches (torch profiler; memcpy/memset excluded)."""
    if device.type != "cuda":
        return []
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
    return [n for n in names if not n.lower().startswith(("memcpy", "memset"))]


def build(args: argparse.Namespace, backend: str, cache_dtype: str, device: torch.device
          ) -> tuple[DecoderForCausalLM, vattn.VattnConfig, vattn.PagedKVCache]:
    overrides: dict[str, Any] = {"max_position_embeddings": args.context + 64}
    if args.layers:
        overrides["num_hidden_layers"] = args.layers
    mcfg = get_preset(args.preset, **overrides)
    cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=BLOCK, cache_dtype=cache_dtype))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with vattn.set_current_vattn_config(cfg), torch.device(device):
            model = DecoderForCausalLM(mcfg, attn_backend=backend).eval()
    finally:
        torch.set_default_dtype(old)
    init_random_weights(model, seed=args.seed)
    num_blocks = 1 + args.batch * math.ceil(args.context / BLOCK)
    kv = vattn.allocate_kv_cache(cfg, num_blocks=num_blocks, device=device, dtype=dtype)
    for i, (name, t) in enumerate(kv.tensors.items()):
        if t.dtype == torch.uint8:  # a byte-typed fp8 cache: fill through its fp8 view
            t = t.view(torch.float8_e4m3fn)
        k, v = common.split_kv_cache(t, num_blocks)
        common.fill_random_kv_(k, v, seed=args.seed + i)
    if cache_dtype.startswith("fp8"):
        for layer in (m for m in model.modules() if isinstance(m, vattn.Attention)):
            layer.set_kv_scales(0.05, 0.05, q_scale=0.05)  # cache holds N(0, 1) codes: values ~ N(0, 0.05^2)
    return model, cfg, kv


def measure(step: Step, device: torch.device, quick: bool) -> dict[str, Any]:
    out = step()  # compiles
    row: dict[str, Any] = {}
    kernels = count_kernels(step, device)
    row["kernels_per_step"] = len(kernels) if device.type == "cuda" else None
    row["quant_kernels"] = sum("_static_fp8_quant_kernel" in k for k in kernels) if device.type == "cuda" else None
    if device.type == "cuda":
        row["_kernel_names"] = dict(Counter(common._short_kernel_name(k) for k in kernels).most_common())
    rep = 50 if quick else 200
    row["ms_launch"] = common.bench(step, warmup=10, rep=rep, device=device)["median_ms"]
    if device.type == "cuda":
        try:
            row["ms_graph"] = common.bench_cuda_graph(step, warmup=10, rep=rep)["median_ms"]
        except Exception as e:  # a backend that cannot be captured this way still gets its launch timing
            row["ms_graph"] = None
            row["graph_error"] = f"{type(e).__name__}: {e}"[:300]
    row["matches"] = ",".join(f"{k}={v}" for k, v in step.compiled.backend.pass_manager.matches.items())
    row["_out"] = out.float()
    return row


def targets(rows: list[dict[str, Any]], num_layers: int) -> list[dict[str, Any]]:
    checks = []
    for backend in sorted({r["backend"] for r in rows}):
        by = {r["variant"]: r for r in rows if r["backend"] == backend}
        fused, unfused, bf16 = by.get("fp8-fused"), by.get("fp8-unfused"), by.get("bf16")
        if fused and bf16 and fused.get("ms_graph") and bf16.get("ms_graph"):
            checks.append({"backend": backend, "target": "fused fp8 step faster than the bf16 step",
                           "fused_ms": fused["ms_graph"], "bf16_ms": bf16["ms_graph"],
                           "met": fused["ms_graph"] < bf16["ms_graph"]})
        if fused and unfused and fused.get("kernels_per_step") is not None:
            removed = unfused["kernels_per_step"] - fused["kernels_per_step"]
            expect = num_layers if backend != "FLASHINFER" else 0
            checks.append({"backend": backend, "target": "passes remove one kernel launch per layer"
                           if expect else "no q quant to remove (bf16 query)", "removed": removed,
                           "num_layers": num_layers, "met": removed >= expect})
    return checks


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_fp8.py needs a CUDA GPU (run it on the device machine), or --device cpu --quick.")
    env = common.env_info(device)
    path = common.result_path("fp8", env)
    rows: list[dict[str, Any]] = []
    summary: dict[str, Any] = {"preset": args.preset, "batch": args.batch, "context": args.context,
                               "passes": list(PASSES),
                               "skipped": [], "errors": []}
    num_layers = args.layers or get_preset(args.preset).num_hidden_layers

    def write() -> None:
        summary["targets"] = targets(rows, num_layers)
        summary["elapsed_s"] = round(time.perf_counter() - _T0, 1)
        common.write_results("fp8", {"env": env, "summary": summary,
                                     "rows": [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]},
                             path=path)

    jobs = [(b, v) for b in args.backends for v in VARIANTS]
    for backend, variant in common.progress(jobs, desc="fp8 decode step"):
        cache_dtype, passes = VARIANTS[variant]
        if time.perf_counter() - _T0 > args.time_budget_s:
            summary["skipped"].append(f"{backend}/{variant}: time budget ({args.time_budget_s}s) used up")
            continue
        model = kv = step = None
        try:
            t0 = time.perf_counter()
            model, cfg, kv = build(args, backend, cache_dtype, device)
            step = Step(model, cfg, kv, passes, args.batch, args.context, args.seed)
            row = {"backend": backend, "variant": variant, "kv_cache": cache_dtype, "passes": ",".join(passes) or "off",
                   "batch": args.batch, "context": args.context, "num_layers": num_layers}
            row.update(measure(step, device, args.quick))
            if row.get("kernels_per_step") is not None:
                row["kernels_per_layer"] = row["kernels_per_step"] / num_layers
            ref = next((r for r in rows if r["backend"] == backend and r["variant"] == "fp8-unfused"), None)
            if ref is not None and variant == "fp8-fused":
                row["max_diff_vs_unfused"] = (row["_out"] - ref["_out"]).abs().max().item()
            row["setup_s"] = round(time.perf_counter() - t0, 1)
            if "_kernel_names" in row:
                summary.setdefault("kernel_names", {})[f"{backend}/{variant}"] = row["_kernel_names"]
            rows.append(row)
            say(f"{backend:12s} {variant:12s} graph {row.get('ms_graph')} ms, launch {row['ms_launch']:.3f} ms, "
                f"kernels {row.get('kernels_per_step')} (quant {row.get('quant_kernels')}), matches {row['matches']}")
        except Exception as e:  # keep what was measured; the next backend may still run
            summary["errors"].append(f"{backend}/{variant}: {type(e).__name__}: {e}"[:600])
            traceback.print_exc()
        finally:
            del model, kv, step
            torch._dynamo.reset()
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        write()
    for r in rows:
        r.pop("_out", None)
    write()
    table = common.Table(["backend", "variant", "ms_graph", "ms_launch", "kernels_per_step", "kernels_per_layer",
                          "quant_kernels", "max_diff_vs_unfused"], title=f"fp8 decode step ({env['device_name']})")
    table.extend(rows)
    table.print()
    for c in summary["targets"]:
        print(c)
    print(f"wrote {path}")
    return {"rows": rows, "summary": summary, "path": str(path)}


if __name__ == "__main__":
    main()

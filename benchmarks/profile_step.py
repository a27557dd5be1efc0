#!/usr/bin/env python
"""Where a decode step's time goes: GPU kernels of a FULL CUDA-graph step, and host time, per backend.

Model: the Llama-3.2-1B shape (``examples/model.py``, random weights, bf16, random KV cache,
every request at ``--context`` cached tokens) through ``vattn.compile`` and a
``CUDAGraphRunner`` in ``FULL_DECODE_ONLY`` mode. Per backend and batch size:

| figure | meaning |
| --- | --- |
| ``replay_ms`` | the captured full graph replayed alone (GPU time of the forward) |
| ``step_ms`` | a whole step: metadata build, padding, replay, LM head (GPU timeline, CUDA events) |
| ``host_ms`` | CPU time to issue one step (timed before the final sync) |
| ``kernels_per_step`` / ``kernel_ms`` | kernels in one replay and the sum of their durations (profiler) |

``--mode PIECEWISE --host-profile 200`` adds, per backend and batch, the host functions that
take a step's time (cProfile: own and cumulative microseconds per step).

The per-kernel table of each replay (name, launches per step, ms per step) is under
``summary.kernel_profiles``. Backend names: ``FLASHINFER-cudacore`` is FLASHINFER with
``VATTN_FLASHINFER_DECODE_TENSOR_CORES=0``; ``auto`` is the platform's choice.

    PYTHONPATH=$PWD python benchmarks/profile_step.py                         # auto, FLASHINFER-cudacore, TRITON_ATTN, FLASH_ATTN
    PYTHONPATH=$PWD python benchmarks/profile_step.py --backends TRITON_ATTN --batches 1 --layers 2
    PYTHONPATH=$PWD python benchmarks/profile_step.py --backends TRITON_ATTN --gemv on off     # OneTokenGemv A/B

In one process a second model times a little slower than the first (about 0.07 ms a step on
an H100, at batch 64 too, where the variants do not differ): compare variants in separate
processes or in both orders.

Writes ``profile-<device>-<date>.json`` to $OUT (if set) or benchmarks/results/ after each backend.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import vattn  # noqa: E402
from benchmarks import bench_compile, common  # noqa: E402

BACKENDS = ("auto", "FLASHINFER-cudacore", "TRITON_ATTN", "FLASH_ATTN")


def run_backend(name: str, args: argparse.Namespace, gemv: str = "on") -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rows (one per batch size) and kernel tables for one backend; ``gemv``: ``examples.gemv.OneTokenGemv``
    on or off."""
    backend = None if name == "auto" else name.split("-")[0]
    if name.endswith("-cudacore"):
        os.environ["VATTN_FLASHINFER_DECODE_TENSOR_CORES"] = "0"
    else:
        os.environ.pop("VATTN_FLASHINFER_DECODE_TENSOR_CORES", None)
    per = -(-(args.context + 8) // bench_compile.BLOCK)
    model, cfg, kv = bench_compile.build(args.layers, backend, num_blocks=max(args.batches) * per + 8,
                                         max_pos=max(8192, args.context + 16),
                                         compile_sizes=common.token_counts(args.compile_sizes),
                                         inductor_config=json.loads(args.inductor_config), one_token_gemv=gemv == "on")
    name = name if gemv == "on" else f"{name}+no-gemv"
    compiled = vattn.compile(model, cfg, dynamic=args.dynamic)
    runner = vattn.CUDAGraphRunner(compiled, cfg, kv, capture_sizes=tuple(args.batches),
                                   mode=vattn.CUDAGraphMode[args.mode], show_progress=False)
    chosen = type(kv.groups[0].builder).__name__
    rows, tables = [], {}
    for b in args.batches:
        ids, pos, cm = bench_compile.decode_batch(kv, b, args.context, seed=b)

        def step() -> torch.Tensor:
            with torch.no_grad():
                return model.compute_logits(runner(ids, pos, cm))

        step()
        mode = runner.last_batch_descriptor.mode.name
        row: dict[str, Any] = {"backend": name, "one_token_gemv": gemv == "on", "builder": chosen, "batch": b, "context": args.context,
                               "layers": args.layers, "dynamic": args.dynamic, "compile_sizes": args.compile_sizes,
                               "inductor_config": args.inductor_config, "mode": mode,
                               "step_ms": common.bench(step, warmup=25, rep=100)["median_ms"],
                               "host_ms": bench_compile.host_ms(step)}
        entry = runner.full_graphs.get(b)
        target = entry.graph.replay if entry is not None and mode == "FULL" else step
        if entry is not None and mode == "FULL":
            row["replay_ms"] = common.bench(target, warmup=25, rep=100)["median_ms"]
        if args.host_profile:
            tables[f"{name}/b{b}/host"] = host_profile(step, args.host_profile, top=args.top)
        prof = common.profile_kernels(target, top=args.top)
        row.update(kernels_per_step=prof["kernels_per_step"], kernel_ms=prof["kernel_ms_per_step"])
        tables[f"{name}/b{b}"] = prof
        rows.append(row)
        print(f"{name:20s} b{b:<3d} replay {row.get('replay_ms', float('nan')):.3f} ms  step "
                          f"{row['step_ms']:.3f} ms  host {row['host_ms']:.3f} ms  kernels {prof['kernels_per_step']:.0f}",
              file=sys.stderr, flush=True)
    runner.release()
    return rows, tables


def host_profile(step: Any, steps: int, top: int) -> dict[str, Any]:
    """Where the host's time per step goes: cProfile over ``steps`` steps (no sync between
    them, as a decode loop), the ``top`` functions by own time and by cumulative time, in
    microseconds per step. cProfile slows Python down, so read the shares, not the totals."""
    import cProfile
    import pstats

    step()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]

    def fmt(key: tuple[str, int, str]) -> str:
        path, line, fn = key
        parts = path.replace("\\", "/").split("/")
        return f"{'/'.join(parts[-2:])}:{line}({fn})" if path != "~" else fn

    total = sum(v[2] for v in stats.values())
    rows = [{"function": fmt(k), "calls_per_step": v[1] / steps, "own_us": v[2] / steps * 1e6,
             "cum_us": v[3] / steps * 1e6} for k, v in stats.items()]
    return {"steps": steps, "profiled_us_per_step": total / steps * 1e6,
            "by_own": sorted(rows, key=lambda r: -r["own_us"])[:top],
            "by_cum": sorted(rows, key=lambda r: -r["cum_us"])[:top]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", nargs="+", default=list(BACKENDS))
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--dynamic", choices=("unbacked", "backed"), default="backed")
    p.add_argument("--compile-sizes", default="1", help="CompilationConfig.compile_sizes, comma-separated token counts (\"\" for none): pieces also compiled for exactly these sizes (Inductor GEMV at 1)")
    p.add_argument("--inductor-config", default="{}",
                   help='CompilationConfig.inductor_compile_config as JSON, e.g. \'{"coordinate_descent_tuning": false}\'')
    p.add_argument("--gemv", nargs="+", default=["on"], choices=["on", "off"],
                   help="examples.gemv.OneTokenGemv variants to run per backend (e.g. on off: an A/B in one run)")
    p.add_argument("--top", type=int, default=30, help="kernels (and host functions) kept per table")
    p.add_argument("--mode", default="FULL_DECODE_ONLY", choices=[m.name for m in vattn.CUDAGraphMode],
                   help="the CUDAGraphRunner's mode (PIECEWISE: host-bound steps, see --host-profile)")
    p.add_argument("--host-profile", type=int, default=0, metavar="STEPS",
                   help="also profile the host with cProfile over STEPS steps (summary.kernel_profiles['<backend>/b<N>/host'])")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_step.py needs a CUDA GPU (run it on the device machine).", file=sys.stderr)
        return 1
    env = common.env_info("cuda")
    rows: list[dict[str, Any]] = []
    summary: dict[str, Any] = {"kernel_profiles": {}, "errors": []}
    t0 = time.perf_counter()
    for name, gemv in common.progress([(b, g) for b in args.backends for g in args.gemv], desc="backends"):
        try:
            r, tables = run_backend(name, args, gemv)
            rows += r
            summary["kernel_profiles"].update(tables)
        except Exception as e:  # keep the other backends' figures
            summary["errors"].append(f"{name}: {type(e).__name__}: {e}"[:600])
            traceback.print_exc()
        finally:
            torch._dynamo.reset()
            common.free_memory()
        summary["elapsed_s"] = round(time.perf_counter() - t0, 1)
        path = common.write_results("profile", {"env": env, "rows": rows, "summary": summary})
    table = common.Table(["backend", "batch", "replay_ms", "step_ms", "host_ms", "kernels_per_step", "kernel_ms"],
                         title=f"{args.mode} decode step ({env['device_name']}, context {args.context})")
    table.extend(rows)
    table.print()
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

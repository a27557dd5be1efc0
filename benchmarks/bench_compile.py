#!/usr/bin/env python
"""vattn.compile and CUDA graphs: decode step latency, and cold start.

**decode**: one decode step (forward + LM head) of the Llama-3.2-1B shape (examples/model.py,
random weights, bf16, random KV cache, every request at ``--context`` tokens) at batch 1, 8
and 64, for:

| impl | what runs |
| --- | --- |
| eager | the model in eager mode (metadata built each step) |
| compiled | ``vattn.compile``d model, no graphs |
| piecewise | ``CUDAGraphRunner(compiled, mode=PIECEWISE)``: pieces replayed, attention eager |
| piecewise-triton-launch | the same, with vattn's Triton kernels launched through Triton's own path (``set_fast_launch(False)``) |
| full | ``CUDAGraphRunner(compiled, mode=FULL)`` (downgraded, with the reason, where the backend forbids) |
| full-direct | eager model whose layers call the backend directly (no opaque op), ``FULL`` graphs |

``step_ms`` is the median wall time of a whole step (metadata build, padding, replay, LM
head) timed with CUDA events; ``replay_ms`` (full graphs only) times the graph replay alone;
``host_ms`` is the CPU time to issue one step (``host_ms``). For compiled, piecewise and full,
``kernels_per_step`` / ``kernel_ms`` (the GPU's busy time) come from a profiler trace, whose
per-kernel table is under ``kernel_profiles`` in the JSON.
``floor_ms`` = bytes of weights a step reads (layers + LM head) / measured read bandwidth.

**coldstart**: time to first token in a fresh process for 4 and 32 layers: build, compile
(Dynamo + Inductor), capture of every size up to 64 (``FULL_AND_PIECEWISE``) and one decode
step; first with empty Inductor/Triton caches ("cold"), then again with the caches the cold
run filled ("warm"), and with Dynamo's trace loaded from ``CompilationConfig.cache_dir``, which
the cold run wrote ("warm_stored_trace"; ``--no-trace-cache`` leaves it out, and the cold run then
traces without saving). Each start gets its own trace directory in place of the default one
(``$VATTN_CACHE_ROOT/compile``), and "warm" keeps none (``VATTN_DISABLE_COMPILE_CACHE=1``): a
second start with default settings is "warm_stored_trace" (``warm_default`` in the summary).
Capture seconds and graph-pool memory are reported separately; a start that loaded the trace
also reports the steps of its load (``trace_read_s``, ``trace_deserialize_s``,
``trace_backend_s``, all within ``compile_s``).

    PYTHONPATH=$PWD python benchmarks/bench_compile.py                   # both parts
    PYTHONPATH=$PWD python benchmarks/bench_compile.py --only decode --quick
    PYTHONPATH=$PWD python benchmarks/bench_compile.py --only coldstart --layers 4 32

Writes ``compile-<device>-<date>.json`` (``compile-decode-...`` / ``compile-coldstart-...`` with
``--only``) to $OUT (if set) or benchmarks/results/, after each part.
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()  # cold start counts from process start, torch import included

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import vattn  # noqa: E402
from examples.gemv import OneTokenGemv  # noqa: E402
from benchmarks import common  # noqa: E402
from examples.model import DecoderForCausalLM, get_preset, init_random_weights  # noqa: E402

M = vattn.CUDAGraphMode
BLOCK = 16
# --device cpu --preset tiny: a CPU smoke run of this script's logic (graphs fall back to eager)
DEV = {"device": "cuda", "preset": "llama-3.2-1b"}


def build(layers: int, backend: str | None, num_blocks: int, max_pos: int = 8192,
          compile_sizes: tuple[int, ...] = (),
          inductor_config: dict[str, Any] | None = None,
          cache_dir: str | None = None, one_token_gemv: bool = True) -> tuple[Any, Any, Any]:
    """The Llama-3.2-1B-shaped model with ``layers`` layers on CUDA (bf16), and its KV cache."""
    cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=BLOCK),
                            compilation=vattn.CompilationConfig(compile_sizes=tuple(compile_sizes),
                                                                inductor_compile_config=dict(inductor_config or {}),
                                                                cache_dir=cache_dir,
                                                                piece_passes=(OneTokenGemv(),) if one_token_gemv else ()))
    mc = get_preset(DEV["preset"], num_hidden_layers=layers, max_position_embeddings=max_pos)
    dtype = torch.bfloat16 if DEV["device"] == "cuda" else torch.float32
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(DEV["device"]), vattn.set_current_vattn_config(cfg):
            model = DecoderForCausalLM(mc, attn_backend=backend).eval()
    finally:
        torch.set_default_dtype(old)
    init_random_weights(model)
    kv = vattn.allocate_kv_cache(cfg, num_blocks=num_blocks, device=DEV["device"], dtype=dtype)
    for i, t in enumerate(kv.tensors.values()):
        k, v = common.split_kv_cache(t, num_blocks)
        common.fill_random_kv_(k, v, seed=i)
    return model, cfg, kv


def decode_batch(kv: Any, batch: int, context: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """``batch`` requests of ``context`` cached tokens, one new token each, on distinct blocks."""
    g = torch.Generator().manual_seed(seed)
    per = -(-(context + 1) // BLOCK)
    blocks = (torch.randperm(kv.num_blocks - 1, generator=g)[: batch * per] + 1).view(batch, per)
    common_md = kv.common_metadata([1] * batch, [context] * batch, blocks.tolist())
    ids = torch.randint(0, 1000, (batch,), generator=g).to(DEV["device"])
    return ids, torch.full((batch,), context, device=DEV["device"]), common_md


def _sync() -> None:
    if DEV["device"] == "cuda":
        torch.cuda.synchronize()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads: every parameter once, except the embedding table when untied."""
    emb = model.model.embed_tokens.weight
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    if model.lm_head.weight.data_ptr() != emb.data_ptr():  # untied: the table is only gathered
        seen.pop(emb.data_ptr(), None)
    return sum(seen.values())


def host_ms(fn: Any, calls: int = 20) -> float:
    """Host milliseconds per call of ``fn``: ``calls`` calls back to back, timed before the final sync.

    What the CPU spends issuing one step (Python, metadata, launches). Where it is below the
    step's GPU time, a loop that never syncs keeps the GPU busy; ``calls`` is small enough that
    the launch queue does not fill and block the host.
    """
    fn()
    _sync()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    ms = (time.perf_counter() - t) * 1e3 / calls
    _sync()
    return ms


def run_decode(args: argparse.Namespace, payload: dict[str, Any]) -> None:
    from benchmarks import roofline

    roof = roofline.measure(DEV["device"], quick=True, tiny=DEV["device"] != "cuda")
    batches = (1, 8) if args.quick else (1, 8, 64)
    per = -(-(args.context + 1) // BLOCK)
    model, cfg, kv = build(args.decode_layers, args.backend, num_blocks=max(batches) * per + 8,
                           max_pos=max(8192, args.context + 16), compile_sizes=common.token_counts(args.compile_sizes))
    wbytes = weight_bytes(model)
    floor_ms = wbytes / (roof.read_tbps * 1e12) * 1e3
    compiled = vattn.compile(model, cfg)
    sizes = tuple(batches)
    pw = vattn.CUDAGraphRunner(compiled, cfg, kv, capture_sizes=sizes, mode=M.PIECEWISE, show_progress=False)
    full = vattn.CUDAGraphRunner(compiled, cfg, kv, capture_sizes=sizes, mode=M.FULL, show_progress=False)
    direct = vattn.CUDAGraphRunner(model, cfg, kv, capture_sizes=sizes, mode=M.FULL, show_progress=False)

    def eager_step(fn: Any, ids: torch.Tensor, pos: torch.Tensor, cm: Any) -> Any:
        with vattn.set_forward_context(kv.build_metadata(cm), cfg), torch.no_grad():
            return model.compute_logits(fn(ids, pos))

    def graph_step(runner: Any, ids: torch.Tensor, pos: torch.Tensor, cm: Any) -> Any:
        with torch.no_grad():
            return model.compute_logits(runner(ids, pos, cm))

    rows = payload.setdefault("decode_rows", [])
    impls = ["eager", "compiled", "piecewise", "piecewise-triton-launch", "full", "full-direct"]
    from vattn.kernels.launch import set_fast_launch
    for b in common.progress(batches, desc="decode batch"):
        ids, pos, cm = decode_batch(kv, b, args.context, seed=b)
        for impl in impls:
            layers = cfg.compilation.static_forward_context.values()
            for layer in layers:  # full-direct: attention called directly, inside the same graph
                layer.use_direct_call = impl == "full-direct"
            set_fast_launch(impl != "piecewise-triton-launch")  # Triton's own launch path, for comparison
            if impl == "full-direct" and not direct.captured:
                direct.capture()
            fn = {
                "eager": lambda: eager_step(model, ids, pos, cm),
                "compiled": lambda: eager_step(compiled, ids, pos, cm),
                "piecewise": lambda: graph_step(pw, ids, pos, cm),
                "piecewise-triton-launch": lambda: graph_step(pw, ids, pos, cm),
                "full": lambda: graph_step(full, ids, pos, cm),
                "full-direct": lambda: graph_step(direct, ids, pos, cm),
            }[impl]
            res = common.bench(fn, warmup=50, rep=200 if not args.quick else 60)
            runner = {"piecewise": pw, "piecewise-triton-launch": pw, "full": full, "full-direct": direct}.get(impl)
            row: dict[str, Any] = {"impl": impl, "batch": b, "context": args.context, "step_ms": res["median_ms"],
                                   "p20_ms": res["p20"], "p80_ms": res["p80"], "floor_ms": floor_ms,
                                   "x_floor": res["median_ms"] / floor_ms}
            if runner is not None:
                row["mode"] = runner.last_batch_descriptor.mode.name if runner.last_batch_descriptor else None
                row["runner_mode"] = runner.mode.name
                row["capture_s"] = runner.stats.get("capture_seconds")
                row["graph_mib"] = (runner.stats.get("graph_memory_bytes") or 0) / 2**20
                entry = runner.full_graphs.get(b)
                if entry is not None and row["mode"] == "FULL":
                    row["replay_ms"] = common.bench(entry.graph.replay, warmup=25, rep=100)["median_ms"]
            row["host_ms"] = host_ms(fn)
            if DEV["device"] == "cuda" and impl in ("compiled", "piecewise", "full"):
                prof = common.profile_kernels(fn)
                row.update(kernels_per_step=prof["kernels_per_step"], kernel_ms=prof["kernel_ms_per_step"],
                           copies_per_step=prof["copies_per_step"])
                payload.setdefault("kernel_profiles", {})[f"{impl}/b{b}"] = prof
            rows.append(row)
        for layer in cfg.compilation.static_forward_context.values():
            layer.use_direct_call = False
    payload["summary"].update(
        decode_layers=args.decode_layers, compile_sizes=list(cfg.compilation.compile_sizes),
        weight_bytes=wbytes, read_tbps=roof.read_tbps, floor_ms=floor_ms,
        backend=type(kv.groups[0].builder).__name__, downgrades={"full": full.downgrade_reasons, "piecewise": pw.downgrade_reasons},
        inductor_compiles=compiled.backend.counter.num_inductor_compiles,
    )
    for r in (pw, full, direct):
        r.release()


def coldstart_child(args: argparse.Namespace) -> None:
    """One cold start in this process; prints one JSON line (the parent collects it)."""
    t_import = time.perf_counter() - _T0
    t = time.perf_counter()
    model, cfg, kv = build(args.child_layers, args.backend, num_blocks=512, cache_dir=args.child_cache_dir)
    _sync()
    t_build = time.perf_counter() - t

    t = time.perf_counter()
    compiled = vattn.compile(model, cfg)
    ids = torch.zeros(64, dtype=torch.long, device=DEV["device"])
    with vattn.set_forward_context(None, cfg, dummy_run=True):  # a warm-up run: compiles
        compiled(ids, torch.arange(64, device=DEV["device"]))
    _sync()
    t_compile = time.perf_counter() - t

    t = time.perf_counter()
    runner = vattn.CUDAGraphRunner(compiled, cfg, kv, max_batch_size=64, mode=M.FULL_AND_PIECEWISE,
                                   max_model_len=2048, show_progress=False)
    runner.capture()
    _sync()
    t_capture = time.perf_counter() - t

    t = time.perf_counter()
    ids1, pos1, cm = decode_batch(kv, 1, 100)
    with torch.no_grad():
        token = int(model.compute_logits(runner(ids1, pos1, cm)).argmax(-1)[0])
    t_first = time.perf_counter() - t
    c = compiled.backend.counter
    print(json.dumps({
        "layers": args.child_layers, "import_s": t_import, "build_s": t_build, "compile_s": t_compile,
        "backend_s": c.compile_seconds,  # of compile_s: the backend's piece compiles (the rest: Dynamo, first run)
        **_dynamo_times(),
        "capture_total_s": t_capture, "capture_s": runner.stats.get("capture_seconds"),
        "capture_warmup_s": runner.stats.get("warmup_seconds"),
        "graph_mib": (runner.stats.get("graph_memory_bytes") or 0) / 2**20,
        "first_step_s": t_first, "ttft_s": time.perf_counter() - _T0, "mode": runner.mode.name,
        "num_sizes": len(runner.sizes), "inductor_compiles": c.num_inductor_compiles,
        "piece_reuses": c.num_piece_reuses, "token": token,
        "trace_cache": compiled.trace_path is not None, "trace_loaded": compiled.trace_loaded,
        # of compile_s, when the trace loaded: reading it, deserialising, the backend on it
        **{f"trace_{k}_s": round(v, 3) for k, v in compiled.trace_load_seconds.items()},
    }))


DYNAMO_PHASES = {"dynamo_total_s": "_compile.compile_inner", "dynamo_tracing_s": "bytecode_tracing",
                 "dynamo_fake_values_s": "get_fake_value", "dynamo_guards_s": "build_guards",
                 "dynamo_backend_call_s": "OutputGraph.call_user_compiler",
                 "dynamo_aot_capture_s": "fullgraph_capture"}


def _dynamo_times() -> dict[str, float]:
    """Seconds of Dynamo's timed phases in this process: all of it (``dynamo_total_s``, the
    backend call included), bytecode tracing (fake-tensor propagation of each op among it),
    guards, and the backend call (``dynamo_backend_call_s``: splitting and compiling pieces).
    With ``CompilationConfig.cache_dir`` Dynamo captures ahead of time instead:
    ``dynamo_aot_capture_s`` is all of that capture (backend included), ``dynamo_total_s`` 0."""
    from torch._dynamo.utils import compilation_time_metrics

    return {k: round(sum(compilation_time_metrics.get(v, [])), 3) for k, v in DYNAMO_PHASES.items()}


def _child(layers: int, args: argparse.Namespace, env: dict[str, str], cache_dir: str | None = None) -> dict[str, Any]:
    """One cold-start child process: its JSON line, or ``{"error": ...}``."""
    cmd = [sys.executable, __file__, "--child-layers", str(layers), "--device", DEV["device"], "--preset", DEV["preset"]]
    if cache_dir:
        cmd += ["--child-cache-dir", cache_dir]
    if args.backend:
        cmd += ["--backend", args.backend]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.child_timeout)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.returncode != 0 or not lines:
        return {"error": res.stderr[-2000:]}
    return json.loads(lines[-1])


def run_coldstart(args: argparse.Namespace, payload: dict[str, Any]) -> None:
    """Cold then warm children per layer count, after one priming child.

    Python bytecode: a pip install compiles every module to ``.pyc``, so a user's first run
    never compiles torch's Python sources. Machines that forbid writing bytecode
    (``PYTHONDONTWRITEBYTECODE``, seen on the GPU machine, where it added about 11 s to
    every process) would count that compile in every start. The children therefore write
    bytecode under one ``PYTHONPYCACHEPREFIX``, filled by a priming child whose Inductor and
    Triton caches are thrown away: the cold runs still compile every kernel.
    """
    rows = payload.setdefault("coldstart_rows", [])
    with tempfile.TemporaryDirectory(prefix="vattn-pyc-") as pyc:
        base = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        base["PYTHONPYCACHEPREFIX"] = pyc
        base["VATTN_DISABLE_COMPILE_CACHE"] = "1"  # no default trace location: cache_dir per start
        with tempfile.TemporaryDirectory(prefix="vattn-prime-") as cache:
            t = time.perf_counter()
            primed = _child(min(args.layers), args, dict(base, TORCHINDUCTOR_CACHE_DIR=f"{cache}/inductor",
                                                         TRITON_CACHE_DIR=f"{cache}/triton"))
            payload["summary"]["bytecode_priming"] = {"seconds": round(time.perf_counter() - t, 1),
                                                      "ok": "error" not in primed}
        for layers in common.progress(args.layers, desc="cold start"):
            with tempfile.TemporaryDirectory(prefix="vattn-coldstart-") as cache:
                env = dict(base, TORCHINDUCTOR_CACHE_DIR=f"{cache}/inductor", TRITON_CACHE_DIR=f"{cache}/triton")
                # cold saves Dynamo's trace (CompilationConfig.cache_dir); warm traces again;
                # warm_stored_trace loads the trace instead.
                trace_dir = f"{cache}/vattn" if args.trace_cache else None
                phases = [("cold", trace_dir), ("warm", None)] + ([("warm_stored_trace", trace_dir)] if trace_dir else [])
                for phase, cache_dir in phases:
                    r = _child(layers, args, env, cache_dir)
                    rows.append({"layers": layers, "phase": phase, **r} if "error" in r else {"phase": phase, **r})
            common.write_results(payload["name"], _payload_for_write(payload))
    by = {(r.get("layers"), r.get("phase")): r for r in rows if "error" not in r}
    lo, hi = min(args.layers), max(args.layers)
    if (lo, "cold") in by and (hi, "cold") in by:
        payload["summary"]["compile_ratio_%d_vs_%d" % (hi, lo)] = by[(hi, "cold")]["compile_s"] / by[(lo, "cold")]["compile_s"]
    for n in args.layers:
        payload["summary"][f"ttft_s_{n}_layers"] = {ph: round(r["ttft_s"], 2) for (m, ph), r in by.items() if m == n}
        if (n, "warm_stored_trace") in by:  # what a second start with default settings does
            payload["summary"][f"ttft_s_{n}_layers"]["warm_default"] = round(by[(n, "warm_stored_trace")]["ttft_s"], 2)


def _payload_for_write(payload: dict[str, Any]) -> dict[str, Any]:
    rows = [{"part": "decode", **r} for r in payload.get("decode_rows", [])]
    rows += [{"part": "coldstart", **r} for r in payload.get("coldstart_rows", [])]
    return {"rows": rows, "summary": payload["summary"], "kernel_profiles": payload.get("kernel_profiles", {})}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=("decode", "coldstart"), default=None)
    p.add_argument("--backend", default=None, help="force an attention backend (e.g. FLASH_ATTN, TRITON_ATTN)")
    p.add_argument("--context", type=int, default=512, help="cached tokens per request in the decode part")
    p.add_argument("--compile-sizes", default="1", help="CompilationConfig.compile_sizes, comma-separated token counts (\"\" for none): pieces also compiled for exactly these sizes (Inductor GEMV at 1); "
                   "the decode part only, the cold start uses the default config")
    p.add_argument("--decode-layers", type=int, default=16, help="layers of the decode-part model (1B: 16)")
    p.add_argument("--layers", type=int, nargs="+", default=[4, 32], help="layer counts for the cold start")
    p.add_argument("--child-timeout", type=float, default=280.0, help="seconds per cold-start process")
    p.add_argument("--quick", action="store_true", help="batch 1 and 8 only, shorter timing")
    p.add_argument("--device", default="cuda", help="cuda; cpu only for a smoke run of the script (with --preset tiny)")
    p.add_argument("--preset", default="llama-3.2-1b", help="model shape from examples/model.py PRESETS")
    p.add_argument("--no-trace-cache", dest="trace_cache", action="store_false",
                   help="cold start without CompilationConfig.cache_dir (no stored Dynamo trace, no warm_stored_trace phase)")
    p.add_argument("--child-layers", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-cache-dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    DEV.update(device=args.device, preset=args.preset)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_compile needs a CUDA GPU (or --device cpu --preset tiny for a smoke run).", file=sys.stderr)
        return 1
    if args.child_layers is not None:
        coldstart_child(args)
        return 0
    # One file per part when run apart (a later part must not overwrite an earlier one in $OUT).
    payload: dict[str, Any] = {"summary": {"context": args.context},
                               "name": "compile" if args.only is None else f"compile-{args.only}"}
    if args.only in (None, "decode"):
        run_decode(args, payload)
        path = common.write_results(payload["name"], _payload_for_write(payload))
        print(f"decode part written to {path}", file=sys.stderr)
    if args.only in (None, "coldstart"):
        run_coldstart(args, payload)
    path = common.write_results(payload["name"], _payload_for_write(payload))
    for r in _payload_for_write(payload)["rows"]:
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k != "error"})
    print(f"written to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

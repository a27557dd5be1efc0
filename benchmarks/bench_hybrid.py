#!/usr/bin/env python
"""Hybrid decode on the GPU: the Qwen3-Next-style example on vattn beside transformers, and cold start.

Model: ``examples/hybrid_model.py``'s ``qwen3-next-16l`` (Qwen3-Next-80B-A3B's widths: hidden 2048,
attention 16 q / 2 KV heads of 256 with an output gate and partial RoPE, Gated DeltaNet 16 k / 32 v
heads of 128 with a conv of 4; 16 layers, attention in every fourth; a dense MLP of the active
width 5632; vocab 151936), random weights, bf16. **decode**: for each batch (1, 64) after prompts
of ``--context`` tokens, ms per decode step and tokens/s of:

| impl | what runs |
| --- | --- |
| vattn-cudagraph-full | ``examples.engine.Engine`` + ``vattn.compile`` + ``vattn.CUDAGraphRunner(mode=FULL_DECODE_ONLY)``: each decode step replays one graph (attention, the GDN conv and delta rule on vattn's Triton kernels, each request's state in the slot of its engine row) |
| vattn-eager | (opt-in) the same engine, eager model |
| dense-cudagraph-full | (opt-in) the dense example (``examples/model.py``, ``--dense-preset``) the same way |
| hf-eager | ``transformers`` ``Qwen3NextForCausalLM.generate`` with its default cache (``DynamicCache``: K/V for the attention layers, conv and recurrent state for the GDN layers), sdpa attention |
| hf-static-compile | ``generate`` with a ``StaticCache`` (static K/V, ``LinearAttentionLayer`` states), which compiles the decode forward (``torch.compile``, CUDA graphs) |

transformers runs the GDN layers on ``fla`` / ``causal-conv1d`` kernels where they are installed,
else on its torch fallbacks (``summary.hf_gdn_kernels`` says which). vattn times are engine steps
(``bench_e2e.vattn_decode``: start-to-start period, median over steps where every request decodes,
async scheduling); transformers times ``(t(generate N+1) - t(generate 1)) / N``
(``bench_e2e.hf_decode``). Same weights: the transformers model is initialised and its state dict
loaded into the example; ``dynamo_graphs`` on a transformers row counts the graphs torch.compile
made during it (0: it ran eagerly). ``floor_ms``: (weights + K/V read + GDN states read and written) / the copy
bandwidth of ``benchmarks/roofline.py``; ``summary.parity`` (also ``--only parity``): the FULL-graph
engine's logits against the eager engine's on the same requests at batch 1 and 2 (``parity``: a check
that the graphs and piece passes compute the model).

**coldstart**: a fresh process per model with empty Inductor / Triton caches (after a priming
process, so that Python bytecode is compiled once): build, ``vattn.compile`` and a warm-up forward
(``compile_s``), capture of FULL graphs for the decode batch sizes (``capture_s``) and a first decode
step (``ttft_s`` from process start), for the hybrid and the dense example of the same widths
(``qwen3-dense-16l``: every layer attention, no output gate, full RoPE).

    PYTHONPATH=$PWD python benchmarks/bench_hybrid.py                       # both parts (about 8 min)
    PYTHONPATH=$PWD python benchmarks/bench_hybrid.py --only decode
    PYTHONPATH=$PWD python benchmarks/bench_hybrid.py --only coldstart
    PYTHONPATH=$PWD python benchmarks/bench_hybrid.py --device cpu --preset qwen3-next-tiny \\
        --dense-preset tiny-qwen3 --context 16 --new-tokens 4               # a CPU smoke run of the logic

Writes ``hybrid-<device>-<date>.json`` (``benchmarks.common.write_results``: env with device,
versions, date and commit; rows; summary) to $OUT (if set) or benchmarks/results/, after every row.
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()  # cold start counts from process start, imports included

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

if __package__ in (None, ""):  # run as a script: make `benchmarks`, `examples` and `vattn` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import vattn  # noqa: E402
from benchmarks import common, roofline  # noqa: E402
from benchmarks.bench_e2e import graph_mode, hf_decode, say, vattn_decode  # noqa: E402
from examples.engine import Engine, SamplingParams  # noqa: E402
from examples.gemv import OneTokenGemv  # noqa: E402
from examples.hybrid_model import HYBRID_PRESETS, HybridForCausalLM, get_hybrid_preset  # noqa: E402
from examples.hybrid_model import init_random_weights as init_hybrid  # noqa: E402
from examples.model import PRESETS, DecoderForCausalLM, ModelConfig, get_preset, init_random_weights  # noqa: E402

BLOCK = 16
IMPLS = ("vattn-cudagraph-full", "vattn-eager", "dense-cudagraph-full", "hf-eager", "hf-static-compile")
DEFAULT_IMPLS = ("vattn-cudagraph-full", "hf-eager", "hf-static-compile")
#: The dense example of ``qwen3-next-16l``'s widths: every layer attention (Qwen3: q/k norms, no gate).
DENSE_PRESETS = {"qwen3-dense-16l": ModelConfig(
    arch="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
    num_attention_heads=16, num_key_value_heads=2, head_dim=256, rope_theta=10_000_000.0,
    max_position_embeddings=32768)}
HF_PATHS = {
    "hf-eager": "Qwen3NextForCausalLM.generate, default DynamicCache (attention K/V + GDN conv/recurrent "
                "states), sdpa attention, eager",
    "hf-static-compile": "Qwen3NextForCausalLM.generate with StaticCache (static K/V + LinearAttentionLayer "
                         "states): transformers compiles the decode forward (torch.compile, CUDA graphs)",
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_config(args: argparse.Namespace) -> vattn.VattnConfig:
    passes = () if args.no_gemv else (OneTokenGemv(),)
    cache = vattn.CacheConfig(block_size=BLOCK, mamba_ssm_cache_dtype=args.ssm_dtype)
    return vattn.VattnConfig(cache=cache, compilation=vattn.CompilationConfig(
        compile_sizes=common.token_counts(args.compile_sizes), piece_passes=passes))


def build_model(kind: str, preset: str, args: argparse.Namespace, cfg: vattn.VattnConfig, max_len: int,
                layers: int | None = None, hf: Any = None) -> torch.nn.Module:
    """The hybrid (``kind`` "hybrid") or dense example on ``args.device`` in ``args.dtype``: the
    weights of ``hf`` when given, else seeded random ones."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    extra: dict[str, Any] = {"max_position_embeddings": max_len}
    if layers is not None:
        extra["num_hidden_layers"] = layers
    if kind == "hybrid":
        mcfg: Any = get_hybrid_preset(preset, **extra)
    else:
        mcfg = DENSE_PRESETS[preset] if preset in DENSE_PRESETS else get_preset(preset)
        mcfg = type(mcfg)(**{**mcfg.__dict__, **extra})
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with vattn.set_current_vattn_config(cfg), torch.device(device):
            model = HybridForCausalLM(mcfg) if kind == "hybrid" else DecoderForCausalLM(mcfg)
    finally:
        torch.set_default_dtype(old)
    if hf is not None:
        model.load_hf_state_dict(hf.state_dict())
    else:
        (init_hybrid if kind == "hybrid" else init_random_weights)(model, seed=args.seed)
    return model.eval()


def build_hf(args: argparse.Namespace, max_len: int) -> Any:
    """transformers' Qwen3NextForCausalLM of the preset (dense MLPs, sdpa), seeded random weights."""
    import transformers

    mcfg = get_hybrid_preset(args.preset, max_position_embeddings=max_len)
    old = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, args.dtype))
    try:
        with torch.device(args.device):
            hf = transformers.Qwen3NextForCausalLM(mcfg.to_hf(attn_implementation="sdpa"))
    finally:
        torch.set_default_dtype(old)
    init_hybrid(hf, seed=args.seed)
    return hf.eval()


def step_bytes(model: torch.nn.Module, kv: Any, batch: int, kv_len: float) -> float:
    """Bytes a decode step moves at least: parameters (the embedding only as a tied LM head), K/V of
    ``batch`` sequences of ``kv_len`` tokens, and every mixer layer's state read and written."""
    seen: dict[int, int] = {}
    tied = getattr(model.config, "tie_word_embeddings", False)
    for name, p in model.named_parameters():
        if not (name.endswith("embed_tokens.weight") and not tied):
            seen[p.data_ptr()] = p.numel() * p.element_size()
    kv_token = sum(t[0, 0].nbytes if t.shape[0] == 2 else t[0].nbytes for t in kv.tensors.values()) / kv.block_size
    state = sum(t[0].nbytes for ts in kv.states.values() for t in ts)
    return sum(seen.values()) + batch * (kv_len * kv_token + 2 * state)


def parity(model: torch.nn.Module, cfg: vattn.VattnConfig, kv: Any, runner: dict[str, Any],
           device: torch.device) -> dict[str, Any]:
    """The FULL-graph engine's logits against the eager engine's, greedy, prefill + 8 decodes, at
    batch 1 (one request: the one-token pieces) and batch 2 (padded to a capture size).

    Rows are compared while both runs have fed the same tokens: up to and including each
    request's first differing sample (random bf16 weights give near-ties that rounding flips;
    after a flip the inputs differ). ``flip_margins``: the eager top-2 logit gap at each flip
    (a near-tie when it is within ``max_abs_diff``)."""
    result: dict[str, Any] = {}
    for prompts in ((29,), (37, 20)):
        runs = []
        for kwargs in ({}, runner):
            engine = Engine(model, cfg, kv, device=device, max_num_seqs=len(prompts), record_logits=True, **kwargs)
            g = torch.Generator().manual_seed(1)
            reqs = [engine.add_request(torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist(),
                                       SamplingParams(max_tokens=9)) for n in prompts]
            engine.run()
            runs.append([(torch.stack(engine.logits[r.req_id]).float(), r.output_token_ids) for r in reqs])
        diffs, margins, absmax, rows = [], [], 0.0, 0
        for (ref, ref_tokens), (got, tokens) in zip(*runs):
            n = next((i for i, (a, b) in enumerate(zip(ref_tokens, tokens)) if a != b), None)
            keep = len(ref_tokens) if n is None else n + 1
            diffs.append(float((got[:keep] - ref[:keep]).abs().max()))
            absmax, rows = max(absmax, float(ref[:keep].abs().max())), rows + keep
            if n is not None:
                top = ref[n].topk(2).values
                margins.append(float(top[0] - top[1]))
        result[f"b{len(prompts)}"] = {"max_abs_diff": max(diffs), "logit_absmax": absmax, "rows_compared": rows,
                                      "flip_margins": margins}
    return result


def run_decode(args: argparse.Namespace, payload: dict[str, Any]) -> None:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    rows, summary = payload["rows"], payload["summary"]
    max_len = args.context + 3 * args.new_tokens + 256
    hf_impls = [i for i in args.impls if i.startswith("hf-")]
    hf = None
    if hf_impls:
        try:
            hf = build_hf(args, max_len)
        except ImportError:
            say("transformers is not installed here: skipping the hf-* rows.")
    cfg = make_config(args)
    model = build_model("hybrid", args.preset, args, cfg, max_len, hf=hf)
    per_req = -(-(args.context + 2 * args.new_tokens + 64) // BLOCK)
    slots = max(args.batches)
    kv = vattn.allocate_kv_cache(cfg, num_blocks=slots * per_req + 16, device=device, dtype=dtype,
                                 num_state_slots=slots)
    roof = roofline.measure(device, quick=True, tiny=device.type != "cuda")
    summary.update(model={k: v for k, v in model.config.__dict__.items()}, dtype=args.dtype, roofline=roof.to_dict(),
                   vattn_attention_backend=next(iter(cfg.attention_layers().values())).attn_backend.get_name(),
                   vattn_mixer_backend=next(iter(cfg.compilation.static_forward_context[n] for n in kv.states)
                                            ).attn_backend.get_name(),
                   state_bytes_per_request=sum(t[0].nbytes for ts in kv.states.values() for t in ts),
                   hf_paths={i: HF_PATHS[i] for i in hf_impls},
                   hf_gdn_kernels={m: importlib.util.find_spec(m) is not None for m in ("fla", "causal_conv1d")})
    dense = None
    for impl in [i for i in args.impls if not i.startswith("hf-")] + hf_impls:
        runner: dict[str, Any] = {}
        setup_s = 0.0
        try:
            if impl.startswith("hf-") and hf is None:
                raise RuntimeError("transformers is not installed")
            if impl == "dense-cudagraph-full":  # its own config and cache (a model registers in one config)
                dcfg = make_config(args)
                dense_model = build_model("dense", args.dense_preset, args, dcfg, max_len)
                dense = (dense_model, dcfg, vattn.allocate_kv_cache(dcfg, num_blocks=slots * per_req + 16,
                                                                    device=device, dtype=dtype))
            m, c, k = dense if impl == "dense-cudagraph-full" else (model, cfg, kv)
            if impl.endswith("cudagraph-full"):
                t0 = time.perf_counter()
                graphs = vattn.CUDAGraphRunner(vattn.compile(m, c), c, k, capture_sizes=sorted(set(args.batches)),
                                               max_model_len=max_len, mode=vattn.CUDAGraphMode.FULL_DECODE_ONLY,
                                               show_progress=False)
                runner = {"graph_runner": graphs}
                for b in (1, 2):  # compile token counts 1 and > 1 and capture, outside the timings
                    vattn_decode(m, c, k, runner, b, 32, 4, args.max_num_batched_tokens, args.seed)
                setup_s = time.perf_counter() - t0
                summary.setdefault("cudagraph", {})[impl] = {"mode": graphs.mode.name, "sizes": list(graphs.sizes),
                                                            "downgrades": graphs.downgrade_reasons}
                if impl == "vattn-cudagraph-full":
                    summary["parity"] = parity(m, c, k, runner, device)
            elif impl == "vattn-eager":
                runner = {"forward_fn": model}
        except Exception as e:  # noqa: BLE001  (every row of the impl says why)
            traceback.print_exc()
            runner = {"error": f"{type(e).__name__}: {e}"[:800]}
        for batch in args.batches:
            row: dict[str, Any] = {"impl": impl, "batch": batch, "context": args.context, "new_tokens": args.new_tokens}
            if time.perf_counter() - _T0 > args.time_budget_s:
                row["skipped"] = f"time budget ({args.time_budget_s:.0f} s, --time-budget-s) spent"
            elif "error" in runner:
                row["error"] = runner["error"]
            else:
                try:
                    if impl.startswith("hf-"):
                        from torch._dynamo.utils import counters

                        graphs_before = counters["stats"]["unique_graphs"]
                        row.update(hf_decode(hf, batch, args.context, args.new_tokens, impl == "hf-static-compile",
                                             args.reps, args.seed))
                        row["dynamo_graphs"] = counters["stats"]["unique_graphs"] - graphs_before  # 0: not compiled
                    else:
                        m, c, k = dense if impl == "dense-cudagraph-full" else (model, cfg, kv)
                        row.update(vattn_decode(m, c, k, runner, batch, args.context, args.new_tokens,
                                                args.max_num_batched_tokens, args.seed)[0], setup_s=setup_s)
                        if "graph_runner" in runner:
                            row["graph_mode"] = graph_mode(runner)
                    m = dense[0] if impl == "dense-cudagraph-full" else model
                    k = dense[2] if impl == "dense-cudagraph-full" else kv
                    floor_ms = 1e3 * step_bytes(m, k, batch, row["kv_len"]) / (roof.copy_tbps * 1e12)
                    row.update(floor_ms=floor_ms, x_floor=row["ms_per_step"] / floor_ms)
                except torch.cuda.OutOfMemoryError as e:
                    row["skipped"] = f"out of memory: {str(e).splitlines()[0]}"
                except Exception as e:  # noqa: BLE001  (the error is in the JSON; the other rows go on)
                    traceback.print_exc()
                    row["error"] = f"{type(e).__name__}: {e}"[:800]
            rows.append(row)
            say(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}))
            common.free_memory()
            write(payload)
    by = {(r["impl"], r["batch"]): r for r in rows if r.get("tok_s")}
    for batch in args.batches:
        base = by.get(("vattn-cudagraph-full", batch))
        for impl in hf_impls:
            other = by.get((impl, batch))
            if base and other:
                summary.setdefault("speedup", {})[f"b{batch} vs {impl}"] = base["tok_s"] / other["tok_s"]


def coldstart_child(args: argparse.Namespace) -> None:
    """One cold start in this process (``--child hybrid|dense``); prints one JSON line."""
    t_import = time.perf_counter() - _T0
    device = torch.device(args.device)
    cfg = make_config(args)
    t = time.perf_counter()
    preset = args.preset if args.child == "hybrid" else args.dense_preset
    model = build_model(args.child, preset, args, cfg, 4096, layers=args.child_layers)
    kv = vattn.allocate_kv_cache(cfg, num_blocks=256, device=device, dtype=getattr(torch, args.dtype),
                                 num_state_slots=max(args.batches))
    sync(device)
    t_build = time.perf_counter() - t
    t = time.perf_counter()
    compiled = vattn.compile(model, cfg)
    with torch.no_grad(), vattn.set_forward_context(None, cfg, dummy_run=True):  # a warm-up run: compiles
        compiled(torch.zeros(64, dtype=torch.long, device=device), torch.arange(64, device=device))
    sync(device)
    t_compile = time.perf_counter() - t
    t = time.perf_counter()
    runner = vattn.CUDAGraphRunner(compiled, cfg, kv, capture_sizes=sorted(set(args.batches)), max_model_len=2048,
                                   mode=vattn.CUDAGraphMode.FULL_DECODE_ONLY, show_progress=False)
    runner.capture()
    sync(device)
    t_capture = time.perf_counter() - t
    t = time.perf_counter()
    common_md = kv.common_metadata([1], [99], [list(range(7))], state_indices=[0])
    with torch.no_grad():
        hidden = runner(torch.zeros(1, dtype=torch.long, device=device), torch.full((1,), 99, device=device), common_md)
        token = int(model.compute_logits(hidden).argmax(-1)[0])
    t_first = time.perf_counter() - t
    c = compiled.backend.counter
    print(json.dumps({
        "model": args.child, "preset": preset, "layers": model.config.num_hidden_layers, "import_s": t_import,
        "build_s": t_build, "compile_s": t_compile, "backend_s": c.compile_seconds,
        "inductor_compiles": c.num_inductor_compiles, "piece_reuses": c.num_piece_reuses,
        "capture_s": t_capture, "graph_mode": runner.mode.name, "num_sizes": len(runner.sizes),
        "first_step_s": t_first, "ttft_s": time.perf_counter() - _T0, "token": token}))


def _child(kind: str, args: argparse.Namespace, env: dict[str, str], layers: int | None = None) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", kind, "--device", args.device, "--dtype", args.dtype,
           "--preset", args.preset, "--dense-preset", args.dense_preset, "--batches", ",".join(map(str, args.batches)),
           "--compile-sizes", args.compile_sizes, "--ssm-dtype", args.ssm_dtype] + (["--no-gemv"] if args.no_gemv else [])
    if layers is not None:
        cmd += ["--child-layers", str(layers)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.child_timeout)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.returncode != 0 or not lines:
        return {"model": kind, "error": res.stderr[-2000:]}
    return json.loads(lines[-1])


def run_coldstart(args: argparse.Namespace, payload: dict[str, Any]) -> None:
    """A priming child (4 layers; its caches thrown away) fills one bytecode prefix, then a cold
    child per model with Inductor and Triton caches of its own (as bench_compile's cold rows)."""
    rows, summary = payload["rows"], payload["summary"]
    with tempfile.TemporaryDirectory(prefix="vattn-pyc-") as pyc:
        base = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        base.update(PYTHONPYCACHEPREFIX=pyc, VATTN_DISABLE_COMPILE_CACHE="1")
        for kind, layers in (("prime", 4), ("hybrid", None), ("dense", None)):
            with tempfile.TemporaryDirectory(prefix="vattn-coldstart-") as cache:
                env = dict(base, TORCHINDUCTOR_CACHE_DIR=f"{cache}/inductor", TRITON_CACHE_DIR=f"{cache}/triton")
                t = time.perf_counter()
                r = _child("hybrid" if kind == "prime" else kind, args, env, layers)
            if kind == "prime":
                summary["bytecode_priming"] = {"seconds": round(time.perf_counter() - t, 1), "ok": "error" not in r}
                continue
            rows.append({"impl": f"coldstart-{kind}", **r})
            say(json.dumps(rows[-1])[:600])
            write(payload)
    by = {r["impl"]: r for r in rows if r["impl"].startswith("coldstart-") and "error" not in r}
    if "coldstart-hybrid" in by and "coldstart-dense" in by:
        h, d = by["coldstart-hybrid"], by["coldstart-dense"]
        summary["coldstart_hybrid_over_dense"] = {k: h[k] / d[k] for k in ("compile_s", "capture_s", "ttft_s") if d[k]}


def write(payload: dict[str, Any]) -> None:
    common.write_results(payload["name"], {k: v for k, v in payload.items() if k != "name"}, path=payload["path"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=("decode", "coldstart", "parity"), default=None)
    p.add_argument("--preset", default="qwen3-next-16l", choices=sorted(HYBRID_PRESETS))
    p.add_argument("--dense-preset", default="qwen3-dense-16l", choices=sorted(DENSE_PRESETS) + sorted(PRESETS),
                   help="the dense example for the cold-start comparison (and dense-cudagraph-full)")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--context", type=int, default=512, help="prompt tokens before the timed decode steps")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--impls", default=",".join(DEFAULT_IMPLS), help=f"comma-separated, of {', '.join(IMPLS)}")
    p.add_argument("--compile-sizes", default="1", help="CompilationConfig.compile_sizes (\"\" for none)")
    p.add_argument("--no-gemv", action="store_true", help="leave out the example's one-token GEMV piece pass")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--reps", type=int, default=3, help="transformers repeats per timing")
    p.add_argument("--time-budget-s", type=float, default=480.0, help="skip rows once this many seconds have passed")
    p.add_argument("--child-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda", help="cuda (the benchmark); cpu only to smoke-test the script")
    p.add_argument("--ssm-dtype", default="float32",
                   help="CacheConfig.mamba_ssm_cache_dtype of the GDN recurrent states (auto: the model dtype)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--child", default=None, choices=["hybrid", "dense"], help=argparse.SUPPRESS)
    p.add_argument("--child-layers", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.batches = [int(x) for x in args.batches.split(",")]
    args.impls = [i for i in args.impls.split(",") if i]
    if unknown := [i for i in args.impls if i not in IMPLS]:
        p.error(f"--impls: unknown {unknown}; choose from {list(IMPLS)}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.child:
        coldstart_child(args)
        return {}
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_hybrid.py needs a CUDA GPU (run it on the device machine), or --device cpu to "
                         "smoke-test.")
    env = common.env_info(device)
    name = "hybrid" if args.only is None else f"hybrid-{args.only}"
    if args.ssm_dtype != "float32":
        name += f"-ssm-{args.ssm_dtype}"
    payload: dict[str, Any] = {"name": name, "path": common.result_path(name, env), "env": env, "rows": [],
                               "summary": {"preset": args.preset, "dense_preset": args.dense_preset,
                                           "batches": args.batches, "context": args.context,
                                           "new_tokens": args.new_tokens, "compile_sizes": args.compile_sizes, "ssm_dtype": args.ssm_dtype,
                                           "one_token_gemv": not args.no_gemv, "partial": True}}
    if args.only == "parity":  # the FULL-graph engine against the eager one, nothing timed
        cfg = make_config(args)
        model = build_model("hybrid", args.preset, args, cfg, 2048)
        kv = vattn.allocate_kv_cache(cfg, num_blocks=64, device=device, dtype=getattr(torch, args.dtype),
                                     num_state_slots=max(args.batches))
        graphs = vattn.CUDAGraphRunner(vattn.compile(model, cfg), cfg, kv, capture_sizes=sorted(set(args.batches)),
                                       max_model_len=2048, mode=vattn.CUDAGraphMode.FULL_DECODE_ONLY,
                                       show_progress=False)
        payload["summary"]["parity"] = parity(model, cfg, kv, {"graph_runner": graphs}, device)
        say(json.dumps(payload["summary"]["parity"]))
    if args.only in (None, "decode"):
        run_decode(args, payload)
        common.free_memory()
    if args.only in (None, "coldstart"):
        run_coldstart(args, payload)
    payload["summary"].update(partial=False, wall_s=time.perf_counter() - _T0)
    write(payload)
    table = common.Table(["impl", "batch", "ms_per_step", "tok_s", "floor_ms", "x_floor", "graph_mode", "setup_s",
                          "compile_s", "capture_s", "ttft_s", "skipped", "error"], title="hybrid")
    table.extend(payload["rows"])
    table.print()
    print(f"wrote {payload['path']}")
    return payload


if __name__ == "__main__":
    main()

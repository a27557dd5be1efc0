#!/usr/bin/env python
"""End-to-end decode on the GPU: vattn beside transformers, and the physical floor.

Model: the Llama-3.2-1B shape (16 layers, hidden 2048, 32 q / 8 KV heads, head dim 64,
vocab 128256, tied embeddings), random weights, bf16. For each batch size and context
(prompt length) it measures ms per decode step and tokens/s for:

| impl | what runs |
| --- | --- |
| vattn-eager | examples.engine.Engine over the paged KV cache, eager model |
| vattn-compile | the same, model through ``vattn.compile`` (split at attention, Inductor per piece) |
| vattn-compile-cudagraph | the same, through ``vattn.CUDAGraphRunner`` (full graphs for decodes, piecewise otherwise) |
| vattn-torch-compile | (opt-in) ``torch.compile(model, fullgraph=True, dynamic=True)`` |
| hf-eager | ``transformers`` ``generate`` with its dynamic cache (sdpa attention) |
| hf-static-compile | ``generate`` with a ``StaticCache`` (which auto-compiles the decode forward, reduce-overhead) |

vattn step times are the engine's own (schedule + metadata + forward + logits + sampling,
one host sync per step), median over the steps where every request decodes. Each vattn impl
also gets an ``<impl>/loop`` row: ``DecodeLoop`` continues the same requests with
device-resident inputs and no per-step sync (what a tuned engine does in steady-state
decode), so host work overlaps the GPU. transformers step times are
``(t(generate N+1 tokens) - t(generate 1 token)) / N``, medians over repeats. All greedy,
on the same weights.

The floor of a step: (bytes of weights read + bytes of KV read) / copy bandwidth, where the
copy bandwidth is ``2 * bytes / time`` of a large device-to-device copy (read + write), and
the embedding table counts only when it is also the LM head (tied).

    PYTHONPATH=$PWD python benchmarks/bench_e2e.py            # batch 1 and 64, contexts 512 and 4096
    PYTHONPATH=$PWD python benchmarks/bench_e2e.py --quick    # batch 1 and 64, context 512

Writes ``e2e-<device>-<date>.json`` (``benchmarks.common.write_results``) to $OUT (if set) or
benchmarks/results/ after every row, so a run cut short keeps what it measured
(``summary.partial``). ``--time-budget-s`` skips the remaining transformers compiles when
the run nears the budget.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

import vattn  # noqa: E402
from benchmarks.common import env_info, progress, result_path, write_results  # noqa: E402
from examples.engine import Engine, SamplingParams  # noqa: E402
from examples.generate import compile_model, make_cudagraph_runner  # noqa: E402
from examples.model import DecoderForCausalLM, ModelConfig, get_preset, init_random_weights  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Device copy bandwidth in bytes/s, counting read + write (median over 20 copies after 5 warm-up)."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(25):
        sync(device)
        t0 = time.perf_counter()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            torch.cuda.synchronize(device)
            dt = start.elapsed_time(end) / 1e3
        else:
            dst.copy_(src)
            dt = time.perf_counter() - t0
        if i >= 5:
            times.append(dt)
    del src, dst
    return 2 * nbytes / statistics.median(times)


def weight_bytes_per_step(model: DecoderForCausalLM) -> int:
    """Bytes of parameters one decode step reads (the embedding table only if tied to the LM head)."""
    seen: dict[int, int] = {}
    for name, p in model.named_parameters():
        if name.endswith("embed_tokens.weight") and not model.config.tie_word_embeddings:
            continue
        seen[p.data_ptr()] = p.numel() * p.element_size()
    return sum(seen.values())


def kv_bytes_per_step(mcfg: ModelConfig, batch: int, context: float, elem: int) -> float:
    return batch * context * mcfg.num_hidden_layers * 2 * mcfg.num_key_value_heads * mcfg.head_dim * elem


# ---- vattn -------------------------------------------------------------------------------------


def vattn_decode(model: DecoderForCausalLM, cfg: vattn.VattnConfig, kv: Any, runner: dict[str, Any],
                 batch: int, context: int, new_tokens: int, budget: int,
                 seed: int) -> tuple[dict[str, float], Engine]:
    """Prefill ``batch`` prompts of ``context`` tokens, then time ``new_tokens`` engine steps where all decode.

    ``runner``: Engine keyword arguments (forward_fn / graph_runner / min_tokens). Returns the
    figures and the engine, whose requests are all still decoding.
    """
    engine = Engine(model, cfg, kv, device=kv_device(kv), max_num_batched_tokens=budget,
                    max_num_seqs=batch, seed=seed, **runner)
    g = torch.Generator().manual_seed(seed)
    extra = math.ceil(batch * context / budget) + 2  # decodes that overlap the prefill steps
    for _ in range(batch):
        prompt = torch.randint(0, model.config.vocab_size, (context,), generator=g).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=new_tokens + extra))
    decode, prefill_s, prefill_tok = [], 0.0, 0
    while len(decode) < new_tokens and engine.scheduler.has_unfinished():
        s = engine.step()
        if s.num_prefill_tokens:
            prefill_s += s.seconds
            prefill_tok += s.num_prefill_tokens
        elif s.num_decode_tokens == batch:
            decode.append(s.seconds)
    ms = 1e3 * statistics.median(decode)
    return {"ms_per_step": ms, "tok_s": batch * 1e3 / ms, "ms_p10": 1e3 * quantile(decode, 0.1),
            "ms_p90": 1e3 * quantile(decode, 0.9), "decode_steps": len(decode),
            "prefill_tok_s": prefill_tok / prefill_s if prefill_s else 0.0}, engine


class DecodeLoop:
    """Steady-state decode of an engine's running requests with device-resident inputs.

    What a tuned engine does between scheduler events: positions, sequence lengths and slot
    mapping advance by device ops, the sampled token feeds the next step on the device, and
    nothing syncs until the end. The host only builds ``CommonAttentionMetadata`` and the
    backend metadata (or the CUDA-graph runner pads and dispatches), so host work overlaps
    the GPU. Blocks for every step are allocated up front.
    """

    def __init__(self, engine: Engine, runner: dict[str, Any], steps: int) -> None:
        reqs = list(engine.scheduler.running)
        assert reqs and all(r.num_remaining == 1 for r in reqs), "every request must be decoding"
        for r in reqs:
            assert engine.scheduler._grow(r, steps + 1), "KV cache too small for the decode loop"
        self.engine, self.steps = engine, steps
        self.forward_fn = runner.get("forward_fn", engine.model)
        self.graph_runner = runner.get("graph_runner")
        dev, b, bs = engine.device, len(reqs), engine.block_size
        width = max(len(r.block_ids) for r in reqs)
        table = torch.zeros(b, width, dtype=torch.int32)
        for i, r in enumerate(reqs):
            table[i, : len(r.block_ids)] = torch.tensor(r.block_ids, dtype=torch.int32)
        self.block_table, self.bs, self.rows = table.to(dev), bs, torch.arange(b, device=dev)
        self.pos_cpu = torch.tensor([r.num_computed_tokens for r in reqs], dtype=torch.int32)
        self.pos = self.pos_cpu.to(dev, torch.long)
        self.tokens = torch.tensor([r.output_token_ids[-1] for r in reqs], device=dev)
        self.qsl_cpu = torch.arange(b + 1, dtype=torch.int32)
        self.qsl = self.qsl_cpu.to(dev)

    def _common(self) -> vattn.CommonAttentionMetadata:
        b = self.rows.shape[0]
        slot = self.block_table[self.rows, self.pos // self.bs].long() * self.bs + self.pos % self.bs
        seq_cpu = self.pos_cpu + 1
        return vattn.CommonAttentionMetadata(
            query_start_loc=self.qsl, query_start_loc_cpu=self.qsl_cpu, seq_lens=(self.pos + 1).int(),
            seq_lens_cpu=seq_cpu, num_computed_tokens_cpu=self.pos_cpu, num_reqs=b, num_actual_tokens=b,
            max_query_len=1, block_table_tensor=self.block_table, slot_mapping=slot,
            max_seq_len=int(seq_cpu.max()))

    def step(self) -> torch.Tensor:
        e, common = self.engine, self._common()
        if self.graph_runner is not None:
            hidden = self.graph_runner(self.tokens, self.pos, common)
        else:
            with vattn.set_forward_context(e.kv.build_metadata(common), e.cfg):
                hidden = self.forward_fn(self.tokens, self.pos)
        self.tokens = e.model.compute_logits(hidden).argmax(dim=-1)
        self.pos, self.pos_cpu = self.pos + 1, self.pos_cpu + 1
        return self.tokens

    @torch.inference_mode()
    def run(self, warmup: int = 4) -> tuple[dict[str, float], torch.Tensor]:
        """Figures of ``steps - warmup`` timed steps, and the (steps, B) tokens."""
        out = [self.step() for _ in range(warmup)]
        sync(self.engine.device)
        t0 = time.perf_counter()
        out += [self.step() for _ in range(self.steps - warmup)]
        sync(self.engine.device)
        ms = 1e3 * (time.perf_counter() - t0) / (self.steps - warmup)
        b = self.rows.shape[0]
        return {"ms_per_step": ms, "tok_s": b * 1e3 / ms, "decode_steps": self.steps - warmup}, torch.stack(out)


def kv_device(kv: Any) -> torch.device:
    return next(iter(kv.tensors.values())).device


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# ---- transformers ------------------------------------------------------------------------------


def hf_decode(hf: Any, batch: int, context: int, new_tokens: int, static: bool, reps: int,
              seed: int) -> dict[str, float]:
    """ms per decode step of ``hf.generate``: (t(N+1 tokens) - t(1 token)) / N, medians over ``reps``."""
    import transformers

    device = hf.device
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.randint(0, hf.config.vocab_size, (batch, context), device=device, generator=g)
    mask = torch.ones_like(ids)
    max_len = context + new_tokens + 1

    def run(n: int) -> float:
        kwargs: dict[str, Any] = {}
        if static:
            try:  # transformers 5.x
                kwargs["past_key_values"] = transformers.StaticCache(config=hf.config, max_cache_len=max_len)
            except TypeError:  # 4.x
                kwargs["past_key_values"] = transformers.StaticCache(
                    config=hf.config, max_batch_size=batch, max_cache_len=max_len, device=device, dtype=hf.dtype)
        sync(device)
        t0 = time.perf_counter()
        hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                    pad_token_id=0, **kwargs)
        sync(device)
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    run(1), run(new_tokens + 1)  # warm-up (compiles the decode forward for the static cache)
    warmup_s = time.perf_counter() - t0
    short = statistics.median(run(1) for _ in range(reps))
    long = statistics.median(run(new_tokens + 1) for _ in range(reps))
    ms = 1e3 * (long - short) / new_tokens
    return {"ms_per_step": ms, "tok_s": batch * 1e3 / ms, "warmup_s": warmup_s}


def build_hf(mcfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int) -> Any:
    import transformers

    hf_cfg = mcfg.to_hf(attn_implementation="sdpa")
    cls = transformers.LlamaForCausalLM if mcfg.arch == "llama" else transformers.Qwen3ForCausalLM
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            hf = cls(hf_cfg)
    finally:
        torch.set_default_dtype(old)
    init_random_weights(hf, seed=seed)
    return hf.eval()


# ---- main --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="context 512 only")
    p.add_argument("--preset", default="llama-3.2-1b")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--contexts", default=None, help="prompt lengths (default 512,4096; --quick 512)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--backend", default=None, help="force a vattn backend by name")
    p.add_argument("--impls", default="vattn-eager,vattn-compile,vattn-compile-cudagraph,hf-eager,hf-static-compile",
                   help="comma-separated; also vattn-torch-compile")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--reps", type=int, default=3, help="transformers repeats per timing")
    p.add_argument("--time-budget-s", type=float, default=540.0,
                   help="skip the remaining transformers compiles once this much time has passed")
    p.add_argument("--no-loop", action="store_true", help="skip the device-resident decode loop rows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda", help="cuda (the benchmark); cpu only to smoke-test the script")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = p.parse_args(argv)
    args.batches = [int(x) for x in args.batches.split(",")]
    args.contexts = [int(x) for x in (args.contexts or ("512" if args.quick else "512,4096")).split(",")]
    args.impls = args.impls.split(",")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_e2e.py needs a CUDA GPU (run it on the device machine), or --device cpu to smoke-test.")
    t_start = time.perf_counter()
    mcfg = get_preset(args.preset, max_position_embeddings=max(args.contexts) + 4 * args.new_tokens + 1024)

    hf = None
    if any(i.startswith("hf-") for i in args.impls):
        try:
            hf = build_hf(mcfg, dtype, device, args.seed)
        except ImportError:
            print("transformers is not installed on this machine: skipping the hf-* baselines.", file=sys.stderr)

    cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=16))
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with vattn.global_force_attn_backend_context_manager(args.backend), vattn.set_current_vattn_config(cfg), \
                torch.device(device):
            model = DecoderForCausalLM(mcfg)
    finally:
        torch.set_default_dtype(old)
    if hf is not None:
        model.load_hf_state_dict(hf.state_dict())  # the same weights on both sides
    else:
        init_random_weights(model, seed=args.seed)
    model.eval()
    backend = model.model.layers[0].self_attn.attn.attn_backend.get_name()

    budget = args.max_num_batched_tokens
    # engine steps (prefill overlap + new tokens), then the decode loop (new tokens + warm-up)
    per_req = max(c + 2 * args.new_tokens + math.ceil(max(args.batches) * c / budget) + 16 for c in args.contexts)
    num_blocks = max(args.batches) * math.ceil(per_req / 16) + 16
    kv = vattn.allocate_kv_cache(cfg, num_blocks=num_blocks, device=device, dtype=dtype)

    bw = copy_bandwidth(device, (2 << 30) if device.type == "cuda" else (64 << 20))
    wbytes = weight_bytes_per_step(model)
    elem = torch.tensor([], dtype=dtype).element_size()
    env = env_info(device)
    path = result_path("e2e", env)
    rows: list[dict[str, Any]] = []
    report: dict[str, Any] = {
        "preset": args.preset, "model": {**mcfg.__dict__, "rope_scaling": mcfg.rope_scaling},
        "dtype": str(dtype), "vattn_backend": backend, "block_size": 16, "max_num_batched_tokens": budget,
        "new_tokens": args.new_tokens, "copy_bandwidth_GBps": bw / 1e9, "weight_bytes_per_step": wbytes,
        "floor": [], "partial": True,
        "notes": [
            "impl rows: examples.engine.Engine steps (schedule + metadata + forward + logits + sampling, one "
            "host sync per step), median over steps where every request decodes",
            "impl/loop rows: DecodeLoop, device-resident decode (no per-step sync; host work overlaps the GPU)",
            "hf rows: (t(generate N+1) - t(generate 1)) / N, medians over --reps",
            "floor_ms: (weight bytes + KV bytes at context + new_tokens) / copy bandwidth (2 * bytes / time)",
        ],
    }

    runners: dict[str, dict[str, Any] | None] = {}  # impl -> Engine kwargs; built once, reused across shapes
    max_model_len = per_req + 16

    def runner_for(impl: str) -> tuple[dict[str, Any] | None, float]:
        if impl in runners:
            return runners[impl], 0.0
        t0 = time.perf_counter()
        r: dict[str, Any] | None
        if impl == "vattn-eager":
            r = {"forward_fn": model}
        elif impl == "vattn-compile":
            r = {"forward_fn": compile_model(model, cfg, "vattn")}
        elif impl == "vattn-torch-compile":
            r = {"forward_fn": compile_model(model, cfg, "inductor"), "min_tokens": 2}
        elif impl == "vattn-compile-cudagraph":
            base = runner_for("vattn-compile")[0]
            if base is None:
                raise RuntimeError(f"needs vattn-compile, which failed: {failed.get('vattn-compile')}")
            graphs = make_cudagraph_runner(base["forward_fn"], cfg, kv, max(args.batches), max_model_len)
            r = None if graphs is None else {"graph_runner": graphs}
            if graphs is not None:
                report["cudagraph"] = {"mode": graphs.mode.name, "downgrades": graphs.downgrade_reasons}
        else:
            raise ValueError(f"unknown impl {impl!r}")
        if r is not None and impl != "vattn-eager":  # compile / capture now, outside the timings
            for b in (1, 2):  # token counts 1 and >1 (Dynamo specialises a size-1 dim)
                DecodeLoop(vattn_decode(model, cfg, kv, r, b, 32, 4, budget, args.seed)[1], r, 6).run()
            if "graph_runner" in r:
                report["cudagraph"]["stats"] = r["graph_runner"].stats
        runners[impl] = r
        return r, time.perf_counter() - t0

    loop_tokens: dict[tuple[str, int, int], torch.Tensor] = {}
    failed: dict[str, str] = {}  # impl -> the error that disabled it
    jobs = [(b, c, impl) for c in args.contexts for b in args.batches for impl in args.impls]
    for batch, context, impl in progress(jobs, desc="e2e", unit="run"):
        row: dict[str, Any] = {"impl": impl, "batch": batch, "context": context, "new_tokens": args.new_tokens}
        extra_rows: list[dict[str, Any]] = []
        elapsed = time.perf_counter() - t_start
        try:
            if impl.startswith("vattn-"):
                r, setup_s = runner_for(impl)
                if r is None:
                    row["skipped"] = failed.get(impl, "vattn.CUDAGraphRunner is not available")
                else:
                    figures, engine = vattn_decode(model, cfg, kv, r, batch, context, args.new_tokens, budget,
                                                   args.seed)
                    row.update(figures, setup_s=setup_s)
                    if not args.no_loop:
                        figures, tokens = DecodeLoop(engine, r, args.new_tokens + 4).run()
                        loop_row = {**row, "impl": impl + "/loop", **figures}
                        for k in ("ms_p10", "ms_p90", "prefill_tok_s"):
                            loop_row.pop(k, None)
                        loop_tokens[(impl, batch, context)] = tokens.cpu()
                        ref = loop_tokens.get(("vattn-eager", batch, context))
                        if ref is not None and impl != "vattn-eager":
                            loop_row["tokens_agree_with_eager"] = float((ref == tokens.cpu()).float().mean())
                        extra_rows.append(loop_row)
            elif hf is None:
                row["skipped"] = "transformers is not installed"
            elif impl == "hf-static-compile" and elapsed > args.time_budget_s - 120:
                row["skipped"] = f"time budget ({elapsed:.0f} s of {args.time_budget_s:.0f} s used)"
            else:
                row.update(hf_decode(hf, batch, context, args.new_tokens, impl == "hf-static-compile",
                                     args.reps, args.seed))
        except torch.cuda.OutOfMemoryError as e:
            row["skipped"] = f"out of memory: {str(e).splitlines()[0]}"
        except Exception as e:  # keep measuring the other rows; the error is in the JSON
            traceback.print_exc()
            row["error"] = f"{type(e).__name__}: {e}"[:800]
            if impl.startswith("vattn-"):
                runners[impl] = None
                failed[impl] = row["error"]
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        floor_ms = 1e3 * (wbytes + kv_bytes_per_step(mcfg, batch, context + args.new_tokens, elem)) / bw
        for rr in [row, *extra_rows]:
            if "ms_per_step" in rr:
                rr["floor_ms"], rr["x_floor"] = floor_ms, rr["ms_per_step"] / floor_ms
            rows.append(rr)
            tqdm.write(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rr.items()}))
        write_results("e2e", {"env": env, "summary": report, "rows": rows}, path=path)

    for batch in args.batches:
        for context in args.contexts:
            kvb = kv_bytes_per_step(mcfg, batch, context + args.new_tokens, elem)
            report["floor"].append({"batch": batch, "context": context, "kv_bytes": kvb,
                                    "floor_ms": 1e3 * (wbytes + kvb) / bw})
    report["wall_s"], report["partial"] = time.perf_counter() - t_start, False
    write_results("e2e", {"env": env, "summary": report, "rows": rows}, path=path)
    print(f"wrote {path}")
    print(f"{'impl':<32}{'batch':>6}{'ctx':>6}{'ms/step':>10}{'tok/s':>10}{'x floor':>9}")
    for r in rows:
        if "ms_per_step" in r:
            print(f"{r['impl']:<32}{r['batch']:>6}{r['context']:>6}{r['ms_per_step']:>10.2f}{r['tok_s']:>10.0f}"
                  f"{r['x_floor']:>9.2f}")
        else:
            why = r.get("skipped") or r.get("error")
            print(f"{r['impl']:<32}{r['batch']:>6}{r['context']:>6}  not measured: {why}")
    return {"env": env, "summary": report, "rows": rows}


if __name__ == "__main__":
    main()

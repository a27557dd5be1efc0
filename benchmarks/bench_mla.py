#!/usr/bin/env python
"""MLA (multi-head latent attention): the MLA backends' kernels, and the DeepSeek-style example model's decode step.

Kernels, DeepSeek's latent sizes (kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128,
v_head_dim 128), bf16, block size 64, random latent cache, for TRITON_MLA, FLASHINFER_MLA and
FLASH_ATTN_MLA (those that run here; the others are listed in ``summary.skipped`` with their reason):

| phase | shapes (batch x context, heads) | timed |
| --- | --- | --- |
| decode | 64 x 4096 and 1 x 32768, 16 and 128 heads | ``kernel``: the backend's absorbed attention over the latent (CUDA-graph replays); ``layer``: the whole MLA op (latent store, ``W_UK`` / ``W_UV`` products, attention); FLASHINFER_MLA also ``bare_layer``: the same layer written on the bare library (below) |
| prefill | 8 x 2048 new tokens, 16 heads | ``kernel``: the up-projected causal attention; ``layer``: the whole op (up-projection included) |

Each row: ms, TB/s (decode: latent bytes read; prefill: q/k/v/o bytes) and TFLOP/s (decode:
``2 B H S (L + P + L)``; prefill: the causal pairs times ``2 H (N + P + V)``), and their fractions
of the copy bandwidth and bf16 matmul rate measured in the same run (``benchmarks/roofline.py``),
plus ``max_abs_diff`` against a float32 torch computation of the same attention.

``bare_layer`` is what a user of FlashInfer alone writes for one decode layer: the latent row
stored with ``index_copy_``, ``W_UK`` absorbed with ``torch.bmm``, the FlashInfer wrapper's
``run`` (the wrapper vattn planned for the batch, so the kernel launch is identical), ``W_UV``
with ``torch.bmm`` and the (T, H, V) output written. ``layer / bare_layer`` is what vattn's layer
costs on top of the library under CUDA graphs (target <= 1.03).

Model: ``examples/deepseek_model.py`` (the DeepSeek-V2-Lite shape, all layers dense, random
weights) on vattn (``vattn.compile`` + ``vattn.CUDAGraphRunner`` FULL_AND_PIECEWISE, through
``examples.engine``) beside transformers' ``DeepseekV3ForCausalLM`` with a static cache
(``generate`` compiles its decode forward): ms per decode step, tokens/s, the speedup.

    PYTHONPATH=$PWD python benchmarks/bench_mla.py                        # everything (GPU, < 10 min)
    PYTHONPATH=$PWD python benchmarks/bench_mla.py --parts kernels        # kernels only
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/bench_mla.py --device cpu --quick   # CPU smoke run

Writes ``<name>-<device>-<date>.json`` (default name ``mla``) and its PNG to $OUT (if set) or
benchmarks/results/. ``summary.targets``: TRITON_MLA decode at least 0.9x FLASHINFER_MLA's
speed at 64 x 4096 (16 and 128 heads).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import traceback
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks`, `examples` and `vattn` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import vattn  # noqa: E402
from benchmarks import common, roofline  # noqa: E402
from vattn.core.registry import AttentionBackendEnum  # noqa: E402
from vattn.mla_layer import MLAAttention  # noqa: E402

BACKENDS = ("TRITON_MLA", "FLASHINFER_MLA", "FLASH_ATTN_MLA")
DEEPSEEK = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
TINY = dict(kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16)
DECODE = ((64, 4096, 16), (64, 4096, 128), (1, 32768, 16), (1, 32768, 128))
PREFILL = ((8, 2048, 16),)
#: DeepSeek-V2-Lite's attention and dense MLP sizes (its MoE layers made dense).
MODEL = dict(vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_hidden_layers=27,
             num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, max_position_embeddings=8192, **DEEPSEEK)
BLOCK = 64


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (the benchmark); cpu only to smoke-test (TRITON_INTERPRET=1)")
    p.add_argument("--quick", action="store_true", help="short timings; on CPU tiny shapes")
    p.add_argument("--parts", default="kernels,model", help="comma-separated: kernels, model")
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--name", default="mla")
    p.add_argument("--warmup-ms", type=float, default=25.0)
    p.add_argument("--rep-ms", type=float, default=100.0)
    p.add_argument("--model-layers", type=int, default=None, help="layers of the example model (default 27)")
    p.add_argument("--model-batches", default="1,64")
    p.add_argument("--model-context", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.parts = [s for s in args.parts.split(",") if s]
    args.backends = [s for s in args.backends.split(",") if s]
    args.model_batches = [int(b) for b in args.model_batches.split(",") if b]
    return args


# ---- kernels ---------------------------------------------------------------------------------------


class MLAProblem:
    """One MLA layer on ``backend`` over a random latent cache, with a step's metadata built."""

    def __init__(self, backend: str, batch: int, context: int, heads: int, prefill: bool, sizes: dict[str, int],
                 device: torch.device, dtype: torch.dtype, seed: int) -> None:
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.lora, self.rope = sizes["kv_lora_rank"], sizes["qk_rope_head_dim"]
        self.nope, self.v = sizes["qk_nope_head_dim"], sizes["v_head_dim"]
        self.batch, self.context, self.heads, self.prefill = batch, context, heads, prefill
        self.cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=BLOCK))
        cls = AttentionBackendEnum[backend].get_class()
        with vattn.set_current_vattn_config(self.cfg), torch.device(device):
            old = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            try:
                self.kv_b = nn.Linear(self.lora, heads * (self.nope + self.v), bias=False)
                nn.init.normal_(self.kv_b.weight, std=self.lora ** -0.5)
                self.layer = MLAAttention(heads, (self.nope + self.rope) ** -0.5, self.nope, self.rope, self.v, None,
                                          self.lora, self.kv_b, prefix="bench.mla", attn_backend=cls)
            finally:
                torch.set_default_dtype(old)
        per_req = math.ceil(context / BLOCK)
        num_blocks = batch * per_req + 1
        self.kv = vattn.allocate_kv_cache(self.cfg, num_blocks=num_blocks, device=device, dtype=dtype)
        self.cache = self.kv.tensors["bench.mla"]
        self.cache.normal_(generator=None)
        perm = torch.randperm(num_blocks - 1, generator=g) + 1
        self.tables = perm[: batch * per_req].view(batch, per_req).tolist()
        qlen = context if prefill else 1
        self.common = self.kv.common_metadata([qlen] * batch, [context - qlen] * batch, self.tables)
        self.md = self.kv.build_metadata(self.common)["bench.mla"]
        t = batch * qlen
        rnd = lambda *shape: torch.randn(*shape, device=device, dtype=dtype)  # noqa: E731
        self.q, self.kv_c, self.k_pe = rnd(t, heads, self.nope + self.rope), rnd(t, self.lora), rnd(t, self.rope)
        self.out = torch.empty(t, heads, self.v, device=device, dtype=dtype)
        self.q_nope, self.q_pe = rnd(batch, heads, self.lora), rnd(batch, heads, self.rope)

    def layer_fn(self) -> Any:
        impl, layer = self.layer.impl, self.layer
        return lambda: impl.forward(layer, self.q, self.kv_c, self.k_pe, self.cache, self.md, output=self.out)

    def bare_layer_fn(self) -> Any:
        """FLASHINFER_MLA decodes: the layer on the bare library (see the module docstring)."""
        wrapper, n, lora = self.md.decode.plan, self.nope, self.lora
        w = self.kv_b.weight.view(self.heads, n + self.v, lora)
        w_uk, w_uv_t = w[:, :n], w[:, n:].transpose(1, 2)
        flat, slots = self.cache.view(-1, lora + self.rope), self.common.slot_mapping
        ckv, kpe = self.cache[..., :lora], self.cache[..., lora:]

        def bare() -> None:
            flat.index_copy_(0, slots, torch.cat([self.kv_c, self.k_pe], -1))
            q_nope, q_pe = self.q.split([n, self.rope], -1)
            latent = wrapper.run(torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1), q_pe, ckv, kpe)
            self.out.copy_(torch.bmm(latent.transpose(0, 1), w_uv_t).transpose(0, 1))
        return bare

    def kernel_fn(self) -> tuple[Any, Any]:
        """(the attention call alone, a function returning (its float32 result, the reference))."""
        impl, md = self.layer.impl, self.md
        if not self.prefill:
            call = lambda: impl._forward_decode(self.q_nope, self.q_pe, self.cache, md.decode, self.layer)  # noqa: E731
            return call, lambda: (call().float(), self._decode_reference())
        p = md.prefill
        k_nope, v = impl.up_project(self.kv_c)
        call = lambda: impl._prefill_attend(self.q, k_nope, self.k_pe, v, p.query_start_loc, p.query_start_loc,  # noqa: E731
                                            p.max_query_len, p.max_query_len, True, p.plan)[0]
        return call, lambda: (call().float(), self._prefill_reference(k_nope, v))

    def _decode_reference(self) -> torch.Tensor:
        b, s = self.batch, self.context
        rows = torch.tensor(self.tables, device=self.cache.device)  # (B, blocks)
        lat = self.cache[rows].reshape(b, -1, self.lora + self.rope)[:, :s].float()  # (B, S, L + P)
        q = torch.cat([self.q_nope, self.q_pe], -1).float()  # (B, H, L + P)
        p = (torch.einsum("bhd,bsd->bhs", q, lat) * self.layer.impl.scale).softmax(-1)
        return torch.einsum("bhs,bsl->bhl", p, lat[..., : self.lora])

    def _prefill_reference(self, k_nope: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n, h = self.context, self.heads
        outs = []
        for r in range(self.batch):
            rows = slice(r * n, (r + 1) * n)
            k = torch.cat([k_nope[rows], self.k_pe[rows, None].expand(-1, h, -1)], -1).float()
            s = torch.einsum("qhd,khd->hqk", self.q[rows].float(), k) * self.layer.impl.scale
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
            outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v[rows].float()))
        return torch.cat(outs)

    def figures(self) -> tuple[float, float]:
        """(bytes, flops) of the attention: decode reads the latent; prefill reads q/k/v, writes o."""
        b, s, h, lora, rope, nope, v = self.batch, self.context, self.heads, self.lora, self.rope, self.nope, self.v
        if not self.prefill:
            return b * s * (lora + rope) * 2.0, 2.0 * b * h * s * (lora + rope + lora)
        pairs = b * s * (s + 1) / 2
        return b * s * h * (2 * (nope + rope) + 2 * v) * 2.0, 2.0 * h * pairs * (nope + rope + v)


def kernel_rows(args: argparse.Namespace, device: torch.device, roof: roofline.Roofline,
                skipped: dict[str, str]) -> list[dict[str, Any]]:
    tiny = device.type != "cuda"
    sizes = TINY if tiny else DEEPSEEK
    decode = ((2, 40, 4), (1, 70, 4)) if tiny else DECODE
    prefill = ((2, 24, 4),) if tiny else PREFILL
    warmup, rep = (0.0, 2.0) if tiny else ((5.0, 30.0) if args.quick else (args.warmup_ms, args.rep_ms))
    rows: list[dict[str, Any]] = []
    for backend in args.backends:
        ok, why = AttentionBackendEnum[backend].get_class().is_available()
        if not ok:
            skipped[backend] = why
            continue
        shapes = [(*s, False) for s in decode] + [(*s, True) for s in prefill]
        for batch, context, heads, is_prefill in common.progress(shapes, backend):
            base = {"backend": backend, "phase": "prefill" if is_prefill else "decode", "batch": batch,
                    "context": context, "heads": heads}
            try:
                prob = MLAProblem(backend, batch, context, heads, is_prefill, sizes, device, torch.bfloat16, args.seed)
                call, check = prob.kernel_fn()
                got, ref = check()
                nbytes, flops = prob.figures()
                graphs = device.type == "cuda" and not is_prefill
                timed = [("kernel", call), ("layer", prob.layer_fn())]
                if backend == "FLASHINFER_MLA" and not is_prefill:
                    timed.append(("bare_layer", prob.bare_layer_fn()))
                for what, fn in timed:
                    t = (common.bench_cuda_graph(fn, warmup=warmup, rep=rep) if graphs
                         else common.bench(fn, warmup=warmup, rep=rep, device=device))
                    ms = t["median_ms"]
                    tbps, tflops = nbytes / (ms * 1e-3) / 1e12, flops / (ms * 1e-3) / 1e12
                    rows.append({**base, "timed": what, "ms": ms, "p20": t["p20"], "p80": t["p80"],
                                 "tbps": tbps, "tflops": tflops, **roof.fractions(tbps=tbps, tflops=tflops),
                                 "max_abs_diff": float((got - ref).abs().max()), "method": t["method"]})
            except Exception as e:  # keep measuring; the error is in the JSON
                traceback.print_exc()
                rows.append({**base, "error": f"{type(e).__name__}: {e}"[:800]})
            common.free_memory()
    return rows


# ---- the example model -----------------------------------------------------------------------------


def model_rows(args: argparse.Namespace, device: torch.device, skipped: dict[str, str]) -> list[dict[str, Any]]:
    import transformers

    from benchmarks.bench_e2e import hf_decode, vattn_decode
    from examples.deepseek_model import DeepseekV3ForCausalLM
    from examples.generate import compile_model
    from examples.model import init_random_weights

    cuda = device.type == "cuda"
    shape = dict(MODEL) if cuda else dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
                                          max_position_embeddings=256, **TINY)
    if args.model_layers:
        shape["num_hidden_layers"] = args.model_layers
    dtype = torch.bfloat16 if cuda else torch.float32
    context, new = (args.model_context, args.new_tokens) if cuda else (8, 3)
    hf_cfg = transformers.DeepseekV3Config(**shape, first_k_dense_replace=shape["num_hidden_layers"],
                                           attn_implementation="sdpa" if cuda else "eager")
    with torch.device(device):
        hf = transformers.DeepseekV3ForCausalLM(hf_cfg).eval()
    init_random_weights(hf, seed=args.seed)
    hf = hf.to(dtype)
    comp = vattn.CompilationConfig(cudagraph_mode=vattn.CUDAGraphMode.FULL_AND_PIECEWISE if cuda else
                                   vattn.CUDAGraphMode.NONE, max_capture_size=max(args.model_batches))
    cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=BLOCK), compilation=comp)
    with vattn.set_current_vattn_config(cfg), torch.device(device), common.default_dtype(dtype):
        model = DeepseekV3ForCausalLM.from_hf_config(hf.config)
    model.load_hf_state_dict(hf.state_dict())
    model.eval()
    batch_max = max(args.model_batches)
    tokens = context + new + 64
    kv = vattn.allocate_kv_cache(cfg, num_blocks=batch_max * math.ceil(tokens / BLOCK) + 8, device=device, dtype=dtype)
    runner: dict[str, Any] = {}
    if cuda:
        runner["graph_runner"] = vattn.CUDAGraphRunner(compile_model(model, cfg), cfg, kv, max_batch_size=batch_max,
                                                       max_model_len=tokens, show_progress=False)
    rows: list[dict[str, Any]] = []
    base = {"backend": model.model.layers[0].self_attn.attn.attn_backend.get_name(), "layers": shape["num_hidden_layers"]}
    for batch in args.model_batches if cuda else [1, 2]:
        for impl in ("vattn-full-graphs" if cuda else "vattn-eager", "hf-static-compile" if cuda else "hf-eager"):
            row = {**base, "impl": impl, "batch": batch, "context": context}
            try:
                if impl.startswith("vattn"):
                    figures, _ = vattn_decode(model, cfg, kv, runner, batch, context, new, budget=4096, seed=args.seed)
                else:
                    figures = hf_decode(hf, batch, context, new, static=cuda, reps=2 if args.quick else 3,
                                        seed=args.seed)
                row.update(figures)
            except Exception as e:
                traceback.print_exc()
                row["error"] = f"{type(e).__name__}: {e}"[:800]
                skipped[f"model/{impl}/b{batch}"] = row["error"]
            rows.append(row)
        vt, ref = rows[-2].get("tok_s"), rows[-1].get("tok_s")
        if vt and ref:
            rows[-2]["speedup_vs_hf"] = vt / ref
    return rows


# ---- main ------------------------------------------------------------------------------------------


def targets(rows: list[dict[str, Any]]) -> dict[str, str]:
    out = {}
    for heads in (16, 128):
        def ms(backend: str) -> float | None:
            return next((r["ms"] for r in rows if r.get("backend") == backend and r.get("phase") == "decode"
                         and r.get("timed") == "kernel" and (r.get("batch"), r.get("context"), r.get("heads"))
                         == (64, 4096, heads) and "ms" in r), None)
        t, f = ms("TRITON_MLA"), ms("FLASHINFER_MLA")
        key = f"TRITON_MLA decode >= 0.9x FLASHINFER_MLA at 64 x 4096, {heads} heads"
        out[key] = "not measured" if t is None or f is None else f"{f / t:.3g}x ({'met' if f / t >= 0.9 else 'NOT met'})"
    for r in rows:
        if (r.get("backend"), r.get("phase"), r.get("timed")) == ("FLASHINFER_MLA", "decode", "layer") and "ms" in r:
            bare = next((b["ms"] for b in rows if b.get("timed") == "bare_layer" and "ms" in b and all(
                b.get(k) == r.get(k) for k in ("backend", "batch", "context", "heads"))), None)
            key = (f"FLASHINFER_MLA layer over the bare-library layer <= 1.03 (CUDA graphs), {r['batch']} x "
                   f"{r['context']}, {r['heads']} heads")
            ratio = None if bare is None else r["ms"] / bare
            out[key] = "not measured" if ratio is None else f"{ratio:.3g}x ({'met' if ratio <= 1.03 else 'NOT met'})"
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_mla.py needs a CUDA GPU (run it on the device machine), or --device cpu to smoke-test.",
              file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    env = common.env_info(device)
    path = common.result_path(args.name, env)
    roof = roofline.measure(device, quick=True, tiny=device.type != "cuda")
    skipped: dict[str, str] = {}
    rows: list[dict[str, Any]] = []
    with torch.no_grad():
        if "kernels" in args.parts:
            rows += kernel_rows(args, device, roof, skipped)
        if "model" in args.parts:
            rows += model_rows(args, device, skipped)
    summary = {"roofline": roof.to_dict(), "skipped": skipped, "targets": targets(rows), "quick": args.quick,
               "sizes": TINY if device.type != "cuda" else DEEPSEEK, "block_size": BLOCK, "wall_s": time.perf_counter() - t0}
    plots: list[str] = []
    if not args.no_plot:
        panels = []
        for phase, unit in (("decode", "tbps"), ("prefill", "tflops")):
            series: dict[str, tuple[list[float], list[float]]] = {}
            for r in rows:
                if r.get("phase") == phase and r.get("timed") == "kernel" and unit in r:
                    xs, ys = series.setdefault(f"{r['backend']} H{r['heads']}", ([], []))
                    xs.append(float(r["batch"] * r["context"]))
                    ys.append(float(r[unit]))
            panels.append({"title": f"MLA {phase} ({env['device_name']})", "xlabel": "batch x context",
                           "ylabel": "TB/s" if unit == "tbps" else "TFLOP/s", "logx": True, "series": series,
                           "ceilings": {"copy": roof.copy_tbps} if unit == "tbps" else {"bf16 mm": roof.bf16_tflops}})
        png = common.plot_panels(path.with_suffix(".png"), panels, title="MLA kernels")
        plots = [png.name] if png is not None else []
    common.write_results(args.name, {"env": env, "summary": summary, "rows": rows, "plots": plots}, path=path)
    table = common.Table(["backend", "phase", "timed", "batch", "context", "heads", "ms", "tbps", "tflops",
                          "frac_copy_bw", "frac_matmul", "max_abs_diff", "impl", "ms_per_step", "tok_s",
                          "speedup_vs_hf", "error"], title="MLA")
    table.extend(rows)
    table.print()
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

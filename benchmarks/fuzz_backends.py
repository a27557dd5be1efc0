"""Fuzz the attention backends with random mixed batches against a float64 reference.

For every backend and every configuration it serves (bf16 with an ``auto`` cache, fp8 KV
cache; NHD and HND layouts through ``vattn.set_kv_cache_layout``), random batches run through
``vattn.Attention`` (``kv.common_metadata`` -> ``kv.build_metadata`` -> the layer): decodes and
chunked prefills with random context, in any request order, with random padding tokens (slot -1),
over shuffled blocks of a randomly filled cache. Each batch is served or clearly rejected
(``ValueError`` / ``NotImplementedError`` / ``TypeError`` with the cache bit-identical). A served
batch must match a float64 reference written here from the cache's contents (no vattn kernel),
leave every slot it does not write bit-identical and hold the new K/V in the slots it writes.
On CUDA, backends that allow full CUDA graphs also replay a ``vattn.CUDAGraphRunner`` graph at
every captured size and compare it with the eager run of the same batch (outputs and caches)
and with the reference.

Usage (counts and failures go to ``benchmarks/results/fuzz-<device>-<date>.json`` via
``benchmarks.common.write_results``, or ``$OUT``)::

    python benchmarks/fuzz_backends.py --batches 2000          # GPU: TRITON_ATTN, FLASHINFER, FLASH_ATTN, TORCH_SDPA
    python benchmarks/fuzz_backends.py --device cpu --quick    # CPU smoke run (TORCH_SDPA)

Exit status 1 when a batch failed.
"""

from __future__ import annotations

import argparse
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import vattn  # noqa: E402
from benchmarks.common import env_info, progress, split_kv_cache, write_results  # noqa: E402

H, HK, D, BS = 8, 2, 128, 16
GPU_BACKENDS = "TRITON_ATTN,FLASHINFER,FLASH_ATTN,TORCH_SDPA"
_REJECTED = (ValueError, NotImplementedError, TypeError)
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (the fuzz), or cpu for a smoke run")
    p.add_argument("--backends", default=None, help=f"comma-separated (default: {GPU_BACKENDS} on CUDA, TORCH_SDPA on CPU)")
    p.add_argument("--batches", type=int, default=None, help="eager batches per backend, over its configurations "
                   "(default 2000; --quick 16)")
    p.add_argument("--graph-batches", type=int, default=None, help="graph replays per captured size and configuration "
                   "(default 3; --quick 1)")
    p.add_argument("--capture-sizes", default="1,2,4,8,16,24,32,64", help="CUDA-graph capture sizes (tokens)")
    p.add_argument("--kv", default="auto,fp8", help="KV-cache dtypes to try (each where the backend serves it)")
    p.add_argument("--layouts", default="NHD,HND")
    p.add_argument("--max-reqs", type=int, default=16)
    p.add_argument("--max-context", type=int, default=384)
    p.add_argument("--max-query", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a few batches per configuration (a smoke run)")
    p.add_argument("--out", default=None, help="JSON path (default: write_results' place)")
    args = p.parse_args(argv)
    quick = args.quick
    args.batches = args.batches if args.batches is not None else (16 if quick else 2000)
    args.graph_batches = args.graph_batches if args.graph_batches is not None else (1 if quick else 3)
    if quick:
        args.max_reqs, args.max_context, args.max_query = min(args.max_reqs, 6), min(args.max_context, 64), \
            min(args.max_query, 12)
    return args


@dataclass
class Batch:
    """Per-request facts of one step (in batch order) and its block tables."""

    query_lens: list[int]
    context_lens: list[int]
    tables: list[list[int]]
    pad: int
    ordered: bool

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    def describe(self) -> str:
        return f"q={self.query_lens} ctx={self.context_lens} pad={self.pad} ordered={self.ordered}"


def random_batch(rng: np.random.Generator, args: argparse.Namespace, num_blocks: int, *, num_tokens: int | None = None,
                 decode_only: bool = False) -> Batch:
    """Decodes (one token) and prefills (2..max_query, random context), in random or decodes-first
    order; ``num_tokens``: exactly that many tokens (for a capture size)."""
    if num_tokens is not None:
        if decode_only:
            qlens = [1] * num_tokens
        else:
            b = int(rng.integers(1, min(num_tokens, args.max_reqs) + 1))
            cuts = np.sort(rng.choice(np.arange(1, num_tokens), size=b - 1, replace=False)) if b > 1 else []
            qlens = np.diff([0, *cuts, num_tokens]).tolist()
    else:
        b = int(rng.integers(1, args.max_reqs + 1))
        qlens = [1 if decode_only or rng.random() < 0.5 else int(rng.integers(2, args.max_query + 1)) for _ in range(b)]
    ctx = [int(rng.integers(0 if q > 1 else 1, args.max_context + 1)) for q in qlens]
    ordered = decode_only or rng.random() < 0.5
    if ordered:
        order = sorted(range(len(qlens)), key=lambda i: qlens[i] > 1)
        qlens, ctx = [qlens[i] for i in order], [ctx[i] for i in order]
    need = [-(-(c + q) // BS) for c, q in zip(ctx, qlens)]
    perm = rng.permutation(num_blocks).tolist()
    tables, start = [], 0
    for n in need:
        tables.append(perm[start:start + n])
        start += n
    pad = 0 if num_tokens is not None or rng.random() < 0.5 else int(rng.integers(1, 4))
    return Batch(qlens, ctx, tables, pad, ordered)


@dataclass
class Fixture:
    backend: str
    kv_dtype: str
    layout: str
    cfg: vattn.VattnConfig
    layer: vattn.Attention
    kv: vattn.PagedKVCache
    device: torch.device
    dtype: torch.dtype
    k_scale: float = 1.0
    v_scale: float = 1.0
    counts: dict[str, int] = field(default_factory=dict)
    rejections: list[str] = field(default_factory=list)

    @property
    def cache(self) -> torch.Tensor:
        return self.kv.tensors["fuzz.attn"]

    def kv_views(self, cache: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return split_kv_cache(self.cache if cache is None else cache, self.kv.num_blocks)


def make_fixture(backend: str, kv_dtype: str, layout: str, args: argparse.Namespace, sizes: list[int],
                 device: torch.device, num_blocks: int) -> Fixture | None:
    """The layer and cache of one configuration, or None where the backend does not serve it."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cls = vattn.AttentionBackendEnum[backend].get_class()
    if cls.validate_configuration(D, dtype, kv_dtype, BS):
        return None
    vattn.set_kv_cache_layout(layout)
    comp = vattn.CompilationConfig(cudagraph_mode=vattn.CUDAGraphMode.FULL, cudagraph_capture_sizes=tuple(sizes),
                                   max_capture_size=max(sizes))
    cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=BS, cache_dtype=kv_dtype), compilation=comp)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with vattn.set_current_vattn_config(cfg):
            layer = vattn.Attention(H, D, D**-0.5, num_kv_heads=HK, prefix="fuzz.attn", attn_backend=backend)
    finally:
        torch.set_default_dtype(old)
    layer.to(device)
    fx = Fixture(backend, kv_dtype, layout, cfg, layer, None, device, dtype)  # type: ignore[arg-type]
    if kv_dtype.startswith("fp8"):
        fx.k_scale, fx.v_scale = 0.5, 0.25
        layer.set_kv_scales(fx.k_scale, fx.v_scale)
    fx.kv = vattn.allocate_kv_cache(cfg, num_blocks=num_blocks, device=device, dtype=dtype)
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    fx.cache.copy_((torch.randn(fx.cache.shape, generator=gen) * 1.5).to(fx.cache.dtype))
    return fx


# ---- the float64 reference (no vattn code) ------------------------------------------------


def _read(stored: torch.Tensor, scale: float) -> torch.Tensor:
    x = stored.double()
    return x * scale if stored.dtype in _FP8 else x


def _through_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """What a cache of ``cache_dtype`` stores for ``x`` (fp8: saturating ``x / scale``)."""
    if cache_dtype in _FP8:
        fi = torch.finfo(cache_dtype)
        return (x.float() / scale).clamp(fi.min, fi.max).to(cache_dtype)
    return x.to(cache_dtype)


def reference(fx: Fixture, batch: Batch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              cache_before: torch.Tensor) -> torch.Tensor:
    """(T, H, D) float64: causal GQA attention of each request's new tokens over its cached
    context (read from ``cache_before``) and its new K/V (as the cache stores them)."""
    kc, vc = fx.kv_views(cache_before)
    cd = kc.dtype
    qx = q.view(-1, H, D)
    quant = fx.layer.query_quant
    if quant is not None:  # the layer feeds the kernel fp8 queries (static scale 1)
        fi = torch.finfo(quant.dtype)
        qx = qx.float().clamp(fi.min, fi.max).to(quant.dtype)
    qx = qx.double()
    out = torch.empty(batch.num_tokens, H, D, dtype=torch.float64, device=q.device)
    start = 0
    for table, ctx, ql in zip(batch.tables, batch.context_lens, batch.query_lens):
        pos = torch.arange(ctx, device=q.device)
        blk = torch.tensor(table, device=q.device)[pos // BS] if ctx else pos
        keys = torch.cat([_read(kc[blk, pos % BS], fx.k_scale),
                          _read(_through_cache(k[start:start + ql].view(-1, HK, D), cd, fx.k_scale), fx.k_scale)])
        vals = torch.cat([_read(vc[blk, pos % BS], fx.v_scale),
                          _read(_through_cache(v[start:start + ql].view(-1, HK, D), cd, fx.v_scale), fx.v_scale)])
        keys, vals = keys.repeat_interleave(H // HK, 1), vals.repeat_interleave(H // HK, 1)
        s = torch.einsum("qhd,khd->hqk", qx[start:start + ql], keys) * D**-0.5
        qpos = torch.arange(ctx, ctx + ql, device=q.device)[:, None]
        s = s.masked_fill(torch.arange(ctx + ql, device=q.device)[None, :] > qpos, float("-inf"))
        out[start:start + ql] = torch.einsum("hqk,khd->qhd", s.softmax(-1), vals)
        start += ql
    return out


# ---- one batch --------------------------------------------------------------------------------


def _slots(batch: Batch) -> list[int]:
    out = []
    for table, ctx, ql in zip(batch.tables, batch.context_lens, batch.query_lens):
        out += [table[p // BS] * BS + p % BS for p in range(ctx, ctx + ql)]
    return out


def check_cache(fx: Fixture, batch: Batch, before: torch.Tensor, after: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> str | None:
    """Untouched slots bit-identical, written slots holding the new K/V; None or what differs."""
    slots = torch.tensor(_slots(batch), dtype=torch.long, device=before.device)
    for which, (b_view, a_view, new, scale) in enumerate(zip(fx.kv_views(before), fx.kv_views(after), (k, v),
                                                             (fx.k_scale, fx.v_scale))):
        nb = b_view.shape[0]
        b_bytes = b_view.contiguous().view(torch.uint8).reshape(nb * BS, -1)
        a_bytes = a_view.contiguous().view(torch.uint8).reshape(nb * BS, -1)
        keep = torch.ones(nb * BS, dtype=torch.bool, device=before.device)
        keep[slots] = False
        changed = (b_bytes[keep] != a_bytes[keep]).any(-1)
        if bool(changed.any()):
            idx = keep.nonzero().flatten()[changed]
            return f"{'kv'[which]} cache: {int(changed.sum())} slots outside slot_mapping changed, e.g. {idx[:6].tolist()}"
        want = _through_cache(new[: slots.numel()].view(-1, HK, D), a_view.dtype, scale)
        got = a_view[slots // BS, slots % BS]
        if a_view.dtype in _FP8:  # the kernel's rounding of x / scale may differ by one fp8 step
            ok = torch.isclose(got.float(), want.float(), rtol=0.13, atol=2.0**-9)
        else:
            ok = got.view(torch.uint8) == want.contiguous().view(torch.uint8)
        if not bool(ok.all()):
            return f"{'kv'[which]} cache: written slots do not hold the new {'kv'[which]} rows"
    return None


def _tolerance(fx: Fixture) -> tuple[float, float]:
    if fx.kv_dtype.startswith("fp8"):
        return 6e-2, 6e-2
    return (2e-2, 2e-2) if fx.dtype == torch.bfloat16 else (1e-4, 1e-4)


def _inputs(fx: Fixture, batch: Batch, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    t = batch.num_tokens + batch.pad
    q = torch.randn(t, H * D, generator=gen).to(fx.dtype).to(fx.device)
    k = torch.randn(t, HK * D, generator=gen).to(fx.dtype).to(fx.device)
    v = torch.randn(t, HK * D, generator=gen).to(fx.dtype).to(fx.device)
    return q, k, v


def eager(fx: Fixture, common: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    with vattn.set_forward_context(fx.kv.build_metadata(common), fx.cfg), torch.no_grad():
        return fx.layer(q, k, v)


def fuzz_one(fx: Fixture, batch: Batch, gen: torch.Generator, runner: Any = None) -> dict[str, Any] | None:
    """Run one batch eagerly (and through ``runner`` when given); None, or the failure."""
    q, k, v = _inputs(fx, batch, gen)
    t = batch.num_tokens
    before = fx.cache.clone()
    try:
        common = fx.kv.common_metadata(batch.query_lens, batch.context_lens, batch.tables,
                                       num_tokens_padded=t + batch.pad)
        out = eager(fx, common, q, k, v)
    except _REJECTED as e:  # served or clearly rejected: a rejection must leave the cache as it was
        fx.counts["rejected"] = fx.counts.get("rejected", 0) + 1
        fx.rejections.append(f"{batch.describe()}: {type(e).__name__}: {e}"[:400])
        if not torch.equal(before.view(torch.uint8), fx.cache.view(torch.uint8)):
            return {"kind": "rejected_cache_changed", "detail": f"{type(e).__name__}: {e}"[:300]}
        fx.cache.copy_(before)
        return None
    except Exception as e:  # noqa: BLE001
        return {"kind": "error", "detail": f"{type(e).__name__}: {e}"[:300]}
    ref = reference(fx, batch, q[:t], k[:t], v[:t], before)
    atol, rtol = _tolerance(fx)
    got = out[:t].view(-1, H, D).double()
    err = (got - ref).abs()
    bad = err > atol + rtol * ref.abs()
    if not torch.isfinite(got).all() or bool(bad.any()):
        return {"kind": "mismatch", "detail": f"max abs err {float(err.max()):.4g} ({int(bad.sum())} values)"}
    after = fx.cache.clone()
    why = check_cache(fx, batch, before, after, k, v)
    if why:
        return {"kind": "cache", "detail": why}
    if runner is not None:  # the same batch replayed from a graph on the same cache contents
        fx.cache.copy_(before)
        try:
            common = fx.kv.common_metadata(batch.query_lens, batch.context_lens, batch.tables)
            graph_out = runner(q[:t], k[:t], v[:t], common)
        except Exception as e:  # noqa: BLE001
            return {"kind": "graph_error", "detail": f"{type(e).__name__}: {e}"[:300]}
        bd = runner.last_batch_descriptor
        mode = bd.mode.name if bd is not None else "NONE"
        fx.counts[f"graph_{mode.lower()}"] = fx.counts.get(f"graph_{mode.lower()}", 0) + 1
        g = graph_out[:t].view(-1, H, D).double()
        if not torch.isfinite(g).all() or bool(((g - ref).abs() > atol + rtol * ref.abs()).any()):
            return {"kind": "graph_mismatch", "detail": f"{mode}: max abs err vs reference {float((g - ref).abs().max()):.4g}"}
        if bool(((g - got).abs() > atol + rtol * got.abs()).any()):
            return {"kind": "graph_vs_eager", "detail": f"{mode}: max abs diff {float((g - got).abs().max()):.4g}"}
        if not torch.equal(fx.cache.view(torch.uint8), after.view(torch.uint8)):
            return {"kind": "graph_cache", "detail": f"{mode}: the replay left other cache contents than eager"}
    return None


def _support(fx: Fixture) -> vattn.AttentionCGSupport:
    """The group builder's full-graph support (FLASH_ATTN's depends on the installed interface)."""
    return min(g.builder.cudagraph_support for g in fx.kv.groups)


def make_runner(fx: Fixture, sizes: list[int]) -> Any:
    """A CUDAGraphRunner over the layer (FULL; FULL_DECODE_ONLY where the builder allows decodes
    only), or None where no full graph is possible (no CUDA, or cudagraph_support NEVER)."""
    if fx.device.type != "cuda" or _support(fx) == vattn.AttentionCGSupport.NEVER:
        return None
    layer = fx.layer

    class Step(torch.nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return layer(q, k, v)

    inputs = [vattn.GraphInput(fx.dtype, (H * D,), name="q"), vattn.GraphInput(fx.dtype, (HK * D,), name="k"),
              vattn.GraphInput(fx.dtype, (HK * D,), name="v")]
    runner = vattn.CUDAGraphRunner(Step(), fx.cfg, fx.kv, inputs=inputs, capture_sizes=sizes,
                                   mode=vattn.CUDAGraphMode.FULL, show_progress=False)
    runner.capture()
    return runner


def fuzz_backend(backend: str, args: argparse.Namespace, device: torch.device, sizes: list[int],
                 rejections: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(one row per configuration, the failures) for one backend; appends to ``rejections``
    (batches a backend refused: random batches are valid, so each deserves a look)."""
    num_blocks = args.max_reqs * -(-(args.max_context + args.max_query) // BS) + 8
    configs = [(kv, lay) for kv in args.kv.split(",") for lay in args.layouts.split(",")]
    rows, failures = [], []
    fixtures = []
    for kv_dtype, layout in configs:
        try:
            fx = make_fixture(backend, kv_dtype, layout, args, sizes, device, num_blocks)
        except Exception as e:  # noqa: BLE001  (a backend that cannot be built here)
            rows.append({"backend": backend, "kv": kv_dtype, "layout": layout, "served": False,
                         "why": f"{type(e).__name__}: {e}"[:200]})
            continue
        if fx is None:
            rows.append({"backend": backend, "kv": kv_dtype, "layout": layout, "served": False, "why": "not served"})
            continue
        fixtures.append(fx)
    if not fixtures:
        return rows, failures
    per = -(-args.batches // len(fixtures))
    for i, fx in enumerate(fixtures):
        vattn.set_kv_cache_layout(fx.layout)
        rng = np.random.default_rng([args.seed, i, zlib.crc32(backend.encode())])
        gen = torch.Generator().manual_seed(args.seed * 7 + i)
        t0 = time.perf_counter()
        n_fail = 0
        for b in progress(range(per), desc=f"{backend} {fx.kv_dtype} {fx.layout}"):
            batch = random_batch(rng, args, fx.kv.num_blocks)
            fail = fuzz_one(fx, batch, gen)
            if fail:
                n_fail += 1
                failures.append({"backend": backend, "kv": fx.kv_dtype, "layout": fx.layout, "batch": b,
                                 "graph": False, "desc": batch.describe(), **fail})
        graph_batches = graph_fails = 0
        runner = None
        try:
            runner = make_runner(fx, sizes)
        except Exception as e:  # noqa: BLE001
            failures.append({"backend": backend, "kv": fx.kv_dtype, "layout": fx.layout, "graph": True,
                             "kind": "capture", "detail": f"{type(e).__name__}: {e}"[:300]})
            graph_fails += 1
        if runner is not None:
            # Mixed batches replay full graphs only where the builder allows any batch (ALWAYS).
            decode_only = _support(fx) < vattn.AttentionCGSupport.ALWAYS
            lower = 0
            for n in sizes:
                for _ in range(args.graph_batches):
                    tokens = int(rng.integers(lower + 1, n + 1))
                    batch = random_batch(rng, args, fx.kv.num_blocks, num_tokens=tokens, decode_only=decode_only)
                    fail = fuzz_one(fx, batch, gen, runner)
                    graph_batches += 1
                    if fail:
                        graph_fails += 1
                        failures.append({"backend": backend, "kv": fx.kv_dtype, "layout": fx.layout, "graph": True,
                                         "size": n, "desc": batch.describe(), **fail})
                lower = n
            runner.release()
        rejections += [{"backend": backend, "kv": fx.kv_dtype, "layout": fx.layout, "why": r} for r in fx.rejections[:20]]
        rows.append({"backend": backend, "kv": fx.kv_dtype, "layout": fx.layout, "served": True, "batches": per,
                     "failures": n_fail, "rejected": fx.counts.get("rejected", 0), "graph_batches": graph_batches,
                     "graph_failures": graph_fails, "graph_full": fx.counts.get("graph_full", 0),
                     "graph_piecewise_or_none": fx.counts.get("graph_none", 0) + fx.counts.get("graph_piecewise", 0),
                     "seconds": round(time.perf_counter() - t0, 1)})
        print(rows[-1], flush=True)
    vattn.set_kv_cache_layout(None)
    return rows, failures


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("fuzz_backends.py needs a CUDA GPU (run it on the device machine), or --device cpu to smoke-test.")
    backends = (args.backends or (GPU_BACKENDS if device.type == "cuda" else "TORCH_SDPA")).split(",")
    sizes = sorted({int(s) for s in args.capture_sizes.split(",")})
    rows, failures, rejections = [], [], []
    for backend in backends:
        r, f = fuzz_backend(backend, args, device, sizes, rejections)
        rows += r
        failures += f
    served = [r for r in rows if r.get("served")]
    summary = {
        "batches_per_backend": {b: sum(r["batches"] for r in served if r["backend"] == b) for b in backends},
        "graph_batches_per_backend": {b: sum(r["graph_batches"] for r in served if r["backend"] == b) for b in backends},
        "failures": len(failures), "failure_list": failures[:200], "rejections": rejections[:100], "args": vars(args),
        "reference": "float64, per request, from the cache contents (no vattn kernel)",
    }
    payload = {"rows": rows, "summary": summary, "env": env_info(device)}
    path = write_results("fuzz", payload, path=args.out)
    print(f"{len(failures)} failures; batches per backend {summary['batches_per_backend']}, graph batches "
          f"{summary['graph_batches_per_backend']} -> {path}")
    for f in failures[:20]:
        print("  ", f)
    for r in rejections[:10]:
        print("   rejected:", r)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

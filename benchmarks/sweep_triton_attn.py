"""Config sweep of vattn's Triton unified attention on issue 5's shapes (one device call).

Compiles every variant of a plan in parallel worker processes first (Triton's on-disk cache
then serves the timing process), checks each variant's output against a float32 torch
reference on a subset of the batch (``rel_err`` = ||out - ref|| / ||ref||), and times it with
``common.bench_cuda_graph`` (replays of a captured call: median, L2 flushed; no host
launch overhead). Prints a table per case, fastest first; writes JSON
(``common.write_results``) to ``$OUT`` or ``benchmarks/results/``.

    PYTHONPATH=$PWD python benchmarks/sweep_triton_attn.py [--plan full] [--jobs 12]

Variants: ``(case, block_m, tile_n, num_warps, num_stages, num_splits, fp8_compute)``;
``fp8_compute`` sets ``vattn.backends.triton.paged_attention.FP8_KV_COMPUTE`` (fp8 cases only).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import logging
import multiprocessing as mp
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import bench_triton_attn as bta  # noqa: E402
from benchmarks import common  # noqa: E402
from vattn.backends.triton import config as tcfg  # noqa: E402
from vattn.backends.triton import paged_attention as tua  # noqa: E402

logger = logging.getLogger("vattn.benchmarks.sweep_triton_attn")


class Variant(NamedTuple):
    case: str
    block_m: int
    tile_n: int
    num_warps: int
    num_stages: int
    num_splits: int = 1
    fp8_compute: str = "fp16"
    maxnreg: int | None = None
    v_asm: bool = True
    one_loop: bool = False

    @property
    def config(self) -> tcfg.UnifiedAttentionConfig:
        return tcfg.UnifiedAttentionConfig(self.block_m, self.tile_n, self.num_splits, self.num_warps,
                                          self.num_stages, self.maxnreg, self.one_loop)


def _plan_full() -> list[Variant]:
    v: list[Variant] = []
    for n, st, w in [(32, 3, 4), (32, 4, 4), (32, 5, 4), (64, 2, 4), (64, 3, 4), (64, 4, 4),
                     (128, 2, 4), (128, 2, 8), (128, 3, 8), (64, 3, 8)]:
        for s in (1, 2):
            v.append(Variant("decode_64x4096", 16, n, w, st, s))
    for n, st, w in [(32, 4, 4), (64, 3, 4), (64, 4, 4), (128, 2, 4), (128, 3, 4), (128, 3, 8), (256, 2, 8)]:
        for s in (1, 2):
            v.append(Variant("decode_64x4096_fp8", 16, n, w, st, s, "fp16"))
    for n, st, w in [(32, 3, 4), (64, 3, 4), (128, 3, 8)]:
        v.append(Variant("decode_64x4096_fp8", 16, n, w, st, 1, "bf16"))
    for m, n, w, st in [(128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (64, 64, 4, 3),
                        (64, 64, 4, 4), (128, 32, 8, 3), (64, 128, 4, 2)]:
        v.append(Variant("prefill_8x2048", m, n, w, st))
    for n, st in [(64, 3), (32, 4), (64, 4)]:
        v.append(Variant("decode_1x32768", 16, n, 4, st, 64))
    for n, st in [(64, 3), (32, 4)]:
        v.append(Variant("decode_4x32768", 16, n, 4, st, 16))
    return v


def _plan_smoke() -> list[Variant]:
    return [Variant("decode_64x4096", 16, 16, 4, 2, 1), Variant("decode_64x4096", 16, 32, 4, 3, 2),
            Variant("decode_64x4096_fp8", 16, 32, 4, 3, 1, "bf16"), Variant("prefill_8x2048", 32, 16, 4, 2)]


def _plan_fp8() -> list[Variant]:
    """Second round: fp8 value tiles converted before the dot layout, register caps."""
    v: list[Variant] = []
    f8 = "decode_64x4096_fp8"
    for n, st, w, reg in [(64, 3, 4, None), (64, 4, 4, None), (64, 3, 4, 128), (64, 4, 4, 128), (64, 5, 4, 128),
                          (128, 2, 4, None), (128, 3, 4, None), (128, 3, 4, 168), (128, 2, 4, 128),
                          (32, 4, 4, None), (128, 3, 8, None)]:
        v.append(Variant(f8, 16, n, w, st, 1, "fp16", reg))
    v += [Variant(f8, 16, 64, 4, 3, 2, "fp16", 128), Variant(f8, 16, 128, 4, 3, 2),
          Variant(f8, 16, 128, 4, 3, 1, "fp16", None, False)]
    d = "decode_64x4096"
    v += [Variant(d, 16, 32, 4, 3), Variant(d, 16, 32, 4, 4), Variant(d, 16, 32, 4, 3, 1, "fp16", 96),
          Variant(d, 16, 32, 4, 4, 1, "fp16", 96), Variant(d, 16, 64, 4, 3, 1, "fp16", 128),
          Variant(d, 16, 64, 4, 4, 1, "fp16", 128), Variant(d, 16, 128, 4, 2)]
    for case, splits in (("decode_1x32768", (32, 64)), ("decode_4x32768", (16, 32))):
        for s in splits:
            v += [Variant(case, 16, 32, 4, 3, s), Variant(case, 16, 32, 4, 4, s)]
    p = "prefill_8x2048"
    v += [Variant(p, 128, 64, 8, 3), Variant(p, 128, 64, 8, 4), Variant(p, 128, 64, 8, 5),
          Variant(p, 128, 32, 8, 4), Variant(p, 128, 128, 8, 3, 1, "fp16", 255)]
    return v


def _plan_r3() -> list[Variant]:
    """Third round: one offset tensor for K and V, unsigned page arithmetic, fp8 keys via PTX."""
    v: list[Variant] = []
    f8 = "decode_64x4096_fp8"
    for n, st, w, reg in [(64, 3, 4, 128), (64, 3, 4, None), (128, 3, 4, None), (128, 3, 4, 168), (32, 3, 4, None),
                          (32, 4, 4, None), (64, 4, 4, 128)]:
        v.append(Variant(f8, 16, n, w, st, 1, "fp16", reg))
    d = "decode_64x4096"
    v += [Variant(d, 16, 32, 4, 3), Variant(d, 16, 32, 4, 4), Variant(d, 16, 32, 4, 3, 1, "fp16", 96),
          Variant(d, 16, 64, 4, 3, 1, "fp16", 128), Variant(d, 16, 64, 4, 4, 1, "fp16", 128), Variant(d, 16, 128, 4, 2),
          Variant(d, 16, 32, 4, 3)]
    for case, splits in (("decode_1x32768", 64), ("decode_4x32768", 16)):
        v += [Variant(case, 16, 32, 4, 3, splits), Variant(case, 16, 32, 4, 4, splits),
              Variant(case, 16, 64, 4, 3, splits, "fp16", 128)]
    p = "prefill_8x2048"
    v += [Variant(p, 128, 64, 8, 3), Variant(p, 128, 64, 8, 4), Variant(p, 128, 128, 8, 3, 1, "fp16", 255)]
    return v


def _plan_r4() -> list[Variant]:
    """Fourth round: decode tiles in one masked loop (no pipeline drain before the last tile)."""
    v: list[Variant] = []
    for one in (False, True):
        v += [Variant("decode_64x4096", 16, 32, 4, 3, 1, "fp16", None, True, one),
              Variant("decode_64x4096", 16, 32, 4, 4, 1, "fp16", None, True, one),
              Variant("decode_64x4096_fp8", 16, 128, 4, 3, 1, "fp16", None, True, one),
              Variant("decode_64x4096_fp8", 16, 64, 4, 3, 1, "fp16", 128, True, one)]
        for case, splits in (("decode_1x32768", 64), ("decode_4x32768", 16)):
            v += [Variant(case, 16, 32, 4, 3, splits, "fp16", None, True, one),
                  Variant(case, 16, 32, 4, 4, splits, "fp16", None, True, one)]
    v += [Variant("decode_64x4096", 16, 32, 4, 3, 1, "fp16", None, True, True),
          Variant("decode_64x4096_fp8", 16, 128, 4, 3, 1, "fp16", None, True, True),
          Variant("decode_64x4096_fp8", 16, 128, 4, 4, 1, "fp16", None, True, True),
          Variant("decode_64x4096_fp8", 16, 64, 4, 4, 1, "fp16", 128, True, True),
          Variant("decode_64x4096_fp8", 16, 64, 4, 3, 2, "fp16", 128, True, True),
          Variant("prefill_8x2048", 128, 64, 8, 3)]
    return v


def _plan_e2e() -> list[Variant]:
    """The example model's decode shapes (Llama-3.2-1B: 32 q / 8 KV heads, head dim 64; issue 4)."""
    v: list[Variant] = []
    tail = ("fp16", None, True, True)
    for n, st in [(16, 3), (32, 2), (32, 3), (32, 4), (64, 2), (64, 3), (64, 4), (128, 2), (128, 3)]:
        for s in (1, 2):
            v.append(Variant("d64_decode_64x512", 16, n, 4, st, s, *tail))
    for n, st in [(32, 3), (64, 3), (64, 4), (128, 3)]:
        v.append(Variant("d64_decode_64x4096", 16, n, 4, st, 1, *tail))
    for s in (8, 16, 32, 64):
        for n in (16, 32, 64):
            v.append(Variant("d64_decode_1x512", 16, n, 4, 3, s, *tail))
    for s in (2, 4, 8, 16):
        for n in (32, 64):
            v.append(Variant("d64_decode_8x512", 16, n, 4, 3, s, *tail))
    return v


def _e2e_setup() -> None:
    """Adds the head-dim-64 decode cases (``_batch`` sets the head dim of each case)."""
    bta.CASES = [c for c in bta.CASES if not c.name.startswith("d64_")] + [
        bta.Case("d64_decode_64x512", 64, 512, 1), bta.Case("d64_decode_64x4096", 64, 4096, 1),
        bta.Case("d64_decode_1x512", 1, 512, 1), bta.Case("d64_decode_8x512", 8, 512, 1)]


PLANS = {"full": _plan_full, "smoke": _plan_smoke, "fp8": _plan_fp8, "r3": _plan_r3, "r4": _plan_r4,
         "e2e": _plan_e2e}
SETUPS = {"e2e": _e2e_setup}


def _smoke_setup() -> None:
    """Tiny same-named cases on the CPU (the Triton interpreter), to check this script."""
    bta.DEVICE = "cpu"
    bta.H, bta.HK, bta.D = 4, 2, 32
    bta.CASES = [bta.Case("decode_64x4096", 3, 37, 1), bta.Case("prefill_8x2048", 2, 0, 21),
                 bta.Case("decode_64x4096_fp8", 3, 37, 1, torch.float8_e4m3fn)]

_BATCHES: dict[str, bta.Batch] = {}


def _batch(case_name: str) -> bta.Batch:
    if case_name not in _BATCHES:
        _BATCHES.clear()
        common.free_memory()
        case = next(c for c in bta.CASES if c.name == case_name)
        if bta.DEVICE != "cpu":  # head dim of the case (the smoke run keeps its tiny one)
            bta.D = 64 if case_name.startswith("d64_") else 128
        _BATCHES[case_name] = bta.Batch(case)
    return _BATCHES[case_name]


def _set_compute(v: Variant) -> None:
    tua.FP8_KV_COMPUTE = {"fp16": torch.float16, "bf16": None}[v.fp8_compute]
    tua.FP8_V_ASM = v.v_asm


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _compile(variants: list[Variant], smoke: bool = False, plan: str = "") -> list[tuple[Variant, float, str | None]]:
    """Worker: build (and run once) each variant, filling Triton's cache."""
    if smoke:
        _smoke_setup()
    elif plan in SETUPS:
        SETUPS[plan]()
    out = []
    for v in variants:
        t0 = time.perf_counter()
        try:
            _set_compute(v)
            b = _batch(v.case)
            bta.triton_fn(b, v.config, torch.empty_like(b.out))()
            _sync()
            err = None
        except Exception as e:  # e.g. out of shared memory: reported, not fatal
            err = f"{type(e).__name__}: {str(e)[:300]}"
        out.append((v, time.perf_counter() - t0, err))
    return out


def _gather(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """(len(pages) * page, Hk, D) rows of ``cache`` (fp8 gathered as bytes)."""
    return cache.view(torch.uint8)[pages].view(cache.dtype).reshape(-1, bta.HK, bta.D)


def reference(b: bta.Batch, rows: int) -> tuple[torch.Tensor, slice]:
    """float32 attention of the first ``rows`` sequences (their output rows, and that slice)."""
    c = b.case
    outs = []
    for i in range(rows):
        pages = b.block_table[i]
        k = _gather(b.k_cache, pages)[: c.seq_len].float()
        v = _gather(b.v_cache, pages)[: c.seq_len].float()
        q = b.q[i * c.q_len : (i + 1) * c.q_len].float()
        rep = bta.H // bta.HK
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) * bta.D**-0.5
        qpos = c.context + torch.arange(c.q_len, device=s.device)
        mask = torch.arange(c.seq_len, device=s.device)[None, :] > qpos[:, None]
        s.masked_fill_(mask[None], float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v))
    return torch.cat(outs), slice(0, rows * c.q_len)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", default="full", choices=sorted(PLANS))
    parser.add_argument("--jobs", type=int, default=12, help="parallel compile processes")
    parser.add_argument("--cases", default=None, help="comma-separated case names (default: the plan's)")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU dry run under TRITON_INTERPRET=1 with tiny batches (checks the script)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.smoke:
        _smoke_setup()
    elif args.plan in SETUPS:
        SETUPS[args.plan]()
    if not args.smoke and not torch.cuda.is_available():
        print("sweep_triton_attn needs a CUDA GPU.", file=sys.stderr)
        return 2
    variants = PLANS[args.plan]()
    if args.cases:
        variants = [v for v in variants if v.case in args.cases.split(",")]
    t0 = time.perf_counter()
    by_case: dict[str, list[Variant]] = {}
    for v in variants:
        by_case.setdefault(v.case, []).append(v)
    chunks: list[list[Variant]] = [[] for _ in range(max(1, args.jobs))]
    for i, v in enumerate(sorted(variants, key=lambda v: v.case)):  # same case together: one Batch per worker
        chunks[i * len(chunks) // len(variants)].append(v)
    errors: dict[Variant, str] = {}
    with cf.ProcessPoolExecutor(len(chunks), mp_context=mp.get_context("spawn")) as pool:
        work = [c for c in chunks if c]
        for res in common.progress(pool.map(_compile, work, [args.smoke] * len(work), [args.plan] * len(work)), desc="compile",
                                   total=sum(1 for c in chunks if c)):
            for v, _, err in res:
                if err:
                    errors[v] = err
    print(f"compiled {len(variants)} variants in {time.perf_counter() - t0:.1f} s; {len(errors)} failed", flush=True)
    rows: list[dict[str, Any]] = []
    for case_name, vs in by_case.items():
        b = _batch(case_name)
        ref, sl = reference(b, min(b.case.num_seqs, 2 if b.case.q_len > 1 else 8))
        for v in common.progress(vs, desc=case_name):
            row: dict[str, Any] = {**v._asdict()}
            if v in errors:
                row["error"] = errors[v]
                rows.append(row)
                continue
            _set_compute(v)
            out = torch.full_like(b.out, float("nan"))
            fn = bta.triton_fn(b, v.config, out)
            fn()
            _sync()
            got = out[sl].float()
            rel = ((got - ref).norm() / ref.norm()).item()
            r = common.bench_cuda_graph(fn, warmup=10, rep=40) if torch.cuda.is_available() else \
                common.bench(fn, warmup=10, rep=40)
            row.update(ms=r["median_ms"], p20=r["p20"], p80=r["p80"], rel_err=rel,
                       nan=bool(torch.isnan(out).any().item()),
                       tbps=b.kv_bytes / (r["median_ms"] * 1e-3) / 1e12,
                       tflops=b.flops / (r["median_ms"] * 1e-3) / 1e12)
            rows.append(row)
    path = common.write_results("triton_attn_sweep", {"rows": rows, "summary": {"plan": args.plan,
                                "errors": {str(k): e for k, e in errors.items()}}})
    for case_name in by_case:
        t = common.Table(["block_m", "tile_n", "num_warps", "num_stages", "num_splits", "fp8_compute", "maxnreg",
                          "v_asm", "one_loop", "ms",
                          "tbps", "tflops", "rel_err", "nan"], title=case_name)
        t.extend(sorted((r for r in rows if r["case"] == case_name and "ms" in r), key=lambda r: r["ms"]))
        t.print()
    for v, e in errors.items():
        print("FAILED", v, e[:160])
    print("wrote", path, f"total {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""TRITON_ATTN kernels on issue 5's shapes, beside FlashInfer and flash-attn-4, in one run.

Shapes: 32 query heads, 8 KV heads, head dim 128, bf16, page (block) size 16, random
block tables over a shared pool, random K/V (never zeros):

| case | what | target (throughput ratio) |
| --- | --- | --- |
| ``decode_64x4096`` | 64 sequences x 4096 context, one new token each | >= 0.9x FlashInfer and flash-attn-4 |
| ``decode_{1,2,4}x32768`` | small-batch long-context decode (split-KV) | >= 0.8x FlashInfer |
| ``prefill_8x2048`` | 8 causal prompts of 2048 tokens, varlen, paged | >= 0.7x flash-attn-4 |
| ``decode_64x4096_fp8`` | e4m3 KV cache | >= 1.5x the same kernel's bf16 throughput |

Providers: ``vattn_triton`` (``unified_attention`` with the config the TRITON_ATTN builder
picks, split scratch preallocated), FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper``
(``use_tensor_cores=True``) and flash-attn-4's ``flash_attn_varlen_func`` with
``page_table``/``seqused_k``, when importable (else a note in ``summary.skipped``). Every
provider is timed replaying a CUDA graph of one call (``common.bench_cuda_graph``: median,
L2 flushed); ``vattn_triton_eager`` adds the launcher's host overhead. ``--sweep`` also times
config variants of the Triton kernel (tile sizes, warps, stages, splits) and reports the best.

Row columns: ``ms``, ``tbps`` (KV bytes read / time), ``tflops`` (prefill: 4*H*D*pairs / time),
``frac_copy_bw`` (of the device copy bandwidth measured in the same run), ``max_abs_diff``
against the vattn output. ``summary.ratios`` and ``summary.targets`` hold the ratios.

Libraries not installed in this run: with ``--reference-json auto`` (default) the FlashInfer /
flash-attn-4 rows of the newest earlier result file for the same device model fill in, each
marked with a ``source`` column (file, date, library versions) and listed under
``summary.reference_rows``, so the ratios are then across two runs on the same GPU model.
A PNG (decode TB/s against the copy bandwidth, prefill TFLOP/s) is written beside the JSON
and listed under ``plots``.

Run on the GPU machine: ``PYTHONPATH=$PWD python benchmarks/bench_triton_attn.py [--sweep] [--quick]``;
``benchmarks/sweep_triton_attn.py`` times config variants of the kernel (how the defaults were chosen).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any, Callable

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common, roofline  # noqa: E402
from vattn.backends.triton import config as tcfg  # noqa: E402
from vattn.backends.triton import paged_attention as tua  # noqa: E402

logger = logging.getLogger("vattn.benchmarks.triton_attn")

H, HK, D, PAGE = 32, 8, 128, 16
DEVICE = "cuda"  # a CPU dry run (Triton interpreter, tiny shapes) may change these module constants


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    num_seqs: int
    context: int  # cached tokens before the step
    q_len: int  # new tokens per sequence
    kv_dtype: torch.dtype = torch.bfloat16

    @property
    def seq_len(self) -> int:
        return self.context + self.q_len


CASES = [
    Case("decode_64x4096", 64, 4096, 1),
    Case("decode_1x32768", 1, 32768, 1),
    Case("decode_2x32768", 2, 32768, 1),
    Case("decode_4x32768", 4, 32768, 1),
    Case("prefill_8x2048", 8, 0, 2048),
    Case("decode_64x4096_fp8", 64, 4096, 1, torch.float8_e4m3fn),
]

# (block_m, tile_n, num_warps, num_stages) variants timed with --sweep; num_splits: the default's.
SWEEP_DECODE = [(16, 64, 4, 2), (16, 64, 4, 3), (16, 64, 4, 5), (16, 32, 4, 3), (16, 128, 4, 2),
                (16, 64, 8, 3), (16, 128, 8, 3)]
SWEEP_PREFILL = [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 8, 4)]


class Batch:
    """One case's inputs on the GPU: q, paged K/V, block table, lengths, output buffers."""

    def __init__(self, case: Case, seed: int = 0) -> None:
        dev = torch.device(DEVICE)
        b, s = case.num_seqs, case.seq_len
        pages = math.ceil(s / PAGE)
        self.num_blocks = b * pages + 8
        gen = torch.Generator(device="cpu").manual_seed(seed)
        perm = torch.randperm(self.num_blocks, generator=gen)[: b * pages]
        self.block_table = perm.view(b, pages).to(torch.int32).to(dev)
        self.kv = torch.empty(2, self.num_blocks, PAGE, HK, D, dtype=case.kv_dtype, device=dev)
        common.fill_random_kv_(self.kv[0], self.kv[1], seed)
        self.k_cache, self.v_cache = self.kv[0], self.kv[1]
        self.seq_lens = torch.full((b,), s, dtype=torch.int32, device=dev)
        self.cu_q = torch.arange(0, b * case.q_len + 1, case.q_len, dtype=torch.int32, device=dev)
        t = b * case.q_len
        self.q = torch.randn(t, H, D, dtype=torch.bfloat16, device=dev)
        self.out = torch.empty_like(self.q)
        self.one = torch.ones((), dtype=torch.float32, device=dev)
        self.case = case

    @property
    def kv_bytes(self) -> int:
        c = self.case
        return c.num_seqs * c.seq_len * HK * D * 2 * self.kv.element_size()

    @property
    def flops(self) -> float:
        c = self.case
        pairs = c.q_len * c.context + c.q_len * (c.q_len + 1) / 2  # causal
        return 4.0 * H * D * pairs * c.num_seqs


def default_config(batch: Batch, num_sms: int) -> tcfg.UnifiedAttentionConfig:
    """The config the TRITON_ATTN builder would pick for this batch."""
    c = batch.case
    return tcfg.select_unified_attention_config(
        num_tokens=batch.q.shape[0], num_seqs=c.num_seqs, num_q_heads=H, num_kv_heads=HK, head_size=D,
        max_seqlen_q=c.q_len, num_sms=num_sms, max_split_rows=tcfg.default_max_split_rows(H, D),
        kv_fp8=c.kv_dtype != torch.bfloat16)


def triton_fn(batch: Batch, config: tcfg.UnifiedAttentionConfig, out: torch.Tensor) -> Callable[[], None]:
    n_o, n_lse = tcfg.split_scratch_numel(tcfg.default_max_split_rows(H, D), H, D)
    po = torch.empty(n_o, dtype=torch.float32, device=DEVICE) if config.num_splits > 1 else None
    pl = torch.empty(n_lse, dtype=torch.float32, device=DEVICE) if config.num_splits > 1 else None
    fp8 = batch.kv.dtype != torch.bfloat16
    c = batch.case

    def run() -> None:
        tua.paged_attention(
            batch.q, batch.k_cache, batch.v_cache, out, cu_seqlens_q=batch.cu_q, seqused_k=batch.seq_lens,
            block_table=batch.block_table, max_seqlen_q=c.q_len, max_seqlen_k=c.seq_len,
            softmax_scale=D**-0.5, causal=True, k_scale=batch.one if fp8 else None,
            v_scale=batch.one if fp8 else None, config=config, partial_out=po, partial_lse=pl)

    return run


class LibCall:
    """A library call to time: ``fn()`` runs it; ``result()`` is the output of the latest run.

    Libraries that allocate their output (flash-attn-4) keep it in ``last`` by reference, so
    the timed function does no copy; the comparison reads it after timing. Under CUDA-graph
    timing ``last`` is the graph's static output, which every replay rewrites.
    """

    def __init__(self, run: Callable[[], Any], out: torch.Tensor | None = None) -> None:
        self._run, self._out = run, out
        self.last: Any = None

    def __call__(self) -> None:
        self.last = self._run()

    def result(self) -> torch.Tensor:
        if self._out is not None:
            return self._out
        return self.last[0] if isinstance(self.last, tuple) else self.last


def flashinfer_fn(batch: Batch) -> LibCall:
    import flashinfer

    c = batch.case
    if c.q_len != 1:
        raise NotImplementedError("BatchDecodeWithPagedKVCacheWrapper serves decode only")
    pages = batch.block_table.shape[1]
    indptr = torch.arange(0, c.num_seqs * pages + 1, pages, dtype=torch.int32, device=DEVICE)
    indices = batch.block_table.flatten().contiguous()
    last = torch.full((c.num_seqs,), (c.seq_len - 1) % PAGE + 1, dtype=torch.int32, device=DEVICE)
    ws = torch.zeros(256 * 2**20, dtype=torch.uint8, device=DEVICE)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    wrapper.plan(indptr, indices, last, H, HK, D, PAGE, q_data_type=torch.bfloat16,
                 kv_data_type=batch.kv.dtype, sm_scale=D**-0.5)
    out = torch.zeros_like(batch.out)
    call = LibCall(lambda: wrapper.run(batch.q, (batch.k_cache, batch.v_cache), out=out), out)
    call._keepalive = (wrapper, ws, indptr, indices, last)  # type: ignore[attr-defined]
    return call


def fa4_fn(batch: Batch) -> LibCall:
    from flash_attn.cute import flash_attn_varlen_func

    c = batch.case
    if batch.kv.dtype != torch.bfloat16:
        raise NotImplementedError("this benchmark runs flash-attn-4 on bf16 KV only")
    return LibCall(lambda: flash_attn_varlen_func(
        batch.q, batch.k_cache, batch.v_cache, cu_seqlens_q=batch.cu_q, max_seqlen_q=c.q_len,
        seqused_k=batch.seq_lens, page_table=batch.block_table, softmax_scale=D**-0.5, causal=True))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure(fn: Callable[[], Any], quick: bool, graph: bool = True) -> tuple[float, str]:
    warmup, rep = (10, 50) if quick else (25, 200)
    if graph:
        try:
            r = common.bench_cuda_graph(fn, warmup=warmup, rep=rep)
            return r["median_ms"], r["method"]
        except Exception as e:  # a library whose call cannot be captured: time it eagerly
            logger.warning("CUDA-graph capture failed (%s); timing eagerly", e)
            _sync()
    r = common.bench(fn, warmup=warmup, rep=rep)
    return r["median_ms"], r["method"]


def row(batch: Batch, provider: str, ms: float, method: str, ref: torch.Tensor | None, out: torch.Tensor,
        roof: roofline.Roofline, **extra: Any) -> dict[str, Any]:
    c = batch.case
    tbps = batch.kv_bytes / (ms * 1e-3) / 1e12
    tflops = batch.flops / (ms * 1e-3) / 1e12
    diff = None if ref is None else (out.float() - ref.float()).abs().max().item()
    return {"case": c.name, "provider": provider, "num_seqs": c.num_seqs, "context": c.context, "q_len": c.q_len,
            "kv_dtype": str(c.kv_dtype).replace("torch.", ""), "ms": ms, "tbps": tbps, "tflops": tflops,
            "frac_copy_bw": roof.frac_copy(tbps), "max_abs_diff": diff, "timing": method, **extra}


def run_case(case: Case, roof: roofline.Roofline, sweep: bool, quick: bool, skipped: dict[str, str]) -> list[dict[str, Any]]:
    batch = Batch(case)
    num_sms = tcfg.device_num_sms(DEVICE)
    cfg = default_config(batch, num_sms)
    ours = torch.empty_like(batch.out)
    fn = triton_fn(batch, cfg, ours)
    fn()
    _sync()
    ref = ours.clone()
    rows = []
    cfg_cols = {f"cfg_{k}": v for k, v in dataclasses.asdict(cfg).items()}
    ms, method = measure(fn, quick)
    rows.append(row(batch, "vattn_triton", ms, method, None, ours, roof, **cfg_cols))
    ms, method = measure(fn, quick, graph=False)
    rows.append(row(batch, "vattn_triton_eager", ms, method, None, ours, roof, **cfg_cols))
    if sweep:
        variants = SWEEP_PREFILL if case.q_len > 1 else SWEEP_DECODE
        splits = [cfg.num_splits] if cfg.num_splits == 1 else sorted({max(1, cfg.num_splits // 2), cfg.num_splits,
                                                                      min(tcfg.MAX_SPLITS, cfg.num_splits * 2)})
        grid = [tcfg.UnifiedAttentionConfig(m, n, s, w, st) for (m, n, w, st) in variants for s in splits]
        for v in common.progress(grid, desc=f"sweep {case.name}"):
            try:
                vfn = triton_fn(batch, v, batch.out)
                vfn()
                ms, method = measure(vfn, True)
            except Exception as e:  # e.g. out of shared memory for this tile shape
                skipped[f"{case.name}:{v}"] = repr(e)[:200]
                continue
            cols = {f"cfg_{k}": val for k, val in dataclasses.asdict(v).items()}
            rows.append(row(batch, "vattn_triton_sweep", ms, method, ref, batch.out, roof, **cols))
    for name, make in (("flashinfer", flashinfer_fn), ("flash_attn_4", fa4_fn)):
        try:
            lfn = make(batch)
            lfn()
            _sync()
            ms, method = measure(lfn, quick)
            _sync()
            lib_out = lfn.result()  # the timed runs' own output, compared after timing
        except Exception as e:  # not installed, or this case unsupported
            skipped[f"{case.name}:{name}"] = f"{type(e).__name__}: {str(e)[:200]}"
            continue
        rows.append(row(batch, name, ms, method, ref, lib_out, roof))
    del batch
    common.free_memory()
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Throughput ratios (their ms / our ms: above 1 = vattn faster) and the issue's targets."""
    ms = {(r["case"], r["provider"]): r["ms"] for r in rows}
    best = {}
    for r in rows:
        if r["provider"].startswith("vattn_triton") and r["provider"] != "vattn_triton_eager":
            key = r["case"]
            if key not in best or r["ms"] < best[key]["ms"]:
                best[key] = r
    ratios: dict[str, dict[str, float]] = {}
    for (case, prov), t in ms.items():
        if prov in ("flashinfer", "flash_attn_4") and (case, "vattn_triton") in ms:
            ratios.setdefault(case, {})[f"vs_{prov}"] = t / ms[(case, "vattn_triton")]
            ratios[case][f"best_sweep_vs_{prov}"] = t / best[case]["ms"]
    targets = []

    def target(name: str, case: str, key: str, need: float) -> None:
        got = ratios.get(case, {}).get(key)
        targets.append({"target": name, "case": case, "need": need, "ratio": got,
                        "met": None if got is None else got >= need})

    target("decode 64x4096 vs FlashInfer", "decode_64x4096", "vs_flashinfer", 0.9)
    target("decode 64x4096 vs flash-attn-4", "decode_64x4096", "vs_flash_attn_4", 0.9)
    for b in (1, 2, 4):
        target(f"decode {b}x32k vs FlashInfer", f"decode_{b}x32768", "vs_flashinfer", 0.8)
    target("prefill 8x2048 vs flash-attn-4", "prefill_8x2048", "vs_flash_attn_4", 0.7)
    if ("decode_64x4096", "vattn_triton") in ms and ("decode_64x4096_fp8", "vattn_triton") in ms:
        r = ms[("decode_64x4096", "vattn_triton")] / ms[("decode_64x4096_fp8", "vattn_triton")]
        ratios.setdefault("decode_64x4096_fp8", {})["vs_own_bf16"] = r
        targets.append({"target": "fp8 KV decode vs own bf16", "case": "decode_64x4096_fp8", "need": 1.5,
                        "ratio": r, "met": r >= 1.5})
    best_cfg = {c: {k[4:]: v for k, v in r.items() if k.startswith("cfg_")} | {"ms": r["ms"]}
                for c, r in best.items()}
    return {"ratios": ratios, "targets": targets, "best_triton_config": best_cfg}


LIBRARIES = ("flashinfer", "flash_attn_4")


def _reference_file(arg: str, device_name: str) -> Path | None:
    """The earlier run whose library rows stand in for libraries missing here (``auto``: the
    newest ``triton_attn-<this device>-*.json`` in benchmarks/results/ holding any)."""
    if arg == "none":
        return None
    if arg != "auto":
        return Path(arg)
    pattern = f"triton_attn-{common.device_slug(device_name)}-*.json"
    for path in sorted(common.RESULTS_DIR.glob(pattern), reverse=True):
        try:
            rows = json.loads(path.read_text()).get("rows", [])
        except (OSError, ValueError):
            continue
        if any(r.get("provider") in LIBRARIES for r in rows):
            return path
    return None


def import_library_rows(path: Path, env: dict[str, Any], rows: list[dict[str, Any]],
                        skipped: dict[str, str]) -> dict[str, Any] | None:
    """Add ``path``'s FlashInfer / flash-attn-4 rows for (case, library) pairs this run lacks.

    Only from a run on the same device model (``env.device_name``); each imported row keeps
    a ``source`` column (file, date, versions) so ratios against it are read as cross-run.
    Returns the summary's ``reference_rows`` entry, or None when nothing was imported.
    """
    data = json.loads(path.read_text())
    old_env = data.get("env", {})
    if old_env.get("device_name") != env.get("device_name"):
        skipped[f"reference:{path.name}"] = (f"device {old_env.get('device_name')!r} != {env.get('device_name')!r}; "
                                            "library rows not imported")
        return None
    have = {(r["case"], r["provider"]) for r in rows}
    source = (f"run of {old_env.get('date')} on {old_env.get('device_name')} (torch {old_env.get('torch')}, "
              f"flashinfer {old_env.get('flashinfer')}, flash_attn {old_env.get('flash_attn')})")
    added = []
    for r in data.get("rows", []):
        if r.get("provider") in LIBRARIES and (r["case"], r["provider"]) not in have \
                and any(x["case"] == r["case"] for x in rows):
            added.append({**r, "source": r.get("source") or source})
    rows.extend(added)
    for r in added:
        skipped.pop(f"{r['case']}:{r['provider']}", None)
    return {"file": path.name, "date": old_env.get("date"), "device_name": old_env.get("device_name"),
            "flashinfer": old_env.get("flashinfer"), "flash_attn": old_env.get("flash_attn"),
            "rows": len(added)} if added else None


def plot(rows: list[dict[str, Any]], roof: roofline.Roofline, path: Path) -> Path | None:
    """Decode TB/s (split-KV batches; 64 x 4096 by KV bits) against the copy bandwidth, and
    prefill TFLOP/s against the bf16 matmul rate, one line per provider."""
    def series(pred: Callable[[dict[str, Any]], bool], x: Callable[[dict[str, Any]], float],
               y: str) -> dict[str, tuple[list[float], list[float]]]:
        out: dict[str, tuple[list[float], list[float]]] = {}
        for r in rows:
            if r["provider"] in ("vattn_triton_sweep", "vattn_triton_eager") or not pred(r):
                continue
            label = r["provider"] + (" (earlier run)" if r.get("source") else "")
            xs, ys = out.setdefault(label, ([], []))
            xs.append(x(r))
            ys.append(r[y])
        return out

    copy = {"copy bandwidth": roof.copy_tbps}
    panels = [
        {"title": "decode, 32k context (split-KV)", "xlabel": "sequences", "ylabel": "KV TB/s", "logx": True,
         "series": series(lambda r: r["q_len"] == 1 and r["context"] == 32768, lambda r: r["num_seqs"], "tbps"),
         "ceilings": copy},
        {"title": "decode, 64 x 4096", "xlabel": "KV bits (8 = fp8 e4m3)", "ylabel": "KV TB/s",
         "series": series(lambda r: r["q_len"] == 1 and r["context"] == 4096,
                          lambda r: 8 if "float8" in r["kv_dtype"] else 16, "tbps"),
         "ceilings": copy},
        {"title": "prefill, 8 x 2048 causal", "xlabel": "sequences", "ylabel": "TFLOP/s",
         "series": series(lambda r: r["q_len"] > 1, lambda r: r["num_seqs"], "tflops"),
         "ceilings": {"bf16 matmul": roof.bf16_tflops}},
    ]
    return common.plot_panels(path, panels, title=f"vattn TRITON_ATTN, H={H} Hk={HK} D={D} page={PAGE}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time Triton config variants")
    parser.add_argument("--quick", action="store_true", help="shorter timing")
    parser.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    parser.add_argument("--reference-json", default="auto",
                        help="earlier run of this benchmark on the same device model whose library rows fill in for "
                             "libraries not installed here ('auto': newest in benchmarks/results/; 'none': off)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        print("bench_triton_attn needs a CUDA GPU (run it on the device machine).", file=sys.stderr)
        return 2
    env = common.env_info()
    roof = roofline.measure(quick=args.quick)
    print(f"copy bandwidth {roof.copy_tbps:.2f} TB/s, read {roof.read_tbps:.2f} TB/s, bf16 mm {roof.bf16_tflops:.0f} TFLOP/s")
    cases = [c for c in CASES if args.cases is None or c.name in args.cases.split(",")]
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    for case in common.progress(cases, desc="cases"):
        rows += run_case(case, roof, args.sweep, args.quick, skipped)
    ref_path = _reference_file(args.reference_json, str(env.get("device_name")))
    reference = import_library_rows(ref_path, env, rows, skipped) if ref_path is not None else None
    summary = {"roofline": roof.to_dict(), "shapes": {"H": H, "Hk": HK, "D": D, "page": PAGE},
               "skipped": skipped, "reference_rows": reference, **summarize(rows)}
    path = common.result_path("triton_attn", env)
    png = plot(rows, roof, path.with_suffix(".png"))
    payload = {"env": env, "rows": rows, "summary": summary, "plots": [png.name] if png else []}
    path = common.write_results("triton_attn", payload, path=path)
    for r in rows:
        if r["provider"] != "vattn_triton_sweep":
            src = " [earlier run]" if r.get("source") else ""
            print(f"{r['case']:20s} {r['provider']:20s} {r['ms']:8.4f} ms {r['tbps']:6.2f} TB/s "
                  f"{r['tflops']:7.1f} TFLOP/s diff={r['max_abs_diff']}{src}")
    if reference:
        print("library rows from", reference["file"], reference["date"])
    for t in summary["targets"]:
        print(f"target {t['target']:34s} need {t['need']:.2f} got {t['ratio']} met={t['met']}")
    print("best configs:", summary["best_triton_config"])
    print("skipped:", skipped)
    print("wrote", path, png)
    return 0


if __name__ == "__main__":
    sys.exit(main())

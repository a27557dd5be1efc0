"""Kernel sweeps: every vattn backend beside the raw library calls, as fractions of the roofline.

Decode (one new token per request over a cached context) and causal prefill, for each head
dimension and KV-cache dtype, through

* every ``vattn.AttentionBackendEnum`` member TORCH_SDPA, TRITON_ATTN, FLASHINFER, FLASH_ATTN
  that can serve the configuration (``validate_configuration``; the reasons of those that cannot
  are recorded), driven through ``impl.forward(layer, q, k, v, kv_cache, metadata, output)`` with
  metadata from the backend's builder: the path ``vattn.Attention`` takes, without the custom op.
  It includes writing the step's new K/V into the cache (one row per decode; every prompt token
  for prefill);
* the raw libraries where importable: FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` /
  ``BatchPrefillWithPagedKVCacheWrapper``, flash-attn-4's ``flash_attn_varlen_func`` with a
  ``page_table``, and dense ``torch.nn.functional.scaled_dot_product_attention`` (and compiled
  FlexAttention for prefill) on contiguous K/V as reference points.

Every provider reads the same K/V (the caches are filled from the same seeds, and the step's new
K/V equal what the cache already holds), so each row also reports its largest difference from the
first provider that ran (``ref``). Figures: ``ms`` (median), ``tbps`` = KV bytes read / time,
``tflops`` = 4 * H * D * (attended query-key pairs) / time, and both as fractions of the copy /
read bandwidth and bf16 matmul rate measured in the same run (``benchmarks/roofline.py``).

Run on the GPU machine: ``PYTHONPATH=$PWD python benchmarks/bench_kernels.py --quick`` (a handful
of points; FlashInfer's first-use JIT, about 20 s for decode and 75 s for the sm90 prefill kernel,
is most of it). The full sweep (no ``--quick``) takes longer than one 10-minute device call: the
JSON is rewritten after every point, and ``--append`` runs it in parts that merge into one file,
e.g. ``--head-dims 128 --kv-dtypes auto``, then ``--head-dims 128 --kv-dtypes fp8 --append``, ...
(the device call carries ``benchmarks/results/``, where ``--append`` finds the earlier parts).
CPU smoke test: ``--device cpu --tiny --backends TORCH_SDPA``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `vattn` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import vattn  # noqa: E402
from benchmarks import common, roofline  # noqa: E402
from vattn.ops.kv_store import kv_cache_torch_dtype  # noqa: E402

logger = logging.getLogger("vattn.benchmarks.kernels")

VATTN_BACKENDS = ("TORCH_SDPA", "TRITON_ATTN", "FLASHINFER", "FLASH_ATTN")
RAW_PROVIDERS = ("flashinfer", "flash_attn", "sdpa_dense", "flex_dense")
LAYER = "bench.attn"


class Skip(Exception):
    """A provider cannot run this point; the message is the reason."""


@dataclass(frozen=True)
class Point:
    """One problem. ``seq_len``: the context per request after the step (decode) or the prompt length (prefill)."""

    phase: str
    batch: int
    seq_len: int
    head_dim: int
    kv_dtype: str

    @property
    def query_len(self) -> int:
        return 1 if self.phase == "decode" else self.seq_len

    @property
    def tokens(self) -> int:
        return self.batch * self.query_len

    @property
    def pairs(self) -> int:
        """Attended (query, key) pairs: every key per decode query; the causal triangle for prefill."""
        if self.phase == "decode":
            return self.batch * self.seq_len
        return self.batch * self.seq_len * (self.seq_len + 1) // 2

    def label(self) -> str:
        return f"{self.phase} B={self.batch} L={self.seq_len} D={self.head_dim} kv={self.kv_dtype}"


@dataclass
class Case:
    """Inputs shared by every provider at one point (all on the benchmark device)."""

    point: Point
    q: torch.Tensor  # (T, H, D) model dtype
    block_table: torch.Tensor  # (B, W) int32
    seq_lens: torch.Tensor  # (B,) int32
    query_start_loc: torch.Tensor  # (B + 1,) int32
    slots: torch.Tensor  # (T,) int64
    common: vattn.CommonAttentionMetadata
    num_blocks: int
    seed: int


@dataclass
class Prepared:
    """A provider ready to run: ``fn`` does the work; ``result()`` gives the (T, H, D) output of the last run."""

    fn: Callable[[], Any]
    result: Callable[[], torch.Tensor]
    kv_elem_bytes: int
    keep: Any = None  # tensors and objects that must outlive the timing


# ---- inputs ----------------------------------------------------------------------------


def split_kv(cache: torch.Tensor, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    try:
        return common.split_kv_cache(cache, num_blocks)
    except ValueError as e:
        raise Skip(str(e)) from None


fill_kv_ = common.fill_random_kv_


def take(cache: torch.Tensor, *index: torch.Tensor) -> torch.Tensor:
    """``cache[index]``; fp8 caches are indexed as bytes (not every torch build indexes fp8 on CUDA)."""
    if cache.element_size() == 1 and cache.is_floating_point():
        return cache.view(torch.uint8)[index].view(cache.dtype)
    return cache[index]


def new_kv(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's key/value (T, Hk, D): exactly what the cache holds at ``slots`` (scales are 1)."""
    bs = k.shape[1]
    blocks, offs = slots // bs, slots % bs
    return take(k, blocks, offs).to(dtype), take(v, blocks, offs).to(dtype)


def make_case(pt: Point, args: argparse.Namespace, seed: int) -> Case:
    device, bs = torch.device(args.device), args.block_size
    gen = torch.Generator().manual_seed(seed)
    per_req = -(-pt.seq_len // bs)
    num_blocks = pt.batch * per_req + 1  # block 0 stays unused (padding reads land there)
    table = (torch.randperm(num_blocks - 1, generator=gen) + 1).view(pt.batch, per_req).to(torch.int32)
    computed = pt.seq_len - pt.query_len
    common = vattn.build_common_attn_metadata(
        [pt.query_len] * pt.batch, [computed] * pt.batch, table, bs, device, num_blocks=num_blocks)
    qgen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(pt.tokens, args.num_heads, pt.head_dim, generator=qgen, device=device, dtype=torch.float32)
    return Case(pt, q.to(args.dtype), common.block_table_tensor, common.seq_lens, common.query_start_loc,
                common.slot_mapping, common, num_blocks, seed)


def cache_bytes(pt: Point, num_blocks: int, args: argparse.Namespace) -> int:
    elem = torch.empty(0, dtype=kv_cache_torch_dtype(pt.kv_dtype, args.dtype)).element_size()
    return 2 * num_blocks * args.block_size * args.num_kv_heads * pt.head_dim * elem


def transient_bytes(provider: str, pt: Point, args: argparse.Namespace) -> int:
    """A generous estimate of a provider's temporary memory beyond the cache."""
    H, Hk, D, B, Lq, Lk = args.num_heads, args.num_kv_heads, pt.head_dim, pt.batch, pt.query_len, pt.seq_len
    io = 4 * pt.tokens * H * D * 2
    if provider == "vattn:TORCH_SDPA":  # fp32 gathers, GQA expansion, scores and masks
        return io + B * Lk * D * 4 * (2 * Hk + 2 * H) + B * H * Lq * Lk * 4 * 3 + B * Lq * Lk * 2 + B * Lk * 24
    if provider in ("sdpa_dense", "flex_dense"):  # dense bf16 K/V (+ one gather temporary)
        return io + 3 * 2 * B * Lk * Hk * D * args.dtype.itemsize
    return io + 512 * 2**20  # workspaces, plans


# ---- providers -------------------------------------------------------------------------


def prepare_vattn(name: str, case: Case, args: argparse.Namespace) -> Prepared:
    """A vattn backend through its builder and ``impl.forward`` (no custom op, no forward context)."""
    pt = case.point
    try:
        backend = vattn.AttentionBackendEnum[name].get_class()
    except (ImportError, ValueError) as e:
        raise Skip(f"not importable: {e}") from None
    reasons = backend.validate_configuration(pt.head_dim, args.dtype, pt.kv_dtype, args.block_size)
    if reasons:
        raise Skip("; ".join(reasons))
    cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=args.block_size, cache_dtype=pt.kv_dtype))
    with vattn.set_current_vattn_config(cfg), common.default_dtype(args.dtype):
        layer = vattn.Attention(args.num_heads, pt.head_dim, pt.head_dim**-0.5, num_kv_heads=args.num_kv_heads,
                                prefix=LAYER, attn_backend=backend)
    layer.to(args.device)
    kv = vattn.allocate_kv_cache(cfg, num_blocks=case.num_blocks, device=args.device, dtype=args.dtype)
    cache = kv.tensors[LAYER]
    k, v = split_kv(cache, case.num_blocks)
    fill_kv_(k, v, case.seed)
    key, value = new_kv(k, v, case.slots, args.dtype)
    md = kv.build_metadata(case.common)[LAYER]
    q = case.q
    if layer.query_quant is not None:  # the layer quantizes q outside the op; so do we, untimed
        q = layer.query_quant(q.reshape(pt.tokens, -1), layer._q_scale)[0].view(q.shape)
    out = torch.empty(pt.tokens, args.num_heads, pt.head_dim, dtype=args.dtype, device=args.device)

    def fn() -> None:
        layer.impl.forward(layer, q, key, value, cache, md, output=out)

    return Prepared(fn, lambda: out, cache.element_size(), keep=(layer, kv, cfg, md, key, value, q))


_WORKSPACES: dict[str, torch.Tensor] = {}


def prepare_flashinfer(case: Case, raw: tuple[torch.Tensor, torch.Tensor], args: argparse.Namespace) -> Prepared:
    if torch.device(args.device).type != "cuda":
        raise Skip("needs CUDA")
    try:
        import flashinfer
    except Exception as e:
        raise Skip(f"flashinfer not importable ({type(e).__name__}: {e})") from None
    from vattn.backends.flashinfer import gather_page_indices, paged_kv_layout

    pt, k, v = case.point, raw[0], raw[1]
    if args.device not in _WORKSPACES:  # zero-initialised once, as FlashInfer requires
        _WORKSPACES[args.device] = torch.zeros(256 * 2**20, dtype=torch.uint8, device=args.device)
    ws = _WORKSPACES[args.device]
    indptr, last = paged_kv_layout(case.common.seq_lens_cpu, args.block_size)
    indices = gather_page_indices(case.block_table, indptr)
    kw = dict(q_data_type=args.dtype, kv_data_type=k.dtype, o_data_type=args.dtype, sm_scale=pt.head_dim**-0.5)
    shape = (args.num_heads, args.num_kv_heads, pt.head_dim, args.block_size)
    if pt.phase == "decode":  # tensor-core decode, as vattn's FLASHINFER backend plans it
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
        wrapper.plan(indptr, indices, last, *shape, pos_encoding_mode="NONE", **kw)
    else:
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        wrapper.plan(case.common.query_start_loc_cpu, indptr, indices, last, *shape, causal=True, **kw)
    scales = dict(k_scale=1.0, v_scale=1.0) if k.dtype.itemsize == 1 else {}
    out = torch.empty(pt.tokens, args.num_heads, pt.head_dim, dtype=args.dtype, device=args.device)

    def fn() -> None:
        wrapper.run(case.q, (k, v), out=out, **scales)

    return Prepared(fn, lambda: out, k.element_size(), keep=(wrapper, indices))


def prepare_flash_attn(case: Case, raw: tuple[torch.Tensor, torch.Tensor], args: argparse.Namespace) -> Prepared:
    if torch.device(args.device).type != "cuda":
        raise Skip("needs CUDA")
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception as e:
        raise Skip(f"flash_attn.cute (flash-attn-4) not importable ({type(e).__name__}: {e})") from None
    pt, k, v = case.point, raw[0], raw[1]
    if k.dtype.itemsize == 1 and torch.cuda.get_device_capability(args.device)[0] != 10:
        raise Skip("flash-attn-4 fp8 runs on SM100 only")
    holder: dict[str, torch.Tensor] = {}

    def fn() -> None:
        holder["out"] = flash_attn_varlen_func(
            case.q, k, v, cu_seqlens_q=case.query_start_loc, seqused_k=case.seq_lens,
            max_seqlen_q=pt.query_len, max_seqlen_k=pt.seq_len, page_table=case.block_table,
            softmax_scale=pt.head_dim**-0.5, causal=True)[0]

    return Prepared(fn, lambda: holder["out"], k.element_size())


def _dense(case: Case, raw: tuple[torch.Tensor, torch.Tensor], args: argparse.Namespace) -> tuple[torch.Tensor, ...]:
    """q (B, H, Lq, D), k/v (B, Hk, L, D) contiguous model-dtype copies of the paged inputs."""
    pt = case.point

    def gather(c: torch.Tensor) -> torch.Tensor:
        x = take(c, case.block_table.long()).flatten(1, 2)[:, : pt.seq_len]  # (B, L, Hk, D)
        return x.to(args.dtype).transpose(1, 2).contiguous()
    q = case.q.view(pt.batch, pt.query_len, args.num_heads, pt.head_dim).transpose(1, 2).contiguous()
    return q, gather(raw[0]), gather(raw[1])


def prepare_sdpa_dense(case: Case, raw: tuple[torch.Tensor, torch.Tensor], args: argparse.Namespace) -> Prepared:
    pt = case.point
    q, k, v = _dense(case, raw, args)
    holder: dict[str, torch.Tensor] = {}

    def fn() -> None:
        holder["out"] = F.scaled_dot_product_attention(q, k, v, is_causal=pt.phase == "prefill",
                                                       scale=pt.head_dim**-0.5, enable_gqa=True)

    def result() -> torch.Tensor:
        return holder["out"].transpose(1, 2).reshape(pt.tokens, args.num_heads, pt.head_dim)

    return Prepared(fn, result, k.element_size(), keep=(q, k, v))


def prepare_flex_dense(case: Case, raw: tuple[torch.Tensor, torch.Tensor], args: argparse.Namespace) -> Prepared:
    pt = case.point
    if pt.phase != "prefill" or torch.device(args.device).type != "cuda":
        raise Skip("prefill on CUDA only")
    if args.quick:
        raise Skip("not in --quick (compiles per shape)")
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, k, v = _dense(case, raw, args)
    mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, pt.seq_len, pt.seq_len, device=args.device)
    flex = torch.compile(flex_attention, dynamic=False)
    holder: dict[str, torch.Tensor] = {}

    def fn() -> None:
        holder["out"] = flex(q, k, v, block_mask=mask, scale=pt.head_dim**-0.5, enable_gqa=True)

    def result() -> torch.Tensor:
        return holder["out"].transpose(1, 2).reshape(pt.tokens, args.num_heads, pt.head_dim)

    return Prepared(fn, result, k.element_size(), keep=(q, k, v, mask))


RAW: dict[str, Callable[[Case, tuple[torch.Tensor, torch.Tensor], argparse.Namespace], Prepared]] = {
    "flashinfer": prepare_flashinfer,
    "flash_attn": prepare_flash_attn,
    "sdpa_dense": prepare_sdpa_dense,
    "flex_dense": prepare_flex_dense,
}


# ---- the sweep -------------------------------------------------------------------------


def build_grid(args: argparse.Namespace) -> list[Point]:
    """Decode points first, then prefill (so a --quick time budget cuts prefill, not everything)."""
    decode = [Point("decode", b, l, d, kv) for d in args.head_dims for kv in args.kv_dtypes
              for b in args.batches for l in args.contexts]
    prefill = [Point("prefill", max(1, args.prefill_tokens // n), n, d, kv) for d in args.head_dims
               for kv in args.kv_dtypes for n in args.prefill_lens]
    return decode + prefill


def prepare(provider: str, case: Case, raw: Callable[[], tuple[torch.Tensor, torch.Tensor]],
            args: argparse.Namespace) -> Prepared:
    kind, _, name = provider.partition(":")
    if kind == "vattn":
        if torch.device(args.device).type != "cuda" and name != "TORCH_SDPA" and name not in args.explicit_backends:
            raise Skip("GPU backend; on the CPU only TORCH_SDPA runs unless named in --backends")
        return prepare_vattn(name, case, args)
    return RAW[provider](case, raw(), args)


def measure_point(provider: str, case: Case, prep: Prepared, roof: roofline.Roofline,
                  args: argparse.Namespace) -> tuple[dict[str, Any], torch.Tensor]:
    pt = case.point
    res = common.bench(prep.fn, warmup=args.warmup_ms, rep=args.rep_ms, device=args.device)
    out = prep.result()
    ms = res["median_ms"]
    kv_bytes = 2 * pt.batch * pt.seq_len * args.num_kv_heads * pt.head_dim * prep.kv_elem_bytes
    tbps = kv_bytes / (ms * 1e-3) / 1e12
    tflops = 4 * args.num_heads * pt.head_dim * pt.pairs / (ms * 1e-3) / 1e12
    row = {
        "phase": pt.phase, "provider": provider, "batch": pt.batch, "seq_len": pt.seq_len,
        "head_dim": pt.head_dim, "kv_dtype": pt.kv_dtype, "tokens": pt.tokens,
        "ms": ms, "p20_ms": res["p20"], "p80_ms": res["p80"], "tbps": tbps, "tflops": tflops,
        **roof.fractions(tbps=tbps, tflops=tflops), "n": res["n"], "timer": res["method"],
    }
    return row, out


def run_sweep(
    args: argparse.Namespace,
    roof: roofline.Roofline,
    checkpoint: Callable[[list[dict[str, Any]], dict[str, Any]], None] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every (point, provider) pair; returns the rows and the skip / error tallies.

    ``checkpoint(rows, tallies)`` runs after each point, so a run killed part-way (the device tool
    stops a command after 10 minutes) still leaves its results.
    """
    providers = [f"vattn:{b}" for b in args.backends] + list(args.raw)
    points = build_grid(args)
    tasks = [(i, pt, p) for i, pt in enumerate(points) for p in providers]
    rows: list[dict[str, Any]] = []
    skipped: dict[str, dict[str, int]] = {}
    errors: dict[str, dict[str, int]] = {}

    def tally(book: dict[str, dict[str, int]], provider: str, reason: str) -> None:
        per = book.setdefault(provider, {})
        per[reason[:300]] = per.get(reason[:300], 0) + 1

    budget = args.mem_budget_gib * 2**30
    start = time.monotonic()
    state: dict[str, Any] = {"point": None}

    def tallies() -> dict[str, Any]:
        return {"skipped": skipped, "errors": errors, "elapsed_s": round(time.monotonic() - start, 1)}

    for index, pt, provider in common.progress(tasks, desc="kernels"):
        if state["point"] != pt:
            if state["point"] is not None and checkpoint is not None:
                checkpoint(rows, tallies())
            state.clear()
            common.free_memory()
            state["point"] = pt
            nb = pt.batch * -(-pt.seq_len // args.block_size) + 1
            if cache_bytes(pt, nb, args) > budget:
                state["skip"] = f"KV cache {cache_bytes(pt, nb, args) / 2**30:.1f} GiB > memory budget"
            else:
                state["case"] = make_case(pt, args, seed=args.seed + index)
        if "skip" in state:
            tally(skipped, provider, state["skip"])
            continue
        if args.time_budget_s and time.monotonic() - start > args.time_budget_s:
            tally(skipped, provider, f"time budget of {args.time_budget_s:g} s used up")
            continue
        case: Case = state["case"]
        if cache_bytes(pt, case.num_blocks, args) + transient_bytes(provider, pt, args) > budget:
            tally(skipped, provider, "cache + temporaries over the memory budget")
            continue

        def raw() -> tuple[torch.Tensor, torch.Tensor]:
            if "raw" not in state:  # one (2, num_blocks, ...) cache shared by the raw providers
                dtype = kv_cache_torch_dtype(pt.kv_dtype, args.dtype)
                shape = (2, case.num_blocks, args.block_size, args.num_kv_heads, pt.head_dim)
                t = torch.empty(shape, dtype=dtype, device=args.device)
                fill_kv_(t[0], t[1], case.seed)
                state["raw"] = (t[0], t[1])
            return state["raw"]

        prep = None
        try:
            prep = prepare(provider, case, raw, args)
            row, out = measure_point(provider, case, prep, roof, args)
        except Skip as e:
            tally(skipped, provider, str(e))
            continue
        except Exception as e:  # a failing provider must not end the sweep
            logger.warning("%s at %s failed: %s: %s", provider, pt.label(), type(e).__name__, e)
            tally(errors, provider, f"{type(e).__name__}: {e}")
            common.free_memory()  # after an out-of-memory error, give the cached blocks back
            continue
        finally:
            del prep
        if "ref" not in state:
            state["ref"], state["ref_name"] = out.detach().float().clone(), provider
        diff = (out.float() - state["ref"]).abs().max().item() if out.shape == state["ref"].shape else float("nan")
        tol = 0.25 if pt.kv_dtype.startswith("fp8") else 0.05
        row.update(max_abs_diff=diff, ref=state["ref_name"], ok=bool(diff <= tol))
        rows.append(row)
    state.clear()
    common.free_memory()
    return rows, tallies()


# ---- plots and CLI -----------------------------------------------------------------------


def plot(rows: list[dict[str, Any]], roof: roofline.Roofline, json_path: Path) -> list[str]:
    """``<stem>-decode.png`` (TB/s vs context) and ``<stem>-prefill.png`` (TFLOP/s vs length)."""
    written = []
    for phase, metric, ylabel, ceilings in (
        ("decode", "tbps", "KV read TB/s", {"copy": roof.copy_tbps, "read": roof.read_tbps}),
        ("prefill", "tflops", "TFLOP/s", {"bf16 matmul": roof.bf16_tflops}),
    ):
        panels: dict[tuple, dict[str, Any]] = {}
        for r in (r for r in rows if r["phase"] == phase):
            key = (r["head_dim"], r["kv_dtype"]) + ((r["batch"],) if phase == "decode" else ())
            title = f"D={r['head_dim']} kv={r['kv_dtype']}" + (f" B={r['batch']}" if phase == "decode" else "")
            panel = panels.setdefault(key, {"title": title, "xlabel": "context" if phase == "decode" else "prompt length",
                                            "ylabel": ylabel, "logx": True, "series": {}, "ceilings": ceilings})
            xs, ys = panel["series"].setdefault(r["provider"], ([], []))
            xs.append(r["seq_len"])
            ys.append(r[metric])
        path = json_path.with_name(f"{json_path.stem}-{phase}.png")
        if common.plot_panels(path, [panels[k] for k in sorted(panels)], title=f"{phase}: {roof.device}",
                              ncols=5 if phase == "decode" else 4):
            written.append(path.name)
    return written


MODES = {  # field: (full, quick, tiny)
    "batches": ([1, 4, 16, 64, 256], [1, 64], [1, 3]),
    "contexts": ([512, 2048, 8192, 32768], [2048, 8192], [16, 40]),
    "prefill_lens": ([512, 2048, 8192], [2048], [24]),
    "prefill_tokens": (16384, 8192, 48),
    "head_dims": ([64, 128], [128], [64]),
    "kv_dtypes": (["auto", "fp8"], ["auto"], ["auto", "fp8"]),
    "num_heads": (32, 32, 4),
    "num_kv_heads": (8, 8, 2),
    "warmup_ms": (25.0, 10.0, 2.0),
    "rep_ms": (100.0, 40.0, 10.0),
    "time_budget_s": (0.0, 100.0, 0.0),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a handful of points (< 2 min on an H100 incl. JIT)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes for a CPU smoke test")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--backends", type=lambda s: s.split(","), default=None,
                   help=f"comma-separated vattn backends (default: {','.join(VATTN_BACKENDS)})")
    p.add_argument("--raw", type=lambda s: [x for x in s.split(",") if x], default=list(RAW_PROVIDERS),
                   help=f"comma-separated raw providers, '' for none (default: {','.join(RAW_PROVIDERS)})")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--mem-budget-gib", type=float, default=None, help="skip points above this (default: 85%% of free)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--name", default="kernels", help="result name (the file name's prefix)")
    p.add_argument("--append", action="store_true",
                   help="merge into this device's result file of the same name and date (found in $OUT or "
                        "benchmarks/results/), replacing re-measured (point, provider) rows: runs a full sweep "
                        "in parts, e.g. --head-dims 64 then --head-dims 128 --append")
    for field, (full, _, _) in MODES.items():
        kind = type(full[0]) if isinstance(full, list) else type(full)
        conv = (lambda s, k=kind: [k(x) for x in s.split(",")]) if isinstance(full, list) else kind
        p.add_argument("--" + field.replace("_", "-"), type=conv, default=None, help=f"override (full: {full})")
    args = p.parse_args(argv)
    mode = 2 if args.tiny else 1 if args.quick else 0
    for field, values in MODES.items():
        if getattr(args, field) is None:
            setattr(args, field, values[mode])
    args.explicit_backends = set(args.backends or ())
    args.backends = args.backends or list(VATTN_BACKENDS)
    bad = [b for b in args.backends if b not in vattn.AttentionBackendEnum.__members__]
    bad += [r for r in args.raw if r not in RAW]
    if bad:
        p.error(f"unknown provider(s) {bad}; vattn backends: {list(VATTN_BACKENDS)}, raw: {list(RAW)}")
    args.dtype = getattr(torch, args.dtype)
    if args.mem_budget_gib is None:
        free = torch.cuda.mem_get_info(args.device)[0] if torch.device(args.device).type == "cuda" else 4 * 2**30
        args.mem_budget_gib = 0.85 * free / 2**30
    return args


ROW_KEY = ("phase", "provider", "batch", "seq_len", "head_dim", "kv_dtype")


def earlier_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of an earlier part of this sweep: the same file name in $OUT or in benchmarks/results/."""
    for candidate in (path, common.RESULTS_DIR / path.name):
        if candidate.exists():
            try:
                rows = json.loads(candidate.read_text()).get("rows", [])
            except (OSError, ValueError) as e:
                logger.warning("--append: cannot read %s (%s); starting a new file", candidate, e)
                return []
            return [r for r in rows if isinstance(r, dict)]
    return []


def merge_rows(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``old`` without the (point, provider) pairs ``new`` measured again, then ``new``."""
    seen = {tuple(r.get(k) for k in ROW_KEY) for r in new}
    return [r for r in old if tuple(r.get(k) for k in ROW_KEY) not in seen] + list(new)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    env = common.env_info(args.device)
    roof = roofline.measure(args.device, quick=args.quick, tiny=args.tiny)
    print(f"roofline: copy {roof.copy_tbps:.3g} TB/s, read {roof.read_tbps:.3g} TB/s, "
          f"bf16 matmul {roof.bf16_tflops:.3g} TFLOP/s", flush=True)
    path = common.result_path(args.name, env)
    config = {k: (str(v).replace("torch.", "") if isinstance(v, torch.dtype) else v) for k, v in vars(args).items()
              if k != "explicit_backends"}

    earlier = earlier_rows(path) if args.append else []

    def save(rows: list[dict[str, Any]], tallies: dict[str, Any], plots: list[str], partial: bool) -> Path:
        summary = {"roofline": roof.to_dict(), "config": config, **tallies, "partial": partial,
                   "rows_from_earlier_parts": len(merge_rows(earlier, rows)) - len(rows)}
        return common.write_results(args.name, {"env": env, "rows": merge_rows(earlier, rows), "summary": summary,
                                                "plots": plots}, path=path)

    rows, tallies = run_sweep(args, roof, checkpoint=lambda r, t: save(r, t, [], True))
    table = common.Table(["phase", "provider", "batch", "seq_len", "head_dim", "kv_dtype", "ms", "tbps",
                          "frac_copy_bw", "tflops", "frac_matmul", "max_abs_diff", "ok"], title="kernels")
    table.extend(rows)
    table.print()
    for what in ("skipped", "errors"):
        for provider, reasons in tallies[what].items():
            for reason, count in reasons.items():
                print(f"{what}: {provider} x{count}: {reason}")
    bad = [r for r in rows if not r["ok"]]
    if bad:
        print(f"WARNING: {len(bad)} rows differ from their point's first provider beyond tolerance "
              f"(max_abs_diff, column ok): {sorted({r['provider'] for r in bad})}")
    plots = [] if args.no_plot else plot(merge_rows(earlier, rows), roof, path)
    path = save(rows, tallies, plots, False)
    print(f"wrote {path}" + "".join(f"\nwrote {path.with_name(p)}" for p in plots))
    return 0


if __name__ == "__main__":
    sys.exit(main())

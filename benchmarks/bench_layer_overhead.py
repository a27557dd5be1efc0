"""What ``vattn.Attention`` costs on top of the bare kernel library (FLASHINFER, FLASH_ATTN).

For each backend and case (32 q heads, 8 KV heads, head dim 128, bf16, block 16):

| case | shape | timed as |
| --- | --- | --- |
| decode-64x4096 | 64 requests, 4095 cached tokens + 1 new | CUDA graph replay |
| decode-1x32k | 1 request, 32767 cached + 1 new | CUDA graph replay |
| prefill-8x2048 | 8 requests of 2048 new tokens, causal | eager, and CUDA graph replay |

Three timings per row, on the same inputs and cache:

* ``vattn_ms``: one ``vattn.Attention`` forward through the ``vattn::unified_attention_with_output``
  custom op (KV write + attention), metadata built beforehand (as every step does once for all layers);
* ``bare_ms``: the library's attention call alone (FlashInfer wrapper ``run`` / flash-attn-4
  ``flash_attn_varlen_func``), planned with the same batch;
* ``bare_kv_ms``: the same plus the KV write a bare-library user also needs (vattn's
  ``store_kv`` kernel, so the difference to ``vattn_ms`` is the layer's own plumbing).

``ratio = vattn_ms / bare_kv_ms`` (target <= 1.03) and ``ratio_vs_attention_only = vattn_ms /
bare_ms`` are reported, with TB/s of KV read (decode) or causal TFLOP/s (prefill) and their
fractions of the roofline (``benchmarks/roofline.py``, measured in the same run: ``frac_*``
columns for vattn, ``bare_frac_*`` for the bare call). Timing: ``benchmarks.common.bench``
(``triton.testing.do_bench``, medians, L2 flushed before each run). Eager rows also carry
``*_wall_ms`` (``benchmarks.common.bench_wall``: host work included, the GPU drained after each
call) and ``wall_ratio``, since host overhead is what the layer adds in eager mode. The cache
holds random values (``common.fill_random_kv_``, any dtype / layout).

Usage (GPU machine, repository root, ``PYTHONPATH=$PWD``)::

    python benchmarks/bench_layer_overhead.py [--backends FLASHINFER FLASH_ATTN] [--cases ...] [--quick] [--no-plot]

The bare FlashInfer call reads the cache in the layout vattn allocated (``VATTN_KV_CACHE_LAYOUT``,
NHD or HND).

Writes ``layer_overhead-<device>-<date>.json`` (after every backend/case, so a cut run keeps what
it measured: ``summary.partial``) and ``layer_overhead-<device>-<date>.png`` (vattn vs bare TB/s and
TFLOP/s with the roofline ceilings) to ``$OUT`` if set, else ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `vattn` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common, roofline  # noqa: E402

H, HK, D, BLOCK, DTYPE = 32, 8, 128, 16, torch.bfloat16
CASES: dict[str, tuple[int, int, int]] = {  # name: (requests, cached tokens, new tokens)
    "decode-64x4096": (64, 4095, 1),
    "decode-1x32k": (1, 32767, 1),
    "prefill-8x2048": (8, 0, 2048),
}
QUICK = {"decode-64x4096": (8, 511, 1), "decode-1x32k": (1, 4095, 1), "prefill-8x2048": (2, 0, 256)}
TARGET = 1.03
TABLE_COLUMNS = ["backend", "interface", "case", "mode", "vattn_ms", "bare_ms", "bare_kv_ms", "ratio",
                 "ratio_vs_attention_only", "vattn_wall_ms", "bare_kv_wall_ms", "wall_ratio", "tb_per_s",
                 "tflop_per_s", "frac_copy_bw", "frac_matmul", "max_abs_diff"]


class Setup:
    """One backend's layer, cache (random contents), inputs and metadata for one case."""

    def __init__(self, backend: str, reqs: int, ctx: int, new: int) -> None:
        import vattn
        from vattn.core.config import CacheConfig, CompilationConfig, CUDAGraphMode, VattnConfig

        self.backend = backend
        self.decode = new == 1
        self.reqs, self.ctx, self.new = reqs, ctx, new
        self.tokens = reqs * new
        graphs = CUDAGraphMode.FULL_DECODE_ONLY if self.decode else CUDAGraphMode.NONE
        self.cfg = VattnConfig(
            cache=CacheConfig(block_size=BLOCK),
            compilation=CompilationConfig(cudagraph_mode=graphs,
                                          cudagraph_capture_sizes=(self.tokens,) if self.decode else None),
        )
        prev = torch.get_default_dtype()
        torch.set_default_dtype(DTYPE)
        try:
            with vattn.set_current_vattn_config(self.cfg), torch.device("cuda"):
                self.layer = vattn.Attention(H, D, D**-0.5, num_kv_heads=HK, prefix="bench.attn", attn_backend=backend)
        finally:
            torch.set_default_dtype(prev)
        per_req = math.ceil((ctx + new) / BLOCK)
        num_blocks = reqs * per_req + 1
        self.kv = vattn.allocate_kv_cache(self.cfg, num_blocks=num_blocks, device="cuda", dtype=DTYPE)
        self.cache = self.kv.tensors["bench.attn"]
        # (num_blocks, block_size, Hk, D) views with the physical layout's strides (NHD or HND, any dtype).
        self.key_cache, self.value_cache = common.split_kv_cache(self.cache, num_blocks)
        common.fill_random_kv_(self.key_cache, self.value_cache, seed=0)  # random, never zeros
        g = torch.Generator().manual_seed(0)
        ids = torch.randperm(num_blocks, generator=g)[: reqs * per_req].view(reqs, per_req).tolist()
        self.common = vattn.build_common_attn_metadata([new] * reqs, [ctx] * reqs, ids, BLOCK, device="cuda")
        gen = torch.Generator(device="cuda").manual_seed(1)
        self.q = torch.randn(self.tokens, H * D, device="cuda", generator=gen).to(DTYPE)
        self.k = torch.randn(self.tokens, HK * D, device="cuda", generator=gen).to(DTYPE)
        self.v = torch.randn(self.tokens, HK * D, device="cuda", generator=gen).to(DTYPE)
        build = self.kv.build_metadata_for_cudagraph_capture if self.decode else self.kv.build_metadata
        self.md = build(self.common)
        self.result = torch.empty(0)

    def vattn_forward(self) -> None:
        """One layer forward: the custom op stores K/V and attends (the step's metadata is built)."""
        import vattn

        with vattn.set_forward_context(self.md, self.cfg):
            self.result = self.layer(self.q, self.k, self.v)

    def store(self) -> None:
        """The KV write a bare-library user also needs (vattn's shared ``store_kv`` kernel)."""
        from vattn.ops.kv_store import store_kv

        store_kv(self.k.view(-1, HK, D), self.v.view(-1, HK, D), self.key_cache, self.value_cache,
                 self.common.slot_mapping, "auto", self.layer._k_scale, self.layer._v_scale)


def bare_flashinfer(s: Setup) -> Callable[[], Any]:
    """FlashInfer's own wrapper, planned for the same batch and cache layout; returns the call to time."""
    import flashinfer

    from vattn.backends.flashinfer import gather_page_indices, paged_kv_layout
    from vattn.core.layout import get_kv_cache_layout

    layout = get_kv_cache_layout()
    paged = s.cache.permute(0, 1, 3, 2, 4) if layout == "HND" else s.cache  # FlashInfer's HND view
    indptr, last = paged_kv_layout(s.common.seq_lens_cpu, BLOCK)
    indices = gather_page_indices(s.common.block_table_tensor, indptr)
    ws = torch.zeros(256 * 2**20, dtype=torch.uint8, device="cuda")
    q = s.q.view(-1, H, D)
    out = torch.empty_like(q)
    args = dict(q_data_type=DTYPE, kv_data_type=DTYPE, sm_scale=D**-0.5)
    if s.decode:
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            ws, layout, use_cuda_graph=True, use_tensor_cores=True, paged_kv_indptr_buffer=indptr.cuda(),
            paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last.cuda())
        w.plan(indptr, indices, last, H, HK, D, BLOCK, pos_encoding_mode="NONE", **args)
    else:
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, layout)
        w.plan(s.common.query_start_loc_cpu, indptr, indices, last, H, HK, D, BLOCK, causal=True, **args)
    s.bare_out = out
    return lambda: w.run(q, paged, out=out)


def bare_flash_attn(s: Setup) -> Callable[[], Any]:
    """flash-attn-4's public varlen call with the same page table; returns the call to time."""
    from flash_attn.cute import flash_attn_varlen_func

    q = s.q.view(-1, H, D)
    b = s.common.num_reqs
    qsl, seq, bt = s.common.query_start_loc[: b + 1], s.common.seq_lens[:b], s.common.block_table_tensor[:b]
    holder: dict[str, torch.Tensor] = {}

    def call() -> None:
        res = flash_attn_varlen_func(q, s.key_cache, s.value_cache, cu_seqlens_q=qsl, seqused_k=seq,
                                     page_table=bt, max_seqlen_q=s.new, softmax_scale=D**-0.5, causal=True)
        holder["out"] = res[0] if isinstance(res, tuple) else res

    s.bare_holder = holder
    return call


def work(reqs: int, ctx: int, new: int) -> tuple[int | None, float | None]:
    """(KV bytes a decode reads, causal attention flops of a prefill); the other is None."""
    if new == 1:
        return reqs * (ctx + new) * HK * D * 2 * DTYPE.itemsize, None
    return None, 4 * H * D * reqs * (new * (new + 1) / 2 + new * ctx)


def measure(backend: str, case: str, shape: tuple[int, int, int], rep: float,
            roof: roofline.Roofline) -> list[dict[str, Any]]:
    """Rows (one per timing mode) of one backend on one case; the caller frees GPU memory after."""
    s = Setup(backend, *shape)
    iface = "flashinfer"
    if backend == "FLASHINFER":
        bare = bare_flashinfer(s)
    else:
        from vattn.backends.flash_attn import get_flash_attn_interface

        info, _ = get_flash_attn_interface()
        iface = info.name if info else "none"
        if iface != "fa4":
            raise RuntimeError(f"the bare FLASH_ATTN baseline is written for flash-attn-4, found {iface}")
        bare = bare_flash_attn(s)

    def bare_kv() -> None:
        s.store()
        bare()

    # Correctness: the vattn layer and the bare call agree (same inputs, same cache).
    s.vattn_forward()
    bare()
    torch.cuda.synchronize()
    ref = s.bare_out if backend == "FLASHINFER" else s.bare_holder["out"]
    diff = (s.result.view(-1, H, D).float() - ref.view(-1, H, D).float()).abs().max().item()

    kv_bytes, flops = work(s.reqs, s.ctx, s.new)
    modes = ["cuda_graph"] if s.decode else ["eager", "cuda_graph"]
    rows = []
    for mode in modes:
        if mode == "cuda_graph":
            def timer(f: Callable[[], Any]) -> float:
                return common.bench_cuda_graph(f, rep=rep)["median_ms"]
        else:
            def timer(f: Callable[[], Any]) -> float:
                return common.bench(f, rep=rep)["median_ms"]
        t_v, t_b, t_bkv = timer(s.vattn_forward), timer(bare), timer(bare_kv)
        row: dict[str, Any] = dict(backend=backend, interface=iface, case=case, mode=mode, requests=s.reqs,
                                   context=s.ctx, new_tokens=s.new, vattn_ms=t_v, bare_ms=t_b, bare_kv_ms=t_bkv,
                                   ratio=t_v / t_bkv, ratio_vs_attention_only=t_v / t_b,
                                   meets_target=t_v / t_bkv <= TARGET, max_abs_diff=diff)
        if mode == "eager":  # host work included: what the layer's Python costs per call
            w_v, w_b, w_bkv = (common.bench_wall(f, rep=rep)["median_ms"] for f in (s.vattn_forward, bare, bare_kv))
            row.update(vattn_wall_ms=w_v, bare_wall_ms=w_b, bare_kv_wall_ms=w_bkv, wall_ratio=w_v / w_bkv)
        if kv_bytes is not None:
            row["tb_per_s"] = kv_bytes / (t_v * 1e-3) / 1e12
            row["bare_tb_per_s"] = kv_bytes / (t_b * 1e-3) / 1e12
        if flops is not None:
            row["tflop_per_s"] = flops / (t_v * 1e-3) / 1e12
            row["bare_tflop_per_s"] = flops / (t_b * 1e-3) / 1e12
        row.update(roof.fractions(tbps=row.get("tb_per_s"), tflops=row.get("tflop_per_s")))
        row.update({f"bare_{k}": v for k, v in roof.fractions(tbps=row.get("bare_tb_per_s"),
                                                               tflops=row.get("bare_tflop_per_s")).items()})
        rows.append(row)
    return rows


def panels_for(rows: Sequence[dict[str, Any]], roof: roofline.Roofline) -> list[dict[str, Any]]:
    """``common.plot_panels`` panels: decode TB/s vs KV tokens read, prefill TFLOP/s vs new tokens,
    vattn and the bare library per backend (and timing mode), with the roofline's ceilings."""
    decode: dict[str, tuple[list[float], list[float]]] = {}
    prefill: dict[str, tuple[list[float], list[float]]] = {}
    for r in rows:
        is_decode = r.get("tb_per_s") is not None
        series, x = (decode, r["requests"] * (r["context"] + r["new_tokens"])) if is_decode else \
            (prefill, r["requests"] * r["new_tokens"])
        key, bare_key = ("tb_per_s", "bare_tb_per_s") if is_decode else ("tflop_per_s", "bare_tflop_per_s")
        for who, col in (("vattn", key), ("bare", bare_key)):
            xs, ys = series.setdefault(f"{r['backend']} {who} ({r['mode']})", ([], []))
            xs.append(x)
            ys.append(r.get(col))
    return [
        {"title": "decode: KV read bandwidth", "xlabel": "KV tokens read (requests x seq len)", "ylabel": "TB/s",
         "logx": True, "series": decode, "ceilings": {"copy": roof.copy_tbps, "read": roof.read_tbps}},
        {"title": "prefill: causal attention", "xlabel": "new tokens (requests x query len)", "ylabel": "TFLOP/s",
         "logx": True, "series": prefill, "ceilings": {"bf16 matmul": roof.bf16_tflops}},
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", nargs="+", default=["FLASHINFER", "FLASH_ATTN"])
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--quick", action="store_true", help="small shapes (a smoke run)")
    p.add_argument("--rep", type=float, default=200.0, help="milliseconds of timed runs per measurement")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_layer_overhead needs a CUDA GPU.", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    env = common.env_info("cuda")
    path = common.result_path("layer_overhead", env)
    roof = roofline.measure("cuda", quick=args.quick)
    shapes = QUICK if args.quick else CASES
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    plots: list[str] = []
    summary: dict[str, Any] = dict(
        target_ratio=TARGET, quick=args.quick, heads=H, kv_heads=HK, head_dim=D, block_size=BLOCK, dtype=str(DTYPE),
        ratio="vattn_ms / bare_kv_ms (bare attention + the same KV-write kernel, vattn.ops.kv_store)",
        wall_ratio="eager rows: vattn_wall_ms / bare_kv_wall_ms (common.bench_wall: host work included)",
        roofline=roof.to_dict(), skipped=skipped, partial=True)

    def write() -> None:
        summary["all_meet_target"] = all(r["meets_target"] for r in rows) if rows else None
        common.write_results("layer_overhead", {"env": env, "rows": rows, "summary": summary, "plots": plots},
                             path=path)

    points = [(b, c) for b in args.backends for c in args.cases]
    for backend, case in common.progress(points, desc="layer overhead"):
        try:
            rows += measure(backend, case, shapes[case], args.rep, roof)
        except Exception as e:  # one backend missing must not lose the others' numbers
            skipped[f"{backend}/{case}"] = f"{type(e).__name__}: {e}"[:800]
            print(f"skipped {backend}/{case}: {skipped[f'{backend}/{case}']}", file=sys.stderr)
        common.free_memory()
        write()
    if not args.no_plot:
        png = common.plot_panels(path.with_suffix(".png"), panels_for(rows, roof), ncols=2,
                                 title=f"vattn.Attention vs the bare library ({env['device_name']})")
        plots[:] = [png.name] if png is not None else []
    summary.update(partial=False, wall_s=time.perf_counter() - t0)
    write()
    table = common.Table(TABLE_COLUMNS, title=f"vattn.Attention vs the bare library (target ratio <= {TARGET})")
    table.extend(rows)
    table.print()
    print(f"wrote {path}" + (f" and {plots[0]}" if plots else ""))
    return 0 if rows else 1


if __name__ == "__main__":
    raise SystemExit(main())

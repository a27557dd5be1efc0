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
bare_ms`` are reported, with TB/s of KV read (decode) or causal TFLOP/s (prefill). Timing:
``benchmarks.common.bench`` (``triton.testing.do_bench``, medians, L2 flushed before each run).

Usage (GPU machine, repository root, ``PYTHONPATH=$PWD``)::

    python benchmarks/bench_layer_overhead.py [--backends FLASHINFER FLASH_ATTN] [--cases ...] [--quick]

Writes ``layer_overhead-<device>-<date>.json`` to ``$OUT`` if set, else ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Table, bench, bench_cuda_graph, env_info, free_memory, progress, write_results  # noqa: E402

H, HK, D, BLOCK, DTYPE = 32, 8, 128, 16, torch.bfloat16
CASES: dict[str, tuple[int, int, int]] = {  # name: (requests, cached tokens, new tokens)
    "decode-64x4096": (64, 4095, 1),
    "decode-1x32k": (1, 32767, 1),
    "prefill-8x2048": (8, 0, 2048),
}
QUICK = {"decode-64x4096": (8, 511, 1), "decode-1x32k": (1, 4095, 1), "prefill-8x2048": (2, 0, 256)}
TARGET = 1.03


class Setup:
    """One backend's layer, cache, inputs and metadata for one case."""

    def __init__(self, backend: str, reqs: int, ctx: int, new: int) -> None:
        import vattn
        from vattn.config import CacheConfig, CompilationConfig, CUDAGraphMode, VattnConfig

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
        self.cache.normal_()  # random, never zeros
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
        from vattn.ops.kv_store import store_kv

        kc, vc = self.key_value_caches()
        store_kv(self.k.view(-1, HK, D), self.v.view(-1, HK, D), kc, vc, self.common.slot_mapping, "auto",
                 self.layer._k_scale, self.layer._v_scale)

    def key_value_caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.backend == "FLASHINFER":  # (N, 2, bs, Hk, D)
            return self.cache[:, 0], self.cache[:, 1]
        return self.cache[0], self.cache[1]  # (2, N, bs, Hk, D)


def bare_flashinfer(s: Setup) -> Callable[[], Any]:
    """FlashInfer's own wrapper, planned for the same batch; returns the call to time."""
    import flashinfer

    from vattn.backends.flashinfer import gather_page_indices, paged_kv_layout

    indptr, last = paged_kv_layout(s.common.seq_lens_cpu, BLOCK)
    indices = gather_page_indices(s.common.block_table_tensor, indptr)
    ws = torch.zeros(256 * 2**20, dtype=torch.uint8, device="cuda")
    q = s.q.view(-1, H, D)
    out = torch.empty_like(q)
    args = dict(q_data_type=DTYPE, kv_data_type=DTYPE, sm_scale=D**-0.5)
    if s.decode:
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            ws, "NHD", use_cuda_graph=True, use_tensor_cores=True, paged_kv_indptr_buffer=indptr.cuda(),
            paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last.cuda())
        w.plan(indptr, indices, last, H, HK, D, BLOCK, pos_encoding_mode="NONE", **args)
    else:
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(s.common.query_start_loc_cpu, indptr, indices, last, H, HK, D, BLOCK, causal=True, **args)
    s.bare_out = out
    return lambda: w.run(q, s.cache, out=out)


def bare_flash_attn(s: Setup) -> Callable[[], Any]:
    """flash-attn-4's public varlen call with the same page table; returns the call to time."""
    from flash_attn.cute import flash_attn_varlen_func

    kc, vc = s.key_value_caches()
    q = s.q.view(-1, H, D)
    b = s.common.num_reqs
    qsl, seq, bt = s.common.query_start_loc[: b + 1], s.common.seq_lens[:b], s.common.block_table_tensor[:b]
    holder: dict[str, torch.Tensor] = {}

    def call() -> None:
        res = flash_attn_varlen_func(q, kc, vc, cu_seqlens_q=qsl, seqused_k=seq, page_table=bt,
                                     max_seqlen_q=s.new, softmax_scale=D**-0.5, causal=True)
        holder["out"] = res[0] if isinstance(res, tuple) else res

    s.bare_holder = holder
    return call


def measure(backend: str, case: str, shape: tuple[int, int, int], rep: float) -> list[dict[str, Any]]:
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

    modes = ["cuda_graph"] if s.decode else ["eager", "cuda_graph"]
    rows = []
    for mode in modes:
        timer = (lambda f: bench_cuda_graph(f, rep=rep)) if mode == "cuda_graph" else (lambda f: bench(f, rep=rep))
        t_v = timer(s.vattn_forward)["median_ms"]
        t_b = timer(bare)["median_ms"]
        t_bkv = timer(bare_kv)["median_ms"]
        seq = s.ctx + s.new
        row: dict[str, Any] = dict(backend=backend, interface=iface, case=case, mode=mode, requests=s.reqs,
                                   context=s.ctx, new_tokens=s.new, vattn_ms=t_v, bare_ms=t_b, bare_kv_ms=t_bkv,
                                   ratio=t_v / t_bkv, ratio_vs_attention_only=t_v / t_b,
                                   meets_target=t_v / t_bkv <= TARGET, max_abs_diff=diff)
        if s.decode:
            kv_bytes = s.reqs * seq * HK * D * 2 * DTYPE.itemsize
            row["tb_per_s"] = kv_bytes / (t_v * 1e-3) / 1e12
            row["bare_tb_per_s"] = kv_bytes / (t_b * 1e-3) / 1e12
        else:
            flops = 4 * H * D * s.reqs * (s.new * (s.new + 1) / 2 + s.new * s.ctx)
            row["tflop_per_s"] = flops / (t_v * 1e-3) / 1e12
            row["bare_tflop_per_s"] = flops / (t_b * 1e-3) / 1e12
        rows.append(row)
    del s
    free_memory()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", nargs="+", default=["FLASHINFER", "FLASH_ATTN"])
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--quick", action="store_true", help="small shapes (a smoke run)")
    p.add_argument("--rep", type=float, default=200.0, help="milliseconds of timed runs per measurement")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_layer_overhead needs a CUDA GPU (see ../shared/device/README.md).", file=sys.stderr)
        return 2
    shapes = QUICK if args.quick else CASES
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    points = [(b, c) for b in args.backends for c in args.cases]
    for backend, case in progress(points, desc="layer overhead"):
        try:
            rows += measure(backend, case, shapes[case], args.rep)
        except Exception as e:  # one backend missing must not lose the others' numbers
            skipped[f"{backend}/{case}"] = f"{type(e).__name__}: {e}"
            print(f"skipped {backend}/{case}: {skipped[f'{backend}/{case}']}", file=sys.stderr)
            free_memory()
    table = Table(["backend", "interface", "case", "mode", "vattn_ms", "bare_ms", "bare_kv_ms", "ratio",
                   "ratio_vs_attention_only", "tb_per_s", "tflop_per_s", "max_abs_diff"],
                  title=f"vattn.Attention vs the bare library (target ratio <= {TARGET})")
    table.extend(rows)
    table.print()
    summary = dict(target_ratio=TARGET, quick=args.quick, heads=H, kv_heads=HK, head_dim=D, block_size=BLOCK,
                   ratio="vattn_ms / bare_kv_ms (bare attention + the same KV-write kernel, vattn.ops.kv_store)",
                   dtype=str(DTYPE), skipped=skipped, all_meet_target=all(r["meets_target"] for r in rows) if rows else None)
    path = write_results("layer_overhead", {"rows": rows, "summary": summary, "env": env_info()})
    print(f"wrote {path}")
    return 0 if rows else 1


if __name__ == "__main__":
    raise SystemExit(main())

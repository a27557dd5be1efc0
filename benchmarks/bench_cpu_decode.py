#!/usr/bin/env python
"""One decode call of ``vattn.Attention`` on the CPU (CPU_ATTN and TORCH_SDPA) against a bare SDPA call.

The CPU is where the main job runs by default. Shape: 32 query / 8 KV heads, head dim 64, float32,
one thread, block size 16. Cases: one request of ``--context`` tokens on consecutive blocks (issue
35's figure), the same on runs of 16 blocks (two requests' allocations interleaved), on a shuffled
table, and 8 requests of mixed lengths (a masked batch). Per case and backend, medians of ``--reps``
calls after warm-up:

| column | meaning |
| --- | --- |
| ``backend`` | the layer's backend |
| ``vattn_us`` | ``attn(q, k, v)`` inside a forward context: the new token's K/V stored, the paged cache read, attention |
| ``bare_gqa_us`` | ``F.scaled_dot_product_attention(q, k, v, enable_gqa=True)`` over contiguous (B, Hk, L, D) K/V of the same tokens |
| ``bare_rows_us`` | the same with each KV head's query heads as query rows (no GQA expansion): SDPA's best on these shapes |
| ``x_bare_gqa`` / ``x_bare_rows`` | ``vattn_us`` over each |

Writes ``cpu_decode-<device>-<date>.json`` to $OUT or benchmarks/results/::

    PYTHONPATH=$PWD python benchmarks/bench_cpu_decode.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import vattn  # noqa: E402
from benchmarks.common import Table, env_info, write_results  # noqa: E402

H, HK, D, BLOCK = 32, 8, 64, 16


def median_us(fn: Callable[[], Any], reps: int) -> float:
    for _ in range(max(20, reps // 10)):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def layout(per: list[int], how: str) -> list[list[int]]:
    """Block ids of requests needing ``per`` blocks: consecutive, in runs of 16 (every other run
    free, as two interleaved allocations leave it), or shuffled."""
    total = sum(per)
    ids = list(range(total))
    if how == "runs":
        ids = [b for start in range(0, 2 * total, 32) for b in range(start, start + 16)][:total]
    elif how == "shuffled":
        ids = torch.randperm(2 * total).tolist()[:total]
    starts = [sum(per[:i]) for i in range(len(per))]
    return [ids[s : s + p] for s, p in zip(starts, per)]


def case(name: str, lens: list[int], reps: int, backend: str, how: str = "consecutive") -> dict[str, Any]:
    """``lens``: tokens each request has cached; each decodes one more."""
    cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=BLOCK))
    with vattn.set_current_vattn_config(cfg):
        attn = vattn.Attention(H, D, D**-0.5, num_kv_heads=HK, prefix="bench.attn", attn_backend=backend)
    per = [-(-(n + 1) // BLOCK) for n in lens]
    kv = vattn.allocate_kv_cache(cfg, num_blocks=2 * sum(per) + 1, dtype=torch.float32)
    kv.tensors["bench.attn"].normal_()
    tables = layout(per, how)
    common = kv.common_metadata(query_lens=[1] * len(lens), num_computed_tokens=lens, block_tables=tables)
    md = kv.build_metadata(common)
    b = len(lens)
    q, k, v = torch.randn(b, H * D), torch.randn(b, HK * D), torch.randn(b, HK * D)
    with vattn.set_forward_context(md, cfg):
        vattn_us = median_us(lambda: attn(q, k, v), reps)
    # Bare: contiguous K/V of the longest request (shorter ones masked), as a model with a dense cache has.
    length = max(lens) + 1
    qb = torch.randn(b, H, 1, D)
    kb, vb = torch.randn(b, HK, length, D), torch.randn(b, HK, length, D)
    mask = (torch.arange(length)[None, :] <= torch.tensor(lens)[:, None])[:, None, None, :] if b > 1 else None
    gqa_us = median_us(lambda: F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, enable_gqa=True), reps)
    qr = qb.view(b, HK, H // HK, D)
    rows_us = median_us(lambda: F.scaled_dot_product_attention(qr, kb, vb, attn_mask=mask), reps)
    return {"case": name, "backend": backend, "batch": b, "max_context": max(lens), "vattn_us": vattn_us,
            "bare_gqa_us": gqa_us,
            "bare_rows_us": rows_us, "x_bare_gqa": vattn_us / gqa_us, "x_bare_rows": vattn_us / rows_us}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=100, help="cached tokens of the one-request case")
    p.add_argument("--reps", type=int, default=2000)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--backends", default="CPU_ATTN,TORCH_SDPA", help="comma-separated, each timed in this run")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = []
    for backend in args.backends.split(","):
        for how in ("consecutive", "runs", "shuffled"):
            rows.append(case(f"1 x {args.context + 1}, {how}", [args.context], args.reps, backend, how))
        rows.append(case("8 mixed", [100, 37, 250, 5, 64, 180, 90, 17], args.reps // 4, backend))
    one = {(r["backend"], r["case"].split(", ")[-1]): r for r in rows if r["batch"] == 1}
    summary = {"threads": args.threads, "shape": f"{H} / {HK} heads, head dim {D}, float32, block {BLOCK}",
               "targets": [{"what": f"issue 59: CPU_ATTN decode at most 1.3x a bare SDPA call ({how} blocks)",
                            "ratio": one[("CPU_ATTN", how)]["x_bare_gqa"],
                            "met": one[("CPU_ATTN", how)]["x_bare_gqa"] <= 1.3}
                           for how in ("consecutive", "runs", "shuffled") if ("CPU_ATTN", how) in one]}
    out = {"rows": rows, "summary": summary}
    path = write_results("cpu_decode", {**out, "env": env_info("cpu")})
    table = Table(["case", "backend", "vattn_us", "bare_gqa_us", "bare_rows_us", "x_bare_gqa", "x_bare_rows"],
                  title="decode call on the CPU")
    table.extend(rows)
    table.print()
    print(f"targets: {summary['targets']}\nwrote {path}")
    return out


if __name__ == "__main__":
    main()

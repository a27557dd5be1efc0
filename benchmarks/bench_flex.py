"""FLEX_ATTENTION and TREE_ATTN beside TRITON_ATTN, FlashInfer and flash-attn-4 (issue 37).

Cases (GPU defaults; ``--quick`` on the CPU shrinks them to a smoke test):

| case | what | providers |
| --- | --- | --- |
| ``decode`` | 64 requests x 4096 context, one new token each, causal | FLEX_ATTENTION, TRITON_ATTN, FlashInfer, flash-attn-4 |
| ``prefill`` | 8 prompts x 2048, causal | the same |
| ``decode_prefix_lm``, ``prefill_prefix_lm`` | the same shapes with a prefix-LM mask (prompt: the first quarter) | FLEX_ATTENTION |
| ``prefill_document`` | prefill with documents of 512 tokens packed per sequence | FLEX_ATTENTION |
| ``tree`` | 8 requests x 4096 context, each with a binary tree of 64 draft tokens | TREE_ATTN and TRITON_ATTN (its kernel's tree mask); FLEX_ATTENTION and TRITON_ATTN causal over 64 tokens as reference points |

vattn backends run ``impl.forward`` (KV store + attention; the builder's per-step work, block
masks included, is timed apart as ``build_ms``) on metadata from their builders, as
``benchmarks/bench_kernels.py`` does; the library calls are ``bench_kernels``' raw providers.
Every provider of a case reads the same cache contents; ``max_abs_diff`` is against the first
provider of the case. Each call is timed replaying a CUDA graph of it where it can be captured,
else eagerly (``timer``). The summary states the issue's targets: FLEX causal prefill at least
0.7x flash-attn-4 and decode at least 0.6x TRITON_ATTN; masks other than causal at most 1.2x the
causal time (``work`` counts the attended pairs, so a mask that attends more says so).

GPU: ``PYTHONPATH=$PWD python benchmarks/bench_flex.py`` (``--block-sizes 16,64``: FlexAttention's
key tile lies inside one cache block). CPU smoke test: ``--device cpu --quick --eager``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `vattn` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import vattn  # noqa: E402
from benchmarks import bench_kernels as bk  # noqa: E402
from benchmarks import common  # noqa: E402
from vattn.backends.flex_attention import mods  # noqa: E402

logger = logging.getLogger("vattn.benchmarks.flex")
LAYER = "bench.attn"
BASELINES = ("vattn:TRITON_ATTN", "flashinfer", "flash_attn")


def tree_parents(drafts: int) -> list[int]:
    """A binary tree of ``drafts`` tokens: token i's parent is (i - 1) // 2; the root continues the context."""
    return [-1] + [(i - 1) // 2 for i in range(1, drafts)]


def flex_case(args: argparse.Namespace, batch: int, context: int, query: int, seed: int,
              tree: bool = False) -> bk.Case:
    """A ``bench_kernels.Case`` of ``batch`` requests with ``context`` cached and ``query`` new tokens."""
    dev, bs = torch.device(args.device), args.block_size
    per_req = -(-(context + query) // bs)
    num_blocks = batch * per_req + 1
    gen = torch.Generator().manual_seed(seed)
    table = (torch.randperm(num_blocks - 1, generator=gen) + 1).view(batch, per_req).to(torch.int32)
    parents = tree_parents(query) * batch if tree else None
    cm = vattn.build_common_attn_metadata([query] * batch, [context] * batch, table, bs, dev, num_blocks=num_blocks,
                                          tree_parents=parents)
    q = torch.randn(batch * query, args.num_heads, args.head_dim, generator=torch.Generator(dev).manual_seed(seed),
                    device=dev).to(args.dtype)
    pt = bk.Point("decode" if query == 1 else "prefill", batch, context + query, args.head_dim, "auto")
    return bk.Case(pt, q, cm.block_table_tensor, cm.seq_lens, cm.query_start_loc, cm.slot_mapping, cm, num_blocks, seed)


def prepare_layer(case: bk.Case, args: argparse.Namespace, backend: str, mask_mod: Any = None) -> tuple[bk.Prepared, float]:
    """A vattn backend through ``vattn.Attention``'s impl: (prepared call, builder ms)."""
    cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=args.block_size))
    flex = {"compiled": not args.eager} if backend in ("FLEX_ATTENTION", "TREE_ATTN") else {}
    with vattn.set_current_vattn_config(cfg), common.default_dtype(args.dtype):
        layer = vattn.Attention(args.num_heads, args.head_dim, args.head_dim**-0.5, num_kv_heads=args.num_kv_heads,
                                prefix=LAYER, attn_backend=backend, mask_mod=mask_mod, **flex)
    layer.to(args.device)
    kv = vattn.allocate_kv_cache(cfg, num_blocks=case.num_blocks, device=args.device, dtype=args.dtype)
    cache = kv.tensors[LAYER]
    k, v = bk.split_kv(cache, case.num_blocks)
    bk.fill_kv_(k, v, case.seed)
    key, value = bk.new_kv(k, v, case.slots, args.dtype)
    builds = []
    for _ in range(3):
        t0 = time.perf_counter()
        md = kv.build_metadata(case.common)[LAYER]
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        builds.append((time.perf_counter() - t0) * 1e3)
    out = torch.empty(case.q.shape, dtype=args.dtype, device=args.device)

    def fn() -> None:
        layer.impl.forward(layer, case.q, key, value, cache, md, output=out)

    return bk.Prepared(fn, lambda: out, cache.element_size(), keep=(layer, kv, cfg, md, key, value)), min(builds)


def raw_cache(case: bk.Case, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """The library providers' (key, value) cache, with the contents the vattn caches get."""
    t = torch.empty((2, case.num_blocks, args.block_size, args.num_kv_heads, args.head_dim), dtype=args.dtype,
                    device=args.device)
    bk.fill_kv_(t[0], t[1], case.seed)
    return t[0], t[1]


def measure(prep: bk.Prepared, args: argparse.Namespace) -> dict[str, Any]:
    warmup, rep = (5, 20) if args.quick else (25, 200)
    if torch.device(args.device).type == "cuda":
        try:
            return common.bench_cuda_graph(prep.fn, warmup=warmup, rep=rep)
        except Exception as e:  # not capturable: time it eagerly
            logger.warning("CUDA-graph capture failed (%s); timing eagerly", e)
            torch.cuda.synchronize()
    return common.bench(prep.fn, warmup=warmup, rep=rep, device=args.device)


def cases(args: argparse.Namespace) -> list[tuple[str, str, Callable[[int], bk.Case], list[tuple[str, Any]]]]:
    """(case, mask, case builder(seed), [(provider, mask_mod or None)]): the grid of the run."""
    d_b, d_l = (4, 256) if args.quick and args.device == "cpu" else (args.decode_batch, args.decode_len)
    p_b, p_l = (2, 128) if args.quick and args.device == "cpu" else (args.prefill_batch, args.prefill_len)
    t_b, t_l, drafts = (2, 64, 16) if args.quick and args.device == "cpu" else (args.tree_batch, args.decode_len, args.drafts)
    base = ["vattn:TORCH_SDPA"] if args.device == "cpu" else list(BASELINES)
    prompt = lambda b, n: torch.full((b,), n // 4, dtype=torch.int32, device=args.device)  # noqa: E731
    docs = lambda b, n: (torch.arange(n, device=args.device) // 512).expand(b, n).contiguous()  # noqa: E731
    grid = [
        ("decode", "causal", lambda s: flex_case(args, d_b, d_l - 1, 1, s), [("FLEX_ATTENTION", None)] + [(p, None) for p in base]),
        ("prefill", "causal", lambda s: flex_case(args, p_b, 0, p_l, s), [("FLEX_ATTENTION", None)] + [(p, None) for p in base]),
        ("decode", "prefix_lm", lambda s: flex_case(args, d_b, d_l - 1, 1, s), [("FLEX_ATTENTION", mods.prefix_lm(prompt(d_b, d_l)))]),
        ("prefill", "prefix_lm", lambda s: flex_case(args, p_b, 0, p_l, s), [("FLEX_ATTENTION", mods.prefix_lm(prompt(p_b, p_l)))]),
        ("prefill", "document", lambda s: flex_case(args, p_b, 0, p_l, s), [("FLEX_ATTENTION", mods.document(docs(p_b, p_l)))]),
        ("tree", "tree", lambda s: flex_case(args, t_b, t_l, drafts, s, tree=True),
         [("TREE_ATTN", None)] + ([] if args.device == "cpu" else [("vattn:TRITON_ATTN", None)])),
        ("tree", "causal", lambda s: flex_case(args, t_b, t_l, drafts, s), [("FLEX_ATTENTION", None), (base[0], None)]),
    ]
    return [g for g in grid if g[0] in args.cases or f"{g[0]}_{g[1]}" in args.cases]


def pairs(case: bk.Case, mask: str, args: argparse.Namespace) -> int:
    """Attended (query, key) pairs of the case under its mask (the work)."""
    b, s = case.point.batch, case.point.seq_len
    q = case.q.shape[0] // b
    ctx = s - q
    if mask == "prefix_lm":
        p = s // 4
        return b * (sum(max(ctx + i + 1, p) for i in range(q)))
    if mask == "document":
        n, full = s // 512, s % 512
        return b * (n * 512 * 513 // 2 + full * (full + 1) // 2)
    if mask == "tree":
        depth = [0] * q
        for i, par in enumerate(tree_parents(q)[1:], start=1):
            depth[i] = depth[par] + 1
        return b * sum(ctx + d + 1 for d in depth)
    return b * sum(ctx + i + 1 for i in range(q))


def run(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    for bs in args.block_sizes:
        args.block_size = bs
        for index, (name, mask, make, providers) in enumerate(cases(args)):
            case = make(args.seed + index)
            ref = None
            for provider, mask_mod in providers:
                label = f"{name}/{mask}/{provider}/bs{bs}"
                try:
                    build_ms = None
                    if provider in bk.RAW_PROVIDERS:
                        prep = bk.prepare(provider, case, lambda: raw_cache(case, args), args)
                    else:
                        prep, build_ms = prepare_layer(case, args, provider.removeprefix("vattn:"), mask_mod)
                    res = measure(prep, args)
                except (bk.Skip, Exception) as e:  # noqa: BLE001  (a provider that cannot run here)
                    errors[label] = f"{type(e).__name__}: {e}"[:300]
                    logger.warning("%s: %s", label, errors[label])
                    continue
                out = prep.result()
                diff = None if ref is None else (out.float() - ref.float()).abs().max().item()
                ref = out.clone() if ref is None else ref
                work = pairs(case, mask, args)
                ms = res["median_ms"]
                rows.append({"case": name, "mask": mask, "provider": provider.removeprefix("vattn:"), "block_size": bs,
                             "batch": case.point.batch, "seq_len": case.point.seq_len, "q_len": case.q.shape[0] // case.point.batch,
                             "ms": ms, "p20_ms": res["p20"], "p80_ms": res["p80"], "timer": res["method"],
                             "build_ms": build_ms, "pairs": work,
                             "tflops": 4 * args.num_heads * args.head_dim * work / (ms * 1e-3) / 1e12,
                             "max_abs_diff": diff, "compiled": not args.eager})
                del prep
                common.free_memory()
    return rows, {"errors": errors, **targets(rows)}


def targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets, per block size, from the rows (None where a provider did not run)."""
    def ms(case: str, mask: str, provider: str, bs: int) -> float | None:
        return next((r["ms"] for r in rows if (r["case"], r["mask"], r["provider"], r["block_size"]) == (case, mask, provider, bs)), None)

    out: dict[str, Any] = {}
    for bs in sorted({r["block_size"] for r in rows}):
        flex = lambda c, m="causal": ms(c, m, "FLEX_ATTENTION", bs)  # noqa: E731
        ratio = lambda a, b: None if a is None or b is None else round(a / b, 3)  # noqa: E731
        t = {"prefill_vs_flash_attn_4": ratio(ms("prefill", "causal", "flash_attn", bs), flex("prefill")),
             "decode_vs_triton": ratio(ms("decode", "causal", "TRITON_ATTN", bs), flex("decode")),
             "prefill_prefix_lm_over_causal": ratio(flex("prefill", "prefix_lm"), flex("prefill")),
             "decode_prefix_lm_over_causal": ratio(flex("decode", "prefix_lm"), flex("decode")),
             "prefill_document_over_causal": ratio(flex("prefill", "document"), flex("prefill")),
             "tree_over_flex_causal": ratio(ms("tree", "tree", "TREE_ATTN", bs), flex("tree")),
             "tree_triton_over_tree_attn": ratio(ms("tree", "tree", "TRITON_ATTN", bs), ms("tree", "tree", "TREE_ATTN", bs))}
        t["met"] = {"prefill >= 0.7x flash-attn-4": None if t["prefill_vs_flash_attn_4"] is None else t["prefill_vs_flash_attn_4"] >= 0.7,
                    "decode >= 0.6x TRITON_ATTN": None if t["decode_vs_triton"] is None else t["decode_vs_triton"] >= 0.6,
                    "masks <= 1.2x causal": all(v is None or v <= 1.2 for k, v in t.items() if k.endswith("_over_causal"))}
        out[f"targets_bs{bs}"] = t
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="short timing (and, on the CPU, tiny shapes)")
    p.add_argument("--eager", action="store_true", help="FlexAttention's reference implementation (no Inductor)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--block-sizes", type=lambda s: [int(x) for x in s.split(",")], default=None)
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--decode-batch", type=int, default=64)
    p.add_argument("--decode-len", type=int, default=4096)
    p.add_argument("--prefill-batch", type=int, default=8)
    p.add_argument("--prefill-len", type=int, default=2048)
    p.add_argument("--tree-batch", type=int, default=8)
    p.add_argument("--drafts", type=int, default=64)
    p.add_argument("--cases", type=lambda s: s.split(","), default=["decode", "prefill", "tree"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="flex")
    args = p.parse_args(argv)
    args.dtype = getattr(torch, args.dtype)
    if args.block_sizes is None:
        args.block_sizes = [16, 64] if args.device == "cuda" else [16]
    if args.device == "cpu" and args.dtype != torch.float32:
        args.dtype = torch.float32  # the CPU reference path and TORCH_SDPA agree best in float32
    rows, summary = run(args)
    path = common.write_results(args.name, {"rows": rows, "summary": {**summary, "quick": args.quick, "eager": args.eager}})
    table = common.Table(["case", "mask", "provider", "block_size", "ms", "build_ms", "tflops", "max_abs_diff"])
    table.extend(rows)
    print(table.to_markdown())
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

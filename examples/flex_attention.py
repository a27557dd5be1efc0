#!/usr/bin/env python
"""Masks that no fixed kernel serves, over vattn's paged cache: FLEX_ATTENTION and TREE_ATTN.

Three steps, each checked against dense float32 attention with an explicit mask:

1. prefix-LM: two prompts attend bidirectionally within their prompt, causally after it;
2. document packing: each sequence holds several documents, a token sees only its own;
3. a draft-tree step (TREE_ATTN): each draft token sees the cached context and its ancestors.

    python examples/flex_attention.py              # CPU, FlexAttention's reference implementation
    python examples/flex_attention.py --compile    # Inductor's FlexAttention kernels (compiles first)
    python examples/flex_attention.py --device cuda --compile
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import vattn  # noqa: E402
from vattn.backends.flex_attention import mods  # noqa: E402

H, HK, D, BLOCK = 4, 2, 32, 16


def attend(mask_mod, lens, computed, args, *, backend="FLEX_ATTENTION", tree_parents=None, name="attn"):  # noqa: ANN001, ANN201
    """One step of ``sum(lens)`` new tokens through a fresh layer and cache; returns (q, k, v, out)."""
    cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=BLOCK))
    with vattn.set_current_vattn_config(cfg), torch.device(args.device):
        layer = vattn.Attention(H, D, D**-0.5, num_kv_heads=HK, prefix=name, attn_backend=backend,
                                mask_mod=mask_mod, compiled=args.compile)
    kv = vattn.allocate_kv_cache(cfg, num_blocks=64, device=args.device)
    blocks = iter(range(1, 64))
    tables = [[next(blocks) for _ in range(-(-(c + n) // BLOCK))] for c, n in zip(computed, lens)]
    common = kv.common_metadata(lens, computed, tables, tree_parents=tree_parents)
    torch.manual_seed(0)
    t = sum(lens)
    q, k, v = (torch.randn(t, h * D, device=args.device) for h in (H, HK, HK))
    with vattn.set_forward_context(kv.build_metadata(common), cfg):  # block masks are built here
        out = layer(q, k, v)
    return q.view(t, H, D), k.view(t, HK, D), v.view(t, HK, D), out.view(t, H, D)


def dense(q, k, v, allowed):  # noqa: ANN001, ANN201
    """float32 attention of one sequence with an explicit (queries, keys) mask."""
    k, v = k.repeat_interleave(H // HK, dim=1), v.repeat_interleave(H // HK, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * D**-0.5
    return torch.einsum("hqk,khd->qhd", s.masked_fill(~allowed, float("-inf")).softmax(-1), v.float())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--compile", action="store_true", help="Inductor's kernels (else the reference implementation)")
    args = p.parse_args()
    dev = args.device

    # 1. prefix-LM: the prompts' lengths are per-request facts the mask reads (updated in place per step).
    lens, prompt_lens = [40, 24], torch.tensor([30, 10], dtype=torch.int32, device=dev)
    q, k, v, out = attend(mods.prefix_lm(prompt_lens), lens, [0, 0], args, name="prefix_lm")
    err, start = 0.0, 0
    for r, n in enumerate(lens):
        pos = torch.arange(n, device=dev)
        allowed = (pos[None, :] <= pos[:, None]) | (pos[None, :] < prompt_lens[r])
        sl = slice(start, start + n)
        err = max(err, (out[sl].float() - dense(q[sl], k[sl], v[sl], allowed)).abs().max().item())
        start += n
    print(f"prefix-LM, 2 prompts of {lens}: max |out - dense| = {err:.2e}")

    # 2. document packing: one sequence of 48 tokens holding documents of 20, 12 and 16.
    doc_ids = torch.repeat_interleave(torch.arange(3, device=dev), torch.tensor([20, 12, 16], device=dev))[None]
    q, k, v, out = attend(mods.document(doc_ids), [48], [0], args, name="documents")
    pos = torch.arange(48, device=dev)
    allowed = (pos[None, :] <= pos[:, None]) & (doc_ids[0][None, :] == doc_ids[0][:, None])
    print(f"document packing, 3 documents: max |out - dense| = {(out.float() - dense(q, k, v, allowed)).abs().max():.2e}")

    # 3. a tree step: 7 draft tokens over a cached context of 0 (so the dense check sees every key).
    parents = [-1, 0, 0, 1, 1, 2, 2]  # a binary tree: each token's parent among the new tokens
    q, k, v, out = attend(None, [7], [0], args, backend="TREE_ATTN", tree_parents=parents, name="tree")
    allowed = torch.zeros(7, 7, dtype=torch.bool, device=dev)
    for i in range(7):
        j = i
        while j >= 0:
            allowed[i, j], j = True, parents[j]
    print(f"draft tree of 7 tokens: max |out - dense| = {(out.float() - dense(q, k, v, allowed)).abs().max():.2e}")


if __name__ == "__main__":
    main()

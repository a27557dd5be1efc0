"""``python -m vattn`` (and the ``vattn`` console script): what this installation can run.

Prints the versions of Python, torch, Triton, FlashInfer and FlashAttention, the device, every
registry backend (available here and what it serves, unavailable here and why, or not
implemented in this version), the backend chosen for a default layer, and the ``VATTN_*``
variables in effect. ``--json`` prints the same as JSON; ``--support-matrix`` prints the
implemented backends' declared support as a Markdown table (README.md's). ``--head-size N`` (with
``--dtype``, ``--kv-cache-dtype``, ...) or ``--hf DIR`` (a transformers checkpoint) says which
backend each layer would get here and why the ones ranked above it were passed over.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from vattn import info, info_layers

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Print the report (or the support matrix); returns the exit status (0)."""
    parser = argparse.ArgumentParser(
        prog="vattn",
        description="Show what this vattn installation can run: versions, device, backends and why "
        "not, the backend chosen for a default layer, and the VATTN_* variables.",
    )
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--json", action="store_true", help="print the report as JSON")
    what.add_argument("--support-matrix", action="store_true",
                      help="print the implemented backends' declared support as a Markdown table")
    layer = parser.add_argument_group("a layer or a checkpoint: which backend each layer gets here, and why")
    layer.add_argument("--hf", metavar="DIR", help="a transformers checkpoint folder (its config.json; no weights read)")
    layer.add_argument("--head-size", type=int, help="a layer of this head size")
    layer.add_argument("--dtype", choices=sorted(info_layers.DTYPES), help="the model dtype (default: the "
                       "checkpoint's, else bfloat16 on CUDA and float32 on the CPU)")
    layer.add_argument("--num-heads", type=int, help="query heads (shown; selection does not depend on it)")
    layer.add_argument("--num-kv-heads", type=int, help="KV heads (shown; selection does not depend on it)")
    layer.add_argument("--kv-cache-dtype", default="auto", help="auto, fp8, fp8_e4m3, ...")
    layer.add_argument("--block-size", type=int, default=16)
    for flag in ("mla", "sinks", "sliding-window", "soft-cap", "alibi"):
        layer.add_argument(f"--{flag}", action="store_true", help=f"the layer has {flag.replace('-', ' ')}")
    args = parser.parse_args(argv)
    try:
        if args.hf or args.head_size:
            dtype = info_layers.DTYPES[args.dtype] if args.dtype else None
            common = dict(kv_cache_dtype=args.kv_cache_dtype, block_size=args.block_size)
            if args.hf:
                entries = info_layers.checkpoint_layers(args.hf, dtype, **common)
            else:
                entries = [info_layers.layer_selection(
                    args.head_size, dtype or (torch.bfloat16 if torch.cuda.is_available() else torch.float32),
                    use_mla=args.mla, has_sink=args.sinks, sliding_window=args.sliding_window,
                    soft_cap=args.soft_cap, alibi=args.alibi, **common)]
                entries[0]["config"].update({k: v for k, v in (("num_heads", args.num_heads),
                                                               ("num_kv_heads", args.num_kv_heads)) if v})
            print(json.dumps(entries, indent=2, default=str) if args.json else info_layers.render_layers(entries))
        elif args.support_matrix:
            sys.stdout.write(info.support_matrix_markdown())
        elif args.json:
            print(json.dumps(info.collect(), indent=2, default=str))
        else:
            print(info.render_text(info.collect()))
        sys.stdout.flush()
    except BrokenPipeError:  # ``vattn | head``: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Run ``benchmarks/bench_mla.py`` with parts of the stack switched off, to isolate a GPU fault.

    PYTHONPATH=$PWD python tools/probe_mla_model.py [--skip-hf] [--no-combo] [--no-pdl] -- --quick --parts model

Everything after ``--`` goes to bench_mla. ``--skip-hf`` leaves out transformers' rows,
``--no-combo`` / ``--no-pdl`` compile the model's pieces without Inductor's combo kernels /
programmatic dependent launch, ``--sync-steps`` synchronizes after every engine step.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    argv = sys.argv[1:]
    rest: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--no-combo", action="store_true")
    p.add_argument("--no-pdl", action="store_true")
    p.add_argument("--sync-steps", action="store_true")
    p.add_argument("--no-head-graph", action="store_true")
    p.add_argument("--no-empty-cache", action="store_true")
    args = p.parse_args(argv)

    import torch

    from benchmarks import bench_e2e, bench_mla
    from vattn.compile_passes import inductor

    if args.no_combo:
        inductor.combo_default = lambda example_inputs: {}
    if args.no_pdl:
        inductor.pdl_default = lambda example_inputs: {}
    if args.skip_hf:
        bench_e2e.hf_decode = lambda *a, **k: {}
    if args.sync_steps:
        from examples.engine import Engine

        step = Engine.step

        def synced(self: Engine) -> object:
            out = step(self)
            torch.cuda.synchronize()
            return out

        Engine.step = synced  # type: ignore[method-assign]
    if args.no_head_graph:
        from examples.engine import Engine

        Engine._greedy_from_graph = lambda self, hidden: None  # type: ignore[method-assign]
    if args.no_empty_cache:
        torch.cuda.empty_cache = lambda: None
    return bench_mla.main(rest)


if __name__ == "__main__":
    sys.exit(main())

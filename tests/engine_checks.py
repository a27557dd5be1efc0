"""Checks shared by the tests that run models through examples/engine.py: an engine's logits and
tokens against a reference run, and an engine run through ``vattn.CUDAGraphRunner``."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

import vattn
from examples.engine import Engine, Request

__all__ = ["assert_logits_match", "run_with_graphs"]


def assert_logits_match(engine: Engine, reqs: Sequence[Request], ref_tokens: Sequence[list[int]],
                        ref_logits: Sequence[torch.Tensor], *, atol: float, what: str) -> None:
    """Each request's recorded logits (steps, V) within ``atol`` of the reference's and its tokens
    equal; the reference must have no near-tie (top-2 gap above ``10 * atol``) that would let
    equal logits pick other tokens."""
    for req, tokens, ref in zip(reqs, ref_tokens, ref_logits):
        top2 = ref.topk(2, dim=-1).values
        assert float((top2[:, 0] - top2[:, 1]).min()) > 10 * atol, "the reference has a near-tie: change the seeds"
        got = torch.stack(engine.logits[req.req_id])
        torch.testing.assert_close(got, ref, atol=atol, rtol=0, msg=lambda m: f"{what} request {req.req_id}: {m}")
        assert req.output_token_ids == tokens, f"{what} request {req.req_id}"


def run_with_graphs(model: Any, fn: Any, cfg: vattn.VattnConfig, kv: vattn.PagedKVCache,
                    run: Callable[[Engine], tuple[list[Request], Any]], budget: int) -> tuple[Engine, list[Request]]:
    """``run`` an engine of ``model`` on the GPU whose steps go through ``CUDAGraphRunner(fn)``
    (FULL_AND_PIECEWISE, logits recorded); asserts some step replayed a full graph."""
    runner = vattn.CUDAGraphRunner(fn, cfg, kv, max_batch_size=8, max_model_len=128,
                                   mode=vattn.CUDAGraphMode.FULL_AND_PIECEWISE, show_progress=False)
    modes = []
    dispatch = runner.dispatch

    def recording_dispatch(common: Any) -> Any:
        bd, padded = dispatch(common)
        modes.append(bd.mode)
        return bd, padded

    runner.dispatch = recording_dispatch  # type: ignore[method-assign]
    engine = Engine(model, cfg, kv, device="cuda", max_num_batched_tokens=budget, graph_runner=runner,
                    record_logits=True)
    reqs, _ = run(engine)
    assert vattn.CUDAGraphMode.FULL in modes, f"no full-graph replay ({runner.mode}: {runner.downgrade_reasons})"
    return engine, reqs

"""Checks of what a caller hands ``VattnCausalLM``: token ids, positions and hidden states.

They run in eager calls only (not inside a ``torch.compile`` trace, not in a CUDA-graph
replay), before the step touches the KV cache, and never synchronize the host with the GPU:

| check | where it runs |
| --- | --- |
| shapes and dtypes of ``input_ids`` / ``positions`` / ``hidden`` | always (metadata only) |
| token ids in ``[0, vocab_size)`` | ids on the host (on a GPU the ids are where the engine made them) |
| positions against the step's metadata (``num_computed + j`` for new token ``j``) | positions on the host |
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["check_hidden", "check_step_inputs"]

_FIX_IDS = "pass a (T,) int64 tensor of every request's new tokens, one flattened step (as the engine does)"


def _int_vector(name: str, x: Any, fix: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a (T,) integer torch.Tensor, got {type(x).__name__}; {fix}.")
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise TypeError(f"{name}: expected an integer dtype (torch.int64), got {x.dtype}; {fix}.")
    if x.dim() != 1:
        raise ValueError(f"{name}: expected shape (T,) (the step's tokens flattened), got {tuple(x.shape)}; {fix}.")
    return x


def check_step_inputs(input_ids: Any, positions: Any, vocab_size: int | None, metadata: Any) -> None:
    """Raise ``TypeError`` / ``ValueError`` naming the argument unless ``input_ids`` and ``positions``
    are (T,) integer tensors of one length, the ids (on the host) lie in ``[0, vocab_size)`` and
    the positions (on the host) are each new token's position in its request per ``metadata``
    (a backend metadata whose ``checks`` carry the step's host mirrors, or None)."""
    _int_vector("input_ids", input_ids, _FIX_IDS)
    _int_vector("positions", positions, "pass (T,) int64 positions, one per token of input_ids")
    if positions.shape[0] != input_ids.shape[0]:
        raise ValueError(f"positions: expected one per token of input_ids ({input_ids.shape[0]}), got "
                         f"{positions.shape[0]}; pass the same number of ids and positions.")
    if input_ids.device.type == "cpu" and vocab_size is not None and input_ids.numel():
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= vocab_size:
            bad = int(torch.nonzero((input_ids < 0) | (input_ids >= vocab_size))[0])
            raise ValueError(f"input_ids[{bad}]: expected a token id in [0, {vocab_size}) (the model's vocabulary), "
                             f"got {int(input_ids[bad])}; check the tokenizer matches the checkpoint.")
    if positions.device.type == "cpu":
        _check_positions(positions, metadata)


def _check_positions(positions: torch.Tensor, metadata: Any) -> None:
    facts = getattr(metadata, "checks", None)
    refs = getattr(facts, "refs", None)
    if not refs or not isinstance(refs[0], torch.Tensor) or not isinstance(refs[1], torch.Tensor):
        return
    qsl, seq = refs[0].numpy().astype(np.int64), refs[1].numpy().astype(np.int64)
    n = min(int(qsl[-1]), positions.shape[0])
    if n <= 0:
        return
    qlen = np.diff(qsl)
    start = seq[: qlen.size] - qlen  # tokens each request had before this step
    req = np.repeat(np.arange(qlen.size), qlen)[:n]
    want = start[req] + np.arange(n) - qsl[:-1][req]
    got = positions[:n].numpy()
    wrong = np.flatnonzero(got != want)
    if wrong.size:
        t = int(wrong[0])
        raise ValueError(f"positions[{t}]: expected {int(want[t])} (request {int(req[t])} has {int(start[req[t]])} "
                         f"tokens before this step, per the step's metadata), got {int(got[t])}; pass each new "
                         "token's position in its request, or fix num_computed_tokens in the metadata.")


def check_hidden(hidden: Any, hidden_size: int | None) -> None:
    """Raise unless ``hidden`` is a floating (N, hidden_size) tensor (``compute_logits``' input)."""
    if not isinstance(hidden, torch.Tensor) or not hidden.dtype.is_floating_point:
        got = type(hidden).__name__ if not isinstance(hidden, torch.Tensor) else f"a {hidden.dtype} tensor"
        raise TypeError(f"hidden: expected a floating (N, hidden_size) tensor (the model's forward output), got {got}.")
    if hidden_size is not None and (hidden.dim() != 2 or hidden.shape[-1] != hidden_size):
        raise ValueError(f"hidden: expected shape (N, {hidden_size}) (rows of the model's forward output), got "
                         f"{tuple(hidden.shape)}; pass model(input_ids, positions)[rows].")

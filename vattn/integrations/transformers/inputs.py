"""Checks of what a caller hands ``VattnCausalLM``: token ids, positions and hidden states.

They run in eager calls only (not inside a ``torch.compile`` trace, not in a CUDA-graph
replay), before the step touches the KV cache. What a check reads decides where it runs: the
host reads host tensors for free, a device tensor's values cost a host sync, so on a GPU only
the free facts are checked unless ``VATTN_DEBUG_CHECKS=1``:

| check | host tensors | device tensors |
| --- | --- | --- |
| ``input_ids`` / ``positions``: (T,), int64 or int32, one length, T >= 1, on the model's device | yes | yes (metadata) |
| ``input_ids``: as many tokens as the step's metadata (``slot_mapping`` rows) | yes | yes (metadata) |
| ``input_ids`` in ``[0, vocab_size)`` | yes | ``VATTN_DEBUG_CHECKS`` (a sync) |
| ``positions[t] == num_computed[r] + j`` (token j of request r; the metadata's host mirrors) | yes | no (see below) |
| ``hidden`` (``compute_logits``): floating (N, hidden_size), the LM head's dtype and device | yes | yes (metadata) |

On a GPU the ids and positions are checked where they are made, on the host (an engine checks a
request's prompt once, at ``add_request``, and builds positions from its own request state); an
out-of-range device id reaches ``nn.Embedding``'s device-side assert. The debug check of device
ids is skipped while a CUDA graph is captured.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["check_hidden", "check_positions", "check_step_inputs"]

_FIX_IDS = "pass a (T,) int64 tensor of every request's new tokens, one flattened step (as the engine does)"
_FIX_POS = "pass (T,) int64 positions, one per token of input_ids"
_INDEX_DTYPES = (torch.int64, torch.int32)  # what nn.Embedding takes
_UNSIGNED = {np.dtype(np.int64): np.uint64, np.dtype(np.int32): np.uint32}


def _int_vector(name: str, x: Any, fix: str, device: torch.device | None) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a (T,) int64 torch.Tensor, got {type(x).__name__}; {fix}.")
    if x.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{name}: expected dtype torch.int64 (or torch.int32), got {x.dtype}; {fix}.")
    if x.dim() != 1:
        raise ValueError(f"{name}: expected shape (T,) (the step's tokens flattened), got {tuple(x.shape)}; {fix}.")
    if device is not None and x.device != device:
        raise ValueError(f"{name}: expected a tensor on the model's device {device}, got one on {x.device}; "
                         f"move it with .to({str(device)!r}).")


def check_step_inputs(input_ids: Any, positions: Any, vocab_size: int | None, metadata: Any, *,
                      device: torch.device | None = None, debug: bool = False) -> None:
    """Raise ``TypeError`` / ``ValueError`` naming the argument unless ``input_ids`` and
    ``positions`` are (T,) int64 (or int32) tensors of one length T >= 1 on ``device`` (the
    model's), T matches ``metadata`` (a backend metadata of the step, or None in a warm-up), the
    ids lie in ``[0, vocab_size)`` and the positions are each new token's position in its request
    per the metadata's host mirrors. Values are read on the host only (``debug``: device ids too,
    one sync)."""
    _int_vector("input_ids", input_ids, _FIX_IDS, device)
    _int_vector("positions", positions, _FIX_POS, device)
    t = input_ids.shape[0]
    if positions.shape[0] != t:
        raise ValueError(f"positions: expected one per token of input_ids ({t}), got "
                         f"{positions.shape[0]}; pass the same number of ids and positions.")
    if t == 0:
        raise ValueError("input_ids: expected at least one token, got an empty tensor; a step without tokens has "
                         "nothing to run: skip the call.")
    _check_token_count(t, metadata)
    if vocab_size is not None:
        if input_ids.device.type == "cpu":
            _check_vocab(input_ids, vocab_size)
        elif debug and not (input_ids.is_cuda and torch.cuda.is_current_stream_capturing()):
            _check_vocab(input_ids.cpu(), vocab_size)  # one sync, asked for (VATTN_DEBUG_CHECKS)
    if positions.device.type == "cpu":
        check_positions(positions, metadata)


def _check_token_count(t: int, metadata: Any) -> None:
    """T against the metadata's rows: its ``num_actual_tokens``, or its padded ``slot_mapping``
    rows (what the attention op accepts)."""
    slots, n = getattr(metadata, "slot_mapping", None), getattr(metadata, "num_actual_tokens", None)
    if not isinstance(slots, torch.Tensor) or not isinstance(n, int):
        return
    rows = slots.shape[0]
    if t < n or t != rows:
        padded = f" ({rows} with its padding)" if rows != n else ""
        raise ValueError(f"input_ids: expected {n} tokens{padded}, as the step's metadata was built for (its "
                         f"query_lens sum to {n}), got {t}; pass every scheduled request's new tokens, or build "
                         "the metadata for these tokens.")


def _check_vocab(ids: torch.Tensor, vocab_size: int) -> None:
    a = ids.numpy()
    if not (a.view(_UNSIGNED[a.dtype]) >= vocab_size).any():  # a negative id reads as a huge unsigned one
        return
    bad = int(np.flatnonzero((a < 0) | (a >= vocab_size))[0])
    raise ValueError(f"input_ids[{bad}]: expected a token id in [0, {vocab_size}) (the model's vocabulary), "
                     f"got {int(a[bad])}; check the tokenizer matches the checkpoint.")


def check_positions(positions: torch.Tensor, metadata: Any, *, name: str = "positions",
                    fix: str = "pass each new token's position in its request, or fix num_computed_tokens in the "
                               "metadata") -> None:
    """Raise ``ValueError`` naming ``name`` unless ``positions[t]`` (a (T,) host tensor) of token j
    of request r is ``seq_lens[r] - query_lens[r] + j``, over the real (unpadded) tokens, per the
    metadata's host mirrors (``StepChecks.refs``); nothing when the metadata has none (a warm-up,
    or mirrors on the device)."""
    refs = getattr(getattr(metadata, "checks", None), "refs", None)
    if not refs or not isinstance(refs[0], torch.Tensor) or not isinstance(refs[1], torch.Tensor):
        return
    if refs[0].device.type != "cpu" or refs[1].device.type != "cpu":
        return
    qsl, seq = refs[0].numpy(), refs[1].numpy()
    r = qsl.size - 1
    n = min(int(qsl[r]), positions.shape[0])
    if n <= 0:
        return
    got = positions.numpy()[:n]
    if n == r:  # as many tokens as requests: decodes only (every query_len is 1) unless one is 0
        want = seq[:r] - 1
        if (got == want).all() and qsl[r] == r and (qsl[1:] > qsl[:-1]).all():
            return
    qlen = np.diff(qsl).astype(np.int64)
    req = np.repeat(np.arange(r), qlen)[:n]
    # token t of request req[t] is its (t - qsl[req[t]])-th new token, after seq - qlen computed ones
    want = (seq[:r].astype(np.int64) - qlen - qsl[:-1])[req] + np.arange(n)
    wrong = np.flatnonzero(got != want)
    if wrong.size:
        t = int(wrong[0])
        rq = int(req[t])
        before = int(want[t]) - (t - int(qsl[rq]))
        raise ValueError(f"{name}[{t}]: expected {int(want[t])} (request {rq} has {before} tokens before this "
                         f"step, per the step's metadata), got {int(got[t])}; {fix}.")


def check_hidden(hidden: Any, hidden_size: int | None, head_weight: torch.Tensor | None = None) -> None:
    """Raise unless ``hidden`` is a floating (N, hidden_size) tensor in the LM head's dtype on its
    device (``head_weight``: the head's weight, or None to skip those two)."""
    fix = "pass rows of the model's forward output, model(input_ids, positions)[rows]"
    if not isinstance(hidden, torch.Tensor) or not hidden.dtype.is_floating_point:
        got = type(hidden).__name__ if not isinstance(hidden, torch.Tensor) else f"a {hidden.dtype} tensor"
        raise TypeError(f"hidden: expected a floating (N, hidden_size) tensor (the model's forward output), got "
                        f"{got}; {fix}.")
    if hidden_size is not None and (hidden.dim() != 2 or hidden.shape[-1] != hidden_size):
        raise ValueError(f"hidden: expected shape (N, {hidden_size}) (rows of the model's forward output), got "
                         f"{tuple(hidden.shape)}; {fix}.")
    if head_weight is None:
        return
    if hidden.dtype != head_weight.dtype:
        raise TypeError(f"hidden: expected dtype {head_weight.dtype} (the model's, as its forward returns), got "
                        f"{hidden.dtype}; cast with hidden.to({head_weight.dtype}).")
    if hidden.device != head_weight.device:
        raise ValueError(f"hidden: expected a tensor on the model's device {head_weight.device}, got one on "
                         f"{hidden.device}; move it with .to({str(head_weight.device)!r}).")

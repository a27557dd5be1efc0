"""Ready-made FlexAttention mods for ``vattn.Attention(mask_mod=..., score_mod=...)``.

Signatures are FlexAttention's, over *logical* positions (``vattn.backends.flex_attention``
maps them from the paged cache)::

    mask_mod(b, h, q_idx, kv_idx) -> bool tensor          # True: the query sees the key
    score_mod(score, b, h, q_idx, kv_idx) -> score tensor  # score already scaled

| argument | meaning |
| --- | --- |
| ``b`` | the request's index in the step (``CommonAttentionMetadata`` order, decodes first) |
| ``h`` | the query head |
| ``q_idx`` | the query's position in its sequence (``num_computed_tokens + i`` for its i-th new token) |
| ``kv_idx`` | the key's position in the same sequence |

A layer's ``mask_mod`` replaces the causal mask (``and_masks(causal, mine)`` keeps it); the
layer's sliding window, if any, still applies on top. Per-request facts (prompt lengths,
document ids) are tensors the mod captures and that you update in place before building each
step's metadata (``kv.build_metadata``): the block masks are computed there, once per step.
Index them by ``b`` (rows past the step's requests are never read) and, for per-token facts,
by ``q_idx`` / ``kv_idx`` (positions below each request's ``seq_len``). Keep their shapes
fixed: a new shape compiles FlexAttention anew. The helpers below check those shapes against
each step when its metadata is built; ``vattn.Attention`` calls a mod once on example indices
when the layer is made, so a mod that raises or returns the wrong type is refused there.

A query row whose mask hides every key gets zeros (FlexAttention's convention; an SDPA call with
the same boolean mask would give NaN), on every path (eager, compiled, gathered or paged).

>>> prompt_lens = torch.zeros(64, dtype=torch.int32)            # doctest: +SKIP
>>> attn = vattn.Attention(8, 64, 0.125, mask_mod=prefix_lm(prompt_lens), prefix="l0.attn")  # doctest: +SKIP
>>> prompt_lens[:2] = torch.tensor([12, 30]); md = kv.build_metadata(common)                  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import and_masks, or_masks

__all__ = [
    "MaskMod",
    "check_mod_tensors",
    "ScoreMod",
    "alibi",
    "and_masks",
    "causal",
    "chunked_local",
    "document",
    "or_masks",
    "prefix_lm",
    "sliding_window",
    "soft_cap",
    "streaming",
]

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


def causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """Each query sees the keys at or before its position."""
    return kv_idx <= q_idx


def _positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}: expected a positive int (tokens), got {value!r}; pass e.g. {name}=128.")
    return value


def _int_tensor(name: str, value: object, dims: int) -> Tensor:
    if not isinstance(value, Tensor) or value.dim() != dims or value.is_floating_point():
        got = f"{value.dtype} of shape {tuple(value.shape)}" if isinstance(value, Tensor) else type(value).__name__
        raise TypeError(f"{name}: expected a {dims}-D integer tensor on the model's device, got {got}; "
                        "allocate it once (rows >= the most requests of a step) and update it in place.")
    return value


def sliding_window(window: int) -> MaskMod:
    """Causal, within the last ``window`` positions (the query's own included)."""
    window = _positive_int("window", window)

    def mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (kv_idx <= q_idx) & (kv_idx > q_idx - window)

    return mask


def streaming(window: int, sink_tokens: int) -> MaskMod:
    """A sliding window plus the first ``sink_tokens`` positions of every sequence (StreamingLLM)."""
    window, sink_tokens = _positive_int("window", window), _positive_int("sink_tokens", sink_tokens)

    def mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (kv_idx <= q_idx) & ((kv_idx > q_idx - window) | (kv_idx < sink_tokens))

    return mask


def chunked_local(chunk: int) -> MaskMod:
    """Causal within fixed chunks of ``chunk`` positions (Llama-4-style local attention)."""
    chunk = _positive_int("chunk", chunk)

    def mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (kv_idx <= q_idx) & (kv_idx // chunk == q_idx // chunk)

    return mask


def prefix_lm(prompt_lens: Tensor) -> MaskMod:
    """Bidirectional over each request's prompt, causal after it.

    ``prompt_lens``: (>= num_reqs,) int tensor, request ``b``'s prompt length. A prompt
    position sees the prompt positions already in the cache: give a bidirectional prompt in
    one step (no chunked prefill) for the whole prompt to see itself.
    """
    prompt_lens = _int_tensor("prompt_lens", prompt_lens, 1)

    def mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (kv_idx <= q_idx) | (kv_idx < prompt_lens[b])

    mask.vattn_tensors = (("prompt_lens", prompt_lens),)  # type: ignore[attr-defined]
    return mask


def document(doc_ids: Tensor) -> MaskMod:
    """Causal within the document of each position (sample packing).

    ``doc_ids``: (>= num_reqs, >= longest seq_len) int tensor, the document id of each
    position of request ``b``'s sequence.
    """
    doc_ids = _int_tensor("doc_ids", doc_ids, 2)

    def mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (kv_idx <= q_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    mask.vattn_tensors = (("doc_ids", doc_ids),)  # type: ignore[attr-defined]
    return mask


def check_mod_tensors(mod: object, num_reqs: int, max_seq_len: int) -> None:
    """Raise ``ValueError`` naming the tensor when a helper's per-request tensor (``prefix_lm``'s
    ``prompt_lens``: (>= num_reqs,), ``document``'s ``doc_ids``: (>= num_reqs, >= max_seq_len))
    is too small for this step. Mods that are not vattn's helpers are not looked at."""
    for name, t in getattr(mod, "vattn_tensors", ()):
        if t.shape[0] < num_reqs:
            raise ValueError(f"{name}: expected a row for each of the step's {num_reqs} requests, got shape "
                             f"{tuple(t.shape)}; allocate it for the most requests a step holds and update it in "
                             "place.")
        if t.dim() == 2 and t.shape[1] < max_seq_len:
            raise ValueError(f"{name}: expected a column for each of the {max_seq_len} positions of the step's "
                             f"longest sequence, got shape {tuple(t.shape)}; allocate it for the longest sequence.")


def soft_cap(cap: float) -> ScoreMod:
    """``cap * tanh(score / cap)`` (Gemma-2, Grok)."""
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0:
        raise ValueError(f"cap: expected a positive float, got {cap!r}; pass the model's soft cap (e.g. 50.0).")
    cap = float(cap)

    def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return cap * torch.tanh(score / cap)

    return score_mod


def alibi(slopes: Tensor) -> ScoreMod:
    """ALiBi: ``score + slopes[h] * (kv_idx - q_idx)``; ``slopes``: (num_heads,) float tensor."""
    if not isinstance(slopes, Tensor) or slopes.dim() != 1 or not slopes.is_floating_point():
        raise TypeError(f"slopes: expected a 1-D float tensor of one slope per query head, got {slopes!r}.")

    def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return score + slopes[h] * (kv_idx - q_idx)

    return score_mod

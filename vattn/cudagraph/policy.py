"""The CUDA-graph dispatch policy: pure functions of sizes, modes and metadata (CPU-testable).

``resolve_capture_sizes`` and ``bucket_size`` say which token counts are captured and which
capture a batch pads to; ``resolve_cudagraph_mode`` downgrades a requested mode to what the
device, the backends' builders and the model can serve; ``choose_runtime_mode`` picks FULL,
PIECEWISE or NONE for one step; ``pad_common_attn_metadata`` pads a batch to a captured size.
``vattn.CUDAGraphRunner`` (``runner.py``) applies them; nothing here touches a CUDA graph.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import numbers
from typing import Iterable, Sequence

import torch

from vattn.core.enums import AttentionCGSupport
from vattn.core.metadata import CommonAttentionMetadata
from vattn.core.config import CUDAGraphMode, VattnConfig, _default_capture_sizes

__all__ = ["FULL_MODES", "BatchDescriptor", "bucket_size", "choose_runtime_mode", "is_uniform_decode",
           "pad_common_attn_metadata", "resolve_capture_sizes", "resolve_cudagraph_mode"]

logger = logging.getLogger("vattn.cudagraph")
M = CUDAGraphMode
#: Runner modes that capture full graphs (for some batches at least).
FULL_MODES = (M.FULL, M.FULL_DECODE_ONLY, M.FULL_AND_PIECEWISE)


@dataclasses.dataclass(frozen=True)
class BatchDescriptor:
    """What the dispatcher decided for one step (set as the forward context's ``batch_descriptor``).

    ``mode`` is the runtime mode (NONE, PIECEWISE or FULL); ``num_tokens``/``num_reqs`` the
    padded sizes the step runs at.
    """

    mode: CUDAGraphMode
    num_tokens: int
    num_reqs: int
    uniform_decode: bool


def resolve_capture_sizes(
    config: VattnConfig, max_batch_size: int | None = None, capture_sizes: Sequence[int] | None = None
) -> tuple[int, ...]:
    """Ascending capture sizes: explicit ``capture_sizes``, else 1, 2, 4, 8, 16, ... up to
    ``max_batch_size`` (which is added when not a multiple of 8), else the config's
    (``CompilationConfig.cudagraph_capture_sizes`` / ``max_capture_size``).

    Sizes above ``max_batch_size`` are dropped with a warning; none left is a ``ValueError``
    (the runner would capture nothing), as are sizes that are not positive integers.
    """
    if max_batch_size is not None and not _positive_int(max_batch_size):
        raise (TypeError if not isinstance(max_batch_size, numbers.Integral) else ValueError)(
            f"CUDAGraphRunner: max_batch_size must be a positive int (the largest padded token count to "
            f"capture), got {max_batch_size!r}; leave it out for the config's sizes."
        )
    if capture_sizes is not None:
        sizes = _check_sizes("CUDAGraphRunner: capture_sizes", capture_sizes)
        if max_batch_size is not None:
            kept = [s for s in sizes if s <= max_batch_size]
            if not kept:
                raise ValueError(
                    f"CUDAGraphRunner: every capture size {sizes} is above max_batch_size={max_batch_size}, so "
                    f"nothing would be captured; pass capture_sizes up to {max_batch_size} (e.g. "
                    f"{list(_default_capture_sizes(max_batch_size))[:4]}), or raise max_batch_size to "
                    f"{sizes[-1]}, or leave one of them out."
                )
            if len(kept) < len(sizes):
                logger.warning(
                    "CUDAGraphRunner: capture_sizes %s are above max_batch_size=%d and are not captured "
                    "(batches that large run without a graph); capturing %s.",
                    sizes[len(kept):], max_batch_size, kept,
                )
            sizes = kept
        return tuple(sizes)
    if max_batch_size is None:
        comp = config.compilation
        if comp.cudagraph_capture_sizes is not None:
            return _check_sizes("CompilationConfig.cudagraph_capture_sizes", comp.cudagraph_capture_sizes)
        if not _positive_int(comp.max_capture_size):
            raise ValueError(
                f"CompilationConfig.max_capture_size must be a positive int (the largest token count to "
                f"capture), got {comp.max_capture_size!r}; or give cudagraph_capture_sizes."
            )
        return comp.capture_sizes()
    max_batch_size = int(max_batch_size)
    return tuple(sorted({*_default_capture_sizes(max_batch_size), max_batch_size}))


def _positive_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool) and x > 0


def _check_sizes(name: str, sizes: object) -> tuple[int, ...]:
    """``sizes`` sorted and deduplicated, or an error naming ``name`` unless they are positive ints
    (a float such as 1.5 is refused, not rounded)."""
    items = list(sizes) if isinstance(sizes, Iterable) and not isinstance(sizes, (str, bytes)) else None
    if not items or not all(_positive_int(s) for s in items):
        integers = items is not None and all(isinstance(s, numbers.Integral) and not isinstance(s, bool) for s in items)
        raise (ValueError if integers else TypeError)(
            f"{name} must be a non-empty sequence of positive int token counts, e.g. [1, 2, 4, 8]; got {sizes!r}."
        )
    return tuple(sorted({int(s) for s in items}))


def bucket_size(num_tokens: int, sizes: Sequence[int]) -> int | None:
    """The smallest capture size >= ``num_tokens`` (``sizes`` ascending), or None."""
    i = bisect.bisect_left(sizes, num_tokens)
    return sizes[i] if i < len(sizes) else None


def resolve_cudagraph_mode(
    requested: CUDAGraphMode,
    *,
    on_cuda: bool,
    support: AttentionCGSupport,
    backends: str = "the attention backend",
    has_piecewise: bool,
) -> tuple[CUDAGraphMode, list[str]]:
    """The mode the runner can actually serve, and why it differs from ``requested``.

    Args:
        support: the lowest ``cudagraph_support`` over the KV-cache groups' builders.
        backends: names for the messages.
        has_piecewise: the model is a ``vattn.compile``d model (it has pieces).
    """
    mode, why = requested, []
    if mode is M.NONE:
        return mode, why
    if not on_cuda:
        return M.NONE, ["CUDA graphs need a CUDA device; running eagerly."]
    if mode in (M.PIECEWISE, M.FULL_AND_PIECEWISE) and not has_piecewise:
        new = M.NONE if mode is M.PIECEWISE else M.FULL_DECODE_ONLY
        why.append(f"{mode.name} needs a model compiled with vattn.compile (it has no pieces); using {new.name}.")
        mode = new
    if mode in FULL_MODES and support == AttentionCGSupport.NEVER:
        new = {M.FULL_DECODE_ONLY: M.NONE, M.FULL_AND_PIECEWISE: M.PIECEWISE}.get(
            mode, M.PIECEWISE if has_piecewise else M.NONE
        )
        why.append(f"{backends} declares cudagraph_support NEVER, so no full graphs; using {new.name}.")
        mode = new
    elif mode is M.FULL and support < AttentionCGSupport.ALWAYS:
        new = M.FULL_AND_PIECEWISE if has_piecewise else M.FULL_DECODE_ONLY
        why.append(
            f"{backends} declares cudagraph_support {support.name}: full graphs only for uniform "
            f"decode batches; using {new.name}."
        )
        mode = new
    return mode, why


def choose_runtime_mode(
    mode: CUDAGraphMode, *, captured: bool, uniform_decode: bool, full_ok: bool
) -> CUDAGraphMode:
    """The dispatcher: FULL, then PIECEWISE, then NONE for one step.

    Args:
        mode: the resolved runner mode.
        captured: the batch fits a capture size.
        uniform_decode: every request has exactly one new token.
        full_ok: the builders allow the (padded) batch in a full graph.
    """
    if mode is M.NONE or not captured:
        return M.NONE
    if mode in FULL_MODES and full_ok and (uniform_decode or mode is M.FULL):
        return M.FULL
    if mode in (M.PIECEWISE, M.FULL_AND_PIECEWISE):
        return M.PIECEWISE
    return M.NONE


def pad_common_attn_metadata(
    common: CommonAttentionMetadata, num_tokens_padded: int, num_reqs_padded: int | None = None
) -> CommonAttentionMetadata:
    """``common`` padded to ``num_tokens_padded`` tokens and ``num_reqs_padded`` requests.

    Padded tokens get slot -1 (never written). Padded requests take one padded token each
    while any remain (query length 1, sequence length 1, block table row of zeros = block 0,
    which ``allocate_kv_cache`` zero-fills), then query length 0 / sequence length 0. Device
    tensors are built with device ops (no host sync).
    """
    t, b = common.num_actual_tokens, common.num_reqs
    bp = b if num_reqs_padded is None else num_reqs_padded
    if num_tokens_padded < t or bp < b:
        raise ValueError(
            f"pad_common_attn_metadata: num_tokens_padded={num_tokens_padded} / num_reqs_padded={bp} "
            f"must be at least the batch's {t} tokens / {b} requests."
        )
    if common.num_slot_tokens not in (None, t):
        raise ValueError(
            f"pad_common_attn_metadata: this batch writes {common.num_slot_tokens} K/V slots for {t} query "
            "tokens (cross-attention); CUDA graphs pad self-attention batches only, so run it eagerly."
        )
    extra, spare = bp - b, num_tokens_padded - t
    if not extra and not spare and _exactly_sized(common):
        return common  # nothing to pad (a batch of a captured size): no host work
    dev = common.query_start_loc.device
    pad_q_cpu = (torch.arange(extra) < spare).to(torch.int32)
    pad_q = (torch.arange(extra, device=dev) < spare).to(torch.int32)
    qsl = common.query_start_loc[: b + 1]
    qsl_cpu = common.query_start_loc_cpu[: b + 1]
    bt = common.block_table_tensor[:b]
    slots = common.slot_mapping[:t]
    qsl_cpu = torch.cat([qsl_cpu, qsl_cpu[b:] + pad_q_cpu.cumsum(0).to(qsl_cpu.dtype)])
    seq_cpu = torch.cat([common.seq_lens_cpu[:b], pad_q_cpu.to(common.seq_lens_cpu.dtype)])
    bt = torch.cat([bt, bt.new_zeros((extra, bt.shape[1]))])
    slots = torch.cat([slots, slots.new_full((num_tokens_padded - t,), -1)])
    facts = common.host_checks
    return CommonAttentionMetadata(
        query_start_loc=torch.cat([qsl, qsl[b:] + pad_q.cumsum(0).to(qsl.dtype)]),
        query_start_loc_cpu=qsl_cpu,
        seq_lens=torch.cat([common.seq_lens[:b], pad_q.to(common.seq_lens.dtype)]),
        seq_lens_cpu=seq_cpu,
        num_computed_tokens_cpu=torch.cat(
            [common.num_computed_tokens_cpu[:b], torch.zeros(extra, dtype=common.num_computed_tokens_cpu.dtype)]
        ),
        num_reqs=bp,
        num_actual_tokens=t,
        max_query_len=common.max_query_len,
        block_table_tensor=bt,
        slot_mapping=slots,
        max_seq_len=max(common.max_seq_len, 1 if extra and spare else 0),
        causal=common.causal,
        # The padding keeps the checks the batch passed valid: reuse them (no host work again).
        host_checks=None if facts is None else facts.for_padded((qsl_cpu, seq_cpu, bt, slots)),
        tree_parents=common.tree_parents,  # read for the real tokens only
        state_indices=_pad_state(common.state_indices, b, extra),  # padded requests: the scratch slot (-1)
        state_indices_cpu=_pad_state(common.state_indices_cpu, b, extra),
    )


def _pad_state(indices: torch.Tensor | None, b: int, extra: int) -> torch.Tensor | None:
    return None if indices is None else torch.cat([indices[:b], indices.new_full((extra,), -1)])


def _exactly_sized(common: CommonAttentionMetadata) -> bool:
    """Every per-request / per-token tensor of ``common`` has exactly the batch's length."""
    b, t = common.num_reqs, common.num_actual_tokens
    return (common.query_start_loc.shape[0] == common.query_start_loc_cpu.shape[0] == b + 1
            and common.seq_lens.shape[0] == common.seq_lens_cpu.shape[0] == b
            and common.num_computed_tokens_cpu.shape[0] == b
            and common.block_table_tensor.shape[0] == b and common.slot_mapping.shape[0] == t
            and (common.state_indices is None or common.state_indices.shape[0] == b))


def is_uniform_decode(common: CommonAttentionMetadata) -> bool:
    """Every request of ``common`` has exactly one new token."""
    return common.num_reqs > 0 and common.max_query_len == 1 and common.num_actual_tokens == common.num_reqs

"""``VATTN_DEBUG_CHECKS=1``: check a step's metadata from any source, device tensors included,
before any kernel reads it.

Without debug checks, what lives only on the device (a hand-built ``slot_mapping`` or
``block_table_tensor`` on CUDA) is not read: that would cost a host sync per step. With them,
each step's metadata is copied to the host once (one sync per step per KV-cache group, never
during a CUDA-graph capture) and checked there: the device tensors agree with their host
mirrors; ``query_start_loc`` starts at 0 and never decreases; ``seq_lens >= query lens`` (causal
batches); the block table covers every sequence with ids in ``[0, num_blocks)``; every slot is
-1 or inside the cache, written once, where the block table puts its token; no block appears
twice in a request or is written by one request while another uses it
(``vattn.core.batch_checks.check_batch``). A violation raises ``ValueError`` naming the field.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vattn.core.batch_checks import check_batch, fail

__all__ = ["check_backend_metadata", "check_common_on_device", "is_capturing"]


def is_capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream (no sync allowed then)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _to_host(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    """The tensors on the host as numpy arrays, after one synchronization at most."""
    on_device = [t.is_cuda for t in tensors]
    host = [t.detach().to("cpu", non_blocking=True) if d else t.detach() for t, d in zip(tensors, on_device)]
    if any(on_device):
        torch.cuda.current_stream().synchronize()
    return [h.numpy() for h in host]


def check_device_batch(qsl: torch.Tensor, seq: torch.Tensor, table: torch.Tensor, slots: torch.Tensor, *,
                       num_reqs: int, num_tokens: int, num_slot_tokens: int | None, causal: bool,
                       block_size: int, num_blocks: int | None, qsl_cpu: torch.Tensor | None = None,
                       seq_cpu: torch.Tensor | None = None, prefix: str = "CommonAttentionMetadata.") -> None:
    """Copy the batch's device tensors to the host (one sync) and check them there.

    | tensor | shape |
    | --- | --- |
    | qsl | (>= B + 1,) int: query_start_loc |
    | seq | (>= B,) int: seq_lens |
    | table | (>= B, W) int: block ids |
    | slots | (>= T,) int: slot_mapping |
    | qsl_cpu, seq_cpu | the host mirrors, compared with the device tensors when given |
    """
    b = num_reqs
    q, s, t, sl = _to_host([qsl[: b + 1], seq[:b], table[:b], slots])
    for name, dev, mirror in (("query_start_loc", q, qsl_cpu), ("seq_lens", s, seq_cpu)):
        if mirror is not None and not np.array_equal(dev, mirror[: dev.shape[0]].numpy()):
            fail(prefix + name, f"the values of its host mirror {name}_cpu {mirror[: dev.shape[0]].tolist()[:16]}",
                 dev.tolist()[:16], f"fill {name} and {name}_cpu from the same numbers.")
    q64, s64 = q.astype(np.int64), s.astype(np.int64)
    qlen = np.diff(q64)
    if b and (q64[0] != 0 or (qlen < 0).any() or q64[b] < num_tokens):
        fail(prefix + "query_start_loc", f"offsets from 0, non-decreasing, ending at >= num_actual_tokens = "
             f"{num_tokens}", q.tolist()[:16], "pass [0, q0, q0 + q1, ...] (the cumulative query lengths).")
    if (s64 < 0).any() or (causal and (s64 < qlen).any()):
        r = int(np.nonzero((s64 < 0) | ((s64 < qlen) if causal else False))[0][0])
        fail(prefix + "seq_lens", "cached + new tokens of each request (>= its query length)",
             f"seq_lens[{r}] = {int(s64[r])} with query length {int(qlen[r])}", "set seq_lens = "
             "num_computed_tokens + query_lens.")
    need = -(-s64 // block_size)
    if b and need.max() > t.shape[1]:
        r = int(need.argmax())
        fail(prefix + "block_table_tensor", f"ceil(seq_len / block_size) = {int(need[r])} columns for request {r}",
             f"{t.shape[1]} columns", "give each request ceil(seq_len / block_size) block ids.")
    check_batch(q, s, t, sl, num_reqs=b, num_tokens=num_tokens, num_slot_tokens=num_slot_tokens, causal=causal,
                block_size=block_size, num_blocks=num_blocks, prefix=prefix)


def check_common_on_device(common: Any, block_size: int, num_blocks: int | None) -> None:
    """``check_device_batch`` over a ``CommonAttentionMetadata`` (skipped while capturing)."""
    if is_capturing():
        return
    check_device_batch(common.query_start_loc, common.seq_lens, common.block_table_tensor, common.slot_mapping,
                       num_reqs=common.num_reqs, num_tokens=common.num_actual_tokens,
                       num_slot_tokens=common.num_slot_tokens, causal=common.causal, block_size=block_size,
                       num_blocks=num_blocks, qsl_cpu=common.query_start_loc_cpu, seq_cpu=common.seq_lens_cpu)


def check_backend_metadata(md: Any, block_size: int, num_blocks: int | None, layer_name: str) -> None:
    """``check_device_batch`` over a backend's metadata built without ``PagedKVCache.build_metadata``
    (a builder called directly), with whichever of its tensors it has; once per metadata object."""
    if getattr(md, "_vattn_debug_checked", False) or is_capturing():
        return
    slots = getattr(md, "slot_mapping", None)
    qsl = getattr(md, "query_start_loc", None)
    seq = getattr(md, "seq_lens", None)
    table = getattr(md, "block_table", getattr(md, "block_table_tensor", None))
    n = getattr(md, "num_actual_tokens", None)
    if all(isinstance(x, torch.Tensor) for x in (slots, qsl, seq, table)) and isinstance(n, int):
        b = int(seq.shape[0]) if getattr(md, "num_reqs", None) is None else min(md.num_reqs, seq.shape[0])
        check_device_batch(qsl, seq, table, slots, num_reqs=b, num_tokens=n, num_slot_tokens=None,
                           causal=bool(getattr(md, "causal", True)), block_size=block_size,
                           num_blocks=num_blocks, prefix=f"{layer_name}: attn_metadata.")
    elif isinstance(slots, torch.Tensor) and isinstance(n, int):  # a planned backend: its slots at least
        (sl,) = _to_host([slots[:n]])
        if sl.size and (sl.min() < -1 or (num_blocks is not None and sl.max() >= num_blocks * block_size)):
            fail(f"{layer_name}: attn_metadata.slot_mapping", f"-1 or slots in [0, {num_blocks} * {block_size})",
                 sl.tolist()[:16], "compute slot = block_id * block_size + offset from the cache's block table.")
    object.__setattr__(md, "_vattn_debug_checked", True)

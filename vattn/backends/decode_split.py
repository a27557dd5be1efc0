"""Decodes first: reordering a batch and finding its decode/prefill boundary (the seeds' utilities).

A *decode* is a request with at most ``decode_threshold`` new tokens. Backends that serve
decodes and prefills with different kernels expect the decodes at the front of the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from vattn.backends.abstract import CommonAttentionMetadata

__all__ = [
    "InputBatchProtocol",
    "SchedulerOutputProtocol",
    "reorder_batch_to_split_decodes_and_prefills",
    "split_decodes_and_prefills",
]


class InputBatchProtocol(Protocol):
    """What ``reorder_batch_to_split_decodes_and_prefills`` needs of the caller's batch.

    ``req_ids[i]`` is the id of the request in batch row ``i``; ``swap_states(i, j)`` swaps
    rows ``i`` and ``j`` (the request ids and all per-request state the caller keeps).
    """

    @property
    def req_ids(self) -> Sequence[str]: ...

    def swap_states(self, i1: int, i2: int) -> None: ...


class SchedulerOutputProtocol(Protocol):
    """What ``reorder_batch_to_split_decodes_and_prefills`` needs of the scheduler's output."""

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        """Request id -> new tokens scheduled for it this step."""
        ...


def reorder_batch_to_split_decodes_and_prefills(
    input_batch: InputBatchProtocol,
    scheduler_output: SchedulerOutputProtocol,
    decode_threshold: int = 1,
) -> bool:
    """Move every request with ``<= decode_threshold`` scheduled tokens (a "decode") to the front.

    Uses the fewest swaps: each decode behind the decode region is swapped with a prefill
    inside it, the last such decode with the first such prefill, and so on, so requests
    that are already in place (steady decodes, newly appended prefills) do not move.

    Returns:
        Whether ``input_batch.swap_states`` was called.
    """
    decodes: list[int] = []
    prefills: list[int] = []
    for i, req_id in enumerate(input_batch.req_ids):
        try:
            num_tokens = scheduler_output.num_scheduled_tokens[req_id]
        except KeyError:
            raise ValueError(
                f"scheduler_output.num_scheduled_tokens has no entry for request {req_id!r} "
                f"(batch row {i}); it must hold every request in input_batch.req_ids."
            ) from None
        (decodes if num_tokens <= decode_threshold else prefills).append(i)
    num_decodes = len(decodes)
    misplaced_decodes = [i for i in reversed(decodes) if i >= num_decodes]
    misplaced_prefills = [i for i in prefills if i < num_decodes]
    assert len(misplaced_decodes) == len(misplaced_prefills)
    for prefill_row, decode_row in zip(misplaced_prefills, misplaced_decodes):
        input_batch.swap_states(prefill_row, decode_row)
    return bool(misplaced_decodes)


def split_decodes_and_prefills(
    common_attn_metadata: "CommonAttentionMetadata",
    decode_threshold: int = 1,
) -> tuple[int, int, int, int]:
    """Find the decode/prefill boundary of a batch ordered decodes first.

    A decode is a request with at most ``decode_threshold`` new tokens. The decodes are
    the leading run of such requests; every request from the first longer one on counts
    as a prefill (so CUDA-graph padding requests, which come last, join the prefills, and
    an unordered batch is never split wrongly, only less efficiently: a prefill path
    handles any query length). Host-only: reads ``query_start_loc_cpu``.

    Returns:
        ``(num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens)``.
    """
    num_reqs = common_attn_metadata.num_reqs
    num_tokens = common_attn_metadata.num_actual_tokens
    if common_attn_metadata.max_query_len <= decode_threshold:
        return num_reqs, 0, num_tokens, 0
    qsl = common_attn_metadata.query_start_loc_cpu[: num_reqs + 1]
    is_prefill = (qsl[1:] - qsl[:-1]) > decode_threshold
    if not bool(is_prefill.any()):
        return num_reqs, 0, num_tokens, 0
    first_prefill = int(is_prefill.int().argmax())
    num_decode_tokens = int(qsl[first_prefill] - qsl[0])
    return first_prefill, num_reqs - first_prefill, num_decode_tokens, num_tokens - num_decode_tokens

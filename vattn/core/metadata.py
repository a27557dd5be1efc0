"""The data a step hands to backends: the batch (``CommonAttentionMetadata``), the cache specs
(``AttentionSpec`` and its MLA / mixer kinds) and the base of every backend's metadata.

Validation of a batch lives here, at the level where the batch is made:

| what | where | when | cost |
| --- | --- | --- | --- |
| types, dtypes, ranks, lengths, devices of every field | ``check_common_metadata`` (``_check_structure``) | construction | host, O(fields) |
| host mirrors agree (monotone ``query_start_loc``, ``seq_lens`` >= query lengths, device copies equal where on the CPU) | ``_check_mirrors`` | construction | host, O(B) |
| slot mapping and block table against a cache | ``vattn.core.batch_checks.StepChecks`` | when the batch meets a cache (``PagedKVCache.build_metadata``), once per cache | host, O(B + T) for CPU tensors; device tensors: ``VATTN_DEBUG_CHECKS=1`` (``vattn.core.debug_checks``) |
| fields edited after construction | ``StepChecks.describes`` | every step | host, O(fields) |

Construction also fills ``slot_mapping[num_slot_tokens:]`` with -1, so padded tokens never
touch the cache. What a layer's arguments and a backend's configuration must satisfy is in
``vattn.core.checks`` (its table covers every level); what the attention op checks per call
in ``vattn.ops.attention.check_call``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Sequence, TypeVar

import numpy as np
import torch

from vattn.core.batch_checks import StepChecks, fail

__all__ = ["AttentionMetadata", "AttentionSpec", "CommonAttentionMetadata", "MLAAttentionSpec", "check_common_metadata", "is_fp8_kv_cache",
           "to_device"]


def is_fp8_kv_cache(kv_cache_dtype: str | None) -> bool:
    """Whether a ``cache_dtype`` string names an fp8 cache."""
    return kv_cache_dtype is not None and kv_cache_dtype.startswith("fp8")


class AttentionMetadata:
    """Base of every backend's per-step metadata (backends use dataclasses). ``checks`` (not a
    field): the step's ``StepChecks``, set by ``PagedKVCache.build_metadata``; the attention op
    checks the cache bound to each layer against it before writing."""

    checks: StepChecks | None = None


M = TypeVar("M", bound=AttentionMetadata)


@dataclass(frozen=True)
class AttentionSpec:
    """What a KV-cache group's layers share, the facts a builder needs: tokens per block, KV
    heads and head size per layer, the dtype stored (fp8 for fp8 caches), the
    ``CacheConfig.cache_dtype`` string, and the group's sliding window (None: none)."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    cache_dtype_str: str = "auto"
    sliding_window: int | None = None


@dataclass
class CommonAttentionMetadata:
    """Per-batch attention metadata, shared across layers and backends.

    Requests are ordered decodes first (see ``reorder_batch_to_split_decodes_and_prefills``).
    B = num_reqs (possibly padded for CUDA graphs), T = tokens in the step (possibly padded).

    | field | shape / type | meaning |
    | --- | --- | --- |
    | query_start_loc, query_start_loc_cpu | (B + 1,) int32 | start of each request's tokens in the flattened query |
    | seq_lens, seq_lens_cpu | (B,) int32 | tokens of each request after this step (cached + new) |
    | num_computed_tokens_cpu | (B,) int32 | tokens already in the cache before this step |
    | num_reqs | int | requests in the batch |
    | num_actual_tokens | int | real (unpadded) tokens in the step |
    | max_query_len | int | longest new-token count |
    | max_seq_len | int | longest seq_len |
    | block_table_tensor | (B, max_blocks) int32 | block ids of each request, in order |
    | slot_mapping | (T,) int64 | cache slot (block * block_size + offset) of each new token; -1 = padding |
    | causal | bool | causal masking (False for encoder attention) |
    | num_slot_tokens | int or None | real entries of slot_mapping: None = num_actual_tokens; cross-attention: the encoder tokens whose K/V this step writes |
    | host_checks | StepChecks | set at construction: the batch's host facts (vattn's helpers pass theirs) |
    | tree_parents | (>= num_actual_tokens,) int32, or None | TREE_ATTN: per new token, its parent's index among its request's new tokens (-1: the last cached token); None: each request's tokens form a chain (causal) |
    | state_indices, state_indices_cpu | (B,) int32, or None | mixer layers (``vattn.mixers``): each request's state slot, -1 = padding (a scratch slot); None: the model has no mixer layers |

    Construction checks the fields on the host (``vattn.core.checks.check_common_metadata``:
    dtypes, lengths, devices, what the host mirrors say; the slot mapping and block table too
    where they are CPU tensors, once the batch meets a cache); a bad field raises ``ValueError``
    naming it. Then ``slot_mapping[num_slot_tokens:]`` is filled with -1, so padded tokens never
    touch the cache.

    Fields edited after construction are checked again when the batch meets a cache (every
    step): host tensors in full, device tensors with ``VATTN_DEBUG_CHECKS=1`` only (else the
    kernels keep every read and write inside the cache and the block table).
    """

    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    num_computed_tokens_cpu: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor
    max_seq_len: int = -1
    causal: bool = True
    num_slot_tokens: int | None = None
    host_checks: StepChecks | None = field(default=None, repr=False, compare=False)
    tree_parents: torch.Tensor | None = None
    state_indices: torch.Tensor | None = None
    state_indices_cpu: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.host_checks = check_common_metadata(self)
        # Padded tokens must not write into the cache (also inside full CUDA graphs).
        real = self.num_actual_tokens if self.num_slot_tokens is None else self.num_slot_tokens
        if self.slot_mapping.shape[0] > real:
            self.slot_mapping[real:].fill_(-1)
        if self.max_seq_len < 0:
            self.max_seq_len = int(self.seq_lens_cpu[: self.num_reqs].max()) if self.num_reqs else 0
        self.host_checks.bind(self)  # an in-place edit from here on is seen (``StepChecks.describes``)

    @property
    def device(self) -> torch.device:
        return self.query_start_loc.device

    @property
    def query_lens_cpu(self) -> torch.Tensor:
        """(B,) new tokens of each request."""
        return self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]


@dataclass(frozen=True)
class MLAAttentionSpec(AttentionSpec):
    """An MLA layer's cache spec (``vattn.MLAAttention.get_kv_cache_spec``): one latent row per token,
    ``num_kv_heads == 1``, ``head_size == kv_lora_rank + qk_rope_head_dim`` (the compressed KV, then
    the RoPE key)."""

    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0


_FIELD = "CommonAttentionMetadata."
_INTS = (torch.int32, torch.int64)


def _check_structure(md: "CommonAttentionMetadata") -> None:
    """Types, dtypes, ranks, lengths and devices."""
    for name in ("num_reqs", "num_actual_tokens", "max_query_len", "max_seq_len"):
        v = getattr(md, name)
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < (-1 if name == "max_seq_len" else 0):
            fail(_FIELD + name, "a non-negative int", repr(v), "pass a Python int (e.g. int(tensor.item()) on the host).")
    if md.slot_mapping.dtype not in _INTS or md.slot_mapping.dim() != 1:
        fail(_FIELD + "slot_mapping", "a 1-D int64 (or int32) tensor of cache slots",
             f"dtype={md.slot_mapping.dtype}, shape={tuple(md.slot_mapping.shape)}",
             "build it with vattn.build_common_attn_metadata or pass slot = block_id * block_size + offset.")
    if md.block_table_tensor.dtype != torch.int32 or md.block_table_tensor.dim() != 2:
        fail(_FIELD + "block_table_tensor", "a 2-D int32 tensor (num_reqs, max_blocks_per_req)",
             f"dtype={md.block_table_tensor.dtype}, shape={tuple(md.block_table_tensor.shape)}",
             "convert with .to(torch.int32) and stack the per-request block ids into rows.")
    for name in ("query_start_loc", "seq_lens", "query_start_loc_cpu", "seq_lens_cpu", "num_computed_tokens_cpu"):
        t = getattr(md, name)
        if not isinstance(t, torch.Tensor) or t.dtype not in _INTS or t.dim() != 1:
            got = f"dtype={t.dtype}, shape={tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            fail(_FIELD + name, "a 1-D int32 tensor", got, "convert with .to(torch.int32).")
    dev = md.query_start_loc.device
    for name in ("seq_lens", "block_table_tensor", "slot_mapping"):
        if getattr(md, name).device != dev:
            fail(_FIELD + name, f"a tensor on query_start_loc's device {dev}", f"one on {getattr(md, name).device}",
                 "put the metadata's device tensors on the model's device (build_common_attn_metadata(device=...)).")
    for name in ("query_start_loc_cpu", "seq_lens_cpu", "num_computed_tokens_cpu"):
        if getattr(md, name).device.type != "cpu":
            fail(_FIELD + name, "a CPU tensor (the host mirror)", f"one on {getattr(md, name).device}",
                 "pass the host copy (the kernels read the device tensors, host work reads these).")
    b = md.num_reqs
    if md.query_start_loc.shape[0] < b + 1 or md.query_start_loc_cpu.shape[0] < b + 1:
        fail(_FIELD + "query_start_loc", f"at least num_reqs + 1 = {b + 1} entries",
             (md.query_start_loc.shape[0], md.query_start_loc_cpu.shape[0]),
             "include the leading 0 and one end offset per request (device tensor and host mirror).")
    rows = (md.seq_lens.shape[0], md.seq_lens_cpu.shape[0], md.block_table_tensor.shape[0],
            md.num_computed_tokens_cpu.shape[0])
    if min(rows) < b:
        fail(_FIELD + "seq_lens/seq_lens_cpu/block_table_tensor/num_computed_tokens_cpu",
             f"at least num_reqs = {b} rows", rows, "give one row per request.")
    if md.num_slot_tokens is None and md.slot_mapping.shape[0] < md.num_actual_tokens:
        fail(_FIELD + "slot_mapping", f"at least num_actual_tokens = {md.num_actual_tokens} entries",
             md.slot_mapping.shape[0], "give one slot per new token.")
    if md.num_slot_tokens is not None and not 0 <= md.num_slot_tokens <= md.slot_mapping.shape[0]:
        fail(_FIELD + "num_slot_tokens", f"between 0 and len(slot_mapping) = {md.slot_mapping.shape[0]}",
             md.num_slot_tokens, "give the number of K/V tokens this step writes (cross-attention: "
             "the encoder tokens), or None for num_actual_tokens.")


def _check_mirrors(md: "CommonAttentionMetadata", qsl: np.ndarray, seq: np.ndarray) -> None:
    """What the host mirrors say: query_start_loc from 0, non-decreasing, covering the tokens;
    seq_lens >= 0 (and >= the query lengths of causal batches); the maxima."""
    b, n = md.num_reqs, md.num_actual_tokens
    if qsl[0] != 0 or (np.diff(qsl) < 0).any():
        fail(_FIELD + "query_start_loc", "offsets starting at 0 and non-decreasing (cumulative query lengths)",
             qsl.tolist()[:16], "pass [0, q0, q0 + q1, ...] (torch.cumsum of the query lengths with a leading 0).")
    if qsl[b] < n or (md.num_slot_tokens is None and qsl[b] > md.slot_mapping.shape[0]):
        fail(_FIELD + "query_start_loc", f"query_start_loc[num_reqs] between num_actual_tokens = {n} and "
             f"len(slot_mapping) = {md.slot_mapping.shape[0]}", int(qsl[b]),
             "make num_actual_tokens the number of real new tokens, which the requests' query lengths sum to.")
    qlen = np.diff(qsl)
    if (seq < 0).any() or (md.causal and (seq < qlen).any()):
        r = int(np.nonzero((seq < 0) | ((seq < qlen) if md.causal else False))[0][0])
        fail(_FIELD + "seq_lens", "each request's cached + new tokens (>= its query length "
             "query_start_loc[r + 1] - query_start_loc[r])", f"seq_lens[{r}] = {int(seq[r])} with query length "
             f"{int(qlen[r])}", "set seq_lens = num_computed_tokens + query_lens (device tensor and host mirror).")
    if b and qlen.max() > max(md.max_query_len, 1):
        fail(_FIELD + "max_query_len", f"at least the longest query length {int(qlen.max())}", md.max_query_len,
             "pass the maximum of the query lengths.")
    if b and md.max_seq_len >= 0 and seq.max() > md.max_seq_len:
        fail(_FIELD + "max_seq_len", f"at least the longest seq_len {int(seq.max())}", md.max_seq_len,
             "pass the maximum of seq_lens (or leave it at -1: it is computed).")
    if md.query_start_loc.device.type == "cpu":  # the "device" tensors are host tensors: compare, no sync
        for name, dev_t, host in (("query_start_loc", md.query_start_loc, qsl), ("seq_lens", md.seq_lens, seq)):
            if not np.array_equal(dev_t[: host.shape[0]].numpy(), host):
                fail(_FIELD + name, f"the same values as {name}_cpu {host.tolist()[:16]}",
                     dev_t[: host.shape[0]].tolist()[:16], "build both from the same numbers.")


def check_common_metadata(md: "CommonAttentionMetadata") -> StepChecks:
    """Check a ``CommonAttentionMetadata`` on the host (structure, then what its host mirrors
    say; the slot mapping and block table too where they are CPU tensors, against each cache
    the batch meets) and return its ``StepChecks``. Facts vattn's helpers computed for these
    very tensors (``md.host_checks``) are reused."""
    facts = md.host_checks
    if facts is not None and facts.describes(md):
        return facts
    _check_structure(md)
    b = md.num_reqs
    qsl = md.query_start_loc_cpu[: b + 1].numpy()
    seq = md.seq_lens_cpu[:b].numpy()
    _check_mirrors(md, qsl, seq)
    host_batch = None
    if md.slot_mapping.device.type == "cpu" and md.block_table_tensor.device.type == "cpu":
        host_batch = ((qsl, seq, md.block_table_tensor.numpy(), md.slot_mapping.numpy()),
                      dict(num_reqs=b, num_tokens=md.num_actual_tokens, num_slot_tokens=md.num_slot_tokens,
                           causal=md.causal))
    return StepChecks(
        refs=(md.query_start_loc_cpu, md.seq_lens_cpu, md.block_table_tensor, md.slot_mapping),
        device=md.query_start_loc.device, max_seq_len=int(seq.max()) if b else 0,
        table_width=md.block_table_tensor.shape[1], host_batch=host_batch,
    )


def to_device(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Numpy arrays as tensors on ``device``, in one host-to-device copy on CUDA.

    The arrays are laid out in one pinned buffer, copied without blocking the host, and
    returned as views of the device copy: one copy per step instead of one per array (each
    copy and pinning costs the host tens of microseconds). Each view starts 16-byte aligned,
    as a tensor of its own would (Triton specialises kernels on pointer alignment).
    """
    if device.type != "cuda":
        return [torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in arrays]
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // 16) * 16
    host = torch.empty(max(total, 16), dtype=torch.uint8, pin_memory=True)
    buf = host.numpy()
    for a, off in zip(arrays, offsets):
        buf[off : off + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
    dev = host.to(device, non_blocking=True)
    typed: dict[torch.dtype, torch.Tensor] = {}  # the copy viewed as each dtype once (view ops cost the host)
    out = []
    for a, off in zip(arrays, offsets):
        dt = _torch_dtype(a.dtype)
        if dt not in typed:
            typed[dt] = dev.view(dt)
        flat = typed[dt][off // a.itemsize : off // a.itemsize + a.size]
        out.append(flat if a.ndim == 1 else flat.view(a.shape))
    return out


@functools.lru_cache(maxsize=None)
def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype

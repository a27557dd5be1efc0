"""Backend utilities shared by every backend (seed 004's semantics).

``CommonAttentionMetadata`` is the per-step batch description every builder starts from;
``AttentionMetadataBuilder`` is the base of each backend's builder.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

import torch

from vattn import envs
from vattn.backends.abstract import AttentionCGSupport, AttentionImpl, AttentionMetadata

if TYPE_CHECKING:
    import numpy as np

    from vattn.config import VattnConfig

logger = logging.getLogger("vattn")

M = TypeVar("M", bound=AttentionMetadata)


@dataclass(frozen=True)
class AttentionSpec:
    """What a KV-cache group's layers share: the facts a builder needs.

    Args:
        block_size: tokens per block.
        num_kv_heads: KV heads per layer.
        head_size: head dimension.
        dtype: the dtype stored in the cache (fp8 dtypes for fp8 caches).
        cache_dtype_str: the ``CacheConfig.cache_dtype`` string.
        sliding_window: the group's sliding window, if any.
    """

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

    After construction, ``slot_mapping[num_slot_tokens:]`` is filled with -1, so padded
    tokens never touch the cache.
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

    def __post_init__(self) -> None:
        _validate_common_metadata(self)
        # Padded tokens must not write into the cache (also inside full CUDA graphs).
        real = self.num_actual_tokens if self.num_slot_tokens is None else self.num_slot_tokens
        if self.slot_mapping.shape[0] > real:
            self.slot_mapping[real:].fill_(-1)
        if self.max_seq_len < 0:
            self.max_seq_len = int(self.seq_lens_cpu[: self.num_reqs].max()) if self.num_reqs else 0

    @property
    def device(self) -> torch.device:
        return self.query_start_loc.device

    @property
    def query_lens_cpu(self) -> torch.Tensor:
        """(B,) new tokens of each request."""
        return self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]

    @classmethod
    def from_requests(cls, *args: Any, **kwargs: Any) -> "CommonAttentionMetadata":
        """Build from per-request facts; see ``vattn.kv_cache.build_common_attn_metadata``."""
        from vattn.kv_cache import build_common_attn_metadata

        return build_common_attn_metadata(*args, **kwargs)


def _validate_common_metadata(md: CommonAttentionMetadata) -> None:
    """Host-side checks of dtypes and shapes (cheap: no device sync)."""

    def fail(name: str, expected: str, got: object, fix: str) -> None:
        raise ValueError(
            f"CommonAttentionMetadata.{name}: expected {expected}, got {got}; {fix}"
        )

    if md.slot_mapping.dtype not in (torch.int64, torch.int32) or md.slot_mapping.dim() != 1:
        fail("slot_mapping", "a 1-D int64 (or int32) tensor of cache slots",
             f"dtype={md.slot_mapping.dtype}, shape={tuple(md.slot_mapping.shape)}",
             "build it with vattn.build_common_attn_metadata or pass slot = block_id * block_size + offset.")
    if md.block_table_tensor.dtype != torch.int32 or md.block_table_tensor.dim() != 2:
        fail("block_table_tensor", "a 2-D int32 tensor (num_reqs, max_blocks_per_req)",
             f"dtype={md.block_table_tensor.dtype}, shape={tuple(md.block_table_tensor.shape)}",
             "convert with .to(torch.int32) and stack the per-request block ids into rows.")
    for name in ("query_start_loc", "seq_lens"):
        t = getattr(md, name)
        if t.dtype != torch.int32 or t.dim() != 1:
            fail(name, "a 1-D int32 tensor", f"dtype={t.dtype}, shape={tuple(t.shape)}",
                 "convert with .to(torch.int32).")
    if md.query_start_loc.shape[0] < md.num_reqs + 1:
        fail("query_start_loc", f"at least num_reqs + 1 = {md.num_reqs + 1} entries",
             md.query_start_loc.shape[0], "include the leading 0 and one end offset per request.")
    if md.seq_lens.shape[0] < md.num_reqs or md.block_table_tensor.shape[0] < md.num_reqs:
        fail("seq_lens/block_table_tensor", f"at least num_reqs = {md.num_reqs} rows",
             (md.seq_lens.shape[0], md.block_table_tensor.shape[0]), "give one row per request.")
    if md.num_slot_tokens is None and md.slot_mapping.shape[0] < md.num_actual_tokens:
        fail("slot_mapping", f"at least num_actual_tokens = {md.num_actual_tokens} entries",
             md.slot_mapping.shape[0], "give one slot per new token.")
    if md.num_slot_tokens is not None and not 0 <= md.num_slot_tokens <= md.slot_mapping.shape[0]:
        fail("num_slot_tokens", f"between 0 and len(slot_mapping) = {md.slot_mapping.shape[0]}",
             md.num_slot_tokens, "give the number of K/V tokens this step writes (cross-attention: "
             "the encoder tokens), or None for num_actual_tokens.")


class AttentionMetadataBuilder(abc.ABC, Generic[M]):
    """Turns ``CommonAttentionMetadata`` into one backend's metadata, once per step per group.

    Host work (syncs, planning, Python loops) belongs here, never in the impl's forward.
    ``cudagraph_support`` declares which batches may run inside a full CUDA graph.
    """

    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    # Decodes are requests with at most this many new tokens (for split_decodes_and_prefills).
    reorder_batch_threshold: ClassVar[int | None] = 1

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vattn_config: "VattnConfig",
        device: torch.device,
    ) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.layer_names = layer_names
        self.vattn_config = vattn_config
        self.device = torch.device(device)

    @property
    def full_cudagraph_supported(self) -> bool:
        return self.cudagraph_support >= AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    @abc.abstractmethod
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> M:
        """Build this backend's metadata for one step.

        Args:
            common_prefix_len: tokens shared by every request (for cascade attention; 0 = none).
            common_attn_metadata: the batch.
            fast_build: favour build speed over kernel speed (metadata used by few layers).
        """

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> M:
        """Metadata for capturing a CUDA graph; defaults to ``build``."""
        return self.build(common_prefix_len=0, common_attn_metadata=common_attn_metadata)

    def can_run_in_cudagraph(self, common_attn_metadata: CommonAttentionMetadata) -> bool:
        """Whether this batch may replay a full CUDA graph, by the declared support level."""
        support = self.cudagraph_support
        if support == AttentionCGSupport.ALWAYS:
            return True
        if support == AttentionCGSupport.NEVER:
            return False
        n = common_attn_metadata.num_reqs
        qlens = common_attn_metadata.query_lens_cpu[:n]
        if n == 0:
            return True
        if support == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE:
            return bool((qlens == 1).all())
        return bool((qlens == qlens[0]).all())

    def use_cascade_attention(
        self,
        common_prefix_len: int,
        query_lens: Any,
        num_query_heads: int,
        num_kv_heads: int,
        use_alibi: bool,
        use_sliding_window: bool,
        num_sms: int,
    ) -> bool:
        return False

    def reorder_batch(self, input_batch: Any, scheduler_output: Any) -> bool:
        """Reorder the batch so decodes come first; returns whether anything moved."""
        if self.reorder_batch_threshold is None:
            return False
        return reorder_batch_to_split_decodes_and_prefills(
            input_batch, scheduler_output, decode_threshold=self.reorder_batch_threshold
        )


# ---- decode / prefill split --------------------------------------------------------


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
    common_attn_metadata: CommonAttentionMetadata,
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


# ---- local (chunked) attention --------------------------------------------------------


def make_local_attention_virtual_batches(
    attn_chunk_size: int,
    query_start_loc_np: "np.ndarray",
    seq_lens_np: "np.ndarray",
    block_table: torch.Tensor,
    block_size: int,
) -> tuple["np.ndarray", "np.ndarray", "np.ndarray", torch.Tensor]:
    """Split each request into one "virtual request" per local-attention chunk it queries.

    With chunked local attention a token at position p attends only to keys in its chunk
    ``[p // C * C, p]`` (C = ``attn_chunk_size``). Every (request, chunk) pair that holds
    new tokens becomes a virtual request whose keys are the chunk's keys, so a plain
    causal kernel computes local attention.

    Args:
        attn_chunk_size: C, a multiple of ``block_size``.
        query_start_loc_np: (B + 1,) cumulative new-token counts.
        seq_lens_np: (B,) tokens per request after this step (>= its new tokens).
        block_table: (B, max_blocks) block ids of each request.
        block_size: tokens per KV-cache block.

    Returns:
        ``seqlens_q_local`` (V,) int32, ``cu_seqlens_q_local`` (V + 1,) int32,
        ``seqlens_k_local`` (V,) int32, ``block_table_local`` (V, C // block_size) with
        ``block_table``'s dtype and device. Block indices past the table's width are
        clipped to its last column (those entries are never read).

    Example (C = 4, block_size = 2, ``block_table[b] = [10b, 10b+1, ..., 10b+9]``):
    ``q_seqlens = [4, 10, 5]``, ``seq_lens = [6, 17, 9]`` give
    ``seqlens_q_local = [2, 2, 1, 4, 4, 1, 4, 1]``, ``seqlens_k_local = [4, 2, 4, 4, 4, 1, 4, 1]``
    (chunks starting at keys ``[0, 4, 4, 8, 12, 16, 4, 8]``) and ``block_table_local =
    [[0, 1], [2, 3], [12, 13], [14, 15], [16, 17], [18, 19], [22, 23], [24, 25]]``.
    """
    import numpy as np

    if block_size <= 0 or attn_chunk_size <= 0 or attn_chunk_size % block_size != 0:
        raise ValueError(
            f"make_local_attention_virtual_batches: attn_chunk_size ({attn_chunk_size}) must be a "
            f"positive multiple of block_size ({block_size})."
        )
    qsl = np.asarray(query_start_loc_np, dtype=np.int64)
    seq_lens = np.asarray(seq_lens_np, dtype=np.int64)
    q_lens = qsl[1:] - qsl[:-1]
    if q_lens.shape != seq_lens.shape or (q_lens < 0).any() or (seq_lens < q_lens).any():
        raise ValueError(
            "make_local_attention_virtual_batches: need len(query_start_loc_np) == "
            "len(seq_lens_np) + 1, non-decreasing query_start_loc_np and seq_lens_np >= query "
            f"lengths; got query lengths {q_lens.tolist()} and seq_lens {seq_lens.tolist()}."
        )
    chunk = attn_chunk_size
    context = seq_lens - q_lens
    last_chunk = np.maximum(seq_lens - 1, 0) // chunk
    # min(): a request with no new tokens still yields one (empty-query) virtual request.
    first_chunk = np.minimum(context // chunk, last_chunk)
    num_local = last_chunk - first_chunk + 1
    num_virtual = int(num_local.sum())

    req = np.repeat(np.arange(len(seq_lens)), num_local)  # owning request of each virtual one
    starts_of_req = np.cumsum(num_local) - num_local
    chunk_idx = first_chunk[req] + np.arange(num_virtual) - starts_of_req[req]
    k_start = chunk_idx * chunk
    k_end = np.minimum(seq_lens[req], k_start + chunk)
    seqlens_k_local = (k_end - k_start).astype(np.int32)
    seqlens_q_local = (k_end - np.maximum(context[req], k_start)).astype(np.int32)
    cu_seqlens_q_local = np.concatenate([[0], np.cumsum(seqlens_q_local)]).astype(np.int32)

    pages = chunk // block_size
    cols = (k_start // block_size)[:, None] + np.arange(pages)[None, :]
    cols = np.minimum(cols, block_table.shape[1] - 1)
    device = block_table.device
    rows_t = torch.from_numpy(req[:, None]).to(device)  # broadcasts against the columns
    block_table_local = block_table[rows_t, torch.from_numpy(cols).to(device)]
    return seqlens_q_local, cu_seqlens_q_local, seqlens_k_local, block_table_local


# ---- KV-cache layout ----------------------------------------------------------------

KV_CACHE_LAYOUTS = ("NHD", "HND")


class _LayoutOverride:
    layout: str | None = None


def _check_layout(value: str, source: str) -> str:
    layout = value.strip().upper() if isinstance(value, str) else value
    if layout not in KV_CACHE_LAYOUTS:
        raise ValueError(
            f"{source} must be one of {KV_CACHE_LAYOUTS} (NHD: blocks x tokens x heads x dim; "
            f"HND: blocks x heads x tokens x dim), got {value!r}."
        )
    return layout


def get_kv_cache_layout() -> str:
    """The paged KV cache's physical layout, ``"NHD"`` (default) or ``"HND"``.

    ``set_kv_cache_layout`` wins over the ``VATTN_KV_CACHE_LAYOUT`` environment variable.
    """
    if _LayoutOverride.layout is not None:
        return _LayoutOverride.layout
    env = envs.VATTN_KV_CACHE_LAYOUT
    if env is not None:
        return _check_layout(env, "VATTN_KV_CACHE_LAYOUT")
    return "NHD"


def set_kv_cache_layout(cache_layout: str | None) -> None:
    """Override the KV-cache layout (``"NHD"``/``"HND"``); ``None`` removes the override."""
    _LayoutOverride.layout = None if cache_layout is None else _check_layout(cache_layout, "cache_layout")


# ---- per-layer hyperparameters --------------------------------------------------------


@dataclass(frozen=True)
class PerLayerParameters:
    """Hyperparameters some backends (FlashInfer's plan) need to be equal across layers.

    ``window_left`` is the sliding window's left extent in tokens (-1: unlimited).
    """

    window_left: int
    logits_soft_cap: float | None
    sm_scale: float


def get_per_layer_parameters(
    vattn_config: "VattnConfig",
    impl_cls: type[AttentionImpl],
    layer_names: Sequence[str] | None = None,
) -> dict[str, PerLayerParameters]:
    """Each attention layer's ``PerLayerParameters``, read from its impl.

    Args:
        vattn_config: the config the model was built under (its static forward context).
        impl_cls: the impl class every selected layer must use.
        layer_names: restrict to these layers (e.g. a builder's KV-cache group); default all.

    Raises:
        TypeError: a layer's impl is not an ``impl_cls``.
        KeyError: a name in ``layer_names`` is not a registered layer.
    """
    from vattn.layer import Attention

    context = vattn_config.compilation.static_forward_context
    if layer_names is None:
        layers = {k: v for k, v in context.items() if isinstance(v, Attention)}
    else:
        missing = [n for n in layer_names if n not in context]
        if missing:
            raise KeyError(f"layers {missing} are not in the config's static forward context.")
        layers = {n: context[n] for n in layer_names}
    params: dict[str, PerLayerParameters] = {}
    for name, layer in layers.items():
        impl = layer.impl
        if not isinstance(impl, impl_cls):
            raise TypeError(
                f"layer {name!r} uses {type(impl).__name__}, expected {impl_cls.__name__}; "
                "pass the layer_names of one backend's layers."
            )
        window_left = impl.sliding_window[0] if impl.sliding_window is not None else -1
        params[name] = PerLayerParameters(window_left, impl.logits_soft_cap, impl.scale)
    return params


def infer_global_hyperparameters(
    per_layer_params: dict[str, PerLayerParameters],
) -> PerLayerParameters:
    """The one ``PerLayerParameters`` all layers share.

    Raises:
        ValueError: no layers, or layers disagree; the message names each differing field
            with its values and the layers that have them.
    """
    if not per_layer_params:
        raise ValueError(
            "infer_global_hyperparameters: no attention layers found; build the model inside "
            "vattn.set_current_vattn_config(cfg) and pass that cfg."
        )
    first = next(iter(per_layer_params.values()))
    problems: list[str] = []
    for f in fields(PerLayerParameters):
        by_value: dict[Any, list[str]] = {}
        for name, params in per_layer_params.items():
            by_value.setdefault(getattr(params, f.name), []).append(name)
        if len(by_value) > 1:
            groups = "; ".join(f"{value!r} in {names}" for value, names in by_value.items())
            problems.append(f"{f.name}: {groups}")
    if problems:
        raise ValueError(
            "this backend needs every attention layer to share window_left, logits_soft_cap and "
            "sm_scale, but layers disagree on " + " | ".join(problems)
            + ". Use a backend without this restriction (e.g. TRITON_ATTN or FLASH_ATTN)."
        )
    return first


def check_kv_cache_shape_args(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> None:
    """Shared argument check of every backend's ``get_kv_cache_shape``."""
    for name, v in (("num_blocks", num_blocks), ("block_size", block_size),
                    ("num_kv_heads", num_kv_heads), ("head_size", head_size)):
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"get_kv_cache_shape: {name} must be a positive int, got {v!r}.")


def paged_kv_stride_order() -> tuple[int, int, int, int, int]:
    """Stride order of a 5-D paged cache whose dims 2, 3 are (block_size, num_kv_heads).

    Identity for ``NHD``; ``(0, 1, 3, 2, 4)`` (heads before tokens in memory) for ``HND``.
    """
    return (0, 1, 3, 2, 4) if get_kv_cache_layout() == "HND" else (0, 1, 2, 3, 4)

"""The paged KV cache: allocation, binding to layers, metadata builders, and the
per-request arithmetic (block tables, slot mapping) so users need not write it.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch

from vattn.backends.abstract import AttentionBackend, AttentionMetadata, AttentionType
from vattn.backends.utils import AttentionMetadataBuilder, AttentionSpec, CommonAttentionMetadata
from vattn.config import VattnConfig, get_current_vattn_config
from vattn.ops.kv_store import kv_cache_torch_dtype

if TYPE_CHECKING:
    from vattn.layer import Attention

__all__ = [
    "KVCacheGroup",
    "PagedKVCache",
    "allocate_kv_cache",
    "bind_kv_cache",
    "build_common_attn_metadata",
]

logger = logging.getLogger("vattn")

# Layers whose K/V are computed on the fly and never cached.
_NO_CACHE_TYPES = (AttentionType.ENCODER, AttentionType.ENCODER_ONLY)


@dataclass
class KVCacheGroup:
    """Layers that share a backend and a cache spec, and so one metadata builder."""

    backend: type[AttentionBackend]
    spec: AttentionSpec
    layer_names: list[str]
    builder: AttentionMetadataBuilder


class PagedKVCache:
    """One paged KV cache tensor per layer, and the metadata builders of their groups.

    Args:
        tensors: layer name -> cache tensor (the backend's ``get_kv_cache_shape``).
        groups: the layer groups with their builders.
        num_blocks / block_size: the pool every request's block table indexes.
    """

    def __init__(
        self, tensors: dict[str, torch.Tensor], groups: list[KVCacheGroup], num_blocks: int, block_size: int
    ) -> None:
        self.tensors = tensors
        self.groups = groups
        self.num_blocks = num_blocks
        self.block_size = block_size

    def build_metadata(
        self, common: CommonAttentionMetadata, common_prefix_len: int = 0, fast_build: bool = False
    ) -> dict[str, AttentionMetadata]:
        """Each group's backend metadata for this step, keyed by layer name."""
        out: dict[str, AttentionMetadata] = {}
        for g in self.groups:
            md = g.builder.build(common_prefix_len, common, fast_build=fast_build)
            out.update(dict.fromkeys(g.layer_names, md))
        return out

    def build_metadata_for_cudagraph_capture(self, common: CommonAttentionMetadata) -> dict[str, AttentionMetadata]:
        out: dict[str, AttentionMetadata] = {}
        for g in self.groups:
            out.update(dict.fromkeys(g.layer_names, g.builder.build_for_cudagraph_capture(common)))
        return out

    def can_run_in_cudagraph(self, common: CommonAttentionMetadata) -> bool:
        """Whether every group's builder allows this batch inside a full CUDA graph."""
        return all(g.builder.can_run_in_cudagraph(common) for g in self.groups)

    def common_metadata(
        self,
        query_lens: Sequence[int] | torch.Tensor,
        num_computed_tokens: Sequence[int] | torch.Tensor,
        block_tables: Sequence[Sequence[int]] | torch.Tensor,
        **kwargs: Any,
    ) -> CommonAttentionMetadata:
        """``build_common_attn_metadata`` with this cache's block size, device and block-id bound."""
        device = next(iter(self.tensors.values())).device if self.tensors else torch.device("cpu")
        kwargs.setdefault("device", device)
        return build_common_attn_metadata(
            query_lens, num_computed_tokens, block_tables, self.block_size, num_blocks=self.num_blocks, **kwargs
        )

    @property
    def nbytes(self) -> int:
        seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self.tensors.values()}
        return sum(seen.values())

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(layers={len(self.tensors)}, num_blocks={self.num_blocks}, "
            f"block_size={self.block_size}, groups={len(self.groups)}, GiB={self.nbytes / 2**30:.3f})"
        )


def _spec_of(layer: "Attention", dtype: torch.dtype) -> AttentionSpec:
    return AttentionSpec(
        block_size=layer.block_size,
        num_kv_heads=layer.num_kv_heads,
        head_size=layer.head_size,
        dtype=kv_cache_torch_dtype(layer.kv_cache_dtype, dtype),
        cache_dtype_str=layer.kv_cache_dtype,
        sliding_window=layer.sliding_window,
    )


def _allocate_one(backend: type[AttentionBackend], spec: AttentionSpec, num_blocks: int, device: torch.device) -> torch.Tensor:
    shape = backend.get_kv_cache_shape(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size, spec.cache_dtype_str)
    try:
        order = tuple(backend.get_kv_cache_stride_order())
    except NotImplementedError:
        order = tuple(range(len(shape)))
    physical = tuple(shape[i] for i in order)
    # Zero-filled: padded requests of CUDA graphs may read block 0, which must be finite.
    raw = torch.zeros(physical, dtype=spec.dtype, device=device)
    inverse = [order.index(i) for i in range(len(order))]
    return raw.permute(*inverse)


def allocate_kv_cache(
    config: VattnConfig | None = None,
    num_blocks: int = 1024,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> PagedKVCache:
    """Allocate a paged KV cache for every attention layer of ``config`` and bind it.

    Args:
        config: the config the model was built under (default: the current one).
        num_blocks: blocks per layer; a request of ``n`` tokens needs ``ceil(n / block_size)``.
        device: where the cache lives (the model's device).
        dtype: the model dtype for ``cache_dtype="auto"`` (default: each layer's construction dtype).

    Returns a ``PagedKVCache``; each layer's ``kv_cache[0]`` is its tensor, KV-sharing layers
    get their target's tensor.
    """
    config = config if config is not None else get_current_vattn_config()
    if not isinstance(num_blocks, int) or num_blocks <= 0:
        raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}.")
    device = torch.device(device)
    layers: dict[str, "Attention"] = config.compilation.static_forward_context
    if not layers:
        raise ValueError(
            "allocate_kv_cache: the config has no attention layers; build the model inside "
            "`with vattn.set_current_vattn_config(cfg):` and pass that cfg."
        )
    block_sizes = {layer.block_size for layer in layers.values()}
    if len(block_sizes) != 1:
        raise ValueError(f"all layers must share one block_size to share block tables, got {sorted(block_sizes)}.")

    tensors: dict[str, torch.Tensor] = {}
    grouped: dict[tuple[type[AttentionBackend], AttentionSpec], list[str]] = {}
    for name, layer in layers.items():
        spec = _spec_of(layer, dtype or layer.dtype)
        grouped.setdefault((layer.attn_backend, spec), []).append(name)
        if layer.attn_type not in _NO_CACHE_TYPES and layer.kv_sharing_target_layer_name is None:
            tensors[name] = _allocate_one(layer.attn_backend, spec, num_blocks, device)
    for name, layer in layers.items():
        target = layer.kv_sharing_target_layer_name
        if target is not None:
            tensors[name] = tensors[target]

    groups = [
        KVCacheGroup(backend, spec, names, backend.get_builder_cls()(spec, names, config, device))
        for (backend, spec), names in grouped.items()
    ]
    kv = PagedKVCache(tensors, groups, num_blocks, block_sizes.pop())
    bind_kv_cache(tensors, config)
    logger.info("allocated %r", kv)
    return kv


def bind_kv_cache(tensors: dict[str, torch.Tensor], config: VattnConfig | None = None) -> None:
    """Point every layer's ``kv_cache[0]`` at its tensor (``tensors``: layer name -> tensor)."""
    config = config if config is not None else get_current_vattn_config()
    layers = config.compilation.static_forward_context
    for name, tensor in tensors.items():
        if name not in layers:
            raise KeyError(f"bind_kv_cache: no attention layer named {name!r} in the config; known: {list(layers)[:8]}")
        layers[name].kv_cache = [tensor]


def _as_int_list(name: str, values: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    out = [int(v) for v in values]
    if any(v < 0 for v in out):
        raise ValueError(f"{name} must be non-negative, got {out}.")
    return out


def build_common_attn_metadata(
    query_lens: Sequence[int] | torch.Tensor,
    num_computed_tokens: Sequence[int] | torch.Tensor,
    block_tables: Sequence[Sequence[int]] | torch.Tensor,
    block_size: int,
    device: torch.device | str = "cpu",
    *,
    num_tokens_padded: int | None = None,
    num_reqs_padded: int | None = None,
    max_blocks_per_req: int | None = None,
    causal: bool = True,
    num_blocks: int | None = None,
) -> CommonAttentionMetadata:
    """Turn per-request facts into ``CommonAttentionMetadata``.

    Args:
        query_lens: (B,) new tokens of each request, decodes first.
        num_computed_tokens: (B,) tokens each request already has in the cache.
        block_tables: B rows of block ids; row r needs ``ceil(seq_len_r / block_size)`` ids.
        block_size: tokens per block (the cache's).
        device: where the device tensors go (CPU mirrors are kept too).
        num_tokens_padded: pad the token dimension to this (padding slots are -1).
        num_reqs_padded: pad the request dimension to this (``num_reqs`` is then this). Padded requests take one padded
            token each while padded tokens remain (query length 1, sequence length 1 on block 0,
            never written), then query length 0: every kernel accepts them.
        max_blocks_per_req: width of ``block_table_tensor`` (default: the longest row).
        causal: False for encoder (bidirectional) attention.
        num_blocks: the cache's block count; block ids must be below it (checked when given).

    New token ``i`` of request ``r`` sits at position ``num_computed_tokens[r] + i`` and goes to
    slot ``block_tables[r][pos // block_size] * block_size + pos % block_size``.
    """
    qlens = _as_int_list("query_lens", query_lens)
    computed = _as_int_list("num_computed_tokens", num_computed_tokens)
    if isinstance(block_tables, torch.Tensor):
        rows = [list(map(int, r)) for r in block_tables.tolist()]
    else:
        rows = [[int(b) for b in r] for r in block_tables]
    b = len(qlens)
    if len(computed) != b or len(rows) < b:
        raise ValueError(
            f"query_lens ({b}), num_computed_tokens ({len(computed)}) and block_tables ({len(rows)}) "
            "must describe the same requests; give one entry per request."
        )
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}.")
    for r, row in enumerate(rows[:b]):
        bad = [x for x in row if x < 0 or (num_blocks is not None and x >= num_blocks)]
        if bad:
            raise ValueError(
                f"block_tables[{r}] has block ids {bad[:4]} outside [0, {num_blocks}); "
                "use ids of blocks allocated in this cache (kv.num_blocks)."
            )
    seq_lens = [c + q for c, q in zip(computed, qlens)]
    for r, (s, row) in enumerate(zip(seq_lens, rows)):
        need = math.ceil(s / block_size)
        if len(row) < need:
            raise ValueError(
                f"block_tables[{r}] has {len(row)} blocks but request {r} has {s} tokens "
                f"(num_computed_tokens {computed[r]} + query_len {qlens[r]}), needing {need} blocks of "
                f"{block_size}; allocate more blocks for it."
            )
    num_tokens = sum(qlens)
    t_pad = num_tokens if num_tokens_padded is None else num_tokens_padded
    b_pad = b if num_reqs_padded is None else num_reqs_padded
    if t_pad < num_tokens or b_pad < b:
        raise ValueError(
            f"num_tokens_padded={num_tokens_padded} / num_reqs_padded={num_reqs_padded} must be at least "
            f"the real {num_tokens} tokens / {b} requests."
        )
    width = max([len(r) for r in rows[:b]] + [1]) if max_blocks_per_req is None else max_blocks_per_req
    if any(len(r) > width for r in rows[:b]):
        raise ValueError(f"max_blocks_per_req={width} is smaller than the longest block table row.")

    # Padded requests: one padded token each while any remain, else none.
    spare = t_pad - num_tokens
    pad_q = [1 if i < spare else 0 for i in range(b_pad - b)]
    all_q = qlens + pad_q
    all_seq = seq_lens + pad_q
    qsl = torch.zeros(b_pad + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(all_q, dtype=torch.int32).cumsum(0)
    table = torch.zeros((b_pad, width), dtype=torch.int32)
    for r in range(b):
        table[r, : len(rows[r])] = torch.tensor(rows[r], dtype=torch.int32)

    slot = torch.full((t_pad,), -1, dtype=torch.int64)
    if num_tokens:
        req = torch.repeat_interleave(torch.arange(b), torch.tensor(qlens))
        starts = torch.tensor([0] + qlens[:-1]).cumsum(0)
        pos = torch.arange(num_tokens) - starts[req] + torch.tensor(computed)[req]
        blocks = table[req, pos // block_size].long()
        slot[:num_tokens] = blocks * block_size + pos % block_size

    seq_t = torch.tensor(all_seq, dtype=torch.int32)
    device = torch.device(device)
    pin = device.type == "cuda"

    def to_dev(t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory().to(device, non_blocking=True) if pin else t.to(device)

    return CommonAttentionMetadata(
        query_start_loc=to_dev(qsl),
        query_start_loc_cpu=qsl,
        seq_lens=to_dev(seq_t),
        seq_lens_cpu=seq_t,
        num_computed_tokens_cpu=torch.tensor(computed + [0] * (b_pad - b), dtype=torch.int32),
        num_reqs=b_pad,
        num_actual_tokens=num_tokens,
        max_query_len=max(qlens, default=0),
        block_table_tensor=to_dev(table),
        slot_mapping=to_dev(slot),
        max_seq_len=max(seq_lens, default=0),
        causal=causal,
    )

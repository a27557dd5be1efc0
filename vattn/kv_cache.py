"""The paged KV cache: allocation per layer, binding to layers, and the metadata builders of
each group of layers that share a backend and a cache spec.

The per-request arithmetic (block tables, slot mapping) lives in ``vattn.metadata``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import torch

from vattn import envs
from vattn.core.enums import AttentionType
from vattn.core.interface import AttentionBackend, AttentionMetadataBuilder
from vattn.core.metadata import AttentionMetadata, AttentionSpec, CommonAttentionMetadata
from vattn.core.batch_checks import StepChecks, cache_geometry
from vattn.core.metadata import check_common_metadata
from vattn.core.debug_checks import check_common_on_device
from vattn.core.registry import AttentionBackendEnum
from vattn.core.config import VattnConfig, get_current_vattn_config
from vattn.metadata import build_common_attn_metadata
from vattn.mixers.base import MambaBase
from vattn.mixers.state import allocate_states, state_bytes
from vattn.ops.kv_store import kv_cache_torch_dtype

if TYPE_CHECKING:
    from vattn.core.interface import AttentionLayerBase
    from vattn.layer import Attention

__all__ = ["KVCacheGroup", "PagedKVCache", "allocate_kv_cache", "bind_kv_cache"]

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
        groups: the layer groups with their builders (mixer layers' groups included).
        num_blocks / block_size: the pool every request's block table indexes.
        states: mixer layer name -> its state tensors, each (num_state_slots + 1, ...) (the last
            slot is padding's scratch slot).
        num_state_slots: state slots per mixer layer (``CommonAttentionMetadata.state_indices``).
    """

    def __init__(
        self, tensors: dict[str, torch.Tensor], groups: list[KVCacheGroup], num_blocks: int, block_size: int,
        states: dict[str, tuple[torch.Tensor, ...]] | None = None, num_state_slots: int = 0,
    ) -> None:
        self.tensors = tensors
        self.groups = groups
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.states = states or {}
        self.num_state_slots = num_state_slots
        first = next(iter(tensors.values()), None) if tensors else next(iter(self.states.values()), (None,))[0]
        #: Where the cache lives (None: no layer has a cache tensor, e.g. encoder-only models).
        self.device: torch.device | None = None if first is None else first.device
        self._where = f"this PagedKVCache ({num_blocks} blocks of {block_size})"

    def check(self, common: CommonAttentionMetadata) -> StepChecks:
        """Check ``common`` against this cache before anything runs on it: on the host (block size,
        block ids below ``num_blocks``, the block table's reach; the slots and block table
        themselves where they are CPU tensors, or where vattn's helpers built them). Device tensors
        a caller filled by hand are read only with ``VATTN_DEBUG_CHECKS=1`` (one host sync per
        step): reading them otherwise would stall every step, so the backends keep every access
        inside the cache and the block table instead. Once per metadata, and again after any of
        its tensors was replaced or edited in place (``StepChecks.describes``: identities and
        version counters, a few attribute reads); raises ``ValueError`` naming the field."""
        if not isinstance(common, CommonAttentionMetadata):
            raise TypeError(
                f"common: expected a vattn.CommonAttentionMetadata (kv.common_metadata(...)), got "
                f"{type(common).__name__}; build the step's metadata with kv.common_metadata or "
                "vattn.build_common_attn_metadata."
            )
        checks = common.host_checks
        if checks is None or not checks.describes(common):  # fields replaced or edited in place since construction
            checks = common.host_checks = check_common_metadata(common)
            checks.bind(common)
        device = self.device or checks.device
        if checks.device != device:
            raise ValueError(
                f"common: expected metadata on the KV cache's device {device}, got tensors on {checks.device}; "
                "build it with kv.common_metadata(...) (the cache's device) or device=kv's device."
            )
        if self.tensors or not self.states:  # a model of mixers only stores no K/V: no block table to check
            checks.check(self.block_size, self.num_blocks, self._where)
        if envs.VATTN_DEBUG_CHECKS and not checks.device_checked:
            check_common_on_device(common, self.block_size, self.num_blocks)
            checks.device_checked = True
        return checks

    def _check_trees(self, common: CommonAttentionMetadata) -> None:
        """Draft trees (``tree_parents``, with a request of several new tokens) only for groups
        whose backend honours them: any other would attend causally, silently."""
        if common.tree_parents is None or common.max_query_len <= 1:
            return
        for g in self.groups:
            if not g.backend.supports_tree_parents:
                able = [m.name for m in AttentionBackendEnum if _declares_trees(m)]
                raise NotImplementedError(
                    f"CommonAttentionMetadata.tree_parents: backend {g.backend.get_name()} (layers "
                    f"{g.layer_names[:3]}{'...' if len(g.layer_names) > 3 else ''}) does not honour draft trees and "
                    f"would attend causally instead; build those layers with attn_backend= one of {able} "
                    "(TREE_ATTN serves mask and score mods too), or pass tree_parents=None for chains."
                )

    def build_metadata(
        self, common: CommonAttentionMetadata, common_prefix_len: int = 0, fast_build: bool = False
    ) -> dict[str, AttentionMetadata]:
        """Each group's backend metadata for this step, keyed by layer name (``check`` first).

        Every step's checks run here, before anything is written: ``common`` itself (again if a
        field was replaced or edited in place since construction) and what each group's backend
        can honour (``tree_parents``)."""
        return self._build(common, lambda b: b.build(common_prefix_len, common, fast_build=fast_build))

    def build_metadata_for_cudagraph_capture(self, common: CommonAttentionMetadata) -> dict[str, AttentionMetadata]:
        """As ``build_metadata``, through each builder's ``build_for_cudagraph_capture``."""
        return self._build(common, lambda b: b.build_for_cudagraph_capture(common))

    def _build(self, common: CommonAttentionMetadata,
               build_one: Callable[[AttentionMetadataBuilder], AttentionMetadata]) -> dict[str, AttentionMetadata]:
        checks = self.check(common)
        self._check_trees(common)
        if self.states:
            self._check_state_indices(common)
        out: dict[str, AttentionMetadata] = {}
        for g in self.groups:
            md = build_one(g.builder)
            md.checks = checks
            out.update(dict.fromkeys(g.layer_names, md))
        return out

    def _check_state_indices(self, common: CommonAttentionMetadata) -> None:
        """The mixer layers' state slots: present, and (on the host mirror) below ``num_state_slots``."""
        indices, b = common.state_indices_cpu, common.num_reqs
        if common.state_indices is None:
            raise ValueError(
                "CommonAttentionMetadata.state_indices: expected one state slot per request for this model's mixer "
                f"layers (slots 0 .. {self.num_state_slots - 1}), got None; pass state_indices= to kv.common_metadata "
                "(InputBatch.prepare passes its rows), each request keeping its slot for its lifetime.")
        if indices is not None and b and int(indices[:b].max()) >= self.num_state_slots:
            raise ValueError(
                f"CommonAttentionMetadata.state_indices: expected slots below kv.num_state_slots = "
                f"{self.num_state_slots}, got {indices[:b].tolist()[:16]}; allocate more slots "
                "(allocate_kv_cache(num_state_slots=...)) or reuse the slots of finished requests.")

    def can_run_in_cudagraph(self, common: CommonAttentionMetadata) -> bool:
        """Whether every group's builder allows this batch inside a full CUDA graph."""
        return all(g.builder.can_run_in_cudagraph(common) for g in self.groups)

    def common_metadata(self, query_lens: Sequence[int] | torch.Tensor,
                        num_computed_tokens: Sequence[int] | torch.Tensor,
                        block_tables: Sequence[Sequence[int]] | torch.Tensor | None,
                        **kwargs: Any) -> CommonAttentionMetadata:
        """``build_common_attn_metadata`` with this cache's block size, device and block-id bound
        (``block_tables=None`` for a model of mixer layers only)."""
        device = self.device or torch.device("cpu")
        kwargs.setdefault("device", device)
        return build_common_attn_metadata(
            query_lens, num_computed_tokens, block_tables, self.block_size, num_blocks=self.num_blocks, **kwargs
        )

    @property
    def nbytes(self) -> int:
        seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self.tensors.values()}
        return sum(seen.values()) + sum(t.nbytes for ts in self.states.values() for t in ts)

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(layers={len(self.tensors)}, num_blocks={self.num_blocks}, "
            f"block_size={self.block_size}, groups={len(self.groups)}, "
            + (f"mixer_layers={len(self.states)}, num_state_slots={self.num_state_slots}, " if self.states else "")
            + f"GiB={self.nbytes / 2**30:.3f})"
        )


def _declares_trees(member: Any) -> bool:
    """Whether the registered backend ``member`` declares ``supports_tree_parents`` (False
    where its class cannot be imported here)."""
    try:
        return bool(member.get_class().supports_tree_parents)
    except Exception:  # noqa: BLE001  (an optional library missing: it cannot serve anyway)
        return False


def _spec_of(layer: "AttentionLayerBase", dtype: torch.dtype) -> AttentionSpec:
    """The layer's cache spec (``AttentionLayerBase.get_kv_cache_spec``: an MLA layer's is an
    ``MLAAttentionSpec``, its latent width) for a model of ``dtype``."""
    return layer.get_kv_cache_spec(kv_cache_torch_dtype(layer.kv_cache_dtype, dtype))  # type: ignore[attr-defined]


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


def allocate_kv_cache(config: VattnConfig | None = None, num_blocks: int = 1024, device: torch.device | str = "cpu",
                      dtype: torch.dtype | None = None, *, num_state_slots: int | None = None) -> PagedKVCache:
    """Allocate a paged KV cache for every attention layer of ``config`` and bind it.

    Each layer's cache follows its spec (``get_kv_cache_spec``): ``vattn.Attention`` layers get
    K/V pages, ``vattn.MLAAttention`` layers one latent row per token; layers of one backend and
    spec form a group with one metadata builder. Every layer shares one block size, so one block
    table per request serves all of them.

    Args:
        config: the config the model was built under (default: the current one).
        num_blocks: blocks per layer; a request of ``n`` tokens needs ``ceil(n / block_size)``.
        device: where the cache lives (the model's device).
        dtype: the model dtype for ``cache_dtype="auto"`` (default: each layer's construction dtype).
        num_state_slots: for models with mixer layers (``vattn.GatedDeltaNet`` ...): the most
            requests running at once; each gets a slot of every mixer layer's state
            (``state_indices`` in the step's metadata). Required when the model has mixer layers.

    Returns a ``PagedKVCache``; each layer's ``kv_cache[0]`` is its tensor, KV-sharing layers
    get their target's tensor.
    """
    config = config if config is not None else get_current_vattn_config()
    if not isinstance(num_blocks, (int, np.integer)) or isinstance(num_blocks, bool):
        raise TypeError(f"num_blocks: expected a positive int, got {num_blocks!r} of type "
                        f"{type(num_blocks).__name__}; pass an int such as 1024.")
    if num_blocks <= 0:
        raise ValueError(f"num_blocks: expected a positive int, got {num_blocks}; pass at least 1 (a request of "
                         "n tokens needs ceil(n / block_size) blocks).")
    num_blocks = int(num_blocks)
    device = _checked_device(device)
    everything = config.compilation.static_forward_context
    if not everything:
        raise ValueError(
            "allocate_kv_cache: the config has no attention layers (and no mixer layers); build the model inside "
            "`with vattn.set_current_vattn_config(cfg):` and pass that cfg."
        )
    mixers = {n: layer for n, layer in everything.items() if isinstance(layer, MambaBase)}
    layers: dict[str, "Attention"] = {n: layer for n, layer in everything.items() if n not in mixers}
    num_state_slots = _checked_slots(num_state_slots, mixers)
    block_sizes = {layer.block_size for layer in layers.values()} or {config.cache.block_size}
    if len(block_sizes) != 1:
        raise ValueError(f"all layers must share one block_size to share block tables, got {sorted(block_sizes)}.")

    tensors: dict[str, torch.Tensor] = {}
    grouped: dict[tuple[type[AttentionBackend], AttentionSpec], list[str]] = {}
    owners = []
    for name, layer in layers.items():
        spec = _spec_of(layer, dtype or layer.dtype)
        grouped.setdefault((layer.attn_backend, spec), []).append(name)
        if layer.attn_type not in _NO_CACHE_TYPES and layer.kv_sharing_target_layer_name is None:
            owners.append((name, layer.attn_backend, spec))
    _check_capacity(owners, num_blocks, device, state_bytes(mixers, num_state_slots, dtype))
    try:
        for name, backend, spec in owners:
            tensors[name] = _allocate_one(backend, spec, num_blocks, device)
    except RuntimeError as e:  # out of memory (torch.OutOfMemoryError is one)
        raise type(e)(f"num_blocks={num_blocks}: allocating the KV cache on {device} failed ({e}); lower "
                      "num_blocks (free memory / bytes per block of all layers).") from None
    for name, layer in layers.items():
        target = layer.kv_sharing_target_layer_name
        if target is not None:
            tensors[name] = tensors[target]

    groups = [
        KVCacheGroup(backend, spec, names, backend.get_builder_cls()(spec, names, config, device))
        for (backend, spec), names in grouped.items()
    ]
    states, mixer_groups = allocate_states(mixers, num_state_slots, device, dtype, config)
    groups += [KVCacheGroup(*g) for g in mixer_groups]
    kv = PagedKVCache(tensors, groups, num_blocks, block_sizes.pop(), states, num_state_slots)
    bind_kv_cache(tensors, config)
    logger.info("allocated %r", kv)
    return kv


def _checked_device(device: torch.device | str) -> torch.device:
    """``device`` as a ``torch.device`` this torch build can allocate on, else ``ValueError``
    naming it (instead of torch's assertion deep inside the allocation)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device: expected a torch device such as 'cuda', 'cuda:0' or 'cpu', got {device!r} ({e}); "
                         "pass the model's device.") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            why = ("this torch build has no CUDA support" if torch.version.cuda is None
                   else "no CUDA GPU is visible (CUDA_VISIBLE_DEVICES, driver)")
            raise ValueError(f"device: expected a device this machine has, got {str(device)!r}, but {why} "
                             f"(torch {torch.__version__}); pass device='cpu', or install a CUDA build of torch "
                             "and run where a GPU is visible.")
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"device: expected one of cuda:0 .. cuda:{count - 1} (the GPUs visible here), got "
                             f"{str(device)!r}; pass an index below torch.cuda.device_count() = {count}.")
    return dev


def _checked_slots(num_state_slots: Any, mixers: dict[str, MambaBase]) -> int:
    """``num_state_slots`` as an int (0 without mixer layers), or an error naming it."""
    if not mixers:
        return 0
    if not isinstance(num_state_slots, (int, np.integer)) or isinstance(num_state_slots, bool) or num_state_slots <= 0:
        raise ValueError(
            f"num_state_slots: expected a positive int for this model's {len(mixers)} mixer layers (e.g. "
            f"{next(iter(mixers))!r}), got {num_state_slots!r}; pass the most requests that run at once, e.g. "
            "allocate_kv_cache(cfg, num_blocks, num_state_slots=64).")
    return int(num_state_slots)


def _check_capacity(owners: list[tuple[str, Any, AttentionSpec]], num_blocks: int, device: torch.device,
                    extra: int = 0) -> None:
    """A ``ValueError`` naming ``num_blocks`` when the caches (and ``extra`` bytes of mixer states)
    cannot fit the device's memory at all."""
    total = extra
    for _, backend, spec in owners:
        shape = backend.get_kv_cache_shape(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size,
                                           spec.cache_dtype_str)
        total += int(np.prod(shape, dtype=np.float64)) * torch.empty((), dtype=spec.dtype).element_size()
    if device.type == "cuda":
        capacity = torch.cuda.get_device_properties(device).total_memory
    else:
        try:
            capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return
    if total > capacity:
        per_block = total // num_blocks
        raise ValueError(
            f"num_blocks: expected at most {capacity // max(per_block, 1)} blocks on {device} ({capacity / 2**30:.1f} "
            f"GiB; one block of all {len(owners)} layers takes {per_block} bytes), got {num_blocks} "
            f"({total / 2**30:.1f} GiB, mixer states {extra / 2**30:.1f} of it); lower num_blocks (or num_state_slots)."
        )


def bind_kv_cache(tensors: dict[str, torch.Tensor], config: VattnConfig | None = None) -> None:
    """Point every layer's ``kv_cache[0]`` at its tensor (``tensors``: layer name -> tensor).

    Each tensor must have the shape the layer's backend states (``get_kv_cache_shape``) for the
    layer's KV heads, head size and block size, with any block count: else ``ValueError``."""
    config = config if config is not None else get_current_vattn_config()
    layers = config.compilation.static_forward_context
    for name, tensor in tensors.items():
        if name not in layers:
            raise KeyError(f"bind_kv_cache: no attention layer named {name!r} in the config; known: {list(layers)[:8]}")
        layer = layers[name]
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"bind_kv_cache: tensors[{name!r}]: expected a torch.Tensor, got {type(tensor).__name__}; "
                            "pass the cache tensors by layer name (kv.tensors).")
        if layer.attn_type not in _NO_CACHE_TYPES and hasattr(layer, "attn_backend"):
            cache_geometry(layer.attn_backend, tensor, block_size=layer.block_size, num_kv_heads=layer.num_kv_heads,
                           head_size=layer.head_size, cache_dtype=layer.kv_cache_dtype, name=f"bind_kv_cache: {name}")
    for name, tensor in tensors.items():
        layers[name].kv_cache = [tensor]

"""The state half of ``vattn.allocate_kv_cache``: per-request state slots for the mixer layers.

Every state tensor of a layer is ``(num_state_slots + 1, *shape)``: slot ``s`` belongs to the
request the caller gave it (``state_indices``), the last one is the scratch slot of padded
requests. Layers of one backend and spec share a metadata builder (one group).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from vattn.core.config import VattnConfig
    from vattn.mixers.base import MambaBase

__all__ = ["allocate_states", "state_bytes"]


def state_bytes(layers: dict[str, "MambaBase"], num_state_slots: int, dtype: torch.dtype | None) -> int:
    """Bytes the states of ``layers`` take for ``num_state_slots`` slots (the scratch slot included)."""
    return sum(layer.get_kv_cache_spec(dtype or layer.dtype).bytes_per_slot for layer in layers.values()) * (
        num_state_slots + 1)


def allocate_states(layers: dict[str, "MambaBase"], num_state_slots: int, device: torch.device,
                    dtype: torch.dtype | None, config: "VattnConfig") -> tuple[dict[str, tuple[torch.Tensor, ...]],
                                                                                list[tuple[Any, Any, list[str], Any]]]:
    """Zero-filled states for every mixer layer, bound to it (``layer.kv_cache[0]``), and the groups
    ``(backend, spec, layer names, builder)`` of layers sharing a backend and spec."""
    states: dict[str, tuple[torch.Tensor, ...]] = {}
    grouped: dict[tuple[Any, Any], list[str]] = {}
    for name, layer in layers.items():
        spec = layer.get_kv_cache_spec(dtype or layer.dtype)
        grouped.setdefault((layer.attn_backend, spec), []).append(name)
        states[name] = tuple(torch.zeros((num_state_slots + 1, *shape), dtype=d, device=device)
                             for shape, d in zip(spec.shapes, spec.dtypes))
        layer.kv_cache = [states[name]]
    groups = [(backend, spec, names, backend.get_builder_cls()(spec, names, config, device, num_state_slots))
              for (backend, spec), names in grouped.items()]
    return states, groups

"""The contract of mixer (Mamba-family) backends: a layer's state per slot (``MambaSpec``), one
step's metadata (``MambaMetadata``) and the static backend description (``MambaBackend``).

A mixer layer keeps a fixed-size state per request instead of K/V per token: each running
request owns a *state slot* (``CommonAttentionMetadata.state_indices``); every state tensor of a
layer has ``num_state_slots + 1`` rows, the last a scratch slot that padded requests use.
The builder and the impls are in ``vattn.backends.mamba``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from vattn.core.enums import AttentionCGSupport
from vattn.core.metadata import AttentionMetadata

__all__ = ["MambaBackend", "MambaMetadata", "MambaSpec"]


@dataclass(frozen=True)
class MambaSpec:
    """A mixer layer's state per request slot: one shape and dtype per state tensor (e.g. the
    conv state (D, K-1) and the SSM state (H, P, N)). Layers with equal specs and backends share
    one metadata builder."""

    mamba_type: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]

    @property
    def bytes_per_slot(self) -> int:
        return sum(int(np.prod(s)) * torch.empty((), dtype=d).element_size() for s, d in zip(self.shapes, self.dtypes))


@dataclass
class MambaMetadata(AttentionMetadata):
    """One step's metadata of a group of mixer layers. B = num_reqs (padded requests included).

    | field | shape / type | meaning |
    | --- | --- | --- |
    | num_reqs | int | requests (padded ones included; they use the scratch slot) |
    | num_actual_tokens | int | real tokens (rows of output written) |
    | num_decodes, num_decode_tokens | int | leading requests of at most one new token, and their tokens |
    | num_prefills | int | the other requests |
    | max_query_len | int | longest new-token count |
    | query_start_loc | (B + 1,) int32 | start of each request's tokens |
    | query_start_loc_cpu | (B + 1,) int32, CPU | its host mirror |
    | state_indices | (B,) int32 | each request's state slot (padding: the scratch slot ``num_state_slots``) |
    | has_initial_state | (B,) bool | the request continues from its slot (``num_computed_tokens > 0``) |
    | has_initial_state_cpu | (B,) bool, CPU | its host mirror |
    """

    num_reqs: int
    num_actual_tokens: int
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    max_query_len: int
    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    state_indices: torch.Tensor
    has_initial_state: torch.Tensor
    has_initial_state_cpu: torch.Tensor


class MambaBackend:
    """Static description of a mixer backend (the ``MambaAttentionBackendEnum`` members' classes).

    Subclasses set ``name``, ``mamba_type``, ``impl_cls`` and ``builder_cls``."""

    name: ClassVar[str] = ""
    mamba_type: ClassVar[str] = ""
    impl_cls: ClassVar[type]
    builder_cls: ClassVar[type]
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    runs_on_cpu: ClassVar[bool] = True
    supports_tree_parents: ClassVar[bool] = False
    installable: ClassVar[bool] = True
    feature_notes: ClassVar[dict[str, str]] = {}

    @classmethod
    def get_name(cls) -> str:
        return cls.name

    @classmethod
    def get_impl_cls(cls) -> type:
        return cls.impl_cls

    @classmethod
    def get_builder_cls(cls) -> type:
        return cls.builder_cls

    @staticmethod
    def get_metadata_cls() -> type[MambaMetadata]:
        return MambaMetadata

    @classmethod
    def get_cudagraph_support(cls) -> AttentionCGSupport:
        return cls.get_builder_cls().cudagraph_support

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        return True, ""

    @classmethod
    def validate_configuration(cls, mamba_type: str, dtype: torch.dtype) -> list[str]:
        """Why this backend cannot serve a ``mamba_type`` layer of ``dtype`` (empty: it can)."""
        reasons = []
        if mamba_type != cls.mamba_type:
            reasons.append(f"{cls.name} serves {cls.mamba_type!r} layers, not {mamba_type!r}")
        if dtype not in cls.supported_dtypes:
            reasons.append(f"dtype {dtype} not in {cls.supported_dtypes}")
        return reasons

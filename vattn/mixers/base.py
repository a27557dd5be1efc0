"""``MambaBase``: what every Mamba-family (mixer) layer is to the rest of vattn, and
``get_mamba_backend``, the mixer layers' selector.

A mixer layer is weightless like ``vattn.Attention``: the model keeps its projections and passes
the per-token tensors and weights in; the layer keeps the recurrent state of each request in a
slot of the state tensors ``vattn.allocate_kv_cache`` binds to it, and dispatches through the
opaque op ``vattn::mixer_with_output`` to the impl of the backend the selector picked from
``MambaAttentionBackendEnum``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional

import torch
from torch import nn

import vattn.ops  # noqa: F401  (registers the vattn:: ops)
from vattn.core.mamba import MambaBackend, MambaSpec
from vattn.core.registry import MAMBA_TYPE_TO_BACKEND_MAP, MambaAttentionBackendEnum
from vattn.core.config import get_current_vattn_config
from vattn.ops.library import eager_direct_ok
from vattn.ops.mixer import run_mixer

__all__ = ["MambaBase", "get_mamba_backend"]


def get_mamba_backend(mamba_type: str, dtype: torch.dtype | None = None,
                      mamba_backend: type[MambaBackend] | MambaAttentionBackendEnum | str | None = None
                      ) -> type[MambaBackend]:
    """The backend class for a mixer layer of ``mamba_type`` (``MAMBA_TYPE_TO_BACKEND_MAP``'s keys).

    ``mamba_backend`` forces one: a class, a ``MambaAttentionBackendEnum`` member or its name
    (``CUSTOM`` after ``register_backend(MambaAttentionBackendEnum.CUSTOM, ..., is_mamba=True)``).
    Overrides registered for a member (``register_backend``) are honoured."""
    if mamba_type not in MAMBA_TYPE_TO_BACKEND_MAP:
        raise ValueError(f"mamba_type: expected one of {sorted(MAMBA_TYPE_TO_BACKEND_MAP)}, got {mamba_type!r}; "
                         "use the layer class of that kind (vattn.GatedDeltaNet, vattn.Mamba2Mixer, ...).")
    if isinstance(mamba_backend, type):
        backend: Any = mamba_backend
    else:
        member = mamba_backend if mamba_backend is not None else MAMBA_TYPE_TO_BACKEND_MAP[mamba_type]
        if isinstance(member, str):
            try:
                member = MambaAttentionBackendEnum[member.strip().upper()]
            except (KeyError, ValueError):
                raise ValueError(f"mamba_backend: expected one of {[m.name for m in MambaAttentionBackendEnum]}, "
                                 f"got {mamba_backend!r}; pass a MambaAttentionBackendEnum name or None.") from None
        backend = member.get_class()
    reasons = backend.validate_configuration(mamba_type, dtype) if hasattr(backend, "validate_configuration") else []
    if dtype is None:
        reasons = [r for r in reasons if not r.startswith("dtype")]
    if reasons:
        raise ValueError(f"mamba_backend={getattr(backend, '__name__', backend)} cannot serve a {mamba_type!r} layer: "
                         f"{'; '.join(reasons)}; pass mamba_backend=None to select automatically.")
    return backend


class MambaBase(nn.Module):
    """Base of the mixer layers: registration, state declaration, dispatch.

    Subclasses set ``mamba_type`` and implement ``get_state_shape`` / ``get_state_dtype``; their
    entries call ``self._run(inputs, output, part)``. After ``vattn.allocate_kv_cache``,
    ``kv_cache[0]`` is the tuple of state tensors, each ``(num_state_slots + 1, *shape)``."""

    mamba_type: ClassVar[str] = ""

    def __init__(self, *, prefix: str, mamba_backend: Any = None) -> None:
        super().__init__()
        cache = get_current_vattn_config().cache
        self._conv_dtype, self._ssm_dtype = cache.mamba_cache_dtype, cache.mamba_ssm_cache_dtype
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"prefix: expected a unique non-empty layer name such as 'model.layers.0.linear_attn', "
                             f"got {prefix!r}.")
        config = get_current_vattn_config()
        context = config.compilation.static_forward_context
        if prefix in context:
            raise ValueError(f"Duplicate layer name: {prefix!r} is already registered in the current vattn config; "
                             "give every layer a unique prefix (e.g. f'model.layers.{i}.linear_attn').")
        self.layer_name = prefix
        self.dtype = torch.get_default_dtype()
        self.attn_backend = get_mamba_backend(self.mamba_type, self.dtype, mamba_backend)
        self.impl = self.attn_backend.get_impl_cls()(self)
        # Replaced by vattn.allocate_kv_cache: one tuple of state tensors per virtual engine.
        self.kv_cache: list[Any] = [None]
        context[prefix] = self

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        """The shape of each state tensor per request slot."""
        raise NotImplementedError

    def get_state_dtype(self, dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        """The dtype of each state tensor for a model of ``dtype`` (``CacheConfig.mamba_cache_dtype``
        for conv states, ``mamba_ssm_cache_dtype`` for recurrent ones, float32 by default)."""
        raise NotImplementedError

    def conv_state_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype if self._conv_dtype == "auto" else getattr(torch, self._conv_dtype)

    def ssm_state_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype if self._ssm_dtype == "auto" else getattr(torch, self._ssm_dtype)

    def get_attn_backend(self) -> type[MambaBackend]:
        return self.attn_backend

    def get_kv_cache_spec(self, dtype: torch.dtype) -> MambaSpec:
        return MambaSpec(self.mamba_type, self.get_state_shape(), self.get_state_dtype(dtype))

    def _run(self, inputs: list[Optional[torch.Tensor]], output: torch.Tensor, part: int = 0) -> torch.Tensor:
        if eager_direct_ok(*inputs):
            run_mixer(inputs, output, self.layer_name, part)
        else:
            torch.ops.vattn.mixer_with_output(inputs, output, self.layer_name, part)
        return output

    @staticmethod
    def _tokens(name: str, x: torch.Tensor, width: int, where: str) -> torch.Tensor:
        """``x`` as (T, width) (a (T, a, b) tensor with a * b == width is viewed), else ``ValueError``."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{where}: {name}: expected a tensor (T, {width}), got {type(x).__name__}.")
        if x.dim() == 3 and x.shape[1] * x.shape[2] == width:
            x = x.reshape(x.shape[0], width)
        if x.dim() != 2 or x.shape[1] != width:
            raise ValueError(f"{where}: {name}: expected shape (T, {width}), got {tuple(x.shape)}; pass one row per "
                             "token of the step (flatten batch and sequence dims first).")
        return x

    def extra_repr(self) -> str:
        return f"prefix={self.layer_name!r}, backend={self.attn_backend.get_name()}"

"""Choose the attention backend for a layer's configuration.

Override order (first that is set wins):

1. a globally forced backend (``global_force_attn_backend`` or its context manager);
2. the ``VATTN_ATTENTION_BACKEND`` environment variable (a member name of ``AttentionBackendEnum``);
3. the platform's priority list (``vattn.platform``): the first backend that can serve the
   configuration; a layer with a FlexAttention ``mask_mod`` / ``score_mod`` also tries the
   backends that take them (``MOD_BACKENDS``) after that list.

A forced backend (1 or 2) that cannot serve the configuration is an error saying why; it
never falls back silently. A forced name that this vattn version does not implement
(``AttentionBackendEnum.is_implemented()``) is an error that says so and lists the implemented
backends. Each backend states its reasons through ``AttentionBackend.validate_configuration``;
a backend whose module fails to import (its library is not installed) counts as unavailable,
with the import error as its reason. When no backend can serve, the error lists the candidates
in two groups: those not implemented in this version, and those that cannot serve here, each
with its reasons.

Selections are cached per configuration; the forced backend, the environment variable and
the registry's override generation are part of the cache key, so changing any of them
takes effect on the next call.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from typing import Iterator

import torch

from vattn import envs
from vattn.core.enums import AttentionType
from vattn.core.interface import AttentionBackend
from vattn.core.registry import AttentionBackendEnum, registry_generation, valid_options, vattn_version
from vattn.core.config import CACHE_DTYPES
from vattn.platform import Platform, current_platform

__all__ = [
    "backend_name_to_enum",
    "get_attn_backend",
    "get_env_variable_attn_backend",
    "get_global_forced_attn_backend",
    "global_force_attn_backend",
    "global_force_attn_backend_context_manager",
]

logger = logging.getLogger("vattn.selector")

STR_BACKEND_ENV_VAR = "VATTN_ATTENTION_BACKEND"
#: Tried after the platform's list for a layer with a mask_mod or score_mod: the platforms list
#: fixed-function kernels, which refuse mods.
MOD_BACKENDS = (AttentionBackendEnum.FLEX_ATTENTION,)


class _ForcedBackend:
    """Holds the globally forced backend (``None``: automatic selection)."""

    backend: AttentionBackendEnum | None = None


def backend_name_to_enum(backend_name: str) -> AttentionBackendEnum | None:
    """The ``AttentionBackendEnum`` member named ``backend_name`` (case-insensitive), or ``None``.

    ``None`` means the name is not a vattn backend. Use ``AttentionBackendEnum[name]``
    for an error that lists the valid names instead.
    """
    if not isinstance(backend_name, str):
        raise TypeError(
            f"backend_name must be a str such as 'TORCH_SDPA', got {type(backend_name).__name__}."
        )
    key = backend_name.strip()
    alias = TRANSFORMERS_NAMES.get(key.lower())
    return AttentionBackendEnum[alias] if alias else AttentionBackendEnum.__members__.get(key.upper())


#: transformers' ``attn_implementation`` names, and the vattn backend that computes the same
#: attention with the same library (``"eager"``, transformers' own matmul-softmax, has none).
TRANSFORMERS_NAMES: dict[str, str] = {
    "sdpa": "TORCH_SDPA",
    "flash_attention_2": "FLASH_ATTN",
    "flash_attention_3": "FLASH_ATTN",
    "flex_attention": "FLEX_ATTENTION",
}


def warn_if_slow_here(backend: type[AttentionBackend]) -> type[AttentionBackend]:
    """``backend``, after a warning (once per backend) where it runs on the CPU through a slow
    reference path (its ``feature_notes["runs_on_cpu"]`` starts with "slow") and no CUDA GPU is
    visible, naming the faster choice."""
    note = backend.feature_notes.get("runs_on_cpu", "")
    if note.startswith("slow") and not torch.cuda.is_available():
        _warn_once(backend.get_name(), note)
    return backend


@functools.lru_cache(maxsize=None)
def _warn_once(name: str, note: str) -> None:
    logger.warning("%s on the CPU: %s.", name, note)


def implemented_names() -> list[str]:
    """Names of the backends this version implements and can install (the ones worth suggesting;
    not those it names only to say why they cannot run, as ``installable = False`` declares)."""
    names = []
    for m in AttentionBackendEnum:
        if m.value and m.is_implemented():
            try:
                if m.get_class().installable:
                    names.append(m.name)
            except (ImportError, ValueError):
                continue
    return names


def get_env_variable_attn_backend() -> AttentionBackendEnum | None:
    """The backend named by ``VATTN_ATTENTION_BACKEND``, or ``None`` when it is unset.

    Raises:
        ValueError: the variable names no backend (the message lists the valid names).
    """
    name = envs.VATTN_ATTENTION_BACKEND
    if name is None:
        _hint_vllm_variable()
        return None
    return _env_name_to_enum(name)


@functools.lru_cache(maxsize=None)
def _hint_vllm_variable(value: str | None = None) -> None:
    """Say once that vLLM's ``VLLM_ATTENTION_BACKEND`` is set but vattn reads its own variable."""
    value = os.environ.get("VLLM_ATTENTION_BACKEND") if value is None else value
    if value:
        logger.warning("VLLM_ATTENTION_BACKEND=%s is set, but vattn reads %s (unset here): set %s=%s to choose "
                       "this backend in vattn.", value, STR_BACKEND_ENV_VAR, STR_BACKEND_ENV_VAR, value)


def _env_name_to_enum(name: str) -> AttentionBackendEnum:
    backend = backend_name_to_enum(name)
    if backend is None:
        raise ValueError(
            f"{STR_BACKEND_ENV_VAR}={name!r} is not an attention backend. "
            f"{valid_options(AttentionBackendEnum)}. Set it to an implemented one or unset it for "
            "automatic selection."
        )
    return backend


def global_force_attn_backend(attn_backend: AttentionBackendEnum | str | None) -> None:
    """Force every later ``get_attn_backend`` call to use ``attn_backend`` (``None``: automatic).

    Overrides ``VATTN_ATTENTION_BACKEND``. A name string is accepted and must be valid.
    """
    if isinstance(attn_backend, str):
        attn_backend = backend_name_to_enum(attn_backend) or AttentionBackendEnum[attn_backend.strip().upper()]
    if attn_backend is not None and not isinstance(attn_backend, AttentionBackendEnum):
        raise TypeError(
            "global_force_attn_backend: attn_backend must be an AttentionBackendEnum member, a "
            f"backend name or None, got {attn_backend!r}."
        )
    _ForcedBackend.backend = attn_backend


def get_global_forced_attn_backend() -> AttentionBackendEnum | None:
    """The globally forced backend, or ``None`` when selection is automatic."""
    return _ForcedBackend.backend


@contextlib.contextmanager
def global_force_attn_backend_context_manager(
    attn_backend: AttentionBackendEnum | str | None,
) -> Iterator[None]:
    """Force ``attn_backend`` inside the block; restore the previous value on exit, even on error.

    The selection cache is cleared on entry and exit.
    """
    original = get_global_forced_attn_backend()
    global_force_attn_backend(attn_backend)
    _cached_get_attn_backend.cache_clear()
    try:
        yield
    finally:
        global_force_attn_backend(original)
        _cached_get_attn_backend.cache_clear()


def get_attn_backend(head_size: int, dtype: torch.dtype, kv_cache_dtype: str | None, block_size: int,
                     use_mla: bool = False, has_sink: bool = False, use_sparse: bool = False, *,
                     attn_type: str = AttentionType.DECODER, use_sliding_window: bool = False,
                     use_logits_soft_cap: bool = False, use_alibi: bool = False, use_mask_mod: bool = False,
                     use_score_mod: bool = False, mla_dims: tuple[int, int, int, int] | None = None,
                     is_attention_free: bool = False) -> type[AttentionBackend]:
    """Select the attention backend for a configuration and import it.

    Args:
        head_size: per-head dimension D.
        dtype: the model (query) dtype.
        kv_cache_dtype: a ``CacheConfig.cache_dtype`` string (``None`` = ``"auto"``).
        block_size: tokens per KV-cache block.
        use_mla: the layer is multi-head latent attention.
        has_sink: the layer has attention-sink logits.
        use_sparse: the layer uses sparse attention.
        attn_type, use_sliding_window, use_logits_soft_cap, use_alibi, use_mask_mod, use_score_mod:
            the layer's features (beyond the seed's arguments), checked against each backend's
            declarations (``AttentionBackend.feature_reasons``).
        mla_dims: an MLA layer's ``(kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim)``,
            checked by MLA backends' ``mla_dims_reasons`` (``head_size`` is only their latent width).
        is_attention_free: the model has no attention layers (only mixers): the placeholder
            ``NO_ATTENTION`` is returned, as the seeds' selector does.

    Returns:
        The backend class (a subclass of ``AttentionBackend``).

    Raises:
        ValueError: no backend can serve the configuration, a forced backend cannot, or
            ``VATTN_ATTENTION_BACKEND`` names no backend. The message gives every reason.
    """
    if is_attention_free:
        return AttentionBackendEnum.NO_ATTENTION.get_class()
    if not isinstance(head_size, int) or isinstance(head_size, bool) or head_size <= 0:
        raise ValueError(f"get_attn_backend: head_size must be a positive int, got {head_size!r}.")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise ValueError(f"get_attn_backend: block_size must be a positive int, got {block_size!r}.")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(
            f"get_attn_backend: dtype must be a torch.dtype (e.g. torch.bfloat16), got {dtype!r}."
        )
    if kv_cache_dtype is not None and kv_cache_dtype not in CACHE_DTYPES:
        raise ValueError(
            f"get_attn_backend: kv_cache_dtype must be None or one of {CACHE_DTYPES}, "
            f"got {kv_cache_dtype!r}."
        )
    # Read the mutable inputs here and pass them to the cached function explicitly, so a
    # change of any of them can never return a stale cached selection.
    return _cached_get_attn_backend(
        head_size,
        dtype,
        kv_cache_dtype,
        block_size,
        bool(use_mla),
        bool(has_sink),
        bool(use_sparse),
        features=(attn_type, bool(use_sliding_window), bool(use_logits_soft_cap), bool(use_alibi),
                  bool(use_mask_mod), bool(use_score_mod)),
        mla_dims=tuple(mla_dims) if mla_dims is not None else None,
        forced_backend=get_global_forced_attn_backend(),
        env_backend=_env_backend(),
        platform=current_platform,
        generation=registry_generation(),
    )


def _env_backend() -> str | None:
    name = envs.VATTN_ATTENTION_BACKEND
    if name is None and "VLLM_ATTENTION_BACKEND" in os.environ:
        _hint_vllm_variable(os.environ["VLLM_ATTENTION_BACKEND"])
    return name


def _not_implemented(backend: AttentionBackendEnum) -> bool:
    """A named vattn backend whose module this version lacks (an unregistered ``CUSTOM`` is not
    one: it is an empty slot, and ``get_class`` says it must be registered)."""
    return bool(backend.value) and not backend.is_implemented()


def _reasons_against(
    backend: AttentionBackendEnum, config: tuple, features: tuple, mla_dims: tuple | None = None
) -> tuple[type[AttentionBackend] | None, list[str]]:
    """Import ``backend`` and ask it why it cannot serve ``config`` (empty list: it can)."""
    try:
        cls = backend.get_class()
    except (ImportError, ValueError) as e:
        return None, [str(e)]
    if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
        return None, [
            f"{cls!r} is not a subclass of vattn.core.interface.AttentionBackend; "
            "register a class that derives from it"
        ]
    try:
        reasons = list(cls.validate_configuration(*config))
    except ImportError as e:  # e.g. is_available() probing a missing library
        return None, [f"unavailable: {e}"]
    attn_type, window, soft_cap, alibi, mask_mod, score_mod = features
    mods = {k: True for k, on in (("use_mask_mod", mask_mod), ("use_score_mod", score_mod)) if on}
    reasons += cls.feature_reasons(attn_type, use_sliding_window=window, use_logits_soft_cap=soft_cap,
                                   use_alibi=alibi, **mods)  # mods only when asked: older overrides lack them
    if mla_dims is not None and hasattr(cls, "mla_dims_reasons"):
        reasons += cls.mla_dims_reasons(*mla_dims)
    return cls, reasons


def _describe(config: tuple, features: tuple) -> str:
    head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink, use_sparse = config
    attn_type, window, soft_cap, alibi, mask_mod, score_mod = features
    extra = "".join(f", {name}=True" for name, on in (("use_sliding_window", window),
                                                      ("use_logits_soft_cap", soft_cap), ("use_alibi", alibi),
                                                      ("use_mask_mod", mask_mod), ("use_score_mod", score_mod)) if on)
    if attn_type != AttentionType.DECODER:
        extra += f", attn_type={attn_type!r}"
    return (
        f"head_size={head_size}, dtype={dtype}, kv_cache_dtype={kv_cache_dtype!r}, "
        f"block_size={block_size}, use_mla={use_mla}, has_sink={has_sink}, use_sparse={use_sparse}{extra}"
    )


@functools.lru_cache(maxsize=None)
def _cached_get_attn_backend(head_size: int, dtype: torch.dtype, kv_cache_dtype: str | None, block_size: int,
                             use_mla: bool, has_sink: bool, use_sparse: bool, *,
                             features: tuple[str, bool, bool, bool, bool, bool],
                             mla_dims: tuple[int, int, int, int] | None = None,
                             forced_backend: AttentionBackendEnum | None, env_backend: str | None, platform: Platform,
                             generation: int) -> type[AttentionBackend]:
    config = (head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink, use_sparse)

    selected, source = None, ""
    if forced_backend is not None:
        selected, source = forced_backend, "global_force_attn_backend"
    elif env_backend is not None:
        selected, source = _env_name_to_enum(env_backend), f"{STR_BACKEND_ENV_VAR}={env_backend!r}"

    if selected is not None:
        if _not_implemented(selected):
            implemented = [m.name for m in AttentionBackendEnum
                           if m.is_implemented() and m is not AttentionBackendEnum.NO_ATTENTION]
            raise ValueError(
                f"attention backend {selected.name} (forced by {source}) is not implemented in "
                f"{vattn_version()}. Implemented backends: {', '.join(implemented)}. Force one of "
                f"these, register your own with vattn.register_backend(AttentionBackendEnum."
                f"{selected.name}, 'your.module.YourBackend'), or remove the override for automatic "
                "selection."
            )
        cls, reasons = _reasons_against(selected, config, features, mla_dims)
        if reasons or cls is None:
            raise ValueError(
                f"attention backend {selected.name} (forced by {source}) cannot serve "
                f"{_describe(config, features)}: {'; '.join(reasons)}. Force another backend or remove the "
                "override for automatic selection."
            )
        logger.info("Using attention backend %s (forced by %s).", selected.name, source)
        return cls

    candidates = list(platform.get_attn_backend_priority(*config))
    if features[4] or features[5]:  # mask_mod / score_mod
        candidates += [b for b in MOD_BACKENDS if b not in candidates]
    rejected: list[str] = []
    missing: list[str] = []
    for backend in candidates:
        if _not_implemented(backend):
            missing.append(backend.name)
            continue
        cls, reasons = _reasons_against(backend, config, features, mla_dims)
        if cls is not None and not reasons:
            logger.info("Using attention backend %s on %s.", backend.name, platform.device_type)
            return cls
        rejected.append(f"  {backend.name}: {'; '.join(reasons)}")
    groups = []
    if rejected:
        groups.append("Candidates that cannot serve here, and why:\n" + "\n".join(rejected))
    if missing:
        groups.append(f"Candidates not implemented in {vattn_version()}: {', '.join(missing)}")
    listing = "\n".join(groups) or "(the platform lists no candidates)"
    raise ValueError(
        f"no attention backend on {platform.device_type} can serve {_describe(config, features)}.\n"
        f"{listing}\n"
        f"Change the configuration, install a backend's library, or register a backend with "
        f"vattn.register_backend(AttentionBackendEnum.CUSTOM) and force it with "
        f"{STR_BACKEND_ENV_VAR}=CUSTOM."
    )

"""vattn: vLLM-grade paged attention as a drop-in ``nn.Module``.

Importing vattn registers the ``torch.ops.vattn`` ops; it imports no optional kernel
library and no ``torch._inductor`` internals (``vattn.compile`` and
``vattn.CUDAGraphRunner`` load their modules on first use).
"""

from __future__ import annotations

from typing import Any

from vattn.backends.abstract import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadata,
    AttentionType,
)
from vattn.backends.registry import AttentionBackendEnum, MambaAttentionBackendEnum, register_backend
from vattn.backends.utils import AttentionMetadataBuilder, AttentionSpec, CommonAttentionMetadata
from vattn.config import (
    CacheConfig,
    CompilationConfig,
    CUDAGraphMode,
    VattnConfig,
    get_current_vattn_config,
    set_current_vattn_config,
)
from vattn.forward_context import ForwardContext, get_forward_context, set_forward_context
from vattn.kv_cache import PagedKVCache, allocate_kv_cache, bind_kv_cache, build_common_attn_metadata
from vattn.layer import Attention
from vattn.selector import (
    backend_name_to_enum,
    get_attn_backend,
    global_force_attn_backend,
    global_force_attn_backend_context_manager,
)

__version__ = "0.1.0"

__all__ = [
    "Attention",
    "AttentionBackend",
    "AttentionBackendEnum",
    "AttentionCGSupport",
    "AttentionImpl",
    "AttentionMetadata",
    "AttentionMetadataBuilder",
    "AttentionSpec",
    "AttentionType",
    "CUDAGraphMode",
    "CUDAGraphRunner",
    "CacheConfig",
    "CommonAttentionMetadata",
    "CompilationConfig",
    "ForwardContext",
    "MambaAttentionBackendEnum",
    "PagedKVCache",
    "VattnConfig",
    "allocate_kv_cache",
    "backend_name_to_enum",
    "bind_kv_cache",
    "build_common_attn_metadata",
    "compile",
    "get_attn_backend",
    "get_current_vattn_config",
    "get_forward_context",
    "global_force_attn_backend",
    "global_force_attn_backend_context_manager",
    "register_backend",
    "set_current_vattn_config",
    "set_forward_context",
]

_LAZY = {
    "compile": ("vattn.compile_passes.backend", "compile"),
    "CUDAGraphRunner": ("vattn.cudagraph", "CUDAGraphRunner"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'vattn' has no attribute {name!r}")

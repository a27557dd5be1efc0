"""vattn: vLLM-grade paged attention as a drop-in ``nn.Module``.

Importing vattn registers the ``torch.ops.vattn`` ops; it imports no optional kernel
library and no ``torch._inductor`` internals (``vattn.compile`` and
``vattn.CUDAGraphRunner`` load their modules on first use).
"""

from __future__ import annotations

from typing import Any

import torch

from vattn._compat import check_torch

check_torch(torch.__version__)

from vattn._version import __version__  # noqa: E402
from vattn.core.capabilities import Capabilities
from vattn.core.config import (
    CacheConfig,
    CompilationConfig,
    CUDAGraphMode,
    VattnConfig,
    get_current_vattn_config,
    set_current_vattn_config,
)
from vattn.core.enums import AttentionCGSupport, AttentionType
from vattn.core.interface import AttentionBackend, AttentionImpl, AttentionMetadataBuilder
from vattn.core.layout import get_kv_cache_layout, set_kv_cache_layout
from vattn.core.metadata import AttentionMetadata, AttentionSpec, CommonAttentionMetadata
from vattn.core.registry import AttentionBackendEnum, MambaAttentionBackendEnum, register_backend
from vattn.backends.utils import (
    PerLayerParameters,
    get_per_layer_parameters,
    infer_global_hyperparameters,
    make_local_attention_virtual_batches,
    split_decodes_and_prefills,
)
from vattn.forward_context import ForwardContext, get_forward_context, set_forward_context
from vattn.input_batch import InputBatch
from vattn.kv_cache import PagedKVCache, allocate_kv_cache, bind_kv_cache
from vattn.metadata import build_common_attn_metadata
from vattn.layer import Attention
from vattn.mla_layer import MLAAttention
from vattn.mixers import (
    GatedDeltaNet,
    LinearAttention,
    MambaBase,
    Mamba1Mixer,
    Mamba2Mixer,
    ShortConv,
    get_mamba_backend,
)
from vattn.platform import current_platform
from vattn.selector import (
    backend_name_to_enum,
    get_attn_backend,
    get_env_variable_attn_backend,
    get_global_forced_attn_backend,
    global_force_attn_backend,
    global_force_attn_backend_context_manager,
)


__all__ = [
    "allocate_kv_cache",
    "Attention",
    "AttentionBackend",
    "AttentionBackendEnum",
    "AttentionCGSupport",
    "AttentionImpl",
    "AttentionMetadata",
    "AttentionMetadataBuilder",
    "AttentionSpec",
    "AttentionType",
    "backend_name_to_enum",
    "bind_kv_cache",
    "build_common_attn_metadata",
    "CacheConfig",
    "Capabilities",
    "CommonAttentionMetadata",
    "CompilationConfig",
    "compile",
    "CUDAGraphMode",
    "CUDAGraphRunner",
    "current_platform",
    "flex_mods",
    "ForwardContext",
    "get_attn_backend",
    "get_current_vattn_config",
    "get_env_variable_attn_backend",
    "get_forward_context",
    "get_global_forced_attn_backend",
    "get_kv_cache_layout",
    "get_per_layer_parameters",
    "GraphInput",
    "global_force_attn_backend",
    "global_force_attn_backend_context_manager",
    "infer_global_hyperparameters",
    "make_local_attention_virtual_batches",
    "MambaAttentionBackendEnum",
    "MambaBase",
    "Mamba1Mixer",
    "Mamba2Mixer",
    "GatedDeltaNet",
    "get_mamba_backend",
    "LinearAttention",
    "ShortConv",
    "MLAAttention",
    "PagedKVCache",
    "PerLayerParameters",
    "register_backend",
    "set_current_vattn_config",
    "set_forward_context",
    "set_kv_cache_layout",
    "split_decodes_and_prefills",
    "VattnConfig",
    "InputBatch",
]

#: Loaded on first use (name -> (module, attribute; None: the module itself)).
_LAZY: dict[str, tuple[str, str | None]] = {
    "compile": ("vattn.compile_passes.compiler", "compile"),
    "CUDAGraphRunner": ("vattn.cudagraph", "CUDAGraphRunner"),
    "GraphInput": ("vattn.cudagraph", "GraphInput"),
    "flex_mods": ("vattn.backends.flex_attention.mods", None),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        loaded = importlib.import_module(module)
        return loaded if attr is None else getattr(loaded, attr)
    raise AttributeError(f"module 'vattn' has no attribute {name!r}")

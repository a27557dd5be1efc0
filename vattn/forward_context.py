"""The forward context: how per-step metadata reaches the attention ops.

Metadata is not a graph input: the opaque attention op looks its layer's metadata up
here, so Dynamo never guards on it and one compiled graph serves every batch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

from vattn import envs
from vattn.config import VattnConfig, get_current_vattn_config

if TYPE_CHECKING:
    from vattn.backends.abstract import AttentionMetadata
    from vattn.layer import Attention

__all__ = ["ForwardContext", "get_forward_context", "set_forward_context", "is_forward_context_available"]


@dataclass
class ForwardContext:
    """What the attention ops read during one forward step.

    Args:
        no_compile_layers: layer name -> ``vattn.Attention`` (the config's static forward context).
        attn_metadata: one metadata for every layer, a dict layer name -> metadata, or
            ``None`` for a warm-up / profile run (the cache is left untouched).
        virtual_engine: index into each layer's ``kv_cache`` list (pipeline stage).
        batch_descriptor: set by the CUDA-graph runner (the padded size being replayed).
        debug_checks: ``VATTN_DEBUG_CHECKS`` when the context was set (read once per step).
    """

    no_compile_layers: dict[str, "Attention"]
    attn_metadata: "AttentionMetadata | dict[str, AttentionMetadata] | None"
    virtual_engine: int = 0
    batch_descriptor: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    debug_checks: bool = False

    def metadata_for(self, layer_name: str) -> "AttentionMetadata | None":
        """The metadata of ``layer_name``; a clear error when a per-layer dict lacks it."""
        md = self.attn_metadata
        if isinstance(md, dict):
            try:
                return md[layer_name]
            except KeyError:
                known = sorted(md)[:8]
                raise KeyError(
                    f"no attention metadata for layer {layer_name!r} in the forward context "
                    f"(it has {len(md)} layers, e.g. {known}); pass metadata for every layer, "
                    "or one metadata object for all of them, to set_forward_context."
                ) from None
        return md

    def layer(self, layer_name: str) -> "Attention":
        try:
            return self.no_compile_layers[layer_name]
        except KeyError:
            raise KeyError(
                f"attention layer {layer_name!r} is not registered in the forward context's config; "
                "build the model inside vattn.set_current_vattn_config(cfg) and pass the same cfg "
                "to set_forward_context."
            ) from None


_forward_context: list[ForwardContext] = []


def is_forward_context_available() -> bool:
    return bool(_forward_context)


def get_forward_context() -> ForwardContext:
    """The innermost forward context; raises if none is set."""
    if not _forward_context:
        raise RuntimeError(
            "no vattn forward context is set: run the model inside "
            "`with vattn.set_forward_context(attn_metadata, vattn_config):` "
            "(attn_metadata=None for a warm-up run)."
        )
    return _forward_context[-1]


@contextlib.contextmanager
def set_forward_context(
    attn_metadata: "AttentionMetadata | dict[str, AttentionMetadata] | None",
    vattn_config: VattnConfig | None = None,
    *,
    virtual_engine: int = 0,
    batch_descriptor: Any = None,
) -> Iterator[ForwardContext]:
    """Set the metadata the attention ops see inside the block; restores the previous context on exit.

    Args:
        attn_metadata: built by each group's ``AttentionMetadataBuilder.build``; a dict maps
            layer names to metadata; ``None`` means a warm-up run (cache untouched, zeros out).
        vattn_config: the config the model was built under (default: the current one).
    """
    config = vattn_config if vattn_config is not None else get_current_vattn_config()
    ctx = ForwardContext(
        no_compile_layers=config.compilation.static_forward_context,
        attn_metadata=attn_metadata,
        virtual_engine=virtual_engine,
        batch_descriptor=batch_descriptor,
        debug_checks=envs.VATTN_DEBUG_CHECKS,
    )
    _forward_context.append(ctx)
    try:
        yield ctx
    finally:
        _forward_context.pop()

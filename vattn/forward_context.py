"""The forward context: how per-step metadata reaches the attention ops.

Metadata is not a graph input: the opaque attention op looks its layer's metadata up
here, so Dynamo never guards on it and one compiled graph serves every batch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

from vattn import envs
from vattn.core.config import VattnConfig, get_current_vattn_config

if TYPE_CHECKING:
    from vattn.core.metadata import AttentionMetadata
    from vattn.core.interface import AttentionLayerBase as Attention

__all__ = ["ForwardContext", "get_forward_context", "set_forward_context", "is_forward_context_available"]


@dataclass
class ForwardContext:
    """What the attention ops read during one forward step.

    Args:
        no_compile_layers: layer name -> ``vattn.Attention`` (the config's static forward context).
        attn_metadata: one metadata for every layer, a dict layer name -> metadata, or
            ``None`` for a warm-up / profile run (``dummy_run``: the cache is left untouched).
        batch_descriptor: set by the CUDA-graph runner (the padded size being replayed).
        debug_checks: ``VATTN_DEBUG_CHECKS`` when the context was set (read once per step).
        dummy_run: a warm-up / profile run: layers without metadata return zeros and write
            nothing (without it, a layer that finds no metadata raises).
    """

    no_compile_layers: dict[str, "Attention"]
    attn_metadata: "AttentionMetadata | dict[str, AttentionMetadata] | None"
    batch_descriptor: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    debug_checks: bool = False
    dummy_run: bool = False

    def check_dummy_run(self, layer_name: str) -> None:
        """Raise ``ValueError`` unless this context is a warm-up run (``dummy_run``): a layer
        called without metadata would return zeros, which a real step must never take for output."""
        if not self.dummy_run:
            raise ValueError(
                f"{layer_name}: attn_metadata: expected the step's metadata (kv.build_metadata(common)), got None "
                "outside a warm-up run: the layer would write nothing and return zeros; pass the step's metadata to "
                "vattn.set_forward_context, or mark a warm-up / profile run explicitly with "
                "vattn.set_forward_context(None, cfg, dummy_run=True)."
            )

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
            "`with vattn.set_forward_context(kv.build_metadata(common), vattn_config):` "
            "(set_forward_context(None, vattn_config, dummy_run=True) for a warm-up run that writes nothing)."
        )
    return _forward_context[-1]


@contextlib.contextmanager
def set_forward_context(
    attn_metadata: "AttentionMetadata | dict[str, AttentionMetadata] | None",
    vattn_config: VattnConfig | None = None,
    *,
    batch_descriptor: Any = None,
    dummy_run: bool = False,
) -> Iterator[ForwardContext]:
    """Set the metadata the attention ops see inside the block; restores the previous context on exit.

    Args:
        attn_metadata: built by each group's ``AttentionMetadataBuilder.build``; a dict maps
            layer names to metadata; ``None`` only with ``dummy_run=True``.
        vattn_config: the config the model was built under (default: the current one).
        dummy_run: a warm-up / profile run (vLLM's name): attention layers without metadata
            leave the cache untouched and return zeros. Without it such a layer raises
            ``ValueError`` naming ``attn_metadata``, so a forgotten metadata never turns into
            zeros that look like output.
    """
    config = vattn_config if vattn_config is not None else get_current_vattn_config()
    ctx = ForwardContext(
        no_compile_layers=config.compilation.static_forward_context,
        attn_metadata=attn_metadata,
        batch_descriptor=batch_descriptor,
        debug_checks=envs.VATTN_DEBUG_CHECKS,
        dummy_run=bool(dummy_run),
    )
    _forward_context.append(ctx)
    try:
        yield ctx
    finally:
        _forward_context.pop()

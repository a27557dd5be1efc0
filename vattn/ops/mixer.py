"""The mixer op: ``vattn::mixer_with_output``, one opaque op for every Mamba-family layer.

Like the attention ops it looks its layer up by name in the forward context and runs the layer's
backend impl, which reads and updates the layer's state slots; to ``torch.compile`` it is opaque
(only the fake is traced) and ``vattn.compile`` splits the graph at it. ``inputs`` are the layer's
per-token tensors and weights in the order its entry documents; ``part`` selects the entry of a
layer with two (Mamba1: 0 = conv, 1 = scan).
"""

from __future__ import annotations

from typing import Optional

import torch

from vattn.forward_context import get_forward_context
from vattn.ops.library import register_op

__all__ = ["mixer_with_output", "run_mixer"]


def run_mixer(inputs: list[Optional[torch.Tensor]], output: torch.Tensor, layer_name: str, part: int = 0) -> None:
    """Run mixer layer ``layer_name``'s step for ``inputs`` into ``output`` (the op's implementation)."""
    from vattn.core.mamba import MambaMetadata

    ctx = get_forward_context()
    layer = ctx.layer(layer_name)
    md = ctx.metadata_for(layer_name)
    if md is None:  # a warm-up / profile run: state untouched, zeros out
        ctx.check_dummy_run(layer_name)
        output.zero_()
        return
    if not isinstance(md, MambaMetadata):
        raise TypeError(
            f"{layer_name}: expected the mixer metadata kv.build_metadata(common) gives this layer, got "
            f"{type(md).__name__}; pass the dict kv.build_metadata returns to vattn.set_forward_context (one "
            "attention metadata object cannot serve a model with mixer layers)."
        )
    state = layer.kv_cache[0]
    if not isinstance(state, tuple):
        raise RuntimeError(
            f"{layer_name}: no state is bound to this mixer layer; allocate it with vattn.allocate_kv_cache(cfg, ...) "
            "for the config the model was built under."
        )
    layer.impl.forward(layer, inputs, output, state, md, part)


def mixer_with_output(inputs: list[Optional[torch.Tensor]], output: torch.Tensor, layer_name: str,
                      part: int = 0) -> None:
    """Mixer layer ``layer_name``'s step: reads and updates its state slots, writes ``output``."""
    run_mixer(inputs, output, layer_name, part)


def _mixer_with_output_fake(inputs: list[Optional[torch.Tensor]], output: torch.Tensor, layer_name: str,
                            part: int = 0) -> None:
    return None


register_op("mixer_with_output", mixer_with_output, mutates_args=["output"], fake_impl=_mixer_with_output_fake)

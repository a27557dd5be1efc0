"""How ``VattnBackend`` calls Inductor on a piece: config patches and shape-guard handling.

Global Inductor config is never changed: every setting is a patch of one ``compile_fx`` call.
The patches, in order of precedence (later wins):

1. vattn's defaults: programmatic dependent launch on sm_90+ GPUs (``pdl_default``) and combo
   kernels on CUDA GPUs (``combo_default``), plus the caller's (e.g. coordinate-descent tuning
   for exact-size compiles);
2. ``CompilationConfig.inductor_compile_config``;
3. always: vattn's post-grad pass manager as ``post_grad_custom_post_pass``, and Inductor's own
   CUDA graphs off (``vattn.CUDAGraphRunner`` captures graphs itself).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx

from vattn.core.config import CompilationConfig
from vattn.kernels.launch import pdl_supported

__all__ = ["combo_default", "compile_with_inductor", "on_pdl_device", "pdl_default", "shape_guards_suppressed"]


def on_pdl_device(args: Sequence[Any]) -> bool:
    """Whether the piece's tensors all live on one device with programmatic dependent launch."""
    devices = {a.device for a in args if isinstance(a, torch.Tensor)}
    return len(devices) == 1 and pdl_supported(devices.pop())


def pdl_default(args: Sequence[Any]) -> dict[str, Any]:
    """Inductor config that turns on its programmatic dependent launch (``triton.enable_pdl``)
    for a piece on an sm_90+ GPU (``CompilationConfig.inductor_compile_config`` overrides it).

    Each kernel then lets the next one launch before it finishes and waits for the one before
    it only at its first dependent access, so the launch gap between back-to-back kernels is
    hidden inside CUDA graphs. Launched eagerly, a PDL launch costs the host a little more: a
    model run without CUDA graphs may pass ``{"triton.enable_pdl": False}``.
    """
    if hasattr(torch._inductor.config.triton, "enable_pdl") and on_pdl_device(args):
        return {"triton.enable_pdl": True}
    return {}


def combo_default(args: Sequence[Any]) -> dict[str, Any]:
    """Inductor config that turns on its combo kernels (``combo_kernels``) for a piece on a CUDA
    GPU (``CompilationConfig.inductor_compile_config`` overrides it).

    Kernels of a piece that do not depend on each other then run as one launch: in a decoder
    layer, RoPE of the queries and RoPE of the keys (transformers rotates them in two
    expressions, which Inductor otherwise compiles into two small kernels, each paying a launch).
    """
    devices = {a.device.type for a in args if isinstance(a, torch.Tensor)}
    if devices == {"cuda"} and hasattr(torch._inductor.config, "combo_kernels"):
        return {"combo_kernels": True}
    return {}


def shape_guards_suppressed(example_inputs: Sequence[Any], suppress: bool) -> Any:
    """With backed token symbols: keep Inductor's lowering of a piece (which asks e.g.
    whether the token count is 1 while computing view strides) from guarding the whole
    model on the answer; its general-size code stays valid for every size."""
    from torch._guards import detect_fake_mode

    shape_env = getattr(detect_fake_mode(example_inputs), "shape_env", None)
    return shape_env.suppress_guards() if suppress and shape_env is not None else contextlib.nullcontext()


def compile_with_inductor(
    graph: fx.GraphModule,
    example_inputs: Sequence[Any],
    compilation: CompilationConfig,
    post_grad_pass: Any,
    defaults: Mapping[str, Any] | None = None,
) -> Callable[..., Any]:
    """``compile_fx`` of one piece with the patches in the module docstring."""
    from torch._inductor.compile_fx import compile_fx

    patches = {**pdl_default(example_inputs), **combo_default(example_inputs), **(defaults or {}),
               **compilation.inductor_compile_config,
               "post_grad_custom_post_pass": post_grad_pass, "triton.cudagraphs": False}
    return compile_fx(graph, list(example_inputs), config_patches=patches)

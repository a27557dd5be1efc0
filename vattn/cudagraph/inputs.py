"""The tensor inputs of a graphed step function: ``GraphInput`` and the persistent buffers.

A CUDA graph reads its inputs at the addresses it was captured with, so ``CUDAGraphRunner``
copies each call's tensors into buffers allocated once for the largest capture size. Every
input is *token-major*: one dimension (``token_dim``) is the step's token count T, the others
(``shape``) are fixed. The buffer of an input holds ``prod(shape) * max_tokens`` elements; the
view for a capture size n is the contiguous tensor of shape
``shape[:token_dim] + (n,) + shape[token_dim:]`` at the buffer's start, so every size's view
has the same address and the layout an eager call would pass.

======================  ===============================================  =====================
step input              ``GraphInput``                                    tensor of a T-token call
======================  ===============================================  =====================
token ids               ``GraphInput(torch.long, name="input_ids")``      (T,) int64
positions               ``GraphInput(torch.long, name="positions")``      (T,) int64
inputs_embeds           ``GraphInput(torch.bfloat16, (hidden,))``         (T, hidden) bf16
M-RoPE positions        ``GraphInput(torch.long, (3,), token_dim=1)``     (3, T) int64
======================  ===============================================  =====================
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import torch

from vattn.core.metadata import CommonAttentionMetadata

__all__ = ["DEFAULT_INPUTS", "GraphInput", "InputBuffers", "check_inputs", "resolve_inputs", "split_call_args"]


@dataclasses.dataclass(frozen=True)
class GraphInput:
    """One token-major tensor input of the step function a ``CUDAGraphRunner`` graphs.

    A call with T tokens passes a tensor of dtype ``dtype`` and shape
    ``shape[:token_dim] + (T,) + shape[token_dim:]``; padded tokens of a replay read zeros.

    Args:
        dtype: the tensor's dtype (checked exactly: the runner never casts).
        shape: the sizes of the non-token dimensions, e.g. ``(hidden,)`` for
            ``inputs_embeds`` (T, hidden), ``(3,)`` for M-RoPE positions (3, T).
        token_dim: the token dimension's index in the full shape (0 ... ``len(shape)``;
            negative counts from the end, so -1 is the last); stored non-negative.
        name: the argument's name in error messages (default: ``input <i>``).
    """

    dtype: torch.dtype
    shape: tuple[int, ...] = ()
    token_dim: int = 0
    name: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"GraphInput: dtype must be a torch.dtype (e.g. torch.long), got {self.dtype!r}.")
        shape = tuple(self.shape) if isinstance(self.shape, (tuple, list, torch.Size)) else None
        if shape is None or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in shape):
            raise ValueError(
                f"GraphInput: shape must be the positive sizes of the non-token dimensions, e.g. (hidden,) "
                f"or () for a (T,) tensor; got {self.shape!r}."
            )
        rank = len(shape) + 1
        if not isinstance(self.token_dim, int) or not -rank <= self.token_dim < rank:
            raise ValueError(
                f"GraphInput: token_dim must be in [{-rank}, {rank - 1}] for shape={shape} (a rank-{rank} "
                f"tensor with the token dimension inserted); got {self.token_dim!r}."
            )
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "token_dim", self.token_dim % rank)

    def full_shape(self, num_tokens: int) -> tuple[int, ...]:
        """The shape of this input for ``num_tokens`` tokens."""
        d = self.token_dim
        return (*self.shape[:d], num_tokens, *self.shape[d:])

    def describe(self) -> str:
        """The full shape with ``T`` for the token dimension, e.g. ``(3, T)``."""
        dims = [str(s) for s in self.shape]
        dims.insert(self.token_dim, "T")
        return f"({', '.join(dims)}{',' if len(dims) == 1 else ''})"

    def label(self, index: int) -> str:
        return self.name or f"input {index}"


#: ``(input_ids, positions)``: two int64 (T,) tensors, the signature of a decoder-only LM step.
DEFAULT_INPUTS = (GraphInput(torch.long, name="input_ids"), GraphInput(torch.long, name="positions"))


def resolve_inputs(inputs: Sequence[GraphInput] | None) -> tuple[GraphInput, ...]:
    """``inputs`` as a tuple, checked; ``DEFAULT_INPUTS`` for None."""
    if inputs is None:
        return DEFAULT_INPUTS
    if isinstance(inputs, GraphInput) or not isinstance(inputs, Sequence):
        raise TypeError(
            f"CUDAGraphRunner: inputs must be a sequence of vattn.GraphInput, one per tensor the step "
            f"function takes (e.g. [GraphInput(torch.long), GraphInput(torch.long)]); got {inputs!r}."
        )
    out = tuple(inputs)
    bad = [i for i, x in enumerate(out) if not isinstance(x, GraphInput)]
    if not out or bad:
        raise TypeError(
            f"CUDAGraphRunner: inputs must be a non-empty sequence of vattn.GraphInput; got {list(out)!r}"
            + (f" (item {bad[0]} is a {type(out[bad[0]]).__name__})." if bad else ".")
        )
    return out


def split_call_args(
    args: tuple[Any, ...], common: CommonAttentionMetadata | None
) -> tuple[tuple[Any, ...], CommonAttentionMetadata]:
    """``runner(*tensors, common)`` or ``runner(*tensors, common_attn_metadata=common)``."""
    if common is None:
        if not args or not isinstance(args[-1], CommonAttentionMetadata):
            got = type(args[-1]).__name__ if args else "no arguments"
            raise TypeError(
                "CUDAGraphRunner: call it as runner(*tensors, common_attn_metadata) with the step's "
                f"vattn.CommonAttentionMetadata last (or as keyword common_attn_metadata=); the last "
                f"positional argument is {got}."
            )
        return args[:-1], args[-1]
    if not isinstance(common, CommonAttentionMetadata):
        raise TypeError(
            f"CUDAGraphRunner: common_attn_metadata must be a vattn.CommonAttentionMetadata (e.g. from "
            f"kv.common_metadata(...)), got {type(common).__name__}."
        )
    return args, common


def check_inputs(
    inputs: Sequence[GraphInput], tensors: Sequence[Any], num_tokens: int, device: torch.device
) -> None:
    """Raise (TypeError / ValueError naming the input) unless ``tensors`` match ``inputs`` for
    ``num_tokens`` tokens (``common_attn_metadata.num_actual_tokens``) on ``device``."""
    if len(tensors) != len(inputs):
        names = ", ".join(spec.label(i) for i, spec in enumerate(inputs))
        raise TypeError(
            f"CUDAGraphRunner: got {len(tensors)} tensor(s) before common_attn_metadata, expected "
            f"{len(inputs)} ({names}) as the runner's inputs= describes; pass one tensor per GraphInput "
            "in that order, or construct the runner with inputs= matching the step function."
        )
    for i, (spec, x) in enumerate(zip(inputs, tensors)):
        where = f"CUDAGraphRunner: {spec.label(i)}"
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{where} must be a torch.Tensor of shape {spec.describe()}, got {type(x).__name__}.")
        if x.dtype != spec.dtype:
            raise TypeError(
                f"{where} has dtype {x.dtype}, expected {spec.dtype} (GraphInput.dtype; the runner does not "
                f"cast); convert it with .to({spec.dtype}) or describe it with GraphInput({x.dtype}, ...)."
            )
        if x.dim() != len(spec.shape) + 1 or x.shape[: spec.token_dim] + x.shape[spec.token_dim + 1:] != spec.shape:
            raise ValueError(
                f"{where} has shape {tuple(x.shape)}, expected {spec.describe()} (GraphInput shape={spec.shape}, "
                f"token_dim={spec.token_dim}); pass a tensor of that shape or fix the runner's inputs=."
            )
        if x.shape[spec.token_dim] != num_tokens:
            raise ValueError(
                f"{where} has {x.shape[spec.token_dim]} tokens (dim {spec.token_dim} of {tuple(x.shape)}), but "
                f"common_attn_metadata.num_actual_tokens is {num_tokens}; they must agree (pass the "
                "unpadded batch: the runner pads)."
            )
        if x.device != device:
            raise ValueError(
                f"{where} is on {x.device}, the KV cache on {device}; move it with .to({str(device)!r})."
            )


class InputBuffers:
    """One persistent device buffer per ``GraphInput``, sized for ``max_tokens`` tokens."""

    def __init__(self, inputs: Sequence[GraphInput], max_tokens: int, device: torch.device) -> None:
        self.inputs = tuple(inputs)
        self.flat = [torch.zeros(math.prod(s.full_shape(max_tokens)), dtype=s.dtype, device=device)
                     for s in self.inputs]
        self._views: dict[int, tuple[torch.Tensor, ...]] = {}

    def views(self, n: int) -> tuple[torch.Tensor, ...]:
        """The contiguous views for ``n`` tokens, each at its buffer's start (cached per n)."""
        if n not in self._views:
            shapes = [s.full_shape(n) for s in self.inputs]
            self._views[n] = tuple(f[: math.prod(sh)].view(sh) for f, sh in zip(self.flat, shapes))
        return self._views[n]

    def load(self, tensors: Sequence[torch.Tensor], n: int) -> tuple[torch.Tensor, ...]:
        """Copy ``tensors`` (t <= n tokens each) into the views for ``n`` tokens, zero the padded
        tokens t..n, and return the views (device ops only)."""
        views = self.views(n)
        for spec, view, x in zip(self.inputs, views, tensors):
            d, t = spec.token_dim, x.shape[spec.token_dim]
            view.narrow(d, 0, t).copy_(x)
            if n > t:
                view.narrow(d, t, n - t).zero_()
        return views

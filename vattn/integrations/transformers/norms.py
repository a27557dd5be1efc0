"""RMSNorm modules of transformers models as one ``F.rms_norm`` call in eager inference.

A transformers RMSNorm runs six to nine tensor ops a call (upcast, square, mean, add, rsqrt,
multiply, downcast, weight), each a kernel launch and its host overhead; a decode step of a
16-layer model calls it 33 times. ``fuse_rms_norms`` gives every RMSNorm module whose
``forward`` is one of transformers' three forms a subclass that computes the same expression
around ``torch.nn.functional.rms_norm`` (which upcasts to float32 inside, as those forms do):

| form | transformers' forward (``n``: ``x`` in float32 times ``rsqrt(mean(x^2) + eps)``) | here |
| --- | --- | --- |
| llama (Llama, Mistral, Qwen2, Qwen3, Phi-3, ...) | ``weight * n.to(x.dtype)`` | ``weight * rms_norm(x)`` |
| weight first (OLMo-2, gpt-oss) | ``(weight * n).to(x.dtype)`` | ``rms_norm(x.float(), weight.float()).to(x.dtype)`` |
| gemma (Gemma, Gemma-2, Gemma-3) | ``(n * (1 + weight.float())).type_as(x)`` | ``rms_norm(x.float(), 1 + weight.float()).type_as(x)`` |

A module is matched by the syntax tree of its class's ``forward`` (and Gemma's ``_norm``), so a
form transformers changes, or a forward replaced by a hub kernel, is left alone. Under
``torch.compile`` (Inductor fuses the original ops, and vattn's passes match them), with
autograd on, or once the module's class is restored it runs transformers' own forward. The
module keeps its parameters, buffers and state dict; ``isinstance`` checks against the
transformers class still hold.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import logging
import textwrap
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from vattn.compile_passes.trace_state import saving_trace

__all__ = ["fuse_rms_norms", "norm_form"]

logger = logging.getLogger("vattn")

# The bodies of transformers' RMSNorm forwards (docstrings, comments and annotations aside).
_FORMS = {
    "llama": """
input_dtype = hidden_states.dtype
hidden_states = hidden_states.to(torch.float32)
variance = hidden_states.pow(2).mean(-1, keepdim=True)
hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
return self.weight * hidden_states.to(input_dtype)
""",
    "weight_first": """
input_dtype = hidden_states.dtype
hidden_states = hidden_states.to(torch.float32)
variance = hidden_states.pow(2).mean(-1, keepdim=True)
hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
return (self.weight * hidden_states).to(input_dtype)
""",
    "gemma": """
output = self._norm(x.float())
output = output * (1.0 + self.weight.float())
return output.type_as(x)
""",
}
_GEMMA_NORM = "return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)"


def _body_dump(source: str) -> list[str] | None:
    """The statements of a function's body (or of bare statements) as ``ast.dump`` strings,
    its docstring left out; None where the source does not parse."""
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return None
    body = tree.body
    if len(body) == 1 and isinstance(body[0], (ast.FunctionDef, ast.AsyncFunctionDef)):
        body = body[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        body = body[1:]  # the docstring
    return [ast.dump(s) for s in body]


_FORM_DUMPS = {name: _body_dump(src) for name, src in _FORMS.items()}


def _source(fn: Callable) -> str | None:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return None


@functools.lru_cache(maxsize=None)
def _class_form(cls: type) -> str | None:
    forward = getattr(cls, "forward", None)
    src = _source(forward) if forward is not None else None
    body = _body_dump(src) if src else None
    form = next((name for name, dump in _FORM_DUMPS.items() if body == dump), None)
    if form == "gemma":
        norm = _source(getattr(cls, "_norm", None)) or ""
        if _body_dump(norm) != _body_dump(_GEMMA_NORM):
            return None
    return form


def norm_form(module: nn.Module) -> str | None:
    """Which form of the table in the module docstring ``module`` computes ("llama",
    "weight_first", "gemma"), or None: not one of them (or not with the attributes it reads)."""
    form = _class_form(type(module))
    weight = getattr(module, "weight", None)
    eps = getattr(module, "eps" if form == "gemma" else "variance_epsilon", None)
    if form is None or not isinstance(weight, torch.Tensor) or weight.dim() != 1 or not isinstance(eps, (int, float)):
        return None
    return form


def _fused_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling() or torch.is_grad_enabled():
        return super(type(self), self).forward(hidden_states)  # transformers' own ops
    shape = (hidden_states.shape[-1],)
    form = self._vattn_norm_form
    if form == "llama":
        if hidden_states.dtype == torch.float64:  # transformers computes in float32; rms_norm would not
            return super(type(self), self).forward(hidden_states)
        return self.weight * F.rms_norm(hidden_states, shape, eps=self.variance_epsilon)
    if form == "weight_first":
        out = F.rms_norm(hidden_states.float(), shape, self.weight.float(), eps=self.variance_epsilon)
        return out.to(hidden_states.dtype)
    out = F.rms_norm(hidden_states.float(), shape, 1.0 + self.weight.float(), eps=self.eps)
    return out.type_as(hidden_states)


def _reduce_ex(self: nn.Module, protocol: int) -> tuple:
    """Pickle (``torch.save``, ``copy.deepcopy``) as the transformers class: the swap is not
    part of the model. While ``vattn.compile`` stores a trace, as itself: the trace's guards
    must name this class (found by name here, ``__getattr__``) to hold in a later process."""
    reduced = super(type(self), self).__reduce_ex__(protocol)
    if saving_trace.get():
        return reduced
    if isinstance(reduced, tuple) and len(reduced) >= 2 and reduced[1] and reduced[1][0] is type(self):
        reduced = (_new_instance, (self._vattn_unfused, *reduced[1][1:]), *reduced[2:])
    return reduced


def _new_instance(cls: type, *args: object) -> object:
    return cls.__new__(cls, *args)


#: The fused classes by their attribute name here: a class made at run time is found by name
#: (``__getattr__``), as pickle and a stored Dynamo trace's type guards look classes up.
_FUSED: dict[str, type] = {}


@functools.lru_cache(maxsize=None)
def _fused_class(cls: type, form: str) -> type:
    """``cls`` with the fused eager forward: one class per transformers class, found here by a
    name of its own, so that a stored trace's guard on it resolves to this class (not to the
    transformers one) in a new process. The module still prints under transformers' name."""
    digest = hashlib.sha256(f"{cls.__module__}.{cls.__qualname__}".encode()).hexdigest()[:12]
    key = f"_Fused{cls.__name__}_{form}_{digest}"
    fused = _FUSED[key] = type(key, (cls,), {
        "forward": _fused_forward, "__reduce_ex__": _reduce_ex, "_vattn_norm_form": form, "_vattn_unfused": cls,
        "__module__": __name__, "_get_name": lambda self: cls.__name__})
    return fused


def __getattr__(name: str) -> type:
    if name in _FUSED:
        return _FUSED[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def fuse_rms_norms(model: nn.Module) -> int:
    """Give every RMSNorm submodule of ``model`` in one of the forms of the module docstring the
    fused eager forward (its class becomes a subclass of its own); returns how many. Modules
    swapped already, or of another form, are left as they are."""
    n = 0
    for module in model.modules():
        if getattr(type(module), "_vattn_unfused", None) is not None:
            continue
        form = norm_form(module)
        if form is not None:
            module.__class__ = _fused_class(type(module), form)
            n += 1
    if n:
        logger.debug("fuse_rms_norms: %d RMSNorm modules run F.rms_norm in eager inference", n)
    return n

"""Calling a ``vattn.compile``d model's code without Dynamo's per-call work.

Every call of a ``torch.compile``d module goes through Dynamo's frame hook: it evaluates
the guards of the cached graph (every parameter, buffer and input) and then runs the code
Dynamo made of the model's ``forward`` (the *transformed bytecode*: it gathers the
parameters and calls the compiled graph). For a decode step whose GPU work is a few
CUDA-graph replays, that Python is a large part of the step's host time.

``DirectDispatch`` keeps the transformed bytecode (from Dynamo's bytecode hook, as vLLM
does) and calls it directly. Guards are still checked, once per *call signature*: the
inputs' types, dtypes, devices, shapes, strides, ``requires_grad``, inference-ness, the
values of plain Python arguments, and the default dtype and autocast state. A call with a
signature not seen before goes through Dynamo; if Dynamo reused the one graph it had
(no recompile), that signature is recorded and its later calls skip Dynamo. Once Dynamo
compiles a second graph (a guard failed), direct dispatch is switched off for good and
every call goes through Dynamo, as ``torch.compile`` alone would.

Calls under module hooks on the compiled module, or under a ``torch.compiler.set_stance``
other than "default", always go through Dynamo. What the per-signature check cannot see:
changes to the model's own Python state after the first call (an attribute ``forward``
branches on, parameters replaced by tensors of another shape). Dynamo would retrace for
those; with direct dispatch the old graph runs. Set ``VATTN_COMPILE_CHECK_GUARDS=1`` to
send every call through Dynamo, or build a new ``vattn.compile`` after such a change.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import logging
import types
from typing import Any, Callable, Iterator

import torch
from torch import nn

__all__ = ["DirectDispatch", "call_signature"]

logger = logging.getLogger("vattn.compile")

_owner: contextvars.ContextVar["DirectDispatch | None"] = contextvars.ContextVar("vattn_dispatch_owner", default=None)
_hook_handle: list[Any] = []


def _on_bytecode(old_code: types.CodeType, new_code: types.CodeType) -> None:
    owner = _owner.get()
    if owner is not None:
        owner._record(old_code, new_code)
    return None  # keep Dynamo's code


def _install_hook() -> bool:
    if not _hook_handle:
        register = getattr(getattr(torch._dynamo, "convert_frame", None), "register_bytecode_hook", None)
        if register is None:
            return False
        _hook_handle.append(register(_on_bytecode))
    return True


def _global_hooks() -> bool:
    has = getattr(nn.modules.module, "_has_any_global_hook", None)
    return bool(has()) if has is not None else False


def _stance() -> str:
    """``torch.compiler.set_stance``'s current stance ("default" where torch does not say)."""
    stance = getattr(getattr(torch._dynamo, "eval_frame", None), "_stance", None)
    return getattr(stance, "stance", "default")


def _arg_signature(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return (type(a), a.dtype, a.device, a.shape, a.stride(), a.requires_grad, a.is_inference())
    if a is None or type(a) in (bool, int, float, str):
        return (type(a), a)
    return (type(a), id(a))


def call_signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """What a call's guards depend on, outside the model (see the module docstring)."""
    return (
        tuple(map(_arg_signature, args)),
        tuple((k, _arg_signature(v)) for k, v in kwargs.items()) if kwargs else (),
        torch.get_default_dtype(),
        torch.is_autocast_enabled("cuda"),
        torch.is_autocast_enabled("cpu"),
    )


class DirectDispatch:
    """The transformed bytecode of one compiled module, and the call signatures it serves.

    Args:
        module: the module ``torch.compile`` traces (its ``forward`` is the converted frame).
        graphs_seen: returns how many graphs Dynamo has handed to the backend so far.
    """

    def __init__(self, module: nn.Module, graphs_seen: Callable[[], int]) -> None:
        self.module = module
        self.graphs_seen = graphs_seen
        self.fn: Callable[..., Any] | None = None
        self.validated: set[tuple[Any, ...]] = set()
        self.disabled = not _install_hook()
        # Frames Dynamo may convert for a module call, by code object: the function to take
        # the globals (where Dynamo stores the compiled graph) and closure from.
        self._frames: dict[types.CodeType, types.FunctionType] = {}
        for f in (type(module).forward, nn.Module._call_impl, nn.Module._wrapped_call_impl):
            f = inspect.unwrap(f)
            if isinstance(f, types.FunctionType):
                self._frames.setdefault(f.__code__, f)

    def use(self, fn: Callable[..., Any]) -> None:
        """Dispatch to ``fn(module, *args, **kwargs)`` (a stored trace's function)."""
        self.fn = fn

    def lookup(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Callable[..., Any] | None, Any]:
        """(the code to call directly or None, the call's signature)."""
        m = self.module
        if self.fn is None or self.disabled or m._forward_pre_hooks or m._forward_hooks or _global_hooks():
            return None, None  # module hooks run in Module.__call__, around the converted frame
        if _stance() != "default":
            return None, None  # torch.compiler.set_stance("force_eager", ...): Dynamo decides
        key = call_signature(args, kwargs)
        return (self.fn if key in self.validated else None), key

    def validate(self, key: Any, graphs_before: int) -> None:
        """After a call went through Dynamo: serve ``key`` directly if no new graph was made."""
        if self.disabled or key is None or self.fn is None:
            return
        if self.graphs_seen() != graphs_before:
            self.disabled = True
            logger.info("vattn.compile: Dynamo compiled another graph; every call now goes through its guards.")
            return
        self.validated.add(key)

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Record the transformed bytecode of a Dynamo conversion inside the block."""
        token = _owner.set(self)
        try:
            yield
        finally:
            _owner.reset(token)

    def _record(self, old_code: types.CodeType, new_code: types.CodeType) -> None:
        if self.disabled:
            return
        f = self._frames.get(old_code)
        if f is None:
            return  # not the module's frame: an inner compiled function of the model
        if self.fn is not None:
            self.disabled = True  # a second conversion of the module: let Dynamo choose every time
            return
        self.fn = types.FunctionType(new_code, f.__globals__, f.__name__, f.__defaults__, f.__closure__)

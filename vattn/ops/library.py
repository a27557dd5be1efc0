"""The ``vattn::`` op library: one ``Library("vattn", "FRAGMENT")`` and its registration helper.

``register_op`` defines an op from its Python implementation's type hints, registers that
implementation for every device (``CompositeExplicitAutograd``: opaque to autograd and
Dynamo) and its fake right after it. No decorator machinery sits on the call path.

The road of one attention call is layer -> ``torch.ops.vattn.*`` (dispatcher) -> the op's
Python implementation (``vattn.ops.attention.run_layer``: checks, output, K/V store) -> the
impl. Beside it run measured shortcuts, each skipping host work that cannot change the
result; this is their map (each lives where the work it skips is):

| shortcut | skips | applies when | where |
| --- | --- | --- | --- |
| ``eager_direct_ok`` | the dispatcher (layer -> op implementation) | eager calls, nothing tracing, no autograd recording | here; ``vattn.Attention.forward`` |
| ``python_impl`` / ``direct_op_call`` | ``nn.Module.__call__`` and the dispatcher between compiled pieces | ``vattn.compile``'s split graph, at run time | here; ``vattn.compile_passes.split`` |
| ``DirectDispatch`` | Dynamo's frame hook and guard evaluation | a compiled model called with a call signature seen before | ``vattn.compile_passes.dispatch`` |
| ``StepChecks`` memo | re-checking a batch against a cache | the same step and cache geometry again (every layer after the first) | ``vattn.core.batch_checks`` |
| ``FastLaunch`` | Triton's argument binding and specialization | vattn's own Triton launches | ``vattn.kernels.launch`` |
| ``LaunchPlan`` | everything but the launch itself | TRITON_ATTN layers after the first of an eager step (same shapes) | ``vattn.kernels.launch``; ``TritonAttentionImpl`` |

Each has a switch back to the road for debugging: ``VATTN_COMPILE_CHECK_GUARDS=1`` (Dynamo on
every call), ``VATTN_DEBUG_CHECKS=1`` (device checks of hand-built metadata).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch.library import Library, infer_schema

__all__ = ["eager_direct_ok", "python_impl", "register_op", "vattn_lib"]

vattn_lib = Library("vattn", "FRAGMENT")
_IMPLS: dict[str, Callable[..., object]] = {}


def register_op(
    name: str,
    impl: Callable[..., object],
    *,
    mutates_args: Sequence[str],
    fake_impl: Callable[..., object],
    dispatch_key: str = "CompositeExplicitAutograd",
    tags: tuple[torch.Tag, ...] = (),
) -> None:
    """Define ``vattn::<name>`` from ``impl``'s type hints, with its fake implementation.

    ``CompositeExplicitAutograd`` serves every device with one kernel and keeps the op opaque
    to autograd and Dynamo.
    """
    schema = infer_schema(impl, mutates_args=list(mutates_args))
    vattn_lib.define(name + schema, tags=tags)
    vattn_lib.impl(name, impl, dispatch_key)
    torch.library.register_fake(f"vattn::{name}", fake_impl, lib=vattn_lib)
    if dispatch_key == "CompositeExplicitAutograd":
        _IMPLS[f"vattn::{name}"] = impl


def python_impl(op: object) -> Callable[..., object] | None:
    """The Python function behind a ``vattn::`` op (``OpOverload`` or packet) that serves every
    device, or None. Calling it skips the dispatcher (a few microseconds a call): the
    compile backend does so for the attention ops between compiled pieces, at run time."""
    if isinstance(op, torch._ops.OpOverload):
        return _IMPLS.get(op._schema.name)
    if isinstance(op, torch._ops.OpOverloadPacket):
        return _IMPLS.get(op._qualified_op_name)
    return None


def eager_direct_ok(*tensors: torch.Tensor | None) -> bool:
    """Whether an eager layer call may run its op's Python implementation directly (skipping
    the dispatcher, a few microseconds a layer): not while anything traces the call (Dynamo,
    or a dispatch mode such as ``make_fx`` or ``FakeTensorMode``, which must see the opaque op)
    and not where autograd would record the implementation's ops (the op is opaque to it)."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return False
    return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))

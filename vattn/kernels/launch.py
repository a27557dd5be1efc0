"""Low-overhead launches of vattn's Triton kernels.

``kernel[grid](*args, **kwargs)`` costs tens of microseconds of host time in Triton 3.x:
it binds every argument, computes its specialization and a cache key, then looks the
compiled kernel up. For a decode step that runs attention eagerly between compiled pieces
(PIECEWISE CUDA graphs, or no graphs), with two or three launches a layer, that is most of
the step's host time.

``FastLaunch(kernel)[grid](*args, **kwargs)`` launches the same compiled kernel with the
same arguments. The first launch of a *specialization* goes through Triton (compiling if
needed) and keeps the ``CompiledKernel`` it returns; later launches with an equal
specialization key call that kernel directly. The key is at least as fine as Triton's own:

| argument | key part |
| --- | --- |
| constexpr | its value |
| tensor | dtype, data pointer divisible by 16 |
| int (not bool) | <= 1: its value; else divisible by 16, fits int32, fits int64 |
| bool, float, None | its type (bools: the value) |
| launch options (``num_warps``, ...) | name and value |

so a kernel is never reused for arguments Triton would have compiled differently. Cached
launches call the kernel's launcher directly, as ``CompiledKernel[grid](...)`` does, but
without launch metadata or hooks when no launch hook is registered (Triton's hook chains
are then empty; with a hook set, e.g. by a profiler, launches go through
``CompiledKernel[grid]`` and call it). Kernels compiled for programmatic dependent launch
(``launch_pdl=True``) are launched with it only while a CUDA graph is being captured: eagerly
it costs the host more than it saves on the device. Triton's check that the kernel's global
values did not change is skipped (vattn never rebinds the globals its kernels read). Under
``TRITON_INTERPRET=1`` (CPU) the wrapper is a plain pass-through.

``record_launches`` and ``LaunchPlan`` go one step further for callers that repeat the same
launches with other tensors (the layers of one step): the launches of one call are recorded
and repeated with the next call's tensors, with no key and no argument binding. A plan passes
pointers as integers: Triton's launcher then neither calls ``data_ptr`` nor asks the driver
about each pointer (``cuPointerGetAttribute``), a large share of a launch's host time.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import os
import weakref
from typing import Any, Callable, Iterator, Sequence

import torch

__all__ = ["FastLaunch", "LaunchPlan", "next_power_of_2", "pdl_supported", "record_launches", "set_fast_launch"]

#: Every FastLaunch made, so ``set_fast_launch`` can switch them all.
_LAUNCHERS: "weakref.WeakSet[FastLaunch]" = weakref.WeakSet()
#: Inside ``record_launches``: the launches made so far (None: one that cannot be replayed).
_recording: contextvars.ContextVar["list[Any] | None"] = contextvars.ContextVar("vattn_launches", default=None)


def set_fast_launch(enabled: bool) -> None:
    """Switch every ``FastLaunch`` between its cache (True) and Triton's own launch path
    (False); ``VATTN_TRITON_FAST_LAUNCH=0`` starts them switched off. Launchers that cannot
    use the cache (the interpreter) stay off."""
    for launcher in _LAUNCHERS:
        launcher.enabled = enabled and launcher.supported


@functools.lru_cache(maxsize=None)
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` can use programmatic dependent launch (CUDA, sm_90+).

    A kernel launched with it (``launch_pdl=True``) may start while the previous kernel
    runs; it must call ``gdc_wait()`` before reading anything that kernel may write and
    before writing anything. ``gdc_launch_dependents()`` lets the next such kernel start.
    """
    if device.type != "cuda":
        return False
    return _sm90(device.index if device.index is not None else torch.cuda.current_device())


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (``triton.next_power_of_2`` without its overhead)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


_I32 = 2**31


def _arg_key(a: Any) -> Any:
    """The key part of one runtime (non-constexpr) argument (the general case of ``_runtime_key``)."""
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() & 15 == 0)
    if isinstance(a, bool):
        return ("b", a)
    if isinstance(a, int):
        return a if a <= 1 else ("i", a & 15 == 0, a < _I32, a < 2**63)
    if isinstance(a, float):
        return "f"
    return ("v", type(a), a)  # anything else: by value (must be hashable)


def _runtime_key(args: tuple[Any, ...]) -> list[Any]:
    """Key parts of the runtime arguments: ints <= 1 by value, larger ints by (divisible by
    16, fits int32), tensors by dtype and 16-byte alignment, floats by type. The common types
    are tested inline (and allocate nothing when aligned / small): this runs on every launch."""
    return [(a if a <= 1 else 3 if a & 15 == 0 else 2) if (t := type(a)) is int and a < _I32
            else (a.dtype if a.data_ptr() & 15 == 0 else (a.dtype, 1)) if t is torch.Tensor
            else "f" if t is float else _arg_key(a) for a in args]


def _hooked(hook: Any) -> bool:
    """Whether a Triton launch hook (a ``HookChain`` in Triton 3.6+, once a callable or None) is set."""
    return hook is not None and bool(getattr(hook, "calls", True))


class _Cached:
    """A compiled specialization and what a launch of it needs besides the runtime arguments."""

    __slots__ = ("compiled", "constexprs", "run", "function", "packed", "direct")

    def __init__(self, compiled: Any, constexprs: tuple[Any, ...] | None) -> None:
        self.compiled = compiled
        self.constexprs = constexprs  # None: a constexpr was left to its default (Triton binds it)
        # Triton's launcher, called as CompiledKernel[grid](...) calls it (Triton 3.6 - 3.9):
        # run(gx, gy, gz, stream, function, packed_metadata, launch_metadata, enter_hook,
        # exit_hook, *args). Handles exist: the kernel has launched once.
        self.run = getattr(compiled, "_run", None)
        self.function = getattr(compiled, "function", None)
        self.packed = getattr(compiled, "packed_metadata", None)
        self.direct = _direct_launch(self.run)

    def launch(self, grid: tuple[int, ...], args: Sequence[Any], stream: int, hooked: bool) -> None:
        """Launch on ``stream``; ``hooked``: a Triton launch hook is set (it needs launch metadata)."""
        if hooked or self.run is None:
            self.compiled[grid](*args, *self.constexprs, stream=stream)
        elif self.direct is not None:  # the C launcher itself: no scratch to allocate
            launch, coop, pdl = self.direct
            # PDL only where it pays: in a captured graph. An eager PDL launch costs the host
            # more than it saves on the device; kernels that wait (gdc_wait) run as plain launches.
            pdl = pdl and _capturing()
            launch(grid[0], grid[1], grid[2], stream, self.function, coop, pdl, None, None, self.packed,
                   None, None, None, *args, *self.constexprs)
        else:  # no launch metadata, and None tells the launcher to call no hook
            self.run(grid[0], grid[1], grid[2], stream, self.function, self.packed, None, None, None,
                     *args, *self.constexprs)


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (``torch.cuda.is_current_stream_capturing``)."""
    return torch._C._cuda_isCurrentStreamCapturing()


def _direct_launch(run: Any) -> tuple[Any, Any, Any] | None:
    """``(launch, cooperative, pdl)`` of a Triton CUDA launcher whose ``__call__`` only allocates
    scratch memory before calling its C ``launch`` (Triton 3.6's ``CudaLauncher``), when the
    kernel needs no scratch: calling ``launch`` directly skips a Python frame per launch. None
    for any other launcher (other Triton versions do more in ``__call__``)."""
    call = getattr(type(run), "__call__", None)
    if call is None or type(run).__name__ != "CudaLauncher" or hasattr(run, "gsan_enabled"):
        return None
    try:
        params = list(inspect.signature(call).parameters)
        if params != ["self", "gridX", "gridY", "gridZ", "stream", "function", "args"]:
            return None
        if run.global_scratch_size or run.profile_scratch_size:
            return None
        return run.launch, run.launch_cooperative_grid, run.launch_pdl
    except (AttributeError, TypeError, ValueError):
        return None


def _launch_state(knobs: Any) -> tuple[int, bool]:
    """The current stream (Triton's get_current_stream) and whether a launch hook is set."""
    runtime = knobs.runtime
    stream = torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())
    return stream, _hooked(runtime.launch_enter_hook) or _hooked(runtime.launch_exit_hook)


class FastLaunch:
    """``FastLaunch(kernel)[grid](*args, **kwargs)``: ``kernel[grid](...)`` with a host-side cache.

    Args:
        kernel: a ``@triton.jit`` function whose runtime parameters all come before its
            constexpr parameters.

    Calls pass the runtime arguments positionally and the constexprs and launch options
    (``num_warps``, ``num_stages``, ``maxnreg``, ...) by name; ``grid`` is a tuple. Other
    call shapes go through Triton's own path, which is always correct.
    """

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.cache: dict[Any, Any] = {}
        params = getattr(kernel, "params", None)
        interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
        self.supported = self.enabled = False
        _LAUNCHERS.add(self)
        if params is None or interpret:
            return
        constexpr = [bool(p.is_constexpr) for p in params]
        self.num_runtime = constexpr.index(True) if True in constexpr else len(params)
        if any(not c for c in constexpr[self.num_runtime:]):
            return  # runtime parameters after constexprs: not this fast path's shape
        self.constexpr_names = tuple(p.name for p in params[self.num_runtime:])
        from triton import knobs

        from vattn import envs

        self._knobs = knobs
        self.supported = True
        self.enabled = envs.VATTN_TRITON_FAST_LAUNCH

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., Any]:
        if not self.enabled:
            rec = _recording.get()
            if rec is not None:
                rec.append(None)  # Triton's own path: nothing to replay
            return self.kernel[grid]
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _launch(self, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        rec = _recording.get()
        if len(args) != self.num_runtime:
            if rec is not None:
                rec.append(None)
            return self.kernel[grid](*args, **kwargs)
        device = torch._C._cuda_getDevice()  # Triton's get_current_device(), without its lazy-init check
        try:
            key = (device, *_runtime_key(args), *kwargs.items())
            entry = self.cache.get(key)
        except TypeError:  # an unhashable constexpr: no caching
            entry, key = None, None
        if entry is None or entry.constexprs is None:
            compiled = self.kernel[grid](*args, **kwargs)
            if entry is None and key is not None and compiled is not None:
                try:
                    constexprs: tuple[Any, ...] | None = tuple(kwargs[n] for n in self.constexpr_names)
                except KeyError:
                    constexprs = None
                self.cache[key] = _Cached(compiled, constexprs)
            if rec is not None:
                rec.append(None)  # a first launch: replayed plans start from the next one
            return compiled
        if len(grid) < 3:
            grid = (*grid, *(1,) * (3 - len(grid)))
        entry.launch(grid, args, *_launch_state(self._knobs))
        if rec is not None:
            rec.append((self, entry, grid, args))
        return entry.compiled


@contextlib.contextmanager
def record_launches() -> Iterator[list[Any]]:
    """Record the ``FastLaunch`` launches made inside the block (for ``LaunchPlan.build``)."""
    launches: list[Any] = []
    token = _recording.set(launches)
    try:
        yield launches
    finally:
        _recording.reset(token)


class LaunchPlan:
    """Launches recorded from one call, repeated with other tensors in the same roles.

    A caller whose calls differ only in some tensors (each layer's q/k/v/output, KV cache
    and scales, with the same shapes, strides, dtypes and 16-byte alignment) records the
    launches of one call and repeats them for the next: no argument binding, no
    specialization key, no validation (the recorded call did all of it). ``build`` gives
    None unless every launch was a cached ``FastLaunch`` one and every tensor argument is
    either one of ``roles`` (replaced on repeat) or one of ``fixed`` (the same for every
    call the plan serves); the caller must make sure no other device work happened in the
    recorded region, and that the calls a plan serves have equal non-tensor arguments.

    Tensors reach the kernels as device addresses (``data_ptr()``): ``fixed`` ones once, at
    ``build`` (the caller keeps them alive while it uses the plan), ``roles`` at each
    ``run``. Triton checks a tensor's address with the driver; an integer it takes as is, so
    the caller must pass, wherever the recorded call had a tensor, a tensor on the device
    the recorded call used.
    """

    __slots__ = ("steps",)

    def __init__(self, steps: list[tuple[FastLaunch, _Cached, tuple[int, ...], list[Any], tuple[tuple[int, int], ...]]]) -> None:
        self.steps = steps

    @classmethod
    def build(cls, launches: Sequence[Any], roles: Sequence[Any], fixed: Sequence[Any]) -> "LaunchPlan | None":
        steps = []
        for launch in launches:
            if launch is None:
                return None
            launcher, entry, grid, args = launch
            subs = []
            ptrs = list(args)
            for i, a in enumerate(args):
                if not isinstance(a, torch.Tensor):
                    continue
                j = next((j for j, r in enumerate(roles) if r is a), None)
                if j is not None:
                    subs.append((i, j))
                elif any(a is f for f in fixed):
                    ptrs[i] = a.data_ptr()  # checked by Triton when the recorded call launched
                else:
                    return None  # a tensor made inside the call (or unknown): cannot stand for other calls
            steps.append((launcher, entry, grid, ptrs, tuple(subs)))
        return cls(steps)

    def run(self, roles: Sequence[Any]) -> bool:
        """Repeat the launches with ``roles`` (same order as at ``build``); False (nothing
        launched) when a launcher was switched to Triton's own path since."""
        for launcher, *_ in self.steps:
            if not launcher.enabled:
                return False
        if not self.steps:
            return True
        stream, hooked = _launch_state(self.steps[0][0]._knobs)
        for _, entry, grid, args, subs in self.steps:
            if subs:
                args = args.copy()
                for i, j in subs:
                    args[i] = roles[j].data_ptr()
            entry.launch(grid, args, stream, hooked)
        return True

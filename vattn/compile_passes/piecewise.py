"""Piecewise CUDA graphs: each compiled piece of a ``vattn.compile``d model, captured per size.

The compile backend wraps every compiled (non-attention) piece in a ``CUDAGraphPiece``.
Outside a ``piecewise_run`` block it just calls the compiled code. Inside one (set by
``vattn.CUDAGraphRunner`` for a PIECEWISE step of ``num_tokens`` padded tokens) it:

* replays the graph it captured for that size (keyed by the runner, so two runners over
  one compiled model do not share graphs), returning the tensors the capture produced;
* captures one when the run asks for capture and none exists (``torch.cuda.graph`` on the
  run's shared memory pool), returning the live outputs of the capture;
* runs the compiled code eagerly for a size it never captured.

Attention ops sit between the pieces and always run eagerly, reading the step's metadata
from the forward context. Everything a piece reads must therefore stay at fixed addresses
between capture and replay: weights, the runner's persistent ``input_ids``/``positions``
buffers, and the outputs of the previous pieces (which live in the graph pool). The first
replay of every graph (and every replay when ``VATTN_CUDAGRAPH_DEBUG=1``) checks that.

Outputs of captured pieces are kept as non-owning references, so the pool memory of one
size's activations is reused by the next size's capture (sizes never run at once); the
tensors a replay returns are overwritten by the next replay.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.utils._pytree import tree_map

__all__ = [
    "CUDAGraphPiece",
    "StaticSizes",
    "PiecewiseRun",
    "capture_graph",
    "current_piecewise_run",
    "piecewise_run",
    "weak_ref_tensor",
]

logger = logging.getLogger("vattn.cudagraph")


@dataclass(frozen=True)
class PiecewiseRun:
    """One PIECEWISE forward, as the runner describes it to the pieces.

    Args:
        owner: a key unique to the runner (graphs are stored per owner).
        num_tokens: the padded token count (the capture size).
        capture: capture graphs for pieces that have none for this size.
        pool: the shared memory pool (``torch.cuda.graph_pool_handle()``).
        check_addresses: verify input addresses on every replay (debug mode).
    """

    owner: int
    num_tokens: int
    capture: bool = False
    pool: Any = None
    check_addresses: bool = False


_run: list[PiecewiseRun | None] = [None]


def current_piecewise_run() -> PiecewiseRun | None:
    return _run[0]


@contextlib.contextmanager
def piecewise_run(run: PiecewiseRun | None) -> Iterator[None]:
    """Make the compiled pieces replay/capture graphs for ``run`` inside the block."""
    prev = _run[0]
    _run[0] = run
    try:
        yield
    finally:
        _run[0] = prev


def weak_ref_tensor(t: Any) -> Any:
    """A tensor viewing ``t``'s memory without keeping it alive (CUDA tensors only; others as is).

    Used for captured outputs: the graph pool may hand the memory to a later capture, which
    is safe because graphs of different sizes never run at the same time.
    """
    if not isinstance(t, torch.Tensor) or t.device.type != "cuda":
        return t
    construct = getattr(torch._C, "_construct_storage_from_data_pointer", None)
    if construct is None:  # keep a strong reference: correct, only less memory sharing
        return t
    st = t.untyped_storage()
    storage = construct(st.data_ptr(), t.device, st.nbytes())
    out = torch.empty((0,), dtype=t.dtype, device=t.device)
    out.set_(storage, t.storage_offset(), t.size(), t.stride())
    return out


def _clear_blas_workspaces() -> None:
    """Drop torch's cached cuBLAS / cuBLASLt workspaces (one per handle and stream)."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def capture_graph(fn: Callable[[], Any], pool: Any = None) -> tuple["torch.cuda.CUDAGraph", Any]:
    """Capture ``fn()`` into a new CUDA graph on ``pool`` (None: a pool of its own); returns the graph
    and ``fn``'s output.

    Both the piecewise pieces and the runner's full graphs capture through this function.

    A captured GEMM keeps the address of the cuBLAS workspace torch cached for the capture
    stream. That workspace belongs to whoever first ran a GEMM on that stream (every
    ``torch.cuda.graph`` without a stream shares one capture stream), and anyone may free it:
    ``torch.compile(mode="reduce-overhead")`` clears every cached workspace around each of its
    recordings. A replay would then read and write freed memory (another tensor's, or an
    unmapped page: an illegal memory access). So the cache is cleared before the capture,
    which makes the capture allocate its workspace from ``pool`` (memory the graph owns for
    its lifetime), and again after it, so no later GEMM outside the graph is handed that
    memory. This is what PyTorch's own CUDA-graph trees do around their recordings.
    """
    graph = torch.cuda.CUDAGraph()
    _clear_blas_workspaces()
    try:
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
    finally:
        _clear_blas_workspaces()
    return graph, out


def _addresses(args: tuple[Any, ...]) -> list[int | None]:
    return [a.data_ptr() if isinstance(a, torch.Tensor) else None for a in args]


@dataclass
class _Entry:
    graph: "torch.cuda.CUDAGraph"
    output: Any
    input_addresses: list[int | None]
    checked: bool = False


@dataclass
class StaticSizes:
    """Code of one piece compiled for exact token counts (``CompilationConfig.compile_sizes``).

    Shared by identical pieces, so each size compiles once per distinct piece. Compiles
    happen on the first call of a size (with that call's real inputs), never while a CUDA
    graph is being captured: a size first seen inside a capture runs the general code.

    Args:
        sizes: the token counts to specialise.
        locate: ``(i, None)``: argument ``i`` is the token count; ``(i, d)``: it is
            ``args[i].shape[d]``.
        compile: ``compile(num_tokens, args) -> fn``.
    """

    sizes: frozenset[int]
    locate: tuple[int, int | None]
    compile: Callable[[int, tuple[Any, ...]], Callable[..., Any]]
    fns: dict[int, Callable[..., Any] | None] = field(default_factory=dict, repr=False)  # None: failed

    def pick(self, args: tuple[Any, ...]) -> Callable[..., Any] | None:
        """The static code for this call's token count, or None (general code)."""
        i, d = self.locate
        n = args[i] if d is None else args[i].shape[d]
        if n not in self.sizes:
            return None
        if n in self.fns:
            return self.fns[n]
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            logger.warning("compile_sizes: %d tokens first seen inside a CUDA-graph capture; the "
                           "capture uses the general code (run one step of that size first).", n)
            return None
        try:
            fn = self.compile(int(n), args)
        except Exception:  # the general code is always valid: keep running
            logger.exception("compile_sizes: compiling a piece for %d tokens failed; that size runs "
                             "the general code.", n)
            fn = None
        self.fns[n] = fn
        return fn


@dataclass
class CUDAGraphPiece:
    """A compiled piece at one position of the split graph, with its captured graphs.

    Identical pieces share ``fn`` (compiled once) and ``static`` (code for exact sizes), but
    each position owns its graphs, since each reads different weights and activations.
    """

    fn: Callable[..., Any]
    index: int
    name: str
    static: StaticSizes | None = None
    graphs: dict[tuple[int, int], _Entry] = field(default_factory=dict, repr=False)

    def _code(self, args: tuple[Any, ...]) -> Callable[..., Any]:
        if self.static is None:
            return self.fn
        return self.static.pick(args) or self.fn

    def __call__(self, *args: Any) -> Any:
        run = _run[0]
        if run is None:
            return self._code(args)(*args)
        key = (run.owner, run.num_tokens)
        entry = self.graphs.get(key)
        if entry is None:
            if not run.capture:
                return self._code(args)(*args)
            return self._capture(key, run, args)
        if run.check_addresses or not entry.checked:
            self._check(entry, args, run.num_tokens)
            entry.checked = True
        entry.graph.replay()
        return entry.output

    def _capture(self, key: tuple[int, int], run: PiecewiseRun, args: tuple[Any, ...]) -> Any:
        graph, out = capture_graph(functools.partial(self._code(args), *args), run.pool)
        self.graphs[key] = _Entry(graph, tree_map(weak_ref_tensor, out), _addresses(args))
        logger.debug("captured %s (piece %d) for %d tokens", self.name, self.index, run.num_tokens)
        return out

    def _check(self, entry: _Entry, args: tuple[Any, ...], num_tokens: int) -> None:
        now = _addresses(args)
        for i, (was, cur) in enumerate(zip(entry.input_addresses, now)):
            if was != cur:
                raise RuntimeError(
                    f"piecewise CUDA graph of {self.name} (piece {self.index}) for {num_tokens} tokens: "
                    f"input {i} is at {cur:#x} but the graph was captured reading {was:#x}, so a replay "
                    "would read stale memory. Inputs must stay at fixed addresses: call the model "
                    "through vattn.CUDAGraphRunner (persistent input buffers), keep weights in place "
                    "(no reassigning parameters after capture), or recapture."
                    if cur is not None and was is not None
                    else f"piece {self.index}: argument {i} changed between tensor and non-tensor."
                )

    def release(self, owner: int | None = None) -> int:
        """Drop the graphs captured for ``owner`` (all when None); returns how many."""
        keys = [k for k in self.graphs if owner is None or k[0] == owner]
        for k in keys:
            del self.graphs[k]
        return len(keys)

"""The ``torch.compile`` backend of vattn, and ``vattn.compile``.

Dynamo traces the whole model (``fullgraph=True``). ``VattnBackend`` then:

1. splits the FX graph at the splitting ops (``cfg.compilation.splitting_ops``, by default
   the two ``vattn::unified_attention*`` ops) with ``torch.fx.passes.split_module``, so each
   attention op is alone in its own submodule and the rest forms *pieces* between them;
2. compiles every piece with Inductor (``compile_fx``), with vattn's
   ``PostGradPassManager`` installed as ``post_grad_custom_post_pass`` for that compile only
   (a config patch; global Inductor config is never changed);
3. compiles identical pieces once: a piece is identified by its graph (ops, arguments,
   constants, with node names canonicalised) and its inputs' metadata (symbolic shapes,
   strides, dtypes, devices). Every decoder layer's piece is the same graph, so a model of
   N layers compiles about 3 pieces (first, middle, last), whatever N;
4. returns the split module, which runs the pieces (each wrapped in a ``CUDAGraphPiece``
   for piecewise CUDA graphs) and the attention ops in order.

``vattn.compile(model, cfg)`` marks the token dimension of the inputs dynamic as a *backed*
symbol (``torch._dynamo.mark_dynamic``) traced size-obliviously (``backed_size_oblivious``:
no 0/1 specialisation) with Inductor's own shape guards suppressed, so one graph serves
every token count, 1 included. Inductor knows a backed symbol's example value, so it proves
views instead of copying and fuses reductions with their consumers: the Llama-3.2-1B step
runs 13 kernels per layer, against 17 with an unbacked symbol (H200, ``profile_step.py``).
Python in the model must not ask whether the token count is 1: a reshape of a strided
q/k/v slice by the token count does, and costs one recompile for 1-token steps (split heads
on the contiguous projection output instead, as ``examples/model.py`` does).
``dynamic="unbacked"`` (``torch._dynamo.decorators.mark_unbacked``) never specialises and
never recompiles, whatever the model does, at the price of those copies and split kernels;
Python branching on the token count then fails at trace time with a data-dependent-guard
error naming the line.
``CompilationConfig.compile_sizes`` (vLLM's name) adds code for exact token counts: the first
step of such a size compiles each distinct piece once more from that step's real inputs
(``StaticSizes`` in ``piecewise.py``; coordinate-descent tuning on, so Inductor turns 1-token
matrix multiplies into fused matrix-vector reductions), and later steps of that size run it.
Dynamo still traces once; the general code serves every other size.
Metadata reaches the attention ops through the forward context, not as graph inputs, so
changing batch composition never recompiles. At run time the split module calls each attention
op's Python implementation directly (``direct_op_call``), and ``VattnCompiledModel`` skips
Dynamo's per-call guard evaluation for call signatures its guards accepted once
(``dispatch.DirectDispatch``). Counters: ``VattnBackend.counter`` (per
backend) and ``compilation_counter`` (process-wide).

| counter | meaning |
| --- | --- |
| num_graphs_seen | FX graphs Dynamo handed to the backend (1 per compile) |
| num_pieces | pieces (non-splitting submodules) over those graphs |
| num_splitting_ops | attention ops left between pieces |
| num_inductor_compiles | pieces actually compiled (distinct graphs) |
| num_piece_reuses | pieces that reused an identical piece's compiled code |
| num_static_compiles | compiles for one exact token count (``compile_sizes``; lazily, per distinct piece) |
| compile_seconds | wall time spent compiling pieces |
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import hashlib
import inspect
import logging
import os
import time
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_map

from vattn import envs
from vattn.compile_passes.dispatch import DirectDispatch
from vattn.compile_passes.piecewise import CUDAGraphPiece, StaticSizes
from vattn.config import VattnConfig, get_current_vattn_config

__all__ = [
    "CompilationCounter",
    "VattnBackend",
    "VattnCompiledModel",
    "compilation_counter",
    "compile",
    "piece_key",
    "split_graph",
]

logger = logging.getLogger("vattn.compile")


@dataclasses.dataclass
class CompilationCounter:
    """Compile statistics (see the module docstring's table)."""

    num_graphs_seen: int = 0
    num_pieces: int = 0
    num_splitting_ops: int = 0
    num_inductor_compiles: int = 0
    num_piece_reuses: int = 0
    num_static_compiles: int = 0
    compile_seconds: float = 0.0

    def snapshot(self) -> "CompilationCounter":
        return dataclasses.replace(self)


#: Process-wide totals over every ``VattnBackend``.
compilation_counter = CompilationCounter()


def _bump(counter: CompilationCounter, **deltas: float) -> None:
    for c in (counter, compilation_counter):
        for name, d in deltas.items():
            setattr(c, name, getattr(c, name) + d)


# ---- splitting ---------------------------------------------------------------------------


def _op_names(target: Any) -> set[str]:
    """Names a call target answers to: ``"ns::op"`` and ``"ns::op.overload"``."""
    if isinstance(target, torch._ops.OpOverload):
        base = target._schema.name
        return {base, f"{base}.{target._overloadname}"}
    if isinstance(target, torch._ops.OpOverloadPacket):
        return {target._qualified_op_name}
    return set()


def is_splitting_node(node: fx.Node, splitting_ops: Sequence[str]) -> bool:
    return node.op == "call_function" and bool(_op_names(node.target) & set(splitting_ops))


@dataclasses.dataclass
class SplitItem:
    """One submodule of the split graph: a piece, or a lone splitting op."""

    name: str
    index: int
    is_splitting: bool
    graph: fx.GraphModule


def _partition(gm: fx.GraphModule, splitting_ops: Sequence[str]) -> dict[fx.Node, int]:
    """Each node's submodule index: splitting ops alone, the nodes between two of them together."""
    part: dict[fx.Node, int] = {}
    pid = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_splitting_node(node, splitting_ops):
            pid += 1
            part[node] = pid
            pid += 1
        else:
            part[node] = pid
    return part


def boundary_nodes(gm: fx.GraphModule, splitting_ops: Sequence[str]) -> set[fx.Node]:
    """The nodes whose values cross a submodule boundary of ``split_graph``: the inputs, and
    the values a submodule returns (to a later one or as the graph's output)."""
    part = _partition(gm, splitting_ops)
    return {n for n in gm.graph.nodes
            if n.op == "placeholder" or any(u.op == "output" or part.get(u) != part.get(n) for u in n.users)}


def split_graph(gm: fx.GraphModule, splitting_ops: Sequence[str]) -> tuple[fx.GraphModule, list[SplitItem]]:
    """Split ``gm`` so that every splitting op sits alone in a submodule.

    Returns the split module (its ``submod_<i>`` children run in order) and the items in
    execution order. Nodes between two splitting ops form one piece.
    """
    part = _partition(gm, splitting_ops)
    splitting_ids = {part[n] for n in part if is_splitting_node(n, splitting_ops)}
    from torch.fx.passes.split_module import split_module

    split_gm = split_module(gm, None, lambda n: part[n], keep_original_order=True)
    items: list[SplitItem] = []
    for node in split_gm.graph.nodes:
        if node.op != "call_module":
            continue
        index = int(node.target.rsplit("_", 1)[1])
        items.append(SplitItem(node.target, index, index in splitting_ids, getattr(split_gm, node.target)))
    return split_gm, items


def direct_op_call(gm: fx.GraphModule) -> Callable[..., Any] | None:
    """``gm`` (a lone splitting op) as a plain function calling the op's Python implementation
    directly, or None when the op has none (``custom_ops.python_impl``). Skips, per attention
    op and step, ``nn.Module.__call__`` and the dispatcher: about 5 us of host time on CPU."""
    from vattn.ops.custom_ops import python_impl

    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    impl = python_impl(ops[0].target) if len(ops) == 1 else None
    if impl is None:
        return None
    direct = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    node = next(n for n in direct.graph.nodes if n.op == "call_function")
    node.target = impl
    direct.recompile()
    return direct.forward


# ---- identical pieces --------------------------------------------------------------------


def _target_key(gm: fx.GraphModule, node: fx.Node) -> str:
    if node.op in ("call_function",):
        t = node.target
        mod = getattr(t, "__module__", None) or ""
        return f"{mod}.{getattr(t, '__qualname__', None) or getattr(t, '__name__', None) or t}"
    if node.op == "call_method":
        return str(node.target)
    if node.op in ("get_attr", "call_module"):
        # A module attribute is per-layer state: only the very same object may share code.
        obj = gm
        for part in str(node.target).split("."):
            obj = getattr(obj, part)
        return f"{node.target}@{id(obj)}"
    return ""


def _value_key(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"T({tuple(str(s) for s in v.shape)},{tuple(str(s) for s in v.stride())},{v.dtype},{v.device},{v.requires_grad})"
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return f"S({v.node.expr})"
    return f"C({v!r})"


def piece_key(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> str:
    """A hash of the piece's graph (node names canonicalised) and its inputs' metadata."""
    index: dict[fx.Node, str] = {}
    lines: list[str] = []
    for i, node in enumerate(gm.graph.nodes):
        index[node] = f"%{i}"
        args = fx.node.map_arg((node.args, node.kwargs), lambda n: index[n])
        lines.append(f"{node.op}|{_target_key(gm, node)}|{args!r}")
    lines.extend(_value_key(v) for v in example_inputs)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


# ---- the backend -------------------------------------------------------------------------


class VattnBackend:
    """``torch.compile`` backend: split at attention, compile pieces once, run in order.

    Args:
        config: the model's config (splitting ops, passes, ``use_inductor``, dump path).
    """

    def __init__(self, config: VattnConfig, *, suppress_guards: bool = False) -> None:
        if not isinstance(config, VattnConfig):
            raise TypeError(f"VattnBackend expects a vattn.VattnConfig, got {type(config).__name__}.")
        self.config = config
        self.splitting_ops = tuple(config.compilation.splitting_ops)
        self.suppress_guards = suppress_guards
        self.counter = CompilationCounter()
        self.pieces: list[CUDAGraphPiece] = []
        self.split_gm: fx.GraphModule | None = None
        self.items: list[SplitItem] = []
        self._compiled: dict[str, Callable[..., Any]] = {}
        self._static: dict[str, StaticSizes | None] = {}
        self._pass_manager: Any = None
        self.serializable = False  # set during an ahead-of-time capture (aot_cache.compile_and_save)
        self.captured: Any = None  # the graph that capture returned, not compiled yet

    def reset(self) -> None:
        """Forget every compiled piece and count (a failed ahead-of-time capture)."""
        self.counter = CompilationCounter()
        self.pieces, self.split_gm, self.items = [], None, []
        self._compiled.clear()
        self._static.clear()

    @property
    def num_unique_pieces(self) -> int:
        """Distinct piece graphs compiled so far (identical pieces count once)."""
        return len(self._compiled)

    @property
    def pass_manager(self) -> Any:
        if self._pass_manager is None:
            from vattn.compile_passes.pass_manager import PostGradPassManager

            self._pass_manager = PostGradPassManager.from_config(self.config)
        return self._pass_manager

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        if self.serializable:  # compiled later, as a loaded trace is (aot_cache.compile_and_save)
            from vattn.compile_passes.aot_cache import SerializableSplitModule

            self.captured = SerializableSplitModule(gm, None, self.splitting_ops)
            return self.captured
        return self.compile_graph(gm, example_inputs)

    def compile_graph(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> fx.GraphModule:
        """Split ``gm`` at the splitting ops and compile its pieces; returns the split module."""
        split_gm, items = split_graph(gm, self.splitting_ops)
        n_split = sum(i.is_splitting for i in items)
        _bump(self.counter, num_graphs_seen=1, num_pieces=len(items) - n_split, num_splitting_ops=n_split)
        if self.counter.num_graphs_seen == 2:
            logger.warning(
                "vattn.compile: Dynamo traced the model a second time (a guard of the first graph "
                "failed; TORCH_LOGS=recompiles names it). Usual causes: inputs that are inference "
                "tensors (made under torch.inference_mode) in some calls and not in others, so make "
                "them one way (CUDAGraphRunner's buffers are not inference tensors); or, with "
                "dynamic=True (backed token symbols), a reshape of a strided q/k/v slice by the token "
                "count, which guards on it being 1: split heads on the contiguous projection output "
                "(see examples/model.py), or pass dynamic='unbacked'."
            )
        to_compile = {i.name: i for i in items if not i.is_splitting}
        start = time.perf_counter()
        with torch.no_grad():
            _PieceCompiler(split_gm, to_compile, self).run(*_fake_inputs(example_inputs))
        for item in items:
            if item.is_splitting and (fn := direct_op_call(item.graph)) is not None:
                split_gm.__dict__[item.name] = fn  # shadows the submodule in the generated code
        _bump(self.counter, compile_seconds=time.perf_counter() - start)
        logger.info(
            "vattn.compile: %d pieces around %d attention ops; %d compiled, %d reused (%.1fs)",
            len(to_compile), n_split, self.counter.num_inductor_compiles,
            self.counter.num_piece_reuses, time.perf_counter() - start,
        )
        self.split_gm, self.items = split_gm, items
        return split_gm

    def compile_piece(self, piece: fx.GraphModule, example_inputs: Sequence[Any], name: str,
                      key: str | None = None) -> Callable[..., Any]:
        """Compiled code for ``piece``; an identical piece compiled before is reused."""
        key = key or piece_key(piece, example_inputs)
        fn = self._compiled.get(key)
        if fn is not None:
            _bump(self.counter, num_piece_reuses=1)
            return fn
        if not self.config.compilation.use_inductor:
            fn = piece
        else:
            from torch._inductor.compile_fx import compile_fx

            patches = {**_pdl_default(example_inputs), **self.config.compilation.inductor_compile_config,
                       "post_grad_custom_post_pass": self.pass_manager, "triton.cudagraphs": False}
            with _shape_guards_suppressed(example_inputs, self.suppress_guards):
                fn = compile_fx(piece, list(example_inputs), config_patches=patches)
            _bump(self.counter, num_inductor_compiles=1)
        self._compiled[key] = fn
        return fn

    def static_sizes(self, piece: fx.GraphModule, example_inputs: Sequence[Any], key: str) -> StaticSizes | None:
        """The ``StaticSizes`` of ``piece`` (shared by identical pieces), or None when
        ``compile_sizes`` is empty, Inductor is off, or the piece's token count is not one
        symbol found among its inputs."""
        cc = self.config.compilation
        if not cc.compile_sizes or not cc.use_inductor:
            return None
        if key in self._static:
            return self._static[key]
        locate = _token_count_locator(example_inputs)
        static = None
        if locate is not None:
            # Inductor rewrites a graph it compiles (e.g. its output into a tuple): keep a copy.
            pristine = fx.GraphModule(piece, copy.deepcopy(piece.graph))
            static = StaticSizes(frozenset(cc.compile_sizes), locate,
                                 functools.partial(self._compile_static, pristine))
        else:
            logger.info("compile_sizes: piece has no single token-count symbol among its inputs; "
                        "it runs its general code at every size.")
        self._static[key] = static
        return static

    def _compile_static(self, piece: fx.GraphModule, num_tokens: int, args: tuple[Any, ...]) -> Callable[..., Any]:
        """Inductor code of ``piece`` for exactly ``num_tokens`` tokens, traced from the real ``args``."""
        from torch._inductor.compile_fx import compile_fx

        start = time.perf_counter()
        graph = fx.GraphModule(piece, copy.deepcopy(piece.graph))  # Inductor edits what it compiles
        defaults: dict[str, Any] = {"coordinate_descent_tuning": True, **_pdl_default(args)}
        if num_tokens == 1 and self.config.compilation.one_token_gemv and _on_sm90(args):
            from vattn.compile_passes import one_token_gemv

            logger.debug("vattn.compile: %d linear layers of the 1-token piece run vattn::gemv",
                         one_token_gemv.rewrite(graph))
        patches = {**defaults, **self.config.compilation.inductor_compile_config,
                   "post_grad_custom_post_pass": self.pass_manager, "triton.cudagraphs": False}
        with torch.no_grad():
            fn = compile_fx(graph, list(args), config_patches=patches)
        elapsed = time.perf_counter() - start
        _bump(self.counter, num_static_compiles=1, compile_seconds=elapsed)
        logger.info("vattn.compile: piece compiled for %d tokens (%.1fs)", num_tokens, elapsed)
        return fn


def _pdl_default(args: Sequence[Any]) -> dict[str, Any]:
    """Inductor config that turns on its programmatic dependent launch (``triton.enable_pdl``)
    for a piece on an sm_90+ GPU (``CompilationConfig.inductor_compile_config`` overrides it).

    Each kernel then lets the next one launch before it finishes, and waits for the one
    before it only at its first dependent access, so the launch gap between back-to-back
    kernels is hidden: in a 1-token step a GEMV after a norm loads its weights while the norm
    runs; at batch 64 the Llama-3.2-1B decode step (16 layers, FULL graph, H100) replays in
    1.588 instead of 1.602 ms, at batch 8 in 1.221 instead of 1.230 ms. The price is paid
    where the code runs without CUDA graphs: a PDL launch costs the host a little more (the
    same step launched eagerly, host-bound at batch 64: 4.52 against 4.27 ms of host time).
    """
    if hasattr(torch._inductor.config.triton, "enable_pdl") and _on_sm90(args):
        return {"triton.enable_pdl": True}
    return {}


def _on_sm90(args: Sequence[Any]) -> bool:
    """Whether the piece's tensors all live on one device with programmatic dependent launch."""
    from vattn.ops.triton_launch import pdl_supported

    devices = {a.device for a in args if isinstance(a, torch.Tensor)}
    return len(devices) == 1 and pdl_supported(devices.pop())


def _token_count_locator(example_inputs: Sequence[Any]) -> tuple[int, int | None] | None:
    """Where a piece's token count is among its (fake) inputs: ``(i, None)`` for a SymInt
    argument, ``(i, d)`` for dim ``d`` of tensor argument ``i``; None unless the inputs
    have exactly one free symbol."""
    symbols: set[Any] = set()
    found: list[tuple[int, int | None]] = []
    for i, a in enumerate(example_inputs):
        if isinstance(a, torch.SymInt):
            symbols |= a.node.expr.free_symbols
            if a.node.expr.is_Symbol:
                found.append((i, None))
        elif isinstance(a, torch.Tensor):
            for d, size in enumerate(a.shape):
                if isinstance(size, torch.SymInt):
                    symbols |= size.node.expr.free_symbols
                    if size.node.expr.is_Symbol:
                        found.append((i, d))
    if len(symbols) != 1 or not found:
        return None
    return min(found, key=lambda f: f[1] is not None)  # a SymInt argument if there is one


def _shape_guards_suppressed(example_inputs: Sequence[Any], suppress: bool) -> Any:
    """With backed token symbols: keep Inductor's lowering of a piece (which asks e.g.
    whether the token count is 1 while computing view strides) from guarding the whole
    model on the answer; its general-size code stays valid for every size."""
    from torch._guards import detect_fake_mode

    shape_env = getattr(detect_fake_mode(example_inputs), "shape_env", None)
    return shape_env.suppress_guards() if suppress and shape_env is not None else contextlib.nullcontext()


def _fake_inputs(example_inputs: Sequence[Any]) -> list[Any]:
    """The inputs as fake tensors of the backend's fake mode (symbolic sizes where Dynamo made them)."""
    from torch._guards import detect_fake_mode

    from torch._subclasses.fake_tensor import FakeTensor

    fake_mode = detect_fake_mode(example_inputs)
    if fake_mode is None:
        return list(example_inputs)
    # from_tensor finds each input's symbolic context in the active TracingContext; inputs
    # already fake (a graph loaded from vattn's cache) are used as they are.
    return [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) else t
            for t in example_inputs]


class _PieceCompiler(torch.fx.Interpreter):
    """Runs the split module on fake inputs; compiles each piece with its (fake) inputs."""

    def __init__(self, module: fx.GraphModule, to_compile: Mapping[str, SplitItem], backend: VattnBackend) -> None:
        super().__init__(module)
        self.to_compile = to_compile
        self.backend = backend

    def run(self, *args: Any) -> Any:  # type: ignore[override]
        from torch._dispatch.python import enable_python_dispatcher
        from torch._guards import detect_fake_mode
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake_mode = detect_fake_mode(args) or FakeTensorMode()
        with fake_mode, enable_python_dispatcher():
            return super().run(*args)

    def call_module(self, target: str, args: Any, kwargs: Any) -> Any:  # type: ignore[override]
        item = self.to_compile.get(target)
        out = _traced_outputs(item.graph) if item is not None else None
        if out is None:  # attention ops (one op: cheap), or a piece without traced values
            out = super().call_module(target, args, kwargs)
        if item is not None:
            key = piece_key(item.graph, args)
            static = self.backend.static_sizes(item.graph, args, key)  # before Inductor edits the graph
            fn = self.backend.compile_piece(item.graph, args, target, key)
            piece = CUDAGraphPiece(fn, item.index, target, static)
            self.backend.pieces.append(piece)
            self.module.__dict__[target] = piece  # shadows the submodule in the generated code
        return out


def _traced_outputs(gm: fx.GraphModule) -> Any:
    """The fake values Dynamo recorded for a piece's outputs (None if any is missing).

    They are what running the piece on the fake inputs would return, without running it:
    a 32-layer model compiles ~30 identical pieces, whose fake execution dominated the
    backend's time before (``benchmarks/bench_compile.py`` cold start).
    """
    node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    missing = []

    def value(n: fx.Node) -> Any:
        v = n.meta.get("example_value", n.meta.get("val"))  # Dynamo's graphs carry example_value
        if not isinstance(v, (torch.Tensor, torch.SymInt, int, float, bool)):
            missing.append(n)
        return v

    out = fx.node.map_arg(node.args[0], value)
    if missing:
        return None
    return tree_map(lambda v: _fresh_fake(v) if isinstance(v, torch.Tensor) else v, out)


def _fresh_fake(v: torch.Tensor) -> torch.Tensor:
    """A tensor of the fake mode now active with ``v``'s sizes, strides and storage offset
    (symbolic: one shape env), so Inductor sees the alignment the real input will have."""
    if v.storage_offset() == 0:
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
    base = torch.empty(v.untyped_storage().nbytes() // v.element_size(), dtype=v.dtype, device=v.device)
    return base.as_strided(v.shape, v.stride(), v.storage_offset())


# ---- vattn.compile -----------------------------------------------------------------------


class VattnCompiledModel(nn.Module):
    """A model compiled by ``vattn.compile``; call it like the model.

    Attributes the model has (``compute_logits``, ``config``, ...) are forwarded to it.
    ``backend`` holds the compile statistics and the compiled pieces.
    """

    def __init__(
        self,
        model: nn.Module,
        config: VattnConfig,
        *,
        dynamic: bool | str,
        dynamic_arg_dims: Mapping[str, int | Sequence[int]] | None,
    ) -> None:
        if dynamic not in (True, False, "unbacked", "backed"):
            raise ValueError(f"vattn.compile: dynamic must be True, False, 'unbacked' or 'backed', got {dynamic!r}.")
        super().__init__()
        self.model = model
        self.config = config
        self.dynamic = "backed" if dynamic is True else dynamic
        self.backend = VattnBackend(config, suppress_guards=self.dynamic == "backed")
        self._dims = dict(dynamic_arg_dims) if dynamic_arg_dims is not None else None
        self._signature = inspect.signature(model.forward)
        compiled = torch.compile(model, backend=self.backend, fullgraph=True, dynamic=False)
        object.__setattr__(self, "_compiled", compiled)  # not a registered submodule
        self._aot: Any = None  # the trace loaded from / saved to CompilationConfig.cache_dir
        #: Where Dynamo's trace is kept: ``CompilationConfig.cache_dir``, else the default
        #: location (``$VATTN_CACHE_ROOT/compile``) unless ``VATTN_DISABLE_COMPILE_CACHE``; None: nowhere.
        self.cache_dir = config.compilation.cache_dir
        self._cache_dir_default = self.cache_dir is None
        if self.cache_dir is None and not envs.VATTN_DISABLE_COMPILE_CACHE:
            self.cache_dir = os.path.join(envs.VATTN_CACHE_ROOT, "compile")
        self._aot_pending = self.cache_dir is not None
        self._aot_missed = False
        self.trace_path: str | None = None  # the stored trace's file, once the first call chose it
        self.trace_loaded = False  # whether the first call loaded it (else traced, and saved it)
        self.trace_load_seconds: dict[str, float] = {}  # aot_cache.load's steps, when it loaded
        # Calls skip Dynamo's per-call guard evaluation once a call of the same signature passed it.
        self._direct = DirectDispatch(model, lambda: self.backend.counter.num_graphs_seen)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["model"], name)

    def _mark_dynamic(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        mark = torch._dynamo.decorators.mark_unbacked if self.dynamic == "unbacked" else torch._dynamo.mark_dynamic
        if self._dims is None:  # dim 0 of every tensor argument (token-major inputs)
            for v in (*args, *kwargs.values()):
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    mark(v, 0)
            return
        bound = self._signature.bind_partial(*args, **kwargs).arguments
        for name, dims in self._dims.items():
            v = bound.get(name)
            if isinstance(v, torch.Tensor):
                for d in [dims] if isinstance(dims, int) else dims:
                    mark(v, d % v.dim())

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        fn, key = (None, None)
        if not torch.compiler.is_compiling() and not envs.VATTN_COMPILE_CHECK_GUARDS:
            fn, key = self._direct.lookup(args, kwargs)
        if fn is not None:  # a call signature Dynamo's guards accepted before (see dispatch.py)
            with torch.no_grad():
                return fn(self.model, *args, **kwargs)
        with torch.no_grad(), self._trace_config():
            if self._aot_pending:
                self._aot_pending = False
                self._aot = self._load_or_capture(args, kwargs)
                if self._aot is not None:
                    self._direct.use(self._aot.fn)
            if self._aot is not None:
                if self._aot.guard_check(self.model, *args, **kwargs):
                    self._direct.validate(key, self.backend.counter.num_graphs_seen)
                    return self._aot.fn(self.model, *args, **kwargs)
                if not self._aot_missed:
                    self._aot_missed = True
                    (logger.info if self._cache_dir_default else logger.warning)(
                        "vattn.compile: a call fails the guards of the stored trace (e.g. an input of "
                        "another dtype or rank); it runs through torch.compile, which traces it anew.")
            # Marks only for Dynamo's tracing: a stored trace's guards take a marked input
            # for a new marking (torch 2.13), so calls through it pass inputs as they are.
            if self.dynamic:
                self._mark_dynamic(args, kwargs)
            graphs = self.backend.counter.num_graphs_seen
            with self._direct.capturing():
                out = self._compiled(*args, **kwargs)
            self._direct.validate(key, graphs)
            return out

    def _trace_config(self) -> Any:
        if self.dynamic == "backed":
            return torch.fx.experimental._config.patch(backed_size_oblivious=True)
        return contextlib.nullcontext()

    def _load_or_capture(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The first call with ``CompilationConfig.cache_dir`` set: load the stored trace, or
        trace ahead of time and store it. None (reason logged): the ordinary path."""
        from vattn.compile_passes import aot_cache

        why = aot_cache.aot_supported()
        if why is not None:
            (logger.debug if self._cache_dir_default else logger.warning)(
                "vattn.compile: CompilationConfig.cache_dir is ignored: %s.", why)
            return None
        bound = self._signature.bind_partial(*args, **kwargs).arguments
        inputs = [(name, v, self._dynamic_dims(name, v)) for name, v in bound.items()]
        key = aot_cache.cache_key(self.model, self.config, dynamic=self.dynamic, inputs=inputs)
        path = self.trace_path = aot_cache.path_for(self.cache_dir, self.model, key)
        fn = aot_cache.load(path, self.model, self.backend, self.trace_load_seconds)
        if fn is not None:
            self.trace_loaded = True
            return fn
        self.backend.reset()
        if self.dynamic:
            self._mark_dynamic(args, kwargs)
        try:
            return aot_cache.compile_and_save(self.model, self.backend, args, kwargs, path)
        except Exception as e:  # noqa: BLE001  (the ordinary path still compiles the model)
            logger.warning("vattn.compile: ahead-of-time capture failed (%s: %s); compiling without "
                           "CompilationConfig.cache_dir%s.", type(e).__name__, e,
                           " (VATTN_DISABLE_COMPILE_CACHE=1 skips the attempt)" if self._cache_dir_default else "")
            self.backend.reset()
            return None

    def _dynamic_dims(self, name: str, v: Any) -> tuple[int, ...]:
        if not self.dynamic or not isinstance(v, torch.Tensor) or v.dim() == 0:
            return ()
        if self._dims is None:
            return (0,)
        dims = self._dims.get(name, ())
        return tuple(d % v.dim() for d in ([dims] if isinstance(dims, int) else dims))


def compile(  # noqa: A001  (mirrors torch.compile)
    model: nn.Module,
    config: VattnConfig | None = None,
    *,
    dynamic: bool | str = True,
    dynamic_arg_dims: Mapping[str, int | Sequence[int]] | None = None,
) -> VattnCompiledModel:
    """Compile ``model`` for inference: whole-graph Dynamo, split at attention, Inductor per piece.

    Args:
        model: an ``nn.Module`` whose attention layers are ``vattn.Attention`` (built under ``config``).
        config: the config the model was built under (default: the current one).
        dynamic: True (= ``"backed"``) marks the token dimension dynamic as a backed symbol,
            traced size-obliviously (see the module docstring): one graph for every token
            count, Inductor's best code. ``"unbacked"`` marks it unbacked: never a recompile,
            whatever the model does, at the price of extra copies and kernels. False: every
            new token count compiles again.
        dynamic_arg_dims: forward-argument name -> dim(s) to mark dynamic; default: dim 0 of
            every tensor argument (``input_ids`` (T,), ``positions`` (T,), ...). Give e.g.
            ``{"input_ids": 0, "positions": -1}`` for M-RoPE positions of shape (3, T).

    Returns a ``VattnCompiledModel``. Compilation happens on the first call, which must run
    inside ``vattn.set_forward_context`` (metadata ``None`` is fine). The model runs under
    ``torch.no_grad()``.

    Example::

        compiled = vattn.compile(model, cfg)
        with vattn.set_forward_context(kv.build_metadata(common), cfg):
            hidden = compiled(input_ids, positions)
        compiled.backend.counter.num_inductor_compiles   # about 3 for any depth
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"vattn.compile expects an nn.Module, got {type(model).__name__}.")
    config = config if config is not None else get_current_vattn_config()
    if not isinstance(config, VattnConfig):
        raise TypeError(f"vattn.compile: config must be a vattn.VattnConfig, got {type(config).__name__}.")
    return VattnCompiledModel(model, config, dynamic=dynamic, dynamic_arg_dims=dynamic_arg_dims)

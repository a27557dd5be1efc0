"""``VattnBackend``: the ``torch.compile`` backend behind ``vattn.compile``.

Dynamo traces the whole model (``fullgraph=True``). ``VattnBackend`` then:

0. hands each attention layer the rotary embedding of its q and k where it can take it over
   (``rope_fusion.py``, ``CompilationConfig.fuse_rope``);
1. splits the FX graph at the splitting ops (``CompilationConfig.splitting_ops``, by default
   the two ``vattn::unified_attention*`` ops; ``split.py``), so each attention op is alone in
   its own submodule and the rest forms *pieces* between them;
2. runs ``CompilationConfig.piece_passes`` on each piece's graph, folds linear layers of one
   input whose weights are packed in one buffer into one GEMM (``packed_linears.py``), then
   compiles it with Inductor (``inductor.py``), with vattn's ``PostGradPassManager``
   installed as ``post_grad_custom_post_pass`` for that compile only;
3. compiles identical pieces once (``pieces.py``): every decoder layer's piece is the same
   graph, so a model of N layers compiles about 3 pieces (first, middle, last), whatever N;
4. for ``CompilationConfig.compile_sizes`` (vLLM's name), compiles each distinct piece once
   more for an exact token count, on the first step of that size, from that step's real
   inputs (``StaticSizes`` in ``piecewise.py``; coordinate-descent tuning on, so Inductor
   turns 1-token matrix multiplies into fused matrix-vector reductions);
5. returns the split module, which runs the pieces (each wrapped in a ``CUDAGraphPiece`` for
   piecewise CUDA graphs) and calls the attention ops' Python implementations directly.

Counters: ``VattnBackend.counter`` (per backend) and ``compilation_counter`` (process-wide).

| counter | meaning |
| --- | --- |
| num_graphs_seen | FX graphs Dynamo handed to the backend (1 per compile) |
| num_pieces | pieces (non-splitting submodules) over those graphs |
| num_splitting_ops | attention ops left between pieces |
| num_inductor_compiles | pieces actually compiled (distinct graphs) |
| num_piece_reuses | pieces that reused an identical piece's compiled code |
| num_static_compiles | compiles for one exact token count (``compile_sizes``; lazily, per distinct piece) |
| num_packed_linear_groups | linear layers of one input over one packed weight, made one GEMM (``packed_linears.py``; per compiled piece) |
| num_rope_fusions | attention ops that took their q / k rotation over (``rope_fusion.py``; per traced graph) |
| compile_seconds | wall time spent compiling pieces |
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import time
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from vattn.compile_passes import packed_linears
from vattn.compile_passes.aot_cache import SerializableSplitModule
from vattn.compile_passes.inductor import compile_with_inductor, shape_guards_suppressed
from vattn.compile_passes.pass_manager import PostGradPassManager
from vattn.compile_passes.pieces import PieceCompiler, fake_inputs, piece_key, token_count_locator
from vattn.compile_passes.piecewise import CUDAGraphPiece, StaticSizes
from vattn.compile_passes.rope_fusion import fuse_rope
from vattn.compile_passes.split import SplitItem, direct_op_call, split_graph
from vattn.core.config import VattnConfig

__all__ = ["CompilationCounter", "VattnBackend", "compilation_counter"]

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
    num_packed_linear_groups: int = 0
    num_rope_fusions: int = 0
    compile_seconds: float = 0.0

    def snapshot(self) -> "CompilationCounter":
        return dataclasses.replace(self)


#: Process-wide totals over every ``VattnBackend``.
compilation_counter = CompilationCounter()


def bump(counter: CompilationCounter, **deltas: float) -> None:
    """Add ``deltas`` to ``counter`` and to the process-wide ``compilation_counter``."""
    for c in (counter, compilation_counter):
        for name, d in deltas.items():
            setattr(c, name, getattr(c, name) + d)


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
    def pass_manager(self) -> PostGradPassManager:
        if self._pass_manager is None:
            self._pass_manager = PostGradPassManager.from_config(self.config)
        return self._pass_manager

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        comp = self.config.compilation
        if comp.merge_packed_linears:
            packed_linears.mark(gm, example_inputs)  # before a capture is saved: a loaded trace has the tags
        # Before the split (which would put the rotation and the attention op in different
        # items) and before a capture is saved (a loaded trace has the rewrite).
        bump(self.counter, num_rope_fusions=fuse_rope(gm, comp.static_forward_context, comp.fuse_rope))
        if self.serializable:  # compiled later, as a loaded trace is (aot_cache.compile_and_save)
            self.captured = SerializableSplitModule(gm, None, self.splitting_ops)
            return self.captured
        return self.compile_graph(gm, example_inputs)

    def compile_graph(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> fx.GraphModule:
        """Split ``gm`` at the splitting ops and compile its pieces; returns the split module."""
        split_gm, items = split_graph(gm, self.splitting_ops)
        n_split = sum(i.is_splitting for i in items)
        bump(self.counter, num_graphs_seen=1, num_pieces=len(items) - n_split, num_splitting_ops=n_split)
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
            PieceCompiler(split_gm, to_compile, self).run(*fake_inputs(example_inputs))
        for item in items:
            if item.is_splitting and (fn := direct_op_call(item.graph)) is not None:
                split_gm.__dict__[item.name] = fn  # shadows the submodule in the generated code
        bump(self.counter, compile_seconds=time.perf_counter() - start)
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
            bump(self.counter, num_piece_reuses=1)
            return fn
        self._run_piece_passes(piece, example_inputs, None)
        if not self.config.compilation.use_inductor:
            fn = piece
        else:
            with shape_guards_suppressed(example_inputs, self.suppress_guards):
                fn = compile_with_inductor(piece, example_inputs, self.config.compilation, self.pass_manager)
            bump(self.counter, num_inductor_compiles=1)
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
        locate = token_count_locator(example_inputs)
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
        start = time.perf_counter()
        graph = fx.GraphModule(piece, copy.deepcopy(piece.graph))  # Inductor edits what it compiles
        self._run_piece_passes(graph, args, num_tokens)
        with torch.no_grad():
            fn = compile_with_inductor(graph, args, self.config.compilation, self.pass_manager,
                                       defaults={"coordinate_descent_tuning": True})
        elapsed = time.perf_counter() - start
        bump(self.counter, num_static_compiles=1, compile_seconds=elapsed)
        logger.info("vattn.compile: piece compiled for %d tokens (%.1fs)", num_tokens, elapsed)
        return fn

    def _run_piece_passes(self, graph: fx.GraphModule, example_inputs: Sequence[Any], num_tokens: int | None) -> None:
        """``CompilationConfig.piece_passes`` on ``graph`` (in place), in order, then the packed
        linears' rewrite (``packed_linears.py``) where ``merge_packed_linears`` is on."""
        for piece_pass in self.config.compilation.piece_passes:
            n = piece_pass(graph, example_inputs, num_tokens)
            logger.debug("vattn.compile: piece pass %s rewrote %s nodes (num_tokens=%s)",
                         getattr(piece_pass, "__name__", type(piece_pass).__name__), n, num_tokens)
        if self.config.compilation.merge_packed_linears:
            n = packed_linears.rewrite(graph, example_inputs)
            bump(self.counter, num_packed_linear_groups=n)
            logger.debug("vattn.compile: %d packed linear groups (num_tokens=%s)", n, num_tokens)

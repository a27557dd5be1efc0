"""``vattn.compile``: compile a model for inference with ``VattnBackend``.

``vattn.compile(model, cfg)`` marks the token dimension of the inputs dynamic as a *backed*
symbol (``torch._dynamo.mark_dynamic``) traced size-obliviously (``backed_size_oblivious``: no
0/1 specialisation) with Inductor's own shape guards suppressed, so one graph serves every
token count, 1 included. Inductor knows a backed symbol's example value, so it proves views
instead of copying and fuses reductions with their consumers. Python in the model must not ask
whether the token count is 1: a reshape of a strided q/k/v slice by the token count does, and
costs one recompile for 1-token steps (split heads on the contiguous projection output
instead, as ``examples/model.py`` does). ``dynamic="unbacked"``
(``torch._dynamo.decorators.mark_unbacked``) never specialises and never recompiles, whatever
the model does, at the price of extra copies and split kernels; Python branching on the token
count then fails at trace time with a data-dependent-guard error naming the line.

Metadata reaches the attention ops through the forward context, not as graph inputs, so
changing batch composition never recompiles. ``VattnCompiledModel`` keeps Dynamo's trace on
disk (``aot_cache.py``) and skips Dynamo's per-call guard evaluation for call signatures its
guards accepted once (``dispatch.py``).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from vattn import envs
from vattn.compile_passes import aot_cache
from vattn.compile_passes.backend import VattnBackend
from vattn.compile_passes.dispatch import DirectDispatch
from vattn.compile_passes.pass_manager import get_pass_class
from vattn.core.config import VattnConfig, get_current_vattn_config

__all__ = ["VattnCompiledModel", "compile"]

logger = logging.getLogger("vattn.compile")


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
                    mark(v, _dim(name, d, v))

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
            # The default cache is best effort (info); a cache_dir the user set is worth a warning.
            (logger.info if self._cache_dir_default else logger.warning)(
                "vattn.compile: ahead-of-time capture failed (%s: %s); compiling without "
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
        return tuple(_dim(name, d, v) for d in ([dims] if isinstance(dims, int) else dims))


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
    _check_compilation(config)
    _check_dynamic_arg_dims(model, dynamic_arg_dims)
    return VattnCompiledModel(model, config, dynamic=dynamic, dynamic_arg_dims=dynamic_arg_dims)


def _check_compilation(config: VattnConfig) -> None:
    """Refuse, before anything is traced, ``CompilationConfig`` values the first call would fail
    on deep inside Dynamo / Inductor (or silently misread, such as a string of op names)."""
    comp = config.compilation
    where = "vattn.compile: CompilationConfig"
    for name in ("splitting_ops", "passes"):
        value = getattr(comp, name)
        if not isinstance(value, (tuple, list)) or not all(isinstance(v, str) for v in value):
            raise TypeError(f"{where}.{name} must be a tuple of names, got {value!r}"
                            + (f"; write ({value!r},) for one." if isinstance(value, str) else "."))
    for name in comp.passes:
        get_pass_class(name)  # ValueError naming the known passes
    for name in ("use_inductor", "merge_packed_linears"):
        if not isinstance(getattr(comp, name), bool):
            raise TypeError(f"{where}.{name} must be True or False, got {getattr(comp, name)!r}.")
    for name in ("debug_dump_path", "cache_dir"):
        value = getattr(comp, name)
        if value is not None and not isinstance(value, (str, os.PathLike)):
            raise TypeError(f"{where}.{name} must be a directory path (str) or None, got {value!r}.")
    if comp.inductor_compile_config:
        import torch._inductor.config as inductor_config  # vattn.compile runs Inductor anyway

        known = inductor_config.get_config_copy()
        unknown = sorted(k for k in comp.inductor_compile_config if k not in known)
        if unknown:
            raise ValueError(f"{where}.inductor_compile_config has names torch._inductor.config does not know: "
                             f"{unknown}; use its option names, e.g. 'max_autotune' or 'triton.enable_pdl'.")


def _check_dynamic_arg_dims(model: nn.Module, dims: Mapping[str, int | Sequence[int]] | None) -> None:
    """``dynamic_arg_dims`` names parameters of ``model.forward`` and gives int dims (their range
    is checked against each tensor when it is marked)."""
    if dims is None:
        return
    if not isinstance(dims, Mapping):
        raise TypeError(f"vattn.compile: dynamic_arg_dims must map forward-argument names to dims, e.g. "
                        f"{{'input_ids': 0, 'positions': -1}}; got {dims!r}.")
    params = inspect.signature(model.forward).parameters
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for name, d in dims.items():
        if name not in params and not takes_kwargs:
            raise ValueError(f"vattn.compile: dynamic_arg_dims names {name!r}, which {type(model).__name__}.forward "
                             f"does not take; its arguments: {list(params)}.")
        ds = [d] if isinstance(d, int) else d
        if not isinstance(ds, (tuple, list)) or not all(isinstance(x, int) and not isinstance(x, bool) for x in ds):
            raise TypeError(f"vattn.compile: dynamic_arg_dims[{name!r}] must be a dim (int) or a tuple of dims, "
                            f"got {d!r}.")


def _dim(name: str, d: int, v: torch.Tensor) -> int:
    """Dim ``d`` of argument ``name`` made non-negative, or a ``ValueError`` if ``v`` has no such dim."""
    if not -v.dim() <= d < v.dim():
        raise ValueError(f"vattn.compile: dynamic_arg_dims[{name!r}] = {d}, but {name} has shape "
                         f"{tuple(v.shape)} (dims {-v.dim()} to {v.dim() - 1}); give the token dimension's index.")
    return d % v.dim()

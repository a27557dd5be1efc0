"""Dynamo's trace on disk: ``CompilationConfig.cache_dir`` skips Dynamo on a warm start.

Inductor's cache makes a second start compile no kernel again, but Dynamo still traces the
whole model in Python, a cost that grows with depth (``benchmarks/bench_compile.py`` measures
a cold and a warm start). With a cache directory
(``cache_dir``; by default ``$VATTN_CACHE_ROOT/compile``, off with
``VATTN_DISABLE_COMPILE_CACHE=1``), ``vattn.compile`` captures the model ahead of time
(``torch._dynamo.aot_compile``, the precompile path vLLM uses), saves Dynamo's output (the
transformed bytecode, the guards and the FX graph) in one file per model, config and input
signature, and on the next start loads that file instead of tracing. Loading runs vattn's
backend on the stored graph again (split, compile each distinct piece), which Inductor's
cache serves.

The file is keyed by everything that changes the trace and does not show in the guards:
torch and vattn versions, the classes of the model and its submodules, its parameter shapes
and dtypes, the attention layers and their backends, the config, vattn's environment
variables, the inputs' dtypes, ranks and dynamic dims, and the distributed rank. Guards on
the inputs and the model's attributes are stored with the trace and checked on every call
(those Dynamo cannot serialize are left out: ``_storable_guards``); a call that fails them
runs the ordinary ``torch.compile`` path. The file also holds a hash of each module whose
code Dynamo traced (the model's, vattn's, torch's): a file whose modules changed since is
stale, and a fresh trace replaces it.

Needs ``torch._dynamo.aot_compile`` (torch 2.10+); elsewhere ``cache_dir`` logs why and is ignored.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import hashlib
import importlib
import inspect
import logging
import os
import pickle
import sys
import time
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from vattn.compile_passes.trace_state import saving_trace
from vattn.mixers.base import MambaBase

__all__ = ["SerializableSplitModule", "aot_supported", "cache_key", "compile_and_save", "load", "path_for", "save"]

logger = logging.getLogger("vattn.compile")

try:
    from torch._dynamo.aot_compile import SerializableCallable as _SerializableBase
except ImportError:  # torch without precompile: cache_dir is ignored (aot_supported says why)
    _SerializableBase = object  # type: ignore[assignment,misc]

# Wrappers unpickled while a stored trace loads (deserialisation is a classmethod given only
# bytes); ``load`` compiles them once it has checked the file is not stale.
_loaded: contextvars.ContextVar["list[SerializableSplitModule] | None"] = contextvars.ContextVar(
    "vattn_loaded_split_modules", default=None)

_FORMAT = 2  # bump when what a file holds changes (2: traces carry the RoPE rewrite, rope_fusion.py)


def aot_supported() -> str | None:
    """None when this torch can save and load a Dynamo trace; else the reason it cannot."""
    try:
        from torch._dynamo import aot_compile

        getattr(aot_compile, "aot_compile_fullgraph")
        getattr(aot_compile, "AOTCompiledFunction")
        from torch.fx._graph_pickler import GraphPickler  # noqa: F401
    except (ImportError, AttributeError) as e:
        return f"torch {torch.__version__} has no ahead-of-time Dynamo capture ({e})"
    return None


class SerializableSplitModule(_SerializableBase):  # type: ignore[misc,valid-type]
    """What ``VattnBackend`` returns under an ahead-of-time capture: the split module,
    plus the Dynamo graph it came from, which is what gets saved.

    Saving pickles the Dynamo graph (``GraphPickler``: ops by name, fake tensors and
    symbolic sizes with their shape environment). Loading unpickles it into a fresh fake
    mode; ``compile`` then runs a backend on it with the placeholders' fake values as the
    example inputs: the same split and the same pieces, found in Inductor's cache.
    """

    def __init__(self, graph_module: fx.GraphModule, runner: Callable[..., Any] | None,
                 splitting_ops: Sequence[str] = ()) -> None:
        self.graph_module = graph_module
        self.runner = runner
        self.splitting_ops = tuple(splitting_ops)

    def __call__(self, *args: Any) -> Any:
        if self.runner is None:
            raise RuntimeError("a loaded vattn trace runs only after vattn.compile compiled it (aot_cache.load).")
        return self.runner(*args)

    @classmethod
    def serialize_compile_artifacts(cls, fn: "SerializableSplitModule") -> bytes:
        from torch.fx._graph_pickler import Options

        from vattn.compile_passes.split import boundary_nodes

        # Dynamo's bookkeeping per placeholder holds the real example tensors: not saved. Of
        # the fake values, only those at the split's boundaries are used after loading (the
        # backend's example inputs and its pieces' outputs); unpickling each of the others
        # rebuilds a fake tensor (about 1 s for 32 layers), so they are saved as None: the
        # key must stay, since AOTAutograd's cache treats a method call on a node without
        # one as uncacheable (it bypassed the cache for every loaded piece).
        gm = fn.graph_module
        keep = boundary_nodes(gm, fn.splitting_ops)
        saved = [(n, k, n.meta.pop(k)) for n in gm.graph.nodes for k in ("grapharg", "example_value")
                 if k in n.meta and (k == "grapharg" or n not in keep)]
        for n, k, _ in saved:
            if k == "example_value":
                n.meta[k] = None
        try:
            return _pickler().dumps(gm, Options(ops_filter=None))
        finally:
            for n, k, v in saved:
                n.meta[k] = v

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> "SerializableSplitModule":
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx._graph_pickler import GraphPickler
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        loaded = _loaded.get()
        if loaded is None:
            raise RuntimeError("a vattn trace loads only through vattn.compile (CompilationConfig.cache_dir).")
        gm = GraphPickler.loads(data, FakeTensorMode(shape_env=ShapeEnv()))
        fn = cls(gm, None)  # the splitting ops come from the backend that compiles it
        loaded.append(fn)
        return fn

    def compile(self, backend: Any) -> None:
        """Run ``backend`` on the loaded graph, with its placeholders' fake values as inputs."""
        from torch._guards import TracingContext, detect_fake_mode, tracing

        example_inputs = [n.meta["example_value"] for n in self.graph_module.graph.nodes if n.op == "placeholder"]
        fake_mode = detect_fake_mode(example_inputs)
        self.splitting_ops = tuple(backend.splitting_ops)
        with tracing(TracingContext(fake_mode)), _trace_config(backend):
            self.runner = backend.compile_graph(self.graph_module, example_inputs)


@functools.cache
def _pickler() -> type:
    """``GraphPickler`` that also pickles what it misses in torch 2.11-2.13: the fake mode a
    view's base tensor still names (dropped: unpickling supplies the fresh one) and sympy's
    opaque unary functions (classes made at run time, rebuilt by name)."""
    import sympy
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler

    class _Pickler(GraphPickler):
        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, FakeTensorMode):
                return type(None), ()
            if inspect.isclass(obj) and issubclass(obj, sympy.Function) and hasattr(obj, "_torch_unpickler"):
                return obj._torch_unpickler, (obj._torch_handler_name,)
            return super().reducer_override(obj)

    return _Pickler


@contextlib.contextmanager
def _trace_config(backend: Any) -> Any:
    """The config the backend ran under during the original trace (backed, size-oblivious symbols)."""
    if backend.suppress_guards:
        with torch.fx.experimental._config.patch(backed_size_oblivious=True):
            yield
    else:
        yield


# ---- the key -------------------------------------------------------------------------------


def _tensor_sig(t: torch.Tensor) -> tuple[Any, ...]:
    return (tuple(t.shape), str(t.dtype), t.device.type, t.requires_grad)


def _input_sig(v: Any, dims: Sequence[int]) -> tuple[Any, ...]:
    if isinstance(v, torch.Tensor):
        return ("tensor", str(v.dtype), v.dim(), v.device.type, tuple(sorted(d % max(v.dim(), 1) for d in dims)))
    if v is None or isinstance(v, (bool, int, float, str)):
        return ("value", type(v).__name__, repr(v))
    return ("object", type(v).__module__, type(v).__qualname__)


def _layer_sig(name: str, layer: Any) -> tuple[Any, ...]:
    impl = getattr(layer, "impl", None)
    fields = ("num_heads", "num_kv_heads", "head_size", "kv_cache_dtype", "attn_type", "sliding_window")
    state = layer.get_kv_cache_spec(layer.dtype) if isinstance(layer, MambaBase) else None  # mixers' state
    return (name, type(impl).__module__ + "." + type(impl).__qualname__,
            *(repr(getattr(layer, f, None)) for f in fields), repr(state))


def cache_key(model: torch.nn.Module, config: Any, *, dynamic: Any, inputs: Sequence[tuple[str, Any, Sequence[int]]]) -> str:
    """Hex digest of what a stored trace depends on beyond its guards (see the module docstring).

    Args:
        inputs: ``(argument name, value, dims marked dynamic)`` for each forward argument.
    """
    from vattn import envs
    from vattn._version import __version__

    cc = config.compilation
    compilation = {f.name: repr(getattr(cc, f.name)) for f in dataclasses.fields(cc)
                   if f.name not in ("static_forward_context", "cache_dir", "piece_passes")}  # not in the trace
    rank = (torch.distributed.get_rank(), torch.distributed.get_world_size()) \
        if torch.distributed.is_available() and torch.distributed.is_initialized() else None
    factors = {
        "format": _FORMAT,
        "versions": (torch.__version__, __version__, sys.version_info[:2]),
        "model": f"{type(model).__module__}.{type(model).__qualname__}",
        "modules": sorted({f"{type(m).__module__}.{type(m).__qualname__}" for m in model.modules()}),
        "params": [(n, *_tensor_sig(p)) for n, p in model.named_parameters()],
        "buffers": [(n, *_tensor_sig(b)) for n, b in model.named_buffers()],
        "layers": [_layer_sig(n, layer) for n, layer in cc.static_forward_context.items()],
        "cache": repr(config.cache),
        "compilation": compilation,
        "envs": {name: repr(getattr(envs, name)) for name in envs.environment_variables},
        "dynamic": repr(dynamic),
        "inputs": [(name, _input_sig(v, dims)) for name, v, dims in inputs],
        "rank": rank,
    }
    return hashlib.sha256(repr(factors).encode()).hexdigest()


# ---- save and load -------------------------------------------------------------------------


def path_for(cache_dir: str, model: torch.nn.Module, key: str) -> str:
    return os.path.join(cache_dir, f"{type(model).__name__}-{key[:24]}.dynamo")


def compile_and_save(model: torch.nn.Module, backend: Any, args: tuple[Any, ...],
                     kwargs: dict[str, Any], path: str) -> Any:
    """Trace ``model`` ahead of time on ``(args, kwargs)`` (dims already marked dynamic),
    compile it with ``backend`` and save the trace to ``path``. Returns the
    ``AOTCompiledFunction`` (call it as ``fn(model, *args, **kwargs)``).

    The backend compiles the captured graph after the capture, exactly as ``load`` compiles
    a loaded one (not inside the capture, which changes AOTAutograd's configuration and so
    the cache keys of every piece): the next start then finds each piece in the caches.
    """
    from torch._dynamo.aot_compile import aot_compile_fullgraph
    from torch._dynamo.hooks import Hooks

    backend.serializable, backend.captured = True, None
    token = saving_trace.set(True)
    try:
        fn = aot_compile_fullgraph(model, (args, kwargs), hooks=Hooks(guard_filter_fn=_storable_guards),
                                   backend=backend, dynamic=False)
    finally:
        backend.serializable = False
        saving_trace.reset(token)
    captured, backend.captured = backend.captured, None
    if not isinstance(captured, SerializableSplitModule):
        raise RuntimeError("the ahead-of-time capture did not reach vattn's backend")
    captured.compile(backend)  # before saving: a trace that does not compile is not stored
    token = saving_trace.set(True)
    try:
        save(fn, path)
    finally:
        saving_trace.reset(token)
    return fn


def _storable_guards(entries: Sequence[Any]) -> list[bool]:
    """Which guards a stored trace keeps: Dynamo's default for ``aot_compile_fullgraph`` (no
    guards on globals, none of a type it cannot serialize), and also none *derived* from such
    a type. ``transformers``' forward decorators read ``func.__code__`` from a closure cell,
    which Dynamo guards as a constant derived from the code object's identity: no file can
    hold that, and the trace's module hashes (see ``save``) already cover the code it stands for."""
    from torch._dynamo.guards import CheckFunctionManager

    unsupported = set(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)
    return [not (g.is_global or g.guard_type in unsupported
                 or unsupported.intersection(getattr(g, "derived_guard_types", None) or ()))
            for g in entries]


def _source_hash(module: str) -> str | None:
    """sha256 of a module's source as it is now (None if it does not import)."""
    try:
        source = inspect.getsource(importlib.import_module(module))  # linecache re-reads edited files
    except Exception:  # noqa: BLE001  (a module that no longer imports cannot match)
        return None
    return hashlib.sha256(source.encode()).hexdigest()


def save(fn: Any, path: str) -> None:
    """Write ``fn``'s trace, with the hashes of the modules Dynamo traced, to ``path``
    atomically (a failure is logged: the compiled model works without the file)."""
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        modules = {src.module for src in fn.source_info().inlined_sources}
        data = pickle.dumps({"format": _FORMAT, "sources": {m: _source_hash(m) for m in sorted(modules)},
                             "trace": type(fn).serialize(fn).serialized_data})
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        logger.info("vattn.compile: saved Dynamo's trace to %s (%.1f MiB)", path, len(data) / 2**20)
    except Exception as e:  # noqa: BLE001
        logger.warning("vattn.compile: could not save Dynamo's trace to %s (%s: %s); the next start traces again.",
                       path, type(e).__name__, e)


def load(path: str, model: torch.nn.Module, backend: Any,
         seconds: dict[str, float] | None = None) -> Any | None:
    """The ``AOTCompiledFunction`` stored at ``path``, compiled by ``backend``; None (with
    the reason logged) when there is no file, a module it traced has changed since, or it
    does not load. ``seconds`` (if given) gets the time of each step: ``read`` (the file and
    the staleness check), ``deserialize`` (bytecode, guards, the graph), ``backend`` (split
    and compile of the pieces, from Inductor's cache)."""
    from torch._dynamo.aot_compile import AOTCompiledFunction

    if not os.path.exists(path):
        return None
    seconds = {} if seconds is None else seconds
    t0 = time.perf_counter()
    loaded: list[SerializableSplitModule] = []
    token = _loaded.set(loaded)
    try:
        with open(path, "rb") as f:
            stored = pickle.load(f)
        if not isinstance(stored, dict) or stored.get("format") != _FORMAT:
            raise ValueError(f"not a vattn trace file of format {_FORMAT}")
        stale = sorted(m for m, h in stored["sources"].items() if h is None or _source_hash(m) != h)
        if stale:
            logger.info("vattn.compile: the stored trace %s is stale (changed since: %s); tracing again.",
                        path, ", ".join(stale))
            return None
        t1 = time.perf_counter()
        seconds["read"] = t1 - t0
        fn = AOTCompiledFunction.deserialize(stored["trace"], f_globals=inspect.unwrap(type(model).forward).__globals__)
    except Exception as e:  # noqa: BLE001  (another torch, a changed class, a torn file: trace again)
        logger.warning("vattn.compile: ignoring the stored trace %s (%s: %s); tracing again.", path, type(e).__name__, e)
        return None
    finally:
        _loaded.reset(token)
    if len(loaded) != 1:
        logger.warning("vattn.compile: the stored trace %s holds %d graphs, expected 1; tracing again.", path, len(loaded))
        return None
    t2 = time.perf_counter()
    seconds["deserialize"] = t2 - t1
    loaded[0].compile(backend)
    seconds["backend"] = time.perf_counter() - t2
    logger.info("vattn.compile: loaded Dynamo's trace from %s in %.1f s (%s)", path, time.perf_counter() - t0,
                ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items()))
    return fn

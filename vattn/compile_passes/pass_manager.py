"""The post-grad pass manager: vattn's FX passes as one Inductor ``CustomGraphPass``.

The compile backend installs a ``PostGradPassManager`` as Inductor's
``post_grad_custom_post_pass`` (a config patch around each piece's compile). It runs the
passes named in ``cfg.compilation.passes``, in that order, on the post-grad (ATen,
functionalized) graph. ``uuid()`` hashes the manager's and every pass's source file and
options, so Inductor's FX-graph cache is invalidated exactly when a pass changes.

Writing a pass: subclass ``VattnPass``, set ``name``, implement ``apply(graph) -> int``
(the number of rewrites), and register it::

    class MyPass(VattnPass):
        name = "my_pass"
        def apply(self, graph: torch.fx.Graph) -> int: ...

    register_pass(MyPass)            # or add "my_pass": "module:Class" to BUILTIN_PASSES

With ``cfg.compilation.debug_dump_path`` set, the graph is written before the first pass
and after each pass (``<path>/<manager>_<call>_<k>_<stage>.py``).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import logging
import os
import sys
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Sequence

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from vattn.core.config import VattnConfig

__all__ = [
    "BUILTIN_PASSES",
    "PostGradPassManager",
    "VattnPass",
    "get_pass_class",
    "node_value",
    "register_pass",
]

logger = logging.getLogger("vattn.compile")

#: Pass name -> "module:ClassName" (imported on first use).
BUILTIN_PASSES: dict[str, str] = {
    "noop_elimination": "vattn.compile_passes.noop_elimination:NoOpEliminationPass",
    "query_quant_fusion": "vattn.compile_passes.fusion_query_quant:QueryQuantFusionPass",
    "attn_quant_fusion": "vattn.compile_passes.fusion_attn_quant:AttnQuantFusionPass",
    "defunctionalize": "vattn.compile_passes.defunctionalize:DefunctionalizePass",
    "unfuse_addmm": "vattn.compile_passes.unfuse_addmm:UnfuseAddmmPass",
}
_registered: dict[str, type["VattnPass"]] = {}


def node_value(n: Any) -> "torch.Tensor | None":
    """The (fake) tensor a post-grad graph node produces (``meta["val"]``), or None."""
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _file_hash(obj: Any) -> str:
    """sha256 of the source file defining ``obj`` (its class source when the file is unreadable)."""
    try:
        path = inspect.getfile(obj)
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except (OSError, TypeError):
        return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()


class VattnPass(ABC):
    """One post-grad graph pass.

    Args:
        config: the model's config (passes may read the cache dtype etc.).
        **options: pass options; they are part of ``uuid()``.

    ``matches`` counts rewrites over every call; ``last_matches`` those of the last call.
    """

    name: ClassVar[str] = ""

    def __init__(self, config: VattnConfig | None = None, **options: Any) -> None:
        self.config = config
        self.options = dict(options)
        self.matches = 0
        self.last_matches = 0

    @abstractmethod
    def apply(self, graph: fx.Graph) -> int:
        """Rewrite ``graph`` in place; return the number of rewrites (matches)."""

    def __call__(self, graph: fx.Graph) -> int:
        n = int(self.apply(graph))
        self.last_matches = n
        self.matches += n
        return n

    def uuid(self) -> str:
        """Changes whenever the pass's source file or its options change."""
        opts = json.dumps(self.options, sort_keys=True, default=repr)
        return hashlib.sha256(f"{type(self).__qualname__}|{_file_hash(type(self))}|{opts}".encode()).hexdigest()


def register_pass(cls: type[VattnPass]) -> type[VattnPass]:
    """Make ``cls`` selectable by ``cls.name`` in ``cfg.compilation.passes`` (usable as a decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, VattnPass)) or not cls.name:
        raise TypeError(f"register_pass expects a VattnPass subclass with a non-empty name, got {cls!r}.")
    _registered[cls.name] = cls
    return cls


def get_pass_class(name: str) -> type[VattnPass]:
    """The pass class registered under ``name``."""
    if name in _registered:
        return _registered[name]
    path = BUILTIN_PASSES.get(name)
    if path is None:
        raise ValueError(
            f"unknown pass {name!r} in cfg.compilation.passes; known passes: "
            f"{sorted({*BUILTIN_PASSES, *_registered})}. Register new ones with "
            "vattn.compile_passes.pass_manager.register_pass."
        )
    module, cls_name = path.split(":")
    return getattr(importlib.import_module(module), cls_name)


class PostGradPassManager(CustomGraphPass):
    """Runs vattn's passes in order on Inductor's post-grad graph (see the module docstring).

    Args:
        passes: the pass instances, in order.
        debug_dump_path: directory for before/after graph dumps, or None.
    """

    def __init__(self, passes: Sequence[VattnPass] = (), *, debug_dump_path: str | None = None) -> None:
        for p in passes:
            if not isinstance(p, VattnPass):
                raise TypeError(f"PostGradPassManager: passes must be VattnPass instances, got {p!r}.")
        self.passes = list(passes)
        self.debug_dump_path = debug_dump_path
        self.num_calls = 0

    @classmethod
    def from_config(cls, config: VattnConfig) -> "PostGradPassManager":
        comp = config.compilation
        return cls([get_pass_class(n)(config) for n in comp.passes], debug_dump_path=comp.debug_dump_path)

    def __call__(self, graph: fx.Graph) -> None:
        self.num_calls += 1
        self._dump(graph, 0, "before")
        for k, p in enumerate(self.passes, start=1):
            n = p(graph)
            logger.debug("pass %s: %d matches", p.name, n)
            self._dump(graph, k, f"after_{p.name}")

    def uuid(self) -> str:
        h = hashlib.sha256(_file_hash(sys.modules[__name__]).encode())
        for p in self.passes:
            h.update(p.uuid().encode())
        return h.hexdigest()

    @property
    def matches(self) -> dict[str, int]:
        """Pass name -> rewrites over every call."""
        return {p.name: p.matches for p in self.passes}

    def _dump(self, graph: fx.Graph, k: int, stage: str) -> None:
        if not self.debug_dump_path:
            return
        os.makedirs(self.debug_dump_path, exist_ok=True)
        path = os.path.join(self.debug_dump_path, f"pm{id(self):x}_{self.num_calls:03d}_{k:02d}_{stage}.py")
        with open(path, "w") as f:
            f.write(graph.python_code("self").src)

"""``CUDAGraphRunner``: capture and replay CUDA graphs of a step function (see ``vattn.cudagraph``)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import math
import time
import weakref
from typing import Any, Iterator, Sequence
from unittest import mock

import torch
from torch.utils._pytree import tree_map

from vattn import envs
from vattn.core.enums import AttentionCGSupport
from vattn.core.metadata import CommonAttentionMetadata
from vattn.compile_passes import piecewise as _piecewise
from vattn.compile_passes.piecewise import PiecewiseRun, piecewise_run, weak_ref_tensor
from vattn.core.config import CUDAGraphMode, VattnConfig
from vattn.cudagraph.inputs import GraphInput, InputBuffers, check_inputs, resolve_inputs, split_call_args
from vattn.cudagraph.policy import (FULL_MODES, BatchDescriptor, bucket_size, choose_runtime_mode,
                                    is_uniform_decode, pad_common_attn_metadata, resolve_capture_sizes,
                                    resolve_cudagraph_mode)
from vattn.forward_context import set_forward_context
from vattn.kv_cache import PagedKVCache

__all__ = ["CUDAGraphRunner"]

logger = logging.getLogger("vattn.cudagraph")
M = CUDAGraphMode
_runner_keys = itertools.count(1)


def _tensor_addresses(metadata: dict[str, Any], device: torch.device) -> dict[tuple[int, str], int]:
    """(group index, field) -> data_ptr of every tensor field on ``device`` (the ones a graph
    reads; host mirrors are not) of each distinct metadata."""
    out: dict[tuple[int, str], int] = {}
    seen: dict[int, int] = {}
    for md in metadata.values():
        if md is None or id(md) in seen:
            continue
        g = seen.setdefault(id(md), len(seen))
        items = (
            {f.name: getattr(md, f.name) for f in dataclasses.fields(md)}
            if dataclasses.is_dataclass(md)
            else vars(md)
        )
        for name, v in items.items():
            if isinstance(v, torch.Tensor) and v.device == device:
                out[(g, name)] = v.data_ptr()
    return out


@dataclasses.dataclass
class _FullGraph:
    graph: "torch.cuda.CUDAGraph"
    output: Any
    addresses: dict[tuple[int, str], int]
    # The capture-time metadata stays alive: the graph read its tensors, and a freed
    # address handed to a fresh tensor would hide a builder that breaks the contract.
    metadata: dict[str, Any]
    checked: bool = False


def _release_pieces(pieces: list[Any], key: int) -> None:
    for piece in pieces:
        piece.release(key)


@contextlib.contextmanager
def _fast_capture() -> Iterator[None]:
    """Skip the gc.collect / empty_cache ``torch.cuda.graph`` does before every capture."""
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    with mock.patch("gc.collect", lambda *a, **k: 0), mock.patch("torch.cuda.empty_cache", lambda: None):
        yield


class CUDAGraphRunner:
    """Captures and replays CUDA graphs of a step function (see the ``vattn.cudagraph`` docstring).

    Args:
        model: the step function: a model, a ``vattn.compile``d model (needed for PIECEWISE) or
            any callable; called as ``model(*tensors)`` with one tensor per entry of ``inputs``
            inside the step's forward context. Its token-major outputs (dim 0 = tokens) are
            returned sliced to the real token count; other outputs as they are.
        config: the config the model was built under.
        kv_cache: the ``vattn.PagedKVCache`` bound to the model's layers.
        inputs: one ``vattn.GraphInput`` per tensor argument of ``model`` (dtype, non-token
            shape, token dimension); default ``(input_ids (T,) int64, positions (T,) int64)``.
        max_batch_size: the largest padded token count to capture (default: the config's).
        capture_sizes: explicit sizes (tokens); default 1, 2, 4, 8, 16, ... up to the max. Sizes
            above ``max_batch_size`` are dropped with a warning; if none is left, ``ValueError``.
        mode: default ``config.compilation.cudagraph_mode``.
        max_model_len: longest sequence, sets the capture block-table width
            (default: ``kv_cache.num_blocks * block_size``).
        show_progress: tqdm bar while capturing.

    Example (a step over embeddings and M-RoPE positions)::

        inputs = [vattn.GraphInput(torch.bfloat16, (hidden,), name="inputs_embeds"),
                  vattn.GraphInput(torch.long, (3,), token_dim=1, name="positions")]
        graphs = vattn.CUDAGraphRunner(step, cfg, kv, inputs=inputs, max_batch_size=64)
        hidden = graphs(inputs_embeds, positions, common)   # (T, hidden), (3, T), metadata
    """

    def __init__(
        self,
        model: Any,
        config: VattnConfig,
        kv_cache: Any,
        *,
        inputs: Sequence[GraphInput] | None = None,
        max_batch_size: int | None = None,
        capture_sizes: Sequence[int] | None = None,
        mode: CUDAGraphMode | None = None,
        max_model_len: int | None = None,
        show_progress: bool = True,
    ) -> None:
        if not callable(model):
            raise TypeError(f"CUDAGraphRunner: model must be callable (the step function), got {type(model).__name__}.")
        if not isinstance(config, VattnConfig):
            raise TypeError(f"CUDAGraphRunner: config must be a vattn.VattnConfig, got {type(config).__name__}.")
        requested = config.compilation.cudagraph_mode if mode is None else mode
        if not isinstance(requested, CUDAGraphMode):
            raise TypeError(f"CUDAGraphRunner: mode must be a vattn.CUDAGraphMode, got {requested!r}.")
        if not isinstance(kv_cache, PagedKVCache):
            raise TypeError(
                f"CUDAGraphRunner: kv_cache must be the vattn.PagedKVCache bound to the model's layers "
                f"(vattn.allocate_kv_cache(cfg, ...)), got {type(kv_cache).__name__}."
            )
        if max_model_len is not None and (
            isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 1
        ):
            raise ValueError(
                f"CUDAGraphRunner: max_model_len must be a positive int (the longest sequence, in tokens), got "
                f"{max_model_len!r}; leave it out for the cache's num_blocks * block_size."
            )
        self.inputs = resolve_inputs(inputs)
        self.model, self.config, self.kv = model, config, kv_cache
        self.sizes = resolve_capture_sizes(config, max_batch_size, capture_sizes)
        self.max_size = self.sizes[-1] if self.sizes else 0
        self.device = kv_cache.device or torch.device("cpu")
        self.show_progress = show_progress
        self.max_model_len = max_model_len or kv_cache.num_blocks * kv_cache.block_size
        # Imported here: vattn.compile's module loads Inductor, which an eager model never needs.
        from vattn.compile_passes.compiler import VattnCompiledModel

        has_piecewise = isinstance(model, VattnCompiledModel) and bool(model.config.compilation.splitting_ops)
        builders = [g.builder for g in kv_cache.groups]
        support = min((b.cudagraph_support for b in builders), default=AttentionCGSupport.ALWAYS)
        names = ", ".join(sorted({f"{type(b).__name__} ({b.cudagraph_support.name})" for b in builders}))
        self.requested_mode = requested
        self.mode, self.downgrade_reasons = resolve_cudagraph_mode(
            requested, on_cuda=self.device.type == "cuda", support=support, backends=names,
            has_piecewise=has_piecewise,
        )
        for why in self.downgrade_reasons:
            logger.warning("CUDAGraphRunner: mode %s downgraded: %s", requested.name, why)
        self.key = next(_runner_keys)  # this runner's piecewise graphs, in every piece
        self._pieces = model.backend.pieces if has_piecewise else []
        weakref.finalize(self, _release_pieces, self._pieces, self.key)
        self.pool: Any = None
        self.full_graphs: dict[int, _FullGraph] = {}
        self.captured = False
        self.stats: dict[str, float] = {}
        self.last_batch_descriptor: BatchDescriptor | None = None
        #: The persistent input buffers every graph reads (``buffers.views(n)``: the tensors of size n).
        self.buffers = InputBuffers(self.inputs, max(self.max_size, 1), self.device)

    # ---- dispatch ----------------------------------------------------------------------

    def dispatch(self, common: CommonAttentionMetadata) -> tuple[BatchDescriptor, CommonAttentionMetadata]:
        """The runtime mode and padded metadata for this step."""
        t = common.num_actual_tokens
        n = bucket_size(t, self.sizes) if self.mode is not M.NONE else None
        decode = is_uniform_decode(common)
        if n is None:
            return BatchDescriptor(M.NONE, t, common.num_reqs, decode), common
        full_ok = False
        if self.mode in FULL_MODES and (decode or self.mode is M.FULL):
            # Full graphs were captured with n requests: pad the requests too.
            padded = pad_common_attn_metadata(common, n, n)
            full_ok = self.kv.can_run_in_cudagraph(padded)
        mode = choose_runtime_mode(self.mode, captured=True, uniform_decode=decode, full_ok=full_ok)
        if mode is M.NONE:
            return BatchDescriptor(M.NONE, t, common.num_reqs, decode), common
        if mode is M.PIECEWISE:
            padded = pad_common_attn_metadata(common, n)
        return BatchDescriptor(mode, n, padded.num_reqs, decode), padded

    # ---- capture -----------------------------------------------------------------------

    def _dummy_common(self, n: int) -> CommonAttentionMetadata:
        """A decode batch of ``n`` requests of one token on block 0 that writes nothing (slot -1; mixer
        layers' scratch state slot)."""
        width = math.ceil(self.max_model_len / self.kv.block_size)
        dev = self.device
        qsl, seq = torch.arange(n + 1, dtype=torch.int32), torch.ones(n, dtype=torch.int32)
        return CommonAttentionMetadata(
            query_start_loc=qsl.to(dev), query_start_loc_cpu=qsl, seq_lens=seq.to(dev), seq_lens_cpu=seq,
            num_computed_tokens_cpu=torch.zeros(n, dtype=torch.int32), num_reqs=n, num_actual_tokens=n,
            max_query_len=1, block_table_tensor=torch.zeros((n, width), dtype=torch.int32, device=dev),
            slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=dev), max_seq_len=1,
            state_indices=torch.full((n,), -1, dtype=torch.int32, device=dev),  # mixers: the scratch slot
            state_indices_cpu=torch.full((n,), -1, dtype=torch.int32),
        )

    def capture(self) -> None:
        """Capture every size (largest first); idempotent."""
        if self.captured or self.mode is M.NONE:
            self.captured = True
            return
        from tqdm.auto import tqdm

        self.pool = torch.cuda.graph_pool_handle()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        warmup_s = 0.0
        with _fast_capture():  # frees cached blocks first, so measure the pool's growth after it
            mem0 = torch.cuda.memory_reserved(self.device)
            for n in tqdm(sorted(self.sizes, reverse=True), desc="Capturing CUDA graphs", disable=not self.show_progress):
                common = self._dummy_common(n)
                args = self.buffers.views(n)
                tw = time.perf_counter()
                with set_forward_context(self.kv.build_metadata(common), self.config), torch.no_grad():
                    self.model(*args)  # warm-up: compiles, autotunes, initialises lazily
                torch.cuda.synchronize()
                warmup_s += time.perf_counter() - tw
                if self.mode in FULL_MODES:
                    md = self.kv.build_metadata_for_cudagraph_capture(common)
                    bd = BatchDescriptor(M.FULL, n, n, True)
                    with set_forward_context(md, self.config, batch_descriptor=bd), torch.no_grad():
                        graph, out = _piecewise.capture_graph(functools.partial(self.model, *args), self.pool)
                    self.full_graphs[n] = _FullGraph(graph, tree_map(weak_ref_tensor, out), _tensor_addresses(md, self.device), md)
                if self.mode in (M.PIECEWISE, M.FULL_AND_PIECEWISE):
                    bd = BatchDescriptor(M.PIECEWISE, n, n, True)
                    run = PiecewiseRun(self.key, n, capture=True, pool=self.pool)
                    with set_forward_context(self.kv.build_metadata(common), self.config, batch_descriptor=bd):
                        with piecewise_run(run), torch.no_grad():
                            self.model(*args)
        torch.cuda.synchronize()
        total = time.perf_counter() - t0
        self.stats = {
            "capture_seconds": total - warmup_s,
            "warmup_seconds": warmup_s,
            "graph_memory_bytes": float(torch.cuda.memory_reserved(self.device) - mem0),
            "num_sizes": float(len(self.sizes)),
        }
        self.captured = True
        logger.info(
            "CUDAGraphRunner: captured %d sizes (%s) in %.2fs (+%.2fs warm-up), pool %.1f MiB",
            len(self.sizes), self.mode.name, total - warmup_s, warmup_s, self.stats["graph_memory_bytes"] / 2**20,
        )

    def release(self) -> None:
        """Drop every graph this runner captured (full and piecewise)."""
        self.full_graphs.clear()
        _release_pieces(self._pieces, self.key)
        self.captured = False

    # ---- replay ------------------------------------------------------------------------

    def __call__(self, *tensors: Any, common_attn_metadata: CommonAttentionMetadata | None = None) -> Any:
        """Run one step: ``runner(*tensors, common_attn_metadata)``.

        ``tensors`` are the step function's inputs for the T real tokens, as ``inputs``
        describes them; ``common_attn_metadata`` (last positional argument, or keyword) is the
        unpadded batch's metadata. The runner builds the backend metadata and sets the forward
        context itself. Returns the step's output with token-major tensors sliced to T rows;
        a replay's outputs are graph memory that the next call overwrites (``clone()`` to keep).
        """
        tensors, common = split_call_args(tensors, common_attn_metadata)
        check_inputs(self.inputs, tensors, common.num_actual_tokens, self.device)
        t = common.num_actual_tokens
        if not self.captured:
            self.capture()
        bd, padded = self.dispatch(common)
        self.last_batch_descriptor = bd
        if bd.mode is M.NONE:
            with set_forward_context(self.kv.build_metadata(common), self.config, batch_descriptor=bd):
                with torch.no_grad():
                    return self.model(*tensors)
        n = bd.num_tokens
        args = self.buffers.load(tensors, n)
        md = self.kv.build_metadata(padded)
        if bd.mode is M.FULL:
            entry = self.full_graphs[n]
            if envs.VATTN_CUDAGRAPH_DEBUG or not entry.checked:
                self._check_metadata(entry, md, n)
            entry.graph.replay()
            out = entry.output
        else:
            run = PiecewiseRun(self.key, n, check_addresses=envs.VATTN_CUDAGRAPH_DEBUG)
            with set_forward_context(md, self.config, batch_descriptor=bd), piecewise_run(run), torch.no_grad():
                out = self.model(*args)
        return tree_map(lambda x: x[:t] if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == n else x, out)

    def _check_metadata(self, entry: _FullGraph, md: dict[str, Any], n: int) -> None:
        now = _tensor_addresses(md, self.device)
        for key, was in entry.addresses.items():
            if now.get(key, was) != was:
                builder = type(self.kv.groups[key[0]].builder).__name__
                raise RuntimeError(
                    f"full CUDA graph for {n} tokens: {builder}.build returned metadata field {key[1]!r} at "
                    f"{now[key]:#x}, but the graph was captured reading {was:#x}; the replay would read stale "
                    "values. A builder with cudagraph_support above NEVER must write into persistent "
                    "buffers and return views of them (see the vattn.cudagraph docstring), or declare NEVER."
                )
        entry.checked = True

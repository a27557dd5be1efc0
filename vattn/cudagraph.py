"""CUDA graphs for decode steps: ``CUDAGraphRunner``.

Usage::

    compiled = vattn.compile(model, cfg)               # needed for PIECEWISE
    graphs = vattn.CUDAGraphRunner(compiled, cfg, kv, max_batch_size=64,
                                   mode=vattn.CUDAGraphMode.FULL_AND_PIECEWISE)
    graphs.capture()                                   # optional: the first call captures
    hidden = graphs(input_ids, positions, common)      # common: CommonAttentionMetadata (unpadded)
    hidden = hidden.clone()                            # the next call overwrites graph outputs

``__call__(input_ids (T,), positions (T,), common_attn_metadata)`` builds the backend
metadata itself (``kv.build_metadata``) and sets the forward context; callers do not. It
returns the model's output for the T real tokens (``[:T]`` of every token-major tensor).

Modes (``CUDAGraphMode``): NONE runs eagerly. PIECEWISE replays each compiled piece of a
``vattn.compile``d model from a graph captured per size, with attention eager in between.
FULL captures the whole forward, attention included, for every batch the backends' builders
allow (``kv.can_run_in_cudagraph``). FULL_DECODE_ONLY uses full graphs for uniform
single-token decode batches and runs everything else eagerly; FULL_AND_PIECEWISE uses full
graphs for those and piecewise graphs for the rest. Per step the dispatcher picks FULL, then
PIECEWISE, then eager. A batch of T tokens is padded to the smallest capture size >= T
(padded tokens: slot -1; padded decode requests: query length 1, sequence length 1 on block
0; see ``pad_common_attn_metadata``); a batch above the largest size runs eagerly.
Modes the backends or the model cannot serve are downgraded with a logged reason
(``CUDAGraphRunner.downgrade_reasons``).

Capture: sizes largest first, one shared memory pool (``torch.cuda.graph_pool_handle()``),
one eager warm-up per size, a progress bar. ``stats`` reports capture seconds and graph
memory. ``VATTN_CUDAGRAPH_DEBUG=1`` checks on every replay (otherwise on the first replay of
each graph) that inputs and metadata sit at the addresses the capture read.

Contract for metadata builders that declare ``cudagraph_support`` above NEVER
-----------------------------------------------------------------------------
A full graph freezes kernel launches, their scalar arguments and every tensor address at
capture; only tensor *contents* change between replays. So a builder must:

1. Own persistent device buffers sized for the largest capture (``max_num_reqs`` = the
   largest capture size, ``max_num_tokens`` likewise, block-table width =
   ``ceil(max_model_len / block_size)``), allocated once (e.g. in ``__init__`` or on the first
   build) and never reallocated.
2. In ``build(common_prefix_len, common)``, when ``common`` is a padded batch
   (``common.num_reqs`` = padded request count, ``slot_mapping.shape[0]`` = padded token
   count), write every graph-visible tensor into those buffers in place (``copy_`` /
   ``fill_``, device ops only, no reallocation) and return metadata whose tensor fields are
   views of the buffers starting at the same addresses for every batch of that padded size
   (e.g. ``buf[:num_reqs]``; never ``buf[offset:]`` with a batch-dependent offset). Stale
   rows past the batch must be overwritten with padding values the kernels accept
   (seq_len 0/1, slot -1, block 0).
3. In ``build_for_cudagraph_capture(common)``, return metadata for a uniform decode batch of
   ``common.num_reqs`` requests through the same buffers, with every host scalar the kernels
   take as a launch argument (max_seq_len, number of KV splits, workspace sizes, ...) set to
   a value valid for every later batch of that size (e.g. the cache's maximum), since these
   are frozen into the graph.
4. Make ``can_run_in_cudagraph(common)`` (declared by ``cudagraph_support``) return False for
   every batch its captured kernels cannot serve.

The runner checks rule 2: after ``build`` at replay, every CUDA tensor field of every
group's metadata must have the data pointer it had at capture, else ``RuntimeError``.
"""

from __future__ import annotations

import bisect
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
from vattn.backends.abstract import AttentionCGSupport
from vattn.backends.utils import CommonAttentionMetadata
from vattn.compile_passes import piecewise as _piecewise
from vattn.compile_passes.piecewise import PiecewiseRun, piecewise_run, weak_ref_tensor
from vattn.config import CUDAGraphMode, VattnConfig, _default_capture_sizes
from vattn.forward_context import set_forward_context

__all__ = [
    "BatchDescriptor",
    "CUDAGraphRunner",
    "bucket_size",
    "choose_runtime_mode",
    "pad_common_attn_metadata",
    "resolve_capture_sizes",
    "resolve_cudagraph_mode",
]

logger = logging.getLogger("vattn.cudagraph")
M = CUDAGraphMode
_runner_keys = itertools.count(1)
_FULL_MODES = (M.FULL, M.FULL_DECODE_ONLY, M.FULL_AND_PIECEWISE)


@dataclasses.dataclass(frozen=True)
class BatchDescriptor:
    """What the dispatcher decided for one step (set as the forward context's ``batch_descriptor``).

    ``mode`` is the runtime mode (NONE, PIECEWISE or FULL); ``num_tokens``/``num_reqs`` the
    padded sizes the step runs at.
    """

    mode: CUDAGraphMode
    num_tokens: int
    num_reqs: int
    uniform_decode: bool


# ---- pure policy (CPU-testable) ----------------------------------------------------------


def resolve_capture_sizes(
    config: VattnConfig, max_batch_size: int | None = None, capture_sizes: Sequence[int] | None = None
) -> tuple[int, ...]:
    """Ascending capture sizes: explicit ``capture_sizes``, else 1, 2, 4, 8, 16, ... up to
    ``max_batch_size`` (which is added when not a multiple of 8), else the config's."""
    if capture_sizes is not None:
        sizes = sorted({int(s) for s in capture_sizes})
        if not sizes or sizes[0] <= 0:
            raise ValueError(f"capture_sizes must be positive ints, got {list(capture_sizes)}.")
        if max_batch_size is not None:
            sizes = [s for s in sizes if s <= max_batch_size]
        return tuple(sizes)
    if max_batch_size is None:
        return config.compilation.capture_sizes()
    if max_batch_size <= 0:
        raise ValueError(f"max_batch_size must be a positive int, got {max_batch_size!r}.")
    return tuple(sorted({*_default_capture_sizes(max_batch_size), max_batch_size}))


def bucket_size(num_tokens: int, sizes: Sequence[int]) -> int | None:
    """The smallest capture size >= ``num_tokens`` (``sizes`` ascending), or None."""
    i = bisect.bisect_left(sizes, num_tokens)
    return sizes[i] if i < len(sizes) else None


def resolve_cudagraph_mode(
    requested: CUDAGraphMode,
    *,
    on_cuda: bool,
    support: AttentionCGSupport,
    backends: str = "the attention backend",
    has_piecewise: bool,
) -> tuple[CUDAGraphMode, list[str]]:
    """The mode the runner can actually serve, and why it differs from ``requested``.

    Args:
        support: the lowest ``cudagraph_support`` over the KV-cache groups' builders.
        backends: names for the messages.
        has_piecewise: the model is a ``vattn.compile``d model (it has pieces).
    """
    mode, why = requested, []
    if mode is M.NONE:
        return mode, why
    if not on_cuda:
        return M.NONE, ["CUDA graphs need a CUDA device; running eagerly."]
    if mode in (M.PIECEWISE, M.FULL_AND_PIECEWISE) and not has_piecewise:
        new = M.NONE if mode is M.PIECEWISE else M.FULL_DECODE_ONLY
        why.append(f"{mode.name} needs a model compiled with vattn.compile (it has no pieces); using {new.name}.")
        mode = new
    if mode in _FULL_MODES and support == AttentionCGSupport.NEVER:
        new = {M.FULL_DECODE_ONLY: M.NONE, M.FULL_AND_PIECEWISE: M.PIECEWISE}.get(
            mode, M.PIECEWISE if has_piecewise else M.NONE
        )
        why.append(f"{backends} declares cudagraph_support NEVER, so no full graphs; using {new.name}.")
        mode = new
    elif mode is M.FULL and support < AttentionCGSupport.ALWAYS:
        new = M.FULL_AND_PIECEWISE if has_piecewise else M.FULL_DECODE_ONLY
        why.append(
            f"{backends} declares cudagraph_support {support.name}: full graphs only for uniform "
            f"decode batches; using {new.name}."
        )
        mode = new
    return mode, why


def choose_runtime_mode(
    mode: CUDAGraphMode, *, captured: bool, uniform_decode: bool, full_ok: bool
) -> CUDAGraphMode:
    """The dispatcher: FULL, then PIECEWISE, then NONE for one step.

    Args:
        mode: the resolved runner mode.
        captured: the batch fits a capture size.
        uniform_decode: every request has exactly one new token.
        full_ok: the builders allow the (padded) batch in a full graph.
    """
    if mode is M.NONE or not captured:
        return M.NONE
    if mode in _FULL_MODES and full_ok and (uniform_decode or mode is M.FULL):
        return M.FULL
    if mode in (M.PIECEWISE, M.FULL_AND_PIECEWISE):
        return M.PIECEWISE
    return M.NONE


def pad_common_attn_metadata(
    common: CommonAttentionMetadata, num_tokens_padded: int, num_reqs_padded: int | None = None
) -> CommonAttentionMetadata:
    """``common`` padded to ``num_tokens_padded`` tokens and ``num_reqs_padded`` requests.

    Padded tokens get slot -1 (never written). Padded requests take one padded token each
    while any remain (query length 1, sequence length 1, block table row of zeros = block 0,
    which ``allocate_kv_cache`` zero-fills), then query length 0 / sequence length 0. Device
    tensors are built with device ops (no host sync).
    """
    t, b = common.num_actual_tokens, common.num_reqs
    bp = b if num_reqs_padded is None else num_reqs_padded
    if num_tokens_padded < t or bp < b:
        raise ValueError(
            f"pad_common_attn_metadata: num_tokens_padded={num_tokens_padded} / num_reqs_padded={bp} "
            f"must be at least the batch's {t} tokens / {b} requests."
        )
    if common.num_slot_tokens not in (None, t):
        raise ValueError(
            f"pad_common_attn_metadata: this batch writes {common.num_slot_tokens} K/V slots for {t} query "
            "tokens (cross-attention); CUDA graphs pad self-attention batches only, so run it eagerly."
        )
    extra, spare = bp - b, num_tokens_padded - t
    if not extra and not spare and _exactly_sized(common):
        return common  # nothing to pad (a batch of a captured size): no host work
    dev = common.query_start_loc.device
    pad_q_cpu = (torch.arange(extra) < spare).to(torch.int32)
    pad_q = (torch.arange(extra, device=dev) < spare).to(torch.int32)
    qsl = common.query_start_loc[: b + 1]
    qsl_cpu = common.query_start_loc_cpu[: b + 1]
    bt = common.block_table_tensor[:b]
    slots = common.slot_mapping[:t]
    return CommonAttentionMetadata(
        query_start_loc=torch.cat([qsl, qsl[b:] + pad_q.cumsum(0).to(qsl.dtype)]),
        query_start_loc_cpu=torch.cat([qsl_cpu, qsl_cpu[b:] + pad_q_cpu.cumsum(0).to(qsl_cpu.dtype)]),
        seq_lens=torch.cat([common.seq_lens[:b], pad_q.to(common.seq_lens.dtype)]),
        seq_lens_cpu=torch.cat([common.seq_lens_cpu[:b], pad_q_cpu.to(common.seq_lens_cpu.dtype)]),
        num_computed_tokens_cpu=torch.cat(
            [common.num_computed_tokens_cpu[:b], torch.zeros(extra, dtype=common.num_computed_tokens_cpu.dtype)]
        ),
        num_reqs=bp,
        num_actual_tokens=t,
        max_query_len=common.max_query_len,
        block_table_tensor=torch.cat([bt, bt.new_zeros((extra, bt.shape[1]))]),
        slot_mapping=torch.cat([slots, slots.new_full((num_tokens_padded - t,), -1)]),
        max_seq_len=max(common.max_seq_len, 1 if extra and spare else 0),
        causal=common.causal,
    )


def _exactly_sized(common: CommonAttentionMetadata) -> bool:
    """Every per-request / per-token tensor of ``common`` has exactly the batch's length."""
    b, t = common.num_reqs, common.num_actual_tokens
    return (common.query_start_loc.shape[0] == common.query_start_loc_cpu.shape[0] == b + 1
            and common.seq_lens.shape[0] == common.seq_lens_cpu.shape[0] == b
            and common.num_computed_tokens_cpu.shape[0] == b
            and common.block_table_tensor.shape[0] == b and common.slot_mapping.shape[0] == t)


def is_uniform_decode(common: CommonAttentionMetadata) -> bool:
    return common.num_reqs > 0 and common.max_query_len == 1 and common.num_actual_tokens == common.num_reqs


# ---- the runner --------------------------------------------------------------------------


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
    """Captures and replays CUDA graphs of ``model``'s forward (see the module docstring).

    Args:
        model: the model or a ``vattn.compile``d model; called as ``model(input_ids, positions)``.
        config: the config the model was built under.
        kv_cache: the ``vattn.PagedKVCache`` bound to the model's layers.
        max_batch_size: the largest padded token count to capture (default: the config's).
        capture_sizes: explicit sizes (tokens); default 1, 2, 4, 8, 16, ... up to the max.
        mode: default ``config.compilation.cudagraph_mode``.
        max_model_len: longest sequence, sets the capture block-table width
            (default: ``kv_cache.num_blocks * block_size``).
        show_progress: tqdm bar while capturing.
    """

    def __init__(
        self,
        model: Any,
        config: VattnConfig,
        kv_cache: Any,
        *,
        max_batch_size: int | None = None,
        capture_sizes: Sequence[int] | None = None,
        mode: CUDAGraphMode | None = None,
        max_model_len: int | None = None,
        show_progress: bool = True,
    ) -> None:
        if not isinstance(config, VattnConfig):
            raise TypeError(f"CUDAGraphRunner: config must be a vattn.VattnConfig, got {type(config).__name__}.")
        requested = config.compilation.cudagraph_mode if mode is None else mode
        if not isinstance(requested, CUDAGraphMode):
            raise TypeError(f"CUDAGraphRunner: mode must be a vattn.CUDAGraphMode, got {requested!r}.")
        self.model, self.config, self.kv = model, config, kv_cache
        self.sizes = resolve_capture_sizes(config, max_batch_size, capture_sizes)
        self.max_size = self.sizes[-1] if self.sizes else 0
        self.device = next(iter(kv_cache.tensors.values())).device
        self.show_progress = show_progress
        self.max_model_len = max_model_len or kv_cache.num_blocks * kv_cache.block_size
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
        n = max(self.max_size, 1)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(n, dtype=torch.long, device=self.device)

    # ---- dispatch ----------------------------------------------------------------------

    def dispatch(self, common: CommonAttentionMetadata) -> tuple[BatchDescriptor, CommonAttentionMetadata]:
        """The runtime mode and padded metadata for this step."""
        t = common.num_actual_tokens
        n = bucket_size(t, self.sizes) if self.mode is not M.NONE else None
        decode = is_uniform_decode(common)
        if n is None:
            return BatchDescriptor(M.NONE, t, common.num_reqs, decode), common
        full_ok = False
        if self.mode in _FULL_MODES and (decode or self.mode is M.FULL):
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
        """A decode batch of ``n`` requests of one token on block 0 that writes nothing."""
        width = math.ceil(self.max_model_len / self.kv.block_size)
        common = self.kv.common_metadata([1] * n, [0] * n, [[0]] * n, max_blocks_per_req=width)
        common.slot_mapping.fill_(-1)
        return common

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
                ids, pos = self.input_ids[:n], self.positions[:n]
                tw = time.perf_counter()
                with set_forward_context(self.kv.build_metadata(common), self.config), torch.no_grad():
                    self.model(ids, pos)  # warm-up: compiles, autotunes, initialises lazily
                torch.cuda.synchronize()
                warmup_s += time.perf_counter() - tw
                if self.mode in _FULL_MODES:
                    md = self.kv.build_metadata_for_cudagraph_capture(common)
                    bd = BatchDescriptor(M.FULL, n, n, True)
                    with set_forward_context(md, self.config, batch_descriptor=bd), torch.no_grad():
                        graph, out = _piecewise.capture_graph(functools.partial(self.model, ids, pos), self.pool)
                    self.full_graphs[n] = _FullGraph(graph, tree_map(weak_ref_tensor, out), _tensor_addresses(md, self.device), md)
                if self.mode in (M.PIECEWISE, M.FULL_AND_PIECEWISE):
                    bd = BatchDescriptor(M.PIECEWISE, n, n, True)
                    run = PiecewiseRun(self.key, n, capture=True, pool=self.pool)
                    with set_forward_context(self.kv.build_metadata(common), self.config, batch_descriptor=bd):
                        with piecewise_run(run), torch.no_grad():
                            self.model(ids, pos)
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

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, common_attn_metadata: CommonAttentionMetadata) -> Any:
        """Run one step; returns the model output for the real tokens (see the module docstring)."""
        common = common_attn_metadata
        t = input_ids.shape[0]
        if positions.shape[0] != t or common.num_actual_tokens != t:
            raise ValueError(
                f"CUDAGraphRunner: input_ids has {t} tokens, positions {positions.shape[0]}, "
                f"common_attn_metadata.num_actual_tokens {common.num_actual_tokens}; they must agree."
            )
        if not self.captured:
            self.capture()
        bd, padded = self.dispatch(common)
        self.last_batch_descriptor = bd
        if bd.mode is M.NONE:
            with set_forward_context(self.kv.build_metadata(common), self.config, batch_descriptor=bd):
                with torch.no_grad():
                    return self.model(input_ids, positions)
        n = bd.num_tokens
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        if n > t:
            self.input_ids[t:n].zero_()
            self.positions[t:n].zero_()
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
                out = self.model(self.input_ids[:n], self.positions[:n])
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

"""CUDA graphs: the runner's policy and data flow on CPU; capture/replay parity on CUDA.

CPU: capture sizes, bucketing, mode downgrades, the dispatcher, padding (checked against
``build_common_attn_metadata``'s own padding), the eager fallback, the piecewise address
check, and the whole capture/replay scenario with CUDA graphs *emulated* (see
``_emulated_capture``). CUDA (``@pytest.mark.cuda``): for each available backend and mode,
replay equals eager (bitwise when the batch is exactly a captured size, so the same kernels
run; within bf16 tolerance when padded) at every captured size and over steps where
sequences grow, finish and join; a builder that breaks the persistent-buffer contract and a
replay with inputs at other addresses are caught.

Step functions of other signatures (``GraphInput``): the description and the call's argument
checks (which raise before anything runs) on CPU; a step over ``inputs_embeds`` (T, H) and
positions (3, T) (``EmbedsStep``) through the same scenario, emulated on CPU and on CUDA.

``GRAPH_SAFE_TEST`` is a test-only backend that follows the contract in ``vattn.cudagraph``
(persistent buffers, ``UNIFORM_SINGLE_TOKEN_DECODE``): it exercises FULL graphs even where
no GPU kernel library is installed.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch

import vattn
from vattn.core.enums import AttentionCGSupport
from vattn.core.metadata import AttentionMetadata
from vattn.backends.torch_sdpa import TorchSDPABackend, TorchSDPAImpl, TorchSDPAMetadataBuilder
from vattn.compile_passes.piecewise import CUDAGraphPiece, PiecewiseRun, _Entry, piecewise_run, weak_ref_tensor
from vattn.cudagraph import (
    BatchDescriptor,
    CUDAGraphRunner,
    GraphInput,
    bucket_size,
    choose_runtime_mode,
    pad_common_attn_metadata,
    resolve_capture_sizes,
    resolve_cudagraph_mode,
)
from vattn.cudagraph.inputs import InputBuffers
from vattn.ops.kv_store import store_kv

from test_compile import H, VOCAB, Batches, build

M = vattn.CUDAGraphMode
S = AttentionCGSupport


# ---- a test backend that follows the full-graph contract ----------------------------------


@dataclass
class DecodeMetadata(AttentionMetadata):
    num_actual_tokens: int
    seq_lens: torch.Tensor  # (B,) view of a persistent buffer
    block_table: torch.Tensor  # (B, MAX_BLOCKS)
    slot_mapping: torch.Tensor  # (T,)


class GraphSafeBuilder(TorchSDPAMetadataBuilder):
    """Uniform decode batches go through persistent buffers; the rest to TORCH_SDPA."""

    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    MAX_REQS, MAX_BLOCKS = 16, 16

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        n, w, dev = self.MAX_REQS, self.MAX_BLOCKS, self.device
        self.seq = torch.zeros(n, dtype=torch.int32, device=dev)
        self.table = torch.zeros(n, w, dtype=torch.int32, device=dev)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=dev)

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):  # type: ignore[no-untyped-def]
        cm = common_attn_metadata
        b, t = cm.num_reqs, cm.slot_mapping.shape[0]
        if not (cm.max_query_len <= 1 and t == b and b <= self.MAX_REQS):
            return super().build(common_prefix_len, cm, fast_build)
        w = cm.block_table_tensor.shape[1]
        self.seq[:b].copy_(cm.seq_lens[:b])
        self.table[:b, :w].copy_(cm.block_table_tensor[:b])
        self.slots[:t].copy_(cm.slot_mapping[:t])
        return DecodeMetadata(cm.num_actual_tokens, self.seq[:b], self.table[:b], self.slots[:t])


class BadBuilder(GraphSafeBuilder):
    """Breaks the contract: returns fresh tensors instead of views of its buffers."""

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):  # type: ignore[no-untyped-def]
        md = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if isinstance(md, DecodeMetadata):
            md.seq_lens = md.seq_lens.clone()
        return md


class GraphSafeImpl(TorchSDPAImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None, output_scale=None):  # type: ignore[no-untyped-def]
        md = attn_metadata
        if not isinstance(md, DecodeMetadata):
            return super().forward(layer, query, key, value, kv_cache, md, output, output_scale)
        key_cache, value_cache = kv_cache.unbind(0)
        store_kv(key, value, key_cache, value_cache, md.slot_mapping, self.kv_cache_dtype, layer._k_scale, layer._v_scale)
        b, g = md.seq_lens.shape[0], self.num_queries_per_kv
        table = md.block_table.long()
        k = key_cache[table].flatten(1, 2).float().repeat_interleave(g, dim=2)  # (B, L, H, D)
        v = value_cache[table].flatten(1, 2).float().repeat_interleave(g, dim=2)
        valid = torch.arange(k.shape[1], device=k.device)[None, :] < md.seq_lens[:, None]
        s = torch.einsum("bhd,blhd->bhl", query[:b].float(), k) * self.scale
        p = torch.softmax(s.masked_fill(~valid[:, None, :], float("-inf")), dim=-1).nan_to_num()
        output[:b] = torch.einsum("bhl,blhd->bhd", p, v).to(output.dtype)
        return output


class GraphSafeBackend(TorchSDPABackend):
    @staticmethod
    def get_name() -> str:
        return "GRAPH_SAFE_TEST"

    @staticmethod
    def get_impl_cls():  # type: ignore[no-untyped-def]
        return GraphSafeImpl

    @staticmethod
    def get_builder_cls():  # type: ignore[no-untyped-def]
        return GraphSafeBuilder


class BadBackend(GraphSafeBackend):
    @staticmethod
    def get_builder_cls():  # type: ignore[no-untyped-def]
        return BadBuilder


# ---- CPU: pure policy ---------------------------------------------------------------------


def test_capture_sizes_and_buckets() -> None:
    cfg = vattn.VattnConfig()
    assert resolve_capture_sizes(cfg, 20) == (1, 2, 4, 8, 16, 20)
    assert resolve_capture_sizes(cfg, 32) == (1, 2, 4, 8, 16, 24, 32)
    assert resolve_capture_sizes(cfg, 16, [8, 1, 32, 8]) == (1, 8)
    assert resolve_capture_sizes(cfg)[:5] == (1, 2, 4, 8, 16) and resolve_capture_sizes(cfg)[-1] == 256
    with pytest.raises(ValueError, match="capture_sizes"):
        resolve_capture_sizes(cfg, None, [0, 4])
    sizes = (1, 2, 4, 8, 16)
    assert [bucket_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 16, 17)] == [1, 2, 4, 8, 8, 16, 16, None]


@pytest.mark.parametrize(
    "requested, support, piecewise, expected",
    [
        (M.PIECEWISE, S.NEVER, True, M.PIECEWISE),
        (M.PIECEWISE, S.ALWAYS, False, M.NONE),
        (M.FULL, S.ALWAYS, False, M.FULL),
        (M.FULL, S.NEVER, True, M.PIECEWISE),
        (M.FULL, S.NEVER, False, M.NONE),
        (M.FULL, S.UNIFORM_SINGLE_TOKEN_DECODE, True, M.FULL_AND_PIECEWISE),
        (M.FULL, S.UNIFORM_BATCH, False, M.FULL_DECODE_ONLY),
        (M.FULL_DECODE_ONLY, S.NEVER, True, M.NONE),
        (M.FULL_DECODE_ONLY, S.UNIFORM_SINGLE_TOKEN_DECODE, False, M.FULL_DECODE_ONLY),
        (M.FULL_AND_PIECEWISE, S.NEVER, True, M.PIECEWISE),
        (M.FULL_AND_PIECEWISE, S.UNIFORM_SINGLE_TOKEN_DECODE, False, M.FULL_DECODE_ONLY),
        (M.FULL_AND_PIECEWISE, S.ALWAYS, True, M.FULL_AND_PIECEWISE),
    ],
)
def test_mode_downgrades_with_reasons(requested, support, piecewise, expected) -> None:
    mode, why = resolve_cudagraph_mode(requested, on_cuda=True, support=support, backends="B", has_piecewise=piecewise)
    assert mode is expected
    assert bool(why) == (mode is not requested)
    assert resolve_cudagraph_mode(requested, on_cuda=False, support=support, has_piecewise=piecewise)[0] is M.NONE


@pytest.mark.parametrize(
    "mode, captured, decode, full_ok, expected",
    [
        (M.FULL_AND_PIECEWISE, True, True, True, M.FULL),
        (M.FULL_AND_PIECEWISE, True, True, False, M.PIECEWISE),
        (M.FULL_AND_PIECEWISE, True, False, True, M.PIECEWISE),
        (M.FULL_AND_PIECEWISE, False, True, True, M.NONE),
        (M.FULL_DECODE_ONLY, True, False, True, M.NONE),
        (M.FULL_DECODE_ONLY, True, True, True, M.FULL),
        (M.FULL, True, False, True, M.FULL),
        (M.FULL, True, False, False, M.NONE),
        (M.PIECEWISE, True, True, True, M.PIECEWISE),
        (M.NONE, True, True, True, M.NONE),
    ],
)
def test_dispatcher_prefers_full_then_piecewise_then_eager(mode, captured, decode, full_ok, expected) -> None:
    assert choose_runtime_mode(mode, captured=captured, uniform_decode=decode, full_ok=full_ok) is expected


@pytest.mark.parametrize(
    "qlens, computed, t_pad, b_pad",
    [([1, 1, 1], [4, 9, 17], 8, 8), ([1, 1, 5], [4, 9, 0], 8, None), ([2, 3], [0, 7], 8, 4), ([1], [3], 1, 1)],
)
def test_padding_matches_build_common_attn_metadata(qlens, computed, t_pad, b_pad) -> None:
    tables = [[1, 2], [3, 7], [4, 5, 6]][: len(qlens)]
    common = vattn.build_common_attn_metadata(qlens, computed, tables, 8)
    want = vattn.build_common_attn_metadata(qlens, computed, tables, 8, num_tokens_padded=t_pad, num_reqs_padded=b_pad)
    got = pad_common_attn_metadata(common, t_pad, b_pad)
    for f in ("query_start_loc", "query_start_loc_cpu", "seq_lens", "seq_lens_cpu", "num_computed_tokens_cpu",
              "block_table_tensor", "slot_mapping"):
        assert torch.equal(getattr(got, f), getattr(want, f)), f
    for f in ("num_reqs", "num_actual_tokens", "max_query_len", "causal"):
        assert getattr(got, f) == getattr(want, f), f
    with pytest.raises(ValueError, match="at least"):
        pad_common_attn_metadata(common, sum(qlens) - 1)


def _runner_on_cpu(mode: vattn.CUDAGraphMode, full_ok: bool = True) -> CUDAGraphRunner:
    model, cfg, kv = build(1, use_inductor=False)
    runner = CUDAGraphRunner(model, cfg, kv, max_batch_size=8, mode=mode, show_progress=False)
    assert runner.mode is M.NONE and runner.downgrade_reasons  # no CUDA here
    runner.mode = mode  # exercise the dispatcher as if on a GPU
    runner.kv = SimpleNamespace(can_run_in_cudagraph=lambda common: full_ok)
    return runner


def test_runner_dispatch_pads_and_chooses() -> None:
    runner = _runner_on_cpu(M.FULL_AND_PIECEWISE)
    decode = vattn.build_common_attn_metadata([1] * 3, [5, 6, 7], [[1], [2], [3]], 8)
    bd, padded = runner.dispatch(decode)
    assert bd == BatchDescriptor(M.FULL, 4, 4, True) and padded.slot_mapping.tolist()[3] == -1
    mixed = vattn.build_common_attn_metadata([1, 4], [5, 0], [[1], [2]], 8)
    bd, padded = runner.dispatch(mixed)
    assert bd == BatchDescriptor(M.PIECEWISE, 8, 2, False) and padded.num_reqs == 2
    big = vattn.build_common_attn_metadata([9], [0], [[1, 2]], 8)
    assert runner.dispatch(big)[0].mode is M.NONE  # larger than every capture size
    runner = _runner_on_cpu(M.FULL_AND_PIECEWISE, full_ok=False)
    assert runner.dispatch(decode)[0].mode is M.PIECEWISE


def test_runner_on_cpu_runs_eagerly() -> None:
    model, cfg, kv = build(2, use_inductor=False)
    runner = CUDAGraphRunner(model, cfg, kv, max_batch_size=8, mode=M.FULL_AND_PIECEWISE, show_progress=False)
    assert runner.mode is M.NONE and "CUDA device" in runner.downgrade_reasons[0]
    ids, positions, common = Batches(kv).step()
    saved = {k: t.clone() for k, t in kv.tensors.items()}
    got = runner(ids, positions, common)
    for k, t in kv.tensors.items():
        t.copy_(saved[k])
    with vattn.set_forward_context(kv.build_metadata(common), cfg), torch.no_grad():
        want = model(ids, positions)
    assert torch.equal(got, want) and runner.last_batch_descriptor.mode is M.NONE
    with pytest.raises(ValueError, match="must agree"):
        runner(ids[:-1], positions, common)


def test_piece_detects_inputs_at_other_addresses() -> None:
    piece = CUDAGraphPiece(lambda x, n: x * 2, 3, "submod_3")
    owner, x = 7, torch.randn(4)
    out = torch.randn(4)
    piece.graphs[(owner, 4)] = _Entry(SimpleNamespace(replay=lambda: None), out, [x.data_ptr(), None])
    with piecewise_run(PiecewiseRun(owner, 4, check_addresses=True)):
        assert piece(x, 4) is out  # replayed: returns the captured output
        with pytest.raises(RuntimeError, match="fixed addresses"):
            piece(x.clone(), 4)
    with piecewise_run(PiecewiseRun(owner, 2)):
        assert torch.equal(piece(x, 2), x * 2)  # size never captured: eager
    assert torch.equal(piece(x, 4), x * 2)  # outside a run: eager
    assert piece.release(owner) == 1 and not piece.graphs
    assert weak_ref_tensor(x) is x  # CPU tensors are returned as is


# ---- capture and replay: on CUDA, and emulated on CPU ------------------------------------
#
# The emulation swaps ``capture_graph`` for one whose "graph" re-runs the captured Python
# on replay (with the capture-time forward context and argument objects) and copies the
# result into the captured outputs. That is CUDA-graph semantics at the level the runner
# controls: replays read persistent buffers and capture-time metadata objects, write the
# captured outputs, and see Python scalars frozen at capture. It checks the runner's data
# flow (padding, buffers, metadata updates, dispatch) on machines without a GPU.

SIZES = (1, 2, 4, 8)
MODES = [M.PIECEWISE, M.FULL, M.FULL_DECODE_ONLY, M.FULL_AND_PIECEWISE]
# head size 64 and block size 16: what every GPU kernel library accepts
CUDA_MODEL = dict(device="cuda", dtype=torch.bfloat16, head_size=64, block_size=16)
CPU_MODEL = dict(device="cpu", dtype=torch.float32, block_size=16, use_inductor=False)


class _EmulatedGraph:
    def __init__(self, replay) -> None:  # type: ignore[no-untyped-def]
        self.replay = replay


def _emulated_capture(fn, pool):  # type: ignore[no-untyped-def]
    from vattn.forward_context import _forward_context

    ctx = _forward_context[-1] if _forward_context else None
    out = fn()

    def replay() -> None:
        if ctx is not None:
            _forward_context.append(ctx)
        try:
            with torch.no_grad():
                new = fn()
        finally:
            if ctx is not None:
                _forward_context.pop()
        for o, n in zip(torch.utils._pytree.tree_leaves(out), torch.utils._pytree.tree_leaves(new)):
            if isinstance(o, torch.Tensor):
                o.copy_(n)

    return _EmulatedGraph(replay), out


@pytest.fixture
def emulated_graphs(monkeypatch):
    """CUDA graphs emulated on CPU (see above); the runner believes it is on a GPU."""
    import vattn.compile_passes.piecewise as piecewise
    import vattn.cudagraph.runner as runner_module

    real = runner_module.resolve_cudagraph_mode
    monkeypatch.setattr(runner_module, "resolve_cudagraph_mode", lambda r, **kw: real(r, **{**kw, "on_cuda": True}))
    monkeypatch.setattr(piecewise, "capture_graph", _emulated_capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 0)


def _backend(name: str) -> type:
    if name == "GRAPH_SAFE_TEST":
        return GraphSafeBackend
    try:
        cls = vattn.AttentionBackendEnum[name].get_class()
    except Exception as e:  # noqa: BLE001  (not importable here)
        pytest.skip(f"{name}: {e}")
    ok, why = cls.is_available()
    if not ok:
        pytest.skip(f"{name}: {why}")
    return cls


@pytest.fixture(scope="module")
def models():
    """(backend name, device) -> (model, cfg, kv, compiled); compiled once each."""
    cache: dict[tuple[str, str], tuple] = {}

    def get(name: str, device: str = "cuda") -> tuple:
        if (name, device) not in cache:
            spec = CUDA_MODEL if device == "cuda" else CPU_MODEL
            model, cfg, kv = build(2, attn_backend=_backend(name), **spec)  # type: ignore[arg-type]
            compiled = vattn.compile(model, cfg)
            common = kv.common_metadata([3], [0], [[1]])
            with vattn.set_forward_context(kv.build_metadata(common), cfg):  # compile now
                compiled(torch.zeros(3, dtype=torch.long, device=device), torch.arange(3, device=device))
            cache[(name, device)] = (model, cfg, kv, compiled)
        return cache[(name, device)]

    return get


def _eager(model, cfg, kv, tensors, common) -> torch.Tensor:
    with vattn.set_forward_context(kv.build_metadata(common), cfg), torch.no_grad():
        return model(*tensors)


def _compare(runner, model, cfg, kv, ids, positions, common, where: str, exact: bool = True, adapt=None) -> None:
    """Runner vs eager on one batch (cache restored in between); ``adapt(ids, positions)`` gives
    the step function's tensors (default: ``(ids, positions)``)."""
    tensors = adapt(ids, positions) if adapt is not None else (ids, positions)
    saved = {k: t.clone() for k, t in kv.tensors.items()}
    got = runner(*tensors, common).clone()
    bd = runner.last_batch_descriptor
    for k, t in kv.tensors.items():
        t.copy_(saved[k])
    want = _eager(model, cfg, kv, tensors, common)
    t = ids.shape[0]
    assert got.shape == want.shape and got.shape[0] == t, f"{where}: {tuple(got.shape)} vs {tuple(want.shape)}"
    if exact and bd.mode is not M.NONE and bd.num_tokens == t:  # same sizes: the same kernels ran
        diff = (got.float() - want.float()).abs().max().item()
        assert torch.equal(got, want), f"{where}: {bd} not bitwise equal to eager (max diff {diff})"
    else:
        torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2, msg=lambda m: f"{where}: {bd}: {m}")


def _decode_batch(kv, n: int, rng: random.Random):
    """n decode requests with random context over distinct blocks (cache contents as they are)."""
    blocks = list(range(1, kv.num_blocks))
    rng.shuffle(blocks)
    computed = [rng.randint(1, 30) for _ in range(n)]
    tables = [[blocks.pop() for _ in range(-(-(c + 1) // kv.block_size))] for c in computed]
    common = kv.common_metadata([1] * n, computed, tables)
    device = common.query_start_loc.device
    ids = torch.tensor([rng.randrange(VOCAB) for _ in range(n)], device=device)
    return ids, torch.tensor(computed, device=device), common


def _scenario(backend: str, mode: vattn.CUDAGraphMode, model, cfg, kv, where: str, *, inputs=None,
              adapt=None) -> None:
    """Replay equals eager at every captured size and over steps where sequences grow, finish, join.

    ``model`` is the step function, ``inputs`` its ``GraphInput``s and ``adapt(ids, positions)``
    its tensors for a batch (default: the ``(input_ids, positions)`` adapter)."""
    runner = CUDAGraphRunner(model, cfg, kv, inputs=inputs, capture_sizes=SIZES, mode=mode, max_model_len=128,
                             show_progress=False)
    compare = functools.partial(_compare, adapt=adapt)
    try:
        runner.capture()
        if runner.mode is not M.NONE:
            assert runner.stats["graph_memory_bytes"] >= 0 and runner.stats["capture_seconds"] > 0
        rng, seen = random.Random(0), set()
        where = f"{where}/{backend}/{mode.name}->{runner.mode.name}"
        for n in SIZES:  # every captured size exactly (bitwise), and padded from n - 1
            for m in sorted({n, max(n - 1, 1)}):
                compare(runner, model, cfg, kv, *_decode_batch(kv, m, rng), f"{where}/decode {m}")
                seen.add(runner.last_batch_descriptor.mode)
        dev = runner.device
        for q in (3, 12):  # a prefill that fits a capture size, one that does not
            common = kv.common_metadata([q], [0], [[1 + q]])
            ids, positions = torch.randint(0, VOCAB, (q,), device=dev), torch.arange(q, device=dev)
            compare(runner, model, cfg, kv, ids, positions, common, f"{where}/prefill {q}")
            seen.add(runner.last_batch_descriptor.mode)
        batches = Batches(kv, seed=5, max_reqs=6)
        for step in range(16):  # grow, finish, join
            compare(runner, model, cfg, kv, *batches.step(), f"{where}/step {step}")
            seen.add(runner.last_batch_descriptor.mode)
        assert M.NONE in seen  # the 12-token prefill
        if runner.mode in (M.FULL, M.FULL_DECODE_ONLY, M.FULL_AND_PIECEWISE):
            assert M.FULL in seen
        if runner.mode in (M.PIECEWISE, M.FULL_AND_PIECEWISE):
            assert M.PIECEWISE in seen
    finally:
        runner.release()


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("backend", ["TORCH_SDPA", "GRAPH_SAFE_TEST"])
def test_runner_semantics_emulated_on_cpu(backend: str, mode, models, emulated_graphs) -> None:
    _, cfg, kv, compiled = models(backend, "cpu")
    _scenario(backend, mode, compiled, cfg, kv, "cpu-emulated")


@pytest.mark.cuda
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("backend", ["TORCH_SDPA", "GRAPH_SAFE_TEST", "TRITON_ATTN", "FLASHINFER", "FLASH_ATTN"])
def test_replay_equals_eager(backend: str, mode: vattn.CUDAGraphMode, models) -> None:
    _, cfg, kv, compiled = models(backend)
    _scenario(backend, mode, compiled, cfg, kv, "cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("mode", [M.FULL_AND_PIECEWISE, M.PIECEWISE], ids=lambda m: m.name)
def test_compile_sizes_replay_matches_eager(mode: vattn.CUDAGraphMode) -> None:
    """compile_sizes=(1,): the capture warm-up compiles the 1-token pieces (Inductor's fused
    matrix-vector code, so not bitwise equal to eager's cuBLAS), graphs replay them, and
    other sizes keep the general code."""
    model, cfg, kv = build(2, attn_backend=_backend("TRITON_ATTN"), compile_sizes=(1,), **CUDA_MODEL)  # type: ignore[arg-type]
    compiled = vattn.compile(model, cfg)
    runner = CUDAGraphRunner(compiled, cfg, kv, capture_sizes=(1, 2, 4), mode=mode, max_model_len=128,
                             show_progress=False)
    try:
        runner.capture()
        counter = compiled.backend.counter
        assert counter.num_static_compiles == counter.num_inductor_compiles > 0
        rng = random.Random(3)
        for n in (1, 2, 1, 3, 1):
            _compare(runner, model, cfg, kv, *_decode_batch(kv, n, rng), f"compile_sizes/{mode.name}/decode {n}",
                     exact=False)
            assert runner.last_batch_descriptor.mode is not M.NONE
        assert counter.num_static_compiles == counter.num_inductor_compiles  # nothing compiled after capture
    finally:
        runner.release()


@pytest.mark.cuda
def test_full_graph_of_uncompiled_model_and_debug_mode(monkeypatch) -> None:
    model, cfg, kv = build(2, attn_backend=GraphSafeBackend, **CUDA_MODEL)  # type: ignore[arg-type]
    monkeypatch.setenv("VATTN_CUDAGRAPH_DEBUG", "1")
    runner = CUDAGraphRunner(model, cfg, kv, capture_sizes=SIZES, mode=M.FULL, max_model_len=128, show_progress=False)
    assert runner.mode is M.FULL_DECODE_ONLY  # UNIFORM_SINGLE_TOKEN_DECODE, no pieces
    rng = random.Random(1)
    for n in (1, 3, 4, 8):
        _compare(runner, model, cfg, kv, *_decode_batch(kv, n, rng), f"uncompiled/FULL/decode {n}")
        assert runner.last_batch_descriptor.mode is M.FULL


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_builder_breaking_the_contract_is_caught(device: str, request) -> None:
    if device == "cpu":
        request.getfixturevalue("emulated_graphs")
    spec = CUDA_MODEL if device == "cuda" else CPU_MODEL
    model, cfg, kv = build(1, attn_backend=BadBackend, **spec)  # type: ignore[arg-type]
    runner = CUDAGraphRunner(model, cfg, kv, capture_sizes=(4,), mode=M.FULL_DECODE_ONLY, max_model_len=128,
                             show_progress=False)
    with pytest.raises(RuntimeError, match="persistent"):
        runner(*_decode_batch(kv, 4, random.Random(2)))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_piecewise_replay_with_moved_inputs_is_caught(device: str, models, request) -> None:
    if device == "cpu":
        request.getfixturevalue("emulated_graphs")
    _, cfg, kv, compiled = models("TORCH_SDPA", device)
    runner = CUDAGraphRunner(compiled, cfg, kv, capture_sizes=(4,), mode=M.PIECEWISE, max_model_len=128,
                             show_progress=False)
    try:
        runner.capture()
        ids, positions, common = _decode_batch(kv, 4, random.Random(3))
        with vattn.set_forward_context(kv.build_metadata(common), cfg), torch.no_grad():
            with piecewise_run(PiecewiseRun(runner.key, 4, check_addresses=True)):
                with pytest.raises(RuntimeError, match="fixed addresses"):
                    compiled(ids, positions)  # not the runner's persistent buffers
    finally:
        runner.release()


# ---- step functions of other signatures: GraphInput ----------------------------------------


class EmbedsStep(torch.nn.Module):
    """A step over ``inputs_embeds`` (T, H) and M-RoPE-style ``positions`` (3, T): the TinyModel's
    layers without its embedding. Every row of ``positions`` changes the result."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, pos = inputs_embeds, positions[0] + positions[1] - positions[2]
        for layer in self.model.layers:
            x = layer(pos, x)
        return self.model.norm(x)


def _embeds_inputs(dtype: torch.dtype) -> list[GraphInput]:
    return [GraphInput(dtype, (H,), name="inputs_embeds"), GraphInput(torch.long, (3,), token_dim=1, name="positions")]


def _embeds_adapter(model: torch.nn.Module):  # type: ignore[no-untyped-def]
    """(ids (T,), positions (T,)) -> (inputs_embeds (T, H), positions (3, T)) with distinct rows."""

    def adapt(ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            embeds = model.embed(ids)
        return embeds, torch.stack([positions, 2 * positions + 1, positions + 1])

    return adapt


@pytest.fixture(scope="module")
def embeds_steps(models):
    """(backend, device, compiled) -> (model, cfg, kv, EmbedsStep over model, compiled or not)."""
    cache: dict[tuple[str, str, bool], torch.nn.Module] = {}

    def get(name: str, device: str = "cuda", compiled: bool = False) -> tuple:
        model, cfg, kv, _ = models(name, device)
        if (name, device, compiled) not in cache:
            step = EmbedsStep(model)
            if compiled:
                step = vattn.compile(step, cfg, dynamic_arg_dims={"inputs_embeds": 0, "positions": 1})
                common = kv.common_metadata([3], [0], [[1]])
                with vattn.set_forward_context(kv.build_metadata(common), cfg):  # compile now
                    step(torch.zeros(3, H, dtype=model.embed.weight.dtype, device=device),
                         torch.zeros(3, 3, dtype=torch.long, device=device))
            cache[(name, device, compiled)] = step
        return model, cfg, kv, cache[(name, device, compiled)]

    return get


def test_graph_input_describes_token_major_tensors() -> None:
    ids = GraphInput(torch.long)
    assert ids.shape == () and ids.token_dim == 0 and ids.full_shape(5) == (5,) and ids.describe() == "(T,)"
    embeds = GraphInput(torch.bfloat16, (64,))
    assert embeds.full_shape(5) == (5, 64) and embeds.describe() == "(T, 64)"
    mrope = GraphInput(torch.long, [3], token_dim=-1)  # a list is fine; -1 = last
    assert mrope == GraphInput(torch.long, (3,), token_dim=1) and mrope.full_shape(5) == (3, 5)
    assert mrope.describe() == "(3, T)" and mrope.label(1) == "input 1"
    assert GraphInput(torch.long, name="positions").label(1) == "positions"
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        GraphInput("int64")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"shape must be the positive sizes.*got \(0,\)"):
        GraphInput(torch.long, (0,))
    with pytest.raises(ValueError, match="shape must be"):
        GraphInput(torch.long, 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"token_dim must be in \[-2, 1\].*got 2"):
        GraphInput(torch.long, (3,), token_dim=2)


def test_runner_rejects_a_bad_inputs_description() -> None:
    model, cfg, kv = build(1, use_inductor=False)
    for bad, what in [(GraphInput(torch.long), "sequence of vattn.GraphInput"), ([], "non-empty"),
                      ([GraphInput(torch.long), torch.long], "item 1 is a dtype")]:
        with pytest.raises(TypeError, match=what):
            CUDAGraphRunner(model, cfg, kv, inputs=bad, max_batch_size=8, show_progress=False)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="model must be callable"):
        CUDAGraphRunner(None, cfg, kv)


def test_input_buffers_pad_with_zeros_at_fixed_addresses() -> None:
    inputs = _embeds_inputs(torch.float32)
    bufs = InputBuffers(inputs, 8, torch.device("cpu"))
    embeds, positions = torch.randn(4, H), torch.arange(12).view(3, 4)
    got = bufs.load([embeds, positions], 4)
    assert [tuple(v.shape) for v in got] == [(4, H), (3, 4)] and all(v.is_contiguous() for v in got)
    assert torch.equal(got[0], embeds) and torch.equal(got[1], positions)
    got = bufs.load([embeds[:2], positions[:, :2]], 4)  # stale rows 2..3 are zeroed
    assert torch.equal(got[0][:2], embeds[:2]) and not got[0][2:].any()
    assert torch.equal(got[1][:, :2], positions[:, :2]) and not got[1][:, 2:].any()
    for n in (1, 2, 8):  # every size's view starts at the buffer's address
        assert [v.data_ptr() for v in bufs.views(n)] == [f.data_ptr() for f in bufs.flat]
        assert bufs.views(n) is bufs.views(n)


def test_default_adapter_checks_input_ids_and_positions() -> None:
    model, cfg, kv = build(1, use_inductor=False)
    runner = CUDAGraphRunner(model, cfg, kv, max_batch_size=8, show_progress=False)
    assert [(i.dtype, i.shape, i.token_dim, i.name) for i in runner.inputs] == [
        (torch.long, (), 0, "input_ids"), (torch.long, (), 0, "positions")]
    ids, positions, common = _decode_batch(kv, 3, random.Random(0))
    with pytest.raises(TypeError, match=r"input_ids has dtype torch.int32, expected torch.int64.*\.to\("):
        runner(ids.int(), positions, common)
    with pytest.raises(ValueError, match=r"positions has shape \(3, 1\), expected \(T,\)"):
        runner(ids, positions[:, None], common)
    with pytest.raises(TypeError, match=r"got 1 tensor\(s\).*expected 2 \(input_ids, positions\)"):
        runner(ids, common_attn_metadata=common)
    torch.testing.assert_close(runner(ids, positions, common_attn_metadata=common),
                               _eager(model, cfg, kv, (ids, positions), common))


def test_call_arguments_checked_before_anything_runs(emulated_graphs) -> None:
    model, cfg, kv = build(1, attn_backend=GraphSafeBackend, **CPU_MODEL)  # type: ignore[arg-type]
    step, calls = EmbedsStep(model), []

    def counting_step(*args: torch.Tensor) -> torch.Tensor:
        calls.append(len(args))
        return step(*args)

    runner = CUDAGraphRunner(counting_step, cfg, kv, inputs=_embeds_inputs(torch.float32), capture_sizes=(4,),
                             mode=M.FULL_DECODE_ONLY, max_model_len=128, show_progress=False)
    ids, positions, common = _decode_batch(kv, 4, random.Random(1))
    embeds, pos3 = _embeds_adapter(model)(ids, positions)
    bad_calls = [
        ((embeds, common), {}, TypeError, r"got 1 tensor\(s\).*expected 2 \(inputs_embeds, positions\)"),
        ((embeds, pos3, common, common), {}, TypeError, "got 3 tensor"),
        ((embeds, pos3), {}, TypeError, "last positional argument is Tensor"),
        ((), {}, TypeError, "last positional argument is no arguments"),
        ((embeds, pos3), {"common_attn_metadata": "common"}, TypeError, "must be a vattn.CommonAttentionMetadata"),
        ((embeds.double(), pos3, common), {}, TypeError, "inputs_embeds has dtype torch.float64, expected torch.float32"),
        ((embeds, pos3.float(), common), {}, TypeError, "positions has dtype torch.float32, expected torch.int64"),
        ((embeds[:, :-1], pos3, common), {}, ValueError, rf"inputs_embeds has shape \(4, {H - 1}\), expected \(T, {H}\)"),
        ((embeds, pos3.T, common), {}, ValueError, r"positions has shape \(4, 3\), expected \(3, T\)"),
        ((embeds, pos3[0], common), {}, ValueError, r"positions has shape \(4,\), expected \(3, T\)"),
        ((embeds[:3], pos3[:, :3], common), {}, ValueError, "inputs_embeds has 3 tokens .*num_actual_tokens is 4"),
        ((embeds, pos3[:, :3], common), {}, ValueError, r"positions has 3 tokens \(dim 1 of \(3, 3\)\)"),
        ((embeds.to("meta"), pos3, common), {}, ValueError, "inputs_embeds is on meta, the KV cache on cpu"),
        ((embeds, "pos", common), {}, TypeError, "positions must be a torch.Tensor of shape \\(3, T\\)"),
    ]
    for args, kwargs, err, match in bad_calls:
        with pytest.raises(err, match=match):
            runner(*args, **kwargs)
    assert not calls and not runner.captured and runner.last_batch_descriptor is None  # nothing ran
    got = runner(embeds, pos3, common_attn_metadata=common).clone()
    assert runner.captured and runner.last_batch_descriptor.mode is M.FULL and calls == [2, 2, 2]  # warm-up, capture, emulated replay
    torch.testing.assert_close(got, _eager(step, cfg, kv, (embeds, pos3), common))


@pytest.mark.parametrize(
    "mode, compiled",
    [(M.FULL, False), *[(m, True) for m in MODES]],
    ids=lambda v: v.name if isinstance(v, M) else ("compiled" if v else "eager"),
)
def test_step_function_inputs_emulated_on_cpu(mode, compiled: bool, embeds_steps, emulated_graphs) -> None:
    model, cfg, kv, step = embeds_steps("GRAPH_SAFE_TEST", "cpu", compiled)
    _scenario("GRAPH_SAFE_TEST", mode, step, cfg, kv, "cpu-emulated/embeds", inputs=_embeds_inputs(torch.float32),
              adapt=_embeds_adapter(model))


@pytest.mark.cuda
@pytest.mark.parametrize(
    "mode, compiled",
    [(M.FULL, False), *[(m, True) for m in MODES]],
    ids=lambda v: v.name if isinstance(v, M) else ("compiled" if v else "eager"),
)
@pytest.mark.parametrize("backend", ["GRAPH_SAFE_TEST", "TRITON_ATTN"])
def test_step_function_inputs_replay_equals_eager(backend: str, mode, compiled: bool, embeds_steps) -> None:
    """A step over (inputs_embeds (T, H) bf16, positions (3, T)): replay equals eager at every
    captured size (bitwise when exactly sized), padded, and over growing batches."""
    model, cfg, kv, step = embeds_steps(backend, "cuda", compiled)
    _scenario(backend, mode, step, cfg, kv, "cuda/embeds", inputs=_embeds_inputs(CUDA_MODEL["dtype"]),
              adapt=_embeds_adapter(model))


@pytest.mark.cuda
def test_default_adapter_replays_on_cuda(models) -> None:
    """``runner(input_ids, positions, common)`` and the keyword form replay graphs equal to eager
    at every captured size."""
    model, cfg, kv, compiled = models("GRAPH_SAFE_TEST")
    runner = CUDAGraphRunner(compiled, cfg, kv, capture_sizes=SIZES, mode=M.FULL_AND_PIECEWISE, max_model_len=128,
                             show_progress=False)
    try:
        rng = random.Random(4)
        for n in SIZES:
            ids, positions, common = _decode_batch(kv, n, rng)
            _compare(runner, compiled, cfg, kv, ids, positions, common, f"default adapter/decode {n}")
            assert runner.last_batch_descriptor.mode is M.FULL
            keyword = lambda ids, positions: (ids, positions)  # noqa: E731
            saved = {k: t.clone() for k, t in kv.tensors.items()}
            got = runner(*keyword(ids, positions), common_attn_metadata=common).clone()
            for k, t in kv.tensors.items():
                t.copy_(saved[k])
            assert torch.equal(got, _eager(compiled, cfg, kv, (ids, positions), common)), f"keyword call, {n}"
        for q in (3, 5):  # prefills: piecewise graphs
            common = kv.common_metadata([q], [0], [[1 + q]])
            ids, positions = torch.randint(0, VOCAB, (q,), device="cuda"), torch.arange(q, device="cuda")
            _compare(runner, compiled, cfg, kv, ids, positions, common, f"default adapter/prefill {q}")
            assert runner.last_batch_descriptor.mode is M.PIECEWISE
    finally:
        runner.release()


# ---- graphs own their cuBLAS workspace ---------------------------------------------------------

_FOREIGN_CLEAR_SCRIPT = r"""
import gc, random, sys
import torch
from torch import nn
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import vattn
from test_compile import build
from test_cudagraph import CUDA_MODEL, SIZES, GraphSafeBackend, _decode_batch

M = vattn.CUDAGraphMode
# Another library's CUDA graph runs a GEMM first (a benchmark's do_bench, say): torch caches the
# cuBLAS workspace of the shared capture stream in that graph's private pool. The graph goes.
lin = nn.Linear(512, 512, device="cuda")
x0 = torch.randn(8, 512, device="cuda")
lin(x0)  # cuBLAS initialised before the capture (a handle cannot be created inside one)
torch.cuda.synchronize()
g0 = torch.cuda.CUDAGraph()
with torch.cuda.graph(g0):
    lin(x0)
del g0, lin


class WideStep(nn.Module):
    # The test model, then skinny GEMMs with a long reduction (split-K: they use the workspace).
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.wide = nn.Linear(32 * 256, 2048, bias=False, device="cuda", dtype=torch.bfloat16)
        self.narrow = nn.Linear(32 * 256, 64, bias=False, device="cuda", dtype=torch.bfloat16)

    def forward(self, ids, positions):
        h = self.model(ids, positions).repeat(1, 256)
        return torch.cat([self.wide(h), self.narrow(h)], dim=-1)


model, cfg, kv = build(2, attn_backend=GraphSafeBackend, **CUDA_MODEL)
step = WideStep(model).eval()
runner = vattn.CUDAGraphRunner(step, cfg, kv, capture_sizes=SIZES, mode=M.FULL, max_model_len=128,
                               show_progress=False)
ids, positions, common = _decode_batch(kv, 4, random.Random(0))
saved = {k: t.clone() for k, t in kv.tensors.items()}
with torch.no_grad():
    first = runner(ids, positions, common).clone()
assert runner.last_batch_descriptor.mode is M.FULL
# What torch.compile(mode="reduce-overhead") does around each recording, then a capture's
# empty_cache: the first graph's pool is now empty and goes back to the driver.
torch._C._cuda_clearCublasWorkspaces()
gc.collect()
torch.cuda.empty_cache()
junk = torch.full((1 << 26,), float("nan"), device="cuda")  # takes whatever memory was freed
for k, t in kv.tensors.items():
    t.copy_(saved[k])
with torch.no_grad():
    again = runner(ids, positions, common).clone()
torch.cuda.synchronize()
intact = bool(torch.isnan(junk).all())
diff = (first.float() - again.float()).abs().max().item()
print(f"junk intact: {intact}, max |first - again|: {diff}")
assert intact, "the replay wrote into memory it no longer owns"
# bf16 tolerance: a split-K GEMM may reduce in another order from one replay to the next
torch.testing.assert_close(again, first, atol=2e-2, rtol=2e-2)
print("replay unaffected")
"""


@pytest.mark.cuda
def test_full_graph_survives_a_cleared_cublas_workspace(tmp_path) -> None:
    """A replay after another library cleared torch's cuBLAS workspaces (as ``torch.compile(mode=
    "reduce-overhead")`` does around each recording) neither faults nor writes memory it does not
    own: the capture allocated its workspace from the runner's pool. In a subprocess, because an
    illegal memory access leaves the CUDA context unusable."""
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    script = tmp_path / "foreign_clear.py"
    script.write_text(_FOREIGN_CLEAR_SCRIPT)
    res = subprocess.run([sys.executable, str(script), str(tests), str(tests.parent)], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0 and "replay unaffected" in res.stdout, (res.stdout + res.stderr)[-3000:]

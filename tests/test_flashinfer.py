"""FLASHINFER: CPU tests of what needs no GPU (lazy import, selection, reasons, host-side
paging), the builder's plans and the impl's runs checked through a torch stand-in for FlashInfer
(CPU), and GPU tests (markers ``cuda`` + ``flashinfer``) of the library's own sizes against the
float32 reference. What every backend must do (mixed steps, CUDA-graph replay at every size) is
in tests/test_conformance.py.

FlashInfer JIT-compiles one module per (q dtype, kv dtype, head size, window, soft cap): the
default GPU set sticks to bf16 / head 128 (+ fp8 KV); other dtypes, head sizes and features are
``slow`` (each new combination costs 20-80 s of compilation on first use).
"""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from attn_harness import (MIXED, PAGED_ORDERS, STAND_IN_STEPS, STEPS, BatchSpec, RandomBatch, batch_specs,
                          check_graph_replays, check_layer_step, make_random_batch, reference_attention, stride_orders)
from vattn.backends.flashinfer import backend as fi_backend
from vattn.backends.flashinfer import paging as fi_paging
from vattn.core.enums import AttentionCGSupport
from vattn.backends.flashinfer import (
    FlashInferBackend,
    FlashInferImpl,
    FlashInferMetadataBuilder,
    gather_page_indices,
    paged_kv_layout,
)
from vattn.core.metadata import AttentionSpec
from vattn.core.config import VattnConfig



# ---- CPU: lazy import, selection, reasons ---------------------------------------------------


def test_importing_vattn_and_the_backend_module_does_not_import_flashinfer() -> None:
    code = (
        "import sys, vattn, vattn.backends.flashinfer, vattn.backends.flash_attn\n"
        "bad = [m for m in ('flashinfer', 'flash_attn', 'flash_attn_interface') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_unavailable_without_gpu_and_selection_skips_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from vattn import selector
    from vattn.platform import CudaPlatform

    ok, why = FlashInferBackend.is_available()
    assert not ok and "CUDA" in why
    assert any("CUDA" in r for r in FlashInferBackend.validate_configuration(128, torch.bfloat16, "auto", 16))
    # The CUDA priority list starts with FLASH_ATTN and FLASHINFER: both must be skipped.
    monkeypatch.setattr(selector, "current_platform", CudaPlatform())
    selector._cached_get_attn_backend.cache_clear()
    chosen = selector.get_attn_backend(128, torch.bfloat16, "auto", 16)
    assert chosen.get_name() not in ("FLASHINFER", "FLASH_ATTN")
    with selector.global_force_attn_backend_context_manager("FLASHINFER"):
        with pytest.raises(ValueError, match="FLASHINFER.*CUDA"):
            selector.get_attn_backend(128, torch.bfloat16, "auto", 16)
    selector._cached_get_attn_backend.cache_clear()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_layer_overhead_benchmark_refuses_to_run_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import bench_layer_overhead

    assert bench_layer_overhead.main(["--quick"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, expected",
    [
        ((128, torch.bfloat16, "auto", 16), None),
        ((128, torch.float16, "fp8_e4m3", 64), None),
        ((96, torch.bfloat16, "auto", 16), "head_size 96"),
        ((128, torch.float32, "auto", 16), "dtype torch.float32"),
        ((128, torch.bfloat16, "float32", 16), "kv_cache_dtype 'float32'"),
        ((128, torch.bfloat16, "auto", 48), "block_size 48"),
        ((128, torch.bfloat16, "auto", 16, False, True), "sinks not supported"),
        ((128, torch.bfloat16, "auto", 16, True), "MLA not supported"),
    ],
)
def test_validate_configuration_reasons(monkeypatch: pytest.MonkeyPatch, args: tuple, expected: str | None) -> None:
    monkeypatch.setattr(fi_backend, "_availability", lambda: (True, ""))
    reasons = FlashInferBackend.validate_configuration(*args)
    if expected is None:
        assert reasons == []
    else:
        assert any(expected in r for r in reasons), reasons


def test_kv_cache_shape_stride_order_and_cg_level() -> None:
    assert FlashInferBackend.get_kv_cache_shape(10, 16, 2, 64) == (10, 2, 16, 2, 64)
    with pytest.raises(ValueError, match="block_size"):
        FlashInferBackend.get_kv_cache_shape(10, 0, 2, 64)
    assert stride_orders(FlashInferBackend) == PAGED_ORDERS
    assert FlashInferBackend.get_cudagraph_support() == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE


def test_paged_layout_and_page_gather() -> None:
    indptr, last = paged_kv_layout(torch.tensor([5, 16, 17, 0, 1]), 16)
    assert indptr.tolist() == [0, 1, 2, 4, 4, 5] and last.tolist() == [5, 16, 1, 0, 1]
    table = torch.tensor([[3, 9, 9], [4, 9, 9], [7, 8, 9], [9, 9, 9], [2, 9, 9]], dtype=torch.int32)
    assert gather_page_indices(table, indptr).tolist() == [3, 4, 7, 8, 2]
    out = torch.full((7,), -1, dtype=torch.int32)
    gather_page_indices(table, indptr, out=out[:5])
    assert out.tolist() == [3, 4, 7, 8, 2, -1, -1]  # writes exactly indptr[-1] entries
    assert gather_page_indices(table, torch.zeros(3, dtype=torch.int32)).numel() == 0
    # Random layouts, a block table that is a column slice of a wider one (not contiguous).
    g = torch.Generator().manual_seed(3)
    wide = torch.randint(0, 1000, (9, 40), generator=g, dtype=torch.int32)
    pages = torch.randint(0, 31, (7,), generator=g)
    indptr = torch.zeros(8, dtype=torch.int32)
    torch.cumsum(pages, 0, out=indptr[1:])
    want = [int(wide[r, j]) for r in range(7) for j in range(int(pages[r]))]
    assert gather_page_indices(wide[:, :31], indptr).tolist() == want


def _layers(cfg: VattnConfig, windows: list[int | None], caps: list[float | None]) -> list[str]:
    """Stand-ins for vattn.Attention layers (what the builder reads: impl, dtype, kv_cache)."""
    names = []
    for i, (w, c) in enumerate(zip(windows, caps)):
        name = f"model.layers.{i}.attn"
        impl = FlashInferImpl(8, 64, 0.125, 2, sliding_window=w, logits_soft_cap=c)
        cfg.compilation.static_forward_context[name] = types.SimpleNamespace(
            impl=impl, dtype=torch.bfloat16, kv_cache=[torch.tensor([])])
        names.append(name)
    return names


def test_builder_needs_one_window_cap_and_scale_across_layers() -> None:
    spec = AttentionSpec(16, 2, 64, torch.bfloat16)
    cfg = VattnConfig()
    names = _layers(cfg, [None, 128, None], [None, None, 30.0])
    with pytest.raises(ValueError, match=r"window_left.*logits_soft_cap|logits_soft_cap.*window_left") as e:
        FlashInferMetadataBuilder(spec, names, cfg, torch.device("cpu"))
    assert "model.layers.1.attn" in str(e.value) and "FLASH_ATTN" in str(e.value)
    ok = FlashInferMetadataBuilder(spec, names[:1], cfg, torch.device("cpu"))
    assert (ok.window_left, ok.logits_soft_cap, ok.sm_scale, ok.num_qo_heads) == (-1, None, 0.125, 8)


@pytest.mark.parametrize("kwargs", [dict(alibi_slopes=[0.5] * 8), dict(sinks=torch.zeros(8)),
                                    dict(attn_type="encoder_only")])
def test_impl_refuses_what_flashinfer_cannot_do(kwargs: dict) -> None:
    with pytest.raises(NotImplementedError, match=f"FLASHINFER {next(iter(kwargs))}: expected .* got .*; use "):
        FlashInferImpl(8, 64, 0.125, 2, **kwargs)


# ---- a torch stand-in for FlashInfer (CPU): the builder's plans and the impl's runs ------------


class _FakeWrapper:
    """FlashInfer's paged-wrapper contract in torch: ``plan`` records the CSR page layout (into
    the caller's buffers in CUDA-graph mode), ``run`` attends over exactly what the buffers say."""

    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 use_tensor_cores: bool = False, paged_kv_indptr_buffer: torch.Tensor | None = None,
                 paged_kv_indices_buffer: torch.Tensor | None = None,
                 paged_kv_last_page_len_buffer: torch.Tensor | None = None) -> None:
        self.layout, self.graph = kv_layout, use_cuda_graph
        self.bufs = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
        self.qo_indptr: torch.Tensor | None = None
        self.causal = True
        self.fast_plans = 0

    def _layout(self, indptr: torch.Tensor, indices: torch.Tensor, last: torch.Tensor, kw: dict, copy: bool) -> None:
        assert indptr.device.type == "cpu" and last.device.type == "cpu", "plan wants host indptr / last_page_len"
        assert int(indptr[-1]) == indices.numel()
        self.kw = kw
        if self.graph:
            ip, ix, lp = self.bufs
            assert ip.numel() == indptr.numel() and lp.numel() == last.numel(), "CUDA-graph batch size is fixed"
            if copy:
                ip.copy_(indptr), ix[: indices.numel()].copy_(indices), lp.copy_(last)
            self.indptr, self.indices, self.last = ip, ix, lp
        else:
            self.indptr, self.indices, self.last = indptr.clone(), indices.clone(), last.clone()

    def run(self, q: torch.Tensor, paged: torch.Tensor, k_scale: float | None = None,
            v_scale: float | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        kc, vc = paged[:, 0], paged[:, 1]
        if self.layout == "HND":
            kc, vc = kc.transpose(1, 2), vc.transpose(1, 2)
        ps, hk, d = kc.shape[1:]
        indptr, indices, last = self.indptr.cpu(), self.indices.cpu().long(), self.last.cpu()
        b = indptr.numel() - 1
        qo = self.qo_indptr if self.qo_indptr is not None else torch.arange(b + 1)
        assert out is not None and out.shape == q.shape and q.shape[0] == int(qo[-1])
        keys, values = [], []
        for r in range(b):
            pages = indices[indptr[r] : indptr[r + 1]]
            n = (pages.numel() - 1) * ps + int(last[r]) if pages.numel() else 0
            keys.append(kc[pages].reshape(-1, hk, d)[:n].float() * (k_scale or 1.0))
            values.append(vc[pages].reshape(-1, hk, d)[:n].float() * (v_scale or 1.0))
        wl, cap = self.kw["window_left"], self.kw["logits_soft_cap"]
        res = reference_attention(q, keys, values, (qo[1:] - qo[:-1]).tolist(), scale=self.kw["sm_scale"],
                                  causal=self.causal, sliding_window=wl + 1 if wl >= 0 else None,
                                  logits_soft_cap=cap)
        out.copy_(res.to(out.dtype))
        return out


class _FakeDecode(_FakeWrapper):
    def plan(self, indptr, indices, last, num_qo_heads, num_kv_heads, head_dim, page_size, **kw):  # type: ignore[no-untyped-def]
        self._layout(indptr, indices, last, kw, copy=True)


class _FakePrefill(_FakeWrapper):
    def plan(self, qo_indptr, indptr, indices, last, num_qo_heads, num_kv_heads, head_dim, page_size,  # type: ignore[no-untyped-def]
             causal=False, **kw):
        self.qo_indptr, self.causal = qo_indptr.clone(), causal
        self._layout(indptr, indices, last, kw, copy=True)


def _fast_decode_plan(w, indptr, indices, last, num_qo_heads, num_kv_heads, head_dim, page_size,  # type: ignore[no-untyped-def]
                      pos_encoding_mode="NONE", global_override_indptr_cpu=None, **kw):
    """Like FlashInfer's: no copies, the persistent buffers must already hold the batch."""
    assert w.graph and torch.equal(global_override_indptr_cpu, indptr)
    w._layout(indptr, indices, last, kw, copy=False)
    w.fast_plans += 1


@pytest.fixture
def fake_flashinfer(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = types.ModuleType("flashinfer")
    mod.BatchDecodeWithPagedKVCacheWrapper = _FakeDecode  # type: ignore[attr-defined]
    mod.BatchPrefillWithPagedKVCacheWrapper = _FakePrefill  # type: ignore[attr-defined]
    dec = types.ModuleType("flashinfer.decode")
    dec.fast_decode_plan = _fast_decode_plan  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashinfer", mod)
    monkeypatch.setitem(sys.modules, "flashinfer.decode", dec)
    monkeypatch.setattr(fi_paging, "WORKSPACE_BYTES", 1024)
    monkeypatch.setattr(fi_paging, "_workspaces", {})
    monkeypatch.setattr(fi_backend, "_availability", lambda: (True, ""))


# ---- shared by the CPU stand-in tests and the GPU tests ----------------------------------------


def _check(batch: RandomBatch, *, factor: float = 2.0, **features: object) -> None:
    """One step through the layer (``attn_harness.check_layer_step``): FLASHINFER's (N, 2, ...) cache included."""
    check_layer_step(FlashInferBackend, batch, factor=factor, **features)


def _spec(case: dict, device: str) -> BatchSpec:
    return BatchSpec(**{"num_heads": 16, "num_kv_heads": 4, "head_size": 128, "dtype": torch.bfloat16,
                        "device": device, **case})


_slow = pytest.mark.slow
#: FlashInfer's page and head sizes that tests/test_conformance.py does not run (it runs the mixed,
#: decode, prefill, HND, MHA / MQA, fp16 and fp8 steps at this geometry).
GPU_CASES = [
    pytest.param("mixed-block1"),
    pytest.param("mixed-block64-gqa4"),
    pytest.param("mixed-d64", marks=_slow),
    pytest.param("mixed-d256", marks=_slow),
]
FEATURES = [pytest.param(dict(sliding_window=24), id="window"), pytest.param(dict(logits_soft_cap=8.0), id="softcap")]


@pytest.mark.parametrize("case", STAND_IN_STEPS)
def test_plans_with_a_torch_stand_in(fake_flashinfer: None, case: str) -> None:
    """CPU: the builder's CSR layouts, row ranges, scales and the impl's calls describe the batch."""
    _check(make_random_batch(_spec({**STEPS[case], "head_size": 64}, "cpu"), seed=1), factor=3.0)


@pytest.mark.parametrize("features", FEATURES)
def test_window_and_soft_cap_with_a_torch_stand_in(fake_flashinfer: None, features: dict) -> None:
    _check(make_random_batch(_spec({**MIXED, "head_size": 64}, "cpu"), seed=2), **features)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=batch_specs(max_reqs=6, head_sizes=(64,), dtypes=(torch.bfloat16,), kv_cache_dtypes=("auto", "fp8")))
def test_fuzz_with_a_torch_stand_in(fake_flashinfer: None, spec: BatchSpec) -> None:
    _check(make_random_batch(spec, seed=0), factor=3.0)


def test_graph_path_with_a_torch_stand_in(fake_flashinfer: None) -> None:
    """CPU: persistent buffers, changed-only copies and fast re-plans give the eager result."""
    kw = dict(num_heads=16, num_kv_heads=4, head_size=64, dtype=torch.bfloat16, device="cpu", layout="HND")
    check_graph_replays(FlashInferBackend, kw, (1, 4, 8), num_blocks=120)


# ---- GPU ------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", GPU_CASES)
@pytest.mark.cuda
@pytest.mark.flashinfer
def test_matches_reference(case: str) -> None:
    _check(make_random_batch(_spec(STEPS[case], "cuda"), seed=1))


@pytest.mark.cuda
@pytest.mark.flashinfer
@settings(max_examples=30, deadline=None)
@given(spec=batch_specs(device="cuda", head_sizes=(128,), dtypes=(torch.bfloat16,), kv_cache_dtypes=("auto", "fp8"),
                        block_sizes=(1, 16, 32, 64)))
def test_fuzz(spec: BatchSpec) -> None:
    """Random mixed batches (GQA 1-8, NHD/HND, padding) on the JIT modules the default set builds."""
    _check(make_random_batch(spec, seed=0), factor=3.0)


@pytest.mark.parametrize("features", FEATURES)
@pytest.mark.slow
@pytest.mark.cuda
@pytest.mark.flashinfer
def test_window_and_soft_cap(features: dict) -> None:
    _check(make_random_batch(_spec(MIXED, "cuda"), seed=2), **features)


@pytest.mark.cuda
def test_fenced_plan_waits_until_the_gpu_read_the_last_plan() -> None:
    """FlashInfer's plan pattern (write the schedule into a pinned host buffer, copy it to the device
    asynchronously) planned again while the GPU is behind: each step still reads its own plan."""
    from vattn.backends.flashinfer.paging import fenced_plan

    class Planner:
        def __init__(self) -> None:
            self.host = torch.zeros(1, dtype=torch.int64).pin_memory()
            self.dev = torch.zeros(1, dtype=torch.int64, device="cuda")

        def plan(self, value: int) -> None:
            self.host.fill_(value)
            self.dev.copy_(self.host, non_blocking=True)

    planner, seen = Planner(), []
    for step in range(1, 6):
        torch.cuda._sleep(20_000_000)  # the GPU is busy: the plan's copy waits in the stream
        fenced_plan(planner, lambda: planner.plan(step))
        seen.append(planner.dev.clone())  # what this step's kernels would read
    torch.cuda.synchronize()
    assert [int(t) for t in seen] == [1, 2, 3, 4, 5]

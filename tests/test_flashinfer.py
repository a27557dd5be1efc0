"""FLASHINFER: CPU tests of what needs no GPU (lazy import, selection, reasons, host-side
paging), and GPU tests (markers ``cuda`` + ``flashinfer``) against the float32 reference of
tests/attn_harness.py, including CUDA-graph replay vs eager at every captured size.

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

from attn_harness import (
    BatchSpec,
    RandomBatch,
    assert_close,
    check_cache_untouched,
    check_cache_written,
    make_random_batch,
)
from vattn.backends import flashinfer as fi_mod
from vattn.backends.abstract import AttentionCGSupport
from vattn.backends.flashinfer import (
    FlashInferBackend,
    FlashInferImpl,
    FlashInferMetadataBuilder,
    gather_page_indices,
    paged_kv_layout,
)
from vattn.backends.utils import AttentionSpec, set_kv_cache_layout
from vattn.config import CacheConfig, CompilationConfig, CUDAGraphMode, VattnConfig, set_current_vattn_config

gpu = [pytest.mark.cuda, pytest.mark.flashinfer]


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
    monkeypatch.setattr(fi_mod, "_availability", lambda: (True, ""))
    reasons = FlashInferBackend.validate_configuration(*args)
    if expected is None:
        assert reasons == []
    else:
        assert any(expected in r for r in reasons), reasons


def test_kv_cache_shape_stride_order_and_cg_level() -> None:
    assert FlashInferBackend.get_kv_cache_shape(10, 16, 2, 64) == (10, 2, 16, 2, 64)
    with pytest.raises(ValueError, match="block_size"):
        FlashInferBackend.get_kv_cache_shape(10, 0, 2, 64)
    try:
        set_kv_cache_layout("HND")
        assert FlashInferBackend.get_kv_cache_stride_order() == (0, 1, 3, 2, 4)
        set_kv_cache_layout("NHD")
        assert FlashInferBackend.get_kv_cache_stride_order() == (0, 1, 2, 3, 4)
    finally:
        set_kv_cache_layout(None)
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


def _layers(cfg: VattnConfig, windows: list[int | None], caps: list[float | None]) -> list[str]:
    import vattn

    names = []
    with set_current_vattn_config(cfg):
        for i, (w, c) in enumerate(zip(windows, caps)):
            name = f"model.layers.{i}.attn"
            vattn.Attention(8, 64, 0.125, num_kv_heads=2, prefix=name, attn_backend=FlashInferBackend,
                            per_layer_sliding_window=w, logits_soft_cap=c)
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
    with pytest.raises(NotImplementedError, match="FLASHINFER does not support"):
        FlashInferImpl(8, 64, 0.125, 2, **kwargs)


# ---- GPU ------------------------------------------------------------------------------------


def _fi_cache(src: torch.Tensor, layout: str) -> torch.Tensor:
    """The harness cache (2, N, bs, Hk, D) copied into FlashInfer's (N, 2, bs, Hk, D), physical ``layout``."""
    two, n, bs, hk, d = src.shape
    if layout == "NHD":
        cache = torch.empty((n, 2, bs, hk, d), dtype=src.dtype, device=src.device)
    else:
        cache = torch.empty((n, 2, hk, bs, d), dtype=src.dtype, device=src.device).permute(0, 1, 3, 2, 4)
    cache.copy_(src.transpose(0, 1))
    return cache


def _setup(spec: BatchSpec, cache: torch.Tensor, cfg: VattnConfig | None = None, **impl_kwargs: object):
    impl = FlashInferImpl(spec.num_heads, spec.head_size, spec.head_size**-0.5, spec.num_kv_heads,
                          kv_cache_dtype=spec.kv_cache_dtype, **impl_kwargs)  # type: ignore[arg-type]
    cfg = cfg or VattnConfig()
    cfg.compilation.static_forward_context["fi.attn"] = types.SimpleNamespace(impl=impl, dtype=spec.dtype, kv_cache=[cache])
    kv_spec = AttentionSpec(spec.block_size, spec.num_kv_heads, spec.head_size, cache.dtype, spec.kv_cache_dtype)
    set_kv_cache_layout(spec.layout)
    try:
        builder = FlashInferMetadataBuilder(kv_spec, ["fi.attn"], cfg, cache.device)
    finally:
        set_kv_cache_layout(None)
    return impl, builder


def _check(batch: RandomBatch, *, factor: float = 2.0, **features: object) -> None:
    spec = batch.spec
    cache = _fi_cache(batch.kv_cache, spec.layout)
    impl, builder = _setup(spec, cache, **features)
    md = builder.build(0, batch.common)
    before = cache.transpose(0, 1).clone()
    out = torch.zeros_like(batch.query)
    assert impl.forward(batch.layer, batch.query, batch.key, batch.value, cache, md, output=out) is out  # type: ignore[arg-type]
    torch.cuda.synchronize()
    ref = batch.reference(scale=impl.scale, **features)
    assert_close(out[: batch.num_actual_tokens], ref, spec.dtype, factor=factor)
    check_cache_untouched(before, cache.transpose(0, 1), batch.common.slot_mapping)
    check_cache_written(batch, kv_cache=cache.transpose(0, 1))


MIXED = dict(context_lens=(0, 37, 100, 5, 64, 0), query_lens=(1, 1, 1, 1, 23, 40))
DECODE = dict(context_lens=(15, 16, 17, 300, 1), query_lens=(1, 1, 1, 1, 1))
PREFILL = dict(context_lens=(0, 0, 33), query_lens=(70, 5, 17))

_slow = pytest.mark.slow
CASES = [
    pytest.param(dict(**MIXED), id="mixed"),
    pytest.param(dict(**DECODE, num_pad_tokens=3), id="decode-padded"),
    pytest.param(dict(**PREFILL), id="prefill"),
    pytest.param(dict(**MIXED, layout="HND"), id="mixed-HND"),
    pytest.param(dict(**MIXED, block_size=1), id="mixed-block1"),
    pytest.param(dict(**MIXED, block_size=64, num_heads=32, num_kv_heads=8), id="mixed-block64-gqa4"),
    pytest.param(dict(**MIXED, num_heads=8, num_kv_heads=8), id="mixed-mha"),
    pytest.param(dict(**MIXED, kv_cache_dtype="fp8", k_scale=0.05, v_scale=0.03), id="mixed-fp8"),
    pytest.param(dict(**MIXED, kv_cache_dtype="fp8_e5m2", layout="HND"), id="mixed-fp8e5m2-HND", marks=_slow),
    pytest.param(dict(**MIXED, head_size=64), id="mixed-d64", marks=_slow),
    pytest.param(dict(**MIXED, head_size=256), id="mixed-d256", marks=_slow),
    pytest.param(dict(**MIXED, dtype=torch.float16), id="mixed-fp16", marks=_slow),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.cuda
@pytest.mark.flashinfer
def test_matches_reference(case: dict) -> None:
    spec = BatchSpec(**{"num_heads": 16, "num_kv_heads": 4, "head_size": 128, "dtype": torch.bfloat16,
                        "device": "cuda", **case})
    _check(make_random_batch(spec, seed=1), factor=3.0 if "fp8" in spec.kv_cache_dtype else 2.0)


@pytest.mark.parametrize("features", [dict(sliding_window=24), dict(logits_soft_cap=8.0)],
                         ids=["window", "softcap"])
@pytest.mark.slow
@pytest.mark.cuda
@pytest.mark.flashinfer
def test_window_and_soft_cap(features: dict) -> None:
    spec = BatchSpec(**MIXED, num_heads=16, num_kv_heads=4, head_size=128, dtype=torch.bfloat16, device="cuda")
    _check(make_random_batch(spec, seed=2), **features)


def _decode_common(spec_kwargs: dict, size: int, seed: int):
    """A random pure-decode batch of fewer than ``size`` requests, padded to ``size`` tokens and requests."""
    from vattn.kv_cache import build_common_attn_metadata

    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, size + 1, (1,), generator=g))
    ctx = tuple(int(c) for c in torch.randint(0, 200, (n,), generator=g))
    batch = make_random_batch(BatchSpec(context_lens=ctx, query_lens=(1,) * n, **spec_kwargs), seed=seed)
    common = build_common_attn_metadata([1] * n, list(ctx), batch.block_tables, batch.spec.block_size,
                                        device="cuda", num_tokens_padded=size, num_reqs_padded=size,
                                        max_blocks_per_req=batch.common.block_table_tensor.shape[1])
    return batch, common


@pytest.mark.parametrize("layout", ["NHD", pytest.param("HND", marks=_slow)])
@pytest.mark.cuda
@pytest.mark.flashinfer
def test_cuda_graph_replay_equals_eager_at_every_size(layout: str) -> None:
    sizes = (1, 2, 4, 8, 16, 32)
    kw = dict(num_heads=16, num_kv_heads=4, head_size=128, dtype=torch.bfloat16, device="cuda", layout=layout,
              extra_blocks=40)
    for size in sizes:
        batch0, common0 = _decode_common(kw, size, seed=size)
        spec = batch0.spec
        cache = _fi_cache(batch0.kv_cache, layout)
        cfg = VattnConfig(compilation=CompilationConfig(cudagraph_mode=CUDAGraphMode.FULL_DECODE_ONLY,
                                                        cudagraph_capture_sizes=sizes))
        impl, builder = _setup(spec, cache, cfg)
        q = torch.zeros(size, spec.num_heads, spec.head_size, dtype=spec.dtype, device="cuda")
        k = torch.zeros(size, spec.num_kv_heads, spec.head_size, dtype=spec.dtype, device="cuda")
        v, out = torch.zeros_like(k), torch.zeros_like(q)
        slots = common0.slot_mapping  # the persistent slot buffer the graph reads
        md = builder.build_for_cudagraph_capture(common0)
        assert md.use_cuda_graph and md.decode_rows == size
        for _ in range(2):  # warm-up (JIT) outside the capture
            impl.forward(batch0.layer, q, k, v, cache, md, output=out)  # type: ignore[arg-type]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            impl.forward(batch0.layer, q, k, v, cache, md, output=out)  # type: ignore[arg-type]
        for seed in (100 + size, 200 + size):  # two replays: the second re-plans without copies
            batch, common = _decode_common(kw, size, seed=seed)
            fresh = _fi_cache(batch.kv_cache, layout)
            cache.copy_(fresh)
            slots.copy_(common.slot_mapping)
            common.slot_mapping = slots
            md2 = builder.build(0, common)
            assert md2.decode_wrapper is md.decode_wrapper and md2.use_cuda_graph
            n = batch.num_actual_tokens
            q.copy_(torch.nn.functional.pad(batch.query, (0, 0, 0, 0, 0, size - n)))
            k.copy_(torch.nn.functional.pad(batch.key, (0, 0, 0, 0, 0, size - n)))
            v.copy_(torch.nn.functional.pad(batch.value, (0, 0, 0, 0, 0, size - n)))
            graph.replay()
            torch.cuda.synchronize()
            eager_cache = _fi_cache(batch.kv_cache, layout)
            eager_impl, eager_builder = _setup(spec, eager_cache)  # no CUDA graphs configured
            eager_out = torch.zeros_like(batch.query)
            eager_impl.forward(batch.layer, batch.query, batch.key, batch.value, eager_cache,  # type: ignore[arg-type]
                               eager_builder.build(0, batch.common), output=eager_out)
            torch.cuda.synchronize()
            assert_close(out[:n], eager_out[:n].float(), spec.dtype)
            assert_close(out[:n], batch.reference(scale=impl.scale), spec.dtype, factor=2.0)
            torch.testing.assert_close(cache, eager_cache, atol=0, rtol=0)


@pytest.mark.cuda
@pytest.mark.flashinfer
def test_layer_end_to_end_through_the_custom_op() -> None:
    """vattn.Attention + allocate_kv_cache + build_common_attn_metadata, vs the TORCH_SDPA layer."""
    import vattn

    outs = {}
    for backend in ("FLASHINFER", "TORCH_SDPA"):
        cfg = VattnConfig(cache=CacheConfig(block_size=16))
        torch.manual_seed(0)
        with set_current_vattn_config(cfg), torch.device("cuda"):
            prev = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)
            try:
                layer = vattn.Attention(16, 128, 128**-0.5, num_kv_heads=4, prefix="l0.attn", attn_backend=backend)
            finally:
                torch.set_default_dtype(prev)
        kv = vattn.allocate_kv_cache(cfg, num_blocks=64, device="cuda", dtype=torch.bfloat16)
        steps = [([5, 9], [0, 0], [[3, 7], [1]]), ([1, 1], [5, 9], [[3, 7], [1]]), ([1, 20], [6, 10], [[3, 7], [1, 2]])]
        res = []
        for qlens, computed, tables in steps:
            common = vattn.build_common_attn_metadata(qlens, computed, tables, 16, device="cuda")
            t = sum(qlens)
            g = torch.Generator(device="cuda").manual_seed(t)
            q = torch.randn(t, 16 * 128, device="cuda", generator=g).bfloat16()
            k = torch.randn(t, 4 * 128, device="cuda", generator=g).bfloat16()
            v = torch.randn(t, 4 * 128, device="cuda", generator=g).bfloat16()
            with vattn.set_forward_context(kv.build_metadata(common), cfg):
                res.append(layer(q, k, v).float())
        outs[backend] = torch.cat(res)
    torch.testing.assert_close(outs["FLASHINFER"], outs["TORCH_SDPA"], atol=3e-2, rtol=3e-2)

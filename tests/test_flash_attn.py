"""FLASH_ATTN: CPU tests of what needs no GPU (interface limits, selection reasons, the
builder's CUDA-graph buffers and launch parameters), the impl's calls checked through a torch
stand-in for flash-attn-4 (CPU), and GPU tests (markers ``cuda`` + ``flash_attn``) of the
library's own sizes and of both metadata paths against the float32 reference. What every
backend must do (mixed steps, CUDA-graph replay at every size) is in tests/test_conformance.py.
"""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attn_harness import (MIXED, PAGED_ORDERS, STAND_IN_STEPS, STEPS, BatchSpec, RandomBatch, batch_specs,
                          check_graph_replays, check_layer_step, make_random_batch, reference_attention,
                          skip_unless_served, stride_orders)
from vattn.backends.flash_attn import interface as fa_interface
from vattn.core.enums import AttentionCGSupport
from vattn.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadataBuilder,
    FlashAttnInterface,
    interface_reasons,
)
from vattn.core.metadata import AttentionSpec
from vattn.core.config import CompilationConfig, CUDAGraphMode, VattnConfig
from vattn.metadata import build_common_attn_metadata

BF16, FP16 = torch.bfloat16, torch.float16


# ---- CPU: interface limits, reasons, selection ----------------------------------------------


@pytest.mark.parametrize(
    "name, arch, args, expected",
    [
        ("fa4", 90, (128, BF16, "auto", 16, False), None),
        ("fa4", 90, (256, FP16, "auto", 1, True), None),  # any page size, learnable sinks
        ("fa4", 90, (264, BF16, "auto", 16, False), "head_size 264"),
        ("fa4", 90, (60, BF16, "auto", 16, False), "head_size 60"),
        ("fa4", 90, (128, BF16, "fp8", 16, False), "no fp8 KV cache"),
        ("fa4", 100, (192, BF16, "auto", 16, False), "head_size 192"),
        ("fa4", 100, (256, BF16, "fp8_e4m3", 128, False), None),
        ("fa4", 100, (128, FP16, "fp8", 128, False), "model dtype must be bfloat16"),
        ("fa3", 90, (128, BF16, "fp8", 16, False), None),
        ("fa3", 90, (128, BF16, "fp8_e5m2", 16, False), "no fp8 KV cache"),
        ("fa3", 90, (128, BF16, "auto", 16, True), "sinks need flash-attn-4"),
        ("fa2", 80, (128, BF16, "auto", 16, False), "block_size % 256"),
        ("fa2", 80, (128, FP16, "auto", 512, False), None),
        ("fa2", 90, (128, torch.float32, "float32", 256, False), "dtype torch.float32"),
        ("fa2", 90, (128, BF16, "float32", 256, False), "kv_cache_dtype 'float32'"),
    ],
)
def test_interface_limits(name: str, arch: int, args: tuple, expected: str | None) -> None:
    reasons = interface_reasons(name, arch, *args)
    if expected is None:
        assert reasons == []
    else:
        assert any(expected in r for r in reasons), reasons


def test_validate_configuration_uses_the_installed_interface(monkeypatch: pytest.MonkeyPatch) -> None:
    fa2 = FlashAttnInterface("fa2", "2.8.3", fn=lambda *a, **k: None)
    monkeypatch.setattr(fa_interface, "get_flash_attn_interface", lambda: (fa2, ""))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    assert FlashAttentionBackend.validate_configuration(128, BF16, "auto", 256) == []
    assert any("block_size % 256" in r for r in FlashAttentionBackend.validate_configuration(128, BF16, "auto", 16))
    assert any("MLA" in r for r in FlashAttentionBackend.validate_configuration(128, BF16, "auto", 256, True))
    assert FlashAttentionBackend.get_cudagraph_support() == AttentionCGSupport.UNIFORM_BATCH
    monkeypatch.setattr(fa_interface, "get_flash_attn_interface", lambda: (None, "no usable FlashAttention (x)"))
    assert FlashAttentionBackend.validate_configuration(128, BF16, "auto", 16) == ["no usable FlashAttention (x)"]
    assert FlashAttentionBackend.get_cudagraph_support() == AttentionCGSupport.ALWAYS


def test_alibi_is_refused_at_selection_unless_fa2(monkeypatch: pytest.MonkeyPatch) -> None:
    """ALiBi is declared for FA2 only: with flash-attn-4 installed the selector passes FLASH_ATTN
    over for an ALiBi layer (instead of choosing it and failing in the impl's constructor)."""
    for name, refused in (("fa4", True), ("fa2", False)):
        iface = FlashAttnInterface(name, "x", fn=lambda *a, **k: None)
        monkeypatch.setattr(fa_interface, "get_flash_attn_interface", lambda iface=iface: (iface, ""))
        reasons = FlashAttentionBackend.feature_reasons(use_alibi=True)
        assert (reasons == [f"ALiBi needs FA2, the installed interface is {name}"]) is refused, reasons
        assert FlashAttentionBackend.feature_reasons(use_sliding_window=True) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_unavailable_without_gpu_and_forced_selection_says_why() -> None:
    from vattn import selector

    ok, why = FlashAttentionBackend.is_available()
    assert not ok and "CUDA" in why
    with selector.global_force_attn_backend_context_manager("FLASH_ATTN"):
        with pytest.raises(ValueError, match="FLASH_ATTN.*CUDA"):
            selector.get_attn_backend(128, BF16, "auto", 16)


def test_kv_cache_shape_and_stride_order() -> None:
    assert FlashAttentionBackend.get_kv_cache_shape(10, 16, 2, 64) == (2, 10, 16, 2, 64)
    with pytest.raises(ValueError, match="head_size"):
        FlashAttentionBackend.get_kv_cache_shape(10, 16, 2, -1)
    assert stride_orders(FlashAttentionBackend) == PAGED_ORDERS
    assert FlashAttentionBackend.get_kv_cache_stride_order() == PAGED_ORDERS["NHD"]  # the default


def test_impl_refuses_encoder_attention() -> None:
    with pytest.raises(NotImplementedError, match="decoder self-attention"):
        FlashAttentionImpl(8, 64, 0.125, 2, attn_type="encoder")


# ---- CPU: the builder's CUDA-graph buffers ------------------------------------------------------


def _builder(device: str, sizes: tuple[int, ...] = (4, 8), num_blocks: int = 50, block_size: int = 16,
             mode: CUDAGraphMode = CUDAGraphMode.FULL) -> FlashAttentionMetadataBuilder:
    cfg = VattnConfig(compilation=CompilationConfig(cudagraph_mode=mode, cudagraph_capture_sizes=sizes,
                                                    max_capture_size=max(sizes)))
    cache = torch.zeros(2, num_blocks, block_size, 2, 64, dtype=BF16, device=device)
    impl = FlashAttentionImpl(8, 64, 0.125, 2)
    cfg.compilation.static_forward_context["fa.attn"] = types.SimpleNamespace(impl=impl, dtype=BF16, kv_cache=[cache])
    return FlashAttentionMetadataBuilder(AttentionSpec(block_size, 2, 64, BF16), ["fa.attn"], cfg, torch.device(device))


def test_graph_steps_use_persistent_buffers_and_fixed_launch_params() -> None:
    b = _builder("cpu")
    # Mixed: 2 decodes + a 4-token prefill = 6 tokens, padded to the capture size 8.
    c1 = build_common_attn_metadata([1, 1, 4], [9, 30, 0], [[5], [1, 2], [7]], 16, num_tokens_padded=8)
    m1 = b.build(0, c1)
    assert m1.use_cuda_graph and (m1.max_query_len, m1.max_seq_len) == (8, 50 * 16)
    assert m1.query_start_loc.tolist() == [0, 1, 2, 6, 6, 6, 6, 6, 6]
    assert m1.seq_lens.tolist() == [10, 31, 4, 0, 0, 0, 0, 0]
    assert m1.block_table.shape == (8, 50) and m1.block_table[:3, :2].tolist() == [[5, 0], [1, 2], [7, 0]]
    # A different batch of the same size: same buffers (what the captured graph reads), new contents.
    c2 = build_common_attn_metadata([1] * 5, [3, 4, 5, 6, 40], [[1], [2], [3], [4], [8, 9, 11]], 16,
                                    num_tokens_padded=8, num_reqs_padded=8)
    m2 = b.build(0, c2)
    for a, z in ((m1.query_start_loc, m2.query_start_loc), (m1.seq_lens, m2.seq_lens), (m1.block_table, m2.block_table)):
        assert a.data_ptr() == z.data_ptr() and a.shape == z.shape
    assert m2.query_start_loc.tolist() == list(range(9)) and m2.seq_lens.tolist() == [4, 5, 6, 7, 41, 1, 1, 1]
    assert m2.block_table[4, :3].tolist() == [8, 9, 11]
    # Not a capture size: the common tensors as they are, exact launch params.
    c3 = build_common_attn_metadata([1, 2], [9, 0], [[5], [7]], 16)
    m3 = b.build(0, c3)
    assert not m3.use_cuda_graph and (m3.max_query_len, m3.max_seq_len) == (2, 10)
    assert m3.query_start_loc.tolist() == [0, 1, 3] and m3.seq_lens.tolist() == [10, 2]


def test_graph_capture_marks_a_size_and_graph_errors_are_clear() -> None:
    b = _builder("cpu", mode=CUDAGraphMode.NONE, num_blocks=3)
    c = build_common_attn_metadata([1, 1], [3, 4], [[0], [1]], 16, num_tokens_padded=4)
    assert not b.build(0, c).use_cuda_graph  # graphs off: eager
    assert b.build_for_cudagraph_capture(c).use_cuda_graph
    assert b.build(0, c).use_cuda_graph  # that size was captured: persistent buffers from now on
    with pytest.raises(ValueError, match="exceeds the largest capture size 8"):
        b.build_for_cudagraph_capture(build_common_attn_metadata([1] * 9, [0] * 9, [[i] for i in range(9)], 16))
    with pytest.raises(ValueError, match="needs 4 blocks but the CUDA-graph page table holds 3"):
        b.build(0, build_common_attn_metadata([1], [60], [[0, 1, 2, 3]], 16, num_tokens_padded=4))


def test_small_batches_use_the_persistent_path_on_cuda() -> None:
    b = _builder("cpu", num_blocks=3)
    b.use_persistent_buffers = True  # what __init__ sets on CUDA
    m = b.build(0, build_common_attn_metadata([1, 2], [9, 0], [[1], [2]], 16))  # 3 tokens: no capture size
    assert not m.use_cuda_graph and m.max_query_len == 3 and m.query_start_loc.tolist() == [0, 1, 3, 3]
    assert m.block_table.data_ptr() == b._persistent(None)["table"].data_ptr()  # type: ignore[arg-type]
    wide = b.build(0, build_common_attn_metadata([1, 2], [60, 0], [[0, 1, 3, 4], [2]], 16))  # 4 pages > 3
    assert wide.max_query_len == 2 and wide.block_table.shape == (2, 4)  # the caller's tensors
    big = b.build(0, build_common_attn_metadata([1] * 9, [0] * 9, [[i] for i in range(9)], 16))  # above the largest size
    assert big.max_query_len == 1 and big.query_start_loc.shape == (10,)


def test_fa2_gets_cumulative_key_lengths() -> None:
    b = _builder("cpu")
    b.iface = FlashAttnInterface("fa2", "2.8.3", fn=lambda *a, **k: None)
    c = build_common_attn_metadata([1, 2], [9, 0], [[5], [7]], 16)
    assert b.build(0, c).cu_seqlens_k.tolist() == [0, 10, 12]
    c8 = build_common_attn_metadata([1, 3], [9, 0], [[5], [7]], 16, num_tokens_padded=8)
    assert b.build(0, c8).cu_seqlens_k.tolist() == [0, 10, 13, 13, 13, 13, 13, 13, 13]


# ---- a torch stand-in for flash-attn-4's varlen paged forward (CPU) --------------------------


def _fake_fa4_fwd(q, k, v, *, out, cu_seqlens_q, seqused_k, page_table, max_seqlen_q, max_seqlen_k,  # type: ignore[no-untyped-def]
                  softmax_scale, causal, softcap=0.0, num_splits=1, learnable_sink=None,
                  window_size_left=None, window_size_right=None, q_descale=None, k_descale=None, v_descale=None):
    """The varlen paged contract in torch; asserts the launch bounds a real kernel relies on."""
    cu, used, table = cu_seqlens_q.cpu().long(), seqused_k.cpu().long(), page_table.cpu().long()
    b = cu.numel() - 1
    qlens = (cu[1:] - cu[:-1]).tolist()
    assert table.shape[0] == b == used.numel() and out.shape[0] == q.shape[0] >= int(cu[-1])
    assert max(qlens, default=0) <= max_seqlen_q and int(used.max()) <= max_seqlen_k
    assert window_size_right in (None, 0)
    ps, hk, d = k.shape[1:]
    scale_q = 1.0 if q_descale is None else float(q_descale[0, 0])
    keys, values = [], []
    for r in range(b):
        pages = table[r, : -(-int(used[r]) // ps)]
        keys.append(k[pages].reshape(-1, hk, d)[: used[r]].float() * (1.0 if k_descale is None else float(k_descale[r, 0])))
        values.append(v[pages].reshape(-1, hk, d)[: used[r]].float() * (1.0 if v_descale is None else float(v_descale[r, 0])))
    n = int(cu[-1])
    res = reference_attention(q[:n].float() * scale_q, keys, values, qlens, scale=softmax_scale, causal=causal,
                              sliding_window=None if window_size_left is None else window_size_left + 1,
                              logits_soft_cap=softcap or None, sinks=learnable_sink)
    out[:n] = res.to(out.dtype)
    return out, None, None, None, None


@pytest.fixture
def fake_fa4(monkeypatch: pytest.MonkeyPatch) -> None:
    """flash-attn-4 on an SM100 GPU, as far as selection and the layer can tell."""
    iface = FlashAttnInterface("fa4", "stand-in", fn=_fake_fa4_fwd, has_out=True)
    monkeypatch.setattr(fa_interface, "get_flash_attn_interface", lambda: (iface, ""))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (10, 0))


# ---- shared by the CPU stand-in tests and the GPU tests ----------------------------------------


def _check(batch: RandomBatch, *, factor: float = 2.0, persistent: bool = False, **features: object) -> None:
    """One step through the layer (``attn_harness.check_layer_step``), metadata in persistent buffers or not."""
    if batch.spec.device == "cuda":
        skip_unless_served(FlashAttentionBackend, batch.spec, **features)
    check_layer_step(FlashAttentionBackend, batch, factor=factor, builder_attrs={"use_persistent_buffers": persistent},
                     **features)


def _spec(case: dict, device: str) -> BatchSpec:
    return BatchSpec(**{"num_heads": 16, "num_kv_heads": 4, "head_size": 128, "dtype": BF16, "device": device,
                        **case})


#: The harness's named steps and FlashAttention's large pages, each through both metadata paths on the GPU.
CASES = {**STEPS, "mixed-block128-tma": dict(**MIXED, block_size=128), "mixed-block256": dict(**MIXED, block_size=256)}


def _features(name: str) -> dict:
    return {"window": dict(sliding_window=24), "softcap": dict(logits_soft_cap=8.0),
            "sinks": dict(sinks=torch.randn(16, generator=torch.Generator().manual_seed(0)))}[name]


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "eager"])
@pytest.mark.parametrize("case", STAND_IN_STEPS)
def test_calls_with_a_torch_stand_in(fake_fa4: None, case: str, persistent: bool) -> None:
    """CPU: the impl's varlen call (cu_seqlens, seqused_k, page table, scales) describes the batch."""
    _check(make_random_batch(_spec({**CASES[case], "head_size": 32}, "cpu"), seed=1), factor=3.0,
           persistent=persistent)


@pytest.mark.parametrize("feature", ["window", "softcap", "sinks"])
def test_features_with_a_torch_stand_in(fake_fa4: None, feature: str) -> None:
    _check(make_random_batch(_spec({**MIXED, "head_size": 32}, "cpu"), seed=2), **_features(feature))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=batch_specs(max_reqs=6, head_sizes=(32,), dtypes=(BF16,)), persistent=st.booleans())
def test_fuzz_with_a_torch_stand_in(fake_fa4: None, spec: BatchSpec, persistent: bool) -> None:
    _check(make_random_batch(spec, seed=0), factor=3.0, persistent=persistent)


def test_graph_path_with_a_torch_stand_in(fake_fa4: None) -> None:
    """CPU: decode and mixed batches through the persistent buffers give the eager result."""
    kw = dict(num_heads=16, num_kv_heads=4, head_size=32, dtype=BF16, device="cpu")
    check_graph_replays(FlashAttentionBackend, kw, (1, 4, 8), num_blocks=120)


# ---- GPU ------------------------------------------------------------------------------------


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "eager"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.cuda
@pytest.mark.flash_attn
def test_matches_reference(case: str, persistent: bool) -> None:
    """Both metadata paths: persistent buffers with fixed launch params (what CUDA graphs replay,
    and every small batch on CUDA), and the caller's tensors with exact launch params."""
    spec = _spec(CASES[case], "cuda")
    _check(make_random_batch(spec, seed=1), factor=3.0 if "fp8" in spec.kv_cache_dtype else 2.0,
           persistent=persistent)


@pytest.mark.cuda
@pytest.mark.flash_attn
@settings(max_examples=30, deadline=None)
@given(spec=batch_specs(device="cuda", head_sizes=(64, 128, 256), dtypes=(FP16, BF16), block_sizes=(1, 16, 64, 128)),
       persistent=st.booleans())
def test_fuzz(spec: BatchSpec, persistent: bool) -> None:
    """Random mixed batches: GQA 1-8, head sizes, dtypes, page sizes, NHD/HND, padding."""
    _check(make_random_batch(spec, seed=0), factor=3.0, persistent=persistent)


@pytest.mark.parametrize("feature", ["window", "softcap", "sinks"])
@pytest.mark.cuda
@pytest.mark.flash_attn
def test_window_soft_cap_and_sinks(feature: str) -> None:
    _check(make_random_batch(_spec(MIXED, "cuda"), seed=2), **_features(feature))

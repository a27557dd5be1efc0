"""FLEX_ATTENTION vs float32 references: mixed paged batches, the layer features as mods, user
masks (prefix-LM, document packing, chunked local, streaming, per-head), score mods, the block
masks' structure, the layer and selection, ``vattn.compile``, and (marked ``cuda``) the GPU.

Most tests run FlexAttention's reference implementation (``compiled=False``): it evaluates the
mask over the whole cache, which checks the physical-to-logical mapping everywhere, and compiles
nothing. The compiled kernels, which read only the blocks the block masks list, are checked
on a few batches (each launch shape compiles once per process, seconds on CPU); the block
masks themselves are checked structurally (``flex_harness.check_block_masks``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attn_harness import (BatchSpec, RandomBatch, assert_close, assert_no_host_sync, batch_specs, check_cache_untouched,
                          check_cache_written, layer_features, make_random_batch)
from flex_harness import causal_allowed, check_block_masks, explicit_reference, positions, run_impl
from vattn.core.enums import AttentionCGSupport
from vattn.backends.flex_attention import FlexAttentionBackend, FlexAttentionImpl, MaskSpec, mods
from vattn.backends.flex_attention.compiled import bucket, default_kernel_options
from vattn.backends.flex_attention.paging import FULL

MIXED = dict(context_lens=(7, 0, 33, 0, 12, 5), query_lens=(1, 1, 1, 9, 6, 17))
GEOMETRY = dict(num_heads=8, num_kv_heads=2, head_size=64, block_size=16)


def mixed(seed: int = 0, **kw: object) -> RandomBatch:
    return make_random_batch(BatchSpec(**{**MIXED, **GEOMETRY, **kw}), seed=seed)  # type: ignore[arg-type]


def check(batch: RandomBatch, *, compiled: bool = False, factor: float = 1.0, gather: bool | None = None,
          **features: object) -> FlexAttentionImpl:
    """Run with the layer ``features`` (harness names); compare with the harness reference and
    check the cache, the padding rows and the block masks."""
    impl_kwargs = dict(features)
    out, before, impl, md = run_impl(batch, compiled=compiled, gather=gather, **impl_kwargs)
    n = batch.num_actual_tokens
    assert_close(out[:n], batch.reference(scale=impl.scale, **features), batch.spec.dtype, factor=factor)
    assert torch.count_nonzero(out[n:]) == 0, "padded token rows of the output were written"
    check_cache_untouched(before, batch.kv_cache, batch.common.slot_mapping)
    check_cache_written(batch)
    check_block_masks(md, impl.mask_spec)
    return impl


# ---- declarations ---------------------------------------------------------------------------


def test_backend_facts() -> None:
    B = FlexAttentionBackend
    assert B.get_name() == "FLEX_ATTENTION" and B.accept_output_buffer and B.runs_on_cpu
    assert B.supports_mask_mod and B.supports_score_mod and B.supports_sink and B.supports_alibi
    assert B.get_kv_cache_shape(10, 16, 2, 64) == (2, 10, 16, 2, 64)
    assert B.get_kv_cache_stride_order() == (0, 1, 2, 3, 4)  # NHD whatever the global layout
    assert B.is_available() == (True, "")
    assert B.validate_configuration(64, torch.bfloat16, "auto", 16) == []
    assert any("kv_cache_dtype" in r for r in B.validate_configuration(64, torch.bfloat16, "fp8", 16))
    assert any("head_size" in r for r in B.validate_configuration(12, torch.bfloat16, "auto", 16))
    assert B.validate_configuration(8, torch.float32, "auto", 4) == []  # CPU: any block size, small heads
    assert B.get_cudagraph_support() == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    assert [bucket(n) for n in (0, 1, 2, 3, 5, 64, 65)] == [1, 1, 2, 4, 8, 64, 128]
    # CUDA: a key tile that divides the cache block (Inductor's default tiles reach 128 keys).
    cuda = torch.device("cuda")
    assert [default_kernel_options(cuda, bs).get("BLOCK_N") for bs in (16, 48, 64, 128)] == [16, 16, 64, None]
    assert default_kernel_options(torch.device("cpu"), 16) == {}


def test_block_sizes_on_cuda_are_multiples_of_16(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert FlexAttentionBackend.validate_configuration(64, torch.float16, "auto", 32) == []
    assert any("multiple of 16" in r for r in FlexAttentionBackend.validate_configuration(64, torch.float16, "auto", 8))
    assert any("at least 16" in r for r in FlexAttentionBackend.validate_configuration(8, torch.float16, "auto", 16))


def test_impl_rejects_bad_arguments() -> None:
    with pytest.raises(NotImplementedError, match="^FLEX_ATTENTION kv_cache_dtype: expected"):
        FlexAttentionImpl(4, 64, 0.1, kv_cache_dtype="fp8")
    with pytest.raises(NotImplementedError, match="^FLEX_ATTENTION attn_type: expected"):
        FlexAttentionImpl(4, 64, 0.1, attn_type="encoder_decoder")
    with pytest.raises(TypeError, match="mask_mod"):
        FlexAttentionImpl(4, 64, 0.1, mask_mod=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="alibi_slopes"):
        FlexAttentionImpl(4, 64, 0.1, alibi_slopes=[1.0])
    # output_scale is refused by the op, before any impl runs (tests/test_custom_ops.py).


def test_mods_reject_bad_arguments() -> None:
    with pytest.raises(ValueError, match="window"):
        mods.sliding_window(0)
    with pytest.raises(TypeError, match="prompt_lens"):
        mods.prefix_lm(torch.zeros(3, 2, dtype=torch.int32))
    with pytest.raises(TypeError, match="doc_ids"):
        mods.document(torch.zeros(3))
    with pytest.raises(ValueError, match="cap"):
        mods.soft_cap(-1.0)


# ---- mixed batches, the layer's features -------------------------------------------------------

FEATURES = {"causal": {}, **layer_features(8)}


@pytest.mark.parametrize("name", sorted(FEATURES))
def test_feature(name: str) -> None:
    check(mixed(seed=11, num_pad_tokens=2), **FEATURES[name])


@pytest.mark.parametrize("dtype, kv", [(torch.bfloat16, "auto"), (torch.float16, "auto"), (torch.bfloat16, "float32")])
def test_dtypes(dtype: torch.dtype, kv: str) -> None:
    check(mixed(seed=12, dtype=dtype, kv_cache_dtype=kv), factor=2.0)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=batch_specs(max_reqs=8, head_sizes=(16, 64), block_sizes=(1, 4, 16)), seed=st.integers(0, 2**16))
def test_fuzz_mixed_batches(spec: BatchSpec, seed: int) -> None:
    """Decodes then chunked prefills, odd lengths, GQA 1-8, both cache layouts (HND is read
    through a copy: FLEX_ATTENTION allocates NHD), padding tokens, spare blocks."""
    check(make_random_batch(spec, seed=seed), factor=2.0 if spec.dtype != torch.float32 else 1.0)


@pytest.mark.parametrize("name", sorted(FEATURES))
def test_gathered_launch_feature(name: str) -> None:
    """Multi-token launches over a gathered copy of their keys (CUDA's prefill path): logical
    tiles, logical mods."""
    check(mixed(seed=13, num_pad_tokens=2), gather=True, **FEATURES[name])


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=batch_specs(max_reqs=8, head_sizes=(16, 64), block_sizes=(1, 4, 16)), seed=st.integers(0, 2**16))
def test_fuzz_gathered_launches(spec: BatchSpec, seed: int) -> None:
    check(make_random_batch(spec, seed=seed), gather=True, factor=2.0 if spec.dtype != torch.float32 else 1.0)


@pytest.mark.parametrize("context", [0, 5], ids=["fresh", "context"])
def test_dense_launch_reads_views(context: int) -> None:
    """Requests of one power-of-two query length filling the padded batch: the queries and the
    output are views of the step's tokens; without context (``fresh``) the masks read no
    per-row facts."""
    batch = make_random_batch(BatchSpec(context_lens=(context,) * 4, query_lens=(32,) * 4, **GEOMETRY), seed=14)
    for gather in (False, True):
        for features in ({}, dict(sliding_window=7, logits_soft_cap=3.0)):
            out, _, impl, md = run_impl(batch, gather=gather, **features)
            (call,) = md.calls
            assert call.dense and call.fresh == (context == 0) and call.gathered == gather
            ref = batch.reference(scale=impl.scale, **features)
            assert_close(out[: batch.num_actual_tokens], ref, torch.float32)
            check_block_masks(md, impl.mask_spec)


def test_gathered_slots_stay_in_the_cache() -> None:
    """A table entry past the cache (hand-built device metadata the host never checked) is
    clamped into it: the gather reads a wrong row, never out of bounds."""
    batch = mixed(seed=15)
    table = batch.common.block_table_tensor.clone()
    table[3, 0] = 10_000
    common = dataclasses.replace(batch.common, block_table_tensor=table)
    _, _, _, md = run_impl(batch, common=common, gather=True)
    slots = md.calls[-1].kv_slots
    assert slots is not None and int(slots.min()) >= 0 and int(slots.max()) < md.num_cache_blocks * batch.spec.block_size


def test_flash_backend_falls_back_to_triton_when_it_cannot_compile(monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """A launch whose ``BACKEND="FLASH"`` kernel does not compile (Inductor raises; here a
    stand-in for it, as the CPU ignores the option) logs one warning and runs the other
    kernel, then stays on it for that shape key."""
    from torch.nn.attention.flex_attention import create_block_mask

    from vattn.backends.flex_attention import compiled

    made = compiled._new_callable

    def new_callable(tag: int, backend: str) -> object:
        fn = made(tag, backend)

        def call(*args: object) -> object:
            if (args[6] or {}).get("BACKEND") == "FLASH":
                raise RuntimeError("InductorError: the FLASH backend cannot lower this mask_mod")
            return fn(*args)

        return call

    monkeypatch.setattr(compiled, "_new_callable", new_callable)
    g = torch.Generator().manual_seed(16)
    q, k, v = (torch.randn(1, h, 32, 16, generator=g) for h in (4, 2, 2))
    mask = create_block_mask(lambda b, h, i, j: j <= i, None, None, 32, 32, device="cpu", BLOCK_SIZE=16)
    outs = []
    with caplog.at_level("WARNING", logger="vattn.backends.flex_attention"):
        for _ in range(2):
            outs.append(compiled.run_flex(q, k, v, score_mod=None, block_mask=mask, scale=0.25,
                                          kernel_options={"BACKEND": "FLASH"}, return_lse=False, compiled=True,
                                          mods_key=("fallback-test",))[0])
    assert sum("FLASH backend cannot compile" in r.getMessage() for r in caplog.records) == 1
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    want = torch.nn.functional.scaled_dot_product_attention(q, kk, vv, is_causal=True, scale=0.25)
    torch.testing.assert_close(outs[0], want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[1], outs[0])


def test_shared_prefix_block_and_untouched_padding_requests() -> None:
    """Two requests read the same first block (prefix caching); a CUDA-graph-style padded
    request (one padding token, block 0, seq_len 1) contributes nothing and writes nothing."""
    batch = mixed(seed=13, block_size=4)
    batch.common.block_table_tensor[4, 1] = batch.block_tables[2][1]  # positions 4-7: context of both
    batch.full_keys[4][4:8] = batch.full_keys[2][4:8]
    batch.full_values[4][4:8] = batch.full_values[2][4:8]
    from vattn.cudagraph.policy import pad_common_attn_metadata

    padded = pad_common_attn_metadata(batch.common, batch.num_actual_tokens + 1, batch.spec.num_reqs + 1)
    query = torch.cat([batch.query, torch.randn_like(batch.query[:1])])
    batch.query, batch.key, batch.value = query, torch.cat([batch.key, batch.key[:1]]), torch.cat([batch.value, batch.value[:1]])
    out, before, impl, md = run_impl(batch, common=padded)
    n = batch.num_actual_tokens
    assert_close(out[:n], batch.reference(scale=impl.scale), torch.float32)
    check_cache_untouched(before, batch.kv_cache, padded.slot_mapping)
    check_block_masks(md, impl.mask_spec)


def test_decode_only_batch_is_one_launch_without_gather() -> None:
    batch = make_random_batch(BatchSpec(context_lens=(5, 63, 16, 1, 40), query_lens=(1,) * 5, **GEOMETRY), seed=5)
    impl = check(batch, sliding_window=9)
    _, _, _, md = run_impl(batch, sliding_window=9)
    (call,) = md.calls
    assert call.query_index is None and call.query_len == 1 and call.batch == 8 and impl.mask_spec.window == 9


def test_non_causal_batch() -> None:
    batch = mixed(seed=14)
    batch.common.causal = False
    out, _, impl, md = run_impl(batch)
    allowed = [torch.ones_like(a) for a in causal_allowed(batch)]
    assert_close(out[: batch.num_actual_tokens], explicit_reference(batch, impl.scale, allowed), torch.float32)
    assert md.calls[0].block_masks and next(iter(md.calls[0].block_masks)).base == FULL
    check_block_masks(md, impl.mask_spec)


def test_warmup_without_metadata_touches_nothing() -> None:
    batch = mixed()
    before = batch.kv_cache.clone()
    out = torch.zeros_like(batch.query)
    impl = FlexAttentionImpl(8, 64, 0.125, 2)
    assert impl.forward(batch.layer, batch.query, batch.key, batch.value, batch.kv_cache, None, output=out) is out  # type: ignore[arg-type]
    assert torch.equal(before, batch.kv_cache) and torch.count_nonzero(out) == 0


# ---- user masks and scores -----------------------------------------------------------------------


def prompt_lens_of(batch: RandomBatch) -> torch.Tensor:
    """Per request, a prompt of about two thirds of its tokens (at least its context)."""
    return torch.tensor([max(c, (2 * (c + q)) // 3) for c, q in zip(batch.spec.context_lens, batch.spec.query_lens)],
                        dtype=torch.int32)


def test_prefix_lm() -> None:
    batch = make_random_batch(BatchSpec(context_lens=(0, 0, 8, 3), query_lens=(1, 13, 20, 9), **GEOMETRY), seed=21)
    prompt = prompt_lens_of(batch)
    out, _, impl, md = run_impl(batch, mask_mod=mods.prefix_lm(prompt))
    allowed = [(k <= q) | (k < prompt[r]) for r, (q, k) in enumerate(positions(batch, r) for r in range(4))]
    assert any((a & ~c).any() for a, c in zip(allowed, causal_allowed(batch)))  # it does see ahead
    assert_close(out[: batch.num_actual_tokens], explicit_reference(batch, impl.scale, allowed), torch.float32)
    check_block_masks(md, impl.mask_spec)


def test_document_packing() -> None:
    batch = make_random_batch(BatchSpec(context_lens=(6, 0, 19), query_lens=(1, 30, 12), **GEOMETRY), seed=22)
    doc = torch.zeros(4, 40, dtype=torch.int32)
    for r, cuts in enumerate(([3], [5, 6, 17, 29], [10, 20, 26])):  # document starts per request
        for c in cuts:
            doc[r, c:] += 1
    out, _, impl, md = run_impl(batch, mask_mod=mods.document(doc))
    allowed = []
    for r in range(3):
        q, k = positions(batch, r)
        allowed.append((k <= q) & (doc[r, q.flatten()][:, None] == doc[r, k.flatten()][None, :]))
    assert_close(out[: batch.num_actual_tokens], explicit_reference(batch, impl.scale, allowed), torch.float32)
    check_block_masks(md, impl.mask_spec)


@pytest.mark.parametrize("name", ["chunked_local", "streaming", "sliding_window"])
def test_structured_masks(name: str) -> None:
    batch = mixed(seed=23)
    mask = {"chunked_local": mods.chunked_local(8), "streaming": mods.streaming(6, 3),
            "sliding_window": mods.sliding_window(7)}[name]
    rules = {"chunked_local": lambda q, k: (k <= q) & (k // 8 == q // 8),
             "streaming": lambda q, k: (k <= q) & ((k > q - 6) | (k < 3)),
             "sliding_window": lambda q, k: (k <= q) & (k > q - 7)}
    out, _, impl, md = run_impl(batch, mask_mod=mask)
    allowed = [rules[name](*positions(batch, r)) for r in range(batch.spec.num_reqs)]
    assert_close(out[: batch.num_actual_tokens], explicit_reference(batch, impl.scale, allowed), torch.float32)
    check_block_masks(md, impl.mask_spec)


def test_per_head_mask_and_user_score_mod_with_layer_features() -> None:
    """A mask that differs by head (built per head), a relative-position bias as score_mod,
    on top of the layer's window and soft cap."""
    batch = mixed(seed=24)
    bias = torch.linspace(-1.0, 1.0, 64)

    def every_other_head_is_local(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        return (kv_idx <= q_idx) & ((h % 2 == 0) | (q_idx - kv_idx < 4))

    def relative(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        return score + bias[(q_idx - kv_idx).clamp(0, 63)]

    out, _, impl, md = run_impl(batch, mask_mod=every_other_head_is_local, score_mod=relative, mask_per_head=True,
                                sliding_window=10, logits_soft_cap=5.0)
    assert impl.mask_spec.heads == 8
    heads = torch.arange(8)[:, None, None]
    allowed = [((k <= q) & (k > q - 10) & ((heads % 2 == 0) | (q - k < 4))) for q, k in
               (positions(batch, r) for r in range(batch.spec.num_reqs))]

    def score(s: torch.Tensor, r: int, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return 5.0 * torch.tanh(s / 5.0) + bias[(q - k).clamp(0, 63)]

    want = explicit_reference(batch, impl.scale, allowed, score=score)
    assert_close(out[: batch.num_actual_tokens], want, torch.float32)
    check_block_masks(md, impl.mask_spec)


def test_mods_see_request_index_and_positions() -> None:
    """b is the request's index in the step; q_idx / kv_idx are positions in its sequence."""
    batch = mixed(seed=25)
    only = torch.tensor([2, 4], dtype=torch.int32)

    def requests_2_and_4_see_only_position_0(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        special = (b == only[0]) | (b == only[1])
        return torch.where(special, kv_idx == 0, kv_idx <= q_idx)

    out, _, impl, _ = run_impl(batch, mask_mod=requests_2_and_4_see_only_position_0)
    allowed = causal_allowed(batch)
    for r in (2, 4):
        allowed[r] = torch.zeros_like(allowed[r])
        allowed[r][:, 0] = True
    assert_close(out[: batch.num_actual_tokens], explicit_reference(batch, impl.scale, allowed), torch.float32)


# ---- the layer and selection ----------------------------------------------------------------------


def test_attention_with_a_mask_mod_selects_flex_and_other_backends_refuse() -> None:
    import vattn

    prompt = torch.zeros(8, dtype=torch.int32)
    assert vattn.get_attn_backend(64, torch.float32, "auto", 16, use_mask_mod=True) is FlexAttentionBackend
    assert vattn.get_attn_backend(64, torch.float32, "auto", 16, use_score_mod=True) is FlexAttentionBackend
    with vattn.set_current_vattn_config(vattn.VattnConfig()):
        layer = vattn.Attention(8, 64, 0.125, num_kv_heads=2, prefix="l0.attn", mask_mod=mods.prefix_lm(prompt))
        assert layer.attn_backend is FlexAttentionBackend
        with pytest.raises(ValueError, match=r"attn_backend=TORCH_SDPA cannot serve this layer: mask_mod not supported"):
            vattn.Attention(8, 64, 0.125, prefix="l1.attn", attn_backend="TORCH_SDPA", mask_mod=mods.causal)
        with pytest.raises(ValueError, match=r"score_mod: expected a function of 5 positional tensors"):
            vattn.Attention(8, 64, 0.125, prefix="l2.attn", score_mod=mods.causal)


def test_through_vattn_attention_layer() -> None:
    """The layer and the opaque op pass scale, window, soft cap, sinks and the mods through."""
    import vattn

    batch = mixed(seed=26, num_pad_tokens=2)
    prompt = prompt_lens_of(batch)
    sinks = torch.linspace(-1.0, 2.0, 8)
    cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=16))
    with vattn.set_current_vattn_config(cfg):
        layer = vattn.Attention(8, 64, 0.1, num_kv_heads=2, prefix="l0.attn", per_layer_sliding_window=12,
                                logits_soft_cap=4.0, sinks=sinks, mask_mod=mods.prefix_lm(prompt), compiled=False)
    layer.kv_cache = [batch.kv_cache]
    spec = vattn.AttentionSpec(16, 2, 64, torch.float32)
    builder = FlexAttentionBackend.get_builder_cls()(spec, ["l0.attn"], cfg, torch.device("cpu"))
    assert builder.layer_specs() == [layer.impl.mask_spec]
    md = builder.build(0, batch.common)
    assert builder.num_cache_blocks == batch.kv_cache.shape[1]  # found from the layer's bound cache
    T = batch.query.shape[0]
    before = batch.kv_cache.clone()
    with vattn.set_forward_context({"l0.attn": md}, cfg):
        out = layer(batch.query.view(T, -1), batch.key.view(T, -1), batch.value.view(T, -1))
    n = batch.num_actual_tokens
    allowed = [((k <= q) | (k < prompt[r])) & (k > q - 12) for r, (q, k) in
               enumerate(positions(batch, r) for r in range(batch.spec.num_reqs))]
    want = explicit_reference(batch, 0.1, allowed, score=lambda s, r, q, k: 4.0 * torch.tanh(s / 4.0), sinks=sinks)
    assert_close(out[:n].view(n, 8, 64), want, torch.float32)
    check_cache_untouched(before, batch.kv_cache, batch.common.slot_mapping)


# ---- vattn.compile and CUDA graphs -----------------------------------------------------------------


def flex_model(num_layers: int, *, compiled: bool = False, **kw: object) -> tuple:
    """test_compile's TinyModel on FLEX_ATTENTION (``compiled``: Inductor FlexAttention inside the op)."""
    from test_compile import build

    kw.setdefault("attn_backend", FlexAttentionBackend)
    model, cfg, kv = build(num_layers, block_size=16, **kw)  # type: ignore[arg-type]
    for layer in model.layers:
        layer.attn.impl.compiled = compiled
    return model, cfg, kv


@pytest.mark.parametrize("inner", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["reference", "inductor"])
def test_vattn_compile_fullgraph_no_recompiles(inner: bool) -> None:
    """The model compiles once (fullgraph, the attention op opaque) and never again as the
    batch composition changes; every step matches the uncompiled model."""
    import vattn
    from test_compile import Batches, run

    model, cfg, kv = flex_model(2, compiled=inner, use_inductor=inner)
    step = vattn.compile(model, cfg)
    batches = Batches(kv, seed=7)
    sizes = set()
    for i in range(16):
        ids, positions, common = batches.step()
        sizes.add(ids.shape[0])
        saved = {k: t.clone() for k, t in kv.tensors.items()}
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = run(step, cfg, kv, ids, positions, common)
        for k, t in kv.tensors.items():
            t.copy_(saved[k])
        torch.testing.assert_close(got, run(model, cfg, kv, ids, positions, common), atol=2e-5, rtol=2e-5)
    assert len(sizes) > 5 and step.backend.counter.num_graphs_seen == 1


@pytest.fixture
def emulated_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA graphs emulated on CPU (test_cudagraph's: a replay re-runs the step with the
    capture-time metadata, so only what the builder updates in place reaches it)."""
    from test_cudagraph import emulated_graphs as fixture

    fixture.__wrapped__(monkeypatch)


@pytest.mark.parametrize("mode", ["FULL_AND_PIECEWISE", pytest.param("FULL_DECODE_ONLY", marks=pytest.mark.slow)])
def test_cuda_graph_contract_emulated_on_cpu(mode: str, emulated_graphs: None) -> None:
    """Decode steps replay from the persistent block masks and launch tensors; replay equals
    eager at every captured size, padded ones too, over steps where sequences grow and join."""
    import vattn
    from test_cudagraph import _scenario

    model, cfg, kv = flex_model(2, use_inductor=False)
    _scenario("FLEX_ATTENTION", getattr(vattn.CUDAGraphMode, mode), vattn.compile(model, cfg), cfg, kv,
              "cpu-emulated")


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["FLEX_ATTENTION", "TREE_ATTN"])
@pytest.mark.parametrize("mode", ["FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "PIECEWISE"])
def test_cuda_graph_replay_equals_eager(mode: str, backend: str) -> None:
    """TREE_ATTN's layers (no mods) run TRITON_ATTN's kernel from its half of the metadata."""
    import vattn
    from test_cudagraph import CUDA_MODEL, _scenario
    from vattn.backends.tree_attn import TreeAttentionBackend

    model, cfg, kv = flex_model(2, compiled=True, **{k: v for k, v in CUDA_MODEL.items() if k != "block_size"},
                                **({"attn_backend": TreeAttentionBackend} if backend == "TREE_ATTN" else {}))
    _scenario(backend, getattr(vattn.CUDAGraphMode, mode), vattn.compile(model, cfg), cfg, kv, "cuda")


# ---- compiled ------------------------------------------------------------------------------------


@pytest.mark.parametrize("gather", [False, True], ids=["in-place", "gathered"])
@pytest.mark.parametrize("mask", ["causal", "prefix_lm"])
def test_compiled_matches_the_reference(mask: str, gather: bool) -> None:
    """Inductor's kernels read only the listed blocks; two batches of one shape share one compile."""
    for seed in (30, 31):
        batch = mixed(seed=seed)
        prompt = prompt_lens_of(batch)
        kwargs = {} if mask == "causal" else {"mask_mod": mods.prefix_lm(prompt)}
        out, _, impl, _ = run_impl(batch, compiled=True, gather=gather, **kwargs)
        allowed = [(k <= q) | (k < (prompt[r] if mask != "causal" else 0)) for r, (q, k) in
                   enumerate(positions(batch, r) for r in range(batch.spec.num_reqs))]
        assert_close(out[: batch.num_actual_tokens], explicit_reference(batch, impl.scale, allowed), torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["window", "all", "softcap", "alibi"])
def test_compiled_features(name: str) -> None:
    check(mixed(seed=32), compiled=True, **FEATURES[name])


# ---- CUDA (run on the GPU machine) ------------------------------------------------------------------


@pytest.mark.cuda
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=batch_specs(device="cuda", block_sizes=(16, 32), dtypes=(torch.bfloat16, torch.float16)),
       seed=st.integers(0, 2**16))
def test_cuda_fuzz_compiled(spec: BatchSpec, seed: int) -> None:
    check(make_random_batch(spec, seed=seed), compiled=True, factor=2.0)


@pytest.mark.cuda
@pytest.mark.parametrize("name", sorted(FEATURES))
def test_cuda_feature_compiled(name: str) -> None:
    feats = {"causal": {}, **layer_features(8, "cuda")}[name]
    check(mixed(seed=33, dtype=torch.bfloat16, device="cuda"), compiled=True, factor=2.0, **feats)


@pytest.mark.cuda
@pytest.mark.parametrize("name", sorted(FEATURES))
@pytest.mark.parametrize("fresh", [True, False], ids=["fresh", "context"])
def test_cuda_gathered_prefill_features_compiled(name: str, fresh: bool) -> None:
    """Prefills of at least one query tile read gathered keys (FlashAttention's kernel where
    flash-attn-4 is installed, else Triton's): every layer feature, whole prompts of one length
    (dense, fresh) and ragged prompts over cached context."""
    feats = {"causal": {}, **layer_features(8, "cuda")}[name]
    lens = dict(context_lens=(0, 0), query_lens=(128, 128)) if fresh else dict(context_lens=(0, 40, 7),
                                                                                query_lens=(1, 150, 131))
    batch = make_random_batch(BatchSpec(**lens, dtype=torch.bfloat16, device="cuda", **GEOMETRY), seed=36)
    out, _, impl, md = run_impl(batch, compiled=True, **feats)
    assert md.calls[-1].gathered and md.calls[-1].fresh == fresh
    assert_close(out[: batch.num_actual_tokens], batch.reference(scale=impl.scale, **feats), torch.bfloat16,
                 factor=2.0)


@pytest.mark.cuda
def test_cuda_forward_without_host_sync() -> None:
    """After the first (compiling) call, a forward is device work only: no host sync."""
    batch = mixed(seed=35, dtype=torch.bfloat16, device="cuda")
    out, _, impl, md = run_impl(batch, compiled=True, sinks=torch.linspace(-1.0, 1.0, 8, device="cuda"))
    assert_no_host_sync(lambda: impl.forward(batch.layer, batch.query, batch.key, batch.value, batch.kv_cache, md,
                                             output=out))
    assert torch.isfinite(out.float()).all()


@pytest.mark.cuda
def test_cuda_prefix_lm_and_documents_compiled() -> None:
    """A prefill longer than one query tile (130 tokens), prefix-LM then document masks, bf16."""
    batch = make_random_batch(BatchSpec(context_lens=(0, 0, 8, 3), query_lens=(1, 130, 20, 9), dtype=torch.bfloat16,
                                        device="cuda", **GEOMETRY), seed=34)
    prompt = prompt_lens_of(batch).cuda()
    doc = (torch.arange(160, device="cuda") // 37).expand(4, 160).contiguous()  # documents of 37 tokens
    for mask, rule in ((mods.prefix_lm(prompt), lambda r, q, k: (k <= q) | (k < prompt[r])),
                       (mods.document(doc), lambda r, q, k: (k <= q) & (q // 37 == k // 37))):
        out, _, impl, md = run_impl(batch, compiled=True, mask_mod=mask)
        allowed = [rule(r, *positions(batch, r)) for r in range(4)]
        assert_close(out[: batch.num_actual_tokens], explicit_reference(batch, impl.scale, allowed), torch.bfloat16,
                     factor=2.0)
        check_block_masks(md, impl.mask_spec)


# ---- the benchmark ------------------------------------------------------------------------------


def test_bench_flex_cpu_smoke(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # noqa: ANN001
    """``benchmarks/bench_flex.py --device cpu --quick --eager`` (the tree case: TREE_ATTN, and
    FLEX_ATTENTION / TORCH_SDPA causal over the same tokens) writes agreeing rows and its targets."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import bench_flex

    monkeypatch.setenv("OUT", str(tmp_path))
    assert bench_flex.main(["--device", "cpu", "--quick", "--eager", "--cases", "tree"]) == 0
    (path,) = tmp_path.glob("flex-*.json")
    data = json.loads(path.read_text())
    rows = {(r["mask"], r["provider"]): r for r in data["rows"]}
    assert set(rows) == {("tree", "TREE_ATTN"), ("causal", "FLEX_ATTENTION"), ("causal", "TORCH_SDPA")}
    assert rows[("causal", "TORCH_SDPA")]["max_abs_diff"] < 1e-4  # SDPA and FLEX causal read the same K/V
    assert rows[("tree", "TREE_ATTN")]["pairs"] < rows[("causal", "FLEX_ATTENTION")]["pairs"]
    assert all(r["ms"] > 0 for r in data["rows"]) and data["summary"]["errors"] == {}
    assert "targets_bs16" in data["summary"]


def test_example_runs_on_cpu() -> None:
    """``python examples/flex_attention.py``: prefix-LM, documents and a tree step match their dense checks."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "examples/flex_attention.py"], capture_output=True, text=True, cwd=root,
                       timeout=300, env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr[-3000:]
    errors = [float(x) for x in re.findall(r"max \|out - dense\| = (\S+)", r.stdout)]
    assert len(errors) == 3 and max(errors) < 1e-5, r.stdout


def test_decode_fallback_only_where_the_decoding_kernel_has_no_tile() -> None:
    """FlexAttention's decoding kernel (queries < 128) packs a KV head's query heads into one tile
    of next_pow2(q_len * group) rows that must divide the mask's query block: past that vattn
    asks for the main kernel, and leaves a user's explicit choice alone."""
    from vattn.backends.flex_attention.compiled import with_decode_fallback

    assert with_decode_fallback({"BLOCK_N": 16}, 1, 4, 128) == {"BLOCK_N": 16}  # decode: 16 rows
    assert with_decode_fallback(None, 32, 4, 128) is None  # 128 rows fit the block
    assert with_decode_fallback({"BLOCK_N": 16}, 64, 4, 128) == {"BLOCK_N": 16, "FORCE_USE_FLEX_ATTENTION": True}
    assert with_decode_fallback(None, 200, 4, 128) is None  # 128 queries or more: the main kernel anyway
    assert with_decode_fallback({"FORCE_USE_FLEX_ATTENTION": False}, 64, 4, 128) == {"FORCE_USE_FLEX_ATTENTION": False}

"""TORCH_SDPA vs the dense float32 reference of tests/attn_harness.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attn_harness import (PAGED_ORDERS, BatchSpec, RandomBatch, assert_close, assert_no_host_sync, batch_specs,
                          check_cache_untouched, check_cache_written, layer_features, make_random_batch, stride_orders)
from vattn.core.enums import AttentionCGSupport, AttentionType
from vattn.backends.torch_sdpa import TorchSDPABackend, TorchSDPAImpl, TorchSDPAMetadataBuilder
from vattn.core.layout import set_kv_cache_layout
from vattn.core.metadata import AttentionSpec
from vattn.core.config import VattnConfig

MIXED = dict(context_lens=(7, 0, 33, 0, 12, 5), query_lens=(1, 1, 1, 9, 6, 17))


def run(
    batch: RandomBatch,
    *,
    key_none: bool = False,
    output_scale: torch.Tensor | None = None,
    **impl_kwargs: object,
) -> tuple[torch.Tensor, torch.Tensor, TorchSDPAImpl]:
    """Build metadata, run one forward; returns (output, cache before the call, impl)."""
    spec = batch.spec
    kv_spec = AttentionSpec(spec.block_size, spec.num_kv_heads, spec.head_size,
                            batch.kv_cache.dtype, spec.kv_cache_dtype)
    builder = TorchSDPAMetadataBuilder(kv_spec, ["fake.attn"], VattnConfig(), torch.device(spec.device))
    md = builder.build(0, batch.common)
    impl_kwargs.setdefault("attn_type", spec.attn_type)
    impl = TorchSDPAImpl(spec.num_heads, spec.head_size, scale=spec.head_size**-0.5,
                         num_kv_heads=spec.num_kv_heads, kv_cache_dtype=spec.kv_cache_dtype,
                         **impl_kwargs)  # type: ignore[arg-type]
    before = batch.kv_cache.clone()
    output = torch.zeros_like(batch.query)
    key = None if key_none else batch.key
    value = None if key_none else batch.value
    ret = impl.forward(batch.layer, batch.query, key, value, batch.kv_cache, md,  # type: ignore[arg-type]
                       output=output, output_scale=output_scale)
    assert ret is output
    return output, before, impl


def check(batch: RandomBatch, *, factor: float = 1.0, **features: object) -> None:
    """Run with ``features``; compare with the reference; check the cache and padding rows."""
    out, before, impl = run(batch, **features)
    n = batch.num_actual_tokens
    ref_kwargs = {k: v for k, v in features.items() if k not in ("attn_type",)}
    ref = batch.reference(scale=impl.scale, **ref_kwargs)
    assert_close(out[:n], ref, batch.spec.dtype, factor=factor)
    assert torch.count_nonzero(out[n:]) == 0, "padded token rows of the output were written"
    if batch.spec.attn_type in (AttentionType.ENCODER, AttentionType.ENCODER_ONLY):
        check_cache_untouched(before, batch.kv_cache, None)
    else:
        check_cache_untouched(before, batch.kv_cache, batch.common.slot_mapping)
        check_cache_written(batch)


# ---- the harness itself ------------------------------------------------------------------


def test_reference_matches_sdpa_for_a_plain_causal_prefill() -> None:
    b = make_random_batch(BatchSpec(context_lens=(0,), query_lens=(11,), num_heads=4, num_kv_heads=4,
                                    head_size=16), seed=3)
    ref = b.reference(scale=0.25)
    q, k, v = (x.transpose(0, 1) for x in (b.query, b.full_keys[0], b.full_values[0]))
    want = F.scaled_dot_product_attention(q.float(), k, v, is_causal=True, scale=0.25).transpose(0, 1)
    torch.testing.assert_close(ref, want, atol=1e-6, rtol=1e-5)


def test_reference_features_reduce_to_plain() -> None:
    b = make_random_batch(BatchSpec(**MIXED, head_size=16), seed=4)
    plain = b.reference(scale=0.3)
    H = b.spec.num_heads
    assert torch.allclose(plain, b.reference(scale=0.3, sliding_window=10_000))
    assert torch.allclose(plain, b.reference(scale=0.3, sinks=torch.full((H,), -1e9)), atol=1e-6)
    assert torch.allclose(plain, b.reference(scale=0.3, alibi_slopes=[0.0] * H))
    assert torch.allclose(plain, b.reference(scale=0.3, logits_soft_cap=1e6), atol=1e-5)
    # ...and each one changes the result when it matters.
    assert not torch.allclose(plain, b.reference(scale=0.3, sliding_window=3))
    assert not torch.allclose(plain, b.reference(scale=0.3, sinks=torch.zeros(H)))


def test_harness_cache_check_detects_a_stray_write() -> None:
    b = make_random_batch(BatchSpec(**MIXED, layout="HND"), seed=5)
    before = b.kv_cache.clone()
    slot = int(b.common.slot_mapping[0])
    b.kv_cache[1, slot // 16, slot % 16, 0, 0] += 1  # inside slot_mapping: allowed
    check_cache_untouched(before, b.kv_cache, b.common.slot_mapping)
    b.kv_cache[0, b.block_tables[2][0], 0, 1, 3] += 1  # a context slot: not allowed
    with pytest.raises(AssertionError, match="outside slot_mapping"):
        check_cache_untouched(before, b.kv_cache, b.common.slot_mapping)


# ---- backend facts -------------------------------------------------------------------------


def test_backend_facts() -> None:
    B = TorchSDPABackend
    assert B.get_name() == "TORCH_SDPA" and B.accept_output_buffer and B.supports_sink
    assert B.get_kv_cache_shape(10, 16, 2, 80) == (2, 10, 16, 2, 80)
    with pytest.raises(ValueError, match="block_size"):
        B.get_kv_cache_shape(10, 0, 2, 80)
    assert B.validate_configuration(80, torch.float32, "fp8_e5m2", 7, has_sink=True) == []
    assert B.validate_configuration(64, torch.int8, "auto", 16) != []
    assert B.get_cudagraph_support() == AttentionCGSupport.NEVER
    assert B.get_impl_cls() is TorchSDPAImpl and B.get_builder_cls() is TorchSDPAMetadataBuilder
    assert stride_orders(B) == PAGED_ORDERS


def test_impl_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        TorchSDPAImpl(4, 64, 0.1, kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="alibi_slopes"):
        TorchSDPAImpl(4, 64, 0.1, alibi_slopes=[1.0, 2.0])
    # output_scale is refused by the op, before any impl runs (tests/test_custom_ops.py).


# ---- fuzz ---------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=batch_specs(), seed=st.integers(0, 2**16))
def test_fuzz_mixed_batches(spec: BatchSpec, seed: int) -> None:
    check(make_random_batch(spec, seed=seed))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=batch_specs(max_reqs=6, kv_cache_dtypes=("fp8", "fp8_e5m2", "float32", "bfloat16")),
       seed=st.integers(0, 2**16))
def test_fuzz_kv_cache_dtypes(spec: BatchSpec, seed: int) -> None:
    spec = spec.with_(k_scale=0.03, v_scale=0.07)
    check(make_random_batch(spec, seed=seed), factor=2.0)


# ---- features -------------------------------------------------------------------------------

FEATURES = layer_features(8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(FEATURES))
def test_feature(name: str, dtype: torch.dtype) -> None:
    spec = BatchSpec(**MIXED, num_heads=8, num_kv_heads=2, block_size=4, dtype=dtype,
                     layout="HND", num_pad_tokens=2)
    check(make_random_batch(spec, seed=11), **FEATURES[name])


@pytest.mark.parametrize("attn_type", [AttentionType.ENCODER, AttentionType.ENCODER_ONLY])
@pytest.mark.parametrize("features", ["none", "window", "all"])
def test_encoder_self_attention_is_bidirectional_and_skips_the_cache(attn_type: str, features: str) -> None:
    feats = {} if features == "none" else FEATURES[features]
    spec = BatchSpec(context_lens=(0, 0, 0), query_lens=(5, 1, 13), num_heads=8, num_kv_heads=4,
                     attn_type=attn_type, num_pad_tokens=3)
    check(make_random_batch(spec, seed=12), **feats)


def test_cross_attention_writes_encoder_kv_once_then_reads_it() -> None:
    # Step 1: encoder K/V given (written), decoder queries attend non-causally over them.
    spec = BatchSpec(context_lens=(9, 20, 3), query_lens=(4, 1, 2), num_heads=4, num_kv_heads=2,
                     block_size=4, attn_type=AttentionType.ENCODER_DECODER, num_pad_tokens=1)
    batch = make_random_batch(spec, seed=13)
    assert batch.common.slot_mapping.shape[0] == sum(spec.context_lens) + 1
    check(batch)
    # Step 2: key/value None: read from the cache, write nothing.
    before = batch.kv_cache.clone()
    q2 = torch.randn_like(batch.query)
    batch.query = q2
    out, _, impl = run(batch, key_none=True)
    assert torch.equal(before, batch.kv_cache)
    ref = batch.reference(scale=impl.scale)
    assert_close(out[: batch.num_actual_tokens], ref, spec.dtype)


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp8_kv_cache(kv_dtype: str, dtype: torch.dtype) -> None:
    spec = BatchSpec(**MIXED, num_heads=4, num_kv_heads=1, dtype=dtype, kv_cache_dtype=kv_dtype,
                     k_scale=0.05, v_scale=0.02, layout="HND", num_pad_tokens=1)
    batch = make_random_batch(spec, seed=14)
    check(batch, factor=2.0)
    # The backend must dequantize with the layer's scales: a unit scale gives other outputs.
    assert batch.kv_cache.dtype == (torch.float8_e5m2 if kv_dtype == "fp8_e5m2" else torch.float8_e4m3fn)
    batch.layer._v_scale = torch.tensor(1.0)
    out, _, impl = run(batch, key_none=True)
    ref = batch.reference(scale=impl.scale)
    assert (out[: batch.num_actual_tokens].float() - ref).abs().max() > 1.0


def test_cache_dtype_differs_from_model_dtype() -> None:
    spec = BatchSpec(**MIXED, dtype=torch.bfloat16, kv_cache_dtype="float32")
    check(make_random_batch(spec, seed=15))


def test_padded_tokens_change_nothing() -> None:
    batch = make_random_batch(BatchSpec(**MIXED, block_size=4, num_pad_tokens=5), seed=16)
    n = batch.num_actual_tokens
    assert batch.common.slot_mapping[n:].eq(-1).all()
    for x in (batch.query, batch.key, batch.value):
        x[n:] = float("nan")  # padding rows must never be read
    check(batch)
    padded_out, _, _ = run(batch)
    batch.query, batch.key, batch.value = batch.query[:n], batch.key[:n], batch.value[:n]
    batch.common.slot_mapping = batch.common.slot_mapping[:n]
    unpadded_out, _, _ = run(batch)
    assert torch.equal(padded_out[:n], unpadded_out)


def test_warmup_without_metadata_touches_nothing() -> None:
    batch = make_random_batch(BatchSpec(**MIXED), seed=17)
    impl = TorchSDPAImpl(4, 64, 0.125, num_kv_heads=2)
    before = batch.kv_cache.clone()
    output = torch.zeros_like(batch.query)
    assert impl.forward(batch.layer, batch.query, batch.key, batch.value, batch.kv_cache, None,  # type: ignore[arg-type]
                        output=output) is output
    assert torch.equal(before, batch.kv_cache) and torch.count_nonzero(output) == 0


def test_kv_sharing_layer_reads_but_never_writes() -> None:
    batch = make_random_batch(BatchSpec(**MIXED), seed=18)
    before = batch.kv_cache.clone()
    run(batch, kv_sharing_target_layer_name="model.layers.0.attn")
    assert torch.equal(before, batch.kv_cache)


def test_short_block_table_is_a_clear_error() -> None:
    batch = make_random_batch(BatchSpec(**MIXED, block_size=4), seed=19)
    batch.common.block_table_tensor = batch.common.block_table_tensor[:, :2]
    with pytest.raises(ValueError, match="block_table_tensor has too few columns"):
        run(batch)


def test_nan_in_unused_cache_slots_does_not_leak() -> None:
    # Padding key positions read slot 0; make block 0 unused and fill every slot no request
    # owns (unused blocks, tails of last blocks) with NaN: none of it may reach the output.
    spec = BatchSpec(**MIXED, block_size=4, extra_blocks=3)
    seed = next(s for s in range(100) if 0 not in {b for t in make_random_batch(spec, s).block_tables for b in t})
    batch = make_random_batch(spec, seed)
    owned = torch.zeros(batch.kv_cache.shape[1] * spec.block_size, dtype=torch.bool)
    for table, seq_len in zip(batch.block_tables, spec.seq_lens):
        for pos in range(seq_len):
            owned[table[pos // 4] * 4 + pos % 4] = True
    flat = (~owned).view(-1, 4)
    batch.kv_cache[:, flat] = float("nan")
    check(batch)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("contexts, features", [
    ((37,), {}),                                 # one request: its exact keys, no mask
    ((37,), {"sliding_window": 7}),
    ((5, 63, 16, 1), {}),                         # several: whole blocks, tails masked
    ((5, 63, 16, 1), {"sliding_window": 9}),
])
def test_decode_only_batches(layout: str, contexts: tuple[int, ...], features: dict) -> None:
    """Decode-only steps take the whole-block path (``TorchSDPAImpl._decode``): the same output
    as the reference, with every slot no request owns full of NaN, GQA (8 / 2 heads)."""
    spec = BatchSpec(context_lens=contexts, query_lens=(1,) * len(contexts), num_heads=8, num_kv_heads=2,
                     block_size=8, layout=layout, extra_blocks=2)
    batch = make_random_batch(spec, seed=5)
    owned = torch.zeros(batch.kv_cache.shape[1] * spec.block_size, dtype=torch.bool)
    for table, seq_len in zip(batch.block_tables, spec.seq_lens):
        for pos in range(seq_len):
            owned[table[pos // 8] * 8 + pos % 8] = True
    batch.kv_cache[:, (~owned).view(-1, 8)] = float("nan")
    md_used = []
    real_decode = TorchSDPAImpl._decode

    def spy(self, *args, **kwargs):  # noqa: ANN001, ANN202
        md_used.append(True)
        return real_decode(self, *args, **kwargs)

    TorchSDPAImpl._decode = spy
    try:
        check(batch, **features)
    finally:
        TorchSDPAImpl._decode = real_decode
    assert md_used, "the decode-only batch did not take the decode path"


def test_padded_fields_made_on_first_use() -> None:
    """A decode-only step's metadata makes its padded-batch fields only for a layer that needs
    them: plain layers decode without them; a soft-capped layer on the same metadata makes them
    (once) and matches the reference."""
    spec = BatchSpec(context_lens=(5, 63, 16), query_lens=(1, 1, 1), num_heads=8, num_kv_heads=2, block_size=8)
    batch = make_random_batch(spec, seed=6)
    kv_spec = AttentionSpec(spec.block_size, spec.num_kv_heads, spec.head_size, batch.kv_cache.dtype,
                            spec.kv_cache_dtype)
    md = TorchSDPAMetadataBuilder(kv_spec, ["fake.attn"], VattnConfig(), torch.device("cpu")).build(0, batch.common)
    assert md.decode_blocks is not None and md.query_index is None
    plain = TorchSDPAImpl(8, spec.head_size, scale=spec.head_size**-0.5, num_kv_heads=2)
    capped = TorchSDPAImpl(8, spec.head_size, scale=spec.head_size**-0.5, num_kv_heads=2, logits_soft_cap=2.0)
    out = torch.zeros_like(batch.query)
    plain.forward(batch.layer, batch.query, batch.key, batch.value, batch.kv_cache, md, output=out)  # type: ignore[arg-type]
    assert md.query_index is None, "the plain decode made the padded fields"
    assert_close(out, batch.reference(scale=plain.scale), spec.dtype)
    capped.forward(batch.layer, batch.query, None, None, batch.kv_cache, md, output=out)  # type: ignore[arg-type]
    made = md.query_index
    assert made is not None and md.output_index is not None and md.key_block is not None
    assert_close(out, batch.reference(scale=capped.scale, logits_soft_cap=2.0), spec.dtype)
    capped.forward(batch.layer, batch.query, None, None, batch.kv_cache, md, output=out)  # type: ignore[arg-type]
    assert md.query_index is made, "made once per step"


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_request_on_consecutive_blocks_reads_a_view(layout: str, dtype: torch.dtype) -> None:
    """One decoding request on consecutive blocks (the CPU metadata marks it): its keys are read
    as a view of an NHD cache, gathered otherwise; the same output as the same keys on shuffled
    blocks and as a float32 reference, GQA (8 / 2 heads), and the new token's K/V stored."""
    import vattn

    heads, kv_heads, d, bs, ctx = 8, 2, 16, 4, 13
    g = torch.Generator().manual_seed(1)
    old_k, old_v = (torch.randn(ctx, kv_heads, d, generator=g).to(dtype) for _ in range(2))
    q, k, v = (torch.randn(1, n * d, generator=g).to(dtype) for n in (heads, kv_heads, kv_heads))
    outs = []
    set_kv_cache_layout(layout)
    try:
        for table in ([2, 3, 4, 5], [5, 0, 3, 1]):
            cfg = VattnConfig(cache=vattn.CacheConfig(block_size=bs))
            with vattn.set_current_vattn_config(cfg):
                attn = vattn.Attention(heads, d, d**-0.5, num_kv_heads=kv_heads, prefix="l.attn", attn_backend="TORCH_SDPA")
            kv = vattn.allocate_kv_cache(cfg, num_blocks=7, dtype=dtype)
            cache = kv.tensors["l.attn"]
            cache.fill_(float("nan"))  # every slot the request does not own
            for pos in range(ctx):
                cache[0, table[pos // bs], pos % bs], cache[1, table[pos // bs], pos % bs] = old_k[pos], old_v[pos]
            common = kv.common_metadata(query_lens=[1], num_computed_tokens=[ctx], block_tables=[table])
            md = kv.build_metadata(common)
            first = md["l.attn"].decode_first_block if isinstance(md, dict) else md.decode_first_block
            assert first == (2 if table[0] == 2 else None)
            with torch.no_grad(), vattn.set_forward_context(md, cfg):
                outs.append(attn(q, k, v))
            slot = table[ctx // bs], ctx % bs
            assert torch.equal(cache[0][slot], k.view(kv_heads, d)) and torch.equal(cache[1][slot], v.view(kv_heads, d))
    finally:
        set_kv_cache_layout(None)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=0)
    keys = torch.cat((old_k, k.view(1, kv_heads, d))).float().repeat_interleave(heads // kv_heads, 1)
    values = torch.cat((old_v, v.view(1, kv_heads, d))).float().repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("hd,thd->ht", q.view(heads, d).float(), keys) * d**-0.5
    ref = torch.einsum("ht,thd->hd", scores.softmax(-1), values).reshape(1, -1)
    assert_close(outs[0], ref, dtype)


def test_through_vattn_attention_layer() -> None:
    """The real layer and the opaque op pass scale, window, sinks and fp8 scales through."""
    import vattn

    spec = BatchSpec(**MIXED, num_heads=8, num_kv_heads=2, block_size=4, dtype=torch.float32,
                     kv_cache_dtype="fp8_e4m3", k_scale=0.05, v_scale=0.03, num_pad_tokens=2)
    batch = make_random_batch(spec, seed=22)
    sinks = torch.linspace(-1.0, 2.0, 8)
    cfg = VattnConfig(cache=vattn.CacheConfig(block_size=4, cache_dtype="fp8_e4m3"))
    with vattn.set_current_vattn_config(cfg):
        layer = vattn.Attention(8, 64, 0.1, num_kv_heads=2, per_layer_sliding_window=6, prefix="l0.attn",
                                attn_backend="TORCH_SDPA", sinks=sinks)
    layer.kv_cache = [batch.kv_cache]
    layer._k_scale.fill_(spec.k_scale)
    layer._v_scale.fill_(spec.v_scale)
    kv_spec = AttentionSpec(4, 2, 64, batch.kv_cache.dtype, "fp8_e4m3")
    md = TorchSDPAMetadataBuilder(kv_spec, ["l0.attn"], cfg, torch.device("cpu")).build(0, batch.common)
    T = batch.query.shape[0]
    before = batch.kv_cache.clone()
    with vattn.set_forward_context({"l0.attn": md}, cfg):
        out = layer(batch.query.view(T, -1), batch.key.view(T, -1), batch.value.view(T, -1))
    n = batch.num_actual_tokens
    ref = batch.reference(scale=0.1, sliding_window=6, sinks=sinks)
    assert_close(out[:n].view(n, 8, 64), ref, torch.float32, factor=2.0)
    check_cache_untouched(before, batch.kv_cache, batch.common.slot_mapping)
    check_cache_written(batch)


# ---- CUDA ------------------------------------------------------------------------------------


@pytest.mark.cuda
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=batch_specs(device="cuda", kv_cache_dtypes=("auto", "fp8_e4m3")), seed=st.integers(0, 2**16))
def test_cuda_fuzz(spec: BatchSpec, seed: int) -> None:
    check(make_random_batch(spec, seed=seed), factor=2.0)


@pytest.mark.cuda
@pytest.mark.parametrize("name", sorted(FEATURES))
def test_cuda_feature_without_host_sync(name: str) -> None:
    spec = BatchSpec(**MIXED, num_heads=8, num_kv_heads=2, dtype=torch.bfloat16, layout="HND",
                     num_pad_tokens=2, device="cuda")
    batch = make_random_batch(spec, seed=21)
    feats = layer_features(8, "cuda")[name]
    check(batch, **feats)  # also the first call (alibi slopes copied to the device)
    kv_spec = AttentionSpec(spec.block_size, spec.num_kv_heads, spec.head_size, batch.kv_cache.dtype)
    md = TorchSDPAMetadataBuilder(kv_spec, ["x"], VattnConfig(), torch.device("cuda")).build(0, batch.common)
    impl = TorchSDPAImpl(8, spec.head_size, spec.head_size**-0.5, num_kv_heads=2, **feats)  # type: ignore[arg-type]
    out = torch.zeros_like(batch.query)
    impl.forward(batch.layer, batch.query, batch.key, batch.value, batch.kv_cache, md, output=out)  # type: ignore[arg-type]
    assert_no_host_sync(lambda: impl.forward(batch.layer, batch.query, batch.key, batch.value, batch.kv_cache, md,
                                             output=out))
    assert math.isfinite(float(out.float().abs().sum()))

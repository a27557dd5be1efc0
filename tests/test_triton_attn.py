"""TRITON_ATTN: the Triton KV-store and unified attention kernels, and the backend around them.

On CPU the kernels run in the Triton interpreter (tiny shapes); ``cuda`` tests run full
shapes on a GPU. Everything is compared with the dense float32 reference of
tests/attn_harness.py; what every backend must do (mixed steps, the layer features, fp8 caches
through the layer, CUDA-graph replay at every size) is in tests/test_conformance.py.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attn_harness import (PAGED_ORDERS, BatchSpec, RandomBatch, assert_close, batch_specs, check_cache_untouched,
                          check_cache_written, make_random_batch, stride_orders, tree_allowed)
import triton_modules
from vattn.core.enums import AttentionCGSupport, AttentionType
from vattn.backends.triton import config as tcfg
from vattn.core.metadata import AttentionSpec, CommonAttentionMetadata
from vattn.core.config import CompilationConfig, VattnConfig

pytest.importorskip("triton")

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"
_OPS = ("vattn.kernels.fp8", "vattn.backends.triton.kernels",
        "vattn.kernels.kv_store", "vattn.backends.triton.paged_attention")


OPS = triton_modules.load(_OPS)
tua = OPS["vattn.backends.triton.paged_attention"]
UnifiedAttentionConfig = tcfg.UnifiedAttentionConfig
triton_store_kv = OPS["vattn.kernels.kv_store"].triton_store_kv

from vattn.backends.triton import (  # noqa: E402
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadataBuilder,
)

# Decodes first, then chunked prefills with context; odd lengths, partial last blocks.
MIXED = dict(context_lens=(7, 30, 0, 12, 21), query_lens=(1, 1, 9, 6, 17))
SMALL = dict(num_heads=4, num_kv_heads=2, head_size=32, block_size=16, device=DEV)


def _builder(batch: RandomBatch, config: VattnConfig | None = None) -> TritonAttentionMetadataBuilder:
    spec = batch.spec
    kv_spec = AttentionSpec(spec.block_size, spec.num_kv_heads, spec.head_size,
                            batch.kv_cache.dtype, spec.kv_cache_dtype)
    return TritonAttentionMetadataBuilder(kv_spec, ["fake.attn"], config or VattnConfig(), torch.device(spec.device))


def run(
    batch: RandomBatch,
    *,
    query: torch.Tensor | None = None,
    output: torch.Tensor | None = None,
    output_scale: torch.Tensor | None = None,
    vattn_config: VattnConfig | None = None,
    **impl_kwargs: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Build metadata and run one forward; returns (output, cache before the call)."""
    spec = batch.spec
    md = _builder(batch, vattn_config).build(0, batch.common)
    impl = TritonAttentionImpl(spec.num_heads, spec.head_size, scale=spec.head_size**-0.5,
                               num_kv_heads=spec.num_kv_heads, kv_cache_dtype=spec.kv_cache_dtype,
                               attn_type=spec.attn_type, **impl_kwargs)  # type: ignore[arg-type]
    before = batch.kv_cache.clone()
    out = torch.zeros_like(batch.query) if output is None else output
    q = batch.query if query is None else query
    ret = impl.forward(batch.layer, q, batch.key, batch.value, batch.kv_cache, md,  # type: ignore[arg-type]
                       output=out, output_scale=output_scale)
    assert ret is out
    return out, before


def check(batch: RandomBatch, *, factor: float = 1.0, **features: object) -> None:
    """Run the backend with ``features``, compare with the reference, check the cache."""
    ref_features = {k: v for k, v in features.items() if k != "vattn_config"}
    out, before = run(batch, **features)  # type: ignore[arg-type]
    ref = batch.reference(scale=batch.spec.head_size**-0.5, **ref_features)
    n = batch.num_actual_tokens
    assert_close(out[:n], ref, batch.spec.dtype, factor=factor)
    assert (out[n:] == 0).all(), "padding rows of the output were written"
    check_cache_written(batch)
    check_cache_untouched(before, batch.kv_cache, batch.common.slot_mapping)


# ---- the KV-store kernel ----------------------------------------------------------------


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "fp8_e5m2"])
def test_store_kv_kernel(layout: str, kv_dtype: str) -> None:
    spec = BatchSpec(context_lens=(5, 20), query_lens=(1, 6), **SMALL, dtype=torch.bfloat16,
                     kv_cache_dtype=kv_dtype, layout=layout, num_pad_tokens=2, extra_blocks=2,
                     k_scale=0.03, v_scale=0.5)
    batch = make_random_batch(spec, seed=1)
    before = batch.kv_cache.clone()
    k_cache, v_cache = batch.kv_cache.unbind(0)
    triton_store_kv(batch.key, batch.value, k_cache, v_cache, batch.common.slot_mapping, kv_dtype,
                    batch.layer._k_scale, batch.layer._v_scale)
    check_cache_written(batch)  # bit-exact: saturating x / scale, rounded to nearest even
    check_cache_untouched(before, batch.kv_cache, batch.common.slot_mapping)


def test_store_kv_skips_slots_past_the_cache() -> None:
    """A hand-built slot mapping past the cache (never checked on the host for device tensors)
    writes nothing there and nothing anywhere else: the kernel bounds every slot."""
    cache = torch.randn(2, 3, 4, 2, 16, device=DEV).bfloat16()  # 3 blocks of 4: slots 0..11
    before = cache.clone()
    key = torch.randn(3, 2, 16, device=DEV).bfloat16()
    triton_store_kv(key, key, cache[0], cache[1], torch.tensor([12, 1 << 40, 5], device=DEV), "auto",
                    torch.ones((), device=DEV), torch.ones((), device=DEV))
    assert torch.equal(cache[:, 1, 1], key[2:].expand(2, 2, 16))  # slot 5: block 1, offset 1
    cache[:, 1, 1] = before[:, 1, 1]
    assert torch.equal(cache, before)


def test_store_kv_saturates_and_rounds_like_torch() -> None:
    """Bit for bit, the sign of values that round to zero included (-0.0005 -> -0.0)."""
    x = torch.tensor([1e6, -1e6, 124.0, 125.0, 0.3, -7.77, 0.0, 2.0**-9,
                      -0.0005, -1e-9, -0.0, 2.0**-18, -(2.0**-17), 3e-6, -448.0, 0.0009765625]).to(DEV)
    key = x.repeat(4, 1).reshape(4, 1, 16)  # (T, Hk, D)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        cache = torch.zeros(2, 1, 4, 1, 16, dtype=dtype, device=DEV)
        name = "fp8" if dtype == torch.float8_e4m3fn else "fp8_e5m2"
        one = torch.tensor(1.0, device=DEV)
        triton_store_kv(key, key, cache[0], cache[1], torch.arange(4, device=DEV), name, one, one)
        want = x.clamp(torch.finfo(dtype).min, torch.finfo(dtype).max).to(dtype)
        assert torch.equal(cache[0, 0, 3, 0].cpu().view(torch.uint8), want.cpu().view(torch.uint8))


# ---- the unified kernel, through the backend ----------------------------------------------


def test_mixed_batch_bf16_head64_eager_path() -> None:
    # T = 34 > max_capture_size: the caller's tensors, no persistent buffers.
    cfg = VattnConfig(compilation=CompilationConfig(max_capture_size=8, cudagraph_capture_sizes=(8,)))
    spec = BatchSpec(**MIXED, **{**SMALL, "head_size": 64}, dtype=torch.bfloat16, layout="HND")
    check(make_random_batch(spec, seed=3), vattn_config=cfg)


@pytest.mark.parametrize("heads,head_size,block_size", [((6, 2), 24, 8), ((8, 1), 16, 48)])
def test_odd_gqa_head_and_block_sizes(heads: tuple[int, int], head_size: int, block_size: int) -> None:
    # 3 query heads per KV head (not a power of two), D=24 padded to 32, 8 heads on one KV head.
    spec = BatchSpec(**MIXED, **{**SMALL, "head_size": head_size, "block_size": block_size,
                                 "num_heads": heads[0], "num_kv_heads": heads[1]}, dtype=torch.float16)
    check(make_random_batch(spec, seed=4))


FEATURES: dict[str, dict[str, object]] = {
    "window": dict(sliding_window=5),
    "softcap": dict(logits_soft_cap=3.0),
    "alibi": dict(alibi_slopes=[0.3, 0.1, 0.05, 0.02]),
    "sinks": dict(sinks=torch.tensor([0.5, -1.0, 2.0, 0.0])),
}


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_kv_cache(kv_dtype: str) -> None:
    # The reference reads the same fp8 values times the scale, so fp32 tolerances apply.
    spec = BatchSpec(**MIXED, **SMALL, kv_cache_dtype=kv_dtype, k_scale=0.05, v_scale=0.02)
    check(make_random_batch(spec, seed=6), factor=10.0)


@pytest.mark.parametrize("one_loop", [False, True])
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_decode_config_on_mixed_batch(one_loop: bool, kv_dtype: str) -> None:
    """A decode config (16-row tiles, one masked loop or interior + edge loops) on a mixed
    batch with a window and sinks: what a CUDA graph captured for decode may replay."""
    spec = BatchSpec(**MIXED, **SMALL, kv_cache_dtype=kv_dtype, k_scale=0.05, v_scale=0.02)
    batch = make_random_batch(spec, seed=13)
    md = _builder(batch).build(0, batch.common)
    md.config = UnifiedAttentionConfig(16, 16, 2, 4, 3, one_loop=one_loop)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], device=DEV)
    impl = TritonAttentionImpl(4, 32, 32**-0.5, 2, sliding_window=9, sinks=sinks, kv_cache_dtype=kv_dtype)
    out = torch.zeros_like(batch.query)
    impl.forward(batch.layer, batch.query, batch.key, batch.value, batch.kv_cache, md, output=out)
    ref = batch.reference(scale=32**-0.5, sliding_window=9, sinks=sinks)
    assert_close(out[: batch.num_actual_tokens], ref, torch.float32, factor=10.0 if kv_dtype == "fp8" else 1.0)


def test_fp8_query_and_output() -> None:
    spec = BatchSpec(**MIXED, **SMALL, dtype=torch.bfloat16, kv_cache_dtype="fp8", k_scale=0.05, v_scale=0.02)
    batch = make_random_batch(spec, seed=7)
    q_scale = 0.02
    batch.layer._q_scale.fill_(q_scale)
    q8 = (batch.query.float() / q_scale).to(torch.float8_e4m3fn)
    o_scale = torch.tensor(0.01, device=DEV)
    out = torch.zeros(batch.query.shape, dtype=torch.float8_e4m3fn, device=DEV)
    run(batch, query=q8, output=out, output_scale=o_scale)
    batch.query = (q8.float() * q_scale).to(torch.bfloat16)  # what the kernel attends with
    ref = batch.reference(scale=spec.head_size**-0.5)
    n = batch.num_actual_tokens
    # One fp8 rounding of the output (relative 2**-4) on top of bf16 attention.
    torch.testing.assert_close(out[:n].float().cpu() * 0.01, ref.cpu(), atol=2e-2, rtol=7e-2)


def test_nan_in_unused_cache_slots_does_not_leak() -> None:
    spec = BatchSpec(context_lens=(5, 20), query_lens=(1, 6), **SMALL, extra_blocks=2)
    batch = make_random_batch(spec, seed=8)
    used = {(b, o) for r, t in enumerate(batch.block_tables)
            for p in range(spec.seq_lens[r]) for b, o in [(t[p // 16], p % 16)]}
    for b in range(batch.kv_cache.shape[1]):
        for o in range(16):
            if (b, o) not in used:
                batch.kv_cache[:, b, o] = float("nan")
    out, _ = run(batch)
    assert torch.isfinite(out).all()


def test_warmup_without_metadata_touches_nothing() -> None:
    batch = make_random_batch(BatchSpec(**MIXED, **SMALL), seed=9)
    impl = TritonAttentionImpl(4, 32, 32**-0.5, 2)
    before = batch.kv_cache.clone()
    out = torch.zeros_like(batch.query)
    assert impl.forward(batch.layer, batch.query, batch.key, batch.value, batch.kv_cache, None, output=out) is out
    assert (out == 0).all() and torch.equal(before, batch.kv_cache)


# ---- the KV store fused into decode attention ---------------------------------------------------

# Decode steps: a first token (no context), odd lengths, a block boundary, padding rows.
DECODES = dict(context_lens=(0, 7, 30, 15, 33), query_lens=(1, 1, 1, 1, 1), num_pad_tokens=2)


def _no_store_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the separate KV-store launch fail: the step must store inside attention."""
    def store_kv(*args: object, **kwargs: object) -> None:
        raise AssertionError("a decode step launched the separate KV-store kernel")

    monkeypatch.setattr(sys.modules["vattn.ops.kv_store"], "store_kv", store_kv)


@pytest.mark.parametrize("kv_dtype,feature", [("auto", None), ("auto", "window"), ("auto", "softcap"),
                                              ("auto", "alibi"), ("auto", "sinks"), ("fp8", None),
                                              ("fp8_e5m2", "softcap")])
def test_decode_stores_kv_inside_attention(kv_dtype: str, feature: str | None,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode configs write the new K/V from the attention kernel (bit-exact, nothing else
    touched) and attend to each token's own key from registers."""
    _no_store_kernel(monkeypatch)
    features = dict(FEATURES[feature]) if feature else {}
    if "sinks" in features:
        features["sinks"] = features["sinks"].to(DEV)  # type: ignore[union-attr]
    spec = BatchSpec(**DECODES, **SMALL, kv_cache_dtype=kv_dtype, k_scale=0.05, v_scale=0.02)
    batch = make_random_batch(spec, seed=30)
    assert _builder(batch).build(0, batch.common).config.one_loop
    check(batch, factor=10.0 if kv_dtype != "auto" else 1.0, **features)


@pytest.mark.parametrize("heads", [(4, 4), (4, 1), (8, 1)])  # 16, 4 and 2 query tokens a 16-row tile
@pytest.mark.parametrize("query_lens", [(1,) * 11, (1, 1, 5, 1, 1, 1, 3, 1, 1)])
def test_each_program_finds_its_request(heads: tuple[int, int], query_lens: tuple[int, ...]) -> None:
    """A program guesses its request from a decode batch's layout (request i's q block at
    i + i // BLOCK_Q) and searches cu_q only when the guess is wrong: decode batches of several
    q-block groups (right), decodes after longer queries (wrong for those after), padding rows
    after the last request (programs past every request exit)."""
    contexts = (5, 17, 0, 33, 2, 9, 40, 1, 12, 20, 7)[: len(query_lens)]
    spec = BatchSpec(context_lens=contexts, query_lens=query_lens, num_heads=heads[0], num_kv_heads=heads[1],
                     head_size=32, block_size=8, device=DEV, num_pad_tokens=3)
    batch = make_random_batch(spec, seed=len(query_lens) + heads[0] * heads[1])
    md = _builder(batch).build(0, batch.common)
    md.config = UnifiedAttentionConfig(16, 16, 1, 4, 3, one_loop=True)
    impl = TritonAttentionImpl(heads[0], 32, 32**-0.5, heads[1])
    before = batch.kv_cache.clone()
    out = torch.zeros_like(batch.query)
    impl.forward(batch.layer, batch.query, batch.key, batch.value, batch.kv_cache, md, output=out)
    n = batch.num_actual_tokens
    assert_close(out[:n], batch.reference(scale=32**-0.5), torch.float32)
    assert (out[n:] == 0).all(), "padding rows of the output were written"
    check_cache_written(batch)
    check_cache_untouched(before, batch.kv_cache, batch.common.slot_mapping)


def test_fused_store_matches_store_then_attend(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused step and ``VATTN_TRITON_FUSED_KV_STORE=0`` (store kernel, then attention)
    leave the same cache and agree on the output (bf16, GQA 3:1, split KV)."""
    spec = BatchSpec(context_lens=(40, 3, 17, 0), query_lens=(1, 1, 1, 1), num_heads=6, num_kv_heads=2,
                     head_size=32, block_size=8, dtype=torch.bfloat16, device=DEV, num_pad_tokens=1)
    outs, caches = [], []
    for fused in ("1", "0"):
        monkeypatch.setenv("VATTN_TRITON_FUSED_KV_STORE", fused)
        batch = make_random_batch(spec, seed=31)
        md = _builder(batch).build(0, batch.common)
        md.config = dataclasses.replace(md.config, num_splits=4)
        impl = TritonAttentionImpl(6, 32, 32**-0.5, 2)
        out = torch.zeros_like(batch.query)
        impl.forward(batch.layer, batch.query, batch.key, batch.value, batch.kv_cache, md, output=out)
        outs.append(out.float())
        caches.append(batch.kv_cache)
    assert torch.equal(caches[0], caches[1])
    torch.testing.assert_close(outs[0], outs[1], atol=2e-2, rtol=2e-2)
    assert_close(outs[0][: batch.num_actual_tokens], batch.reference(scale=32**-0.5), torch.bfloat16)


def test_launcher_argument_checks() -> None:
    """The fused store's and the rotary rows' arguments are checked before any launch."""
    batch = make_random_batch(BatchSpec(context_lens=(3,), query_lens=(1,), **SMALL), seed=32)
    c = batch.common
    kc, vc = batch.kv_cache.unbind(0)
    kw = dict(cu_seqlens_q=c.query_start_loc, seqused_k=c.seq_lens, block_table=c.block_table_tensor,
              max_seqlen_q=1, max_seqlen_k=4, softmax_scale=1.0)
    with pytest.raises(ValueError, match="key, value and slot_mapping .* come together"):
        tua.paged_attention(batch.query, kc, vc, torch.empty_like(batch.query), key=batch.key, **kw)
    with pytest.raises(ValueError, match=r"value must be \(T >= 1, Hk=2, D=32\)"):
        tua.paged_attention(batch.query, kc, vc, torch.empty_like(batch.query), key=batch.key,
                              value=batch.value[:, :1], slot_mapping=c.slot_mapping, **kw)
    with pytest.raises(ValueError, match="slot_mapping must be"):
        tua.paged_attention(batch.query, kc, vc, torch.empty_like(batch.query), key=batch.key,
                              value=batch.value, slot_mapping=c.slot_mapping.float(), **kw)
    cos, sin = rotary_rows(1, 32, torch.float32, seed=46)  # rotary rows: both, (T, D)
    with pytest.raises(ValueError, match="rope_cos and rope_sin come together"):
        tua.paged_attention(batch.query, kc, vc, torch.empty_like(batch.query), rope_cos=cos, **kw)
    with pytest.raises(ValueError, match=r"rope_sin must be \(T >= 1, head_size = 32\)"):
        tua.paged_attention(batch.query, kc, vc, torch.empty_like(batch.query), rope_cos=cos, rope_sin=sin[:, :16],
                            **kw)


# ---- RoPE rotated as the kernels load q and k --------------------------------------------------


def same_cache(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit for bit in the interpreter; on a GPU Triton may contract ``x * cos + y * sin`` into an FMA,
    which can move a rounded key by one unit in the last place."""
    if got.device.type == "cpu":
        assert torch.equal(got, want), "the cache differs from keys rotated first"
    else:
        tol = 1e-6 if got.dtype == torch.float32 else 2**-7
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def rotary_rows(num_tokens: int, head_size: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, D) cos / sin rows of random positions and frequencies, rotate-half layout (both halves equal)."""
    g = torch.Generator().manual_seed(seed)
    angle = torch.rand(num_tokens, 1, generator=g) * 500.0 * torch.rand(head_size // 2, generator=g)
    angle = torch.cat((angle, angle), dim=-1)
    return angle.cos().to(dtype).to(DEV), angle.sin().to(dtype).to(DEV)


ROPE_CASES = {
    # decode config: K/V stored by the attention kernel, 4 splits, own key from registers
    "decode-fused-store": (DECODES, UnifiedAttentionConfig(16, 16, 4, 4, 3, one_loop=True)),
    # decode config on a mixed batch: the step's keys of longer queries read in tiles
    "mixed-one-loop": (dict(MIXED, num_pad_tokens=2), UnifiedAttentionConfig(16, 16, 1, 4, 3, one_loop=True)),
    # prefill config: the KV-store kernel rotates the keys, attention only q
    "mixed-store-first": (dict(MIXED, num_pad_tokens=2), None),
}


# bf16 on the GPU only: the interpreter truncates fp32 -> bf16 where the GPU rounds to nearest.
ROPE_DTYPES = [torch.float32, torch.float16, *([torch.bfloat16] if HAS_CUDA else [])]


@pytest.mark.parametrize("dtype", ROPE_DTYPES)
@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rope_rotated_as_the_kernels_load(case: str, dtype: torch.dtype) -> None:
    """``rope=(cos, sin)`` with unrotated q / k gives what q and k rotated first
    (``vattn.ops.rotary.apply_rotary``) give, a path the other tests compare with the dense
    reference: the same cache bit for bit, the same output; padding rows and other slots untouched."""
    from vattn.ops.rotary import apply_rotary

    lens, config = ROPE_CASES[case]
    spec = BatchSpec(**lens, num_heads=6, num_kv_heads=2, head_size=32, block_size=8, dtype=dtype, device=DEV)
    results = []
    for fused in (True, False):
        batch = make_random_batch(spec, seed=41)
        cos, sin = rotary_rows(batch.query.shape[0], 32, dtype, seed=42)
        md = _builder(batch).build(0, batch.common)
        if config is not None:
            md.config = config
        impl = TritonAttentionImpl(6, 32, 32**-0.5, 2)
        before = batch.kv_cache.clone()
        out = torch.zeros_like(batch.query)
        if fused:
            impl.forward(batch.layer, batch.query, batch.key, batch.value, batch.kv_cache, md, output=out,
                         rope=(cos, sin))
        else:
            impl.forward(batch.layer, apply_rotary(batch.query, cos, sin), apply_rotary(batch.key, cos, sin),
                         batch.value, batch.kv_cache, md, output=out)
        results.append((out, batch.kv_cache))
        check_cache_untouched(before, batch.kv_cache, batch.common.slot_mapping)
    (out, cache), (want_out, want_cache) = results
    same_cache(cache, want_cache)
    n = batch.num_actual_tokens
    torch.testing.assert_close(out[:n].float(), want_out[:n].float(), atol=1e-5 if dtype == torch.float32 else 1e-2,
                               rtol=1e-5 if dtype == torch.float32 else 1e-2)
    assert (out[n:] == 0).all(), "padding rows of the output were written"


def test_rope_store_kv_kernel() -> None:
    """The KV-store kernel stores keys rotated by the rows given (values as they are), as it
    stores keys rotated first; other slots untouched."""
    from vattn.ops.rotary import apply_rotary

    dtype = torch.bfloat16 if HAS_CUDA else torch.float16  # the interpreter truncates fp32 -> bf16
    spec = BatchSpec(context_lens=(5, 20), query_lens=(1, 6), **SMALL, dtype=dtype, num_pad_tokens=2)
    batch = make_random_batch(spec, seed=43)
    cos, sin = rotary_rows(batch.key.shape[0], 32, dtype, seed=44)
    before = batch.kv_cache.clone()
    k_cache, v_cache = batch.kv_cache.unbind(0)
    triton_store_kv(batch.key, batch.value, k_cache, v_cache, batch.common.slot_mapping, "auto",
                    batch.layer._k_scale, batch.layer._v_scale, rope=(cos, sin))
    check_cache_untouched(before, batch.kv_cache, batch.common.slot_mapping)
    want = before.clone()
    triton_store_kv(apply_rotary(batch.key, cos, sin), batch.value, *want.unbind(0), batch.common.slot_mapping,
                    "auto", batch.layer._k_scale, batch.layer._v_scale)
    same_cache(batch.kv_cache, want)


# ---- split-KV and launch configs -------------------------------------------------------------


def _launch(batch: RandomBatch, config: UnifiedAttentionConfig) -> torch.Tensor:
    c = batch.common
    kc, vc = batch.kv_cache.unbind(0)
    out = torch.zeros_like(batch.query)
    tua.paged_attention(batch.query, kc, vc, out, cu_seqlens_q=c.query_start_loc, seqused_k=c.seq_lens,
                          block_table=c.block_table_tensor, max_seqlen_q=c.max_query_len,
                          max_seqlen_k=c.max_seq_len, softmax_scale=batch.spec.head_size**-0.5,
                          sinks=torch.tensor([0.5, -1.0, 2.0, 0.0], device=DEV), config=config)
    return out


def _stored_batch(seed: int) -> RandomBatch:
    # The direct kernel calls read the step's K/V from the cache: store them first.
    spec = BatchSpec(context_lens=(70, 3, 40), query_lens=(1, 1, 5), **SMALL)
    batch = make_random_batch(spec, seed=seed)
    k_cache, v_cache = batch.kv_cache.unbind(0)
    triton_store_kv(batch.key, batch.value, k_cache, v_cache, batch.common.slot_mapping, "auto",
                    batch.layer._k_scale, batch.layer._v_scale)
    return batch


def test_split_kv_matches_no_split() -> None:
    batch = _stored_batch(10)
    ref = batch.reference(scale=batch.spec.head_size**-0.5, sinks=torch.tensor([0.5, -1.0, 2.0, 0.0]))
    one = _launch(batch, UnifiedAttentionConfig(16, 16, num_splits=1))
    four = _launch(batch, UnifiedAttentionConfig(16, 16, num_splits=4))  # >= 1 empty split for req 2
    assert_close(one, ref, torch.float32)
    assert_close(four, ref, torch.float32)
    torch.testing.assert_close(one, four, atol=2e-6, rtol=2e-6)


def test_split_kv_with_window_softcap_alibi() -> None:
    # A window that cuts through split segments, so some splits see nothing for some rows.
    batch = _stored_batch(13)
    c = batch.common
    kc, vc = batch.kv_cache.unbind(0)
    slopes = torch.tensor([0.3, 0.1, 0.05, 0.02], device=DEV)
    ref = batch.reference(scale=batch.spec.head_size**-0.5, sliding_window=23, logits_soft_cap=2.0,
                          alibi_slopes=slopes.cpu())
    for splits in (1, 4):
        out = torch.zeros_like(batch.query)
        tua.paged_attention(batch.query, kc, vc, out, cu_seqlens_q=c.query_start_loc, seqused_k=c.seq_lens,
                              block_table=c.block_table_tensor, max_seqlen_q=5, max_seqlen_k=71,
                              softmax_scale=batch.spec.head_size**-0.5, window=(22, 0), softcap=2.0,
                              alibi_slopes=slopes, config=UnifiedAttentionConfig(16, 16, num_splits=splits))
        assert_close(out, ref, torch.float32)


def test_cross_attention_reads_the_cached_encoder_kv() -> None:
    spec = BatchSpec(context_lens=(9, 20), query_lens=(3, 7), **SMALL, attn_type=AttentionType.ENCODER_DECODER)
    check(make_random_batch(spec, seed=14))


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(spec=batch_specs(max_reqs=4, max_context=40, max_query=9, head_sizes=(16, 32),
                        dtypes=(torch.float32, torch.bfloat16), kv_cache_dtypes=("auto", "fp8"),
                        block_sizes=(1, 4, 16), device=DEV),
       seed=st.integers(0, 2**16))
def test_fuzz_mixed_batches(spec: BatchSpec, seed: int) -> None:
    check(make_random_batch(spec, seed=seed), factor=10.0 if spec.kv_cache_dtype != "auto" else 1.0)


def test_config_selection_is_static_and_fills_the_gpu() -> None:
    sel = tcfg.select_unified_attention_config
    kw = dict(num_q_heads=32, num_kv_heads=8, head_size=128, num_sms=132)
    big = sel(num_tokens=64, num_seqs=64, max_seqlen_q=1, **kw)
    assert (big.block_m, big.num_splits) == (16, 1)  # 64 x 8 programs fill 132 SMs
    one = sel(num_tokens=1, num_seqs=1, max_seqlen_q=1, **kw)
    assert one.num_splits == 32  # 1 x 8 programs: split KV 32 ways, about one program per SM
    assert sel(num_tokens=4, num_seqs=4, max_seqlen_q=1, **kw).num_splits == 8
    capped = sel(num_tokens=200, num_seqs=1, max_seqlen_q=200, max_split_rows=256, **kw)
    assert capped.num_splits * 200 <= 256
    assert (big.tile_n, big.num_stages, big.one_loop, big.maxnreg) == (32, 3, True, None)
    fp8 = sel(num_tokens=64, num_seqs=64, max_seqlen_q=1, kv_fp8=True, **kw)
    # fp8: 64-token tiles (same bytes per tile as bf16's 32), registers capped for 4 CTAs/SM.
    assert (fp8.tile_n, fp8.maxnreg, fp8.one_loop) == (64, 128, True)
    prefill = sel(num_tokens=16384, num_seqs=8, max_seqlen_q=2048, **kw)
    assert (prefill.block_m, prefill.num_splits, prefill.num_warps) == (128, 1, 8)
    assert (prefill.tile_n, prefill.num_stages, prefill.one_loop) == (64, 3, False)
    assert sel(num_tokens=1, num_seqs=1, max_seqlen_q=1, **kw) == one  # deterministic
    with pytest.raises(ValueError, match="power of two"):
        UnifiedAttentionConfig(24, 16)


def test_persistent_buffers_emulate_graph_replay() -> None:
    """A 'captured' decode metadata replays a later mixed batch of the same size correctly."""
    cfg = VattnConfig(compilation=CompilationConfig(cudagraph_capture_sizes=(4, 8, 16, 32, 40)))
    replay = make_random_batch(BatchSpec(**MIXED, **SMALL), seed=11)  # 34 tokens, 5 requests
    builder = _builder(replay, cfg)
    builder.use_persistent_buffers = True  # on by default on CUDA only
    t = replay.common.slot_mapping.shape[0]
    width = 8
    capture = CommonAttentionMetadata(
        query_start_loc=torch.arange(t + 1, dtype=torch.int32, device=DEV),
        query_start_loc_cpu=torch.arange(t + 1, dtype=torch.int32),
        seq_lens=torch.full((t,), 3, dtype=torch.int32, device=DEV),
        seq_lens_cpu=torch.full((t,), 3, dtype=torch.int32),
        num_computed_tokens_cpu=torch.full((t,), 2, dtype=torch.int32),
        num_reqs=t, num_actual_tokens=t, max_query_len=1,
        block_table_tensor=torch.zeros((t, width), dtype=torch.int32, device=DEV),
        slot_mapping=torch.full((t,), -1, dtype=torch.int64, device=DEV),
    )
    assert builder.cudagraph_support == AttentionCGSupport.ALWAYS
    captured = builder.build_for_cudagraph_capture(capture)
    assert captured.config.block_m == 16  # decode config, fixed in the "graph"
    fresh = builder.build(0, replay.common)
    for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
        assert getattr(fresh, name).data_ptr() == getattr(captured, name).data_ptr(), name
    assert fresh.seq_lens[replay.common.num_reqs:].eq(0).all()
    impl = TritonAttentionImpl(4, 32, 32**-0.5, 2)
    before = replay.kv_cache.clone()
    out = torch.zeros_like(replay.query)
    impl.forward(replay.layer, replay.query, replay.key, replay.value, replay.kv_cache, captured, output=out)
    assert_close(out, replay.reference(scale=32**-0.5), torch.float32)
    check_cache_written(replay)  # stored inside the decode config's attention kernel
    check_cache_untouched(before, replay.kv_cache, replay.common.slot_mapping)


@pytest.mark.parametrize("b,bk,t,width", [(3, 5, 5, 4), (1, 1, 1, 33), (64, 64, 64, 40), (2, 2, 7, 1)])
def test_copy_decode_metadata_matches_the_copies(b: int, bk: int, t: int, width: int) -> None:
    """The one-launch metadata copy (what the CUDA builder runs before a replay) writes what
    the per-array copies and padding fills write, into a wider block-table buffer, and no
    entry past the batch's."""
    meta = triton_modules.load(["vattn.backends.triton.metadata_copy"])["vattn.backends.triton.metadata_copy"]
    g = torch.Generator().manual_seed(b * 100 + width)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int32), torch.randint(1, 4, (b,), generator=g).cumsum(0).int()])
    seq = torch.randint(1, 500, (b,), generator=g, dtype=torch.int32)
    slots = torch.randint(0, 10_000, (t,), generator=g)
    bt = torch.randint(0, 900, (b + 2, width), generator=g, dtype=torch.int32)[:b]  # rows of a taller table
    bufs = [torch.full((bk + 3,), -7, dtype=torch.int32), torch.full((bk + 2,), -7, dtype=torch.int32),
            torch.full((t + 2,), -7, dtype=torch.int64), torch.full((bk + 1, width + 5), -7, dtype=torch.int32)]
    want = [x.clone() for x in bufs]
    want[0][: b + 1] = qsl
    want[0][b + 1 : bk + 1] = qsl[b]
    want[1][:b] = seq
    want[1][b:bk] = 0
    want[2][:t] = slots
    want[3][:b, :width] = bt
    qsl, seq, slots, bt = (x.to(DEV) for x in (qsl, seq, slots, bt))
    bufs = [x.to(DEV) for x in bufs]
    meta.copy_decode_metadata(qsl, seq, slots, bt, bufs[0][: bk + 1], bufs[1][:bk], bufs[2][:t], bufs[3][:b, :width])
    for got, exp in zip(bufs, want):
        assert torch.equal(got.cpu(), exp)


def test_capture_grows_persistent_buffers_first() -> None:
    cfg = VattnConfig(compilation=CompilationConfig(max_capture_size=4, cudagraph_capture_sizes=(4,)))
    batch = make_random_batch(BatchSpec(context_lens=(3,) * 6, query_lens=(1,) * 6, **SMALL), seed=15)
    builder = _builder(batch, cfg)
    builder.use_persistent_buffers = True
    wide = dataclasses.replace(batch.common, block_table_tensor=torch.nn.functional.pad(
        batch.common.block_table_tensor, (0, 5)))
    md = builder.build_for_cudagraph_capture(wide)  # 6 tokens > 4: grows before capturing
    assert builder.max_graph_tokens == 6 and builder._block_table.shape[1] == wide.block_table_tensor.shape[1]
    again = builder.build(0, batch.common)
    assert again.block_table.data_ptr() == md.block_table.data_ptr()
    assert again.partial_out is md.partial_out is not None


_AOT_SCRIPT = r"""
import sys, triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vattn.backends.triton.kernels import _combine_splits_kernel, _unified_attention_kernel
from vattn.kernels.kv_store import _store_kv_kernel
from examples.gemv.kernel import _gemv_kernel

def compile_(fn, types, consts, warps, stages):
    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in sig
             if sig[n].startswith("*") or (n.startswith("stride") and n not in consts)}
    src = ASTSource(fn, sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))

def attn(kv="bf16", q="bf16", out="bf16", m=16, splits=1, warps=4, feats=False, fuse=False):
    ptr = {n: "*fp32" for n in _unified_attention_kernel.arg_names if n.endswith("_ptr")}
    ptr.update(q_ptr="*" + q, k_ptr="*" + kv, v_ptr="*" + kv, out_ptr="*" + out, cu_q_ptr="*i32",
               seqused_k_ptr="*i32", block_table_ptr="*i32", softmax_scale="fp32", softcap="fp32",
               key_ptr="*bf16", value_ptr="*bf16", slot_ptr="*i64")
    c = dict(stride_qd=1, stride_kd=1, stride_vd=1, stride_od=1, NUM_Q_HEADS=32, QPK=4, HEAD_SIZE=128,
             HEAD_PAD=128, PAGE_SIZE=16, BLOCK_M=m, BLOCK_Q=m // 4, TILE_N=64, SPLIT_KV=splits > 1,
             COMPUTE_DTYPE=tl.bfloat16 if kv == "bf16" else tl.float16, DOT_FP32=False, CAUSAL=True,
             USE_WINDOW=feats, USE_SOFTCAP=feats, USE_ALIBI=feats, USE_SINKS=feats, Q_FP8=q != "bf16",
             KV_FP8=kv != "bf16", OUT_FP8=out != "bf16", FP8_OUT_MAX=448.0, FP8_ROUND_FIX=0,
             V_CVT={"bf16": 0, "fp8e4nv": 1, "fp8e5": 2}[kv], KV_SAME=kv != "fp8e5",
             ONE_LOOP=m == 16, LAUNCH_DEPENDENTS=splits > 1, FUSE_STORE=fuse,
             KV_FP8_MAX=448.0 if kv == "fp8e4nv" else 57344.0, KV_ROUND_FIX=0, PDL_WAIT=fuse)
    c.update(stride_nkd=1, stride_nvd=1)
    return compile_(_unified_attention_kernel, ptr, c, warps, 3)

decode = attn(splits=16, feats=True)
fused = attn(splits=16, fuse=True)  # the decode step's kernel: KV store fused, PDL
fused_fp8 = attn(kv="fp8e4nv", splits=16, fuse=True, feats=True)
assert "griddepcontrol.wait" in fused.asm["ptx"] and "griddepcontrol.wait" not in decode.asm["ptx"]
prefill = attn(m=128, warps=8)
fp8 = attn(kv="fp8e4nv", q="fp8e4nv", out="fp8e4nv", feats=True)
fp8_e5m2 = attn(kv="fp8e5", m=16)
assert "LDS.U8" not in fp8.asm.get("sass", "") and "cvt.rn.f16x2.e4m3x2" in fp8.asm["ptx"]
assert "cvt.rn.f16x2.e5m2x2" in fp8_e5m2.asm["ptx"]
# The block table is prefetched a tile ahead, so the K/V copies stay in flight across
# iterations (a ``cp.async.wait_group 0`` inside the loop would serialise them).
for k in (decode, fused):
    assert "cp.async.wait_group 	2" in k.asm["ptx"] or "cp.async.wait_group 2" in k.asm["ptx"]
combine = compile_(_combine_splits_kernel, dict(out_ptr="*bf16", part_o_ptr="*fp32", part_lse_ptr="*fp32",
                   cu_q_ptr="*i32", out_scale_ptr="*fp32"), dict(stride_od=1, NUM_Q_HEADS=32, HEAD_SIZE=128,
                   HEAD_PAD=128, NUM_SPLITS=64, OUT_FP8=False, FP8_OUT_MAX=0.0, FP8_ROUND_FIX=0,
                   LAUNCH_DEPENDENTS=True, WAIT=True, EARLY_DEPENDENTS=True), 4, 1)
ptx = combine.asm["ptx"]  # the output projection may start while attention runs, before the combine waits
assert ptx.index("griddepcontrol.launch_dependents") < ptx.index("griddepcontrol.wait")
compile_(_store_kv_kernel, {n: "*fp32" for n in _store_kv_kernel.arg_names if n.endswith("_ptr")}
         | dict(key_ptr="*bf16", value_ptr="*bf16", key_cache_ptr="*fp8e5", value_cache_ptr="*fp8e5",
                slot_ptr="*i64"),
         dict(stride_kd=1, stride_vd=1, stride_kcd=1, stride_vcd=1, NUM_KV_HEADS=8, HEAD_SIZE=128,
              HEAD_PAD=128, BLOCK_H=8, PAGE_SIZE=16, FP8=True, FP8_MAX=57344.0, FP8_ROUND_FIX=0), 4, 1)
gemv_ptrs = dict(x_ptr="*bf16", up_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", res_ptr="*bf16", nw_ptr="*bf16",
                 cos_ptr="*bf16", sin_ptr="*bf16", eps="fp32")
gemv = compile_(_gemv_kernel, gemv_ptrs, dict(BLOCK_N=4, BLOCK_K=2048, SILU_MUL=True, RMS_NORM=False, RESIDUAL=True,
                                              ROPE_DIM=0, USE_PDL=True), 8, 1)
gemv_norm = compile_(_gemv_kernel, gemv_ptrs, dict(BLOCK_N=4, BLOCK_K=2048, SILU_MUL=False, RMS_NORM=True,
                                                   RESIDUAL=False, ROPE_DIM=0, USE_PDL=True), 8, 1)
gemv_rope = compile_(_gemv_kernel, gemv_ptrs, dict(BLOCK_N=4, BLOCK_K=2048, SILU_MUL=False, RMS_NORM=True,
                                                   RESIDUAL=False, ROPE_DIM=64, USE_PDL=True), 8, 1)
assert "griddepcontrol.wait" in gemv.asm["ptx"] and "griddepcontrol.wait" in gemv_norm.asm["ptx"] and "griddepcontrol.launch_dependents" in decode.asm["ptx"]
assert "griddepcontrol.launch_dependents" in gemv_norm.asm["ptx"]  # the next kernel may start early ...
assert "griddepcontrol.launch_dependents" not in gemv_rope.asm["ptx"]  # ... but not attention after RoPE
compile_(_gemv_kernel, gemv_ptrs, dict(BLOCK_N=4, BLOCK_K=2048, SILU_MUL=False, RMS_NORM=False, RESIDUAL=False,
                                       ROPE_DIM=128, USE_PDL=True, UNSIGNED_SIN=True), 8, 1)
from examples.argmax import _chunk_argmax_kernel, _row_argmax_kernel
chunk_argmax = compile_(_chunk_argmax_kernel, dict(x_ptr="*bf16", key_ptr="*i32", idx_ptr="*i32"),
                        dict(BLOCK=4096, USE_PDL=True), 4, 1)
row_argmax = compile_(_row_argmax_kernel, dict(key_ptr="*i32", idx_ptr="*i32", out_ptr="*i64"),
                      dict(CHUNKS=32, USE_PDL=True), 1, 1)
ptx = chunk_argmax.asm["ptx"]  # the logits are read after the wait for the LM head
assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global") and "griddepcontrol.wait" in row_argmax.asm["ptx"]
from vattn.backends.triton.metadata_copy import _copy_metadata_kernel
compile_(_copy_metadata_kernel, dict(qsl_src="*i32", qsl_dst="*i32", seq_src="*i32", seq_dst="*i32",
         slot_src="*i64", slot_dst="*i64", bt_src="*i32", bt_dst="*i32"), dict(BLOCK=128), 4, 1)
ttgir = prefill.asm["ttgir"]
print("WGMMA" if "warp_group_dot" in ttgir else "NO-WGMMA", "SMEM", decode.metadata.shared, prefill.metadata.shared)
"""


def test_kernels_compile_for_hopper() -> None:
    """Compile (no GPU needed) the main kernel variants for sm_90 with Triton's own ptxas.

    Runs in a subprocess: the kernels must be built in compiled mode, not the interpreter.
    Catches compile-only errors the interpreter cannot see, and checks that the prefill
    tile takes Hopper's wgmma path.
    """
    import subprocess
    import sys

    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as e:
        pytest.skip(f"this Triton has no ahead-of-time compile API: {e}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _AOT_SCRIPT], capture_output=True, text=True, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=600)
    if res.returncode != 0 and ("ptxas" in res.stderr.lower() and "not found" in res.stderr.lower()):
        pytest.skip("Triton's NVIDIA backend (ptxas) is not installed")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "WGMMA" in res.stdout.split() and "NO-WGMMA" not in res.stdout, res.stdout


# ---- the backend's static facts -----------------------------------------------------------


def test_backend_facts(monkeypatch: pytest.MonkeyPatch) -> None:
    B = TritonAttentionBackend
    assert B.get_name() == "TRITON_ATTN"
    assert B.accept_output_buffer and B.supports_quant_query_input and B.supports_output_quant
    assert B.get_kv_cache_shape(10, 16, 2, 64) == (2, 10, 16, 2, 64)
    assert stride_orders(B) == PAGED_ORDERS
    assert B.get_kv_cache_stride_order() == PAGED_ORDERS["NHD"]  # the default
    assert {64, 128, 256} <= set(B.get_supported_head_sizes())
    assert B.get_cudagraph_support() == AttentionCGSupport.ALWAYS
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert B.validate_configuration(128, torch.bfloat16, "fp8_e5m2", 32, has_sink=True) == []
    reasons = B.validate_configuration(512, torch.bfloat16, "int4", 16)
    assert any("head_size" in r for r in reasons) and any("kv_cache_dtype" in r for r in reasons)
    if not HAS_CUDA:
        monkeypatch.delenv("TRITON_INTERPRET")
        ok, why = B.is_available()
        assert not ok and "TRITON_INTERPRET" in why
    impl = TritonAttentionImpl(4, 64, 0.125, 2)
    assert impl.fused_output_quant_supported(torch.float8_e4m3fn)
    assert not impl.fused_output_quant_supported(torch.int8)
    with pytest.raises(NotImplementedError, match="TORCH_SDPA"):
        TritonAttentionImpl(4, 64, 0.125, 2, attn_type=AttentionType.ENCODER_ONLY)


def test_launcher_errors_name_the_argument() -> None:
    batch = make_random_batch(BatchSpec(context_lens=(3,), query_lens=(1,), **SMALL), seed=12)
    c = batch.common
    kc, vc = batch.kv_cache.unbind(0)
    kw = dict(cu_seqlens_q=c.query_start_loc.long(), seqused_k=c.seq_lens, block_table=c.block_table_tensor,
              max_seqlen_q=1, max_seqlen_k=4, softmax_scale=1.0)
    with pytest.raises(ValueError, match="cu_seqlens_q must be int32"):
        tua.paged_attention(batch.query, kc, vc, torch.empty_like(batch.query), **kw)
    kw["cu_seqlens_q"] = c.query_start_loc
    with pytest.raises(ValueError, match="k_scale is required"):
        tua.paged_attention(batch.query, kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn),
                              torch.empty_like(batch.query), **kw)


# ---- GPU: full shapes, long contexts, CUDA graphs ----------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("block_size", [16, 32])
def test_cuda_full_shapes(head_size: int, block_size: int) -> None:
    spec = BatchSpec(context_lens=(32000, 4999, 0, 700, 1500), query_lens=(1, 1, 300, 77, 513),
                     num_heads=32, num_kv_heads=8, head_size=head_size, block_size=block_size,
                     dtype=torch.bfloat16, layout="NHD" if block_size == 16 else "HND",
                     num_pad_tokens=5, device="cuda")
    check(make_random_batch(spec, seed=20))


@pytest.mark.cuda
@pytest.mark.parametrize("num_reqs", [1, 3])
def test_cuda_long_decode_split_kv(num_reqs: int) -> None:
    spec = BatchSpec(context_lens=(32767, 20000, 9000)[:num_reqs], query_lens=(1,) * num_reqs,
                     num_heads=32, num_kv_heads=8, head_size=128, dtype=torch.bfloat16, device="cuda")
    batch = make_random_batch(spec, seed=21)
    md = _builder(batch).build(0, batch.common)
    assert md.config.num_splits > 1, "small-batch long decode must split KV"
    check(batch)


@pytest.mark.cuda
@pytest.mark.parametrize("kv_dtype", ["fp8", "fp8_e5m2"])
def test_cuda_fp8_kv_and_features(kv_dtype: str) -> None:
    spec = BatchSpec(context_lens=(4000, 100, 2000), query_lens=(1, 200, 64), num_heads=16,
                     num_kv_heads=4, head_size=128, dtype=torch.bfloat16, kv_cache_dtype=kv_dtype,
                     k_scale=0.05, v_scale=0.03, device="cuda")
    sinks = torch.linspace(-1, 1, 16, device="cuda")
    check(make_random_batch(spec, seed=22), sliding_window=1000, logits_soft_cap=30.0, sinks=sinks)


@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_cuda_store_kv_matches_torch(layout: str) -> None:
    spec = BatchSpec(context_lens=(100, 0), query_lens=(1, 400), num_heads=32, num_kv_heads=8,
                     head_size=128, dtype=torch.bfloat16, kv_cache_dtype="fp8", layout=layout,
                     num_pad_tokens=7, k_scale=0.04, v_scale=0.02, device="cuda")
    batch = make_random_batch(spec, seed=23)
    before = batch.kv_cache.clone()
    kc, vc = batch.kv_cache.unbind(0)
    triton_store_kv(batch.key, batch.value, kc, vc, batch.common.slot_mapping, "fp8",
                    batch.layer._k_scale, batch.layer._v_scale)
    check_cache_written(batch)
    check_cache_untouched(before, batch.kv_cache, batch.common.slot_mapping)


class _DeviceTensor:
    """Stands in for a tensor in ``_plan_signature`` (which reads only these attributes)."""

    def __init__(self, is_cuda: bool, ptr: int = 1 << 20) -> None:
        self.is_cuda, self.shape, self.dtype, self._ptr = is_cuda, (1, 4, 32), torch.bfloat16, ptr

    def data_ptr(self) -> int:
        return self._ptr

    def stride(self) -> tuple[int, ...]:
        return (128, 32, 1)


def test_launch_plans_only_for_aligned_cuda_tensors() -> None:
    """A plan passes bare addresses, which Triton does not check: a tensor off CUDA (or
    misaligned) in any role means no plan, so its call goes through the validated path."""
    impl = TritonAttentionImpl(4, 32, 32**-0.5, 2)
    t = _DeviceTensor
    assert impl._plan_signature(t(True), t(True), t(True), t(True), None, ()) is not None
    for i in range(4):  # q, k, v, output
        args = [t(j != i) for j in range(4)]
        assert impl._plan_signature(*args, None, ()) is None, i
    assert impl._plan_signature(t(True), t(True), t(True), t(True), t(False), ()) is None  # output_scale
    assert impl._plan_signature(t(True), t(True, 8), t(True), t(True), None, ()) is None  # misaligned
    assert impl._plan_signature(t(True), t(True), t(True), t(True), None, None) is None  # cache not plannable


@pytest.mark.cuda
@pytest.mark.parametrize("kv_dtype,shape", [("auto", "long_decode"), ("auto", "mixed"), ("auto", "wide_decode"),
                                             ("fp8", "mixed")])
def test_cuda_layers_of_a_step_repeat_the_first_layers_launches(kv_dtype: str, shape: str) -> None:
    """After the step's first layer, the others repeat its launches with their own q/k/v,
    output, cache and scales (``LaunchPlan``): outputs and every cache equal, bit for bit, the
    path that validates and launches each layer anew (``FastLaunch`` off: no plans)."""
    from vattn.kernels.launch import LaunchPlan, set_fast_launch

    lens = {"long_decode": dict(context_lens=(900, 30), query_lens=(1, 1)), "mixed": MIXED,
            "wide_decode": dict(context_lens=tuple(range(5, 400, 10)), query_lens=(1,) * 40)}[shape]
    heads = (32, 8) if shape == "wide_decode" else (8, 2)  # 40 x 8 programs fill an H100/H200: no split
    spec = BatchSpec(**lens, num_heads=heads[0], num_kv_heads=heads[1], head_size=64, block_size=16,
                     dtype=torch.bfloat16, kv_cache_dtype=kv_dtype, k_scale=0.5, v_scale=0.25,
                     num_pad_tokens=3, device="cuda")
    base = make_random_batch(spec, seed=30)
    layers = [make_random_batch(spec, seed=31 + i) for i in range(3)]  # own inputs, caches, scales
    impls = [TritonAttentionImpl(heads[0], 64, 0.125, num_kv_heads=heads[1], kv_cache_dtype=kv_dtype) for _ in layers]

    def step(fast: bool) -> tuple[object, list[torch.Tensor], list[torch.Tensor]]:
        set_fast_launch(fast)
        md = _builder(base).build(0, base.common)  # one metadata for every layer, as in a model
        caches, outs = [], []
        for batch, impl in zip(layers, impls):
            cache, out = batch.kv_cache.clone(), torch.zeros_like(batch.query)
            impl.forward(batch.layer, batch.query, batch.key, batch.value, cache, md, output=out)  # type: ignore[arg-type]
            caches.append(cache)
            outs.append(out)
        return md, outs, caches

    try:
        step(True)  # compiles: first launches go through Triton, nothing to repeat yet
        md, outs, caches = step(True)
        plans = list(md.launch_plans.values())  # type: ignore[attr-defined]
        assert len(plans) == 1 and isinstance(plans[0], LaunchPlan)
        # store (decode configs: inside attention), attention, split combine
        cfg = md.config  # type: ignore[attr-defined]
        assert len(plans[0].steps) == (not cfg.one_loop) + 1 + (cfg.num_splits > 1)  # type: ignore[attr-defined]
        _, want_outs, want_caches = step(False)
    finally:
        set_fast_launch(True)
    assert (md.config.num_splits > 1) == (shape != "wide_decode")  # type: ignore[attr-defined]
    for got, want in zip(outs + caches, want_outs + want_caches):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert not torch.equal(outs[1], outs[2])


# ---- draft trees ---------------------------------------------------------------------------

#: A decode, a chain, two trees over cached context, one tree from scratch (as tests/test_tree_attn.py).
TREE_PARENTS = [[-1], [-1, 0, 1, 2, 3, 4], [-1, 0, 0, 1, 1, 2, -1], [-1, 0, 1, 0, 3], [-1, -1, 0, 1, 1, 2, 3, 0, 7]]
TREE_CONTEXT = (9, 0, 20, 3, 0)


def _tree_batch(parents: list[list[int]], context: tuple[int, ...], seed: int, **kw: object) -> RandomBatch:
    """A random batch whose common metadata carries ``parents`` (flattened) as draft trees."""
    from vattn.metadata import build_common_attn_metadata

    spec = BatchSpec(context_lens=context, query_lens=tuple(len(p) for p in parents), **{**SMALL, **kw})  # type: ignore[arg-type]
    batch = make_random_batch(spec, seed=seed)
    batch.common = build_common_attn_metadata(list(spec.query_lens), list(context), batch.block_tables,
                                              spec.block_size, device=spec.device,
                                              tree_parents=[p for ps in parents for p in ps])
    return batch


@pytest.mark.parametrize("features", ["plain", "window_softcap", "sinks"])
def test_draft_trees_match_explicit_masks(features: str) -> None:
    """TRITON_ATTN honors ``tree_parents``: a new token sees the context, its ancestors, itself."""
    from flex_harness import explicit_reference

    batch = _tree_batch(TREE_PARENTS, TREE_CONTEXT, seed=40, block_size=4)
    allowed = tree_allowed(TREE_CONTEXT, TREE_PARENTS)
    kwargs: dict[str, object] = {}
    score = sinks = None
    if features == "window_softcap":
        kwargs = dict(sliding_window=5, logits_soft_cap=2.0)
        for r, a in enumerate(allowed):
            s = a.shape[1]
            q_pos = torch.arange(s - a.shape[0], s)[:, None]
            a &= torch.arange(s)[None, :] > q_pos - 5
        score = lambda s, r, q, k: 2.0 * torch.tanh(s / 2.0)  # noqa: E731
    elif features == "sinks":
        sinks = torch.linspace(-1.0, 2.0, SMALL["num_heads"])
        kwargs = dict(sinks=sinks.to(DEV))
    out, before = run(batch, **kwargs)
    want = explicit_reference(batch, batch.spec.head_size**-0.5, allowed, score=score, sinks=sinks)
    assert_close(out[: batch.num_actual_tokens], want, torch.float32)
    check_cache_written(batch)
    check_cache_untouched(before, batch.kv_cache, batch.common.slot_mapping)


def test_wide_draft_tree_bf16() -> None:
    """A binary tree of 64 drafts over a long context beside decodes, GQA, bf16, split KV allowed."""
    from flex_harness import explicit_reference

    parents = [[-1]] * 3 + [[-1] + [(i - 1) // 2 for i in range(1, 64)]]
    context = (30, 5, 17, 70)
    batch = _tree_batch(parents, context, seed=41, dtype=torch.bfloat16)
    out, _ = run(batch)
    want = explicit_reference(batch, batch.spec.head_size**-0.5, tree_allowed(context, parents))
    assert_close(out[: batch.num_actual_tokens], want, torch.bfloat16)


def test_draft_trees_run_outside_full_graphs_and_need_causal_attention() -> None:
    batch = _tree_batch(TREE_PARENTS, TREE_CONTEXT, seed=42, block_size=4)
    builder = _builder(batch)
    assert not builder.can_run_in_cudagraph(batch.common)
    md = builder.build(0, batch.common)
    assert md.tree is not None and md.tree.dtype == torch.uint8 and md.tree.shape == (batch.query.shape[0], 9)
    chain = dataclasses.replace(batch.common, tree_parents=None)
    assert builder.can_run_in_cudagraph(chain) and builder.build(0, chain).tree is None
    decodes = _tree_batch([[-1]] * 3, (4, 9, 2), seed=43)  # one-token trees: plain decodes
    assert builder.can_run_in_cudagraph(decodes.common) and builder.build(0, decodes.common).tree is None
    k_cache, v_cache = batch.kv_cache.unbind(0)
    with pytest.raises(ValueError, match="tree needs causal attention"):
        tua.paged_attention(batch.query, k_cache, v_cache, torch.empty_like(batch.query),
                            cu_seqlens_q=md.query_start_loc, seqused_k=md.seq_lens, block_table=md.block_table,
                            max_seqlen_q=9, max_seqlen_k=md.max_seq_len, softmax_scale=0.1, causal=False, tree=md.tree)
    bad = dataclasses.replace(batch.common, tree_parents=batch.common.tree_parents[:3])
    with pytest.raises(ValueError, match=r"^CommonAttentionMetadata.tree_parents: expected a 1-D int tensor"):
        builder.build(0, bad)
    with pytest.raises(ValueError, match=r"tree must be \(T >="):
        tua.paged_attention(batch.query, k_cache, v_cache, torch.empty_like(batch.query),
                            cu_seqlens_q=md.query_start_loc, seqused_k=md.seq_lens, block_table=md.block_table,
                            max_seqlen_q=9, max_seqlen_k=md.max_seq_len, softmax_scale=0.1, tree=md.tree[:, :4])


def test_tree_attn_runs_triton_for_layers_without_mods() -> None:
    """TREE_ATTN: a layer without mods runs this kernel's tree mask (the builder's Triton half),
    one with a mask_mod FlexAttention; both match the explicit masks. A group of registered
    layers that all run Triton skips FlexAttention's launches."""
    from flex_harness import explicit_reference

    import vattn
    from vattn.backends.flex_attention import mods
    from vattn.backends.tree_attn import TreeAttentionImpl, TreeAttentionMetadataBuilder

    batch = _tree_batch(TREE_PARENTS, TREE_CONTEXT, seed=44, block_size=4)
    spec = batch.spec
    kv_spec = AttentionSpec(spec.block_size, spec.num_kv_heads, spec.head_size, batch.kv_cache.dtype, "auto")
    builder = TreeAttentionMetadataBuilder(kv_spec, ["fake.attn"], VattnConfig(), torch.device(DEV))
    builder.use_triton, builder.num_cache_blocks = True, batch.kv_cache.shape[1]
    md = builder.build(0, batch.common)
    assert md.triton is not None and md.triton.tree is not None and not md.flex_skipped
    allowed = tree_allowed(TREE_CONTEXT, TREE_PARENTS)
    scale = spec.head_size**-0.5
    for mask_mod in (None, mods.sliding_window(4)):
        impl = TreeAttentionImpl(spec.num_heads, spec.head_size, scale, spec.num_kv_heads, mask_mod=mask_mod,
                                 compiled=False)
        assert (impl.triton_impl is None) == (mask_mod is not None)
        out = torch.zeros_like(batch.query)
        impl.forward(batch.layer, batch.query, batch.key, batch.value, batch.kv_cache, md, output=out)  # type: ignore[arg-type]
        want_allowed = allowed
        if mask_mod is not None:
            want_allowed = []
            for a in allowed:
                s = a.shape[1]
                q_pos = torch.arange(s - a.shape[0], s)[:, None]
                want_allowed.append(a & (torch.arange(s)[None, :] > q_pos - 4))
        assert_close(out[: batch.num_actual_tokens], explicit_reference(batch, scale, want_allowed), torch.float32)

    cfg = VattnConfig(cache=vattn.CacheConfig(block_size=16))  # FLEX_ATTENTION's CUDA block sizes
    with vattn.set_current_vattn_config(cfg):
        vattn.Attention(spec.num_heads, spec.head_size, scale, num_kv_heads=spec.num_kv_heads, prefix="t0.attn",
                        attn_backend="TREE_ATTN")
    registered = TreeAttentionMetadataBuilder(kv_spec, ["t0.attn"], cfg, torch.device(DEV))
    registered.use_triton, registered.num_cache_blocks = True, batch.kv_cache.shape[1]
    md = registered.build(0, batch.common)
    assert md.flex_skipped and md.calls == [] and md.triton is not None
    flex_only = TreeAttentionImpl(spec.num_heads, spec.head_size, scale, spec.num_kv_heads,
                                  mask_mod=mods.sliding_window(4), compiled=False)
    with pytest.raises(ValueError, match="no FlexAttention launches"):
        flex_only.forward(batch.layer, batch.query, batch.key, batch.value, batch.kv_cache, md,  # type: ignore[arg-type]
                          output=torch.zeros_like(batch.query))


def test_tree_attn_capture_metadata_is_triton_persistent() -> None:
    """TREE_ATTN's capture-time metadata (every layer on Triton): TRITON_ATTN's persistent
    buffers, no FlexAttention launches; a later decode step of that size reuses the buffers
    and the replayed launch matches the reference."""
    import vattn
    from vattn.backends.tree_attn import TreeAttentionImpl, TreeAttentionMetadataBuilder

    cfg = VattnConfig(cache=vattn.CacheConfig(block_size=16),
                      compilation=CompilationConfig(cudagraph_capture_sizes=(4, 8)))
    spec = BatchSpec(context_lens=(7, 30, 0, 12), query_lens=(1, 1, 1, 1), **SMALL)
    batch = make_random_batch(spec, seed=45)
    scale = spec.head_size**-0.5
    with vattn.set_current_vattn_config(cfg):
        vattn.Attention(spec.num_heads, spec.head_size, scale, num_kv_heads=spec.num_kv_heads, prefix="g0.attn",
                        attn_backend="TREE_ATTN")
    kv_spec = AttentionSpec(spec.block_size, spec.num_kv_heads, spec.head_size, batch.kv_cache.dtype, "auto")
    builder = TreeAttentionMetadataBuilder(kv_spec, ["g0.attn"], cfg, torch.device(DEV))
    builder.use_triton, builder.num_cache_blocks = True, batch.kv_cache.shape[1]
    builder._triton().use_persistent_buffers = True  # on by default on CUDA only
    from mla_harness import dummy_decode_common

    captured = builder.build_for_cudagraph_capture(dummy_decode_common(4, 8, DEV))
    assert captured.flex_skipped and captured.triton is not None and captured.triton.config.one_loop
    fresh = builder.build(0, batch.common)
    for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
        assert getattr(fresh.triton, name).data_ptr() == getattr(captured.triton, name).data_ptr(), name
    impl = TreeAttentionImpl(spec.num_heads, spec.head_size, scale, spec.num_kv_heads)
    out = torch.zeros_like(batch.query)
    impl.forward(batch.layer, batch.query, batch.key, batch.value, batch.kv_cache, captured, output=out)  # type: ignore[arg-type]
    assert_close(out[: batch.num_actual_tokens], batch.reference(scale=scale), torch.float32)

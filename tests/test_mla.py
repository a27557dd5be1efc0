"""Multi-head latent attention: the layer, its ops, the latent cache and metadata, and the MLA
backends against a float32 reference of unabsorbed MLA (tests/mla_harness.py).

CPU: TRITON_MLA's kernels run in the Triton interpreter (tiny shapes); FLASHINFER_MLA and
FLASH_ATTN_MLA run their planning and glue code against torch stand-ins of the libraries'
documented APIs (tests/mla_standins.py). GPU tests (``cuda``, ``flashinfer``, ``flash_attn``)
run every backend at DeepSeek's sizes, fp8 latent caches and CUDA-graph replays.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from torch import nn
from torch.library import opcheck

import torch._dynamo.testing
import triton_modules
import vattn
from benchmarks.common import default_dtype
from mla_harness import MLASpec, assert_close, check_latent_cache, dummy_decode_common, make_mla_batch
from vattn.core.enums import AttentionCGSupport
from vattn.backends.mla.common import MLACommonBackend, merge_attn_states
from vattn.core.metadata import MLAAttentionSpec
from vattn.core.registry import AttentionBackendEnum as B
from vattn.core.config import CompilationConfig, VattnConfig
from vattn.mla_layer import MLAAttention

pytest.importorskip("triton")

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"
# Kernel modules built for the interpreter on CPU (dependencies first: they are reloaded in order).
OPS = triton_modules.load(("vattn.kernels.fp8", "vattn.kernels.mla_store", "vattn.backends.mla.triton_mla.kernels",
                           "vattn.backends.mla.triton_mla.launch"))

from vattn.backends.mla.triton_mla import TritonMLAImpl, TritonMLAMetadataBuilder  # noqa: E402

# Decodes first, then prefills with and without cached context; odd lengths, partial blocks.
MIXED = dict(context_lens=(7, 30, 0, 12, 21), query_lens=(1, 1, 9, 6, 17))
DECODE = dict(context_lens=(15, 16, 17, 40, 0), query_lens=(1, 1, 1, 1, 1))
PREFILL = dict(context_lens=(0, 0, 33), query_lens=(20, 5, 17))


@pytest.fixture
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    """TRITON_MLA available on CPU (its kernels were built for the interpreter above)."""
    if not HAS_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def _builder(spec: MLASpec, cfg: VattnConfig | None = None, chunk: int | None = None,
             cls: type = TritonMLAMetadataBuilder) -> TritonMLAMetadataBuilder:
    b = cls(spec.kv_spec(), [], cfg or VattnConfig(), torch.device(spec.device))
    if chunk is not None:
        b.prefill_chunk_tokens = chunk
    return b


def _run_triton(spec: MLASpec, seed: int = 0, chunk: int | None = 8, factor: float = 1.0, grad: bool = True) -> None:
    batch = make_mla_batch(spec, seed=seed)
    md = _builder(spec, chunk=chunk).build(0, batch.common)
    impl = TritonMLAImpl(spec.num_heads, spec.head_size, spec.scale, 1, kv_cache_dtype=spec.kv_cache_dtype,
                         **spec.impl_kwargs(batch.kv_b_proj))
    out = torch.zeros(batch.q.shape[0], spec.num_heads, spec.v_head_dim, dtype=spec.dtype, device=spec.device)
    before = batch.kv_cache.clone()
    with torch.set_grad_enabled(grad):
        assert impl.forward(batch.layer, batch.q, batch.kv_c, batch.k_pe, batch.kv_cache, md, output=out) is out
    n = batch.num_actual_tokens
    assert_close(out[:n], batch.reference(), spec.dtype, factor=factor)
    check_latent_cache(batch, before)


# ---- TRITON_MLA: kernels in the interpreter --------------------------------------------------


@pytest.mark.parametrize("case", [MIXED, DECODE, PREFILL], ids=["mixed", "decode", "prefill"])
def test_triton_mla_matches_unabsorbed_reference(case: dict) -> None:
    _run_triton(MLASpec(**case, num_pad_tokens=2, device=DEV), seed=1)


@pytest.mark.parametrize("case", [MIXED, DECODE], ids=["mixed", "decode"])
def test_triton_mla_decode_without_autograd(case: dict) -> None:
    """Without autograd the decode's up-projection writes the output rows in place (bmm out=);
    with it (the weights require grad) it copies. Both against the reference."""
    _run_triton(MLASpec(**case, num_pad_tokens=2, device=DEV), seed=5, grad=False)


@pytest.mark.parametrize("block_size,chunk", [(1, 5), (5, 3), (48, None)])
def test_triton_mla_odd_blocks_and_chunks(block_size: int, chunk: int | None) -> None:
    """Shuffled blocks of 1, 5 and 48 tokens; context chunks of 3 / 5 tokens (or one chunk)."""
    spec = MLASpec(**MIXED, block_size=block_size, num_heads=3, kv_lora_rank=24, qk_rope_head_dim=8,
                   qk_nope_head_dim=8, v_head_dim=12, device=DEV)
    _run_triton(spec, seed=2, chunk=chunk)


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp8_e5m2"])
def test_triton_mla_fp8_latent_cache(kv_dtype: str) -> None:
    """The reference reads the same fp8 rows times the scale, so fp32 tolerances (loosened) apply."""
    _run_triton(MLASpec(**MIXED, kv_cache_dtype=kv_dtype, kv_scale=0.05, device=DEV), seed=3, factor=10.0)


def test_triton_mla_bf16() -> None:
    _run_triton(MLASpec(**MIXED, dtype=torch.bfloat16, device=DEV), seed=4, factor=2.0)


def _four_decodes(seed: int) -> tuple[Any, Any, torch.Tensor, torch.Tensor, Any]:
    """(spec, batch, q_nope, q_pe, decode(cache, splits) -> out) for four decodes of random context."""
    spec = MLASpec(context_lens=(3, 70, 0, 33), query_lens=(1, 1, 1, 1), device=DEV)
    batch = make_mla_batch(spec, seed=seed)
    d = _builder(spec).build(0, batch.common).decode
    assert d is not None
    launch = OPS["vattn.backends.mla.triton_mla.launch"]
    q_nope = torch.randn(4, spec.num_heads, spec.kv_lora_rank, device=DEV)
    q_pe = torch.randn(4, spec.num_heads, spec.qk_rope_head_dim, device=DEV)

    def decode(cache: torch.Tensor, splits: int) -> torch.Tensor:
        out = torch.empty_like(q_nope)
        launch.mla_decode(q_nope, q_pe, cache, out, query_start_loc=d.query_start_loc, seq_lens=d.seq_lens,
                          block_table=d.block_table, softmax_scale=0.3, kv_lora_rank=spec.kv_lora_rank,
                          num_splits=splits)
        return out

    return spec, batch, q_nope, q_pe, decode


def test_triton_mla_split_counts_agree() -> None:
    """Every split count gives the one-split result (partials merged by log-sum-exp)."""
    _, batch, _, _, decode = _four_decodes(5)
    outs = [decode(batch.kv_cache, splits) for splits in (1, 2, 8)]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], atol=1e-5, rtol=1e-5)


def test_triton_mla_decode_propagates_nan() -> None:
    """A NaN query head, or a NaN in a request's cached k_pe, gives NaN for exactly what it touches
    with every split count (the split merge once dropped a NaN split as an empty one: zeros)."""
    spec, batch, q_nope, _, decode = _four_decodes(6)
    q_nope[0, 1, 3] = float("nan")  # request 0, head 1
    cache = batch.kv_cache.clone()
    block, offset = divmod(int(batch.common.slot_mapping[1]), cache.shape[1])
    cache[block, offset, spec.kv_lora_rank] = float("nan")  # request 1's new token: its k_pe
    for splits in (1, 2, 8):
        nan = decode(cache, splits).isnan().any(-1)  # (rows, heads)
        want = torch.zeros_like(nan)
        want[0, 1] = True
        want[1, :] = True
        assert torch.equal(nan, want), f"{splits} splits: NaN rows/heads {nan.nonzero().tolist()}"


@pytest.mark.parametrize("block_size", [16, 5])
def test_triton_mla_decode_tiles_agree(block_size: int) -> None:
    """Every tile shape (16 to 64 heads a program, key tiles inside one page or across pages)
    gives the reference's result."""
    tiles_mod = sys.modules["vattn.backends.mla.triton_mla.config"]
    spec = MLASpec(context_lens=(3, 70, 0, 33), query_lens=(1, 1, 1, 1), num_heads=20, block_size=block_size,
                   device=DEV)
    batch = make_mla_batch(spec, seed=6)
    d = _builder(spec).build(0, batch.common).decode
    assert d is not None
    launch = OPS["vattn.backends.mla.triton_mla.launch"]
    g = torch.Generator(device="cpu").manual_seed(6)
    q_nope = torch.randn(4, spec.num_heads, spec.kv_lora_rank, generator=g).to(DEV)
    q_pe = torch.randn(4, spec.num_heads, spec.qk_rope_head_dim, generator=g).to(DEV)
    lat = [batch.kv_cache[torch.tensor(t, device=DEV)].reshape(-1, batch.kv_cache.shape[-1])[:n].float()
           for t, n in zip(batch.block_tables, (4, 71, 1, 34))]
    q = torch.cat([q_nope, q_pe], -1).float()
    want = torch.stack([((q[i] @ x.T) * 0.3).softmax(-1) @ x[:, : spec.kv_lora_rank] for i, x in enumerate(lat)])
    for bh, bn, splits in ((16, 16, 1), (32, 32, 2), (64, 16, 4)):
        out = torch.empty_like(q_nope)
        launch.mla_decode(q_nope, q_pe, batch.kv_cache, out, query_start_loc=d.query_start_loc, seq_lens=d.seq_lens,
                          block_table=d.block_table, softmax_scale=0.3, kv_lora_rank=spec.kv_lora_rank,
                          num_splits=splits, tiles=tiles_mod.DecodeTiles(bh, bn, 4, 2))
        torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4, msg=f"block_h={bh} block_n={bn}")


def test_triton_mla_tiles_follow_the_device() -> None:
    """Large tiles only where shared memory holds them; the split count counts their programs."""
    cfg = sys.modules["vattn.backends.mla.triton_mla.config"]
    hopper = 227 << 10
    assert cfg.decode_tiles(128, 512, hopper).block_h == 64
    assert cfg.decode_tiles(16, 512, hopper).block_h == 16
    assert cfg.decode_tiles(128, 512, 163 << 10) == cfg.DecodeTiles(16, 32, 8, 2)  # Ampere
    assert cfg.decode_num_splits(64, 128, 512, 132, block_h=64) == 2  # 128 programs: about one per SM
    assert cfg.decode_num_splits(64, 128, 512, 132, block_h=16) == 1
    assert cfg.decode_num_splits(1, 16, 512, 132) == cfg.MAX_SPLITS


def test_store_latent_kernel_bit_exact() -> None:
    store = OPS["vattn.kernels.mla_store"].triton_store_latent
    for dtype in (torch.float32, torch.float8_e4m3fn, torch.float8_e5m2):
        cache = torch.zeros(3, 4, 24, dtype=dtype, device=DEV)
        kv_c, k_pe = torch.randn(5, 16, device=DEV) * 40, torch.randn(5, 8, device=DEV)
        slots = torch.tensor([5, -1, 0, 11, -3], device=DEV)
        scale = torch.tensor(0.5, device=DEV)
        store(kv_c, k_pe, cache, slots, scale)
        want = torch.zeros_like(cache)
        from vattn.ops.mla import store_latent

        store_latent(kv_c, k_pe, want, slots, scale)  # the torch path (CPU)
        assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8)), dtype


# ---- metadata, cache, merge --------------------------------------------------------------------


def test_builder_splits_decodes_and_chunks_context() -> None:
    spec = MLASpec(**MIXED, num_pad_tokens=3)
    batch = make_mla_batch(spec, seed=6)
    builder = _builder(spec, chunk=8)
    md = builder.build(0, batch.common)
    assert (md.num_decodes, md.num_prefills, md.num_decode_tokens, md.num_prefill_tokens) == (2, 3, 2, 32)
    assert md.decode is not None and md.decode.num_decode_tokens == 2 and not md.decode.cuda_graph
    p = md.prefill
    assert p is not None and (p.start, p.num_tokens, p.max_query_len) == (2, 32, 17)
    assert p.query_start_loc_cpu.tolist() == [0, 9, 15, 32] and p.context_lens_cpu.tolist() == [0, 12, 21]
    # 8 tokens per chunk shared by the 2 prefills with context: 4 each, up to 21 -> 6 chunks.
    assert len(p.chunks) == 6
    tables = batch.block_tables
    for i, chunk in enumerate(p.chunks):
        lens = torch.diff(chunk.cu_seqlens_cpu).tolist()
        assert lens == [0, min(4, max(0, 12 - 4 * i)), min(4, max(0, 21 - 4 * i))]
        want = [tables[r][pos // 16] * 16 + pos % 16 for r, n in ((3, lens[1]), (4, lens[2]))
                for pos in range(4 * i, 4 * i + n)]
        assert chunk.slots.tolist() == want and chunk.max_seqlen == max(lens)
    assert AttentionCGSupport(builder.cudagraph_support) == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    assert not builder.can_run_in_cudagraph(batch.common)


def test_builder_persistent_buffers_for_decode_steps() -> None:
    """Pure-decode steps go through fixed buffers (what a full CUDA graph replays)."""
    spec = MLASpec(**DECODE)
    cfg = VattnConfig(compilation=CompilationConfig(cudagraph_capture_sizes=(1, 8)))
    builder = _builder(spec, cfg)
    builder.use_persistent_buffers = True  # CPU: exercise the CUDA-graph path's bookkeeping
    addresses = None
    for seed in (7, 8):
        batch = make_mla_batch(spec, seed=seed)
        assert builder.can_run_in_cudagraph(batch.common)
        md = builder.build_for_cudagraph_capture(batch.common) if seed == 7 else builder.build(0, batch.common)
        assert md.decode is not None and md.decode.cuda_graph and md.prefill is None
        now = [t.data_ptr() for t in (md.query_start_loc, md.seq_lens, md.block_table, md.slot_mapping)]
        assert addresses in (None, now)
        addresses = now
        assert torch.equal(md.seq_lens, batch.common.seq_lens) and torch.equal(md.slot_mapping, batch.common.slot_mapping)


def test_merge_attn_states_equals_one_softmax() -> None:
    g = torch.Generator().manual_seed(0)
    s = torch.randn(6, 3, 10, generator=g)
    v = torch.randn(10, 5, generator=g)
    full = torch.einsum("thk,kd->thd", s.softmax(-1), v)
    a, b = s[..., :4], s[..., 4:]
    out_a, out_b = torch.einsum("thk,kd->thd", a.softmax(-1), v[:4]), torch.einsum("thk,kd->thd", b.softmax(-1), v[4:])
    out, lse = merge_attn_states(out_a, a.logsumexp(-1), out_b, b.logsumexp(-1))
    torch.testing.assert_close(out, full)
    torch.testing.assert_close(lse, s.logsumexp(-1))
    empty = torch.full((6, 3), float("inf"))  # FlashAttention's lse of a row without keys
    out, lse = merge_attn_states(torch.full_like(out_a, float("nan")).nan_to_num(7.0), empty, out_b, b.logsumexp(-1))
    torch.testing.assert_close(out, out_b)


def test_latent_cache_shape_and_errors() -> None:
    assert MLACommonBackend.get_kv_cache_shape(10, 16, 1, 576) == (10, 16, 576)
    with pytest.raises(ValueError, match="num_kv_heads: expected 1"):
        MLACommonBackend.get_kv_cache_shape(10, 16, 2, 576)


def _model(cfg: VattnConfig, backend: str | None = None, **kw: object) -> tuple[MLAAttention, vattn.Attention]:
    spec = MLASpec(context_lens=(), query_lens=())
    kv_b = nn.Linear(spec.kv_lora_rank, spec.num_heads * (spec.qk_nope_head_dim + spec.v_head_dim), bias=False)
    with vattn.set_current_vattn_config(cfg):
        mla = MLAAttention(spec.num_heads, spec.scale, spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim,
                           None, spec.kv_lora_rank, kv_b, prefix="m.layers.0.mla", attn_backend=backend, **kw)
        attn = vattn.Attention(4, 16, 0.25, num_kv_heads=2, prefix="m.layers.1.attn")
    return mla, attn


def test_allocate_mixes_latent_and_kv_caches_with_one_block_table(interpret: None) -> None:
    cfg = VattnConfig()
    mla, attn = _model(cfg)
    kv = vattn.allocate_kv_cache(cfg, num_blocks=12)
    assert tuple(kv.tensors["m.layers.0.mla"].shape) == (12, 16, 48)
    assert tuple(kv.tensors["m.layers.1.attn"].shape) == (2, 12, 16, 2, 16)
    specs = {g.backend.get_name(): g.spec for g in kv.groups}
    assert isinstance(specs["TRITON_MLA"], MLAAttentionSpec) and specs["TRITON_MLA"].kv_lora_rank == 32
    assert type(specs["CPU_ATTN"]) is not MLAAttentionSpec
    assert mla.kv_cache[0] is kv.tensors["m.layers.0.mla"]
    common = kv.common_metadata([3, 2], [0, 0], [[4], [7]])
    with vattn.set_forward_context(kv.build_metadata(common), cfg), torch.no_grad():
        out = mla(torch.randn(5, 4 * 32), torch.randn(5, 32), torch.randn(5, 16))
        out2 = attn(torch.randn(5, 64), torch.randn(5, 32), torch.randn(5, 32))
    assert out.shape == (5, 64) and out2.shape == (5, 64)
    assert kv.tensors["m.layers.0.mla"][4, :3].abs().sum() > 0 and kv.tensors["m.layers.1.attn"][0, 7, :2].abs().sum() > 0
    with pytest.raises(ValueError, match=r"TRITON_MLA cache of shape \(num_blocks, 16, 48\)"):
        vattn.bind_kv_cache({"m.layers.0.mla": torch.zeros(12, 16, 40)}, cfg)


# ---- the layer and its op --------------------------------------------------------------------


def _layer_step(cfg: VattnConfig, spec: MLASpec, seed: int, **kw: object):
    batch = make_mla_batch(spec, seed=seed)
    with vattn.set_current_vattn_config(cfg):
        layer = MLAAttention(spec.num_heads, spec.scale, spec.qk_nope_head_dim, spec.qk_rope_head_dim,
                             spec.v_head_dim, None, spec.kv_lora_rank, batch.kv_b_proj, prefix="t.mla", **kw)
    kv = vattn.allocate_kv_cache(cfg, num_blocks=batch.kv_cache.shape[0], device=DEV)
    kv.tensors["t.mla"].copy_(batch.kv_cache)
    batch.kv_cache = kv.tensors["t.mla"]
    return layer, kv, batch


def test_layer_through_the_op_matches_reference(interpret: None) -> None:
    cfg = VattnConfig()
    spec = MLASpec(**MIXED, num_pad_tokens=2, device=DEV)
    layer, kv, batch = _layer_step(cfg, spec, seed=9)
    before = batch.kv_cache.clone()
    with vattn.set_forward_context(kv.build_metadata(batch.common), cfg), torch.no_grad():
        out = layer(batch.q.flatten(1), batch.kv_c, batch.k_pe[:, None])
    n = batch.num_actual_tokens
    assert out.shape == (batch.q.shape[0], spec.num_heads * spec.v_head_dim)
    assert_close(out[:n].view(n, spec.num_heads, -1), batch.reference(), spec.dtype)
    check_latent_cache(batch, before)
    with vattn.set_forward_context(None, cfg, dummy_run=True), torch.no_grad():  # warm-up run: zeros, cache untouched
        assert not layer(batch.q, batch.kv_c, batch.k_pe).any()
    check_latent_cache(batch, before)


def test_opcheck_mla_ops(interpret: None) -> None:
    cfg = VattnConfig()
    spec = MLASpec(**MIXED, device=DEV)
    layer, kv, batch = _layer_step(cfg, spec, seed=10)
    out = torch.empty(batch.q.shape[0], spec.num_heads, spec.v_head_dim, device=DEV)
    with vattn.set_forward_context(kv.build_metadata(batch.common), cfg):
        opcheck(torch.ops.vattn.unified_mla_attention_with_output.default,
                (batch.q, batch.kv_c, batch.k_pe, out, "t.mla"))
    opcheck(torch.ops.vattn.concat_and_cache_mla.default,
            (batch.kv_c, batch.k_pe, torch.zeros(4, 16, spec.head_size, device=DEV),
             torch.tensor([3, -1, 17, 40, 8] + [-1] * (batch.kv_c.shape[0] - 5), device=DEV), torch.ones((), device=DEV)))
    schema = torch.ops.vattn.unified_mla_attention_with_output.default._schema
    assert [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write] == ["output"]
    assert str(schema).endswith("-> ()")


def test_compiled_fullgraph_has_the_op_and_no_recompiles(interpret: None) -> None:
    """torch.compile(fullgraph=True, dynamic=True) keeps the opaque op; batches never recompile."""
    cfg = VattnConfig()
    spec = MLASpec(**MIXED, device=DEV)
    layer, kv, batch = _layer_step(cfg, spec, seed=11)

    def step(q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
        return layer(q, kv_c, k_pe) * 2

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
    for s in (MIXED, PREFILL, dict(context_lens=(4, 9), query_lens=(1, 1))):
        b = make_mla_batch(spec.with_(**s), seed=12, kv_b_proj=batch.kv_b_proj)
        kv.tensors["t.mla"][: b.kv_cache.shape[0]].copy_(b.kv_cache)
        b.kv_cache = kv.tensors["t.mla"][: b.kv_cache.shape[0]]
        with vattn.set_forward_context(kv.build_metadata(b.common), cfg), torch.no_grad():
            out = compiled(b.q, b.kv_c, b.k_pe)
        n = b.num_actual_tokens
        assert_close(out[:n].view(n, spec.num_heads, -1) / 2, b.reference(), spec.dtype)
    assert counter.frame_count == 1
    assert "vattn::unified_mla_attention_with_output" in cfg.compilation.splitting_ops


def test_layer_argument_errors(interpret: None) -> None:
    cfg = VattnConfig()
    spec = MLASpec(context_lens=(), query_lens=())
    good = nn.Linear(32, 4 * 32, bias=False)
    args = (4, spec.scale, 16, 16, 16, None, 32)
    with vattn.set_current_vattn_config(cfg):
        with pytest.raises(ValueError, match=r"kv_b_proj.weight: expected a .* = \(128, 32\) tensor, got \(64, 32\)"):
            MLAAttention(*args, nn.Linear(32, 64, bias=False), prefix="e.0")
        with pytest.raises(ValueError, match="kv_b_proj: expected no bias"):
            MLAAttention(*args, nn.Linear(32, 128), prefix="e.1")
        with pytest.raises(ValueError, match="kv_lora_rank: expected a positive int"):
            MLAAttention(4, spec.scale, 16, 16, 16, None, 0, good, prefix="e.2")
        with pytest.raises(ValueError, match="prefix must be a unique non-empty"):
            MLAAttention(*args, good)
        with pytest.raises(ValueError, match="TORCH_SDPA cannot serve this MLA layer: MLA not supported"):
            MLAAttention(*args, good, prefix="e.3", attn_backend="TORCH_SDPA")
        layer = MLAAttention(*args, good, prefix="e.4")
        with pytest.raises(ValueError, match="Duplicate layer name"):
            MLAAttention(*args, good, prefix="e.4")
    with pytest.raises(ValueError, match=r"e.4: kv_c_normed: expected \(T, kv_lora_rank = 32\)"):
        layer._check_inputs(torch.randn(3, 128), torch.randn(3, 30), torch.randn(3, 16))
    with pytest.raises(ValueError, match=r"e.4: k_pe: expected 3 tokens"):
        layer._check_inputs(torch.randn(3, 128), torch.randn(3, 32), torch.randn(2, 16))
    with pytest.raises(ValueError, match=r"e.4: q: expected last dim num_heads"):
        layer._check_inputs(torch.randn(3, 100), torch.randn(3, 32), torch.randn(3, 16))


# ---- backends that cannot serve, and selection ---------------------------------------------------


@pytest.mark.parametrize("member,library", [(B.FLASHMLA, "flash_mla"), (B.FLASHMLA_SPARSE, "flash_mla"),
                                            (B.CUTLASS_MLA, "vllm._C")])
def test_unservable_backends_say_why(member: B, library: str) -> None:
    cls = member.get_class()
    ok, why = cls.is_available()
    assert not ok and why.startswith(member.name) and library in why and "cannot install" in why
    assert "TRITON_MLA" in why  # what to use instead
    assert cls.supports_mla and cls.get_cudagraph_support() == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    with pytest.raises(NotImplementedError, match=library.split(".")[0]):
        cls.get_impl_cls()(16, 576, 0.1, 1)
    assert cls.validate_configuration(576, torch.bfloat16, "auto", 64, use_mla=True) == [why]


def test_triton_mla_selected_under_the_interpreter_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import vattn.selector as selector

    monkeypatch.setattr(selector, "current_platform", vattn.platform.CpuPlatform())
    selector._cached_get_attn_backend.cache_clear()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_MLA: TRITON_MLA needs a CUDA GPU, or TRITON_INTERPRET=1"):
        vattn.get_attn_backend(48, torch.float32, "auto", 16, use_mla=True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert vattn.get_attn_backend(48, torch.float32, "auto", 16, use_mla=True).get_name() == "TRITON_MLA"
    selector._cached_get_attn_backend.cache_clear()


def test_importing_mla_backends_imports_no_kernel_library() -> None:
    import subprocess

    code = ("import sys, vattn.mla_layer, vattn.backends.mla.flashinfer_mla, vattn.backends.mla.flashattn_mla, "
            "vattn.backends.mla.triton_mla, vattn.backends.mla.flashmla, vattn.backends.mla.cutlass_mla\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('triton', 'flashinfer', 'flash_attn', "
            "'flash_attn_interface', 'flash_mla', 'vllm')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---- GPU ------------------------------------------------------------------------------------------

DEEPSEEK = dict(num_heads=16, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                dtype=torch.bfloat16)
GPU_CASES = [
    pytest.param(dict(context_lens=(0, 37, 100, 5, 64, 0, 300), query_lens=(1, 1, 1, 1, 23, 40, 17)), id="mixed"),
    pytest.param(dict(context_lens=(15, 16, 17, 3000, 1), query_lens=(1, 1, 1, 1, 1), num_pad_tokens=3), id="decode"),
    pytest.param(dict(context_lens=(0, 0, 33), query_lens=(70, 5, 17)), id="prefill"),
    pytest.param(dict(context_lens=(0, 37, 100, 5), query_lens=(1, 1, 30, 9), block_size=64), id="block64"),
    pytest.param(dict(context_lens=(0, 1000), query_lens=(1, 300), num_heads=128), id="heads128"),
]


def _gpu_check(backend: str, case: dict, chunk: int | None = 64, factor: float = 2.0) -> None:
    spec = MLASpec(**{**DEEPSEEK, **case}, device="cuda")
    batch = make_mla_batch(spec, seed=13)
    cls = B[backend].get_class()
    cfg = VattnConfig()
    with vattn.set_current_vattn_config(cfg), default_dtype(spec.dtype):
        layer = MLAAttention(spec.num_heads, spec.scale, spec.qk_nope_head_dim, spec.qk_rope_head_dim,
                             spec.v_head_dim, None, spec.kv_lora_rank, batch.kv_b_proj, prefix="g.mla",
                             attn_backend=cls, cache_config=vattn.CacheConfig(block_size=spec.block_size,
                                                                              cache_dtype=spec.kv_cache_dtype))
        builder = cls.get_builder_cls()(spec.kv_spec(), ["g.mla"], cfg, torch.device("cuda"))
    if chunk is not None:
        builder.prefill_chunk_tokens = chunk
    batch.layer._k_scale.fill_(spec.kv_scale)
    md = builder.build(0, batch.common)
    out = torch.zeros(batch.q.shape[0], spec.num_heads, spec.v_head_dim, dtype=spec.dtype, device="cuda")
    before = batch.kv_cache.clone()
    layer.impl.forward(batch.layer, batch.q, batch.kv_c, batch.k_pe, batch.kv_cache, md, output=out)
    torch.cuda.synchronize()
    n = batch.num_actual_tokens
    assert_close(out[:n], batch.reference(), spec.dtype, factor=factor)
    check_latent_cache(batch, before)


@pytest.mark.cuda
@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_triton_mla(case: dict) -> None:
    _gpu_check("TRITON_MLA", case)


@pytest.mark.cuda
@pytest.mark.parametrize("kv_dtype", ["fp8", "fp8_e5m2"])
def test_gpu_triton_mla_fp8(kv_dtype: str) -> None:
    _gpu_check("TRITON_MLA", {**GPU_CASES[0].values[0], "kv_cache_dtype": kv_dtype, "kv_scale": 0.02}, factor=4.0)


@pytest.mark.cuda
@pytest.mark.flashinfer
@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_flashinfer_mla(case: dict) -> None:
    _gpu_check("FLASHINFER_MLA", case)


@pytest.mark.cuda
@pytest.mark.flash_attn
@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_flash_attn_mla(case: dict) -> None:
    from vattn.backends.mla.flashattn_mla import get_mla_interface

    iface, why = get_mla_interface()
    if iface is None or iface.decode is None:
        pytest.skip(why)
    _gpu_check("FLASH_ATTN_MLA", case)


def _graph_replays(backend: str, device: str, sizes: tuple[int, ...], sizes_kw: dict, max_ctx: int,
                   num_blocks: int) -> None:
    """Per size (largest first, as the runner captures): capture metadata, then (CUDA) capture the
    decode forward; replay two new padded batches of that size through the same buffers. Each
    matches the eager run of the same unpadded batch (its own split count: the model dtype's
    tolerance) and writes the same latent rows (bit for bit). CPU: no capture, the forward runs
    on the persistent metadata (the bookkeeping a replay relies on)."""
    from vattn.metadata import build_common_attn_metadata

    cls = B[backend].get_class()
    cfg = VattnConfig(compilation=CompilationConfig(cudagraph_mode=vattn.CUDAGraphMode.FULL_DECODE_ONLY,
                                                    cudagraph_capture_sizes=sizes))
    spec = MLASpec(context_lens=(0,), query_lens=(1,), **sizes_kw, device=device)
    with vattn.set_current_vattn_config(cfg):
        proto = make_mla_batch(spec, seed=0)
    with vattn.set_current_vattn_config(cfg), default_dtype(spec.dtype):
        layer = MLAAttention(spec.num_heads, spec.scale, spec.qk_nope_head_dim, spec.qk_rope_head_dim,
                             spec.v_head_dim, None, spec.kv_lora_rank, proto.kv_b_proj, prefix="cg.mla",
                             attn_backend=cls, cache_config=vattn.CacheConfig(block_size=16))
    kv = vattn.allocate_kv_cache(cfg, num_blocks=num_blocks, device=device, dtype=spec.dtype)
    builder = kv.groups[0].builder
    builder.use_persistent_buffers = True
    cache = kv.tensors["cg.mla"]
    width = -(-(max_ctx + 1) // 16)
    g = torch.Generator().manual_seed(1)
    eager_builder = cls.get_builder_cls()(spec.kv_spec(), ["cg.mla"], cfg, torch.device(device))
    eager_builder.use_persistent_buffers = False

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device, spec.dtype)

    for size in sorted(sizes, reverse=True):
        q, kv_c = rnd(size, spec.num_heads, spec.qk_head_dim), rnd(size, spec.kv_lora_rank)
        k_pe, out = rnd(size, spec.qk_rope_head_dim), torch.zeros(size, spec.num_heads, spec.v_head_dim, dtype=spec.dtype,
                                                                   device=device)
        md = builder.build_for_cudagraph_capture(dummy_decode_common(size, width, device))

        def step() -> None:
            layer.impl.forward(layer, q, kv_c, k_pe, cache, md, output=out)

        graph = None
        if device == "cuda":
            for _ in range(2):
                step()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
        for _ in range(2):
            n = int(torch.randint(1, size + 1, (1,), generator=g))
            ctx = [int(c) for c in torch.randint(0, max_ctx, (n,), generator=g)]
            perm, tables, i = torch.randperm(num_blocks - 1, generator=g) + 1, [], 0
            for c in ctx:
                k = -(-(c + 1) // 16)
                tables.append(perm[i : i + k].tolist())
                i += k
            common = build_common_attn_metadata([1] * n, ctx, tables, 16, device=device, num_tokens_padded=size,
                                                num_reqs_padded=size, max_blocks_per_req=width)
            cache.copy_(torch.randn(cache.shape, generator=g).to(device, cache.dtype))
            eager_cache = cache.clone()
            md2 = builder.build(0, common)
            assert md2.decode is not None and md2.decode.cuda_graph and md2.decode.num_decodes == size
            assert [t.data_ptr() for t in (md2.query_start_loc, md2.seq_lens, md2.block_table, md2.slot_mapping)] == \
                [t.data_ptr() for t in (md.query_start_loc, md.seq_lens, md.block_table, md.slot_mapping)]
            for buf, new in ((q, rnd(size, spec.num_heads, spec.qk_head_dim)), (kv_c, rnd(size, spec.kv_lora_rank)),
                             (k_pe, rnd(size, spec.qk_rope_head_dim))):
                buf.copy_(new)
            if graph is not None:
                graph.replay()
                torch.cuda.synchronize()
            else:
                layer.impl.forward(layer, q, kv_c, k_pe, cache, md2, output=out)
            eager_out = torch.zeros_like(out)
            eager_md = eager_builder.build(0, build_common_attn_metadata([1] * n, ctx, tables, 16, device=device))
            layer.impl.forward(layer, q[:n], kv_c[:n], k_pe[:n], eager_cache, eager_md, output=eager_out[:n])
            assert_close(out[:n], eager_out[:n].float(), spec.dtype, factor=2.0)
            assert torch.equal(cache.view(torch.uint8), eager_cache.view(torch.uint8))


def test_graph_bookkeeping_replays_on_cpu(interpret: None) -> None:
    """CPU: the persistent decode metadata of every capture size serves new padded batches."""
    _graph_replays("TRITON_MLA", DEV, (1, 4, 8), {}, max_ctx=40, num_blocks=48)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["TRITON_MLA", pytest.param("FLASHINFER_MLA", marks=pytest.mark.flashinfer),
                                     pytest.param("FLASH_ATTN_MLA", marks=pytest.mark.flash_attn)])
def test_gpu_cuda_graph_replay_equals_eager_at_every_size(backend: str) -> None:
    ok, why = B[backend].get_class().is_available()
    if not ok:
        pytest.skip(why)
    _graph_replays(backend, "cuda", (1, 2, 4, 8, 16, 32, 64), DEEPSEEK, max_ctx=900, num_blocks=64 * 57 + 8)


def test_bench_mla_cpu_smoke(tmp_path) -> None:
    """benchmarks/bench_mla.py --device cpu --quick (TRITON_MLA in the interpreter, the tiny model)."""
    import json
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "OUT": str(tmp_path), "PYTHONPATH": str(root),
           "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "benchmarks/bench_mla.py", "--device", "cpu", "--quick"], cwd=root,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = tmp_path.glob("mla-*.json")
    data = json.loads(path.read_text())
    kernels = [r for r in data["rows"] if "timed" in r]
    assert {(r["phase"], r["timed"]) for r in kernels} == {(p, t) for p in ("decode", "prefill") for t in ("kernel", "layer")}
    assert all(r["backend"] == "TRITON_MLA" and r["ms"] > 0 and r["tbps"] > 0 and r["max_abs_diff"] < 0.05
               for r in kernels), kernels
    assert set(data["summary"]["skipped"]) == {"FLASHINFER_MLA", "FLASH_ATTN_MLA"}
    assert {r["impl"] for r in data["rows"] if "impl" in r} == {"vattn-eager", "hf-eager"}
    assert all("error" not in r for r in data["rows"]) and (tmp_path / data["plots"][0]).exists()


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["TRITON_MLA"])
@pytest.mark.parametrize("bad", ["block_past_cache", "slot_past_cache", "seq_lens_past_table"])
def test_device_metadata_never_faults(backend: str, bad: str) -> None:
    """Hand-built device metadata with a block id or slot past the cache, or a sequence longer than
    its table (host mirrors valid, so no host check sees it): the latent store skips the slot,
    the builder clamps the table, nothing outside the cache is read or written."""
    cls = vattn.AttentionBackendEnum[backend].get_class()
    ok, why = cls.is_available()
    if not ok:
        pytest.skip(why)
    lora, rope, nope, v, heads, bs = 512, 64, 128, 128, 16, 64
    cfg = VattnConfig(cache=vattn.CacheConfig(block_size=bs))
    dev, dt = torch.device("cuda"), torch.bfloat16
    with vattn.set_current_vattn_config(cfg), torch.device(dev):
        kv_b = nn.Linear(lora, heads * (nope + v), bias=False, dtype=dt)
        layer = MLAAttention(heads, (nope + rope) ** -0.5, nope, rope, v, None, lora, kv_b, prefix="g.mla",
                             attn_backend=cls).to(dt)
    kv = vattn.allocate_kv_cache(cfg, num_blocks=4, device=dev, dtype=dt)
    cache = kv.tensors["g.mla"]
    cache.normal_()
    before = cache.clone()
    t32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    table, slots, seq = [[0], [1]], [7, bs + 4], [8, 5]
    if bad == "block_past_cache":
        table = [[0], [1 << 20]]
    if bad == "slot_past_cache":
        slots = [7, 1 << 40]
    seq_dev = t32([8, 1 << 20] if bad == "seq_lens_past_table" else seq)
    cm = vattn.CommonAttentionMetadata(
        query_start_loc=t32([0, 1, 2]).to(dev), query_start_loc_cpu=t32([0, 1, 2]), seq_lens=seq_dev.to(dev),
        seq_lens_cpu=t32(seq), num_computed_tokens_cpu=t32([7, 4]), num_reqs=2, num_actual_tokens=2,
        max_query_len=1, max_seq_len=8, block_table_tensor=t32(table).to(dev),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev))
    q = torch.randn(2, heads * (nope + rope), device=dev, dtype=dt)
    with vattn.set_forward_context(kv.build_metadata(cm), cfg), torch.no_grad():
        out = layer(q, torch.randn(2, lora, device=dev, dtype=dt), torch.randn(2, rope, device=dev, dtype=dt))
    torch.cuda.synchronize()
    assert out[0].isfinite().all()
    written = torch.zeros(cache.shape[:2], dtype=torch.bool, device=dev)
    written[0, 7] = True
    if bad != "slot_past_cache":
        written[1, 4] = True
    assert torch.equal(cache[~written].view(torch.int16), before[~written].view(torch.int16))

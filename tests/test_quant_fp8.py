"""fp8: ``QuantFP8`` (plain torch ops vs the opaque ``vattn::static_scaled_fp8_quant`` op vs its
Triton kernel, bit for bit) and fp8 KV caches end to end on the example model.

The end-to-end tests build ``examples.model.DecoderForCausalLM`` (seeded random weights) under
a config with ``cache_dtype="fp8"`` and ``calculate_kv_scales=True`` and decode greedily. Each
decode step is teacher-forced with the float32-KV model's tokens, so every step compares one
argmax; the agreement rate is printed (``pytest -s``) and recorded as a test property.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

import triton_modules
import vattn
from vattn.ops.quant_fp8 import GroupShape, QuantFP8, QuantKey, quantize_fp8_native

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.model import DecoderForCausalLM, ModelConfig, init_random_weights  # noqa: E402

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
HAS_CUDA = torch.cuda.is_available()


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def same_fp8(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, except that any NaN encoding matches any other (NaN payloads carry no value)."""
    a, b = a.cpu(), b.cpu()
    na, nb = a.float().isnan(), b.float().isnan()
    return torch.equal(na, nb) and torch.equal(bits(a)[~na], bits(b)[~nb])


def special_inputs(shape: tuple[int, ...], dtype: torch.dtype, nan: bool = True, seed: int = 0) -> torch.Tensor:
    """Random values over many magnitudes, with +-inf, saturating values, zeros (and a NaN)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-12, 12, shape, generator=g).float())
    flat = x.view(-1)
    flat[:6] = torch.tensor([float("inf"), float("-inf"), 1e9, -1e9, 0.0, -0.0])
    if nan:
        flat[6] = float("nan")
    return x.to(dtype)


# ---- the op and QuantFP8 ------------------------------------------------------------------


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [GroupShape.PER_TENSOR, GroupShape.PER_HEAD])
def test_custom_op_bitwise_equals_native(fp8: torch.dtype, x_dtype: torch.dtype, group: GroupShape) -> None:
    x = special_inputs((9, 4 * 16), x_dtype)
    scale = torch.tensor(0.173) if group is GroupShape.PER_TENSOR else torch.tensor([0.01, 0.5, 3.0, 0.173])
    native = QuantFP8(group_shape=group, dtype=fp8, num_heads=4, use_custom_op=False)
    opaque = QuantFP8(group_shape=group, dtype=fp8, num_heads=4)
    want, s1 = native(x, scale)
    got, s2 = opaque(x, scale)
    assert got.dtype == want.dtype == fp8 and got.shape == x.shape and s1 is s2 is scale
    assert torch.equal(bits(got), bits(want))
    # the definition: saturate(x / scale) rounded to nearest even (through float32)
    groups = 1 if group is GroupShape.PER_TENSOR else 4
    ref = (x.float().view(9, groups, -1) / scale.view(1, -1, 1)).clamp(torch.finfo(fp8).min, torch.finfo(fp8).max)
    ref = ref.to(fp8).view(9, 64)
    assert torch.equal(bits(got), bits(ref))


def test_custom_op_strided_and_3d_inputs() -> None:
    qkv = torch.randn(7, 96)
    q = qkv[:, :64]  # a non-contiguous q split of a fused QKV projection
    s = torch.tensor(0.02)
    out = torch.empty(q.shape, dtype=torch.float8_e4m3fn)
    torch.ops.vattn.static_scaled_fp8_quant(out, q, s)
    assert torch.equal(bits(out), bits(quantize_fp8_native(q, s, torch.float8_e4m3fn)))
    q3 = q.view(7, 4, 16)
    out3 = torch.empty(q3.shape, dtype=torch.float8_e5m2)
    torch.ops.vattn.static_scaled_fp8_quant(out3, q3, torch.rand(4) + 0.1)


def test_custom_op_opcheck_and_graph() -> None:
    x, s = torch.randn(5, 32), torch.tensor(0.05)
    out = torch.empty(5, 32, dtype=torch.float8_e4m3fn)
    # (test_schema is left out: its checker multiplies outputs, which torch has no fp8 kernel for)
    torch.library.opcheck(torch.ops.vattn.static_scaled_fp8_quant.default, (out, x, s),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic", "test_autograd_registration"))
    for use_op, present in ((True, True), (False, False)):
        gm = torch.fx.experimental.proxy_tensor.make_fx(QuantFP8(use_custom_op=use_op))(x, s)
        targets = {n.target for n in gm.graph.nodes}
        assert (torch.ops.vattn.static_scaled_fp8_quant.default in targets) is present
        assert (torch.ops.aten.clamp.default in targets) is not present


def test_quant_fp8_errors() -> None:
    with pytest.raises(ValueError, match="float8_e4m3fn or torch.float8_e5m2"):
        QuantFP8(dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="num_heads"):
        QuantFP8(group_shape=GroupShape.PER_HEAD)
    with pytest.raises(NotImplementedError, match="static=True"):
        QuantFP8(static=False)
    with pytest.raises(ValueError, match="scale must have 1 element"):
        QuantFP8()(torch.randn(2, 8), torch.ones(2))
    with pytest.raises(ValueError, match="out must have x's shape"):
        torch.ops.vattn.static_scaled_fp8_quant(torch.empty(2, 4, dtype=torch.float8_e4m3fn), torch.randn(2, 8),
                                                torch.tensor(1.0))
    with pytest.raises(ValueError, match="out.dtype"):
        torch.ops.vattn.static_scaled_fp8_quant(torch.empty(2, 8), torch.randn(2, 8), torch.tensor(1.0))
    assert QuantFP8(dtype=torch.float8_e5m2).quant_key == QuantKey(torch.float8_e5m2)


# ---- the Triton kernel ----------------------------------------------------------------------

_TRITON_MODS = ("vattn.kernels.fp8", "vattn.kernels.quant_fp8", "vattn.backends.triton.kernels",
                "vattn.kernels.kv_store", "vattn.backends.triton.paged_attention")


def _load_triton_quant() -> ModuleType:
    """The quant kernel's module; on CPU every vattn Triton module is (re)built for the Triton
    interpreter (``triton_modules.load``)."""
    pytest.importorskip("triton")
    return triton_modules.load(_TRITON_MODS)[_TRITON_MODS[1]]


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("per_head", [False, True])
def test_triton_kernel_bitwise_equals_native(fp8: torch.dtype, per_head: bool) -> None:
    """On CPU the interpreter (whose fp8 cast mis-handles NaN, so no NaN here); on CUDA the real kernel."""
    tq = _load_triton_quant()
    dev = "cuda" if HAS_CUDA else "cpu"
    for x in (special_inputs((5, 64), torch.bfloat16, nan=HAS_CUDA), special_inputs((3, 160), torch.float32, nan=HAS_CUDA)[:, 16:144]):
        x = x.to(dev)
        scale = (torch.rand(4) + 0.05 if per_head else torch.tensor(0.37)).to(dev)
        out = torch.empty(x.shape, dtype=fp8, device=dev)
        tq.triton_static_fp8_quant(out, x, scale)
        assert same_fp8(out, quantize_fp8_native(x, scale, fp8))
    out_t = torch.empty(64, 5, dtype=fp8, device=dev).t()  # a non-contiguous out is staged
    x = torch.randn(5, 64, device=dev)
    tq.triton_static_fp8_quant(out_t, x, torch.tensor(0.1, device=dev))
    assert same_fp8(out_t.contiguous(), quantize_fp8_native(x, torch.tensor(0.1, device=dev), fp8))


@pytest.mark.cuda
def test_cuda_op_uses_kernel_and_matches_native_large() -> None:
    x = special_inputs((4096, 2048), torch.bfloat16).cuda()
    s = torch.tensor(0.03, device="cuda")
    q = QuantFP8()
    got, _ = q(x, s)
    want = quantize_fp8_native(x, s, torch.float8_e4m3fn)
    assert same_fp8(got, want)
    g = torch.cuda.CUDAGraph()  # no host sync inside: capturable
    with torch.cuda.graph(g):
        got2, _ = q(x, s)
    g.replay()
    torch.cuda.synchronize()
    assert same_fp8(got2, want)


# ---- fp8 KV caches end to end on the example model --------------------------------------------

MODEL = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
BLOCKS_PER_REQ = 8


def build_model(cache_dtype: str, backend: str | None, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
                seed: int = 0, model: ModelConfig = MODEL, block_size: int = 8
                ) -> tuple[DecoderForCausalLM, vattn.VattnConfig, vattn.PagedKVCache]:
    """The example model (seeded weights) with a KV cache of ``cache_dtype`` (fp8: scales from the first batch)."""
    fp8 = cache_dtype.startswith("fp8")
    cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=block_size, cache_dtype=cache_dtype,
                                                    calculate_kv_scales=fp8))
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with vattn.set_current_vattn_config(cfg), torch.device(device):
            m = DecoderForCausalLM(model, attn_backend=backend).eval()
    finally:
        torch.set_default_dtype(old)
    init_random_weights(m, seed=seed)
    kv = vattn.allocate_kv_cache(cfg, num_blocks=1 + 16 * BLOCKS_PER_REQ, device=device, dtype=dtype)
    return m, cfg, kv


@torch.no_grad()
def greedy(model: torch.nn.Module, cfg: vattn.VattnConfig, kv: vattn.PagedKVCache, prompts: list[list[int]],
           steps: int, teacher: torch.Tensor | None = None, forward: object = None) -> torch.Tensor:
    """(B, steps) greedy tokens: one batched prefill, then decode steps of one token per request.

    ``teacher`` (B, steps): feed its tokens instead of our own (so every step is comparable).
    """
    fwd = forward or model
    b = len(prompts)
    tables = [list(range(1 + i * BLOCKS_PER_REQ, 1 + (i + 1) * BLOCKS_PER_REQ)) for i in range(b)]
    lens = [len(p) for p in prompts]
    dev = kv.tensors[next(iter(kv.tensors))].device
    ids = torch.tensor([t for p in prompts for t in p], device=dev)
    pos = torch.cat([torch.arange(n) for n in lens]).to(dev)
    with vattn.set_forward_context(kv.build_metadata(kv.common_metadata(lens, [0] * b, tables)), cfg):
        hidden = fwd(ids, pos)
    tok = model.compute_logits(hidden[torch.tensor(lens, device=dev).cumsum(0) - 1]).argmax(-1)
    out = [tok]
    for s in range(1, steps):
        ctx = [n + s - 1 for n in lens]
        inp = teacher[:, s - 1].to(dev) if teacher is not None else tok
        with vattn.set_forward_context(kv.build_metadata(kv.common_metadata([1] * b, ctx, tables)), cfg):
            hidden = fwd(inp, torch.tensor(ctx, device=dev))
        tok = model.compute_logits(hidden).argmax(-1)
        out.append(tok)
    return torch.stack(out, 1).cpu()


def prompts(n: int = 8, seed: int = 1, vocab: int = MODEL.vocab_size) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(l),), generator=g).tolist()
            for l in torch.randint(3, 24, (n,), generator=g)]


def check_fp8_layers(model: torch.nn.Module, kv: vattn.PagedKVCache, fp8: torch.dtype) -> None:
    for layer in (m for m in model.modules() if isinstance(m, vattn.Attention)):
        assert not layer.calculate_kv_scales, "scales were not computed from the first batch"
        assert 0 < layer._k_scale_float != 1.0 and 0 < layer._v_scale_float != 1.0
        cache = kv.tensors[layer.layer_name]
        assert cache.dtype in (fp8, torch.uint8) and bool(cache.view(torch.uint8).ne(0).any())


@pytest.mark.parametrize("cache_dtype, fp8, threshold", [
    ("fp8", torch.float8_e4m3fn, 0.9), ("fp8_e5m2", torch.float8_e5m2, 0.75)])
def test_fp8_greedy_tokens_agree_with_fp32_sdpa(cache_dtype: str, fp8: torch.dtype, threshold: float,
                                               record_property: object) -> None:
    """16 greedy steps, TORCH_SDPA (reads q in the model dtype, dequantizes the fp8 cache)."""
    ps = prompts()
    ref = greedy(*build_model("auto", "TORCH_SDPA"), ps, 16)
    model, cfg, kv = build_model(cache_dtype, "TORCH_SDPA")
    got = greedy(model, cfg, kv, ps, 16, teacher=ref)
    check_fp8_layers(model, kv, fp8)
    rate = float((got == ref).float().mean())
    record_property("agreement_rate", rate)  # type: ignore[operator]
    print(f"\nfp8 greedy agreement ({cache_dtype}, TORCH_SDPA, 8 requests x 16 steps): {rate:.3f}")
    assert rate >= threshold


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-interpreter test; its cuda variant runs the real kernels")
def test_fp8_example_model_triton_attn_interpreter(monkeypatch: pytest.MonkeyPatch, record_property: object) -> None:
    """TRITON_ATTN (Triton interpreter, tiny): fp8 q through QuantFP8's op, fp8 cache; 4 greedy steps."""
    pytest.importorskip("triton")
    _load_triton_quant()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ps = prompts(n=3)
    ref = greedy(*build_model("auto", "TORCH_SDPA"), ps, 4)
    model, cfg, kv = build_model("fp8", "TRITON_ATTN")
    layer = model.model.layers[0].self_attn.attn
    assert layer.query_quant is not None and layer.query_quant.use_custom_op
    got = greedy(model, cfg, kv, ps, 4, teacher=ref)
    check_fp8_layers(model, kv, torch.float8_e4m3fn)
    assert layer._q_scale_float != 1.0
    rate = float((got == ref).float().mean())
    record_property("agreement_rate", rate)  # type: ignore[operator]
    print(f"\nfp8 greedy agreement (fp8, TRITON_ATTN interpreter, 3 requests x 4 steps): {rate:.3f}")
    assert rate >= 0.9


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["TRITON_ATTN", pytest.param("FLASHINFER", marks=pytest.mark.flashinfer)])
def test_cuda_fp8_greedy_agreement_and_compiled_passes(backend: str, record_property: object) -> None:
    """bf16 model on the GPU: fp8 KV vs bf16 KV over 16 steps; then vattn.compile with the fp8
    passes gives the eager fp8 tokens."""
    import dataclasses

    mc = dataclasses.replace(MODEL, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                             intermediate_size=512)
    ps = prompts(n=8, vocab=mc.vocab_size)
    ref = greedy(*build_model("auto", backend, device="cuda", dtype=torch.bfloat16, model=mc, block_size=16), ps, 16)
    model, cfg, kv = build_model("fp8", backend, device="cuda", dtype=torch.bfloat16, model=mc, block_size=16)
    eager = greedy(model, cfg, kv, ps, 16, teacher=ref)
    rate = float((eager == ref).float().mean())
    record_property("agreement_rate", rate)  # type: ignore[operator]
    print(f"\nfp8 greedy agreement (fp8, {backend}, bf16, 8 x 16 steps): {rate:.3f}")
    assert rate >= 0.85

    passes = ("noop_elimination", "query_quant_fusion", "defunctionalize")
    cfg2 = dataclasses.replace(cfg, compilation=dataclasses.replace(cfg.compilation, passes=passes))
    compiled = vattn.compile(model, cfg2)
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        got = greedy(model, cfg2, kv, ps, 16, teacher=ref, forward=compiled)  # caches off: the passes run
    assert float((got == eager).float().mean()) >= 0.95
    if backend == "TRITON_ATTN":
        assert compiled.backend.pass_manager.matches["query_quant_fusion"] >= 1

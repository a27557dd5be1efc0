"""The fp8 fusion passes: graphs before and after, match counts, numerics, and in Inductor.

Graph tests trace a tiny attention block with AOTAutograd and Inductor's decompositions (the
graph Inductor's post-grad custom pass receives), run the passes on it and execute the
rewritten graph eagerly. ``REF_FP8`` is a test backend (registered as ``CUSTOM``) that takes
fp8 queries and writes fp8 output with ``output_scale``, in torch; TRITON_ATTN runs in the
Triton interpreter for the output-quant fusion. The Inductor tests compile with
``vattn.compile`` and count the kernels in the generated code.

Run with ``-s`` to see the op lists before and after each pass.
"""

from __future__ import annotations

import dataclasses
import operator
import re
from typing import Any, Callable, Iterator, Sequence

import pytest
import torch
from torch import nn

import vattn
from vattn.core.registry import AttentionBackendEnum, register_backend
from vattn.backends.torch_sdpa import TorchSDPABackend, TorchSDPAImpl
from vattn.compile_passes.pass_manager import PostGradPassManager, get_pass_class
from vattn.ops.quant_fp8 import FP8_DTYPES, GroupShape, QuantFP8, quantize_fp8_native

aten = torch.ops.aten
H, NH, NKV, D, VOCAB = 32, 2, 1, 16, 64
E4M3 = torch.float8_e4m3fn


@pytest.fixture(autouse=True, scope="module")
def _setup() -> Iterator[None]:
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    register_backend(AttentionBackendEnum.CUSTOM, f"{__name__}.RefFP8Backend")
    yield
    AttentionBackendEnum.CUSTOM.clear_override()
    torch.set_num_threads(old)


# ---- a backend with fp8 query input and fp8 output, in torch ------------------------------


class RefFP8Impl(TorchSDPAImpl):
    """TORCH_SDPA plus fp8 queries (dequantized with the layer's q scale) and ``output_scale``."""

    def fused_output_quant_supported(self, quant_key: Any) -> bool:
        return quant_key.dtype in FP8_DTYPES and quant_key.static and quant_key.group_shape is GroupShape.PER_TENSOR

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None, output_scale=None):  # type: ignore[no-untyped-def,override]
        if query.dtype in FP8_DTYPES:
            query = (query.float() * layer._q_scale).to(layer.dtype)
        if output_scale is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output)
        tmp = torch.zeros(output.shape, dtype=layer.dtype, device=output.device)
        super().forward(layer, query, key, value, kv_cache, attn_metadata, tmp)
        n = attn_metadata.num_actual_tokens
        output[:n] = quantize_fp8_native(tmp[:n], output_scale, output.dtype)
        return output


class RefFP8Backend(TorchSDPABackend):
    supports_quant_query_input = True
    supports_output_quant = True

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[RefFP8Impl]:
        return RefFP8Impl


# ---- the model -----------------------------------------------------------------------------


class Block(nn.Module):
    """QKV projection, a RoPE-like position scaling, fp8-cache attention, an optional static fp8
    quantization of the attention output (``"native"`` QuantFP8 ops or the ``"op"``) and its
    dequantization before the output projection (what an fp8 o_proj does)."""

    def __init__(self, i: int, backend: str, out_quant: str | None, out_dtype: torch.dtype = E4M3) -> None:
        super().__init__()
        self.qkv = nn.Linear(H, (NH + 2 * NKV) * D, bias=False)
        self.o = nn.Linear(NH * D, H, bias=False)
        self.attn = vattn.Attention(NH, D, D**-0.5, num_kv_heads=NKV, prefix=f"blocks.{i}.attn",
                                    attn_backend=backend)
        self.attn.set_kv_scales(0.02, 0.02, q_scale=0.01)
        self.out_quant = None if out_quant is None else QuantFP8(dtype=out_dtype, use_custom_op=out_quant == "op")
        self.register_buffer("o_scale", torch.tensor(0.004, dtype=torch.float32))

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split([NH * D, NKV * D, NKV * D], dim=-1)
        rot = torch.cos(positions[:, None].to(x.dtype) * 0.1)
        a = self.attn(q * rot, k * rot, v)
        if self.out_quant is not None:
            a8, _ = self.out_quant(a, self.o_scale)
            a = a8.to(x.dtype) * self.o_scale
        return x + self.o(a)


class Net(nn.Module):
    def __init__(self, n: int, backend: str, out_quant: str | None, out_dtype: torch.dtype = E4M3) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, H)
        self.blocks = nn.ModuleList(Block(i, backend, out_quant, out_dtype) for i in range(n))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for b in self.blocks:
            x = b(positions, x)
        return x


@dataclasses.dataclass
class Setup:
    net: Net
    cfg: vattn.VattnConfig
    kv: vattn.PagedKVCache
    ids: torch.Tensor
    positions: torch.Tensor
    common: vattn.CommonAttentionMetadata

    def run(self, fn: Callable[..., torch.Tensor] | None = None, cfg: vattn.VattnConfig | None = None) -> torch.Tensor:
        with vattn.set_forward_context(self.kv.build_metadata(self.common), cfg or self.cfg), torch.no_grad():
            return (fn if fn is not None else self.net)(self.ids, self.positions)


def make(backend: str = "CUSTOM", out_quant: str | None = None, *, n: int = 1, out_dtype: torch.dtype = E4M3,
         device: str = "cpu", dtype: torch.dtype = torch.float32, **compilation: Any) -> Setup:
    """A seeded ``Net`` of ``n`` blocks on an fp8 cache, and one mixed batch (2 decodes, a prefill)."""
    cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=8, cache_dtype="fp8"),
                            compilation=vattn.CompilationConfig(**compilation))
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with vattn.set_current_vattn_config(cfg), torch.device(device):
            net = Net(n, backend, out_quant, out_dtype).eval()
    finally:
        torch.set_default_dtype(old)
    kv = vattn.allocate_kv_cache(cfg, num_blocks=16, device=device, dtype=dtype)
    common = kv.common_metadata([1, 1, 5], [9, 3, 0], [[1, 2], [3], [4]])
    ids = torch.randint(0, VOCAB, (7,), generator=torch.Generator().manual_seed(1)).to(device)
    return Setup(net, cfg, kv, ids, torch.tensor([9, 3, 0, 1, 2, 3, 4], device=device), common)


def with_passes(cfg: vattn.VattnConfig, passes: Sequence[str], **compilation: Any) -> vattn.VattnConfig:
    """The same config (same layers) with other passes."""
    return dataclasses.replace(cfg, compilation=dataclasses.replace(cfg.compilation, passes=tuple(passes),
                                                                    **compilation))


# ---- graph helpers -------------------------------------------------------------------------


def op_name(n: torch.fx.Node) -> str | None:
    """A readable op name for the op lists (None for getitem and pure view nodes)."""
    from torch._higher_order_ops.auto_functionalize import auto_functionalized_v2

    if n.op != "call_function" or n.target is operator.getitem:
        return None
    t = n.target
    if t is auto_functionalized_v2:
        return f"auto_functionalized_v2({n.args[0]._schema.name})"
    if isinstance(t, torch._ops.OpOverload):
        if t.is_view or t._schema.name.startswith("aten::_assert"):
            return None
        name = t._schema.name.replace("aten::", "").replace("prims::", "")
        if name == "convert_element_type":
            name += f"({str(n.args[1]).replace('torch.', '')})"
        if t._schema.name.startswith("vattn::unified_attention") and "output_scale" in n.kwargs:
            name += "(output_scale)" if n.kwargs["output_scale"] is not None else ""
        return name
    return str(t)


def op_list(g: torch.fx.Graph) -> list[str]:
    return [s for s in (op_name(n) for n in g.nodes) if s is not None]


def count(ops: list[str], needle: str) -> int:
    return sum(needle in o for o in ops)


class Traced:
    """The model's forward graph as the post-grad custom pass sees it, with ``passes`` applied."""

    def __init__(self, s: Setup, passes: Sequence[Any]) -> None:
        from torch._dynamo.backends.common import aot_autograd
        from torch._inductor.decomposition import select_decomp_table

        self.pm = PostGradPassManager(list(passes))
        self.before: list[str] = []
        self.after: list[str] = []

        def fw(gm: torch.fx.GraphModule, _inputs: Any) -> torch.fx.GraphModule:
            self.before = op_list(gm.graph)
            self.pm(gm.graph)
            gm.graph.eliminate_dead_code()
            gm.graph.lint()
            gm.recompile()
            self.after = op_list(gm.graph)
            self.graph = gm.graph
            return gm

        torch._dynamo.reset()
        backend = aot_autograd(fw_compiler=fw, decompositions=select_decomp_table())
        self.fn = torch.compile(s.net, backend=backend, fullgraph=True, dynamic=False)
        self.out = s.run(self.fn)

    def show(self, title: str) -> None:
        print(f"\n[{title}] matches {self.pm.matches}\n  before: {self.before}\n  after:  {self.after}")


def p(name: str, config: vattn.VattnConfig | None = None, **options: Any) -> Any:
    return get_pass_class(name)(config, **options)


QOP = "vattn::static_scaled_fp8_quant"
ATTN = "vattn::unified_attention_with_output"


def fp8_close(got: torch.Tensor, want: torch.Tensor, rel: float = 0.0625) -> None:
    """Within fp8 (e4m3: 2**-4 relative step) of the unfused result, relative to its magnitude."""
    err = (got - want).abs().max().item()
    assert err <= rel * want.abs().max().item() + 1e-6, f"max abs error {err} vs scale {want.abs().max().item()}"


# ---- query-quant fusion --------------------------------------------------------------------


def test_query_quant_decomposed_into_producer_ops() -> None:
    s = make("CUSTOM")
    want = s.run()
    t = Traced(s, [p("query_quant_fusion", s.cfg)])
    t.show("query_quant_fusion, attention in the graph")
    assert count(t.before, QOP) == 1 and count(t.after, QOP) == 0
    assert t.pm.matches == {"query_quant_fusion": 1}
    assert count(t.after, "convert_element_type(float8_e4m3fn)") == 1
    assert count(t.after, "clamp_min") == 1 and count(t.after, "clamp_max") == 1
    assert count(t.after, ATTN) == 1
    (attn,) = [n for n in t.graph.nodes if ATTN in (op_name(n) or "")]
    assert attn.kwargs["query"].meta["val"].dtype == E4M3  # the attention still reads fp8 q
    torch.testing.assert_close(t.out, want, rtol=0, atol=0)  # bitwise: the same ops as the opaque op


def test_query_quant_folded_into_attention() -> None:
    s = make("CUSTOM")
    want = s.run()
    qp = p("query_quant_fusion", s.cfg, fold_backends=["CUSTOM"])
    t = Traced(s, [qp])
    t.show("query_quant_fusion, fold_backends=['CUSTOM']")
    assert t.pm.matches == {"query_quant_fusion": 1} and qp.folded == 1
    assert count(t.after, QOP) == 0 and count(t.after, "float8") == 0  # no quantization of q at all
    (attn,) = [n for n in t.graph.nodes if ATTN in (op_name(n) or "")]
    assert attn.kwargs["query"].meta["val"].dtype == torch.float32
    fp8_close(t.out, want)


def test_query_quant_in_a_split_piece_and_non_matches() -> None:
    """Under vattn.compile's split the quantized q leaves the piece (to the attention op)."""
    def piece(x: torch.Tensor, scale: torch.Tensor, head_scales: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q8, _ = QuantFP8()(x * 2, scale)
        qh, _ = QuantFP8(group_shape=GroupShape.PER_HEAD, num_heads=2)(x * 3, head_scales)  # per head
        other, _ = QuantFP8()(x + 1, scale)  # consumed inside the graph: not a query
        return q8.view(-1, 2, 16), qh, other.float().sum()

    def functional(fn: Callable[..., Any], *args: Any) -> torch.fx.GraphModule:
        from torch._functorch.aot_autograd import aot_function
        from torch._inductor.decomposition import select_decomp_table

        out: dict[str, torch.fx.GraphModule] = {}

        def grab(g: torch.fx.GraphModule, _: Any) -> torch.fx.GraphModule:
            out["gm"] = g
            return g

        with torch.no_grad():
            aot_function(fn, fw_compiler=grab, decompositions=select_decomp_table())(*args)
        return out["gm"]

    args = (torch.randn(5, 32), torch.tensor(0.1), torch.tensor([0.05, 0.2]))
    for graph_outputs, matches in ((True, 2), (False, 0)):
        gm = functional(piece, *args)
        assert count(op_list(gm.graph), QOP) == 3
        qp = p("query_quant_fusion", None, match_graph_outputs=graph_outputs)
        assert qp(gm.graph) == matches
        gm.recompile()
        assert count(op_list(gm.graph), QOP) == 3 - matches
        got, want = gm(*args), piece(*args)
        assert all(torch.equal(g.view(torch.uint8), w.view(torch.uint8)) for g, w in zip(got[:2], want[:2]))
        assert torch.equal(got[2], want[2])


def test_query_quant_after_defunctionalize() -> None:
    """The pass also matches the direct (defunctionalized) calls."""
    s = make("CUSTOM")
    want = s.run()
    t = Traced(s, [p("defunctionalize"), p("query_quant_fusion", s.cfg)])
    assert t.pm.matches == {"defunctionalize": 2, "query_quant_fusion": 1}
    assert count(t.after, QOP) == 0 and count(t.after, "auto_functionalized") == 0
    torch.testing.assert_close(t.out, want, rtol=0, atol=0)


def test_rope_rows_on_an_fp8_query_layer() -> None:
    """A layer that quantizes its query takes ``rope=(cos, sin)`` by rotating q and k before the
    quantization (``vattn.ops.rotary.rope_args``): output and fp8 cache equal to the same layer
    over q / k rotated first, on a mixed batch; bad rows are refused before anything is written."""
    from vattn.ops.rotary import apply_rotary

    s = make(n=2)
    plain, rope = (b.attn for b in s.net.blocks)
    assert plain.query_quant is not None and rope.query_quant is not None
    g = torch.Generator().manual_seed(3)
    t = s.ids.shape[0]
    q, k, v = torch.randn(t, NH * D, generator=g), torch.randn(t, NKV * D, generator=g), torch.randn(t, NKV * D, generator=g)
    angle = torch.rand(t, D // 2, generator=g) * 30
    cos, sin = torch.cat((angle, angle), -1).cos(), torch.cat((angle, angle), -1).sin()
    with vattn.set_forward_context(s.kv.build_metadata(s.common), s.cfg), torch.no_grad():
        want = plain(apply_rotary(q.view(t, NH, D), cos, sin), apply_rotary(k.view(t, NKV, D), cos, sin), v)
        got = rope(q, k, v, rope=(cos, sin))
        same_cache = torch.equal(rope.kv_cache[0].view(torch.uint8), plain.kv_cache[0].view(torch.uint8))
        unrotated = plain(q, k, v)
        before = rope.kv_cache[0].clone()
        with pytest.raises(ValueError, match=r"blocks\.1\.attn: rope_sin must be \(T >= 7, head_size = 16\)"):
            rope(q, k, v, rope=(cos, sin[:, :8]))
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert not torch.allclose(got, unrotated, atol=1e-2)  # the rows took effect
    assert same_cache
    assert torch.equal(rope.kv_cache[0].view(torch.uint8), before.view(torch.uint8))


# ---- attention + output-quant fusion -------------------------------------------------------


@pytest.mark.parametrize("out_quant", ["native", "op"])
@pytest.mark.parametrize("defunc_first", [False, True])
def test_attn_output_quant_fused(out_quant: str, defunc_first: bool) -> None:
    s = make("CUSTOM", out_quant)
    want = s.run()
    passes = [p("defunctionalize")] if defunc_first else []
    passes += [p("query_quant_fusion", s.cfg), p("attn_quant_fusion", s.cfg)]
    t = Traced(s, passes)
    t.show(f"attn_quant_fusion ({out_quant} quant{', after defunctionalize' if defunc_first else ''})")
    assert t.pm.matches["attn_quant_fusion"] == 1 and t.pm.matches["query_quant_fusion"] == 1
    assert count(t.before, QOP) == (2 if out_quant == "op" else 1)
    assert count(t.after, QOP) == 0 and count(t.after, "clamp") == 2  # only q's (fused into its producer)
    assert count(t.after, f"{ATTN}(output_scale)") == 1
    (attn,) = [n for n in t.graph.nodes if ATTN in (op_name(n) or "")]
    assert attn.kwargs["output"].meta["val"].dtype == E4M3
    fp8_close(t.out, want)


def test_attn_output_quant_not_fused() -> None:
    # a backend without fp8 output: nothing changes
    s = make("TORCH_SDPA", "native")
    t = Traced(s, [p("attn_quant_fusion", s.cfg)])
    assert t.pm.matches == {"attn_quant_fusion": 0} and t.before == t.after
    # the bf16/fp32 output is also read elsewhere: must stay
    s = make("CUSTOM", "native")
    blk = s.net.blocks[0]
    blk.forward = lambda positions, x: _two_uses(blk, positions, x)  # type: ignore[method-assign]
    t = Traced(s, [p("attn_quant_fusion", s.cfg)])
    assert t.pm.matches == {"attn_quant_fusion": 0}


def _two_uses(blk: Block, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    q, k, v = blk.qkv(x).split([NH * D, NKV * D, NKV * D], dim=-1)
    a = blk.attn(q, k, v)
    a8, _ = QuantFP8(use_custom_op=False)(a, blk.o_scale)
    return x + blk.o(a8.to(x.dtype) * blk.o_scale) + a.sum()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-interpreter test; its cuda variant runs the real kernels")
def test_attn_output_quant_fused_triton_attn_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """TRITON_ATTN writes the fp8 output itself (Triton interpreter, tiny shapes)."""
    pytest.importorskip("triton")
    from test_quant_fp8 import _load_triton_quant

    _load_triton_quant()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    s = make("TRITON_ATTN", "native", out_dtype=torch.float8_e5m2)
    want = s.run()
    t = Traced(s, [p("query_quant_fusion", s.cfg), p("attn_quant_fusion", s.cfg)])
    t.show("TRITON_ATTN (interpreter): query_quant_fusion + attn_quant_fusion, e5m2 output")
    assert t.pm.matches == {"query_quant_fusion": 1, "attn_quant_fusion": 1}
    assert count(t.after, f"{ATTN}(output_scale)") == 1 and count(t.after, QOP) == 0
    fp8_close(t.out, want, rel=0.125)  # e5m2: 2**-3 relative step


# ---- uuid -------------------------------------------------------------------------------------


def test_pass_uuids_change_with_options() -> None:
    q = get_pass_class("query_quant_fusion")
    a = get_pass_class("attn_quant_fusion")
    assert q().uuid() == q().uuid() and a().uuid() == a().uuid()
    assert q().uuid() != q(fold_backends=["TRITON_ATTN"]).uuid() != q(match_graph_outputs=False).uuid()
    assert q(fold_backends=["A", "B"]).uuid() == q(fold_backends=["B", "A"]).uuid()  # a set
    assert q().uuid() != a().uuid()
    pm = PostGradPassManager([q(), a()])
    assert pm.uuid() != PostGradPassManager([q(fold_backends=["CUSTOM"]), a()]).uuid()
    assert pm.uuid() != PostGradPassManager([a(), q()]).uuid()
    # decisions depend on the layers' backends: the same graph for another backend must not hit the cache
    ref, sdpa = make("CUSTOM").cfg, make("TORCH_SDPA").cfg
    assert a(ref).uuid() != a(sdpa).uuid()
    assert q(ref, fold_backends=["CUSTOM"]).uuid() != q(sdpa, fold_backends=["CUSTOM"]).uuid()
    assert q(ref).uuid() == q(sdpa).uuid()  # without folding the backend does not matter


# ---- defunctionalize: copies ------------------------------------------------------------------


def test_defunctionalize_leaves_no_copies() -> None:
    """Before: every functionalized vattn op implies a clone of its mutated buffer (the HOP's
    decomposition); after: in-place calls, no clones and no copy_ epilogues."""
    s = make("CUSTOM", "op", n=2)
    t = Traced(s, [p("defunctionalize")])
    from torch._higher_order_ops.auto_functionalize import auto_functionalized_v2

    implied_before = count(t.before, "auto_functionalized_v2")  # one cloned base each
    copies_after = count(t.after, "clone") + count(t.after, "copy_") + count(t.after, "auto_functionalized")
    assert implied_before == 6 and t.pm.matches == {"defunctionalize": 6} and copies_after == 0
    assert not any(n.target is auto_functionalized_v2 for n in t.graph.nodes)
    torch.testing.assert_close(t.out, s.run(), rtol=0, atol=0)


# ---- in Inductor -----------------------------------------------------------------------------


def inductor_run(s: Setup, cfg: vattn.VattnConfig) -> tuple[torch.Tensor, list[str], Any]:
    """Compile with vattn.compile (caches off, so the passes run) and return (output, kernel
    launches in the generated code, the compiled model)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    compiled = vattn.compile(s.net, cfg)
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        out, codes = run_and_get_code(lambda: s.run(compiled, cfg))
    launches = [m.group(1) for c in codes for m in re.finditer(r"^\s+(cpp_fused_\w+|triton_\w+|torch\.ops\.vattn\.\w+)[.(]",
                                                                c, re.M)]
    return out, launches, compiled


EXTERN_QUANT = "torch.ops.vattn.static_scaled_fp8_quant"
PASSES = ("noop_elimination", "query_quant_fusion", "attn_quant_fusion", "defunctionalize")


def test_inductor_piecewise_query_quant_fuses_into_rope() -> None:
    """Default split: the q quant leaves the compiled piece as fp8, computed inside the RoPE kernel."""
    s = make("CUSTOM", n=2)
    want = s.run()
    off, k_off, _ = inductor_run(s, with_passes(s.cfg, ()))
    on, k_on, compiled = inductor_run(s, with_passes(s.cfg, PASSES))
    print(f"\n[inductor, piecewise] passes off: {k_off}\n[inductor, piecewise] passes on:  {k_on}")
    assert compiled.backend.counter.num_splitting_ops == 2
    assert compiled.backend.pass_manager.matches["query_quant_fusion"] == 2  # one per distinct piece with a q
    assert k_off.count(EXTERN_QUANT) == 2 and not any("quant" in k for k in k_on)
    assert len(k_on) <= len(k_off) - 2  # at least one launch fewer per layer
    torch.testing.assert_close(on, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(off, want, rtol=1e-5, atol=1e-5)


def test_inductor_full_graph_fuses_query_and_output_quant() -> None:
    """splitting_ops=(): the attention op is inside the Inductor graph, so the output quant fuses too."""
    s = make("CUSTOM", "op", splitting_ops=())
    want = s.run()
    off, k_off, _ = inductor_run(s, with_passes(s.cfg, ()))
    on, k_on, compiled = inductor_run(s, with_passes(s.cfg, PASSES))
    print(f"\n[inductor, full graph] passes off: {k_off}\n[inductor, full graph] passes on:  {k_on}")
    assert compiled.backend.pass_manager.matches == {
        "noop_elimination": compiled.backend.pass_manager.matches["noop_elimination"],
        "query_quant_fusion": 1, "attn_quant_fusion": 1, "defunctionalize": 0}
    assert k_off.count(EXTERN_QUANT) == 2 and not any("quant" in k for k in k_on)  # q and output quant
    assert k_on.count("torch.ops.vattn.unified_attention_with_output") == 1
    assert len(k_on) <= len(k_off) - 2
    torch.testing.assert_close(off, want, rtol=1e-5, atol=1e-5)
    fp8_close(on, want)


def test_example_model_fp8_compiled_with_passes_matches_eager() -> None:
    """The example model (fp8 cache, scales from the first batch, fp8 q): vattn.compile with the
    passes gives the eager greedy tokens, and the q quant of every distinct piece was fused."""
    from test_quant_fp8 import build_model, greedy, prompts

    model, cfg, kv = build_model("fp8", "CUSTOM")
    ps = prompts(n=4)
    eager = greedy(model, cfg, kv, ps, 4)  # computes the scales in its prefill
    cfg2 = with_passes(cfg, PASSES)
    torch._dynamo.reset()
    compiled = vattn.compile(model, cfg2)
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        got = greedy(model, cfg2, kv, ps, 4, forward=compiled)  # caches off: the passes really run
    matches = compiled.backend.pass_manager.matches
    print(f"\n[example model, fp8, piecewise] matches {matches}, pieces {compiled.backend.num_unique_pieces}")
    assert torch.equal(got, eager)
    assert matches["query_quant_fusion"] == 2  # the first piece and the (shared) middle piece hold a q quant


@pytest.mark.cuda
@pytest.mark.parametrize("split", [True, False], ids=["piecewise", "full_graph"])
def test_cuda_triton_attn_passes_with_real_kernels(split: bool) -> None:
    """bf16 on the GPU with TRITON_ATTN: the q quant (and, in the full graph, the output quant)
    leave the generated code; results stay within fp8 tolerance of eager."""
    s = make("TRITON_ATTN", "op", n=2, device="cuda", dtype=torch.bfloat16, **({} if split else {"splitting_ops": ()}))
    want = s.run().float()
    off, k_off, _ = inductor_run(s, with_passes(s.cfg, ()))
    on, k_on, compiled = inductor_run(s, with_passes(s.cfg, PASSES))
    print(f"\n[cuda {'piecewise' if split else 'full graph'}] off: {k_off}\n  on: {k_on}")
    matches = compiled.backend.pass_manager.matches
    assert k_off.count(EXTERN_QUANT) == 4 and k_on.count(EXTERN_QUANT) == (0 if not split else 2)
    assert matches["query_quant_fusion"] == 2 and matches["attn_quant_fusion"] == (0 if split else 2)
    assert len(k_on) <= len(k_off) - (2 if split else 4)
    fp8_close(off.float(), want)
    fp8_close(on.float(), want)

"""vattn.compile on CPU: the split, piecewise Inductor compile vs eager, no recompiles,
identical pieces compiled once, the pass manager and its passes.

One Inductor-compiled 4-layer model is shared by the tests (module fixture); structural
tests use ``use_inductor=False`` (Dynamo only), which is fast.
"""

from __future__ import annotations

import importlib
import logging
import random
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vattn
from vattn.compile_passes.backend import compilation_counter
from vattn.compile_passes.compiler import VattnCompiledModel
from vattn.compile_passes.pieces import _traced_outputs, piece_key
from vattn.compile_passes.pass_manager import PostGradPassManager, VattnPass, get_pass_class

H, NH, NKV, D, VOCAB = 32, 2, 1, 16, 64
ATTN_OP = "vattn::unified_attention_with_output"


class TinyLayer(nn.Module):
    """``strided_reshape``: reshape the strided k slice by the token count, as RoPE code often
    does (a backed token symbol then guards on it being 1); else split heads on the contiguous
    projection output, as ``examples/model.py`` does."""

    def __init__(self, i: int, attn_backend: object = None, head_size: int = D, strided_reshape: bool = False) -> None:
        super().__init__()
        self.strided_reshape = strided_reshape
        self.d = d = head_size
        self.norm1, self.norm2 = nn.RMSNorm(H), nn.RMSNorm(H)
        self.qkv = nn.Linear(H, (NH + 2 * NKV) * d, bias=False)
        self.o = nn.Linear(NH * d, H, bias=False)
        self.up, self.down = nn.Linear(H, 2 * H, bias=False), nn.Linear(2 * H, H, bias=False)
        self.attn = vattn.Attention(
            NH, d, d**-0.5, num_kv_heads=NKV, prefix=f"layers.{i}.attn", attn_backend=attn_backend  # type: ignore[arg-type]
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        t, d = x.shape[0], self.d
        rot = torch.cos(positions[:, None].to(x.dtype) * 0.1)  # position-dependent, like RoPE
        if self.strided_reshape:
            q, k, v = self.qkv(self.norm1(x)).split([NH * d, NKV * d, NKV * d], dim=-1)
            k = k.reshape(t, NKV, d)  # reshape of a non-contiguous split
            attn = self.attn(q * rot, (k * rot[:, None]).reshape(t, NKV * d), v)
        else:
            q, k, v = self.qkv(self.norm1(x)).view(t, NH + 2 * NKV, d).split([NH, NKV, NKV], dim=1)
            attn = self.attn(q * rot[:, None], k * rot[:, None], v)
        x = x + self.o(attn)
        return x + self.down(F.silu(self.up(self.norm2(x))))


class TinyModel(nn.Module):
    def __init__(self, num_layers: int, attn_backend: object = None, head_size: int = D,
                 strided_reshape: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, H)
        self.layers = nn.ModuleList(TinyLayer(i, attn_backend, head_size, strided_reshape) for i in range(num_layers))
        self.norm = nn.RMSNorm(H)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(positions, x)
        return self.norm(x)


def build(
    num_layers: int,
    *,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    attn_backend: object = None,
    head_size: int = D,
    block_size: int = 8,
    strided_reshape: bool = False,
    **compilation: object,
) -> tuple[TinyModel, vattn.VattnConfig, vattn.PagedKVCache]:
    """A TinyModel of ``num_layers`` (seeded weights), its config and a 64-block KV cache."""
    cfg = vattn.VattnConfig(
        cache=vattn.CacheConfig(block_size=block_size),
        compilation=vattn.CompilationConfig(**compilation),  # type: ignore[arg-type]
    )
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # the layers record the model dtype at construction
    try:
        with vattn.set_current_vattn_config(cfg):
            model = TinyModel(num_layers, attn_backend, head_size, strided_reshape).eval().to(device)
    finally:
        torch.set_default_dtype(old)
    kv = vattn.allocate_kv_cache(cfg, num_blocks=64, device=device, dtype=dtype)
    return model, cfg, kv


class Batches:
    """Random steps where sequences grow (decode), finish, and new ones join (prefill)."""

    def __init__(self, kv: vattn.PagedKVCache, seed: int = 0, max_reqs: int = 5) -> None:
        self.kv, self.rng, self.max_reqs = kv, random.Random(seed), max_reqs
        self.reqs: list[dict] = []  # {"len": cached tokens, "blocks": [...]}
        self.free = list(range(1, kv.num_blocks))

    def step(self) -> tuple[torch.Tensor, torch.Tensor, vattn.CommonAttentionMetadata]:
        rng = self.rng
        for r in [r for r in self.reqs if r["len"] > 40 or rng.random() < 0.1]:  # finish
            self.free += r["blocks"]
            self.reqs.remove(r)
        decodes = [(r, 1) for r in self.reqs]
        new = []
        while len(self.reqs) + len(new) < self.max_reqs and (not self.reqs or rng.random() < 0.3):
            new.append(({"len": 0, "blocks": []}, rng.randint(1, 9)))
            if len(new) >= 2:
                break
        batch = decodes + new
        bs = self.kv.block_size
        for r, q in batch:
            while len(r["blocks"]) * bs < r["len"] + q:
                r["blocks"].append(self.free.pop())
        common = self.kv.common_metadata([q for _, q in batch], [r["len"] for r, _ in batch], [r["blocks"] for r, _ in batch])
        positions = torch.cat([torch.arange(r["len"], r["len"] + q) for r, q in batch])
        ids = torch.randint(0, VOCAB, (positions.shape[0],), generator=torch.Generator().manual_seed(rng.randint(0, 99)))
        device = common.query_start_loc.device
        ids, positions = ids.to(device), positions.to(device)
        for r, q in batch:
            r["len"] += q
        self.reqs += [r for r, _ in new]
        return ids, positions, common


def run(model, cfg, kv, ids, positions, common) -> torch.Tensor:
    with vattn.set_forward_context(kv.build_metadata(common), cfg), torch.no_grad():
        return model(ids, positions)


@pytest.fixture(scope="module")
def compiled4(tmp_path_factory):
    """A 4-layer model compiled with Inductor (caches off so the pass manager really runs)."""
    dump = tmp_path_factory.mktemp("dump")
    model, cfg, kv = build(4, passes=("noop_elimination",), debug_dump_path=str(dump))
    compiled = vattn.compile(model, cfg)
    ids, positions, common = Batches(kv, seed=1).step()
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        run(compiled, cfg, kv, ids, positions, common)
    return model, cfg, kv, compiled, dump


def test_split_puts_each_attention_op_alone(compiled4) -> None:
    *_, compiled, _ = compiled4
    items = compiled.backend.items
    assert [i.is_splitting for i in items] == [False, True] * 4 + [False]
    for item in items:
        targets = [n.target for n in item.graph.graph.nodes if n.op == "call_function"]
        attn = [t for t in targets if isinstance(t, torch._ops.OpOverloadPacket) and t._qualified_op_name == ATTN_OP
                or isinstance(t, torch._ops.OpOverload) and t._schema.name == ATTN_OP]
        if item.is_splitting:
            assert len(targets) == 1 and len(attn) == 1
        else:
            assert attn == [] and targets
    c = compiled.backend.counter
    assert (c.num_graphs_seen, c.num_pieces, c.num_splitting_ops) == (1, 5, 4)


def test_identical_pieces_compiled_once(compiled4) -> None:
    *_, compiled, dump = compiled4
    backend = compiled.backend
    # first piece (embed + layer 0 pre-attention), 3 identical middle pieces, last piece.
    assert backend.counter.num_inductor_compiles == 3
    assert backend.counter.num_piece_reuses == 2
    fns = [p.fn for p in backend.pieces]
    assert fns[1] is fns[2] is fns[3] and fns[0] is not fns[1] and fns[4] is not fns[1]
    # the pass manager ran as Inductor's post-grad pass for each compile, dumping graphs
    pm = backend.pass_manager
    assert pm.num_calls == 3
    assert len(list(dump.glob("*_00_before.py"))) == 3
    assert len(list(dump.glob("*_01_after_noop_elimination.py"))) == 3
    assert compilation_counter.num_inductor_compiles >= 3


@pytest.mark.parametrize("num_layers", [2, 6])
def test_unique_pieces_do_not_grow_with_depth(num_layers: int) -> None:
    model, cfg, kv = build(num_layers, use_inductor=False)
    compiled = vattn.compile(model, cfg)
    ids, positions, common = Batches(kv).step()
    out = run(compiled, cfg, kv, ids, positions, common)
    backend = compiled.backend
    assert backend.num_unique_pieces == 3
    assert backend.counter.num_piece_reuses == num_layers - 2
    assert torch.isfinite(out).all()


def test_piecewise_compile_matches_eager(compiled4) -> None:
    model, cfg, kv, compiled, _ = compiled4
    batches = Batches(kv, seed=2)
    for _ in range(6):
        ids, positions, common = batches.step()
        saved = {k: t.clone() for k, t in kv.tensors.items()}
        got = run(compiled, cfg, kv, ids, positions, common)
        for k, t in kv.tensors.items():
            t.copy_(saved[k])
        want = run(model, cfg, kv, ids, positions, common)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_no_recompiles_over_50_steps(compiled4) -> None:
    _, cfg, kv, compiled, _ = compiled4
    batches = Batches(kv, seed=3)
    sizes = set()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(50):
            ids, positions, common = batches.step()
            sizes.add(ids.shape[0])
            run(compiled, cfg, kv, ids, positions, common)
        # a single-token step too (no 0/1 specialisation)
        kv1 = kv.common_metadata([1], [3], [[5]])
        run(compiled, cfg, kv, torch.tensor([7]), torch.tensor([3]), kv1)
    assert len(sizes) > 5
    assert compiled.backend.counter.num_graphs_seen == 1


def test_first_call_with_one_token_stays_dynamic() -> None:
    model, cfg, kv = build(2, use_inductor=False)
    compiled = vattn.compile(model, cfg)
    for i, n in enumerate((1, 5, 1, 12)):
        # Other tests' TinyModels share this forward's code object: only compiles after
        # the first one of this model are recompiles.
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            common = kv.common_metadata([n], [0], [[1, 2]])
            run(compiled, cfg, kv, torch.randint(0, VOCAB, (n,)), torch.arange(n), common)
    assert compiled.backend.counter.num_graphs_seen == 1


def test_strided_reshape_recompiles_once_when_backed_never_when_unbacked(caplog) -> None:
    """A reshape of a strided slice by the token count guards a backed symbol on T == 1: the
    default mode traces once more for 1-token steps (and says why); "unbacked" never does."""
    steps = (5, 1, 12, 1, 3)
    for dynamic, graphs in ((True, 2), ("unbacked", 1)):
        model, cfg, kv = build(2, use_inductor=False, strided_reshape=True)
        compiled = vattn.compile(model, cfg, dynamic=dynamic)
        with caplog.at_level(logging.WARNING, logger="vattn.compile"):
            caplog.clear()
            for n in steps:
                common = kv.common_metadata([n], [0], [[1, 2]])
                ids = torch.randint(0, VOCAB, (n,))
                got = run(compiled, cfg, kv, ids, torch.arange(n), common)
                torch.testing.assert_close(got, run(model, cfg, kv, ids, torch.arange(n), common))
        assert compiled.backend.counter.num_graphs_seen == graphs, dynamic
        assert ("traced the model a second time" in caplog.text) == (graphs == 2)


def test_compile_errors_and_forwarding() -> None:
    model, cfg, _ = build(2, use_inductor=False)
    with pytest.raises(TypeError, match="nn.Module"):
        vattn.compile(lambda x: x, cfg)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="VattnConfig"):
        vattn.compile(model, object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dynamic"):
        vattn.compile(model, cfg, dynamic="sometimes")
    compiled = vattn.compile(model, cfg)
    assert isinstance(compiled, VattnCompiledModel) and compiled.layers is model.layers
    with pytest.raises(ValueError, match="noop_elimination"):
        get_pass_class("no_such_pass")


def test_piece_key_ignores_names_but_not_constants() -> None:
    def graph(scale: float, name: str) -> torch.fx.GraphModule:
        g = torch.fx.Graph()
        x = g.placeholder(name)
        g.output(g.call_function(torch.mul, (x, scale)))
        return torch.fx.GraphModule(nn.Module(), g)

    x = torch.randn(3)
    assert piece_key(graph(2.0, "a"), [x]) == piece_key(graph(2.0, "b"), [x])
    assert piece_key(graph(2.0, "a"), [x]) != piece_key(graph(3.0, "a"), [x])
    assert piece_key(graph(2.0, "a"), [x]) != piece_key(graph(2.0, "a"), [torch.randn(4)])


# ---- the pass manager --------------------------------------------------------------------

_PASS_SRC = '''
import torch
from vattn.compile_passes.pass_manager import VattnPass

class CountAdds(VattnPass):
    name = "count_adds"
    def apply(self, graph):
        return sum(n.target is torch.ops.aten.add.Tensor for n in graph.nodes){extra}
'''


def _load_pass(tmp_path, extra: str) -> type[VattnPass]:
    path = tmp_path / "vattn_tmp_pass.py"
    path.write_text(textwrap.dedent(_PASS_SRC.format(extra=extra)))
    sys.path.insert(0, str(tmp_path))
    try:
        sys.modules.pop("vattn_tmp_pass", None)
        return importlib.import_module("vattn_tmp_pass").CountAdds
    finally:
        sys.path.remove(str(tmp_path))


def test_pass_manager_uuid_tracks_pass_source_options_and_order(tmp_path) -> None:
    a = _load_pass(tmp_path, "")
    pm_a = PostGradPassManager([a()])
    uuid_a = pm_a.uuid()
    assert uuid_a == PostGradPassManager([a()]).uuid()  # deterministic
    b = _load_pass(tmp_path, " + 0")  # the pass's source changed
    assert PostGradPassManager([b()]).uuid() != uuid_a
    assert PostGradPassManager([a(threshold=2)]).uuid() != uuid_a  # options
    noop = get_pass_class("noop_elimination")
    assert PostGradPassManager([a(), noop()]).uuid() != PostGradPassManager([noop(), a()]).uuid()

    # it runs the passes in order and counts matches
    gm = torch.fx.experimental.proxy_tensor.make_fx(lambda x: (x + 1) + 2)(torch.randn(2))
    pm = PostGradPassManager([a()])
    pm(gm.graph)
    assert pm.matches == {"count_adds": 2} and pm.num_calls == 1
    with pytest.raises(TypeError, match="VattnPass"):
        PostGradPassManager([lambda g: None])  # type: ignore[list-item]


def test_noop_elimination_counts_and_keeps_numerics() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        y = x.view(n, 4, 8).view(n, 32)  # chain back to the same shape
        z = y.reshape(n, 32)[:, :]  # no-op reshape and slice
        return (z * 2).view(n, 2, 16)

    x = torch.randn(5, 32)
    gm = torch.fx.experimental.proxy_tensor.make_fx(f, tracing_mode="symbolic")(x)

    def views(g: torch.fx.GraphModule) -> int:
        ops = (torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten.slice.Tensor)
        return sum(n.target in ops for n in g.graph.nodes)

    before = views(gm)
    p = get_pass_class("noop_elimination")()
    matches = p(gm.graph)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    assert matches == 4 and before == 5 and views(gm) == 1
    torch.testing.assert_close(gm(x), f(x))
    torch.testing.assert_close(gm(torch.randn(7, 32)).shape, torch.Size([7, 2, 16]))


def _addmm_graph(device: str) -> tuple[torch.fx.Graph, dict[str, torch.fx.Node]]:
    """A post-grad-like graph with fake tensors on ``device``: a residual addmm, a bias addmm
    and a scaled one; its outputs are the three results."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    aten = torch.ops.aten
    g = torch.fx.Graph()
    with FakeTensorMode():
        vals = {"res": torch.empty(5, 6, device=device), "x": torch.empty(5, 8, device=device),
                "w": torch.empty(8, 6, device=device), "bias": torch.empty(6, device=device)}
        nodes = {}
        for name, v in vals.items():
            nodes[name] = g.placeholder(name)
            nodes[name].meta["val"] = v
        x, w = nodes["x"], nodes["w"]
        for name, args, kwargs in (("residual", (nodes["res"], x, w), {}), ("bias", (nodes["bias"], x, w), {}),
                                   ("scaled", (nodes["res"], x, w), {"beta": 2})):
            nodes[name] = g.call_function(aten.addmm.default, args, kwargs)
            nodes[name].meta["val"] = aten.addmm.default(*(a.meta["val"] for a in args), **kwargs)
    g.output((nodes["residual"], nodes["bias"], nodes["scaled"]))
    return g, nodes


def test_unfuse_addmm_splits_residual_addmm_on_gpu_graphs() -> None:
    """A residual ``addmm`` of a GPU graph becomes ``mm`` + ``add`` (same values); a bias or
    scaled addmm, and any CPU graph, stay as they are. The pass is on by default."""
    aten = torch.ops.aten
    assert "unfuse_addmm" in vattn.CompilationConfig().passes
    p = get_pass_class("unfuse_addmm")()

    g, _ = _addmm_graph("cpu")
    assert p(g) == 0

    g, nodes = _addmm_graph("cuda")
    assert p(g) == 1
    ops = [n.target for n in g.nodes if n.op == "call_function"]
    assert ops.count(aten.addmm.default) == 2 and ops.count(aten.mm.default) == 1
    (add,) = [n for n in g.nodes if n.target == aten.add.Tensor]
    mm = add.args[0]
    assert mm.target == aten.mm.default and mm.args == (nodes["x"], nodes["w"]) and add.args[1] is nodes["res"]
    assert g.output_node().args[0][0] is add
    assert tuple(mm.meta["val"].shape) == (5, 6) and add.meta["val"].device.type == "cuda"
    g.lint()

    # The rewritten graph computes what the addmm did (run on CPU tensors).
    gen = torch.Generator().manual_seed(0)
    res, x, w, bias = (torch.randn(*s, generator=gen) for s in ((5, 6), (5, 8), (8, 6), (6,)))
    out = torch.fx.GraphModule(nn.Module(), g)(res, x, w, bias)
    torch.testing.assert_close(out[0], torch.addmm(res, x, w))
    torch.testing.assert_close(out[1], torch.addmm(bias, x, w))
    torch.testing.assert_close(out[2], torch.addmm(res, x, w, beta=2))


@pytest.mark.cuda
def test_unfuse_addmm_leaves_no_residual_addmm_in_inductor_code_cuda() -> None:
    """On CUDA, Inductor's code for a bf16 model has the residual adds of ``o`` and ``down``
    as ``addmm`` without the pass and fused into its Triton kernels with it; outputs agree."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import run_and_get_code

    default = vattn.CompilationConfig().passes
    outs, codes = {}, {}
    for name, passes in (("on", default), ("off", tuple(p for p in default if p != "unfuse_addmm"))):
        model, cfg, kv = build(2, device="cuda", dtype=torch.bfloat16, passes=passes)
        ids, positions, common = Batches(kv, seed=3).step()
        torch._dynamo.reset()
        compiled = vattn.compile(model, cfg)
        with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
            outs[name], code = run_and_get_code(lambda: run(compiled, cfg, kv, ids, positions, common))
        codes[name] = "\n".join(code)
        if name == "on":
            assert compiled.backend.pass_manager.matches["unfuse_addmm"] >= 2
            want = run(model, cfg, kv, ids, positions, common)
    assert "extern_kernels.addmm" in codes["off"] and "extern_kernels.addmm" not in codes["on"]
    assert "extern_kernels.mm" in codes["on"]
    torch.testing.assert_close(outs["on"].float(), want.float(), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(outs["on"].float(), outs["off"].float(), atol=3e-2, rtol=3e-2)


def test_defunctionalize_removes_auto_functionalized_and_copies() -> None:
    from torch._dynamo.backends.common import aot_autograd
    from torch._higher_order_ops.auto_functionalize import auto_functionalized, auto_functionalized_v2

    seen: dict[str, object] = {}

    def fw(gm: torch.fx.GraphModule, _inputs: object) -> torch.fx.GraphModule:
        hops = (auto_functionalized, auto_functionalized_v2)
        count = lambda: sum(n.target in hops for n in gm.graph.nodes)  # noqa: E731
        seen["before"] = count()
        p = get_pass_class("defunctionalize")()
        seen["matches"] = p(gm.graph)
        gm.recompile()
        seen["after"] = count()
        seen["clones"] = sum(n.target in (torch.ops.aten.clone.default, torch.ops.aten.copy_.default) for n in gm.graph.nodes)
        return gm

    def f(key, value, kv, slots, scale):
        key_cache, value_cache = kv.unbind(0)
        torch.ops.vattn.reshape_and_cache_flash(key, value, key_cache, value_cache, slots, "auto", scale, scale)
        return kv.sum(dim=(1, 2))

    kv, kv_ref = torch.zeros(2, 4, 2, 2, 8), torch.zeros(2, 4, 2, 2, 8)
    key, value, slots, scale = torch.randn(3, 2, 8), torch.randn(3, 2, 8), torch.tensor([0, 5, -1]), torch.tensor(1.0)
    got = torch.compile(f, backend=aot_autograd(fw_compiler=fw), fullgraph=True)(key, value, kv, slots, scale)
    want = f(key, value, kv_ref, slots, scale)
    assert seen == {"before": 1, "matches": 1, "after": 0, "clones": 0}
    torch.testing.assert_close(got, want)
    assert torch.equal(kv, kv_ref)


def test_passes_run_inside_inductor_on_an_unsplit_graph(tmp_path) -> None:
    """splitting_ops=(): attention stays in the one graph; defunctionalize removes its copies."""
    model, cfg, kv = build(2, splitting_ops=(), passes=("noop_elimination", "defunctionalize"),
                           debug_dump_path=str(tmp_path))
    compiled = vattn.compile(model, cfg)
    batches = Batches(kv, seed=4)
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    for i in range(3):
        ids, positions, common = batches.step()
        saved = {k: t.clone() for k, t in kv.tensors.items()}
        with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
            got = run(compiled, cfg, kv, ids, positions, common)
        for k, t in kv.tensors.items():
            t.copy_(saved[k])
        torch.testing.assert_close(got, run(model, cfg, kv, ids, positions, common), atol=2e-5, rtol=2e-5)
    assert compiled.backend.counter.num_splitting_ops == 0 and compiled.backend.counter.num_pieces == 1
    assert compiled.backend.pass_manager.matches["defunctionalize"] == 2  # one per attention op
    (before,) = tmp_path.glob("*_00_before.py")
    (after,) = tmp_path.glob("*_02_after_defunctionalize.py")
    assert before.read_text().count("auto_functionalized") >= 2
    assert "auto_functionalized" not in after.read_text() and "unified_attention_with_output" in after.read_text()


def test_traced_outputs_need_every_value() -> None:
    """Pieces reuse Dynamo's traced output values only when every output has one (else they
    run on fake inputs); the values come back as fresh tensors with the same layout."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.ops.aten.add.Tensor, (x, 1))
    g.output((y, x))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    assert _traced_outputs(gm) is None  # no values recorded
    base = torch.randn(4, 6)
    x.meta["example_value"], y.meta["val"] = base[:, 2:], base + 1
    out = _traced_outputs(gm)
    assert out[0].shape == (4, 6) and out[1].shape == (4, 4)
    assert out[1].stride() == (6, 1) and out[1].storage_offset() == 2  # the slice's layout kept


def test_compile_sizes_specialise_exact_token_counts() -> None:
    """compile_sizes=(1, 5): the first step of each size compiles every distinct piece once
    more for exactly that many tokens (lazily, with the step's inputs) and matches eager; other
    sizes keep the general code; no Dynamo recompile either way."""
    model, cfg, kv = build(3, compile_sizes=(1, 5))
    compiled = vattn.compile(model, cfg)
    counter = compiled.backend.counter
    steps = [(3, [4]), (1, [6]), (1, [7]), (5, [2]), (5, [9]), (4, [3])]
    for i, (n, ctx) in enumerate(steps):
        common = kv.common_metadata([n], ctx, [[1, 2]])
        ids, pos = torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(i)), torch.arange(ctx[0], ctx[0] + n)
        saved = {k: t.clone() for k, t in kv.tensors.items()}
        got = run(compiled, cfg, kv, ids, pos, common)
        for k, t in kv.tensors.items():
            t.copy_(saved[k])
        torch.testing.assert_close(got, run(model, cfg, kv, ids, pos, common), atol=2e-5, rtol=2e-5)
        if i == 0:
            assert counter.num_static_compiles == 0
        if i in (1, 3):  # the first 1-token and 5-token steps: every distinct piece, once
            assert counter.num_static_compiles == counter.num_inductor_compiles * (1 + (i == 3))
    assert counter.num_static_compiles == 2 * counter.num_inductor_compiles  # repeats and 3, 4 tokens: none
    assert counter.num_graphs_seen == 1
    pieces = compiled.backend.pieces
    assert all(p.static is not None and set(p.static.fns) == {1, 5} for p in pieces)
    assert len({id(p.static) for p in pieces}) == counter.num_inductor_compiles  # shared by identical pieces


def test_compile_sizes_validation() -> None:
    with pytest.raises(ValueError, match="compile_sizes must be a tuple of positive token counts"):
        vattn.CompilationConfig(compile_sizes=(0,))
    with pytest.raises(TypeError, match="inductor_compile_config must be a dict"):
        vattn.CompilationConfig(inductor_compile_config=[("max_autotune", True)])  # type: ignore[arg-type]


def _piece_config_patches(monkeypatch, default: str, on: bool, extra: dict) -> list[dict]:  # noqa: ANN001
    """The Inductor config patches of every piece compile (general and 1-token code) of a
    2-layer model, with ``vattn.compile_passes.inductor``'s ``default`` function replaced by
    one whose device check answers ``on``; Inductor's entry point only records its patches."""
    import torch._inductor.compile_fx as compile_fx_mod

    from vattn.compile_passes import inductor as inductor_mod

    patches: list[dict] = []

    def record(graph, example_inputs, config_patches=None, **kwargs):  # noqa: ANN001, ANN202
        patches.append(dict(config_patches or {}))
        return graph

    monkeypatch.setattr(compile_fx_mod, "compile_fx", record)
    if default == "on_pdl_device":
        monkeypatch.setattr(inductor_mod, default, lambda args: on)
    else:
        monkeypatch.setattr(inductor_mod, default, lambda args: {"combo_kernels": True} if on else {})
    model, cfg, kv = build(2, compile_sizes=(1,), inductor_compile_config=extra)
    compiled = vattn.compile(model, cfg)
    for n in (3, 1):  # general code, then the 1-token code
        common = kv.common_metadata([n], [4], [[1, 2]])
        got = run(compiled, cfg, kv, torch.arange(n), torch.arange(4, 4 + n), common)
        assert got.shape == (n, H)
    counter = compiled.backend.counter
    assert len(patches) == counter.num_inductor_compiles + counter.num_static_compiles > counter.num_inductor_compiles
    return patches


@pytest.mark.parametrize("override", [None, False])
def test_pieces_compile_with_combo_kernels_on_cuda(monkeypatch, override: bool | None) -> None:
    """Pieces on a CUDA GPU (general and exact-size code) compile with Inductor's combo kernels
    unless ``inductor_compile_config`` says otherwise; CPU pieces keep Inductor's default.
    Checked on the CPU: Inductor's entry point recorded, the device faked."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vattn.compile_passes.inductor import combo_default

    if not hasattr(torch._inductor.config, "combo_kernels"):
        pytest.skip(f"torch {torch.__version__} has no combo_kernels")
    with FakeTensorMode():
        on_gpu = torch.empty(2, device="cuda")
    assert combo_default([on_gpu, 3]) == {"combo_kernels": True}
    assert combo_default([torch.ones(2)]) == {}
    assert combo_default([on_gpu, torch.ones(2)]) == {}  # a piece across devices: left alone
    extra = {} if override is None else {"combo_kernels": override}
    for cuda in (False, True):
        patches = _piece_config_patches(monkeypatch, "combo_default", cuda, extra)
        want = override if override is not None else (True if cuda else None)
        assert [p.get("combo_kernels") for p in patches] == [want] * len(patches)


@pytest.mark.parametrize("override", [None, False])
def test_pieces_compile_with_inductor_pdl_on_sm90(monkeypatch, override: bool | None) -> None:
    """On an sm_90+ GPU every piece (general and exact-size code) compiles with Inductor's
    programmatic dependent launch, unless ``inductor_compile_config`` says otherwise; elsewhere
    the config is left alone. Checked on the CPU with Inductor's entry point recorded."""
    if not hasattr(torch._inductor.config.triton, "enable_pdl"):
        pytest.skip(f"torch {torch.__version__} has no triton.enable_pdl")
    extra = {} if override is None else {"triton.enable_pdl": override}
    for sm90 in (False, True):
        patches = _piece_config_patches(monkeypatch, "on_pdl_device", sm90, extra)
        want = override if override is not None else (True if sm90 else None)
        assert [p.get("triton.enable_pdl") for p in patches] == [want] * len(patches)

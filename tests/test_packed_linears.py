"""``vattn.compile_passes.packed_linears``: weights packed into one buffer, the op that runs them as
one GEMM (and checks the packing on every call), and the piece rewrite that uses it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from test_compile import NH, NKV, TinyLayer
from vattn.compile_passes.packed_linears import PackedLinear, pack_linear_weights, packed_rows


class Block(nn.Module):
    """A decoder layer's projections as transformers writes them: separate q / k / v of one
    input, separate gate / up of another, each output viewed as heads."""

    def __init__(self, hidden: int = 32, bias: bool = False) -> None:
        super().__init__()
        self.q_proj = nn.Linear(hidden, 32, bias=bias)
        self.k_proj = nn.Linear(hidden, 16, bias=bias)
        self.v_proj = nn.Linear(hidden, 16, bias=bias)
        self.gate_proj = nn.Linear(hidden, 48, bias=False)
        self.up_proj = nn.Linear(hidden, 48, bias=False)
        self.down_proj = nn.Linear(48, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[:-1]
        q = self.q_proj(x).view(*t, 4, 8)
        k = self.k_proj(x).view(*t, 2, 8)
        v = self.v_proj(x).view(*t, 2, 8)
        a = (q[..., :2, :] * k + v).flatten(-2).sum(-1, keepdim=True)
        h = x + a
        return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


def test_pack_keeps_values_and_leaves_what_it_cannot_pack() -> None:
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(5, 32)
    want = block(x)
    before = {n: p.detach().clone() for n, p in block.named_parameters()}
    params = dict(block.named_parameters())
    assert pack_linear_weights(block) == 2
    assert all(p is params[n] for n, p in block.named_parameters())  # the same Parameter objects
    assert packed_rows([block.q_proj.weight, block.k_proj.weight, block.v_proj.weight])
    assert packed_rows([block.gate_proj.weight, block.up_proj.weight])
    assert all(torch.equal(p, before[n]) for n, p in block.named_parameters())
    torch.testing.assert_close(block(x), want, atol=0, rtol=0)
    assert pack_linear_weights(block) == 0  # packed already
    block.load_state_dict({n: torch.randn_like(p) for n, p in block.state_dict().items()})  # in place: still packed
    assert packed_rows([block.q_proj.weight, block.k_proj.weight, block.v_proj.weight])

    biased = Block(bias=True)
    assert pack_linear_weights(biased) == 1  # gate / up only: q / k / v have biases
    assert not packed_rows([biased.q_proj.weight, biased.k_proj.weight, biased.v_proj.weight])
    tied = Block()
    tied.up_proj.weight = tied.gate_proj.weight  # shared with another module: not repacked
    assert pack_linear_weights(tied) == 1 and tied.up_proj.weight is tied.gate_proj.weight


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "separate"])
def test_op_matches_separate_linears(packed: bool) -> None:
    torch.manual_seed(1)
    block = Block()
    if packed:
        pack_linear_weights(block)
    ws = [block.q_proj.weight, block.k_proj.weight, block.v_proj.weight]
    x = torch.randn(2, 3, 32)
    got = torch.ops.vattn.packed_linear(x, ws)
    torch.testing.assert_close(got, torch.cat([F.linear(x, w) for w in ws], -1))
    assert packed_rows(ws) == packed
    torch.library.opcheck(torch.ops.vattn.packed_linear.default, (x, ws))
    # gradients: those of the separate linears
    x.requires_grad_(True)
    r = torch.randn_like(got)
    grads = torch.autograd.grad((torch.ops.vattn.packed_linear(x, ws) * r).sum(), [x, *ws])
    want = torch.autograd.grad((torch.cat([F.linear(x, w) for w in ws], -1) * r).sum(), [x, *ws])
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w)


def test_rows_out_of_order_or_past_the_storage_are_not_packed() -> None:
    buf = torch.randn(10, 4)
    assert packed_rows([buf[0:3], buf[3:10]])
    assert not packed_rows([buf[3:10], buf[0:3]])
    assert not packed_rows([buf[0:3], buf[4:10]])  # a gap
    assert not packed_rows([buf[0:3, :2], buf[3:10, :2]])  # not full rows
    assert not packed_rows([buf[0:3], torch.randn(7, 4)])


def test_compiled_rewrite_one_gemm_per_packed_group() -> None:
    import vattn
    from vattn.compile_passes.backend import VattnBackend

    torch.manual_seed(2)
    block = Block()
    pack_linear_weights(block)
    x = torch.randn(6, 32)
    backend = VattnBackend(vattn.VattnConfig(compilation=vattn.CompilationConfig(use_inductor=False)))
    torch._dynamo.reset()
    compiled = torch.compile(block, backend=backend, fullgraph=True)
    torch.testing.assert_close(compiled(x), block(x))
    assert backend.counter.num_packed_linear_groups == 2
    code = "\n".join(m.code for m in backend.split_gm.modules() if isinstance(m, torch.fx.GraphModule))
    assert code.count("vattn.packed_linear") == 2 and "torch._C._nn.linear" in code  # down_proj stays

    # the weights unpacked after the compile: the op sees it and runs the linears one by one
    for m in (block.q_proj, block.k_proj, block.v_proj):
        m.weight = nn.Parameter(m.weight.detach().clone())
    torch.testing.assert_close(compiled(x), block(x))


def test_rewrite_is_off_when_the_config_says_so() -> None:
    import vattn
    from vattn.compile_passes.backend import VattnBackend

    block = Block()
    pack_linear_weights(block)
    cc = vattn.CompilationConfig(use_inductor=False, merge_packed_linears=False)
    backend = VattnBackend(vattn.VattnConfig(compilation=cc))
    torch._dynamo.reset()
    torch.compile(block, backend=backend, fullgraph=True)(torch.randn(3, 32))
    assert backend.counter.num_packed_linear_groups == 0


def _split_qkv(model: nn.Module) -> None:
    """test_compile's TinyModel with separate q / k / v projections (transformers' layout), packed."""
    for layer in model.layers:
        w = layer.qkv.weight.detach()
        d = layer.d
        for name, rows in zip(("q_proj", "k_proj", "v_proj"), w.split([NH * d, NKV * d, NKV * d])):
            proj = nn.Linear(w.shape[1], rows.shape[0], bias=False)
            proj.weight = nn.Parameter(rows.clone())
            setattr(layer, name, proj)
        del layer.qkv
        layer.__class__ = SplitTinyLayer
    assert pack_linear_weights(model) == len(model.layers)


class SplitTinyLayer(TinyLayer):
    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        t, d = x.shape[0], self.d
        rot = torch.cos(positions[:, None].to(x.dtype) * 0.1)[:, None]
        h = self.norm1(x)
        q = self.q_proj(h).view(t, NH, d)
        k = self.k_proj(h).view(t, NKV, d)
        attn = self.attn(q * rot, k * rot, self.v_proj(h).view(t, NKV, d))
        x = x + self.o(attn)
        return x + self.down(F.silu(self.up(self.norm2(x))))


def test_groups_survive_a_saved_trace(tmp_path) -> None:
    """A second start loads Dynamo's trace from ``cache_dir``: the groups tagged at the first
    capture are one GEMM each again, and both starts compute what the eager model does."""
    import vattn
    from test_compile import Batches, build, run
    from vattn.compile_passes import aot_cache

    if aot_cache.aot_supported() is not None:
        pytest.skip(f"{aot_cache.aot_supported()}: cache_dir is ignored on this torch")
    outs, starts = [], []
    for _ in range(2):
        model, cfg, kv = build(2, cache_dir=str(tmp_path), use_inductor=False)
        _split_qkv(model)
        compiled = vattn.compile(model, cfg)
        batches = Batches(kv, seed=5)
        outs.append([run(compiled, cfg, kv, *batches.step()) for _ in range(4)])
        starts.append(compiled)
    assert not starts[0].trace_loaded and starts[1].trace_loaded
    assert [c.backend.counter.num_packed_linear_groups for c in starts] == [2, 2]  # first layer, then the shared one
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    eager, cfg, kv = build(2)
    _split_qkv(eager)
    batches = Batches(kv, seed=5)
    for got in outs[1]:
        torch.testing.assert_close(got, run(eager, cfg, kv, *batches.step()), atol=1e-5, rtol=1e-5)


class _CountMM(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the matrix multiplications dispatched (what a GEMM launch is; ``linear`` where a
    mode sees it undecomposed)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.linear):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_eager_inference_runs_a_packed_group_as_one_gemm() -> None:
    """Without grad, the first member called with an input computes the group; the others return
    their column slices for that tensor in any order; everything equals the separate linears."""
    torch.manual_seed(3)
    block, plain = Block(), Block()
    plain.load_state_dict(block.state_dict())
    pack_linear_weights(block)
    assert all(type(getattr(block, n)) is PackedLinear for n in ("q_proj", "k_proj", "v_proj", "gate_proj"))
    assert type(block.down_proj) is nn.Linear and isinstance(block.q_proj, nn.Linear)
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        want = plain(x)
        with _CountMM() as mm:
            got = block(x)
        assert mm.count == 3  # q/k/v, gate/up, down
        torch.testing.assert_close(got, want)
        with _CountMM() as mm:  # k and v first: still one GEMM, the same values
            k, v, q = block.k_proj(x), block.v_proj(x), block.q_proj(x)
        assert mm.count == 1
        for out, ref in zip((q, k, v), (plain.q_proj(x), plain.k_proj(x), plain.v_proj(x))):
            torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
        q.view(2, 5, 4, 8)  # a column slice: its last dimension still splits into heads
        with _CountMM() as mm:  # a member called twice with one input: the second call computes again
            twice = [block.q_proj(x), block.q_proj(x)]
        assert mm.count == 2
        for out in twice:
            torch.testing.assert_close(out, plain.q_proj(x))
        block.q_proj(x)
        x.add_(1.0)  # changed in place since the group ran: k is computed from the new values
        torch.testing.assert_close(block.k_proj(x), plain.k_proj(x))
        block.q_proj(x)
        torch.testing.assert_close(block.k_proj(x + 0), plain.k_proj(x))  # another tensor of equal values


def test_packed_group_with_grad_or_unpacked_runs_member_by_member() -> None:
    torch.manual_seed(4)
    block, plain = Block(), Block()
    plain.load_state_dict(block.state_dict())
    pack_linear_weights(block)
    x = torch.randn(3, 32, requires_grad=True)
    with _CountMM() as mm:
        out = block(x)
    assert mm.count == 6  # with grad: the plain linears (autograd sees each weight)
    out.sum().backward()
    plain(x).sum().backward()
    for (name, p), q in zip(block.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    with torch.no_grad():
        block.k_proj.weight = nn.Parameter(torch.randn(16, 32))  # the packing undone
        plain.k_proj.weight = nn.Parameter(block.k_proj.weight.detach().clone())
        with _CountMM() as mm:
            got = block(x)
        assert mm.count == 5  # gate/up still packed
        torch.testing.assert_close(got, plain(x))
        block.double()
        torch.testing.assert_close(block(x.double()), plain.double()(x.double()))
        block.gate_proj.bias = nn.Parameter(torch.randn(48, dtype=torch.float64))  # a bias added later is used
        plain.gate_proj.bias = nn.Parameter(block.gate_proj.bias.detach().clone())
        torch.testing.assert_close(block(x.double()), plain(x.double()))


def test_packed_group_under_inference_mode_runs_member_by_member() -> None:
    """Inference tensors keep no version counter: each member runs its own GEMM, and no call fails."""
    torch.manual_seed(5)
    block, plain = Block(), Block()
    plain.load_state_dict(block.state_dict())
    pack_linear_weights(block)
    with torch.inference_mode():
        x = torch.randn(4, 32)
        with _CountMM() as mm:
            got = block(x)
        with _CountMM() as mm_plain:
            want = plain(x)
        assert mm.count == mm_plain.count > 0  # six linears each (inference mode may dispatch linear undecomposed)
        torch.testing.assert_close(got, want)

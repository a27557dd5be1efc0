"""vattn::gemv, its Triton kernel, and the 1-token rewrite of linear layers (one_token_gemv).

CPU: the kernel under the Triton interpreter against a float32 reference, the op's
fallback (opcheck), and the rewrite on a Dynamo graph (what it replaces, and that the
rewritten graph computes the same). GPU: the kernel on the Llama-3.2-1B projections, with
and without programmatic dependent launch, alone and as a dependent chain in a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

import triton_modules
import vattn  # noqa: F401  (registers torch.ops.vattn)
from vattn.compile_passes import one_token_gemv

pytest.importorskip("triton")

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"


triton_gemv = triton_modules.load(["vattn.ops.triton_gemv"])["vattn.ops.triton_gemv"]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The example model's (and transformers') RMSNorm, in x's dtype."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _reference(x: torch.Tensor, w: torch.Tensor, silu_mul: bool, residual: torch.Tensor | None = None,
               norm_weight: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """float32 result of the unfused steps (each intermediate rounded to x's dtype, as a model has it)."""
    k = w.shape[1]
    if silu_mul:  # the activation rounded to the input dtype, as an unfused model computes it
        x = (F.silu(x[:, :k].float()) * x[:, k:].float()).to(x.dtype)
    if norm_weight is not None:
        x = _rms_norm(x, norm_weight, eps)
    out = x.float() @ w.float().T
    if residual is not None:
        out = out.to(x.dtype).float() + residual.float()
    return out


@pytest.mark.parametrize("silu_mul", [False, True])
@pytest.mark.parametrize("n,k,block_n,block_k", [(24, 64, 4, 32), (37, 100, 8, 32), (5, 33, 2, 64)])
def test_kernel_matches_float32(n: int, k: int, block_n: int, block_k: int, silu_mul: bool) -> None:
    """Odd N and K (masked last program and last K block), several K steps, random inputs."""
    g = torch.Generator().manual_seed(n * k)
    x = torch.randn(1, 2 * k if silu_mul else k, generator=g).to(DEV, torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(DEV, torch.bfloat16)
    out = torch.full((1, n + 3), 7.0, device=DEV, dtype=torch.bfloat16)  # 3 guard columns
    triton_gemv.gemv(x, w, out[:, :n], silu_mul=silu_mul, block_n=block_n, block_k=block_k, num_warps=4)
    ref = _reference(x, w, silu_mul)
    torch.testing.assert_close(out[:, :n].float(), ref, atol=0.06 * ref.abs().max().item() / 8, rtol=1e-2)
    assert torch.all(out[:, n:] == 7.0)  # nothing written past N


@pytest.mark.parametrize("transform", ["none", "silu_mul", "norm"])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("n,k,block_n,block_k", [(37, 100, 8, 32), (5, 33, 2, 64)])
def test_kernel_norm_and_residual_match_float32(n: int, k: int, block_n: int, block_k: int, transform: str,
                                                with_residual: bool) -> None:
    """RMSNorm on the input (its mean square over several K blocks) and the residual add on
    the output, alone and with SwiGLU, against the unfused float32 steps."""
    g = torch.Generator().manual_seed(n + k)
    silu_mul, norm = transform == "silu_mul", transform == "norm"
    x = (3 * torch.randn(1, 2 * k if silu_mul else k, generator=g)).to(DEV, torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(DEV, torch.bfloat16)
    nw = (1 + torch.randn(k, generator=g) / 4).to(DEV, torch.bfloat16) if norm else None
    res = (4 * torch.randn(1, n, generator=g)).to(DEV, torch.bfloat16) if with_residual else None
    out = torch.full((1, n + 3), 7.0, device=DEV, dtype=torch.bfloat16)
    triton_gemv.gemv(x, w, out[:, :n], silu_mul=silu_mul, residual=res, norm_weight=nw, eps=1e-5,
                     block_n=block_n, block_k=block_k, num_warps=4)
    ref = _reference(x, w, silu_mul, res, nw, 1e-5)
    torch.testing.assert_close(out[:, :n].float(), ref, atol=0.06 * ref.abs().max().item() / 8, rtol=1e-2)
    assert torch.all(out[:, n:] == 7.0)


def test_kernel_rejects_silu_mul_with_norm() -> None:
    x, w = torch.randn(1, 8), torch.randn(4, 4)
    with pytest.raises(ValueError, match="exclusive"):
        triton_gemv.gemv(x, w, torch.empty(1, 4), silu_mul=True, norm_weight=torch.ones(4))


@pytest.mark.parametrize("silu_mul", [False, True])
def test_op_fallback_and_opcheck(silu_mul: bool) -> None:
    """Off the GPU fast path (CPU, or more than one row) the op is F.linear (after SwiGLU or
    RMSNorm, then the residual)."""
    g = torch.Generator().manual_seed(1)
    for rows in (1, 3):
        x = torch.randn(rows, 32 if silu_mul else 16, generator=g)
        w = torch.randn(8, 16, generator=g)
        got = torch.ops.vattn.gemv(x, w, silu_mul)
        x_in = F.silu(x[:, :16]) * x[:, 16:] if silu_mul else x
        torch.testing.assert_close(got, F.linear(x_in, w))
        opcheck(torch.ops.vattn.gemv.default, (x, w, silu_mul))
        res = torch.randn(rows, 8, generator=g)
        torch.testing.assert_close(torch.ops.vattn.gemv(x, w, silu_mul, res), F.linear(x_in, w) + res)
        opcheck(torch.ops.vattn.gemv.default, (x, w, silu_mul, res))
        if not silu_mul:
            nw = torch.randn(16, generator=g)
            got = torch.ops.vattn.gemv(x, w, False, res, nw, 1e-5)
            torch.testing.assert_close(got, F.linear(_rms_norm(x, nw, 1e-5), w) + res)
            opcheck(torch.ops.vattn.gemv.default, (x, w, False, res, nw, 1e-5))


class _Block(torch.nn.Module):
    """A projection, a SwiGLU MLP, and a linear layer with a bias (left alone)."""

    def __init__(self, d: int = 16, inner: int = 24) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(d, d, bias=False)
        self.gate_up = torch.nn.Linear(d, 2 * inner, bias=False)
        self.down = torch.nn.Linear(inner, d, bias=False)
        self.head = torch.nn.Linear(d, 8, bias=True)
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        gate, up = self.gate_up(h).split(self.inner, dim=-1)
        h = h + self.down(F.silu(gate) * up)
        return self.head(h)


def _dynamo_graph(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    """The graph Dynamo hands a backend for ``model(x)``, and its (real) inputs."""
    graphs: list[tuple[torch.fx.GraphModule, list[torch.Tensor]]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend, fullgraph=True)(x)
    return graphs[0]


def test_rewrite_replaces_bias_free_linears_and_fuses_swiglu() -> None:
    torch.manual_seed(0)
    model, x = _Block().eval(), torch.randn(1, 16)
    gm, inputs = _dynamo_graph(model, x)
    want = model(x)
    assert one_token_gemv.rewrite(gm) == 3  # proj, gate_up, down; not the biased head
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.vattn.gemv.default]
    assert [n.args[2] for n in calls] == [False, False, True]  # down reads the gate/up output itself
    assert calls[2].args[0] is calls[1]
    assert sum(n.target is torch._C._nn.linear for n in gm.graph.nodes) == 1
    (got,) = gm(*inputs)
    torch.testing.assert_close(got, want)


class _Layer(_Block):
    """A decoder layer's projections: the example model's RMSNorm -> proj -> residual add, then
    transformers' LlamaRMSNorm -> SwiGLU MLP -> residual add, and a biased head."""

    def __init__(self, d: int = 16, inner: int = 24) -> None:
        super().__init__(d, inner)
        from examples.model import RMSNorm

        self.norm1, self.norm2 = RMSNorm(d, 1e-5), _HFRMSNorm(d, 1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.proj(self.norm1(x))
        gate, up = self.gate_up(self.norm2(x)).split(self.inner, dim=-1)
        x = self.down(F.silu(gate) * up) + x
        return self.head(x)


class _HFRMSNorm(torch.nn.Module):
    """``transformers``' LlamaRMSNorm, written out (the ``.to(torch.float32)`` form)."""

    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def test_rewrite_fuses_norms_and_residual_adds() -> None:
    """Both RMSNorm forms enter their projection, both residual adds (either operand order)
    leave it: no add, norm or SwiGLU node is used any more, and the graph computes the same."""
    torch.manual_seed(0)
    model = _Layer().to(torch.bfloat16).eval()
    for p in model.parameters():
        p.data.normal_()
    x = torch.randn(1, 16, dtype=torch.bfloat16)
    gm, inputs = _dynamo_graph(model, x)
    want = model(x)
    assert one_token_gemv.rewrite(gm) == 3
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.vattn.gemv.default]
    proj, gate_up, down = calls
    assert proj.args[3] is proj.args[0] and proj.args[5] == 1e-5  # residual x, the norm's input x
    assert gate_up.args[0] is proj and gate_up.args[3] is None and gate_up.args[5] == 1e-6
    assert down.args[0] is gate_up and down.args[2] is True and down.args[3] is proj
    gm.graph.eliminate_dead_code()
    assert not [n for n in gm.graph.nodes if n.op in ("call_method", "call_function")
                and n.target not in (torch.ops.vattn.gemv.default, torch._C._nn.linear)]
    (got,) = gm(*inputs)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_rewrite_leaves_norms_and_adds_it_cannot_fuse() -> None:
    """A broadcasting add, a projection with a second use, a float32 norm weight and a norm
    that is not the RMSNorm form stay in the graph."""

    class Odd(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(16, 16))
            self.nw32 = torch.nn.Parameter(torch.randn(16))

        def forward(self, x: torch.Tensor, bias_row: torch.Tensor) -> torch.Tensor:
            a = F.linear(x, self.w) + bias_row  # (1, 16) + (16,): broadcasting
            b = F.linear(a, self.w)
            c = b + a  # b has a second use below
            xf = c.float()
            n32 = self.nw32 * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5))  # no cast back
            d = F.linear(n32.to(torch.bfloat16), self.w)
            xf = d.float()
            not_rms = self.nw32.bfloat16() * (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + 1e-5)).to(d.dtype)
            return F.linear(not_rms, self.w) + b

    model = Odd().to(torch.bfloat16)
    model.nw32.data = model.nw32.data.float()
    x, row = torch.randn(1, 16, dtype=torch.bfloat16), torch.randn(16, dtype=torch.bfloat16)
    graphs: list[tuple[torch.fx.GraphModule, list[torch.Tensor]]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend, fullgraph=True)(x, row)
    gm, inputs = graphs[0]
    want = model(x, row)
    assert one_token_gemv.rewrite(gm) == 4
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.vattn.gemv.default]
    assert [(n.args[3] is not None, n.args[4] is not None) for n in calls] == [
        (False, False), (False, False), (False, False), (True, False)]  # only the last add fuses
    (got,) = gm(*inputs)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_rewrite_leaves_a_split_that_is_not_two_halves() -> None:
    """``silu(h[:, :8]) * h[:, 8:24]`` of a three-way split is not SwiGLU: the linear stays plain."""

    class ThreeWay(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 8))

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            a, b, _ = h.split(8, dim=-1)
            return F.linear(F.silu(a) * b, self.w)

    model, h = ThreeWay(), torch.randn(1, 24)
    gm, _ = _dynamo_graph(model, h)
    assert one_token_gemv.rewrite(gm) == 1
    (call,) = [n for n in gm.graph.nodes if n.target is torch.ops.vattn.gemv.default]
    assert call.args[2] is False


@pytest.mark.cuda
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("name,n,k,silu_mul", [("qkv", 3072, 2048, False), ("o", 2048, 2048, False),
                                                 ("gate_up", 16384, 2048, False), ("down", 2048, 8192, True)])
def test_kernel_llama_shapes_cuda(name: str, n: int, k: int, silu_mul: bool, pdl: bool) -> None:
    if pdl and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90+")
    g = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(1, 2 * k if silu_mul else k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).bfloat16()
    out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    triton_gemv.gemv(x, w, out, silu_mul=silu_mul, pdl=pdl)
    torch.testing.assert_close(out.float(), _reference(x, w, silu_mul), atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("name,n,k", [("qkv", 3072, 2048), ("gate_up", 16384, 2048), ("o", 2048, 2048)])
def test_kernel_norm_residual_llama_shapes_cuda(name: str, n: int, k: int, pdl: bool) -> None:
    """The fused RMSNorm (qkv, gate_up) and residual add (o), as vattn::gemv runs them in a
    decoder layer, against the unfused steps."""
    if pdl and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90+")
    g = torch.Generator(device="cuda").manual_seed(n)
    x = (4 * torch.randn(1, k, device="cuda", generator=g)).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).bfloat16()
    norm = name != "o"
    nw = (1 + torch.randn(k, device="cuda", generator=g) / 4).bfloat16() if norm else None
    res = None if norm else torch.randn(1, n, device="cuda", generator=g).bfloat16()
    out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    triton_gemv.gemv(x, w, out, residual=res, norm_weight=nw, eps=1e-5, pdl=pdl)
    torch.testing.assert_close(out.float(), _reference(x, w, False, res, nw, 1e-5), atol=3e-2, rtol=2e-2)
    op = torch.ops.vattn.gemv(x, w, False, res, nw, 1e-5)  # the op's fast path: the same kernel
    assert torch.equal(op, out)


@pytest.mark.cuda
def test_pdl_chain_in_cuda_graph_matches_serial() -> None:
    """Twelve dependent GEMVs with PDL, captured and replayed, give the serial launches' result
    bit for bit (each reads the previous one's output: an early start must wait for it)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [(torch.randn(2048, 2048, device="cuda", generator=g) / 45).bfloat16() for _ in range(12)]
    x0 = torch.randn(1, 2048, device="cuda", generator=g).bfloat16()
    bufs = [torch.empty(1, 2048, device="cuda", dtype=torch.bfloat16) for _ in range(12)]
    pdl = torch.cuda.get_device_capability()[0] >= 9

    def chain(use_pdl: bool) -> torch.Tensor:
        x = x0
        for w, b in zip(ws, bufs):
            triton_gemv.gemv(x, w, b, pdl=use_pdl)
            x = b
        return x

    want = chain(False).clone()
    chain(pdl)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain(pdl)
    for b in bufs:
        b.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(bufs[-1], want)


def test_pdl_supported_only_on_cuda_sm90() -> None:
    from vattn.ops.triton_launch import pdl_supported

    assert pdl_supported(torch.device("cpu")) is False
    if HAS_CUDA:
        assert pdl_supported(torch.device("cuda")) == (torch.cuda.get_device_capability()[0] >= 9)

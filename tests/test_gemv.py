"""vattn_examples::gemv, its Triton kernel, and the 1-token rewrite of linear layers (one_token_gemv).

CPU: the kernel under the Triton interpreter against a float32 reference, the op's
fallback (opcheck), and the rewrite on a Dynamo graph (what it replaces, and that the
rewritten graph computes the same). GPU: the kernel on the Llama-3.2-1B projections, with
and without programmatic dependent launch, alone and as a dependent chain in a CUDA graph.
"""

from __future__ import annotations

import operator
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

import triton_modules
import vattn  # noqa: F401  (registers torch.ops.vattn)
from examples.gemv import rewrite as one_token_gemv

pytest.importorskip("triton")

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"


triton_gemv = triton_modules.load(["examples.gemv.kernel"])["examples.gemv.kernel"]


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
    triton_gemv.launch_gemv(x, w, out[:, :n], silu_mul=silu_mul, block_n=block_n, block_k=block_k, num_warps=4)
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
    triton_gemv.launch_gemv(x, w, out[:, :n], silu_mul=silu_mul, residual=res, norm_weight=nw, eps=1e-5,
                     block_n=block_n, block_k=block_k, num_warps=4)
    ref = _reference(x, w, silu_mul, res, nw, 1e-5)
    torch.testing.assert_close(out[:, :n].float(), ref, atol=0.06 * ref.abs().max().item() / 8, rtol=1e-2)
    assert torch.all(out[:, n:] == 7.0)


def test_default_tiles_follow_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """H100 tiles by default (and off CUDA); an H200 gets its own table (shorter K steps for the
    fused QKV / gate-up projections and the down projection, 4 rows for the LM head), each a
    valid RoPE tile (a power of two of at least 2 rows)."""
    shapes = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
              "lm_head": (128256, 2048)}
    h100 = {"qkv": (4, 2048, 8), "o": (4, 2048, 8), "gate_up": (4, 2048, 8), "down": (4, 4096, 8),
            "lm_head": (8, 2048, 8)}
    h200 = {"qkv": (8, 1024, 8), "o": (4, 2048, 8), "gate_up": (4, 1024, 4), "down": (4, 2048, 8),
            "lm_head": (4, 2048, 8)}
    for name, (n, k) in shapes.items():
        assert triton_gemv.default_tiles(n, k, torch.device("cpu")) == h100[name]
    names = iter(["NVIDIA H200", "NVIDIA H100 80GB HBM3"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: next(names))
    triton_gemv._gpu_tiles.cache_clear()
    try:
        for name, (n, k) in shapes.items():
            tiles = triton_gemv.default_tiles(n, k, torch.device("cuda", 0))
            assert tiles == h200[name]
            assert tiles[0] >= 2 and tiles[0] & (tiles[0] - 1) == 0 and tiles[2] in (4, 8)
        for name, (n, k) in shapes.items():  # another GPU: its own lookup, H100 tiles
            assert triton_gemv.default_tiles(n, k, torch.device("cuda", 1)) == h100[name]
    finally:
        triton_gemv._gpu_tiles.cache_clear()


@pytest.mark.parametrize("with_residual", [False, True])
def test_kernel_separate_up_matches_the_concatenated_input(with_residual: bool) -> None:
    """SwiGLU with the up projection in its own tensor (``up``): the same bits as the gate and
    up concatenated into one (1, 2K) input, odd K over several K steps."""
    g = torch.Generator().manual_seed(4)
    n, k = 37, 100
    gate, up = (torch.randn(1, k, generator=g).to(DEV, torch.bfloat16) for _ in range(2))
    w = torch.randn(n, k, generator=g).to(DEV, torch.bfloat16)
    res = torch.randn(1, n, generator=g).to(DEV, torch.bfloat16) if with_residual else None
    want = torch.empty(1, n, device=DEV, dtype=torch.bfloat16)
    triton_gemv.launch_gemv(torch.cat((gate, up), 1), w, want, silu_mul=True, residual=res, block_n=8,
                            block_k=32, num_warps=4)
    got = torch.full((1, n), 7.0, device=DEV, dtype=torch.bfloat16)
    triton_gemv.launch_gemv(gate, w, got, silu_mul=True, up=up, residual=res, block_n=8, block_k=32, num_warps=4)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="silu_mul"):
        triton_gemv.launch_gemv(gate, w, got, up=up)


@pytest.mark.parametrize("ns, rope_segs", [((48, 16, 16), 2), ((40, 24), 0), ((16, 32, 8), 0), ((32, 16), 1)])
def test_kernel_group_matches_one_gemv_each(ns: tuple[int, ...], rope_segs: int) -> None:
    """2 or 3 projections of one input in one launch (RMSNorm on the input, RoPE on every head
    of the first ``rope_segs``), into column blocks of one output as ``gemv_group`` passes them:
    the same bits as one ``launch_gemv`` each, and as one ``launch_gemv`` over the weights
    stacked (what ``gemv_group`` runs for packed weights, RoPE on the leading columns)."""
    g = torch.Generator().manual_seed(sum(ns))
    k = 100
    x = (3 * torch.randn(1, k, generator=g)).to(DEV, torch.bfloat16)
    nw = (1 + torch.randn(k, generator=g) / 4).to(DEV, torch.bfloat16)
    ws = [torch.randn(n, k, generator=g).to(DEV, torch.bfloat16) for n in ns]
    cos, sin = (t.to(DEV) for t in _rope_tables(8, torch.bfloat16, g))
    out = torch.full((1, sum(ns)), 7.0, device=DEV, dtype=torch.bfloat16)
    rope = dict(rope_cos=cos, rope_sin=sin) if rope_segs else {}
    triton_gemv.launch_gemv_group(x, ws, out.split(ns, -1), norm_weight=nw, eps=1e-5, rope_segs=rope_segs, **rope,
                                  block_n=4, block_k=32, num_warps=4)
    for i, (w, got) in enumerate(zip(ws, out.split(ns, -1))):
        want = torch.empty(1, w.shape[0], device=DEV, dtype=torch.bfloat16)
        extra = dict(rope, rope_cols=w.shape[0]) if i < rope_segs else {}
        triton_gemv.launch_gemv(x, w, want, norm_weight=nw, eps=1e-5, block_n=4, block_k=32, num_warps=4, **extra)
        assert torch.equal(got, want), f"projection {i}"
    stacked = torch.full((1, sum(ns)), 7.0, device=DEV, dtype=torch.bfloat16)
    triton_gemv.launch_gemv(x, torch.cat(ws), stacked, norm_weight=nw, eps=1e-5, rope_cols=sum(ns[:rope_segs]),
                            block_n=4, block_k=32, num_warps=4, **rope)
    assert torch.equal(stacked, out)


def test_op_group_fallback_and_opcheck() -> None:
    """Off the GPU fast path the group op is one gemv per weight, rotated where asked; bad
    arguments are refused by name."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 1, 24, generator=g).bfloat16()
    ws = [torch.randn(n, 24, generator=g).bfloat16() for n in (32, 16, 16)]
    nw = torch.randn(24, generator=g).bfloat16()
    cos, sin = (t.view(1, 1, 1, 16) for t in _rope_tables(16, torch.bfloat16, g))
    got = torch.ops.vattn_examples.gemv_group(x, ws, nw, 1e-5, cos, sin, 2, False)
    assert got.shape == (1, 1, 64)
    for i, (w, out) in enumerate(zip(ws, got.split([32, 16, 16], -1))):
        rope = (cos, sin, w.shape[0]) if i < 2 else ()
        assert torch.equal(out, torch.ops.vattn_examples.gemv(x, w, False, None, nw, 1e-5, *rope))
    opcheck(torch.ops.vattn_examples.gemv_group.default, (x, ws, nw, 1e-5, cos, sin, 2, False))
    opcheck(torch.ops.vattn_examples.gemv_group.default, (x, ws[:2]))
    with pytest.raises(ValueError, match="2 or 3 weights"):
        torch.ops.vattn_examples.gemv_group(x, ws[:1])
    with pytest.raises(ValueError, match="rope_segs"):
        torch.ops.vattn_examples.gemv_group(x, ws, None, 0.0, None, None, 1)


def test_kernel_rejects_silu_mul_with_norm() -> None:
    x, w = torch.randn(1, 8), torch.randn(4, 4)
    with pytest.raises(ValueError, match="exclusive"):
        triton_gemv.launch_gemv(x, w, torch.empty(1, 4), silu_mul=True, norm_weight=torch.ones(4))


@pytest.mark.parametrize("silu_mul", [False, True])
def test_op_fallback_and_opcheck(silu_mul: bool) -> None:
    """Off the GPU fast path (CPU, or more than one row) the op is F.linear (after SwiGLU or
    RMSNorm, then the residual)."""
    g = torch.Generator().manual_seed(1)
    for rows in (1, 3):
        x = torch.randn(rows, 32 if silu_mul else 16, generator=g)
        w = torch.randn(8, 16, generator=g)
        got = torch.ops.vattn_examples.gemv(x, w, silu_mul)
        x_in = F.silu(x[:, :16]) * x[:, 16:] if silu_mul else x
        torch.testing.assert_close(got, F.linear(x_in, w))
        opcheck(torch.ops.vattn_examples.gemv.default, (x, w, silu_mul))
        res = torch.randn(rows, 8, generator=g)
        torch.testing.assert_close(torch.ops.vattn_examples.gemv(x, w, silu_mul, res), F.linear(x_in, w) + res)
        opcheck(torch.ops.vattn_examples.gemv.default, (x, w, silu_mul, res))
        if silu_mul:  # separate gate and up: x is the gate, up its own tensor
            gate, up = x[:, :16].contiguous(), x[:, 16:].contiguous()
            got = torch.ops.vattn_examples.gemv(gate, w, True, res, up=up)
            torch.testing.assert_close(got, F.linear(x_in, w) + res)
            opcheck(torch.ops.vattn_examples.gemv.default, (gate, w, True, res), {"up": up})
            with pytest.raises(ValueError, match="up"):
                torch.ops.vattn_examples.gemv(gate, w, False, up=up)
        if not silu_mul:
            nw = torch.randn(16, generator=g)
            got = torch.ops.vattn_examples.gemv(x, w, False, res, nw, 1e-5)
            torch.testing.assert_close(got, F.linear(_rms_norm(x, nw, 1e-5), w) + res)
            opcheck(torch.ops.vattn_examples.gemv.default, (x, w, False, res, nw, 1e-5))


def _rope_tables(d: int, dtype: torch.dtype, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed sin), each (d,), for one random position: the example model's tables."""
    angle = 40 * torch.rand(d // 2, generator=g)
    cos, sin = angle.cos(), angle.sin()
    return torch.cat((cos, cos)).to(dtype), torch.cat((-sin, sin)).to(dtype)


def _rope(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cols: int) -> torch.Tensor:
    """(1, N) projection -> its first ``cols`` outputs rotated head by head, in float32."""
    d = cos.shape[-1]
    out = y.float().clone()
    heads = out[:, :cols].unflatten(-1, (-1, d))
    out[:, :cols] = (heads * cos.float() + heads.roll(d // 2, -1) * sin.float()).flatten(1)
    return out


@pytest.mark.parametrize("d,heads,rotated,block_n", [(16, 5, 3, 4), (8, 3, 3, 2), (32, 4, 1, 8), (16, 2, 2, 16)])
def test_kernel_rope_epilogue(d: int, heads: int, rotated: int, block_n: int) -> None:
    """RoPE in the epilogue: the first ``rotated`` heads leave rotated, the others as
    projected. float16 (which the interpreter rounds as the GPU does): bit for bit the
    kernel's own unrotated output, rotated in float32 and rounded once; both dtypes: within
    rounding of the float32 reference. Odd head counts, pairs across heads (block_n > d), a
    norm on the input, several K blocks."""
    g = torch.Generator().manual_seed(d * heads + block_n)
    n, k = heads * d, 40
    for dtype in (torch.float16, torch.bfloat16):
        x = (2 * torch.randn(1, k, generator=g)).to(DEV, dtype)
        w = torch.randn(n, k, generator=g).to(DEV, dtype)
        nw = (1 + torch.randn(k, generator=g) / 4).to(DEV, dtype)
        cos, sin = (t.to(DEV) for t in _rope_tables(d, dtype, g))
        plain = torch.empty(1, n, device=DEV, dtype=dtype)
        triton_gemv.launch_gemv(x, w, plain, norm_weight=nw, eps=1e-5, block_n=block_n, block_k=32, num_warps=4)
        out = torch.full((1, n + 3), 7.0, device=DEV, dtype=dtype)
        triton_gemv.launch_gemv(x, w, out[:, :n], norm_weight=nw, eps=1e-5, rope_cos=cos, rope_sin=sin,
                         rope_cols=rotated * d, block_n=block_n, block_k=32, num_warps=4)
        assert torch.all(out[:, n:] == 7.0)
        assert torch.equal(out[:, rotated * d : n], plain[:, rotated * d :])  # not rotated: as projected
        if dtype == torch.float16:
            assert torch.equal(out[:, :n], _rope(plain, cos, sin, rotated * d).to(dtype))
        # transformers' rotate-half form takes the plain sin: the same rotation, bit for bit
        unsigned = torch.cat((-sin[: d // 2], sin[d // 2 :]))
        out_u = torch.empty(1, n, device=DEV, dtype=dtype)
        triton_gemv.launch_gemv(x, w, out_u, norm_weight=nw, eps=1e-5, rope_cos=cos, rope_sin=unsigned,
                         rope_cols=rotated * d, rope_unsigned_sin=True, block_n=block_n, block_k=32, num_warps=4)
        assert torch.equal(out_u, out[:, :n])
        ref = _rope(_reference(x, w, False, None, nw, 1e-5).to(dtype), cos, sin, rotated * d)
        # two roundings (projection, rotation; the interpreter truncates bfloat16): a few units
        # in the last place of the largest output
        torch.testing.assert_close(out[:, :n].float(), ref, atol=ref.abs().max().item() / 32, rtol=1e-2)


def test_kernel_rope_rejects_bad_arguments() -> None:
    x, w, out = torch.randn(1, 8), torch.randn(32, 8), torch.empty(1, 32)
    cos, sin = torch.ones(16), torch.zeros(16)
    cases = [
        (dict(rope_cos=cos, rope_cols=16), "together"),
        (dict(rope_cols=16), "needs rope_cos"),
        (dict(rope_cos=cos, rope_sin=sin, rope_cols=24), "multiples of the head size 16"),
        (dict(rope_cos=cos, rope_sin=sin, rope_cols=48), "rope_cols <= 32"),
        (dict(rope_cos=torch.ones(2, 16), rope_sin=sin, rope_cols=16), "one contiguous row"),
        (dict(rope_cos=cos, rope_sin=sin, rope_cols=16, block_n=6), "block_n"),
        (dict(rope_cos=cos, rope_sin=sin, rope_cols=16, residual=out), "exclusive"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            triton_gemv.launch_gemv(x, w, out, **kwargs)


class _RolledRope(torch.nn.Module):
    """Neox RoPE written with the halves rolled and a signed sin table (``x * cos + x.roll(D // 2,
    -1) * signed_sin``): the other RoPE idiom the 1-token rewrite matches (the example model and
    transformers write ``rotate_half``)."""

    def __init__(self, d: int, positions: int) -> None:
        super().__init__()
        from examples.model import RotaryEmbedding

        table = RotaryEmbedding(d, positions, 10000.0)
        half = d // 2
        self.half = half
        self.register_buffer("cos_cache", table.cos_cache)
        self.register_buffer("signed_sin_cache", torch.cat((-table.sin_cache[:, :half], table.sin_cache[:, half:]), -1))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.cos_cache.index_select(0, positions).to(dtype)[:, None, :],
                self.signed_sin_cache.index_select(0, positions).to(dtype)[:, None, :])

    def apply(self, cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        cos, signed_sin = cos_sin
        return x * cos + x.roll(self.half, -1) * signed_sin


def test_op_rope_fallback_and_opcheck() -> None:
    """Off the fast path the op rotates in torch exactly as the models do (bf16 ops, each
    rounded), for any token count, with either sin table; bad RoPE arguments are refused by name."""
    from examples.model import RotaryEmbedding

    g = torch.Generator().manual_seed(3)
    rolled, rope = _RolledRope(16, 64), RotaryEmbedding(16, 64, 10000.0)
    for rows in (1, 3):
        x = torch.randn(rows, 24, generator=g).bfloat16()
        w = torch.randn(5 * 16, 24, generator=g).bfloat16()
        positions = torch.randint(0, 64, (rows,), generator=g)
        signed = rolled.cos_sin(positions, torch.bfloat16)  # the signed sin table, rolled halves
        got = torch.ops.vattn_examples.gemv(x, w, False, None, None, 0.0, *signed, 3 * 16)
        heads = F.linear(x, w).view(rows, 5, 16)
        want = torch.cat((rolled.apply(signed, heads[:, :3]), heads[:, 3:]), dim=1).flatten(1)
        assert torch.equal(got, want)
        opcheck(torch.ops.vattn_examples.gemv.default, (x, w, False, None, None, 0.0, *signed, 3 * 16))
        # rotate_half with the plain sin table (the example model, transformers)
        plain = rope.cos_sin(positions, torch.bfloat16)
        got = torch.ops.vattn_examples.gemv(x, w, False, None, None, 0.0, *plain, 5 * 16, True)
        assert torch.equal(got, rope.apply(plain, heads).flatten(1))
        opcheck(torch.ops.vattn_examples.gemv.default, (x, w, False, None, None, 0.0, *plain, 5 * 16, True))
        # transformers' batch-first layout: x (1, T, K), tables (1, 1, T, D)
        batch_first = [t.view(1, 1, rows, 16) for t in plain]
        got = torch.ops.vattn_examples.gemv(x[None], w, False, None, None, 0.0, *batch_first, 5 * 16, True)
        assert got.shape == (1, rows, 80) and torch.equal(got[0], rope.apply(plain, heads).flatten(1))
    with pytest.raises(ValueError, match="rope_cols=24"):
        torch.ops.vattn_examples.gemv(x, w, False, None, None, 0.0, *signed, 24)
    with pytest.raises(ValueError, match="residual set"):
        torch.ops.vattn_examples.gemv(x, w, False, torch.zeros(rows, 80).bfloat16(), None, 0.0, *signed, 32)


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


def _dynamo_graph(model: torch.nn.Module, *args: torch.Tensor) -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    """The graph Dynamo hands a backend for ``model(*args)``, and its (real) inputs."""
    graphs: list[tuple[torch.fx.GraphModule, list[torch.Tensor]]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend, fullgraph=True)(*args)
    return graphs[0]


def test_rewrite_replaces_bias_free_linears_and_fuses_swiglu() -> None:
    torch.manual_seed(0)
    model, x = _Block().eval(), torch.randn(1, 16)
    gm, inputs = _dynamo_graph(model, x)
    want = model(x)
    assert one_token_gemv.rewrite(gm) == 3  # proj, gate_up, down; not the biased head
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.vattn_examples.gemv.default]
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
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.vattn_examples.gemv.default]
    proj, gate_up, down = calls
    assert proj.args[3] is proj.args[0] and proj.args[5] == 1e-5  # residual x, the norm's input x
    assert gate_up.args[0] is proj and gate_up.args[3] is None and gate_up.args[5] == 1e-6
    assert down.args[0] is gate_up and down.args[2] is True and down.args[3] is proj
    gm.graph.eliminate_dead_code()
    assert not [n for n in gm.graph.nodes if n.op in ("call_method", "call_function")
                and n.target not in (torch.ops.vattn_examples.gemv.default, torch._C._nn.linear)]
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
    gm, inputs = _dynamo_graph(model, x, row)
    want = model(x, row)
    assert one_token_gemv.rewrite(gm) == 4
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.vattn_examples.gemv.default]
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
    (call,) = [n for n in gm.graph.nodes if n.target is torch.ops.vattn_examples.gemv.default]
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
    triton_gemv.launch_gemv(x, w, out, silu_mul=silu_mul, pdl=pdl)
    torch.testing.assert_close(out.float(), _reference(x, w, silu_mul), atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("name,n,k", [("qkv", 3072, 2048), ("gate_up", 16384, 2048), ("o", 2048, 2048)])
def test_kernel_norm_residual_llama_shapes_cuda(name: str, n: int, k: int, pdl: bool) -> None:
    """The fused RMSNorm (qkv, gate_up) and residual add (o), as vattn_examples::gemv runs them in a
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
    triton_gemv.launch_gemv(x, w, out, residual=res, norm_weight=nw, eps=1e-5, pdl=pdl)
    torch.testing.assert_close(out.float(), _reference(x, w, False, res, nw, 1e-5), atol=3e-2, rtol=2e-2)
    op = torch.ops.vattn_examples.gemv(x, w, False, res, nw, 1e-5)  # the op's fast path: the same kernel
    assert torch.equal(op, out)


@pytest.mark.cuda
def test_op_group_runs_packed_weights_as_one_gemv_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama-3.2-1B's q / k / v (RMSNorm, q and k rotated, the plain sin): weights packed into
    one buffer (``pack_linear_weights``' layout) run one plain GEMV, separate weights the group
    kernel; the results agree within one bf16 rounding and are close to float32."""
    import examples.gemv.kernel as kernel
    from vattn.compile_passes.packed_linears import packed_rows

    launched: list[str] = []

    def counted(name: str) -> Any:
        real = getattr(kernel, name)

        def launch(*args: Any, **kwargs: Any) -> None:
            launched.append(name)
            real(*args, **kwargs)
        return launch

    for name in ("launch_gemv", "launch_gemv_group"):
        monkeypatch.setattr(kernel, name, counted(name))

    g = torch.Generator().manual_seed(3)
    k, ns, d = 2048, (2048, 512, 512), 64
    x = torch.randn(1, 1, k, generator=g).to("cuda", torch.bfloat16)
    nw = (1 + torch.randn(k, generator=g) / 4).to("cuda", torch.bfloat16)
    buffer = (torch.randn(sum(ns), k, generator=g) / 32).to("cuda", torch.bfloat16)
    packed = list(buffer.split(ns))
    separate = [w.clone() for w in packed]
    assert packed_rows(packed) and not packed_rows(separate)
    angle = torch.rand(d // 2, generator=g) * 30
    cos = torch.cat((angle.cos(), angle.cos())).view(1, 1, 1, d).to("cuda", torch.bfloat16)
    sin = torch.cat((angle.sin(), angle.sin())).view(1, 1, 1, d).to("cuda", torch.bfloat16)
    group = torch.ops.vattn_examples.gemv_group
    got, want = group(x, packed, nw, 1e-5, cos, sin, 2, True), group(x, separate, nw, 1e-5, cos, sin, 2, True)
    assert launched == ["launch_gemv", "launch_gemv_group"]
    assert got.shape == want.shape == (1, 1, sum(ns))
    torch.testing.assert_close(got, want, atol=0.02, rtol=0.01)
    f32 = [t.cpu().float() for t in (x, nw, cos, sin)]
    ref = torch.cat([torch.ops.vattn_examples.gemv(f32[0], w.cpu().float(), False, None, f32[1], 1e-5,
                                                   *((f32[2], f32[3], n, True) if i < 2 else ()))
                     for i, (w, n) in enumerate(zip(separate, ns))], -1)
    torch.testing.assert_close(got.cpu().float(), ref, atol=0.05, rtol=0.02)


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
            triton_gemv.launch_gemv(x, w, b, pdl=use_pdl)
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
    from vattn.kernels.launch import pdl_supported

    assert pdl_supported(torch.device("cpu")) is False
    if HAS_CUDA:
        assert pdl_supported(torch.device("cuda")) == (torch.cuda.get_device_capability()[0] >= 9)


class _QKVRope(torch.nn.Module):
    """A fused-QKV attention input: RMSNorm -> fused QKV projection -> RoPE of the q and k heads
    (rolled halves, signed sin: ``_RolledRope``) -> q, k, v. ``variant`` breaks one condition
    of the fusion: ``"reuse"`` also returns the unrotated heads, ``"overlap"`` takes v from
    a rotated head, ``"float32_table"`` rotates with float32 cos / sin (type promotion)."""

    def __init__(self, variant: str = "", heads: int = 4, kv_heads: int = 2, d: int = 16, hidden: int = 32) -> None:
        super().__init__()
        from examples.model import RMSNorm

        self.variant, self.h, self.hk, self.d = variant, heads, kv_heads, d
        self.norm = RMSNorm(hidden, 1e-5)
        self.qkv = torch.nn.Linear(hidden, (heads + 2 * kv_heads) * d, bias=False)
        self.rope = _RolledRope(d, 64)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        dtype = torch.float32 if self.variant == "float32_table" else x.dtype
        cos_sin = self.rope.cos_sin(positions, dtype)
        h, hk = self.h, self.hk
        qkv = self.qkv(self.norm(x)).view(x.shape[0], h + 2 * hk, self.d)
        q, k = self.rope.apply(cos_sin, qkv[:, : h + hk]).split([h, hk], dim=1)
        v = qkv[:, h + hk - (self.variant == "overlap") :]
        if self.variant == "reuse":
            return q, k, v, qkv[:, :h]
        return q, k, v


def test_rewrite_fuses_rope_into_the_qkv_projection() -> None:
    """The projection takes cos, sin and the rotated width; the rotation's nodes are gone and
    the graph gives the same q, k and v bit for bit (the op's torch path on CPU)."""
    torch.manual_seed(0)
    model = _QKVRope().to(torch.bfloat16).eval()
    x, pos = torch.randn(1, 32, dtype=torch.bfloat16), torch.tensor([37])
    gm, inputs = _dynamo_graph(model, x, pos)
    want = model(x, pos)
    assert one_token_gemv.rewrite(gm) == 1
    (call,) = [n for n in gm.graph.nodes if n.target is torch.ops.vattn_examples.gemv.default]
    assert call.args[4] is not None and None not in call.args[6:8] and call.args[8:] == ((4 + 2) * 16, False)
    gm.graph.eliminate_dead_code()
    assert not [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "roll"]
    got = gm(*inputs)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_rewrite_fuses_rope_in_every_layer_of_the_example_model() -> None:
    """The example model's 1-token graph: every layer's QKV projection takes RoPE (its
    ``rotate_half`` form, the plain sin), and no rotation is left outside the projections."""
    import vattn
    from examples.model import DecoderForCausalLM, get_preset, init_random_weights

    cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=16))
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with vattn.set_current_vattn_config(cfg):
            model = DecoderForCausalLM(get_preset("tiny", num_hidden_layers=3)).eval()
    finally:
        torch.set_default_dtype(old)
    init_random_weights(model)
    with vattn.set_forward_context(None, cfg, dummy_run=True):
        gm, _ = _dynamo_graph(model, torch.tensor([7]), torch.tensor([30]))
    assert one_token_gemv.rewrite(gm) == 3 * 4
    rope = [n for n in gm.graph.nodes if n.target is torch.ops.vattn_examples.gemv.default and len(n.args) > 6 and n.args[9]]
    assert len(rope) == 3 and all(n.args[8] == (model.config.num_attention_heads
                                                + model.config.num_key_value_heads) * model.config.head_dim
                                  for n in rope)
    gm.graph.eliminate_dead_code()
    assert not [n for n in gm.graph.nodes if n.target is torch.cat]


class _HFStyleAttentionInput(torch.nn.Module):
    """transformers' Llama attention input, token-major: separate q / k / v projections, each
    viewed as (T, heads, D), and ``apply_rotary_pos_emb``'s rotate-half with the plain sin."""

    def __init__(self, heads: int = 4, kv_heads: int = 2, d: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.h, self.hk, self.d = heads, kv_heads, d
        self.q_proj = torch.nn.Linear(hidden, heads * d, bias=False)
        self.k_proj = torch.nn.Linear(hidden, kv_heads * d, bias=False)
        self.v_proj = torch.nn.Linear(hidden, kv_heads * d, bias=False)

    @staticmethod
    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1 = x[..., : x.shape[-1] // 2]
        x2 = x[..., x.shape[-1] // 2 :]
        return torch.cat((-x2, x1), dim=-1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.h, self.d)
        k = self.k_proj(x).view(t, self.hk, self.d)
        v = self.v_proj(x).view(t, self.hk, self.d)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + self.rotate_half(q) * sin, k * cos + self.rotate_half(k) * sin, v


def _one_group(gm: torch.fx.GraphModule, weights: int, rope_segs: int) -> torch.fx.Node:
    """The graph's only ``vattn_examples::gemv_group`` (and no gemv left): ``weights`` projections
    of one input, the first ``rope_segs`` rotated with the plain (rotate-half) sin."""
    (group,) = [n for n in gm.graph.nodes if n.target is torch.ops.vattn_examples.gemv_group.default]
    assert not [n for n in gm.graph.nodes if n.target is torch.ops.vattn_examples.gemv.default]
    assert len(group.args[1]) == weights and group.args[6:] == (rope_segs, True)
    return group


class _HFBatchFirstAttentionInput(_HFStyleAttentionInput):
    """The same projections as transformers' Llama really lays them out: (1, T, hidden) in,
    each projection viewed as (1, T, heads, D) and transposed to (1, heads, T, D), cos / sin
    (1, T, D) unsqueezed to (1, 1, T, D)."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        shape = (*x.shape[:-1], -1, self.d)
        q = self.q_proj(x).view(shape).transpose(1, 2)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + self.rotate_half(q) * sin, k * cos + self.rotate_half(k) * sin, v


@pytest.mark.parametrize("layout", ["token_major", "batch_first"])
def test_rewrite_fuses_transformers_rotate_half(layout: str) -> None:
    """transformers' form, token-major (T, heads, D) or as its Llama lays it out (1, heads, T, D):
    q and k projections take RoPE (all their heads, the plain sin), v's stays plain, the three
    share one launch; the rotation's nodes are gone and q, k, v are the same bit for bit."""
    torch.manual_seed(0)
    batch_first = layout == "batch_first"
    model = (_HFBatchFirstAttentionInput() if batch_first else _HFStyleAttentionInput()).to(torch.bfloat16).eval()
    lead = (1, 1) if batch_first else (1,)
    angle = torch.rand(*lead, 8) * 30
    cos = torch.cat((angle.cos(), angle.cos()), -1).bfloat16()
    sin = torch.cat((angle.sin(), angle.sin()), -1).bfloat16()
    x = torch.randn(*lead, 32, dtype=torch.bfloat16)
    gm, inputs = _dynamo_graph(model, x, cos, sin)
    want = model(x, cos, sin)
    assert one_token_gemv.rewrite(gm) == 3
    _one_group(gm, 3, 2)  # q, k rotated, v plain: one launch
    gm.graph.eliminate_dead_code()
    assert not [n for n in gm.graph.nodes if n.target is torch.cat]
    got = gm(*inputs)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_rewrite_fuses_every_layer_of_a_transformers_llama() -> None:
    """transformers' own Llama on vattn (``vattn.integrations.transformers``), one token:
    every projection becomes a gemv; q, k and v share one launch with the input RMSNorm and q
    and k RoPE, gate and up one with the post-attention norm; o and down take the residual add,
    down the SwiGLU of gate and up; no rotation or activation is left and one norm (the final one) is."""
    pytest.importorskip("transformers")
    import vattn
    from examples.hf_model import random_model, tiny_config
    from vattn.integrations import transformers as vt

    layers = 2
    cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=16))
    hf = random_model(tiny_config("llama", num_hidden_layers=layers), dtype=torch.bfloat16)
    model = vt.wrap(hf, cfg)
    with vattn.set_forward_context(None, cfg, dummy_run=True):
        gm, _ = _dynamo_graph(model, torch.tensor([7]), torch.tensor([30]))
    assert one_token_gemv.rewrite(gm) == 7 * layers
    ops = [n for n in gm.graph.nodes if n.target in (torch.ops.vattn_examples.gemv.default,
                                                     torch.ops.vattn_examples.gemv_group.default)]
    group = torch.ops.vattn_examples.gemv_group.default
    assert [n.target is group for n in ops] == [True, False, True, False] * layers  # qkv, o, gate/up, down
    for qkv, o, gate_up, down in zip(*[iter(ops)] * 4):
        assert len(qkv.args[1]) == 3 and qkv.args[2] is not None and qkv.args[6] == 2  # input norm, q / k RoPE
        assert o.args[3] is not None and len(o.args) == 6  # the residual add
        assert len(gate_up.args[1]) == 2 and gate_up.args[2] is not None and gate_up.args[6] == 0  # post norm
        gate, up = down.args[0], down.kwargs["up"]  # SwiGLU of the group's two outputs, and the residual
        assert down.args[2] and down.args[3] is not None
        assert (gate.target, up.target) == (torch.narrow, torch.narrow)  # the group's two column blocks
        assert (gate.args, up.args) == ((gate_up, -1, 0, 128), (gate_up, -1, 128, 128))
    gm.graph.eliminate_dead_code()
    assert not [n for n in gm.graph.nodes if n.target in (operator.neg, torch.neg, F.silu)]  # rotate_half's, SwiGLU's
    assert len([n for n in gm.graph.nodes if n.target is torch.rsqrt]) == 1


@pytest.mark.parametrize("variant", ["reuse", "overlap", "float32_table"])
def test_rewrite_leaves_rope_it_cannot_fuse(variant: str) -> None:
    """Unrotated heads read elsewhere, v overlapping the rotated heads, or a rotation that
    promotes to float32: the projection becomes a plain gemv, the RoPE nodes stay, and the
    graph computes the same."""
    torch.manual_seed(0)
    model = _QKVRope(variant).to(torch.bfloat16).eval()
    x, pos = torch.randn(1, 32, dtype=torch.bfloat16), torch.tensor([5])
    gm, inputs = _dynamo_graph(model, x, pos)
    want = model(x, pos)
    assert one_token_gemv.rewrite(gm) == 1
    (call,) = [n for n in gm.graph.nodes if n.target is torch.ops.vattn_examples.gemv.default]
    assert len(call.args) == 6  # no RoPE arguments
    got = gm(*inputs)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.cuda
@pytest.mark.parametrize("pdl", [False, True])
def test_kernel_rope_llama_qkv_cuda(pdl: bool) -> None:
    """The Llama-3.2-1B QKV projection (32 q + 8 k heads rotated, 8 v heads not, head dim
    64) with its RMSNorm and RoPE fused, against the projection rotated in float32 and
    rounded once (Inductor's unfused RoPE): equal up to one rounding."""
    if pdl and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90+")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (4 * torch.randn(1, 2048, device="cuda", generator=g)).bfloat16()
    w = (torch.randn(3072, 2048, device="cuda", generator=g) / 45).bfloat16()
    nw = (1 + torch.randn(2048, device="cuda", generator=g) / 4).bfloat16()
    cos, sin = (t.cuda() for t in _rope_tables(64, torch.bfloat16, torch.Generator().manual_seed(1)))
    plain = torch.empty(1, 3072, device="cuda", dtype=torch.bfloat16)
    triton_gemv.launch_gemv(x, w, plain, norm_weight=nw, eps=1e-5, pdl=pdl)
    out = torch.empty_like(plain)
    triton_gemv.launch_gemv(x, w, out, norm_weight=nw, eps=1e-5, rope_cos=cos, rope_sin=sin, rope_cols=2560, pdl=pdl)
    assert torch.equal(out[:, 2560:], plain[:, 2560:])
    want = _rope(plain, cos, sin, 2560).bfloat16()
    ulp = want.float().abs().clamp_min(1e-3) * 2**-7
    assert torch.all((out.float() - want.float()).abs() <= ulp)
    op = torch.ops.vattn_examples.gemv(x, w, False, None, nw, 1e-5, cos.view(1, 1, 64), sin.view(1, 1, 64), 2560)
    assert torch.equal(op, out)  # the op's fast path: the same kernel
    unsigned = torch.cat((-sin[:32], sin[32:]))  # transformers' rotate-half form: the same rotation
    op = torch.ops.vattn_examples.gemv(x, w, False, None, nw, 1e-5, cos.view(1, 1, 64), unsigned.view(1, 1, 64), 2560, True)
    assert torch.equal(op, out)
    # transformers' batch-first layout takes the fast path too: x (1, 1, K), tables (1, 1, 1, D)
    op = torch.ops.vattn_examples.gemv(x.view(1, 1, -1), w, False, None, nw, 1e-5, cos.view(1, 1, 1, 64),
                                       unsigned.view(1, 1, 1, 64), 2560, True)
    assert op.shape == (1, 1, 3072) and torch.equal(op.view(1, -1), out)
    res = torch.randn(1, 1, 3072, device="cuda", generator=g).bfloat16()
    fast = torch.ops.vattn_examples.gemv(x.view(1, 1, -1), w, False, res, nw, 1e-5)
    assert fast.shape == (1, 1, 3072)
    assert torch.equal(fast.view(1, -1), torch.ops.vattn_examples.gemv(x, w, False, res.view(1, -1), nw, 1e-5))


def test_rewritten_transformers_llama_matches_eager_under_vattn_compile() -> None:
    """transformers' Llama on vattn, ``vattn.compile``d with the rewrite on its 1-token pieces
    (forced here on the CPU, where the op runs its torch path): a prefill and decode steps give
    the eager model's hidden states, and the decode pieces hold the grouped projections."""
    pytest.importorskip("transformers")
    import vattn
    from examples.hf_model import random_model, tiny_config
    from vattn.integrations import transformers as vt

    rewritten = []

    def force_rewrite(gm: torch.fx.GraphModule, example_inputs: list, num_tokens: int | None) -> int:
        n = one_token_gemv.rewrite(gm) if num_tokens == 1 else 0
        rewritten.extend(str(node.target) for node in gm.graph.nodes if n and "gemv" in str(node.target))
        return n

    cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=16), compilation=vattn.CompilationConfig(
        compile_sizes=[1], piece_passes=(force_rewrite,)))
    model = vt.wrap(random_model(tiny_config("llama", num_hidden_layers=2), dtype=torch.bfloat16), cfg)
    kv = vattn.allocate_kv_cache(cfg, num_blocks=8, dtype=torch.bfloat16)
    compiled = vattn.compile(model, cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for ql, nc in (([5], [0]), ([1], [5]), ([1], [6])):
            ids, pos = torch.randint(0, 100, (ql[0],), generator=g), torch.arange(nc[0], nc[0] + ql[0])
            md = kv.build_metadata(kv.common_metadata(query_lens=ql, num_computed_tokens=nc, block_tables=[[0]]))
            snapshot = {n: t.clone() for n, t in kv.tensors.items()}
            with vattn.set_forward_context(md, cfg):
                want = model(ids, pos)
            for n, t in snapshot.items():
                kv.tensors[n].copy_(t)
            with vattn.set_forward_context(md, cfg):
                got = compiled(ids, pos)
            torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)
    assert "vattn_examples.gemv_group.default" in rewritten


def test_gemv_lm_head_keeps_the_head_and_its_logits() -> None:
    """``gemv_lm_head`` on a wrapped transformers model: the same parameter objects and state-dict
    keys (tied embeddings stay tied), the same logits (off the GPU the op is ``F.linear``);
    a head with a bias is left alone."""
    pytest.importorskip("transformers")
    import vattn
    from examples.gemv import GemvLinear, gemv_lm_head
    from examples.hf_model import random_model, tiny_config
    from vattn.integrations import transformers as vt

    model = vt.wrap(random_model(tiny_config("qwen3"), dtype=torch.bfloat16), vattn.VattnConfig())
    head = model.hf_model.get_output_embeddings()
    keys, weight = list(model.state_dict()), head.weight
    hidden = torch.randn(3, model.hf_model.config.hidden_size, dtype=torch.bfloat16)
    want = model.compute_logits(hidden)
    assert gemv_lm_head(model)
    assert type(head) is GemvLinear and head.weight is weight is model.hf_model.get_input_embeddings().weight
    assert list(model.state_dict()) == keys
    assert torch.equal(model.compute_logits(hidden), want)
    with torch.enable_grad(), warnings.catch_warnings():  # recorded by autograd: nn.Linear's forward
        warnings.simplefilter("error")  # not the op's autograd fallback, which warns
        model.compute_logits(hidden.requires_grad_()).float().sum().backward()
    assert weight.grad is not None and weight.grad.shape == weight.shape
    biased = torch.nn.Linear(4, 6)
    assert not gemv_lm_head(type("Owner", (torch.nn.Module,), {"get_output_embeddings": lambda self: biased})())
    assert type(biased) is torch.nn.Linear

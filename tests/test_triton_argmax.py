"""examples.argmax: equal to torch.argmax (ties, NaN, -inf rows, signed zeros), on CPU
under Triton's interpreter and on a GPU (a 128k vocabulary, inside a CUDA graph)."""

from __future__ import annotations

import pytest
import torch

import triton_modules

pytest.importorskip("triton")

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"

triton_argmax = triton_modules.load(["examples.argmax"])["examples.argmax"]


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU, 256-logit chunks: rows of a few hundred logits span chunks, and the interpreter
    stays fast (its reductions run element by element)."""
    if not HAS_CUDA:
        monkeypatch.setattr(triton_argmax, "_BLOCK", 256)


def _hard_rows(n: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random rows, then: ties across chunks, the maximum at the very end, two NaNs, a row of
    -inf, a row of signed zeros over negatives."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, vocab, generator=g)
    x[1, [5, vocab // 2, vocab - 1]] = 50.0
    x[2, vocab - 1] = 60.0
    x[3, [vocab // 3 + 1, 7]] = float("nan")
    x[4] = float("-inf")
    x[5] = -1.0
    x[5, [vocab // 2, 3]] = torch.tensor([0.0, -0.0])
    return x.to(dtype).to(DEV)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 7, 256, 1000] + ([9000, 128256] if HAS_CUDA else []))
def test_argmax_equals_torch(vocab: int, dtype: torch.dtype) -> None:
    if vocab < 100:
        x = torch.randn(3, vocab).to(dtype).to(DEV)
    else:
        x = _hard_rows(7, vocab, dtype, vocab)
    got = triton_argmax.argmax(x)
    assert got.dtype == torch.int64 and got.shape == (x.shape[0],)
    assert torch.equal(got, x.argmax(-1))
    if vocab >= 100:
        assert got.tolist()[1:6] == [5, vocab - 1, 7, 0, 3]


def test_argmax_rows_of_a_wider_tensor_and_out() -> None:
    """A row stride larger than V (a slice of a wider tensor), written into ``out``."""
    base = torch.randn(5, 900, generator=torch.Generator().manual_seed(1)).to(DEV)
    x = base[:, :700]
    out = torch.full((5,), -1, dtype=torch.int64, device=DEV)
    assert triton_argmax.argmax(x, out) is out
    assert torch.equal(out, x.argmax(-1))


def test_argmax_rejects_bad_input_and_takes_no_rows() -> None:
    with pytest.raises(ValueError, match="argmax: expected"):
        triton_argmax.argmax(torch.zeros(4, 8, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="argmax: expected"):
        triton_argmax.argmax(torch.zeros(8, 4, device=DEV).t())
    with pytest.raises(ValueError, match="argmax: expected"):
        triton_argmax.argmax(torch.zeros(4, 0, device=DEV))
    assert triton_argmax.argmax(torch.zeros(0, 4, device=DEV)).shape == (0,)  # no row samples
    with pytest.raises(ValueError, match="out must be"):
        triton_argmax.argmax(torch.zeros(2, 4, device=DEV), torch.empty(3, dtype=torch.int64, device=DEV))


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 64])
def test_argmax_in_cuda_graph_after_a_matmul_cuda(rows: int) -> None:
    """Captured after the matmul that writes the logits (the LM head: with PDL the first kernel
    may launch before it ends and must wait for it), replayed on new inputs."""
    g = torch.Generator(device="cuda").manual_seed(rows)
    w = torch.randn(128256, 256, device="cuda", generator=g).bfloat16()
    h = torch.randn(rows, 256, device="cuda", generator=g).bfloat16()
    out = torch.empty(rows, dtype=torch.int64, device="cuda")

    def step() -> None:
        triton_argmax.argmax(h @ w.t(), out)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        h.copy_(torch.randn(rows, 256, device="cuda", generator=g).bfloat16())
        out.fill_(-1)
        graph.replay()
        assert torch.equal(out, (h @ w.t()).argmax(-1))

"""The mixers' Triton kernels against their torch path (itself checked against float64 references
in test_mixers.py) on mixed varlen batches: decodes, odd prefills, a request without tokens,
padded requests, permuted slots, GQA and groups. Compiled on a GPU; through the Triton
interpreter on the CPU (tiny shapes)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.triton_modules import load
from vattn.backends.mamba import torch_ops

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def tri():
    return load(["vattn.backends.mamba.triton_ops"])["vattn.backends.mamba.triton_ops"]


def _batch(lens: list[int], num_slots: int, initial: list[bool], pad: int = 1):
    """(query_start_loc, state_indices, has_initial_state, num_reqs, T): ``pad`` padded requests
    with no tokens and slot -1 after the real ones."""
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()] + [sum(lens)] * pad, dtype=torch.int32)
    slots = torch.randperm(num_slots - 2)[: len(lens)].tolist()  # slot S-2: never named
    si = torch.tensor(slots + [num_slots - 1] * pad, dtype=torch.int32)
    init = torch.tensor(initial + [False] * pad)
    return qsl.to(DEV), si.to(DEV), init.to(DEV), len(lens), sum(lens)


LENS = [1, 1, 5, 0, 9, 1]
INIT = [True, True, False, True, True, False]


def _run_both(tri, name: str, args: list, states: list[int], out_shape: tuple, dtype=torch.float32,
              tol: float = 1e-4) -> None:
    """Call ``name`` of both modules on copies; compare outputs (real rows) and every state slot."""
    results = []
    for mod in (torch_ops, tri):
        a = [x.clone() if isinstance(x, torch.Tensor) else x for x in args]
        out = torch.full(out_shape, 7.0, dtype=dtype, device=DEV)
        getattr(mod, name)(*a, out)
        results.append((out, [a[i] for i in states]))
    (o1, s1), (o2, s2) = results
    torch.testing.assert_close(o2.float(), o1.float(), rtol=tol, atol=tol)
    for x, y, orig in zip(s1, s2, [args[i] for i in states]):
        torch.testing.assert_close(y.float(), x.float(), rtol=tol, atol=tol)
        assert torch.equal(y[-2:-1], orig[-2:-1])  # a slot no request names (the real ones are < S-2)


def test_causal_conv1d(tri):
    torch.manual_seed(0)
    d, k, s = 20, 4, 10
    batch = _batch(LENS, s, INIT)
    x = torch.randn(batch[4] + 2, d, device=DEV)
    for act, bias in (("silu", torch.randn(d, device=DEV)), (None, None)):
        args = [x, torch.randn(d, k, device=DEV), bias, torch.randn(s, d, k - 1, device=DEV), *batch[:4], act]
        _run_both(tri, "causal_conv1d", args, [3], (x.shape[0], d))
    # a strided row view (a split of a wider projection) and width 3
    wide = torch.randn(batch[4], 2 * d, device=DEV)
    args = [wide[:, d:], torch.randn(d, 3, device=DEV), None, torch.randn(s, d, 2, device=DEV), *batch[:4], "silu"]
    _run_both(tri, "causal_conv1d", args, [3], (batch[4], d))


def test_gated_delta_rule(tri):
    torch.manual_seed(1)
    hk, hv, dk, dv, s = 2, 4, 16, 12, 10
    batch = _batch(LENS, s, INIT)
    t = batch[4]
    qkv = torch.randn(t, 2 * hk * dk + hv * dv, device=DEV)
    q, k, v = qkv.split([hk * dk, hk * dk, hv * dv], -1)
    g = -F.softplus(torch.randn(t, hv, device=DEV))
    beta = torch.sigmoid(torch.randn(t, hv, device=DEV))
    for l2 in (True, False):
        scale = dk ** -0.5 if l2 else 0.05
        args = [q.view(t, hk, dk), k.view(t, hk, dk) * (1 if l2 else 0.2), v.view(t, hv, dv), g, beta, scale, l2,
                torch.randn(s, hv, dk, dv, device=DEV) * 0.1, *batch[:4]]
        _run_both(tri, "gated_delta_rule", args, [7], (t, hv, dv))


def test_ssd_scan(tri):
    torch.manual_seed(2)
    h, p, g, n, s = 4, 6, 2, 8, 10
    batch = _batch(LENS, s, INIT)
    t = batch[4]
    for d, bias in ((torch.randn(h, device=DEV), torch.randn(h, device=DEV)), (None, None)):
        args = [torch.randn(t, h, p, device=DEV), torch.randn(t, h, device=DEV), -torch.rand(h, device=DEV) - 0.5,
                torch.randn(t, g, n, device=DEV), torch.randn(t, g, n, device=DEV), d, bias, True, (0.0, 5.0),
                torch.randn(s, h, p, n, device=DEV) * 0.1, *batch[:4]]
        _run_both(tri, "ssd_scan", args, [9], (t, h, p))


def test_selective_scan(tri):
    torch.manual_seed(3)
    d, n, s = 24, 5, 10
    batch = _batch(LENS, s, INIT)
    t = batch[4]
    for extra in (True, False):
        args = [torch.randn(t, d, device=DEV), torch.randn(t, d, device=DEV), -torch.rand(d, n, device=DEV) - 0.5,
                torch.randn(t, n, device=DEV), torch.randn(t, n, device=DEV),
                torch.randn(d, device=DEV) if extra else None, torch.randn(t, d, device=DEV) if extra else None,
                torch.randn(d, device=DEV) if extra else None, extra, torch.randn(s, d, n, device=DEV) * 0.1,
                *batch[:4]]
        _run_both(tri, "selective_scan", args, [9], (t, d))


def test_linear_attention(tri):
    torch.manual_seed(4)
    h, dk, dv, s = 3, 8, 6, 10
    batch = _batch(LENS, s, INIT)
    t = batch[4]
    args = [torch.randn(t, h, dk, device=DEV) * 0.3, torch.randn(t, h, dk, device=DEV) * 0.3,
            torch.randn(t, h, dv, device=DEV), torch.rand(h, device=DEV) * 0.5, torch.randn(s, h, dk, dv, device=DEV),
            *batch[:4]]
    _run_both(tri, "linear_attention", args, [4], (t, h, dv))


def test_bfloat16_inputs(tri):
    """bf16 activations and conv state, float32 recurrent state (as the layers allocate them)."""
    torch.manual_seed(5)
    hk, hv, dk, dv, s = 1, 2, 16, 16, 10
    batch = _batch(LENS, s, INIT)
    t = batch[4]
    bf = torch.bfloat16
    args = [torch.randn(t, hk, dk, device=DEV, dtype=bf), torch.randn(t, hk, dk, device=DEV, dtype=bf),
            torch.randn(t, hv, dv, device=DEV, dtype=bf), -F.softplus(torch.randn(t, hv, device=DEV)),
            torch.sigmoid(torch.randn(t, hv, device=DEV)), dk ** -0.5, True,
            torch.randn(s, hv, dk, dv, device=DEV) * 0.1, *batch[:4]]
    _run_both(tri, "gated_delta_rule", args, [7], (t, hv, dv), dtype=bf, tol=2e-2)


def test_strided_per_head_parameters(tri):
    """A per-head parameter given as a strided view (a column of a wider tensor) is read correctly."""
    torch.manual_seed(6)
    h, p, g, n, s = 4, 6, 2, 8, 10
    batch = _batch(LENS, s, INIT)
    t = batch[4]
    wide = -torch.rand(h, 3, device=DEV) - 0.5
    args = [torch.randn(t, h, p, device=DEV), torch.randn(t, h, device=DEV), wide[:, 1],
            torch.randn(t, g, n, device=DEV), torch.randn(t, g, n, device=DEV), torch.randn(h, 2, device=DEV)[:, 0],
            None, True, (0.0, 5.0), torch.randn(s, h, p, n, device=DEV) * 0.1, *batch[:4]]
    _run_both(tri, "ssd_scan", args, [9], (t, h, p))

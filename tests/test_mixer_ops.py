"""The varlen state kernels of ``vattn.backends.mamba.torch_ops`` against the float64 references of
``tests/mixer_reference.py``, one suite for all five: mixed batches (decodes and odd-length
prefills, some continuing from a random initial state, one request without tokens, padded requests
past ``num_reqs`` that own tokens of their own), decode-only batches, bfloat16 inputs, and a prefill
split in two chunks against one call. State slots are permuted, and every slot no real request
with tokens names must stay bit-identical, as must the rows of ``out`` past the real tokens."""

from __future__ import annotations

import math
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

from tests import mixer_reference as ref
from vattn.backends.mamba import torch_ops

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

NAMES = ["causal_conv1d", "selective_scan", "ssd_scan", "gated_delta_rule", "linear_attention"]
STATE = {"causal_conv1d": "conv_state", "selective_scan": "ssm_state", "ssd_scan": "ssm_state",
         "gated_delta_rule": "state", "linear_attention": "state"}

# Mixed batch: decodes (1), odd prefills (7, 13, 33), a request without tokens (0).
MIXED_LENS = [1, 7, 1, 0, 13, 1, 33]
MIXED_INIT = [True, False, True, True, True, False, False]
PAD_LENS = [2, 0]  # padded requests after num_reqs: their rows and slots must stay untouched
DECODE_LENS, DECODE_INIT = [1] * 6, [True, True, False, True, False, True]


def _rnd(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


# ---- one random case per kernel: (kwargs without batch and out, out shape per token) ---------------------

def _conv(t: int, s: int, full: bool) -> tuple[dict, tuple[int, ...]]:
    d, k = 12, 4
    wide = _rnd(t, 2 * d)  # x a strided view, as a split of a wider projection
    return dict(x=wide[:, d:], weight=_rnd(d, k) * 0.5, bias=_rnd(d) if full else None,
                conv_state=_rnd(s, d, k - 1), activation="silu" if full else None), (d,)


def _selective(t: int, s: int, full: bool) -> tuple[dict, tuple[int, ...]]:
    d, n = 10, 6
    delta = _rnd(t, d) if full else torch.rand(t, d) * 0.5 + 0.05  # positive when not through softplus
    return dict(u=_rnd(t, d), delta=delta, A=-torch.exp(_rnd(d, n) * 0.5), B=_rnd(t, n), C=_rnd(t, n),
                D_skip=_rnd(d) if full else None, z=_rnd(t, d) if full else None,
                delta_bias=_rnd(d) * 0.3 if full else None, delta_softplus=full, ssm_state=_rnd(s, d, n)), (d,)


def _ssd(t: int, s: int, full: bool) -> tuple[dict, tuple[int, ...]]:
    h, p, g, n = 4, 6, 2, 5
    dt = _rnd(t, h) if full else torch.rand(t, h) + 0.01
    return dict(x=_rnd(t, h, p), dt=dt, A=-torch.exp(_rnd(h)), B=_rnd(t, g, n), C=_rnd(t, g, n),
                D=_rnd(h) if full else None, dt_bias=_rnd(h) * 0.3 if full else None, dt_softplus=full,
                dt_limit=(0.0, math.inf) if full else (0.05, 0.6), ssm_state=_rnd(s, h, p, n)), (h, p)


def _gdn(t: int, s: int, full: bool) -> tuple[dict, tuple[int, ...]]:
    hk, hv, dk, dv = 2, 4, 8, 6  # GQA: value head h reads key head h // 2
    q, k, v = _rnd(t, 2 * hk * dk + hv * dv).split([hk * dk, hk * dk, hv * dv], -1)
    return dict(q=q.view(t, hk, dk), k=k.view(t, hk, dk) * (1.0 if full else 0.3), v=v.view(t, hv, dv),
                g=-F.softplus(_rnd(t, hv)), beta=torch.sigmoid(_rnd(t, hv)), scale=dk ** -0.5 if full else 0.1,
                use_qk_l2norm=full, state=_rnd(s, hv, dk, dv) * 0.5), (hv, dv)


def _linear(t: int, s: int, full: bool) -> tuple[dict, tuple[int, ...]]:
    h, d, dv = 3, 8, 5
    return dict(q=_rnd(t, h, d) * 0.5, k=_rnd(t, h, d) * 0.5, v=_rnd(t, h, dv),
                slope=torch.tensor([1.0, 0.5, 0.1]), state=_rnd(s, h, d, dv)), (h, dv)


CASES: dict[str, Callable[[int, int, bool], tuple[dict, tuple[int, ...]]]] = {
    "causal_conv1d": _conv, "selective_scan": _selective, "ssd_scan": _ssd, "gated_delta_rule": _gdn,
    "linear_attention": _linear}


def _batch(lens: list[int], initial: list[bool], pad_lens: list[int], num_slots: int) -> dict:
    """The batch arguments: real requests ``lens``, then padded ones; permuted slots."""
    all_lens = lens + pad_lens
    qsl = torch.tensor([0] + torch.tensor(all_lens).cumsum(0).tolist(), dtype=torch.int32)
    slots = torch.randperm(num_slots)[: len(all_lens)].to(torch.int32)
    init = torch.tensor(initial + [True] * len(pad_lens))
    return dict(query_start_loc=qsl, state_indices=slots, has_initial_state=init, num_reqs=len(lens))


def _cast(kwargs: dict, dtype: torch.dtype) -> dict:
    return {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            for k, v in kwargs.items()}


def _check(name: str, lens: list[int], initial: list[bool], pad_lens: list[int], dtype: torch.dtype,
           full: bool, tol: float) -> None:
    num_slots = len(lens) + len(pad_lens) + 3
    batch = _batch(lens, initial, pad_lens, num_slots)
    t_real = sum(lens)
    t_all = t_real + sum(pad_lens) + 1  # one more row past every request
    kwargs, out_tail = CASES[name](t_all, num_slots, full)
    kwargs = _cast(kwargs, dtype)
    state0 = kwargs[STATE[name]]
    written = {int(batch["state_indices"][b]) for b, n in enumerate(lens) if n > 0}
    for b, n in enumerate(lens):  # a slot read without its initial state may hold anything
        if n > 0 and not initial[b]:
            state0[int(batch["state_indices"][b])] = float("nan")
    out0 = torch.full((t_all, *out_tail), 7.0, dtype=dtype)

    want_out, want_state = getattr(ref, name)(**kwargs, **batch, out=out0)
    got = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    out = out0.clone()
    getattr(torch_ops, name)(**got, **batch, out=out)

    assert out.dtype == dtype and got[STATE[name]].dtype == dtype
    torch.testing.assert_close(out[:t_real].double(), want_out[:t_real], rtol=tol, atol=tol)
    assert torch.equal(out[t_real:], out0[t_real:]), "rows past the real tokens were written"
    state = got[STATE[name]]
    for slot in range(num_slots):
        if slot in written:
            torch.testing.assert_close(state[slot].double(), want_state[slot], rtol=tol, atol=tol,
                                       msg=lambda m: f"slot {slot}: {m}")
        else:
            assert torch.equal(state[slot], state0[slot]), f"slot {slot} is named by no real request with tokens"
    for k, v in kwargs.items():  # the inputs are read only
        if isinstance(v, torch.Tensor) and k != STATE[name]:
            assert torch.equal(got[k], v)


#: Batches by name: (seed, request lengths, initial states, padded requests' lengths, dtype, optional inputs, tolerance).
BATCHES = {
    "mixed-float32": (0, MIXED_LENS, MIXED_INIT, PAD_LENS, torch.float32, True, 1e-4),
    # No bias / D / z / dt_bias, no softplus, a dt_limit that clamps, no q/k l2 norm.
    "mixed-without-options": (10, MIXED_LENS, MIXED_INIT, PAD_LENS, torch.float32, False, 1e-4),
    "decodes": (20, DECODE_LENS, DECODE_INIT, [0, 0], torch.float32, True, 1e-4),
    # bfloat16 inputs, states and out: float32 math inside, so only the final roundings differ.
    "mixed-bfloat16": (30, MIXED_LENS, MIXED_INIT, PAD_LENS, torch.bfloat16, True, 3e-2),
    # Real requests without tokens and padded ones with tokens: nothing is written.
    "without-tokens": (50, [0, 0], [True, False], [3], torch.float32, True, 0.0),
}


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("name", NAMES)
def test_batch(name, batch):
    seed, lens, init, pad, dtype, full, tol = BATCHES[batch]
    torch.manual_seed(seed + NAMES.index(name))
    _check(name, lens, init, pad, dtype, full=full, tol=tol)


@pytest.mark.parametrize("name", NAMES)
def test_chunked_prefill_equals_one_call(name):
    """A 20-token prefill in chunks of 9 and 11 (the second from the first's state) = one call."""
    torch.manual_seed(40 + NAMES.index(name))
    kwargs, out_tail = CASES[name](20, 4, True)

    def one(lo: int, hi: int, initial: bool) -> dict:  # one request of rows lo:hi in slot 2
        return dict(query_start_loc=torch.tensor([0, hi - lo], dtype=torch.int32),
                    state_indices=torch.tensor([2], dtype=torch.int32),
                    has_initial_state=torch.tensor([initial]), num_reqs=1)

    per_token = {k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == 20
                 and k != STATE[name]}

    whole = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    out_whole = torch.empty(20, *out_tail)
    getattr(torch_ops, name)(**whole, **one(0, 20, False), out=out_whole)

    chunked = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    outs = []
    for lo, hi in ((0, 9), (9, 20)):
        part = {k: (v[lo:hi] if k in per_token else v) for k, v in chunked.items()}
        outs.append(torch.empty(hi - lo, *out_tail))
        getattr(torch_ops, name)(**part, **one(lo, hi, lo > 0), out=outs[-1])
    torch.testing.assert_close(torch.cat(outs), out_whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked[STATE[name]], whole[STATE[name]], rtol=1e-5, atol=1e-5)
    assert torch.equal(chunked[STATE[name]][:2], kwargs[STATE[name]][:2])

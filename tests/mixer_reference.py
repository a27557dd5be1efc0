"""float64 references of the varlen state kernels (``vattn.backends.mamba.torch_ops`` and
``triton_ops``), written straight from the recurrences of the mixer spec: a plain loop over the
requests, then over each request's tokens (and over heads where the spec states it per head).

Each function takes the kernel's arguments by the same names (``out`` included, only for its shape,
dtype and untouched rows) and returns ``(out, new_state)`` as new float64 tensors: ``out`` a copy
of the given one with the real token rows replaced, ``new_state`` a copy of the state tensor
(S, ...) with the slots of the requests that had tokens replaced. Nothing passed in is mutated.
Independent of both kernel modules on purpose.
"""

from __future__ import annotations

import math

import torch

__all__ = ["causal_conv1d", "gated_delta_rule", "linear_attention", "selective_scan", "ssd_scan"]

F64 = torch.float64


def _requests(query_start_loc, state_indices, has_initial_state, num_reqs):
    """(first row, last row + 1, slot, has initial state) of every real request with tokens."""
    qsl = [int(v) for v in query_start_loc.cpu()]
    for b in range(num_reqs):
        if qsl[b + 1] > qsl[b]:
            yield qsl[b], qsl[b + 1], int(state_indices[b]), bool(has_initial_state[b])


def _start(state: torch.Tensor, slot: int, initial: bool) -> torch.Tensor:
    return state[slot].to(F64).clone() if initial else torch.zeros(state.shape[1:], dtype=F64)


def _softplus(x: torch.Tensor) -> torch.Tensor:
    return torch.log1p(torch.exp(x))


def _silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1 + torch.exp(-x))


def causal_conv1d(x, weight, bias, conv_state, query_start_loc, state_indices, has_initial_state, num_reqs,
                  activation, out):
    x, w = x.to(F64), weight.to(F64)
    k = w.shape[1]
    out, new = out.to(F64).clone(), conv_state.to(F64).clone()
    for lo, hi, slot, initial in _requests(query_start_loc, state_indices, has_initial_state, num_reqs):
        past = _start(conv_state, slot, initial).T  # (K-1, D), oldest first
        xext = torch.cat([past, x[lo:hi]])
        for t in range(hi - lo):
            y = sum(w[:, j] * xext[t + j] for j in range(k))
            if bias is not None:
                y = y + bias.to(F64)
            out[lo + t] = _silu(y) if activation == "silu" else y
        new[slot] = xext[xext.shape[0] - (k - 1):].T
    return out, new


def selective_scan(u, delta, A, B, C, D_skip, z, delta_bias, delta_softplus, ssm_state,  # noqa: N803
                   query_start_loc, state_indices, has_initial_state, num_reqs, out):
    u, delta, A, B, C = (t.to(F64) for t in (u, delta, A, B, C))  # noqa: N806
    out, new = out.to(F64).clone(), ssm_state.to(F64).clone()
    for lo, hi, slot, initial in _requests(query_start_loc, state_indices, has_initial_state, num_reqs):
        h = _start(ssm_state, slot, initial)  # (D, N)
        for t in range(lo, hi):
            dt = delta[t] + (delta_bias.to(F64) if delta_bias is not None else 0)
            if delta_softplus:
                dt = _softplus(dt)
            h = torch.exp(dt[:, None] * A) * h + (dt * u[t])[:, None] * B[t][None, :]
            y = (h * C[t][None, :]).sum(-1)
            if D_skip is not None:
                y = y + D_skip.to(F64) * u[t]
            if z is not None:
                y = y * _silu(z[t].to(F64))
            out[t] = y
        new[slot] = h
    return out, new


def ssd_scan(x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit, ssm_state, query_start_loc,  # noqa: N803
             state_indices, has_initial_state, num_reqs, out):
    x, dt, A, B, C = (t.to(F64) for t in (x, dt, A, B, C))  # noqa: N806
    heads, groups = x.shape[1], B.shape[1]
    out, new = out.to(F64).clone(), ssm_state.to(F64).clone()
    for lo, hi, slot, initial in _requests(query_start_loc, state_indices, has_initial_state, num_reqs):
        state = _start(ssm_state, slot, initial)  # (H, P, N)
        for t in range(lo, hi):
            for hd in range(heads):
                g = hd // (heads // groups)
                d = dt[t, hd] + (dt_bias[hd].to(F64) if dt_bias is not None else 0)
                if dt_softplus:
                    d = _softplus(d)
                d = min(max(float(d), dt_limit[0]), dt_limit[1])
                state[hd] = math.exp(d * float(A[hd])) * state[hd] + d * x[t, hd][:, None] * B[t, g][None, :]
                y = (state[hd] * C[t, g][None, :]).sum(-1)
                out[t, hd] = y + (D[hd].to(F64) * x[t, hd] if D is not None else 0)
        new[slot] = state
    return out, new


def gated_delta_rule(q, k, v, g, beta, scale, use_qk_l2norm, state, query_start_loc, state_indices,
                     has_initial_state, num_reqs, out):
    q, k, v, g, beta = (t.to(F64) for t in (q, k, v, g, beta))
    hk, hv = q.shape[1], v.shape[1]
    out, new = out.to(F64).clone(), state.to(F64).clone()
    for lo, hi, slot, initial in _requests(query_start_loc, state_indices, has_initial_state, num_reqs):
        s_all = _start(state, slot, initial)  # (HV, Dk, Dv)
        for t in range(lo, hi):
            for h in range(hv):
                qt, kt = q[t, h // (hv // hk)], k[t, h // (hv // hk)]
                if use_qk_l2norm:
                    qt = qt / torch.sqrt((qt * qt).sum() + 1e-6)
                    kt = kt / torch.sqrt((kt * kt).sum() + 1e-6)
                s = s_all[h] * torch.exp(g[t, h])
                u = beta[t, h] * (v[t, h] - s.T @ kt)
                s = s + torch.outer(kt, u)
                out[t, h] = s.T @ (qt * scale)
                s_all[h] = s
        new[slot] = s_all
    return out, new


def linear_attention(q, k, v, slope, state, query_start_loc, state_indices, has_initial_state, num_reqs, out):
    q, k, v, slope = (t.to(F64) for t in (q, k, v, slope))
    out, new = out.to(F64).clone(), state.to(F64).clone()
    for lo, hi, slot, initial in _requests(query_start_loc, state_indices, has_initial_state, num_reqs):
        s_all = _start(state, slot, initial)  # (H, D, Dv)
        for t in range(lo, hi):
            for h in range(q.shape[1]):
                s_all[h] = torch.exp(-slope[h]) * s_all[h] + torch.outer(k[t, h], v[t, h])
                out[t, h] = s_all[h].T @ q[t, h]
        new[slot] = s_all
    return out, new

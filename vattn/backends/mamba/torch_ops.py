"""The varlen state kernels in plain torch: the CPU path of every mixer backend (and a fallback on
any device; on CUDA the backends use ``vattn.backends.mamba.triton_ops``, same signatures).

| function | per-token inputs | state per slot | recurrence |
| --- | --- | --- | --- |
| ``causal_conv1d`` | x (T, D) | (D, K-1) | ``y_t = act(b + sum_j w[:, j] x_{t-K+1+j})`` |
| ``selective_scan`` | u, delta (T, D); B, C (T, N) | (D, N) | ``h = exp(dt A) h + dt u B``; ``y = h C + D u`` |
| ``ssd_scan`` | x (T, H, P); dt (T, H); B, C (T, G, N) | (H, P, N) | ``h = exp(dt A) h + dt x B^T``; ``y = h C + D x`` |
| ``gated_delta_rule`` | q, k (T, HK, Dk); v (T, HV, Dv); g, beta (T, HV) | (HV, Dk, Dv) | ``S = e^g S``; ``S += k (beta (v - S^T k))^T``; ``o = S^T q`` |
| ``linear_attention`` | q, k (T, H, D); v (T, H, Dv) | (H, D, Dv) | ``S = e^-slope S + k v^T``; ``o = S^T q`` |

Common arguments: request b owns token rows ``query_start_loc[b]:query_start_loc[b+1]`` and state
slot ``state_indices[b]``; ``has_initial_state[b]`` False starts it from zeros; only the first
``num_reqs`` requests are real; a request with no new token leaves its slot untouched; ``out``'s
rows of real tokens are written, nothing else. Math in float32.

The requests are padded to (R, L) (R requests with tokens, L the longest) and the recurrences
step over L with every request's state updated at once; a decode batch is one step. The batch
layout is read on the host (``query_start_loc.tolist()``), which on CUDA is a sync: the fallback
is for correctness, not speed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["causal_conv1d", "gated_delta_rule", "linear_attention", "selective_scan", "ssd_scan"]


class _Batch:
    """The real requests with tokens, padded: ``index`` (R, L) token rows (clamped), ``mask`` (R, L)."""

    def __init__(self, query_start_loc: torch.Tensor, state_indices: torch.Tensor, has_initial_state: torch.Tensor,
                 num_reqs: int, num_slots: int) -> None:
        qsl = query_start_loc[: num_reqs + 1].tolist()
        lens = [qsl[b + 1] - qsl[b] for b in range(num_reqs)]
        reqs = [b for b in range(num_reqs) if lens[b] > 0]
        dev = query_start_loc.device
        self.empty = not reqs
        if self.empty:
            return
        self.lens = torch.tensor([lens[b] for b in reqs], device=dev)
        starts = torch.tensor([qsl[b] for b in reqs], device=dev)
        self.length = int(max(lens[b] for b in reqs))
        steps = torch.arange(self.length, device=dev)
        self.mask = steps[None, :] < self.lens[:, None]
        self.index = (starts[:, None] + torch.minimum(steps[None, :], self.lens[:, None] - 1)).long()
        rows = torch.tensor(reqs, device=dev)
        self.slots = state_indices[rows].long().clamp(0, num_slots - 1)
        self.initial = has_initial_state[rows].bool()
        self.decode = self.length == 1

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """(T, ...) -> (R, L, ...) float32."""
        return x[self.index].float()

    def scatter(self, out: torch.Tensor, y: torch.Tensor) -> None:
        """Write (R, L, ...) back to the real token rows of ``out``."""
        out[self.index[self.mask]] = y[self.mask].to(out.dtype)

    def initial_state(self, state: torch.Tensor) -> torch.Tensor:
        s = state[self.slots].float()
        return torch.where(self.initial.view(-1, *([1] * (s.dim() - 1))), s, torch.zeros_like(s))

    def store(self, state: torch.Tensor, value: torch.Tensor) -> None:
        state[self.slots] = value.to(state.dtype)

    def step(self, t: int) -> torch.Tensor:
        """(R, 1, ...)-broadcastable mask of requests that have token ``t``."""
        return self.mask[:, t]


def _keep(batch: _Batch, t: int, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``new`` for requests with token ``t``, ``old`` for the rest."""
    if batch.decode:
        return new
    m = batch.step(t).view(-1, *([1] * (new.dim() - 1)))
    return torch.where(m, new, old)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                  query_start_loc: torch.Tensor, state_indices: torch.Tensor, has_initial_state: torch.Tensor,
                  num_reqs: int, activation: str | None, out: torch.Tensor) -> None:
    """Depthwise causal conv over each request's tokens, continuing from its conv state.

    x (T, D), weight (D, K), bias (D,) or None, conv_state (S, D, K-1) (oldest input first),
    activation None or "silu", out (T, D)."""
    b = _Batch(query_start_loc, state_indices, has_initial_state, num_reqs, conv_state.shape[0])
    if b.empty:
        return
    k = weight.shape[1]
    past = b.initial_state(conv_state).transpose(1, 2)  # (R, K-1, D)
    xs = b.gather(x) * b.mask[..., None]  # (R, L, D)
    ext = torch.cat([past, xs], dim=1)  # (R, K-1+L, D)
    w = weight.float()
    y = sum(ext[:, j:j + b.length] * w[:, j] for j in range(k))
    if bias is not None:
        y = y + bias.float()
    if activation == "silu":
        y = F.silu(y)
    b.scatter(out, y)
    # The new state: the K-1 inputs before each request's next token, ext rows [len, len + K-1).
    tail = b.lens[:, None] + torch.arange(k - 1, device=x.device)[None, :]  # (R, K-1)
    new = torch.gather(ext, 1, tail[..., None].expand(-1, -1, ext.shape[2]))
    b.store(conv_state, new.transpose(1, 2))


def selective_scan(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor,  # noqa: N803
                   C: torch.Tensor, D_skip: torch.Tensor | None, z: torch.Tensor | None,  # noqa: N803
                   delta_bias: torch.Tensor | None, delta_softplus: bool, ssm_state: torch.Tensor,
                   query_start_loc: torch.Tensor, state_indices: torch.Tensor, has_initial_state: torch.Tensor,
                   num_reqs: int, out: torch.Tensor) -> None:
    """Mamba's selective scan: u, delta, z (T, D); A (D, N); B, C (T, N); ssm_state (S, D, N)."""
    b = _Batch(query_start_loc, state_indices, has_initial_state, num_reqs, ssm_state.shape[0])
    if b.empty:
        return
    dt = b.gather(delta) + (delta_bias.float() if delta_bias is not None else 0.0)
    dt = F.softplus(dt) if delta_softplus else dt
    us, bs, cs, a = b.gather(u), b.gather(B), b.gather(C), A.float()
    h = b.initial_state(ssm_state)  # (R, D, N)
    ys = []
    for t in range(b.length):
        new = torch.exp(dt[:, t, :, None] * a) * h + (dt[:, t] * us[:, t])[..., None] * bs[:, t, None, :]
        h = _keep(b, t, new, h)
        ys.append((h * cs[:, t, None, :]).sum(-1))
    y = torch.stack(ys, 1)
    if D_skip is not None:
        y = y + us * D_skip.float()
    if z is not None:
        y = y * F.silu(b.gather(z))
    b.scatter(out, y)
    b.store(ssm_state, h)


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,  # noqa: N803
             D: torch.Tensor | None, dt_bias: torch.Tensor | None, dt_softplus: bool,  # noqa: N803
             dt_limit: tuple[float, float], ssm_state: torch.Tensor, query_start_loc: torch.Tensor,
             state_indices: torch.Tensor, has_initial_state: torch.Tensor, num_reqs: int, out: torch.Tensor) -> None:
    """Mamba2's scan: x (T, H, P), dt (T, H), A (H,), B, C (T, G, N), D (H,), ssm_state (S, H, P, N)."""
    bt = _Batch(query_start_loc, state_indices, has_initial_state, num_reqs, ssm_state.shape[0])
    if bt.empty:
        return
    h_count, g_count = x.shape[1], B.shape[1]
    d = bt.gather(dt) + (dt_bias.float() if dt_bias is not None else 0.0)
    d = F.softplus(d) if dt_softplus else d
    d = d.clamp(dt_limit[0], dt_limit[1])  # (R, L, H)
    xs = bt.gather(x)  # (R, L, H, P)
    rep = h_count // g_count
    bs = bt.gather(B).repeat_interleave(rep, dim=2)  # (R, L, H, N)
    cs = bt.gather(C).repeat_interleave(rep, dim=2)
    a = A.float()
    h = bt.initial_state(ssm_state)  # (R, H, P, N)
    ys = []
    for t in range(bt.length):
        dtt = d[:, t]  # (R, H)
        new = torch.exp(dtt * a)[..., None, None] * h + (dtt[..., None] * xs[:, t])[..., None] * bs[:, t, :, None, :]
        h = _keep(bt, t, new, h)
        ys.append((h * cs[:, t, :, None, :]).sum(-1))
    y = torch.stack(ys, 1)
    if D is not None:
        y = y + xs * D.float()[:, None]
    bt.scatter(out, y)
    bt.store(ssm_state, h)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     scale: float, use_qk_l2norm: bool, state: torch.Tensor, query_start_loc: torch.Tensor,
                     state_indices: torch.Tensor, has_initial_state: torch.Tensor, num_reqs: int,
                     out: torch.Tensor) -> None:
    """The gated delta rule: q, k (T, HK, Dk), v (T, HV, Dv), g, beta (T, HV), state (S, HV, Dk, Dv)."""
    b = _Batch(query_start_loc, state_indices, has_initial_state, num_reqs, state.shape[0])
    if b.empty:
        return
    rep = v.shape[1] // q.shape[1]
    qs, ks = b.gather(q), b.gather(k)
    if use_qk_l2norm:
        qs, ks = _l2norm(qs), _l2norm(ks)
    qs, ks = qs.repeat_interleave(rep, dim=2) * scale, ks.repeat_interleave(rep, dim=2)  # (R, L, HV, Dk)
    vs, gs, bs = b.gather(v), b.gather(g), b.gather(beta)
    s = b.initial_state(state)  # (R, HV, Dk, Dv)
    ys = []
    for t in range(b.length):
        decayed = s * torch.exp(gs[:, t])[..., None, None]
        kt = ks[:, t]
        u = bs[:, t, :, None] * (vs[:, t] - torch.einsum("rhkv,rhk->rhv", decayed, kt))
        s = _keep(b, t, decayed + kt[..., None] * u[..., None, :], s)
        ys.append(torch.einsum("rhkv,rhk->rhv", s, qs[:, t]))
    b.scatter(out, torch.stack(ys, 1))
    b.store(state, s)


def linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor, state: torch.Tensor,
                     query_start_loc: torch.Tensor, state_indices: torch.Tensor, has_initial_state: torch.Tensor,
                     num_reqs: int, out: torch.Tensor) -> None:
    """Lightning attention with decay: q, k (T, H, D), v (T, H, Dv), slope (H,), state (S, H, D, Dv)."""
    b = _Batch(query_start_loc, state_indices, has_initial_state, num_reqs, state.shape[0])
    if b.empty:
        return
    qs, ks, vs = b.gather(q), b.gather(k), b.gather(v)
    decay = torch.exp(-slope.float())[:, None, None]
    s = b.initial_state(state)  # (R, H, D, Dv)
    ys = []
    for t in range(b.length):
        s = _keep(b, t, decay * s + ks[:, t, ..., None] * vs[:, t, :, None, :], s)
        ys.append(torch.einsum("rhkv,rhk->rhv", s, qs[:, t]))
    b.scatter(out, torch.stack(ys, 1))
    b.store(state, s)

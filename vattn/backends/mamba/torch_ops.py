"""The varlen state kernels in plain torch: the CPU path of every mixer backend, and a fallback on
any device (on CUDA the backends use ``vattn.backends.mamba.triton_ops``, same names and signatures).

| function | per-token inputs | state per slot | recurrence (per request, per token t) |
| --- | --- | --- | --- |
| ``causal_conv1d`` | x (T, D) | (D, K-1) | ``y_t = act(b + sum_j w[:, j] x_{t-K+1+j})`` |
| ``selective_scan`` | u, delta, z (T, D); B, C (T, N) | (D, N) | ``h = exp(dt A) h + dt u B``; ``y = h C + D u`` |
| ``ssd_scan`` | x (T, H, P); dt (T, H); B, C (T, G, N) | (H, P, N) | ``h = exp(dt A) h + dt x B^T``; ``y = h C + D x`` |
| ``gated_delta_rule`` | q, k (T, HK, Dk); v (T, HV, Dv); g, beta (T, HV) | (HV, Dk, Dv) | ``S = e^g S``; ``S += k (beta (v - S^T k))^T``; ``o = S^T q`` |
| ``linear_attention`` | q, k (T, H, D); v (T, H, Dv) | (H, D, Dv) | ``S = e^-slope S + k v^T``; ``o = S^T q`` |

Common arguments: request b owns token rows ``query_start_loc[b]:query_start_loc[b+1]`` and state
slot ``state_indices[b]`` (dim 0 of every state tensor); ``has_initial_state[b]`` False starts it
from zeros whatever its slot holds; only the first ``num_reqs`` requests are read (B may be larger:
CUDA-graph padding). A request with no new token leaves its slot untouched, and so is every slot no
request names (bit-identical). Only ``out``'s rows of real tokens (< ``query_start_loc[num_reqs]``)
are written. The math runs in float32 (float64 inputs stay float64); ``out`` and the states keep
their dtypes.

How: the requests with tokens are gathered into a padded (R, L, ...) layout (R such requests, L the
longest), and each recurrence steps over L with the state of all R requests updated at once; a
request shorter than L keeps its state through the padded steps. A decode batch (one token each)
is a single step. The batch layout is read on the host once (``query_start_loc[:num_reqs + 1]`` is
copied to the CPU: free on the CPU, one sync on an accelerator, where this path is a fallback for
correctness rather than speed); nothing else leaves the device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["causal_conv1d", "gated_delta_rule", "linear_attention", "selective_scan", "ssd_scan"]


class _Batch:
    """The real requests with at least one token, padded to (R, L).

    ``index`` (R, L): token row of each (request, step), clamped to the request's last token in the
    padding; ``active`` (R, L) bool: the step is a real token; ``slots`` (R,), ``initial`` (R,);
    ``rows`` the slice of real token rows and ``flat`` their positions in the padded (R*L) layout."""

    def __init__(self, query_start_loc: torch.Tensor, state_indices: torch.Tensor, has_initial_state: torch.Tensor,
                 num_reqs: int, device: torch.device) -> None:
        qsl = query_start_loc[: num_reqs + 1].to("cpu", torch.int64)  # the one host read
        lens = qsl[1:] - qsl[:-1]
        reqs = torch.nonzero(lens > 0).flatten()
        self.empty = reqs.numel() == 0
        if self.empty:
            return
        lens, starts = lens[reqs], qsl[:-1][reqs]
        r = reqs.numel()
        self.length = int(lens.max())
        self.min_length = int(lens.min())  # steps below this need no masking
        steps = torch.arange(self.length)
        index = starts[:, None] + torch.minimum(steps[None, :], lens[:, None] - 1)
        owner = torch.repeat_interleave(torch.arange(r), lens)  # (real tokens,) -> request
        flat = owner * self.length + torch.arange(owner.numel()) - (torch.cumsum(lens, 0) - lens)[owner]
        self.rows = slice(int(qsl[0]), int(qsl[-1]))
        self.index = index.to(device, non_blocking=True)
        self.flat = flat.to(device, non_blocking=True)
        self.lens = lens.to(device, non_blocking=True)
        self.active = steps.to(device)[None, :] < self.lens[:, None]
        sel = reqs.to(state_indices.device, non_blocking=True)
        self.slots = state_indices[sel].to(device, torch.int64)
        self.initial = has_initial_state[reqs.to(has_initial_state.device)].to(device, torch.bool)

    def gather(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(T, ...) -> (R, L, ...) in ``dtype``."""
        return x[self.index].to(dtype)

    def scatter(self, out: torch.Tensor, y: torch.Tensor) -> None:
        """Write the real steps of ``y`` (R, L, ...) to the real token rows of ``out`` (T, ...)."""
        out[self.rows] = y.flatten(0, 1)[self.flat].to(out.dtype)

    def load(self, state: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The requests' initial states (R, ...): their slots' contents, or zeros."""
        s = state.index_select(0, self.slots).to(dtype)
        return torch.where(self.initial.view(-1, *([1] * (s.dim() - 1))), s, torch.zeros((), dtype=dtype,
                                                                                           device=s.device))

    def store(self, state: torch.Tensor, value: torch.Tensor) -> None:
        state.index_copy_(0, self.slots, value.to(state.dtype))

    def keep(self, t: int, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        """``new`` for the requests that have step ``t``, ``old`` for those already finished."""
        if t < self.min_length:
            return new
        return torch.where(self.active[:, t].view(-1, *([1] * (new.dim() - 1))), new, old)


def _math_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                  query_start_loc: torch.Tensor, state_indices: torch.Tensor, has_initial_state: torch.Tensor,
                  num_reqs: int, activation: str | None, out: torch.Tensor) -> None:
    """Depthwise causal conv over each request's tokens, continuing from its conv state.

    x (T, D), weight (D, K), bias (D,) or None, conv_state (S, D, K-1) (``[s, :, j]`` = the input
    K-1-j tokens before the next one: oldest first), activation None or "silu", out (T, D)."""
    if activation not in (None, "silu"):
        raise ValueError(f"causal_conv1d: activation must be None or 'silu', got {activation!r}; "
                         "apply other activations to the output instead")
    b = _Batch(query_start_loc, state_indices, has_initial_state, num_reqs, x.device)
    if b.empty:
        return
    dt, k = _math_dtype(x), weight.shape[1]
    past = b.load(conv_state, dt).transpose(1, 2)  # (R, K-1, D)
    ext = torch.cat([past, b.gather(x, dt)], dim=1)  # (R, K-1+L, D)
    w = weight.to(dt)
    y = ext[:, 0:b.length] * w[:, 0]
    for j in range(1, k):
        y = y + ext[:, j:j + b.length] * w[:, j]
    if bias is not None:
        y = y + bias.to(dt)
    if activation == "silu":
        y = F.silu(y)
    b.scatter(out, y)
    # The new state: the last K-1 rows of cat(past, the request's tokens) = ext rows [len, len+K-1).
    tail = b.lens[:, None] + torch.arange(k - 1, device=x.device)[None, :]  # (R, K-1)
    new = torch.gather(ext, 1, tail[..., None].expand(-1, -1, ext.shape[2]))
    b.store(conv_state, new.transpose(1, 2))


def selective_scan(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor,  # noqa: N803
                   C: torch.Tensor, D_skip: torch.Tensor | None, z: torch.Tensor | None,  # noqa: N803
                   delta_bias: torch.Tensor | None, delta_softplus: bool, ssm_state: torch.Tensor,
                   query_start_loc: torch.Tensor, state_indices: torch.Tensor, has_initial_state: torch.Tensor,
                   num_reqs: int, out: torch.Tensor) -> None:
    """Mamba's selective scan (Gu & Dao, 2023).

    u, delta, z (T, D); A (D, N); B, C (T, N); D_skip, delta_bias (D,); ssm_state (S, D, N); out (T, D).
    ``dt = softplus(delta + delta_bias)`` (or without softplus), ``h = exp(dt A) h + (dt u) B``,
    ``y = h C + D_skip u``, then ``y *= silu(z)`` when z is given."""
    b = _Batch(query_start_loc, state_indices, has_initial_state, num_reqs, u.device)
    if b.empty:
        return
    f = _math_dtype(u)
    dt = b.gather(delta, f) + (delta_bias.to(f) if delta_bias is not None else 0.0)
    dt = F.softplus(dt) if delta_softplus else dt  # (R, L, D)
    us, bs, cs, a = b.gather(u, f), b.gather(B, f), b.gather(C, f), A.to(f)
    h = b.load(ssm_state, f)  # (R, D, N)
    ys = []
    for t in range(b.length):
        new = torch.exp(dt[:, t, :, None] * a) * h + (dt[:, t] * us[:, t])[..., None] * bs[:, t, None, :]
        h = b.keep(t, new, h)
        ys.append((h * cs[:, t, None, :]).sum(-1))
    y = torch.stack(ys, 1)
    if D_skip is not None:
        y = y + us * D_skip.to(f)
    if z is not None:
        y = y * F.silu(b.gather(z, f))
    b.scatter(out, y)
    b.store(ssm_state, h)


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,  # noqa: N803
             D: torch.Tensor | None, dt_bias: torch.Tensor | None, dt_softplus: bool,  # noqa: N803
             dt_limit: tuple[float, float], ssm_state: torch.Tensor, query_start_loc: torch.Tensor,
             state_indices: torch.Tensor, has_initial_state: torch.Tensor, num_reqs: int, out: torch.Tensor) -> None:
    """Mamba2's scan with a scalar decay per head (Dao & Gu, 2024), one token at a time.

    x (T, H, P), dt (T, H), A (H,), B, C (T, G, N) (head h reads group h // (H // G)), D, dt_bias (H,),
    ssm_state (S, H, P, N), out (T, H, P). ``dt = clamp(softplus(dt + dt_bias), *dt_limit)``,
    ``h = exp(dt A) h + dt x B^T``, ``y = h C + D x``."""
    if x.shape[1] % B.shape[1] != 0:
        raise ValueError(f"ssd_scan: the heads of x ({x.shape[1]}) must be a multiple of the groups of B "
                         f"({B.shape[1]}); pass B and C as (T, G, N) with G dividing H")
    bt = _Batch(query_start_loc, state_indices, has_initial_state, num_reqs, x.device)
    if bt.empty:
        return
    f, rep = _math_dtype(x), x.shape[1] // B.shape[1]
    d = bt.gather(dt, f) + (dt_bias.to(f) if dt_bias is not None else 0.0)
    d = F.softplus(d) if dt_softplus else d
    d = d.clamp(dt_limit[0], dt_limit[1])  # (R, L, H)
    xs = bt.gather(x, f)  # (R, L, H, P)
    bs = bt.gather(B, f).repeat_interleave(rep, dim=2)  # (R, L, H, N)
    cs = bt.gather(C, f).repeat_interleave(rep, dim=2)
    decay = torch.exp(d * A.to(f))  # (R, L, H)
    h = bt.load(ssm_state, f)  # (R, H, P, N)
    ys = []
    for t in range(bt.length):
        new = decay[:, t, :, None, None] * h + (d[:, t, :, None] * xs[:, t])[..., None] * bs[:, t, :, None, :]
        h = bt.keep(t, new, h)
        ys.append((h * cs[:, t, :, None, :]).sum(-1))
    y = torch.stack(ys, 1)
    if D is not None:
        y = y + xs * D.to(f)[:, None]
    bt.scatter(out, y)
    bt.store(ssm_state, h)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     scale: float, use_qk_l2norm: bool, state: torch.Tensor, query_start_loc: torch.Tensor,
                     state_indices: torch.Tensor, has_initial_state: torch.Tensor, num_reqs: int,
                     out: torch.Tensor) -> None:
    """The gated delta rule (Yang, Kautz & Hatamizadeh, 2024), fla's layout.

    q, k (T, HK, Dk), v (T, HV, Dv) (value head h reads key head h // (HV // HK)), g (T, HV) (log
    decay, <= 0), beta (T, HV), state (S, HV, Dk, Dv), out (T, HV, Dv).
    ``S = e^g S``, ``S += k (beta (v - S^T k))^T``, ``o = S^T (scale q)``."""
    if v.shape[1] % q.shape[1] != 0:
        raise ValueError(f"gated_delta_rule: the value heads ({v.shape[1]}) must be a multiple of the key "
                         f"heads ({q.shape[1]}); pass q, k as (T, HK, Dk) and v as (T, HV, Dv)")
    b = _Batch(query_start_loc, state_indices, has_initial_state, num_reqs, v.device)
    if b.empty:
        return
    f, rep = _math_dtype(v), v.shape[1] // q.shape[1]
    qs, ks = b.gather(q, f), b.gather(k, f)
    if use_qk_l2norm:
        qs, ks = _l2norm(qs), _l2norm(ks)
    qs, ks = qs.repeat_interleave(rep, dim=2) * scale, ks.repeat_interleave(rep, dim=2)  # (R, L, HV, Dk)
    vs, decay, bs = b.gather(v, f), torch.exp(b.gather(g, f)), b.gather(beta, f)
    s = b.load(state, f)  # (R, HV, Dk, Dv)
    ys = []
    for t in range(b.length):
        decayed = s * decay[:, t, :, None, None]
        kt = ks[:, t]
        u = bs[:, t, :, None] * (vs[:, t] - torch.einsum("rhkv,rhk->rhv", decayed, kt))
        s = b.keep(t, decayed + kt[..., None] * u[..., None, :], s)
        ys.append(torch.einsum("rhkv,rhk->rhv", s, qs[:, t]))
    b.scatter(out, torch.stack(ys, 1))
    b.store(state, s)


def linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor, state: torch.Tensor,
                     query_start_loc: torch.Tensor, state_indices: torch.Tensor, has_initial_state: torch.Tensor,
                     num_reqs: int, out: torch.Tensor) -> None:
    """Lightning attention with a per-head decay (MiniMax-01), q not scaled.

    q, k (T, H, D), v (T, H, Dv), slope (H,), state (S, H, D, Dv), out (T, H, Dv).
    ``S = exp(-slope) S + k v^T``, ``o = S^T q``."""
    b = _Batch(query_start_loc, state_indices, has_initial_state, num_reqs, v.device)
    if b.empty:
        return
    f = _math_dtype(v)
    qs, ks, vs = b.gather(q, f), b.gather(k, f), b.gather(v, f)
    decay = torch.exp(-slope.to(f))[:, None, None]  # (H, 1, 1)
    s = b.load(state, f)  # (R, H, D, Dv)
    ys = []
    for t in range(b.length):
        s = b.keep(t, decay * s + ks[:, t, ..., None] * vs[:, t, :, None, :], s)
        ys.append(torch.einsum("rhkv,rhk->rhv", s, qs[:, t]))
    b.scatter(out, torch.stack(ys, 1))
    b.store(state, s)

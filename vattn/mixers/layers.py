"""The Mamba-family layers: ``ShortConv``, ``GatedDeltaNet``, ``Mamba2Mixer``, ``Mamba1Mixer``,
``LinearAttention``. Each takes the step's tokens flattened to (T, ...) and the model's weights,
and keeps each request's state in its slot (see ``vattn.mixers.base``)."""

from __future__ import annotations

import math
from typing import Any

import torch

from vattn.mixers.base import MambaBase

__all__ = ["GatedDeltaNet", "LinearAttention", "Mamba1Mixer", "Mamba2Mixer", "ShortConv"]


def _positive(where: str, **values: Any) -> None:
    for name, v in values.items():
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{where}: {name}: expected a positive int, got {v!r}; pass the model config's value.")


def _out(x: torch.Tensor, *shape: int) -> torch.Tensor:
    # As vattn.Attention's output: rows of padding tokens that no request owns are not written.
    return torch.empty(shape, dtype=x.dtype, device=x.device)


class ShortConv(MambaBase):
    """A causal depthwise convolution with a conv state of the last ``kernel_size - 1`` inputs (LFM2).

    ``forward(x (T, dim), weight (dim, K) or (dim, 1, K), bias (dim,) | None) -> (T, dim)``;
    ``activation``: None or ``"silu"``. State: (dim, K-1) in the model's dtype."""

    mamba_type = "short_conv"

    def __init__(self, dim: int, kernel_size: int, *, activation: str | None = None, prefix: str,
                 mamba_backend: Any = None) -> None:
        _positive(f"vattn.ShortConv({prefix!r})", dim=dim, kernel_size=kernel_size)
        if activation not in (None, "silu"):
            raise ValueError(f"vattn.ShortConv({prefix!r}): activation: expected None or 'silu', got {activation!r}.")
        self.dim, self.kernel_size, self.activation = dim, kernel_size, activation
        super().__init__(prefix=prefix, mamba_backend=mamba_backend)

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        return ((self.dim, self.kernel_size - 1),)

    def get_state_dtype(self, dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        return (self.conv_state_dtype(dtype),)

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x = self._tokens("x", x, self.dim, f"vattn.ShortConv({self.layer_name!r})")
        out = _out(x, x.shape[0], self.dim)
        return self._run([x, weight.reshape(self.dim, self.kernel_size), bias], out)


class GatedDeltaNet(MambaBase):
    """Gated DeltaNet (Qwen3-Next's linear-attention layers): causal conv (silu) over the mixed
    q/k/v, then the gated delta rule per value head.

    ``forward(mixed_qkv (T, 2*HK*Dk + HV*Dv), conv_weight (conv_dim, K), conv_bias | None,
    g (T, HV), beta (T, HV)) -> (T, HV, Dv)``: q, k and v are split from the conv output in that
    order; ``g`` is the log of each token's decay (<= 0), ``beta`` its write strength; value head
    h reads key head ``h // (HV // HK)``. State: conv (conv_dim, K-1) in the model's dtype and the
    recurrent state (HV, Dk, Dv) in float32 (``CacheConfig`` chooses both)."""

    mamba_type = "gdn_attention"

    def __init__(self, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel_size: int = 4, *, use_qk_l2norm: bool = True, scale: float | None = None, prefix: str,
                 mamba_backend: Any = None) -> None:
        where = f"vattn.GatedDeltaNet({prefix!r})"
        _positive(where, num_k_heads=num_k_heads, num_v_heads=num_v_heads, head_k_dim=head_k_dim,
                  head_v_dim=head_v_dim, conv_kernel_size=conv_kernel_size)
        if num_v_heads % num_k_heads:
            raise ValueError(f"{where}: num_v_heads: expected a multiple of num_k_heads = {num_k_heads}, got "
                             f"{num_v_heads}; pass the model config's head counts.")
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim, self.conv_kernel_size = head_k_dim, head_v_dim, conv_kernel_size
        self.use_qk_l2norm = bool(use_qk_l2norm)
        self.scale = head_k_dim ** -0.5 if scale is None else float(scale)
        self.conv_dim = 2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim
        super().__init__(prefix=prefix, mamba_backend=mamba_backend)

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        return ((self.conv_dim, self.conv_kernel_size - 1), (self.num_v_heads, self.head_k_dim, self.head_v_dim))

    def get_state_dtype(self, dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        return (self.conv_state_dtype(dtype), self.ssm_state_dtype(dtype))

    def forward(self, mixed_qkv: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        mixed_qkv = self._tokens("mixed_qkv", mixed_qkv, self.conv_dim, f"vattn.GatedDeltaNet({self.layer_name!r})")
        out = _out(mixed_qkv, mixed_qkv.shape[0], self.num_v_heads, self.head_v_dim)
        weight = conv_weight.reshape(self.conv_dim, self.conv_kernel_size)
        return self._run([mixed_qkv, weight, conv_bias, g, beta], out)


class Mamba2Mixer(MambaBase):
    """Mamba2's SSD core: causal conv (silu) over ``xBC``, split into x (H, P), B and C (G, N),
    then the selective state update with a scalar decay per head.

    ``forward(xBC (T, H*P + 2*G*N), conv_weight (conv_dim, K), conv_bias | None, dt (T, H),
    A (H,), D (H,) | None, dt_bias (H,) | None) -> (T, H, P)``; dt goes through softplus and is
    clamped to ``dt_limit``. The gated norm and output projection stay in the model. State: conv
    (conv_dim, K-1) in the model's dtype and the SSM state (H, P, N) in float32."""

    mamba_type = "mamba2"

    def __init__(self, num_heads: int, head_dim: int, state_size: int, n_groups: int = 1, conv_kernel_size: int = 4,
                 *, dt_limit: tuple[float, float] = (0.0, math.inf), prefix: str, mamba_backend: Any = None) -> None:
        where = f"vattn.Mamba2Mixer({prefix!r})"
        _positive(where, num_heads=num_heads, head_dim=head_dim, state_size=state_size, n_groups=n_groups,
                  conv_kernel_size=conv_kernel_size)
        if num_heads % n_groups:
            raise ValueError(f"{where}: n_groups: expected a divisor of num_heads = {num_heads}, got {n_groups}.")
        self.num_heads, self.head_dim, self.state_size, self.n_groups = num_heads, head_dim, state_size, n_groups
        self.conv_kernel_size = conv_kernel_size
        self.dt_limit = (float(dt_limit[0]), float(dt_limit[1]))
        self.conv_dim = num_heads * head_dim + 2 * n_groups * state_size
        super().__init__(prefix=prefix, mamba_backend=mamba_backend)

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        return ((self.conv_dim, self.conv_kernel_size - 1), (self.num_heads, self.head_dim, self.state_size))

    def get_state_dtype(self, dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        return (self.conv_state_dtype(dtype), self.ssm_state_dtype(dtype))

    def forward(self, xBC: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,  # noqa: N803
                dt: torch.Tensor, A: torch.Tensor, D: torch.Tensor | None = None,  # noqa: N803
                dt_bias: torch.Tensor | None = None) -> torch.Tensor:
        xBC = self._tokens("xBC", xBC, self.conv_dim, f"vattn.Mamba2Mixer({self.layer_name!r})")  # noqa: N806
        out = _out(xBC, xBC.shape[0], self.num_heads, self.head_dim)
        weight = conv_weight.reshape(self.conv_dim, self.conv_kernel_size)
        return self._run([xBC, weight, conv_bias, dt, A, D, dt_bias], out)


class Mamba1Mixer(MambaBase):
    """Mamba's selective scan behind a causal conv, in two entries a step (the model projects
    the conv output to dt, B and C in between):

    ``conv(x (T, D), weight (D, K), bias | None) -> (T, D)`` (silu), then
    ``scan(u (T, D), delta (T, D), A (D, N), B (T, N), C (T, N), D (D,) | None, z (T, D) | None,
    delta_bias (D,) | None) -> (T, D)``: ``dt = softplus(delta + delta_bias)`` (when
    ``delta_softplus``), ``h = exp(dt A) h + dt u B``, ``y = h C + D u``, times ``silu(z)``.
    State: conv (D, K-1) in the model's dtype and the SSM state (D, N) in float32."""

    mamba_type = "mamba1"

    def __init__(self, intermediate_size: int, state_size: int, conv_kernel_size: int = 4, *,
                 delta_softplus: bool = True, prefix: str, mamba_backend: Any = None) -> None:
        _positive(f"vattn.Mamba1Mixer({prefix!r})", intermediate_size=intermediate_size, state_size=state_size,
                  conv_kernel_size=conv_kernel_size)
        self.intermediate_size, self.state_size, self.conv_kernel_size = intermediate_size, state_size, conv_kernel_size
        self.delta_softplus = bool(delta_softplus)
        super().__init__(prefix=prefix, mamba_backend=mamba_backend)

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        return ((self.intermediate_size, self.conv_kernel_size - 1), (self.intermediate_size, self.state_size))

    def get_state_dtype(self, dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        return (self.conv_state_dtype(dtype), self.ssm_state_dtype(dtype))

    def conv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x = self._tokens("x", x, self.intermediate_size, f"vattn.Mamba1Mixer({self.layer_name!r}).conv")
        out = _out(x, x.shape[0], self.intermediate_size)
        return self._run([x, weight.reshape(self.intermediate_size, self.conv_kernel_size), bias], out, 0)

    def scan(self, u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor,  # noqa: N803
             C: torch.Tensor, D: torch.Tensor | None = None, z: torch.Tensor | None = None,  # noqa: N803
             delta_bias: torch.Tensor | None = None) -> torch.Tensor:
        u = self._tokens("u", u, self.intermediate_size, f"vattn.Mamba1Mixer({self.layer_name!r}).scan")
        out = _out(u, u.shape[0], self.intermediate_size)
        return self._run([u, delta, A, B, C, D, z, delta_bias], out, 1)

    forward = scan


class LinearAttention(MambaBase):
    """Lightning (linear) attention with a per-head decay (MiniMax-01's linear layers):
    ``S_t = exp(-slope) S_{t-1} + k_t v_t^T``, ``o_t = S_t^T q_t`` (q is not scaled here).

    ``forward(q (T, H, D), k (T, H, D), v (T, H, Dv), slope (H,)) -> (T, H, Dv)``. State: (H, D, Dv)
    in float32."""

    mamba_type = "linear_attention"

    def __init__(self, num_heads: int, head_size: int, *, value_head_size: int | None = None, prefix: str,
                 mamba_backend: Any = None) -> None:
        value_head_size = head_size if value_head_size is None else value_head_size
        _positive(f"vattn.LinearAttention({prefix!r})", num_heads=num_heads, head_size=head_size,
                  value_head_size=value_head_size)
        self.num_heads, self.head_size, self.value_head_size = num_heads, head_size, value_head_size
        super().__init__(prefix=prefix, mamba_backend=mamba_backend)

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        return ((self.num_heads, self.head_size, self.value_head_size),)

    def get_state_dtype(self, dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        return (self.ssm_state_dtype(dtype),)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor) -> torch.Tensor:
        h, d, dv = self.num_heads, self.head_size, self.value_head_size
        t = q.shape[0]
        q, k, v = q.reshape(t, h, d), k.reshape(t, h, d), v.reshape(t, h, dv)
        return self._run([q, k, v, slope], _out(q, t, h, dv))

"""MAMBA2: Mamba2's state-space duality layer (Dao & Gu, 2024): a causal conv (silu) over
``xBC``, split into x (H, P), B and C (G, N), then the scan with a scalar decay per head."""

from __future__ import annotations

from vattn.backends.mamba.common import CommonMambaBackend, MambaImpl, kernels_for
from vattn.core.mamba import MambaMetadata

__all__ = ["Mamba2AttentionBackend", "Mamba2Impl"]


class Mamba2Impl(MambaImpl):
    """``inputs = [xBC (T, H*P + 2*G*N), conv_weight, conv_bias | None, dt (T, H), A (H,), D (H,) | None,
    dt_bias (H,) | None]``; ``state = (conv (S+1, H*P + 2*G*N, K-1), ssm (S+1, H, P, N))``."""

    def forward(self, layer, inputs, output, state, md: MambaMetadata, part: int = 0) -> None:
        xbc, weight, bias, dt, a, d, dt_bias = inputs
        assert xbc is not None and weight is not None and dt is not None and a is not None
        t = xbc.shape[0]
        h, p, g, n = layer.num_heads, layer.head_dim, layer.n_groups, layer.state_size
        x, b, c = self.conv_silu(xbc, weight, bias, state[0], md).split([h * p, g * n, g * n], dim=-1)
        kernels_for(xbc.device).ssd_scan(x.view(t, h, p), dt, a, b.view(t, g, n), c.view(t, g, n), d, dt_bias, True,
                         layer.dt_limit, state[1], *self.common_args(md), output)


class Mamba2AttentionBackend(CommonMambaBackend):
    name = "MAMBA2"
    mamba_type = "mamba2"
    impl_cls = Mamba2Impl

"""MAMBA1: Mamba's selective scan (Gu & Dao, 2023) behind a causal conv, in two entries a step:
``part`` 0 the conv (silu) over the mixer's input, ``part`` 1 the scan over the conv output once
the model has projected it to dt, B and C."""

from __future__ import annotations

from vattn.backends.mamba.common import CommonMambaBackend, MambaImpl, kernels_for
from vattn.core.mamba import MambaMetadata

__all__ = ["Mamba1AttentionBackend", "Mamba1Impl"]


class Mamba1Impl(MambaImpl):
    """part 0: ``inputs = [x (T, D), weight (D, K), bias | None]``;
    part 1: ``inputs = [u (T, D), delta (T, D), A (D, N), B (T, N), C (T, N), D (D,) | None,
    z (T, D) | None, delta_bias (D,) | None]``; ``state = (conv (S+1, D, K-1), ssm (S+1, D, N))``."""

    def forward(self, layer, inputs, output, state, md: MambaMetadata, part: int = 0) -> None:
        batch = self.common_args(md)
        if part == 0:
            x, weight, bias = inputs
            assert x is not None and weight is not None
            kernels_for(x.device).causal_conv1d(x, weight, bias, state[0], *batch, "silu", output)
            return
        u, delta, a, b, c, d, z, delta_bias = inputs
        assert u is not None and delta is not None and a is not None and b is not None and c is not None
        kernels_for(u.device).selective_scan(u, delta, a, b, c, d, z, delta_bias, layer.delta_softplus, state[1],
                                             *batch, output)


class Mamba1AttentionBackend(CommonMambaBackend):
    name = "MAMBA1"
    mamba_type = "mamba1"
    impl_cls = Mamba1Impl

"""SHORT_CONV: a causal depthwise convolution over each request's tokens with a rolling conv
state of the last K-1 inputs (LFM2's short convolutions)."""

from __future__ import annotations

from vattn.backends.mamba.common import CommonMambaBackend, MambaImpl, kernels_for
from vattn.core.mamba import MambaMetadata

__all__ = ["ShortConvAttentionBackend", "ShortConvImpl"]


class ShortConvImpl(MambaImpl):
    """``inputs = [x (T, D), weight (D, K), bias (D,) | None]``; ``state = (conv_state (S+1, D, K-1),)``."""

    def forward(self, layer, inputs, output, state, md: MambaMetadata, part: int = 0) -> None:
        x, weight, bias = inputs
        assert x is not None and weight is not None
        kernels_for(x.device).causal_conv1d(x, weight, bias, state[0], *self.common_args(md),
                                            layer.activation, output)


class ShortConvAttentionBackend(CommonMambaBackend):
    name = "SHORT_CONV"
    mamba_type = "short_conv"
    impl_cls = ShortConvImpl

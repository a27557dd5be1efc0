"""LINEAR: lightning (linear) attention with a per-head decay (MiniMax-01):
``S_t = exp(-slope) S_{t-1} + k_t v_t^T``, ``o_t = S_t^T q_t``, one (D, Dv) state per head."""

from __future__ import annotations

from vattn.backends.mamba.common import CommonMambaBackend, MambaImpl, kernels_for
from vattn.core.mamba import MambaMetadata

__all__ = ["LinearAttentionBackend", "LinearAttentionImpl"]


class LinearAttentionImpl(MambaImpl):
    """``inputs = [q (T, H, D), k (T, H, D), v (T, H, Dv), slope (H,)]``; ``state = (kv (S+1, H, D, Dv),)``."""

    def forward(self, layer, inputs, output, state, md: MambaMetadata, part: int = 0) -> None:
        q, k, v, slope = inputs
        assert q is not None and k is not None and v is not None and slope is not None
        kernels_for(q.device).linear_attention(q, k, v, slope, state[0], *self.common_args(md), output)


class LinearAttentionBackend(CommonMambaBackend):
    name = "LINEAR"
    mamba_type = "linear_attention"
    impl_cls = LinearAttentionImpl

"""GDN_ATTN: the gated delta rule (Yang, Kautz & Hatamizadeh, 2024) behind a causal conv, as in
Qwen3-Next's Gated DeltaNet layers: conv (silu) over the mixed q/k/v, split, then
``S = exp(g) S; S += k (beta (v - S^T k))^T; o = S^T (scale q)`` per value head."""

from __future__ import annotations

import torch

from vattn.backends.mamba.common import MambaBackend, MambaImpl, MambaMetadata, kernels_for

__all__ = ["GDNAttentionBackend", "GDNImpl"]


class GDNImpl(MambaImpl):
    """``inputs = [mixed_qkv (T, 2*HK*Dk + HV*Dv), conv_weight, conv_bias | None, g (T, HV), beta (T, HV)]``;
    ``state = (conv (S+1, 2*HK*Dk + HV*Dv, K-1), recurrent (S+1, HV, Dk, Dv) float32)``."""

    def forward(self, layer, inputs, output, state, md: MambaMetadata, part: int = 0) -> None:
        mixed, weight, bias, g, beta = inputs
        assert mixed is not None and weight is not None and g is not None and beta is not None
        kernels = kernels_for(mixed.device)
        t = mixed.shape[0]
        hk, hv, dk, dv = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
        conv = torch.empty_like(mixed)
        batch = self.common_args(md)
        kernels.causal_conv1d(mixed, weight, bias, state[0], *batch, "silu", conv)
        q, k, v = conv.split([hk * dk, hk * dk, hv * dv], dim=-1)
        kernels.gated_delta_rule(q.view(t, hk, dk), k.view(t, hk, dk), v.view(t, hv, dv), g, beta, layer.scale,
                                 layer.use_qk_l2norm, state[1], *batch, output)


class GDNAttentionBackend(MambaBackend):
    name = "GDN_ATTN"
    mamba_type = "gdn_attention"
    impl_cls = GDNImpl

"""GDN_ATTN: the gated delta rule (Yang, Kautz & Hatamizadeh, 2024) behind a causal conv, as in
Qwen3-Next's Gated DeltaNet layers: conv (silu) over the mixed q/k/v, split, then
``S = exp(g) S; S += k (beta (v - S^T k))^T; o = S^T (scale q)`` per value head. On CUDA, prompts
go through fla's chunked kernels where fla-core is installed (``fla_ops``), decodes through vattn's
recurrent kernel."""

from __future__ import annotations

from vattn.backends.mamba.common import CommonMambaBackend, MambaImpl, kernels_for
from vattn.core.mamba import MambaMetadata
from vattn.backends.mamba.fla_ops import chunked_prefill, fla_chunk_fn

__all__ = ["GDNAttentionBackend", "GDNImpl"]


class GDNImpl(MambaImpl):
    """``inputs = [mixed_qkv (T, 2*HK*Dk + HV*Dv), conv_weight, conv_bias | None, g (T, HV), beta (T, HV)]``;
    ``state = (conv (S+1, 2*HK*Dk + HV*Dv, K-1), recurrent (S+1, HV, Dk, Dv) float32)``."""

    def forward(self, layer, inputs, output, state, md: MambaMetadata, part: int = 0) -> None:
        mixed, weight, bias, g, beta = inputs
        assert mixed is not None and weight is not None and g is not None and beta is not None
        t = mixed.shape[0]
        hk, hv, dk, dv = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
        batch = self.common_args(md)
        q, k, v = self.conv_silu(mixed, weight, bias, state[0], md).split([hk * dk, hk * dk, hv * dv], dim=-1)
        q, k, v = q.view(t, hk, dk), k.view(t, hk, dk), v.view(t, hv, dv)
        if md.num_prefills and mixed.is_cuda and fla_chunk_fn() is not None and self._all_have_tokens(md):
            # Prompts in chunks (fla); the decodes in front keep the recurrent kernel.
            nd = md.num_decodes
            chunked_prefill(q, k, v, g, beta, layer.scale, layer.use_qk_l2norm, state[1], md.query_start_loc,
                            md.query_start_loc_cpu, md.state_indices, md.has_initial_state, nd, md.num_reqs, output)
            if not nd:
                return
            batch = (md.query_start_loc, md.state_indices, md.has_initial_state, nd)
        kernels_for(mixed.device).gated_delta_rule(q, k, v, g, beta, layer.scale, layer.use_qk_l2norm, state[1],
                                                   *batch, output)

    @staticmethod
    def _all_have_tokens(md: MambaMetadata) -> bool:
        """Every request after the decodes has a token (fla would rewrite the slot of one without)."""
        qsl = md.query_start_loc_cpu[md.num_decodes: md.num_reqs + 1]
        return bool((qsl[1:] > qsl[:-1]).all())


class GDNAttentionBackend(CommonMambaBackend):
    name = "GDN_ATTN"
    mamba_type = "gdn_attention"
    impl_cls = GDNImpl

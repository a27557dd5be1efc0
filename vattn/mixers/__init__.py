"""Mamba-family (mixer) layers: state per request slot instead of K/V per token.

| layer | backend | state per slot |
| --- | --- | --- |
| ``GatedDeltaNet`` | GDN_ATTN | conv (conv_dim, K-1), recurrent (HV, Dk, Dv) float32 |
| ``Mamba2Mixer`` | MAMBA2 | conv (conv_dim, K-1), SSM (H, P, N) float32 |
| ``Mamba1Mixer`` | MAMBA1 | conv (D, K-1), SSM (D, N) float32 |
| ``ShortConv`` | SHORT_CONV | conv (D, K-1) |
| ``LinearAttention`` | LINEAR | (H, D, Dv) float32 |
"""

from vattn.mixers.base import MambaBase, get_mamba_backend
from vattn.mixers.layers import GatedDeltaNet, LinearAttention, Mamba1Mixer, Mamba2Mixer, ShortConv

__all__ = ["GatedDeltaNet", "LinearAttention", "MambaBase", "Mamba1Mixer", "Mamba2Mixer", "ShortConv",
           "get_mamba_backend"]

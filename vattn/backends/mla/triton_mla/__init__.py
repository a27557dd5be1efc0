"""TRITON_MLA: vattn's own Triton kernels for multi-head latent attention.

| module | what |
| --- | --- |
| ``backend`` | ``TritonMLABackend``, its impl and metadata builder |
| ``config`` | the decode's split count and scratch sizes, from static sizes (no Triton import) |
| ``launch`` | the launchers ``mla_decode`` and ``mla_prefill`` (imports Triton) |
| ``kernels`` | the Triton kernels (latent decode, split combine, ragged prefill) |
| ``wgmma`` | the Hopper latent decode on warpgroup MMAs, in Gluon (imported by ``launch`` on sm_90) |
"""

from vattn.backends.mla.triton_mla.backend import (
    TritonMLABackend,
    TritonMLADecodePlan,
    TritonMLAImpl,
    TritonMLAMetadataBuilder,
)

__all__ = ["TritonMLABackend", "TritonMLADecodePlan", "TritonMLAImpl", "TritonMLAMetadataBuilder"]

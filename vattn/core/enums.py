"""The enumerations of the backend interface: ``AttentionType`` and ``AttentionCGSupport``
(re-exported by ``vattn.core.interface``)."""

from __future__ import annotations

import enum

__all__ = ["AttentionCGSupport", "AttentionType"]


class AttentionType:
    """Attention type. Plain strings, so ``torch.compile`` treats them as constants."""

    DECODER = "decoder"
    """Causal self-attention over previous tokens (uses the KV cache)."""
    ENCODER = "encoder"
    """Bidirectional encoder self-attention of an encoder-decoder model (no KV cache)."""
    ENCODER_ONLY = "encoder_only"
    """Bidirectional self-attention of an encoder-only model (no KV cache)."""
    ENCODER_DECODER = "encoder_decoder"
    """Cross-attention: decoder queries over encoder K/V (cached once per request)."""

    ALL = (DECODER, ENCODER, ENCODER_ONLY, ENCODER_DECODER)


class AttentionCGSupport(enum.IntEnum):
    """How much of a backend's attention may be captured in a full CUDA graph.

    Ordered: a higher level allows everything a lower one does.
    """

    NEVER = 0
    """No full CUDA graphs (piecewise graphs, with attention outside, still work)."""
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    """Batches where every request decodes exactly one token."""
    UNIFORM_BATCH = 2
    """Batches where every request has the same query length (e.g. spec-decode)."""
    ALWAYS = 3
    """Any batch, including mixed prefill/decode."""

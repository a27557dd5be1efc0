"""The backend interface: what every attention backend states and implements.

A backend is a class of static facts (name, KV-cache shape, what it supports) that
points at three more classes: its ``AttentionImpl`` (runs the kernels), its
``AttentionMetadata`` (the per-step data the kernels need) and its
``AttentionMetadataBuilder`` (turns ``CommonAttentionMetadata`` into that metadata; host
work lives there).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import torch

if TYPE_CHECKING:
    from vattn.backends.utils import AttentionMetadataBuilder
    from vattn.layer import Attention

__all__ = [
    "AttentionBackend",
    "AttentionCGSupport",
    "AttentionImpl",
    "AttentionMetadata",
    "AttentionType",
    "is_fp8_kv_cache",
]


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


def is_fp8_kv_cache(kv_cache_dtype: str | None) -> bool:
    """Whether a ``cache_dtype`` string names an fp8 cache."""
    return kv_cache_dtype is not None and kv_cache_dtype.startswith("fp8")


class AttentionMetadata:
    """Base of every backend's per-step metadata (backends use dataclasses)."""


M = TypeVar("M", bound=AttentionMetadata)


class AttentionBackend(ABC):
    """Static description of an attention backend.

    Subclasses set the class attributes and implement the static methods. The selector
    asks ``validate_configuration`` why a backend cannot serve a configuration.
    """

    accept_output_buffer: ClassVar[bool] = False
    """The layer allocates the output and the op writes into it (required for piecewise graphs)."""
    supports_quant_query_input: ClassVar[bool] = False
    """The kernel takes fp8 queries: with an fp8 KV cache the layer quantizes q (an opaque op that
    ``vattn.compile``'s ``query_quant_fusion`` pass makes fusable into the producer of q)."""
    supports_output_quant: ClassVar[bool] = False
    """The kernel can write fp8 output given ``output_scale``."""

    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16)
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto", "bfloat16", "float16")
    supports_sink: ClassVar[bool] = False
    supports_mla: ClassVar[bool] = False
    supports_sparse: ClassVar[bool] = False

    @staticmethod
    @abstractmethod
    def get_name() -> str:
        """The registry name (``AttentionBackendEnum`` member name), e.g. ``"TORCH_SDPA"``."""

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type["AttentionImpl"]: ...

    @staticmethod
    @abstractmethod
    def get_metadata_cls() -> type[AttentionMetadata]: ...

    @staticmethod
    @abstractmethod
    def get_builder_cls() -> type["AttentionMetadataBuilder"]: ...

    @staticmethod
    @abstractmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        """The logical shape of one layer's KV cache tensor."""

    @staticmethod
    def get_kv_cache_stride_order() -> tuple[int, ...]:
        """Permutation from the logical shape to the physical (allocation) order.

        Backends that do not implement it are allocated in their logical order (identity).
        """
        raise NotImplementedError

    @classmethod
    def make_metadata(cls, *args: Any, **kwargs: Any) -> AttentionMetadata:
        return cls.get_metadata_cls()(*args, **kwargs)

    @classmethod
    def full_cls_name(cls) -> tuple[str, str]:
        return (cls.__module__, cls.__qualname__)

    # ---- what the backend can serve -------------------------------------------------

    @classmethod
    def get_supported_head_sizes(cls) -> tuple[int, ...] | None:
        """Head sizes the kernels support, or ``None`` for any."""
        return None

    @classmethod
    def get_supported_block_sizes(cls) -> tuple[int, ...] | None:
        """Block sizes the kernels support, or ``None`` for any."""
        return None

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """Whether the backend can run on this machine (library installed, device present).

        Returns ``(ok, reason)``; ``reason`` says what is missing when not ``ok``.
        """
        return True, ""

    @classmethod
    def validate_configuration(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: str | None,
        block_size: int,
        use_mla: bool = False,
        has_sink: bool = False,
        use_sparse: bool = False,
    ) -> list[str]:
        """Every reason this backend cannot serve the configuration (empty: it can)."""
        reasons: list[str] = []
        ok, why = cls.is_available()
        if not ok:
            reasons.append(why)
        head_sizes = cls.get_supported_head_sizes()
        if head_sizes is not None and head_size not in head_sizes:
            reasons.append(f"head_size {head_size} not in {list(head_sizes)}")
        if dtype not in cls.supported_dtypes:
            reasons.append(
                f"dtype {dtype} not in {[str(d) for d in cls.supported_dtypes]}"
            )
        kv = kv_cache_dtype or "auto"
        if kv not in cls.supported_kv_cache_dtypes:
            reasons.append(f"kv_cache_dtype {kv!r} not in {list(cls.supported_kv_cache_dtypes)}")
        block_sizes = cls.get_supported_block_sizes()
        if block_sizes is not None and block_size not in block_sizes:
            reasons.append(f"block_size {block_size} not in {list(block_sizes)}")
        if use_mla and not cls.supports_mla:
            reasons.append("MLA not supported")
        if not use_mla and cls.supports_mla:
            reasons.append("only serves MLA models")
        if has_sink and not cls.supports_sink:
            reasons.append("attention sinks not supported")
        if use_sparse and not cls.supports_sparse:
            reasons.append("sparse attention not supported")
        return reasons

    @classmethod
    def get_cudagraph_support(cls) -> AttentionCGSupport:
        """The full-CUDA-graph support level, as declared by the builder."""
        return cls.get_builder_cls().cudagraph_support


class AttentionImpl(ABC, Generic[M]):
    """Runs one layer's attention: store new K/V in the paged cache, then attend.

    Constructed once per layer by ``vattn.Attention`` with the layer's hyperparameters.
    """

    num_heads: int
    head_size: int
    scale: float
    num_kv_heads: int
    sliding_window: tuple[int, int] | None
    logits_soft_cap: float | None
    kv_cache_dtype: str
    attn_type: str

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads if num_kv_heads is not None else num_heads
        self.num_queries_per_kv = self.num_heads // self.num_kv_heads
        self.alibi_slopes = (
            torch.tensor(alibi_slopes, dtype=torch.float32) if alibi_slopes is not None else None
        )
        # (left, right) window in tokens, as FlashAttention takes it; None = unlimited.
        self.sliding_window = (sliding_window - 1, 0) if sliding_window is not None else None
        self.kv_cache_dtype = kv_cache_dtype
        self.logits_soft_cap = logits_soft_cap if logits_soft_cap else None
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        if sinks is not None and sinks.shape != (num_heads,):
            raise ValueError(
                f"sinks must have shape (num_heads,) = ({num_heads},), got {tuple(sinks.shape)}."
            )
        self.sinks = sinks

    @abstractmethod
    def forward(
        self,
        layer: "Attention",
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: M | None,
        output: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write ``key``/``value`` into ``kv_cache`` at the metadata's slots, then attend.

        Shapes (T = tokens in the step, H = num_heads, Hk = num_kv_heads, D = head_size):

        | tensor | shape |
        | --- | --- |
        | query | (T, H, D) |
        | key, value | (T, Hk, D), or None when K/V come only from the cache |
        | kv_cache | the backend's ``get_kv_cache_shape`` |
        | output | (T, H, D), written in place (the first ``num_actual_tokens`` rows) |

        ``attn_metadata is None`` is a profiling / warm-up run: leave the cache untouched
        (the op zero-fills ``output`` itself). Rows past ``num_actual_tokens`` are left unspecified.
        """

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        """Hook to convert loaded parameters (e.g. sinks to float32)."""
        return None

    def fused_output_quant_supported(self, quant_key: Any) -> bool:
        """Whether this impl can write quantized output for ``quant_key`` in-kernel."""
        return False

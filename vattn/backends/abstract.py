"""The backend interface, in one place: what an attention backend states and implements.

A backend is a class of static facts (``AttentionBackend``: name, KV-cache shape, what it
serves) that points at three more classes: its ``AttentionImpl`` (runs the kernels), its
``AttentionMetadata`` (the per-step data the kernels need) and its ``AttentionMetadataBuilder``
(turns the batch's ``CommonAttentionMetadata`` into that metadata; host work lives there). The
seeds' import paths (``vattn.backends.utils.CommonAttentionMetadata``, ...) re-export these.
"""

from __future__ import annotations

import abc
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import torch

from vattn.backends.batch_checks import StepChecks, unchecked_block_limit
from vattn.backends.checks import check_common_metadata, configuration_reasons, feature_reasons
from vattn.backends.decode_split import reorder_batch_to_split_decodes_and_prefills
from vattn.backends.enums import AttentionCGSupport, AttentionType

if TYPE_CHECKING:
    from vattn.config import VattnConfig
    from vattn.layer import Attention

__all__ = ["AttentionBackend", "AttentionCGSupport", "AttentionImpl", "AttentionLayerBase", "AttentionMetadata",
           "AttentionMetadataBuilder", "AttentionSpec", "AttentionType", "CommonAttentionMetadata", "is_fp8_kv_cache"]


def is_fp8_kv_cache(kv_cache_dtype: str | None) -> bool:
    """Whether a ``cache_dtype`` string names an fp8 cache."""
    return kv_cache_dtype is not None and kv_cache_dtype.startswith("fp8")


class AttentionMetadata:
    """Base of every backend's per-step metadata (backends use dataclasses). ``checks`` (not a
    field): the step's ``StepChecks``, set by ``PagedKVCache.build_metadata``; the attention op
    checks the cache bound to each layer against it before writing."""

    checks: StepChecks | None = None


M = TypeVar("M", bound=AttentionMetadata)


@dataclass(frozen=True)
class AttentionSpec:
    """What a KV-cache group's layers share, the facts a builder needs: tokens per block, KV
    heads and head size per layer, the dtype stored (fp8 for fp8 caches), the
    ``CacheConfig.cache_dtype`` string, and the group's sliding window (None: none)."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    cache_dtype_str: str = "auto"
    sliding_window: int | None = None


@dataclass
class CommonAttentionMetadata:
    """Per-batch attention metadata, shared across layers and backends.

    Requests are ordered decodes first (see ``reorder_batch_to_split_decodes_and_prefills``).
    B = num_reqs (possibly padded for CUDA graphs), T = tokens in the step (possibly padded).

    | field | shape / type | meaning |
    | --- | --- | --- |
    | query_start_loc, query_start_loc_cpu | (B + 1,) int32 | start of each request's tokens in the flattened query |
    | seq_lens, seq_lens_cpu | (B,) int32 | tokens of each request after this step (cached + new) |
    | num_computed_tokens_cpu | (B,) int32 | tokens already in the cache before this step |
    | num_reqs | int | requests in the batch |
    | num_actual_tokens | int | real (unpadded) tokens in the step |
    | max_query_len | int | longest new-token count |
    | max_seq_len | int | longest seq_len |
    | block_table_tensor | (B, max_blocks) int32 | block ids of each request, in order |
    | slot_mapping | (T,) int64 | cache slot (block * block_size + offset) of each new token; -1 = padding |
    | causal | bool | causal masking (False for encoder attention) |
    | num_slot_tokens | int or None | real entries of slot_mapping: None = num_actual_tokens; cross-attention: the encoder tokens whose K/V this step writes |
    | host_checks | StepChecks | set at construction: the batch's host facts (vattn's helpers pass theirs) |
    | tree_parents | (>= num_actual_tokens,) int32, or None | TREE_ATTN: per new token, its parent's index among its request's new tokens (-1: the last cached token); None: each request's tokens form a chain (causal) |
    | state_indices, state_indices_cpu | (B,) int32, or None | mixer layers (``vattn.mixers``): each request's state slot, -1 = padding (a scratch slot); None: the model has no mixer layers |

    Construction checks the fields on the host (``vattn.backends.checks.check_common_metadata``:
    dtypes, lengths, devices, what the host mirrors say; the slot mapping and block table too
    where they are CPU tensors, once the batch meets a cache); a bad field raises ``ValueError``
    naming it. Then ``slot_mapping[num_slot_tokens:]`` is filled with -1, so padded tokens never
    touch the cache.

    Fields edited after construction are checked again when the batch meets a cache (every
    step): host tensors in full, device tensors with ``VATTN_DEBUG_CHECKS=1`` only (else the
    kernels keep every read and write inside the cache and the block table).
    """

    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    num_computed_tokens_cpu: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor
    max_seq_len: int = -1
    causal: bool = True
    num_slot_tokens: int | None = None
    host_checks: StepChecks | None = field(default=None, repr=False, compare=False)
    tree_parents: torch.Tensor | None = None
    state_indices: torch.Tensor | None = None
    state_indices_cpu: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.host_checks = check_common_metadata(self)
        # Padded tokens must not write into the cache (also inside full CUDA graphs).
        real = self.num_actual_tokens if self.num_slot_tokens is None else self.num_slot_tokens
        if self.slot_mapping.shape[0] > real:
            self.slot_mapping[real:].fill_(-1)
        if self.max_seq_len < 0:
            self.max_seq_len = int(self.seq_lens_cpu[: self.num_reqs].max()) if self.num_reqs else 0
        self.host_checks.bind(self)  # an in-place edit from here on is seen (``StepChecks.describes``)

    @property
    def device(self) -> torch.device:
        return self.query_start_loc.device

    @property
    def query_lens_cpu(self) -> torch.Tensor:
        """(B,) new tokens of each request."""
        return self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]


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
    supports_sliding_window: ClassVar[bool] = False
    supports_logits_soft_cap: ClassVar[bool] = False
    supports_alibi: ClassVar[bool] = False
    supports_mask_mod: ClassVar[bool] = False  # takes a layer's FlexAttention mask_mod
    supports_score_mod: ClassVar[bool] = False  # takes a layer's FlexAttention score_mod
    supports_tree_parents: ClassVar[bool] = False  # honours CommonAttentionMetadata.tree_parents
    supported_attn_types: ClassVar[tuple[str, ...]] = (AttentionType.DECODER,)
    runs_on_cpu: ClassVar[bool] = False
    """Serves CPU tensors (else CUDA only)."""
    min_compute_capability: ClassVar[tuple[int, int] | None] = None
    """The oldest CUDA GPU generation it runs on, e.g. ``(8, 0)``; None: any."""
    installable: ClassVar[bool] = True
    """False: vattn names it, but cannot install its kernels (it only says why it cannot serve)."""
    feature_notes: ClassVar[dict[str, str]] = {}
    """Qualifiers of the declarations above, by feature name (e.g. ``{"sinks": "flash-attn-4 only"}``)."""

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
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        """The logical shape of one layer's KV cache tensor."""

    @staticmethod
    def get_kv_cache_stride_order() -> tuple[int, ...]:
        """Permutation from the logical shape to the physical order (not implemented: identity)."""
        raise NotImplementedError

    @classmethod
    def make_metadata(cls, *args: Any, **kwargs: Any) -> AttentionMetadata:
        return cls.get_metadata_cls()(*args, **kwargs)

    @classmethod
    def full_cls_name(cls) -> tuple[str, str]:
        return (cls.__module__, cls.__qualname__)

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
        """``(ok, reason)``: whether it can run on this machine (library installed, device present)."""
        return True, ""

    @classmethod
    def validate_configuration(cls, head_size: int, dtype: torch.dtype, kv_cache_dtype: str | None,
                               block_size: int, use_mla: bool = False, has_sink: bool = False,
                               use_sparse: bool = False) -> list[str]:
        """Every reason this backend cannot serve the configuration (empty: it can); the
        declarations above are checked by ``vattn.backends.checks.configuration_reasons``."""
        return configuration_reasons(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink, use_sparse)

    @classmethod
    def feature_reasons(cls, attn_type: str = AttentionType.DECODER, *, use_sliding_window: bool = False,
                        use_logits_soft_cap: bool = False, use_alibi: bool = False, use_mask_mod: bool = False,
                        use_score_mod: bool = False) -> list[str]:
        """Every layer feature (attention type, window, soft cap, ALiBi, mods) it declares not to serve."""
        return feature_reasons(cls, attn_type, use_sliding_window, use_logits_soft_cap, use_alibi, use_mask_mod,
                               use_score_mod)

    @classmethod
    def get_cudagraph_support(cls) -> AttentionCGSupport:
        """The full-CUDA-graph support level, as declared by the builder."""
        return cls.get_builder_cls().cudagraph_support


class AttentionImpl(ABC, Generic[M]):
    """Runs one layer's attention: store new K/V in the paged cache, then attend.

    Constructed once per layer by ``vattn.Attention`` with the layer's hyperparameters."""

    num_heads: int
    head_size: int
    scale: float
    num_kv_heads: int
    sliding_window: tuple[int, int] | None
    logits_soft_cap: float | None
    kv_cache_dtype: str
    attn_type: str
    fuses_rope: bool = False  #: forward takes ``rope=(cos, sin)`` with unrotated q / key (``vattn.ops.attention``)

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None,
                 sinks: torch.Tensor | None = None) -> None:
        self.num_heads, self.head_size = num_heads, head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads if num_kv_heads is not None else num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{type(self).__name__} num_kv_heads: expected a divisor of num_heads = {num_heads}, "
                             f"got {self.num_kv_heads}; choose num_kv_heads among the divisors of num_heads.")
        self.num_queries_per_kv = self.num_heads // self.num_kv_heads
        self.alibi_slopes = None if alibi_slopes is None else torch.tensor(alibi_slopes, dtype=torch.float32)
        # (left, right) window in tokens, as FlashAttention takes it; None = unlimited.
        self.sliding_window = (sliding_window - 1, 0) if sliding_window is not None else None
        self.kv_cache_dtype = kv_cache_dtype
        self.logits_soft_cap = logits_soft_cap if logits_soft_cap else None
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        if sinks is not None and sinks.shape != (num_heads,):
            raise ValueError(f"sinks must have shape (num_heads,) = ({num_heads},), got {tuple(sinks.shape)}.")
        self.sinks = sinks

    @abstractmethod
    def forward(self, layer: "Attention", query: torch.Tensor, key: torch.Tensor | None,
                value: torch.Tensor | None, kv_cache: torch.Tensor, attn_metadata: M | None,
                output: torch.Tensor | None = None, output_scale: torch.Tensor | None = None) -> torch.Tensor:
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


class AttentionMetadataBuilder(abc.ABC, Generic[M]):
    """Turns ``CommonAttentionMetadata`` into one backend's metadata, once per step per group.

    Host work (syncs, planning, Python loops) belongs here, never in the impl's forward.
    ``cudagraph_support`` declares which batches may run inside a full CUDA graph.
    """

    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    # Decodes are requests with at most this many new tokens (for split_decodes_and_prefills).
    reorder_batch_threshold: ClassVar[int | None] = 1

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vattn_config: "VattnConfig",
                 device: torch.device) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.layer_names = layer_names
        self.vattn_config = vattn_config
        self.device = torch.device(device)

    @property
    def full_cudagraph_supported(self) -> bool:
        return self.cudagraph_support >= AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    cache_blocks_dim: ClassVar[int] = 1  # the bound KV-cache tensor's block dimension

    def unchecked_block_limit(self, cm: CommonAttentionMetadata) -> int | None:
        """``num_blocks`` of the bound cache when ``cm``'s block ids were never seen on the host,
        else None: builders then clamp the table on the device (``batch_checks.unchecked_block_limit``)."""
        return unchecked_block_limit(cm, self.vattn_config, self.layer_names, self.cache_blocks_dim)

    @abc.abstractmethod
    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> M:
        """Build this backend's metadata for one step.

        Args:
            common_prefix_len: tokens shared by every request (for cascade attention; 0 = none).
            common_attn_metadata: the batch.
            fast_build: favour build speed over kernel speed (metadata used by few layers).
        """

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> M:
        """Metadata for capturing a CUDA graph; defaults to ``build``."""
        return self.build(common_prefix_len=0, common_attn_metadata=common_attn_metadata)

    def can_run_in_cudagraph(self, common_attn_metadata: CommonAttentionMetadata) -> bool:
        """Whether this batch may replay a full CUDA graph, by the declared support level."""
        support = self.cudagraph_support
        if support == AttentionCGSupport.ALWAYS:
            return True
        if support == AttentionCGSupport.NEVER:
            return False
        n = common_attn_metadata.num_reqs
        qlens = common_attn_metadata.query_lens_cpu[:n]
        if n == 0:
            return True
        if support == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE:
            return bool((qlens == 1).all())
        return bool((qlens == qlens[0]).all())

    def use_cascade_attention(self, common_prefix_len: int, query_lens: Any, num_query_heads: int,
                              num_kv_heads: int, use_alibi: bool, use_sliding_window: bool, num_sms: int) -> bool:
        """Whether to run cascade attention over a shared prefix (no vattn backend does)."""
        return False

    def reorder_batch(self, input_batch: Any, scheduler_output: Any) -> bool:
        """Reorder the batch so decodes come first; returns whether anything moved."""
        if self.reorder_batch_threshold is None:
            return False
        return reorder_batch_to_split_decodes_and_prefills(input_batch, scheduler_output,
                                                           decode_threshold=self.reorder_batch_threshold)


class AttentionLayerBase(ABC):
    """What every attention layer (``vattn.Attention``, and an MLA layer beside it) is to the
    rest of vattn: a module with a backend, an impl and a KV cache, registered by name in its
    config's static forward context."""

    impl: "AttentionImpl"
    layer_name: str
    kv_cache: list[torch.Tensor]

    @abstractmethod
    def get_attn_backend(self) -> type[AttentionBackend]:
        """The backend class this layer runs."""

    def get_kv_cache_spec(self, dtype: torch.dtype) -> AttentionSpec:
        """The layer's cache spec storing ``dtype`` (``allocate_kv_cache`` groups layers by it)."""
        layer: Any = self
        return AttentionSpec(block_size=layer.block_size, num_kv_heads=layer.num_kv_heads, head_size=layer.head_size,
                             dtype=dtype, cache_dtype_str=layer.kv_cache_dtype, sliding_window=layer.sliding_window)

"""The backend interface, in one place: what an attention backend states and implements.

A backend is a class of static facts (``AttentionBackend``: name, KV-cache shape, what it
serves as one ``Capabilities`` value) that points at three more classes: its ``AttentionImpl``
(runs the kernels), its ``AttentionMetadata`` (the per-step data the kernels need) and its
``AttentionMetadataBuilder`` (turns the batch's ``CommonAttentionMetadata`` into that metadata;
host work lives there). ``docs/backends.md`` walks through writing one.
"""

from __future__ import annotations

import abc
import dataclasses
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Mapping

import torch

from vattn.core.batch_checks import unchecked_block_limit
from vattn.core.capabilities import LEGACY_NAMES, Capabilities
from vattn.core.checks import e4m3_cache_reasons
from vattn.core.config import CACHE_DTYPES
from vattn.core.enums import AttentionCGSupport, AttentionType
from vattn.core.layout import check_kv_cache_shape_args, paged_kv_stride_order
from vattn.core.metadata import M, AttentionMetadata, AttentionSpec, CommonAttentionMetadata

if TYPE_CHECKING:
    from vattn.core.config import VattnConfig

__all__ = ["AttentionBackend", "AttentionImpl", "AttentionLayerBase", "AttentionMetadataBuilder"]


class _BackendMeta(abc.ABCMeta):
    """Keeps ``capabilities`` and its mirrors under the seeds' names in step: setting either on a
    backend class (``Backend.supports_sink = True``, a test's monkeypatch) updates the other."""

    def __setattr__(cls, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name == "capabilities":
            for attr, fld in LEGACY_NAMES.items():
                super().__setattr__(attr, getattr(value, fld))
        elif name in LEGACY_NAMES and "capabilities" in dir(cls):
            caps = cls.capabilities
            if getattr(caps, LEGACY_NAMES[name]) != value:
                super().__setattr__("capabilities", dataclasses.replace(caps, **{LEGACY_NAMES[name]: value}))


class AttentionBackend(ABC, metaclass=_BackendMeta):
    """Static description of an attention backend: its name, its classes, its KV-cache shape
    and what it serves (``capabilities``).

    A backend on the standard cache layout sets ``name``, ``impl_cls``, ``metadata_cls``,
    ``builder_cls`` and ``capabilities`` and inherits the rest; one with another layout
    overrides ``get_kv_cache_shape`` (and ``get_kv_cache_stride_order``). The selector asks
    ``validate_configuration`` and ``feature_reasons`` why a backend cannot serve a layer.
    """

    name: ClassVar[str] = ""
    """The registry name (``AttentionBackendEnum`` member name), e.g. ``"TORCH_SDPA"``."""
    impl_cls: ClassVar[type["AttentionImpl"]]
    metadata_cls: ClassVar[type[AttentionMetadata]]
    builder_cls: ClassVar[type["AttentionMetadataBuilder"]]
    capabilities: ClassVar[Capabilities] = Capabilities()

    # Mirrors of ``capabilities`` under the seeds' names, kept in step by the metaclass.
    accept_output_buffer: ClassVar[bool]
    supports_quant_query_input: ClassVar[bool]
    supports_output_quant: ClassVar[bool]
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]]
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]]
    supports_sink: ClassVar[bool]
    supports_mla: ClassVar[bool]
    supports_sparse: ClassVar[bool]
    supports_sliding_window: ClassVar[bool]
    supports_logits_soft_cap: ClassVar[bool]
    supports_alibi: ClassVar[bool]
    supports_mask_mod: ClassVar[bool]
    supports_score_mod: ClassVar[bool]
    supports_tree_parents: ClassVar[bool]
    supported_attn_types: ClassVar[tuple[str, ...]]
    runs_on_cpu: ClassVar[bool]
    min_compute_capability: ClassVar[tuple[int, int] | None]
    installable: ClassVar[bool]
    feature_notes: ClassVar[Mapping[str, str]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Fold the seeds' attributes a subclass body sets (``supports_sink = True``, ...) into its
        ``capabilities``, then mirror ``capabilities`` under those names."""
        super().__init_subclass__(**kwargs)
        legacy = {fld: cls.__dict__[attr] for attr, fld in LEGACY_NAMES.items() if attr in cls.__dict__}
        cls.capabilities = dataclasses.replace(cls.capabilities, **legacy)  # mirrored by the metaclass

    @classmethod
    def get_name(cls) -> str:
        if not cls.name:
            raise NotImplementedError(f"{cls.__qualname__}: set name = \"<registry name>\" (or override get_name).")
        return cls.name

    @classmethod
    def get_impl_cls(cls) -> type["AttentionImpl"]:
        return cls.impl_cls

    @classmethod
    def get_metadata_cls(cls) -> type[AttentionMetadata]:
        return cls.metadata_cls

    @classmethod
    def get_builder_cls(cls) -> type["AttentionMetadataBuilder"]:
        return cls.builder_cls

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        """The logical shape of one layer's KV cache tensor; the standard one is
        ``(2, num_blocks, block_size, num_kv_heads, head_size)``: ``[0]`` keys, ``[1]`` values."""
        check_kv_cache_shape_args(num_blocks, block_size, num_kv_heads, head_size)
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_kv_cache_stride_order() -> tuple[int, ...]:
        """Permutation from the logical shape to the physical order: for the standard shape the
        identity (NHD) or heads before tokens (HND), by ``vattn.core.layout.get_kv_cache_layout``."""
        return paged_kv_stride_order()

    @classmethod
    def make_metadata(cls, *args: Any, **kwargs: Any) -> AttentionMetadata:
        return cls.get_metadata_cls()(*args, **kwargs)

    @classmethod
    def full_cls_name(cls) -> tuple[str, str]:
        return (cls.__module__, cls.__qualname__)

    @classmethod
    def get_supported_head_sizes(cls) -> tuple[int, ...] | None:
        """Head sizes the kernels support, or ``None`` for any."""
        return cls.capabilities.head_sizes

    @classmethod
    def get_supported_block_sizes(cls) -> tuple[int, ...] | None:
        """Block sizes the kernels support, or ``None`` for any."""
        return cls.capabilities.block_sizes

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """``(ok, reason)``: whether it can run on this machine (library installed, device present)."""
        return True, ""

    @classmethod
    def validate_configuration(cls, head_size: int, dtype: torch.dtype, kv_cache_dtype: str | None,
                               block_size: int, use_mla: bool = False, has_sink: bool = False,
                               use_sparse: bool = False) -> list[str]:
        """Every reason this backend cannot serve the configuration (empty: it can), by
        ``is_available``, its declarations, and an e4m3 cache on a GPU older than compute capability 8.9."""
        caps = cls.capabilities
        reasons: list[str] = []
        ok, why = cls.is_available()
        if not ok:
            reasons.append(why)
        elif caps.min_compute_capability is not None and torch.cuda.is_available():
            cap = torch.cuda.get_device_capability()
            if cap < caps.min_compute_capability:
                need = ".".join(map(str, caps.min_compute_capability))
                reasons.append(f"GPU too old: compute capability {cap[0]}.{cap[1]} < {need}")
        head_sizes = cls.get_supported_head_sizes()
        if head_sizes is not None and head_size not in head_sizes:
            reasons.append(f"head_size {head_size} not in {list(head_sizes)}")
        if dtype not in caps.dtypes:
            reasons.append(f"dtype {dtype} not in {[str(d) for d in caps.dtypes]}")
        kv = kv_cache_dtype or "auto"
        if kv not in caps.kv_cache_dtypes:
            reasons.append(f"kv_cache_dtype {kv!r} not in {list(caps.kv_cache_dtypes)}")
        block_sizes = cls.get_supported_block_sizes()
        if block_sizes is not None and block_size not in block_sizes:
            reasons.append(f"block_size {block_size} not in {list(block_sizes)}")
        if kv in caps.kv_cache_dtypes:
            reasons += e4m3_cache_reasons(kv)  # vattn's KV store writes e4m3 on compute capability 8.9+
        for wanted, served, what in ((use_mla, caps.mla, "MLA not supported"), (not use_mla, not caps.mla,
                                     "only serves MLA models"), (has_sink, caps.sink, "attention sinks not supported"),
                                     (use_sparse, caps.sparse, "sparse attention not supported")):
            if wanted and not served:
                reasons.append(what)
        return reasons

    @classmethod
    def feature_reasons(cls, attn_type: str = AttentionType.DECODER, *, use_sliding_window: bool = False,
                        use_logits_soft_cap: bool = False, use_alibi: bool = False, use_mask_mod: bool = False,
                        use_score_mod: bool = False) -> list[str]:
        """Every layer feature (attention type, window, soft cap, ALiBi, mods) it declares not to serve."""
        caps = cls.capabilities
        reasons = []
        if attn_type not in caps.attn_types:
            reasons.append(f"attn_type {attn_type!r} not in {list(caps.attn_types)}")
        for wanted, served, what in ((use_sliding_window, caps.sliding_window, "sliding window"),
                                     (use_logits_soft_cap, caps.logits_soft_cap, "logits soft cap"),
                                     (use_alibi, caps.alibi, "ALiBi"), (use_mask_mod, caps.mask_mod, "mask_mod"),
                                     (use_score_mod, caps.score_mod, "score_mod")):
            if wanted and not served:
                reasons.append(f"{what} not supported")
        return reasons

    @classmethod
    def get_cudagraph_support(cls) -> AttentionCGSupport:
        """The full-CUDA-graph support level, as declared by the builder."""
        return cls.get_builder_cls().cudagraph_support


AttentionBackend.capabilities = Capabilities()  # mirrored under the seeds' names


class AttentionImpl(ABC, Generic[M]):
    """Runs one layer's attention: store new K/V in the paged cache (unless the op does, see
    ``Capabilities.stores_kv``), then attend.

    Constructed once per layer by ``vattn.Attention`` with the layer's hyperparameters. The base
    constructor checks what every impl shares: ``attn_type`` among ``attn_types``, a known
    ``kv_cache_dtype``, one ALiBi slope and one sink per query head, KV heads dividing the query
    heads; errors name the impl by ``backend_name``. Subclasses add their own checks after it.
    """

    backend_name: ClassVar[str] = ""
    """The registry name errors use (e.g. ``"TRITON_ATTN"``); empty: the class name."""
    attn_types: ClassVar[tuple[str, ...]] = AttentionType.ALL
    """The ``attn_type`` values the impl serves (the backend's ``Capabilities.attn_types``)."""

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
        name = self.backend_name or type(self).__name__
        if attn_type not in AttentionType.ALL:
            raise ValueError(f"{name} attn_type: expected one of {AttentionType.ALL}, got {attn_type!r}; "
                             "use a vattn.AttentionType constant.")
        if attn_type not in self.attn_types:
            only = " (decoder self-attention over the paged cache)" if self.attn_types == (AttentionType.DECODER,) else ""
            raise NotImplementedError(f"{name} attn_type: expected one of {self.attn_types}{only}, got {attn_type!r}; "
                                      "use a backend that serves it (TORCH_SDPA serves every attention type).")
        if kv_cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"{name} kv_cache_dtype: expected one of {CACHE_DTYPES}, got {kv_cache_dtype!r}; "
                             "set CacheConfig.cache_dtype to one of them.")
        if alibi_slopes is not None and len(alibi_slopes) != num_heads:
            raise ValueError(f"{name} alibi_slopes: expected num_heads = {num_heads} slopes, got "
                             f"{len(alibi_slopes)}; give one slope per query head.")
        self.num_heads, self.head_size = num_heads, head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads if num_kv_heads is not None else num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{name} num_kv_heads: expected a divisor of num_heads = {num_heads}, "
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
    def forward(self, layer: "AttentionLayerBase", query: torch.Tensor, key: torch.Tensor | None,
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

    def split_kv_cache(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value caches, (num_blocks, block_size, Hk, D) each, of the layer's cache
        tensor (the standard shape's ``[0]`` and ``[1]``). The op stores K/V into them for
        backends that declare ``Capabilities(stores_kv=False)``."""
        return kv_cache[0], kv_cache[1]

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


class AttentionLayerBase(ABC):
    """What every attention layer (``vattn.Attention``, and an MLA layer beside it) is to the
    rest of vattn: a module with a backend, an impl and a KV cache, registered by name in its
    config's static forward context."""

    impl: "AttentionImpl"
    attn_backend: type[AttentionBackend]
    quant_method: Any = None
    layer_name: str
    kv_cache: list[torch.Tensor]

    def get_attn_backend(self) -> type[AttentionBackend]:
        """The backend class this layer runs."""
        return self.attn_backend

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        """After the checkpoint is loaded: the quant method's and the impl's conversions."""
        if self.quant_method is not None:
            self.quant_method.process_weights_after_loading(self)
        self.impl.process_weights_after_loading(act_dtype)

    def get_kv_cache_spec(self, dtype: torch.dtype) -> AttentionSpec:
        """The layer's cache spec storing ``dtype`` (``allocate_kv_cache`` groups layers by it)."""
        layer: Any = self
        return AttentionSpec(block_size=layer.block_size, num_kv_heads=layer.num_kv_heads, head_size=layer.head_size,
                             dtype=dtype, cache_dtype_str=layer.kv_cache_dtype, sliding_window=layer.sliding_window)

"""TRITON_ATTN: vattn's own Triton paged-attention kernels behind the backend interface.

One launch of ``vattn.ops.triton_unified_attention.unified_attention`` serves a whole mixed
batch (decodes and chunked prefills with cached context), preceded by ``store_kv``; decode
batches (and CUDA graphs captured for them) store the new K/V inside the attention kernel
(``VATTN_TRITON_FUSED_KV_STORE=0`` turns that off).

| feature | support |
| --- | --- |
| head sizes | multiples of 8 up to 256 (computed padded to a power of two) |
| block sizes | any (the kernel reads the block table per token; 16 and 32 are the GPU-tested ones) |
| dtypes | fp16, bf16, fp32 |
| KV cache | auto, bfloat16, float16, float32, fp8 / fp8_e4m3, fp8_e5m2 (per-layer scales) |
| extras | GQA/MQA, causal with offset, sliding window, soft cap, ALiBi, sinks, fp8 query, fp8 output |
| attention types | decoder, encoder-decoder (cross-attention over the cached encoder K/V) |
| CUDA graphs | ``ALWAYS``: persistent metadata buffers, one kernel path per captured size |

KV cache: logical ``(2, num_blocks, block_size, Hk, D)``; physical NHD or HND by
``vattn.backends.utils.get_kv_cache_layout()`` (the kernels use strides).
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from vattn import envs
from vattn.backends.abstract import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadata,
    AttentionType,
)
from vattn.backends.utils import (
    AttentionMetadataBuilder,
    AttentionSpec,
    CommonAttentionMetadata,
    check_kv_cache_shape_args,
    paged_kv_stride_order,
)
from vattn.config import CACHE_DTYPES

if TYPE_CHECKING:
    from vattn.config import VattnConfig
    from vattn.layer import Attention
    from vattn.ops.triton_unified_attention import UnifiedAttentionConfig

logger = logging.getLogger("vattn.backends.triton_attn")

#: Write a step's metadata into the persistent (CUDA-graph) buffers with one kernel
#: (``vattn.ops.triton_metadata``) instead of one copy per array; False: ``copy_`` each.
FUSED_METADATA_COPY = True

__all__ = [
    "TritonAttentionBackend",
    "TritonAttentionImpl",
    "TritonAttentionMetadata",
    "TritonAttentionMetadataBuilder",
]

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_NO_PLAN: Any = object()  # no plan recorded yet for a signature
_SUPPORTED_TYPES = (AttentionType.DECODER, AttentionType.ENCODER_DECODER)


class TritonAttentionBackend(AttentionBackend):
    """vattn's Triton backend: portable wherever Triton runs (GPU, or CPU under TRITON_INTERPRET=1)."""

    accept_output_buffer: ClassVar[bool] = True
    supports_quant_query_input: ClassVar[bool] = True
    supports_output_quant: ClassVar[bool] = True
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16, torch.float32)
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = CACHE_DTYPES
    supports_sink: ClassVar[bool] = True

    @staticmethod
    def get_name() -> str:
        return "TRITON_ATTN"

    @staticmethod
    def get_impl_cls() -> type["TritonAttentionImpl"]:
        return TritonAttentionImpl

    @staticmethod
    def get_metadata_cls() -> type["TritonAttentionMetadata"]:
        return TritonAttentionMetadata

    @staticmethod
    def get_builder_cls() -> type["TritonAttentionMetadataBuilder"]:
        return TritonAttentionMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        """``(2, num_blocks, block_size, num_kv_heads, head_size)``; ``[0]`` keys, ``[1]`` values."""
        check_kv_cache_shape_args(num_blocks, block_size, num_kv_heads, head_size)
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_kv_cache_stride_order() -> tuple[int, ...]:
        """Identity for NHD, ``(0, 1, 3, 2, 4)`` for HND (``get_kv_cache_layout()``)."""
        return paged_kv_stride_order()

    @classmethod
    def get_supported_head_sizes(cls) -> tuple[int, ...]:
        return tuple(range(8, 257, 8))

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        try:
            import triton  # noqa: F401
        except ImportError:
            return False, "triton is not installed; pip install 'vattn[triton]' (triton>=3.6)"
        if torch.cuda.is_available() or envs.TRITON_INTERPRET:
            return True, ""
        return False, ("TRITON_ATTN needs a CUDA GPU, or TRITON_INTERPRET=1 to run its kernels on CPU "
                       "through the Triton interpreter (slow; for tests)")


@dataclass
class TritonAttentionMetadata(AttentionMetadata):
    """One step's metadata. T = token rows of the step (padded), Bk = requests the kernel sees.

    Under CUDA graphs (T <= the largest capture size) every tensor is a view of the builder's
    persistent buffers and ``Bk = T``: requests past ``num_reqs`` are empty padding
    (``query_start_loc`` repeats the token count, ``seq_lens`` is 0).

    | field | shape / type | meaning |
    | --- | --- | --- |
    | num_actual_tokens | int | real tokens (rows of output written) |
    | num_tokens | int | T: rows of slot_mapping (= query rows, except for cross-attention) |
    | num_reqs | int | requests in the batch (as given) |
    | max_query_len, max_seq_len | int | batch maxima |
    | query_start_loc | (Bk + 1,) int32 | cumulative query lengths |
    | seq_lens | (Bk,) int32 | cached + new tokens per request |
    | block_table | (Bk, max_blocks) int32 | block ids per request |
    | slot_mapping | (T,) int64 | cache slot of each new token, -1 = padding |
    | causal | bool | the batch's causal flag |
    | config | UnifiedAttentionConfig | launch config (tiles, splits), fixed per captured size |
    | partial_out, partial_lse | fp32 or None | split-KV scratch (the builder's, persistent) |
    """

    num_actual_tokens: int
    num_tokens: int
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool
    config: "UnifiedAttentionConfig"
    partial_out: torch.Tensor | None = None
    partial_lse: torch.Tensor | None = None
    #: Per layer signature: the launches the step's first such layer made (``LaunchPlan``).
    launch_plans: dict[Any, Any] = dataclasses.field(default_factory=dict, repr=False, compare=False)


class TritonAttentionMetadataBuilder(AttentionMetadataBuilder[TritonAttentionMetadata]):
    """Builds ``TritonAttentionMetadata``; full CUDA graphs for any batch (``ALWAYS``).

    On CUDA, batches of at most ``max_graph_tokens`` rows (the largest capture size) are
    copied into persistent buffers, updated in place every step, so a captured graph reads
    this step's data (the ``vattn.cudagraph`` builder contract). The kernel then sees
    ``Bk = T`` requests (past ``num_reqs``: empty) and a config chosen from ``T`` and whether
    the batch is decode-only, so each captured size holds one kernel path that is valid for
    every batch of that size. Larger batches run on the caller's tensors. The split-KV
    scratch is allocated once and every metadata carries it.
    """

    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.ALWAYS

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vattn_config: "VattnConfig",
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vattn_config, device)
        from vattn.ops.triton_metadata import copy_decode_metadata
        from vattn.ops.triton_unified_attention import (
            default_max_split_rows,
            device_num_sms,
            split_scratch_numel,
        )

        self._copy_metadata = copy_decode_metadata
        comp = vattn_config.compilation
        layers = comp.static_forward_context
        heads = [getattr(layers.get(n), "num_heads", None) for n in layer_names]
        heads = [h for h in heads if isinstance(h, int)]
        # Query heads size the split scratch; unknown (no registered layer): assume 8 per KV head.
        self.num_q_heads = max(heads) if heads else 8 * kv_cache_spec.num_kv_heads
        self.num_sms = device_num_sms(self.device)
        self.max_split_rows = default_max_split_rows(self.num_q_heads, kv_cache_spec.head_size)
        n_o, n_lse = split_scratch_numel(self.max_split_rows, self.num_q_heads, kv_cache_spec.head_size)
        self.partial_out = torch.empty(n_o, dtype=torch.float32, device=self.device)
        self.partial_lse = torch.empty(n_lse, dtype=torch.float32, device=self.device)
        # CUDA graphs exist only on CUDA; elsewhere skip the copies (tests may turn this on).
        self.use_persistent_buffers = self.device.type == "cuda"
        self.max_graph_tokens = max([comp.max_capture_size, *comp.capture_sizes()])
        self._captured = False
        self._configs: dict[tuple[int, int, int], "UnifiedAttentionConfig"] = {}
        self._allocate(self.max_graph_tokens, 1)

    def _allocate(self, num_tokens: int, width: int) -> None:
        """(Re)allocate the persistent buffers: ``num_tokens`` rows, block tables ``width`` wide."""
        dev = self.device
        self.max_graph_tokens = num_tokens
        self._qsl = torch.zeros(num_tokens + 1, dtype=torch.int32, device=dev)
        self._seq_lens = torch.zeros(num_tokens, dtype=torch.int32, device=dev)
        self._slots = torch.full((num_tokens,), -1, dtype=torch.int64, device=dev)
        self._block_table = torch.zeros((num_tokens, width), dtype=torch.int32, device=dev)

    def _fits(self, cm: CommonAttentionMetadata) -> bool:
        t = cm.slot_mapping.shape[0]
        return (self.use_persistent_buffers and 0 < t and max(t, cm.num_reqs) <= self.max_graph_tokens
                and cm.block_table_tensor.shape[1] <= self._block_table.shape[1])

    def _config(self, num_tokens: int, num_seqs: int, max_query_len: int) -> "UnifiedAttentionConfig":
        """The launch config for these static sizes (chosen once per distinct triple)."""
        key = (num_tokens, num_seqs, max_query_len)
        config = self._configs.get(key)
        if config is None:
            from vattn.ops.triton_unified_attention import select_unified_attention_config

            spec = self.kv_cache_spec
            config = self._configs[key] = select_unified_attention_config(
                num_tokens=num_tokens, num_seqs=num_seqs, num_q_heads=self.num_q_heads,
                num_kv_heads=spec.num_kv_heads, head_size=spec.head_size, max_seqlen_q=max_query_len,
                num_sms=self.num_sms, max_split_rows=self.max_split_rows,
                kv_fp8=spec.cache_dtype_str.startswith("fp8"),
            )
        return config

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> TritonAttentionMetadata:
        cm = common_attn_metadata
        num_tokens, b = cm.slot_mapping.shape[0], cm.num_reqs
        if not self._captured and self.use_persistent_buffers and 0 < num_tokens <= self.max_graph_tokens:
            # Before any capture the block-table buffer may still widen (capture batches are widest).
            width = cm.block_table_tensor.shape[1]
            if width > self._block_table.shape[1]:
                self._block_table = torch.zeros((self.max_graph_tokens, width), dtype=torch.int32,
                                                device=self.device)
        if self._fits(cm):
            bk = max(num_tokens, b)
            bt = cm.block_table_tensor
            if (FUSED_METADATA_COPY and self.device.type == "cuda" and bt.stride(1) == 1 and bt.is_cuda
                    and cm.query_start_loc.is_cuda and cm.seq_lens.is_cuda and cm.slot_mapping.is_cuda):
                # One launch instead of four to six copies (vattn.ops.triton_metadata).
                self._copy_metadata(cm.query_start_loc, cm.seq_lens, cm.slot_mapping, bt[:b],
                                     self._qsl[: bk + 1], self._seq_lens[:bk], self._slots[:num_tokens],
                                     self._block_table[:b, : bt.shape[1]])
            else:
                self._qsl[: b + 1].copy_(cm.query_start_loc[: b + 1], non_blocking=True)
                self._seq_lens[:b].copy_(cm.seq_lens[:b], non_blocking=True)
                if bk > b:  # padded requests (a launch each; none for a batch of exactly bk requests)
                    self._qsl[b + 1 : bk + 1].fill_(int(cm.query_start_loc_cpu[b]))
                    self._seq_lens[b:bk].fill_(0)
                self._slots[:num_tokens].copy_(cm.slot_mapping, non_blocking=True)
                self._block_table[:b, : bt.shape[1]].copy_(bt[:b], non_blocking=True)
            qsl, seq_lens = self._qsl[: bk + 1], self._seq_lens[:bk]
            block_table, slots = self._block_table[:bk], self._slots[:num_tokens]
        else:
            bk = b
            qsl, seq_lens = cm.query_start_loc[: b + 1], cm.seq_lens[:b]
            block_table, slots = cm.block_table_tensor[:b], cm.slot_mapping
        return TritonAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            num_tokens=num_tokens,
            num_reqs=b,
            max_query_len=cm.max_query_len,
            max_seq_len=cm.max_seq_len,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_table=block_table,
            slot_mapping=slots,
            causal=cm.causal,
            config=self._config(num_tokens, bk, cm.max_query_len),
            partial_out=self.partial_out,
            partial_lse=self.partial_lse,
        )

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> TritonAttentionMetadata:
        """Capture-time metadata through the persistent buffers (grown first if this batch is larger)."""
        cm = common_attn_metadata
        t, width = cm.slot_mapping.shape[0], cm.block_table_tensor.shape[1]
        if not self.use_persistent_buffers:
            raise ValueError(f"CUDA graphs need a CUDA device; this TRITON_ATTN builder is on {self.device}.")
        if max(t, cm.num_reqs) > self.max_graph_tokens or width > self._block_table.shape[1]:
            if self._captured:
                logger.warning(
                    "TRITON_ATTN: capturing %d tokens / %d block-table columns after smaller captures; "
                    "the persistent buffers grow and graphs captured before must be captured again "
                    "(capture the largest size, with the widest block table, first).", t, width)
            self._allocate(max(t, cm.num_reqs, self.max_graph_tokens), max(width, self._block_table.shape[1]))
        self._captured = True
        return self.build(0, cm)


def _ops() -> tuple[Any, Any, Any]:
    """The kernels' launchers (imported on first use: importing them imports Triton), looked
    up in ``sys.modules`` on every call: tests reload them for the Triton interpreter."""
    try:
        unified = sys.modules["vattn.ops.triton_unified_attention"]
        return sys.modules["vattn.ops.kv_store"].store_kv, unified.head_pad, unified.unified_attention
    except KeyError:
        from vattn.ops.kv_store import store_kv
        from vattn.ops.triton_unified_attention import head_pad, unified_attention

        return store_kv, head_pad, unified_attention


def _is_static_per_tensor_fp8(quant_key: Any) -> bool:
    """Whether ``quant_key`` (a QuantKey-like object or a dtype) means static per-tensor fp8."""
    if isinstance(quant_key, torch.dtype):
        return quant_key in _FP8
    dtype = getattr(quant_key, "dtype", None)
    scale = getattr(quant_key, "scale", quant_key)
    static = getattr(scale, "static", True)
    group = getattr(scale, "group_shape", None)
    per_tensor = group is None or "TENSOR" in str(getattr(group, "name", group)).upper()
    return dtype in _FP8 and bool(static) and per_tensor


def _fixed_signature(key_cache: torch.Tensor, value_cache: torch.Tensor,
                     others: tuple[torch.Tensor | None, ...]) -> tuple[Any, ...] | None:
    """The launch-plan signature part of a layer's cache and scales (computed once per bound
    cache): shapes, strides, dtypes, devices; None when one of them is not 16-byte aligned."""
    ptrs = key_cache.data_ptr() | value_cache.data_ptr()
    for t in others:
        if t is not None:
            ptrs |= t.data_ptr()
    if ptrs & 15:
        return None
    return (key_cache.shape, key_cache.stride(), key_cache.dtype, key_cache.device, value_cache.stride(),
            tuple(None if t is None else (t.dtype, t.device) for t in others))


class TritonAttentionImpl(AttentionImpl[TritonAttentionMetadata]):
    """Stores new K/V (``store_kv``), then runs the unified Triton kernel into ``output``.

    On CUDA, the first layer of a step (per ``_plan_signature``) records its launches in the
    step's metadata (``launch_plans``); the other layers repeat them with their own tensors
    (``vattn.ops.triton_launch.LaunchPlan``), skipping validation and Triton's argument
    handling: what an eager attention step between CUDA-graph pieces costs on the host."""

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
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                         kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads}).")
        if attn_type not in _SUPPORTED_TYPES:
            raise NotImplementedError(
                f"TRITON_ATTN serves attn_type {_SUPPORTED_TYPES}, got {attn_type!r}; use TORCH_SDPA or "
                "FLASH_ATTN for encoder self-attention."
            )
        if kv_cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {CACHE_DTYPES}, got {kv_cache_dtype!r}.")
        if head_size > 256:
            raise ValueError(f"TRITON_ATTN supports head_size <= 256, got {head_size}; use TORCH_SDPA.")
        if self.alibi_slopes is not None and self.alibi_slopes.shape != (num_heads,):
            raise ValueError(
                f"alibi_slopes must have num_heads = {num_heads} entries, got {tuple(self.alibi_slopes.shape)}."
            )
        self._alibi_cache: dict[torch.device, torch.Tensor] = {}
        self._fixed: tuple[Any, ...] | None = None  # (cache, scales...), K view, V view, their signature part
        self._static_signature = (type(self), self.num_heads, self.num_kv_heads, self.head_size, self.scale,
                                  self.sliding_window, self.logits_soft_cap, self.kv_cache_dtype, self.attn_type,
                                  self.kv_sharing_target_layer_name is None)

    def _alibi(self, device: torch.device) -> torch.Tensor | None:
        if self.alibi_slopes is None:
            return None
        if device not in self._alibi_cache:  # copied once (first, eager forward), not per step
            self._alibi_cache[device] = self.alibi_slopes.to(device=device, dtype=torch.float32)
        return self._alibi_cache[device]

    def fused_output_quant_supported(self, quant_key: Any) -> bool:
        """Static per-tensor fp8 output (``output_scale``) is written by the kernel itself."""
        return _is_static_per_tensor_fp8(quant_key)

    def forward(
        self,
        layer: "Attention",
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: TritonAttentionMetadata | None,
        output: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """See ``AttentionImpl.forward``. Device work only (no host syncs): CUDA-graph safe."""
        if output is None:
            raise ValueError("TritonAttentionImpl.forward: output must be a (T, H, D) buffer (accept_output_buffer).")
        if attn_metadata is None:
            return output
        if query.dim() != 3 or query.shape[1:] != (self.num_heads, self.head_size):
            raise ValueError(
                f"query must be (T, num_heads={self.num_heads}, head_size={self.head_size}), got {tuple(query.shape)}."
            )
        if (output_scale is not None) != (output.dtype in _FP8):
            raise ValueError(
                f"output dtype {output.dtype} and output_scale ({'given' if output_scale is not None else 'None'}) "
                "disagree: fp8 output needs output_scale, other dtypes take none."
            )
        md = attn_metadata
        alibi = None if self.alibi_slopes is None else self._alibi(query.device)
        fixed = (kv_cache, layer._k_scale, layer._v_scale, layer._q_scale, alibi, self.sinks)
        views = self._fixed
        if views is None or not all(map(operator.is_, views[0], fixed)):
            # Once per bound cache (and scales): the cache unbound into K / V, and the part of
            # the launch-plan signature that depends on these tensors only.
            key_cache, value_cache = kv_cache.unbind(0)
            views = self._fixed = (fixed, key_cache, value_cache, _fixed_signature(key_cache, value_cache, fixed[1:]))
        _, key_cache, value_cache, fixed_sig = views
        # Every layer of a step makes the same launches with its own tensors: the first one
        # records them (validated, specialized) and the others repeat them (LaunchPlan).
        roles = (query, key, value, output, key_cache, value_cache, layer._k_scale, layer._v_scale,
                 layer._q_scale, output_scale, alibi, self.sinks)
        sig = self._plan_signature(query, key, value, output, output_scale, fixed_sig)
        plan = md.launch_plans.get(sig, _NO_PLAN) if sig is not None else None
        if plan is _NO_PLAN:  # this step's first layer of this signature: record
            from vattn.ops.triton_launch import LaunchPlan, record_launches

            with record_launches() as launches:
                self._launch(layer, query, key, value, key_cache, value_cache, md, output, output_scale)
            md.launch_plans[sig] = LaunchPlan.build(launches, roles, (
                md.query_start_loc, md.seq_lens, md.block_table, md.slot_mapping, md.partial_out, md.partial_lse))
        elif plan is None or not plan.run(roles):  # no plan (or FastLaunch switched off since)
            self._launch(layer, query, key, value, key_cache, value_cache, md, output, output_scale)
        return output

    def _plan_signature(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, o: torch.Tensor,
                        output_scale: torch.Tensor | None, fixed_sig: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
        """What makes two calls of one step launch the same way, besides their tensors: the
        impl's settings, the tensors' shapes, strides and dtypes (all 16-byte aligned), and
        ``fixed_sig`` (``_fixed_signature`` of the layer's cache and scales, with their device).
        None: no plan (a misaligned tensor, or one not on CUDA: a plan passes bare addresses,
        which Triton does not check)."""
        if fixed_sig is None or not (q.is_cuda and o.is_cuda):
            return None
        ptrs = q.data_ptr() | o.data_ptr()
        for t in (k, v, output_scale):
            if t is not None:
                if not t.is_cuda:
                    return None
                ptrs |= t.data_ptr()
        if ptrs & 15:
            return None
        return (self._static_signature, fixed_sig, q.shape, q.stride(), q.dtype, o.shape, o.stride(), o.dtype,
                None if k is None else (k.shape, k.stride(), k.dtype), None if v is None else (v.shape, v.stride(), v.dtype),
                None if output_scale is None else output_scale.dtype)

    def _launch(self, layer: "Attention", query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
                key_cache: torch.Tensor, value_cache: torch.Tensor, md: TritonAttentionMetadata,
                output: torch.Tensor, output_scale: torch.Tensor | None) -> None:
        """Store the new K/V, then attend (the validated, general path)."""
        store_kv, head_pad, unified_attention = _ops()
        config = md.config
        store = self.kv_sharing_target_layer_name is None and key is not None and value is not None
        # Decode configs store the new K/V inside the attention kernel (one launch less).
        fuse = (store and config.one_loop and self.attn_type == AttentionType.DECODER
                and envs.VATTN_TRITON_FUSED_KV_STORE)
        if store and not fuse:
            store_kv(key, value, key_cache, value_cache, md.slot_mapping,
                     self.kv_cache_dtype, layer._k_scale, layer._v_scale)
        splits = config.num_splits
        if splits > 1 and md.partial_out is not None:
            # Static shape arithmetic: fewer splits when the scratch cannot hold these rows (more
            # query rows than planned, as in cross-attention, or a builder without layer facts).
            per_split = query.shape[0] * self.num_heads * head_pad(self.head_size)
            while splits > 1 and splits * per_split > md.partial_out.numel():
                splits //= 2
            if splits != config.num_splits:
                config = dataclasses.replace(config, num_splits=splits)
        causal = md.causal and self.attn_type == AttentionType.DECODER
        window = None
        if self.sliding_window is not None and self.attn_type == AttentionType.DECODER:
            window = (self.sliding_window[0], 0 if causal else -1)
        unified_attention(
            query, key_cache, value_cache, output,
            cu_seqlens_q=md.query_start_loc, seqused_k=md.seq_lens, block_table=md.block_table,
            max_seqlen_q=md.max_query_len, max_seqlen_k=md.max_seq_len,
            softmax_scale=self.scale, causal=causal, window=window,
            softcap=self.logits_soft_cap or 0.0, alibi_slopes=self._alibi(query.device),
            sinks=self.sinks,
            q_scale=layer._q_scale if query.dtype in _FP8 else None,
            k_scale=layer._k_scale, v_scale=layer._v_scale, output_scale=output_scale,
            config=config, partial_out=md.partial_out, partial_lse=md.partial_lse,
            key=key if fuse else None, value=value if fuse else None,
            slot_mapping=md.slot_mapping if fuse else None,
        )

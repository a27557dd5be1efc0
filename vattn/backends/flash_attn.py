"""FLASH_ATTN: FlashAttention's varlen paged kernels behind the vattn backend interface.

The only vattn module that imports ``flash_attn`` / ``flash_attn_interface`` (lazily). It uses
the first interface that is installed and runs paged KV on this GPU, in this order:

| interface | call | paged KV | CUDA graphs |
| --- | --- | --- | --- |
| flash-attn-4 (``flash_attn.cute``) | varlen fwd with ``page_table``, ``seqused_k``, ``cu_seqlens_q``, ``out=`` | SM90, SM100/110 | ALWAYS |
| FA3 (``flash_attn_interface``) | ``flash_attn_with_kvcache`` with ``page_table``, ``cache_seqlens``, ``cu_seqlens_q`` | SM90 | ALWAYS |
| FA2 (``flash_attn`` 2.x) | ``flash_attn_varlen_func`` with ``block_table`` | SM80+, block size % 256 == 0 | UNIFORM_BATCH |

One varlen call serves a mixed batch of decodes and (chunked) prefills. KV cache: logical
``(2, num_blocks, block_size, Hk, D)``, physical NHD or HND. For CUDA graphs (the contract in
``vattn.cudagraph``) the builder keeps persistent ``cu_seqlens_q`` / ``seqused_k`` / page-table /
slot buffers: a step of ``T <= max capture size`` tokens runs as ``T`` requests (the extra ones
empty) with ``max_seqlen_q = T`` and ``max_seqlen_k = width * block_size``, launch parameters
that depend on ``T`` only, so any batch of ``T`` tokens replays the graph captured for ``T`` (and
the eager warm-up before a capture compiles the very kernel the capture records).

Features: sliding window, soft cap (all); sinks (flash-attn-4 ``learnable_sink``); ALiBi (FA2);
fp8 KV caches with fp8 queries and descales (FA3 on SM90, flash-attn-4 on SM100), bf16 models.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import torch

from vattn.backends.abstract import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadata,
    AttentionType,
    is_fp8_kv_cache,
)
from vattn.backends.utils import (
    AttentionMetadataBuilder,
    AttentionSpec,
    CommonAttentionMetadata,
    check_kv_cache_shape_args,
    paged_kv_stride_order,
)
from vattn.config import CUDAGraphMode
from vattn.ops.kv_store import fp8_dtype_for, store_kv

if TYPE_CHECKING:
    from vattn.config import VattnConfig
    from vattn.layer import Attention

__all__ = [
    "FlashAttentionBackend",
    "FlashAttentionImpl",
    "FlashAttentionMetadata",
    "FlashAttentionMetadataBuilder",
    "FlashAttnInterface",
    "get_flash_attn_interface",
    "interface_reasons",
]

logger = logging.getLogger("vattn.backends.flash_attn")

_FULL_GRAPH_MODES = (CUDAGraphMode.FULL, CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL_AND_PIECEWISE)
_MAX_GRAPH_TABLE_ENTRIES = 1 << 22  # persistent page-table cap (entries) unless the cache is smaller
_PLAIN_KV = ("auto", "bfloat16", "float16")


@dataclass(frozen=True)
class FlashAttnInterface:
    """The FlashAttention generation in use: ``"fa4"``, ``"fa3"`` or ``"fa2"``."""

    name: str
    version: str
    fn: Callable[..., Any]  # the paged varlen entry point
    has_out: bool = False  # ``fn`` takes ``out=`` (no copy of the result)


def _fa4(arch: int) -> FlashAttnInterface | None:
    if arch // 10 not in (9, 10, 11):  # no paged KV on SM80 / SM120 in flash-attn-4
        return None
    mod = importlib.import_module("flash_attn.cute.interface")
    from importlib.metadata import version

    fwd = getattr(mod, "_flash_attn_fwd", None)
    if fwd is not None and {"out", "page_table", "seqused_k"} <= set(inspect.signature(fwd).parameters):
        return FlashAttnInterface("fa4", version("flash-attn-4"), fwd, has_out=True)
    return FlashAttnInterface("fa4", version("flash-attn-4"), mod.flash_attn_varlen_func)


def _fa3(arch: int) -> FlashAttnInterface | None:
    if arch // 10 != 9:
        return None
    mod = importlib.import_module("flash_attn_interface")
    return FlashAttnInterface("fa3", str(getattr(mod, "__version__", "3")), mod.flash_attn_with_kvcache)


def _fa2(arch: int) -> FlashAttnInterface | None:
    mod = importlib.import_module("flash_attn")
    ver = str(getattr(mod, "__version__", ""))
    if arch < 80 or not ver.startswith("2.") or not hasattr(mod, "flash_attn_varlen_func"):
        return None
    return FlashAttnInterface("fa2", ver, mod.flash_attn_varlen_func)


@functools.lru_cache(maxsize=1)
def get_flash_attn_interface() -> tuple[FlashAttnInterface | None, str]:
    """The interface to use on this machine, or ``(None, why not)``."""
    if not torch.cuda.is_available():
        return None, "FLASH_ATTN needs a CUDA GPU and none is visible"
    major, minor = torch.cuda.get_device_capability()
    arch = major * 10 + minor
    why: list[str] = []
    for probe, label in ((_fa4, "flash-attn-4"), (_fa3, "FA3 (flash_attn_interface)"), (_fa2, "FA2 (flash_attn 2.x)")):
        try:
            iface = probe(arch)
        except Exception as e:  # not installed, or fails to import (e.g. a CUDA/torch ABI mismatch)
            why.append(f"{label}: {type(e).__name__}: {e}")
            continue
        if iface is not None:
            return iface, ""
        why.append(f"{label}: no paged KV on compute capability {major}.{minor}")
    return None, "no usable FlashAttention (" + "; ".join(why) + "); pip install flash-attn-4"


def interface_reasons(
    name: str, arch: int, head_size: int, dtype: torch.dtype, kv_cache_dtype: str, block_size: int, has_sink: bool
) -> list[str]:
    """Why interface ``name`` on compute capability ``arch`` (e.g. 90) cannot serve a configuration."""
    out: list[str] = []
    if dtype not in (torch.float16, torch.bfloat16):
        out.append(f"dtype {dtype} not in [torch.float16, torch.bfloat16]")
    sm100 = name == "fa4" and arch // 10 in (10, 11)  # flash-attn-4 on Blackwell: <= 128, or 256
    if head_size % 8 or not (8 <= head_size <= (128 if sm100 else 256) or head_size == 256):
        allowed = "multiples of 8 in [8, 128], or 256" if sm100 else "multiples of 8 in [8, 256]"
        out.append(f"{name} on sm{arch}: head_size {head_size} not in {allowed}")
    if name == "fa2" and block_size % 256:
        out.append(f"fa2 paged KV needs block_size % 256 == 0, got {block_size} (install flash-attn-4 or FA3)")
    fp8_ok = (name == "fa3" and kv_cache_dtype in ("fp8", "fp8_e4m3")) or (name == "fa4" and arch // 10 in (10, 11))
    if is_fp8_kv_cache(kv_cache_dtype):
        if not fp8_ok:
            out.append(f"{name} on sm{arch} has no fp8 KV cache '{kv_cache_dtype}' (FA3 on SM90: fp8_e4m3; "
                       "flash-attn-4 on SM100); use FLASHINFER or TRITON_ATTN")
        elif dtype != torch.bfloat16:
            out.append(f"fp8 KV with {name} writes bfloat16 output: the model dtype must be bfloat16, got {dtype}")
    elif kv_cache_dtype not in _PLAIN_KV:
        out.append(f"kv_cache_dtype {kv_cache_dtype!r} not in {list(_PLAIN_KV)} (or fp8)")
    if has_sink and name != "fa4":
        out.append(f"attention sinks need flash-attn-4 (learnable_sink), {name} has none")
    return out


class FlashAttentionBackend(AttentionBackend):
    """FlashAttention (flash-attn-4, FA3 or FA2, whichever is installed) over a paged KV cache."""

    accept_output_buffer: ClassVar[bool] = True
    supports_quant_query_input: ClassVar[bool] = True  # fp8 KV caches attend with fp8 queries
    supports_sink: ClassVar[bool] = True  # flash-attn-4 only: validate_configuration says so

    @staticmethod
    def get_name() -> str:
        return "FLASH_ATTN"

    @staticmethod
    def get_impl_cls() -> type["FlashAttentionImpl"]:
        return FlashAttentionImpl

    @staticmethod
    def get_metadata_cls() -> type["FlashAttentionMetadata"]:
        return FlashAttentionMetadata

    @staticmethod
    def get_builder_cls() -> type["FlashAttentionMetadataBuilder"]:
        return FlashAttentionMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, cache_dtype_str: str = "auto"
    ) -> tuple[int, ...]:
        """``(2, num_blocks, block_size, num_kv_heads, head_size)``; ``[0]`` keys, ``[1]`` values."""
        check_kv_cache_shape_args(num_blocks, block_size, num_kv_heads, head_size)
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_kv_cache_stride_order() -> tuple[int, ...]:
        """Identity for NHD; ``(0, 1, 3, 2, 4)`` for HND."""
        return paged_kv_stride_order()

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        iface, why = get_flash_attn_interface()
        return iface is not None, why

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
        iface, why = get_flash_attn_interface()
        if iface is None:
            return [why]
        major, minor = torch.cuda.get_device_capability()
        reasons = interface_reasons(iface.name, major * 10 + minor, head_size, dtype, kv_cache_dtype or "auto",
                                    block_size, has_sink)
        if use_mla:
            reasons.append("MLA not supported (use an MLA backend)")
        if use_sparse:
            reasons.append("sparse attention not supported")
        return reasons

    @classmethod
    def get_cudagraph_support(cls) -> AttentionCGSupport:
        iface, _ = get_flash_attn_interface()
        return _cg_support(iface)


def _cg_support(iface: FlashAttnInterface | None) -> AttentionCGSupport:
    if iface is not None and iface.name == "fa2":
        return AttentionCGSupport.UNIFORM_BATCH
    return AttentionCGSupport.ALWAYS


@dataclass
class FlashAttentionMetadata(AttentionMetadata):
    """One step's metadata; B = requests the kernel sees (the padded ``T`` in graph mode).

    | field | shape | meaning |
    | --- | --- | --- |
    | query_start_loc | (B+1,) int32 | cu_seqlens_q |
    | seq_lens | (B,) int32 | seqused_k (cached + new tokens) |
    | block_table | (B, W) int32 | page table |
    | cu_seqlens_k | (B+1,) int32 or None | FA2 only |

    ``use_cuda_graph``: ``T`` is a (captured) CUDA-graph size, so the fields are views of the
    persistent buffers (small eager batches on CUDA use them too, with ``use_cuda_graph`` False).
    """

    num_actual_tokens: int
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    max_query_len: int
    max_seq_len: int
    causal: bool = True
    cu_seqlens_k: torch.Tensor | None = None
    use_cuda_graph: bool = False


class FlashAttentionMetadataBuilder(AttentionMetadataBuilder[FlashAttentionMetadata]):
    """Persistent buffers and launch params fixed per token count ``T`` for every batch up to the
    largest capture size (on CUDA; capture sizes only elsewhere), the caller's tensors with exact
    launch params above it. ``cudagraph_support`` follows the interface (see the module table)."""

    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.ALWAYS
    reorder_batch_threshold: ClassVar[int | None] = 1

    def __init__(
        self, kv_cache_spec: AttentionSpec, layer_names: list[str], vattn_config: "VattnConfig", device: torch.device
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vattn_config, device)
        iface, _ = get_flash_attn_interface() if torch.cuda.is_available() else (None, "")
        self.iface = iface
        self.cudagraph_support = _cg_support(iface)  # type: ignore[misc]  (per interface)
        comp = vattn_config.compilation
        self._capture_sizes = set(comp.capture_sizes()) if comp.cudagraph_mode in _FULL_GRAPH_MODES else set()
        self._max_graph_tokens = max([comp.max_capture_size, *comp.capture_sizes()])
        self._graph_sizes: set[int] = set()
        self._buffers: dict[str, torch.Tensor] | None = None
        # On CUDA every batch of at most the largest capture size takes the persistent path, so an
        # eager warm-up runs the very launch parameters (and JIT-compiled kernel) a capture will.
        self.use_persistent_buffers = self.device.type == "cuda"
        context = vattn_config.compilation.static_forward_context
        self._layer = context.get(layer_names[0]) if layer_names else None

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> FlashAttentionMetadata:
        return self._build(common_attn_metadata, force_graph=True)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> FlashAttentionMetadata:
        return self._build(common_attn_metadata, force_graph=False)

    def _build(self, cm: CommonAttentionMetadata, force_graph: bool) -> FlashAttentionMetadata:
        rows = cm.slot_mapping.shape[0]
        if force_graph or rows in self._graph_sizes or rows in self._capture_sizes:
            return self._build_graph(cm, rows)
        b = cm.num_reqs
        if self.use_persistent_buffers and b <= rows <= self._max_graph_tokens and self._fits(cm):
            return self._build_graph(cm, rows, mark=False)
        seq = cm.seq_lens[:b]
        md = FlashAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens, slot_mapping=cm.slot_mapping,
            query_start_loc=cm.query_start_loc[: b + 1], seq_lens=seq, block_table=cm.block_table_tensor[:b],
            max_query_len=max(cm.max_query_len, 1), max_seq_len=max(cm.max_seq_len, 1), causal=cm.causal,
        )
        if self.iface is not None and self.iface.name == "fa2":
            md.cu_seqlens_k = torch.zeros(b + 1, dtype=torch.int32, device=seq.device)
            torch.cumsum(seq, 0, out=md.cu_seqlens_k[1:])
        return md

    def _persistent(self, cm: CommonAttentionMetadata) -> dict[str, torch.Tensor]:
        if self._buffers is None:
            n = self._max_graph_tokens
            cache = getattr(self._layer, "kv_cache", [None])[0]
            num_blocks = cache.shape[1] if cache is not None and cache.dim() == 5 else cm.block_table_tensor.shape[1]
            width = min(num_blocks, max(cm.block_table_tensor.shape[1], _MAX_GRAPH_TABLE_ENTRIES // n))
            z = functools.partial(torch.zeros, dtype=torch.int32, device=self.device)
            self._buffers = {"qsl": z(n + 1), "seq": z(n), "cu_k": z(n + 1), "table": z((n, width)),
                             "slots": torch.full((n,), -1, dtype=torch.int64, device=self.device)}
        return self._buffers

    def _pages_needed(self, cm: CommonAttentionMetadata) -> int:
        n = cm.num_reqs
        return -(-int(cm.seq_lens_cpu[:n].max()) // self.kv_cache_spec.block_size) if n else 0

    def _fits(self, cm: CommonAttentionMetadata) -> bool:
        return self._pages_needed(cm) <= self._persistent(cm)["table"].shape[1]

    def _build_graph(self, cm: CommonAttentionMetadata, rows: int, mark: bool = True) -> FlashAttentionMetadata:
        """Copy the batch into the persistent buffers as ``rows`` requests (the extra ones empty)."""
        if rows > self._max_graph_tokens:
            raise ValueError(
                f"FLASH_ATTN: a CUDA-graph step of {rows} tokens exceeds the largest capture size "
                f"{self._max_graph_tokens}; raise CompilationConfig.max_capture_size."
            )
        buf = self._persistent(cm)
        table = buf["table"]
        qsl_cpu = cm.query_start_loc_cpu
        n = min(cm.num_reqs, rows)
        if int(qsl_cpu[n]) != int(qsl_cpu[cm.num_reqs]):
            raise ValueError(
                f"FLASH_ATTN: {cm.num_reqs} requests with tokens beyond the first {rows} cannot run as a "
                f"CUDA-graph step of {rows} tokens; pad requests only with empty (query length 0) ones."
            )
        pages = self._pages_needed(cm)
        if pages > table.shape[1]:
            raise ValueError(
                f"FLASH_ATTN: a request needs {pages} blocks but the CUDA-graph page table holds "
                f"{table.shape[1]}; allocate the KV cache before capturing (its size bounds the table)."
            )
        w = min(cm.block_table_tensor.shape[1], table.shape[1])
        buf["qsl"][: n + 1].copy_(cm.query_start_loc[: n + 1], non_blocking=True)
        buf["qsl"][n + 1 : rows + 1].fill_(int(qsl_cpu[n]))
        buf["seq"][:n].copy_(cm.seq_lens[:n], non_blocking=True)
        buf["seq"][n:rows].zero_()
        table[:n, :w].copy_(cm.block_table_tensor[:n, :w], non_blocking=True)
        buf["slots"][:rows].copy_(cm.slot_mapping, non_blocking=True)
        cu_k = None
        if self.iface is not None and self.iface.name == "fa2":
            cu_k = buf["cu_k"][: rows + 1]
            torch.cumsum(buf["seq"][:rows], 0, out=cu_k[1:])
        if mark:
            self._graph_sizes.add(rows)
        return FlashAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens, slot_mapping=buf["slots"][:rows],
            query_start_loc=buf["qsl"][: rows + 1], seq_lens=buf["seq"][:rows], block_table=table[:rows],
            max_query_len=rows, max_seq_len=table.shape[1] * self.kv_cache_spec.block_size,
            causal=cm.causal, cu_seqlens_k=cu_k, use_cuda_graph=mark,
        )


class FlashAttentionImpl(AttentionImpl[FlashAttentionMetadata]):
    """Stores new K/V, then one varlen paged call for the whole (mixed) batch."""

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
        super().__init__(
            num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
            logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks,
        )
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(
                f"FLASH_ATTN serves decoder self-attention over the paged cache, got attn_type={attn_type!r}; "
                "use TORCH_SDPA for encoder attention."
            )
        self._fp8_dtype = fp8_dtype_for(kv_cache_dtype)
        self._iface: FlashAttnInterface | None = None
        self._dev_cache: dict[str, torch.Tensor] = {}
        if (alibi_slopes is not None or sinks is not None) and torch.cuda.is_available():
            self._interface()  # refuse ALiBi / sinks the installed interface lacks at construction

    def _interface(self) -> FlashAttnInterface:
        if self._iface is None:
            iface, why = get_flash_attn_interface()
            if iface is None:
                raise RuntimeError(f"FLASH_ATTN cannot run: {why}")
            if self.alibi_slopes is not None and iface.name != "fa2":
                raise NotImplementedError(f"ALiBi needs FA2; {iface.name} has none. Use TRITON_ATTN or TORCH_SDPA.")
            if self.sinks is not None and iface.name != "fa4":
                raise NotImplementedError(f"sinks need flash-attn-4; {iface.name} has none. Use TRITON_ATTN.")
            self._iface = iface
        return self._iface

    def _on_device(self, name: str, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``t`` as float32 on ``device``, converted once (not inside a captured graph)."""
        cached = self._dev_cache.get(name)
        if cached is None or cached.device != device:
            cached = self._dev_cache[name] = t.to(device=device, dtype=torch.float32)
        return cached

    def forward(
        self,
        layer: "Attention",
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: FlashAttentionMetadata | None,
        output: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query (T, H, D) (fp8 with an fp8 cache), key/value (T, Hk, D), kv_cache (2, N, bs, Hk, D) -> output."""
        if output is None:
            raise ValueError("FLASH_ATTN writes into a caller-allocated output (T, H, D); pass output=.")
        if output_scale is not None:
            raise NotImplementedError("FLASH_ATTN does not write quantized output; leave output_scale=None.")
        md = attn_metadata
        if md is None:
            return output
        iface = self._interface()
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        if self.kv_sharing_target_layer_name is None and key is not None and value is not None:
            store_kv(key, value, key_cache, value_cache, md.slot_mapping, self.kv_cache_dtype,
                     layer._k_scale, layer._v_scale)
        descale: dict[str, torch.Tensor] = {}
        if self._fp8_dtype is not None:
            key_cache, value_cache = key_cache.view(self._fp8_dtype), value_cache.view(self._fp8_dtype)
            shape = (md.query_start_loc.shape[0] - 1, self.num_kv_heads)
            descale = {f"{c}_descale": getattr(layer, f"_{c}_scale").expand(shape) for c in "qkv"}
        out = output[: query.shape[0]]
        window = self.sliding_window
        if iface.name == "fa4":
            kwargs: dict[str, Any] = dict(
                cu_seqlens_q=md.query_start_loc, seqused_k=md.seq_lens, page_table=md.block_table,
                max_seqlen_q=md.max_query_len, max_seqlen_k=md.max_seq_len, softmax_scale=self.scale,
                causal=md.causal, softcap=self.logits_soft_cap or 0.0, num_splits=1,
                learnable_sink=None if self.sinks is None else self._on_device("sinks", self.sinks, query.device),
                **descale,
            )
            if iface.has_out:
                iface.fn(query, key_cache, value_cache, out=out,
                         window_size_left=window[0] if window else None,
                         window_size_right=window[1] if window else None, **kwargs)
                return output
            for name in descale:  # the public varlen entry point has no descales (and no out=)
                del kwargs[name]
            res = iface.fn(query, key_cache, value_cache, window_size=window if window else (None, None), **kwargs)
        elif iface.name == "fa3":
            res = iface.fn(
                query, key_cache, value_cache, cache_seqlens=md.seq_lens, page_table=md.block_table,
                cu_seqlens_q=md.query_start_loc, max_seqlen_q=md.max_query_len, softmax_scale=self.scale,
                causal=md.causal, window_size=window if window else (-1, -1),
                softcap=self.logits_soft_cap or 0.0, **descale,
            )
        else:
            alibi = None if self.alibi_slopes is None else self._on_device("alibi", self.alibi_slopes, query.device)
            res = iface.fn(
                query, key_cache, value_cache, md.query_start_loc, md.cu_seqlens_k, md.max_query_len,
                md.max_seq_len, softmax_scale=self.scale, causal=md.causal,
                window_size=window if window else (-1, -1), softcap=self.logits_soft_cap or 0.0,
                alibi_slopes=alibi, block_table=md.block_table,
            )
        out.copy_(res[0] if isinstance(res, tuple) else res)
        return output

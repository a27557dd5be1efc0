"""TORCH_SDPA: the reference backend, plain PyTorch on CPU and CUDA.

One ``forward`` serves a mixed batch of decodes and (chunked) prefills with prior context.
The builder turns the batch into padded index tensors once per step (host work); the
forward then only runs device ops: store the new K/V, gather every request's K/V pages
into a padded ``(B, max_seq_len, Hk, D)`` tensor, and attend in float32 with a mask.

Features: GQA/MQA, causal with offset, sliding window, logits soft cap, ALiBi, sinks,
encoder / encoder-only (non-causal over the given K/V, no cache), encoder-decoder
(non-causal over encoder K/V cached once), fp8 KV caches (dequantized with the layer's
``_k_scale`` / ``_v_scale``). It is written for clarity, not speed: memory grows with
``B * max_query_len * max_seq_len``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

from vattn.backends.abstract import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadata,
    AttentionType,
)
from vattn.backends.utils import (
    check_kv_cache_shape_args,
    paged_kv_stride_order,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from vattn.config import CACHE_DTYPES
from vattn.ops.kv_store import store_kv

if TYPE_CHECKING:
    from vattn.layer import Attention

__all__ = ["TorchSDPABackend", "TorchSDPAImpl", "TorchSDPAMetadata", "TorchSDPAMetadataBuilder"]

_ENCODER_SELF = (AttentionType.ENCODER, AttentionType.ENCODER_ONLY)


class TorchSDPABackend(AttentionBackend):
    """Reference backend: any head size, fp16/bf16/fp32, every KV-cache dtype and feature, CPU and CUDA."""

    accept_output_buffer: ClassVar[bool] = True
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16, torch.float32)
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = CACHE_DTYPES
    supports_sink: ClassVar[bool] = True
    supports_sliding_window: ClassVar[bool] = True
    supports_logits_soft_cap: ClassVar[bool] = True
    supports_alibi: ClassVar[bool] = True
    supported_attn_types: ClassVar[tuple[str, ...]] = AttentionType.ALL
    runs_on_cpu: ClassVar[bool] = True
    min_compute_capability: ClassVar[tuple[int, int] | None] = None
    feature_notes: ClassVar[dict[str, str]] = {
        "sliding_window": "not on cross-attention",
        "alibi": "not on cross-attention",
        "fp8_kv": "e4m3 on CUDA: 8.9+",
    }

    @staticmethod
    def get_name() -> str:
        return "TORCH_SDPA"

    @staticmethod
    def get_impl_cls() -> type["TorchSDPAImpl"]:
        return TorchSDPAImpl

    @staticmethod
    def get_metadata_cls() -> type["TorchSDPAMetadata"]:
        return TorchSDPAMetadata

    @staticmethod
    def get_builder_cls() -> type["TorchSDPAMetadataBuilder"]:
        return TorchSDPAMetadataBuilder

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
        """Identity for the NHD layout, ``(0, 1, 3, 2, 4)`` for HND (``get_kv_cache_layout()``)."""
        return paged_kv_stride_order()


@dataclass
class TorchSDPAMetadata(AttentionMetadata):
    """One step's metadata. B = num_reqs, Lq = max_query_len, Lk = max_seq_len.

    | field | shape / type | meaning |
    | --- | --- | --- |
    | num_actual_tokens | int | real tokens (rows of output written) |
    | slot_mapping | (T,) int64 | where the new K/V rows go; < 0 skipped |
    | query_index | (B, Lq) int64 | token row of query i of request b (0 where padding) |
    | query_pos | (B, Lq) int64 | absolute position of that query (seq_len - query_len + i) |
    | key_valid | (B, Lk) bool | key position j < seq_len of request b |
    | key_block, key_offset | (B, Lk) int64, or None | cache block / offset of key j (0 where invalid); None when the block table cannot cover Lk (encoder-only batches) |
    | encoder_key_valid | (B, Lq) bool | for encoder self-attention: key j < query_len |
    | output_index | (num_actual_tokens,) int64 | row ``b * Lq + i`` of each token in the padded output |
    | causal | bool | the batch's causal flag |
    """

    num_actual_tokens: int
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    query_index: torch.Tensor
    query_pos: torch.Tensor
    key_valid: torch.Tensor
    key_block: torch.Tensor | None
    key_offset: torch.Tensor | None
    encoder_key_valid: torch.Tensor
    output_index: torch.Tensor
    causal: bool = True


class TorchSDPAMetadataBuilder(AttentionMetadataBuilder[TorchSDPAMetadata]):
    """Builds ``TorchSDPAMetadata``. No full CUDA graphs: the forward's shapes follow the batch."""

    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> TorchSDPAMetadata:
        cm = common_attn_metadata
        B, Lq, Lk = cm.num_reqs, cm.max_query_len, cm.max_seq_len
        dev = cm.query_start_loc.device
        qsl = cm.query_start_loc[: B + 1].long()
        seq_lens = cm.seq_lens[:B].long()
        qlens = qsl[1:] - qsl[:-1]

        i = torch.arange(Lq, device=dev)
        query_valid = i[None, :] < qlens[:, None]
        query_index = torch.where(query_valid, qsl[:-1, None] + i[None, :], 0)
        query_pos = (seq_lens - qlens)[:, None] + i[None, :]

        j = torch.arange(Lk, device=dev)
        key_valid = j[None, :] < seq_lens[:, None]
        block_size = self.kv_cache_spec.block_size
        bt = cm.block_table_tensor
        n_blocks = -(-Lk // block_size)
        key_block = key_offset = None
        if bt.shape[1] >= n_blocks:
            cols = (j // block_size).expand(B, Lk)
            key_block = torch.where(key_valid, bt[:B].long().gather(1, cols), 0)
            key_offset = torch.where(key_valid, j % block_size, 0)

        # Token t belongs to request r with qsl[r] <= t < qsl[r + 1]; its padded row is r * Lq + (t - qsl[r]).
        t = torch.arange(cm.num_actual_tokens, device=dev)
        r = torch.searchsorted(qsl[1:], t, right=True)
        output_index = r * Lq + (t - qsl[r])

        qlens_cpu = cm.query_lens_cpu[:B]
        thr = self.reorder_batch_threshold or 1
        is_decode = qlens_cpu <= thr
        num_decodes = int(is_decode.sum())
        num_decode_tokens = int(qlens_cpu[is_decode].sum())
        return TorchSDPAMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            num_reqs=B,
            max_query_len=Lq,
            max_seq_len=Lk,
            num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens,
            num_prefills=B - num_decodes,
            num_prefill_tokens=cm.num_actual_tokens - num_decode_tokens,
            slot_mapping=cm.slot_mapping,
            query_start_loc=cm.query_start_loc,
            seq_lens=cm.seq_lens,
            block_table=bt,
            query_index=query_index,
            query_pos=query_pos,
            key_valid=key_valid,
            key_block=key_block,
            key_offset=key_offset,
            encoder_key_valid=query_valid,
            output_index=output_index,
            causal=cm.causal,
        )


class TorchSDPAImpl(AttentionImpl[TorchSDPAMetadata]):
    """Stores new K/V, gathers each request's K/V into a padded batch, attends in float32."""

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
            raise ValueError(
                f"TORCH_SDPA num_kv_heads: expected a divisor of num_heads = {num_heads}, got "
                f"{self.num_kv_heads}; choose num_kv_heads among the divisors of num_heads."
            )
        if attn_type not in AttentionType.ALL:
            raise ValueError(
                f"TORCH_SDPA attn_type: expected one of {AttentionType.ALL}, got {attn_type!r}; "
                "use a vattn.AttentionType constant."
            )
        if kv_cache_dtype not in CACHE_DTYPES:
            raise ValueError(
                f"TORCH_SDPA kv_cache_dtype: expected one of {CACHE_DTYPES}, got {kv_cache_dtype!r}; "
                "set CacheConfig.cache_dtype to one of them."
            )
        if self.alibi_slopes is not None and self.alibi_slopes.shape != (num_heads,):
            raise ValueError(
                f"TORCH_SDPA alibi_slopes: expected num_heads = {num_heads} slopes, got "
                f"{tuple(self.alibi_slopes.shape)}; give one slope per query head."
            )
        self.window = sliding_window
        self._alibi_cache: dict[torch.device, torch.Tensor] = {}

    def _alibi(self, device: torch.device) -> torch.Tensor:
        # Copied to the device once (first forward), not on every step.
        if device not in self._alibi_cache:
            assert self.alibi_slopes is not None
            self._alibi_cache[device] = self.alibi_slopes.to(device)
        return self._alibi_cache[device]

    def forward(
        self,
        layer: "Attention",
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: TorchSDPAMetadata | None,
        output: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """See ``AttentionImpl.forward``. Device ops only: no host syncs."""
        if output is None:
            raise ValueError("TorchSDPAImpl.forward: output must be a (T, H, D) buffer (accept_output_buffer).")
        if output_scale is not None:
            raise NotImplementedError(
                "TORCH_SDPA does not write quantized output; pass output_scale=None "
                "(or disable the attention+quant fusion pass)."
            )
        if attn_metadata is None:
            return output
        if query.dim() != 3 or query.shape[1:] != (self.num_heads, self.head_size):
            raise ValueError(
                f"query must be (T, num_heads={self.num_heads}, head_size={self.head_size}), "
                f"got {tuple(query.shape)}."
            )
        md = attn_metadata
        n = md.num_actual_tokens

        if self.attn_type in _ENCODER_SELF:
            if key is None or value is None:
                raise ValueError(f"attn_type {self.attn_type!r} needs key and value (no KV cache is used).")
            k = key[md.query_index].float()  # (B, Lq, Hk, D): keys are the request's own tokens
            v = value[md.query_index].float()
            key_valid = md.encoder_key_valid
        else:
            key_cache, value_cache = kv_cache.unbind(0)
            if self.kv_sharing_target_layer_name is None and key is not None and value is not None:
                store_kv(key, value, key_cache, value_cache, md.slot_mapping,
                         self.kv_cache_dtype, layer._k_scale, layer._v_scale)
            if md.key_block is None or md.key_offset is None:
                raise ValueError(
                    "block_table_tensor has too few columns for max_seq_len "
                    f"({md.max_seq_len}); give each request ceil(seq_len / block_size) block ids."
                )
            k = self._read_cache(key_cache, md, layer._k_scale)
            v = self._read_cache(value_cache, md, layer._v_scale)
            key_valid = md.key_valid

        q = query[md.query_index].float()  # (B, Lq, H, D)
        out = self._attend(q, k, v, md.query_pos, key_valid, md.causal)  # (B, Lq, H, D)
        B, Lq = md.query_index.shape
        output[:n] = out.reshape(B * Lq, self.num_heads, self.head_size)[md.output_index].to(output.dtype)
        return output

    def _read_cache(self, cache: torch.Tensor, md: TorchSDPAMetadata, scale: torch.Tensor) -> torch.Tensor:
        """(B, Lk, Hk, D) float32 of each request's keys (or values); invalid positions zero."""
        x = cache[md.key_block, md.key_offset].float()
        if cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            x = x * scale.float()
        # Invalid positions read slot 0, which may hold anything (even NaN): zero them.
        return torch.where(md.key_valid[:, :, None, None], x, 0.0)

    def _mask(self, q_pos: torch.Tensor, key_valid: torch.Tensor, causal: bool) -> torch.Tensor:
        """(B, Lq, Lk) bool, True = attend. Rows with nothing to attend to are opened fully
        (they are padding and discarded), so softmax never sees an all -inf row."""
        Lk = key_valid.shape[1]
        k_pos = torch.arange(Lk, device=q_pos.device)
        allowed = key_valid[:, None, :]
        self_attn = self.attn_type != AttentionType.ENCODER_DECODER
        if causal and self_attn:
            allowed = allowed & (k_pos[None, None, :] <= q_pos[:, :, None])
        if self.window is not None and self_attn:
            allowed = allowed & (k_pos[None, None, :] > q_pos[:, :, None] - self.window)
        allowed = allowed.expand(q_pos.shape[0], q_pos.shape[1], Lk)
        return allowed | ~allowed.any(-1, keepdim=True)

    def _expand_kv_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, Lk, Hk, D) -> (B, H, Lk, D); query head h reads KV head h // (H // Hk).

        ``expand`` + ``reshape`` rather than ``repeat_interleave``, which may sync on some versions.
        """
        B, Lk, Hk, D = x.shape
        x = x.transpose(1, 2)[:, :, None].expand(B, Hk, self.num_queries_per_kv, Lk, D)
        return x.reshape(B, self.num_heads, Lk, D)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_pos: torch.Tensor,
        key_valid: torch.Tensor,
        causal: bool,
    ) -> torch.Tensor:
        """q (B, Lq, H, D), k/v (B, Lk, Hk, D) float32 -> (B, Lq, H, D) float32."""
        causal = causal and self.attn_type == AttentionType.DECODER
        if self.attn_type in _ENCODER_SELF:
            q_pos = torch.arange(q.shape[1], device=q.device).expand(q.shape[0], -1)
        q = q.transpose(1, 2)  # (B, H, Lq, D)
        k, v = self._expand_kv_heads(k), self._expand_kv_heads(v)  # (B, H, Lk, D)
        allowed = self._mask(q_pos, key_valid, causal)[:, None]  # (B, 1, Lq, Lk)
        bias = None
        if self.alibi_slopes is not None and self.attn_type != AttentionType.ENCODER_DECODER:
            k_pos = torch.arange(k.shape[2], device=q.device)
            rel = (k_pos[None, None, :] - q_pos[:, :, None]).float()  # (B, Lq, Lk)
            bias = self._alibi(q.device)[None, :, None, None] * rel[:, None]

        if self.logits_soft_cap is None and self.sinks is None:
            mask = allowed if bias is None else bias.masked_fill(~allowed, float("-inf"))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
            return out.transpose(1, 2)

        s = torch.matmul(q, k.transpose(-1, -2)) * self.scale  # (B, H, Lq, Lk)
        if self.logits_soft_cap is not None:
            s = self.logits_soft_cap * torch.tanh(s / self.logits_soft_cap)
        if bias is not None:
            s = s + bias
        s = s.masked_fill(~allowed, float("-inf"))
        if self.sinks is not None:
            sink = self.sinks.to(device=q.device, dtype=torch.float32)
            sink = sink[None, :, None, None].expand(s.shape[0], -1, s.shape[2], 1)
            p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
        else:
            p = torch.softmax(s, dim=-1)
        return torch.matmul(p, v).transpose(1, 2)

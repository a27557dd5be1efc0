"""``TorchSDPAImpl``: store the new K/V, gather the requests' K/V, attend in float32."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from vattn.core.enums import AttentionType
from vattn.core.interface import AttentionImpl
from vattn.backends.torch_sdpa.metadata import TorchSDPAMetadata
from vattn.ops.kv_store import layer_scales, store_kv, store_rows

if TYPE_CHECKING:
    from vattn.core.interface import AttentionLayerBase as Attention

__all__ = ["TorchSDPAImpl"]

_ENCODER_SELF = (AttentionType.ENCODER, AttentionType.ENCODER_ONLY)


class TorchSDPAImpl(AttentionImpl[TorchSDPAMetadata]):
    """Stores new K/V, gathers each request's K/V into a padded batch, attends in float32."""

    backend_name = "TORCH_SDPA"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """``AttentionImpl``'s arguments (every attention type and cache dtype)."""
        super().__init__(*args, **kwargs)
        self.window = None if self.sliding_window is None else self.sliding_window[0] + 1
        self._alibi_cache: dict[torch.device, torch.Tensor] = {}
        # Decode-only batches of plain causal attention go through ``_decode`` (SDPA's own GQA,
        # whole blocks gathered, no padded query batch).
        self._plain_decode = (self.attn_type == AttentionType.DECODER and self.alibi_slopes is None
                              and self.logits_soft_cap is None and self.sinks is None)

    def _alibi(self, device: torch.device) -> torch.Tensor:
        # Copied to the device once (first forward), not on every step.
        if device not in self._alibi_cache:
            assert self.alibi_slopes is not None
            self._alibi_cache[device] = self.alibi_slopes.to(device)
        return self._alibi_cache[device]

    def forward(self, layer: "Attention", query: torch.Tensor, key: torch.Tensor | None,
                value: torch.Tensor | None, kv_cache: torch.Tensor, attn_metadata: TorchSDPAMetadata | None,
                output: torch.Tensor | None = None, output_scale: torch.Tensor | None = None) -> torch.Tensor:
        """See ``AttentionImpl.forward``. Device ops only: no host syncs."""
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
            md = md.padded()
            k = key[md.query_index].float()  # (B, Lq, Hk, D): keys are the request's own tokens
            v = value[md.query_index].float()
            key_valid = md.encoder_key_valid
        else:
            key_cache, value_cache = kv_cache.unbind(0)
            k_scale, v_scale, _ = layer_scales(layer)
            if self.kv_sharing_target_layer_name is None and key is not None and value is not None:
                if (md.store_slots is not None and key.shape[0] == md.slot_mapping.shape[0]
                        and key_cache.device == md.store_slots.device):
                    store_rows(key, value, key_cache, value_cache, md.store_slots, md.store_rows, k_scale, v_scale)
                else:
                    store_kv(key, value, key_cache, value_cache, md.slot_mapping, self.kv_cache_dtype, k_scale, v_scale)
            if not md.table_covers:
                raise ValueError(
                    "block_table_tensor has too few columns for max_seq_len "
                    f"({md.max_seq_len}); give each request ceil(seq_len / block_size) block ids."
                )
            if md.decode_blocks is not None and self._plain_decode:
                return self._decode(query, kv_cache, md, layer, output)
            md = md.padded()
            k = self._read_cache(key_cache, md, k_scale)
            v = self._read_cache(value_cache, md, v_scale)
            key_valid = md.key_valid

        q = query[md.query_index].float()  # (B, Lq, H, D)
        out = self._attend(q, k, v, md.query_pos, key_valid, md.causal)  # (B, Lq, H, D)
        B, Lq = md.query_index.shape
        output[:n] = out.reshape(B * Lq, self.num_heads, self.head_size)[md.output_index].to(output.dtype)
        return output

    def _decode(self, query: torch.Tensor, kv_cache: torch.Tensor, md: TorchSDPAMetadata, layer: "Attention",
                output: torch.Tensor) -> torch.Tensor:
        """A decode-only batch: query (B, H, D), one token per request at position seq_len - 1.

        Each request's blocks are gathered whole, (B, Hk, Lb, D) with Lb = blocks * block_size;
        keys past seq_len are masked (and zeroed: stale slots may hold anything). One request
        without a window reads exactly its seq_len keys: no mask at all."""
        assert md.decode_blocks is not None and md.decode_key_valid is not None
        first = md.decode_first_block
        s_kv, s_block, s_tok, s_head, s_dim = kv_cache.stride()
        if (first is not None and self.window is None and kv_cache.element_size() > 1
                and s_block == kv_cache.shape[2] * s_tok):
            # One request on consecutive blocks of an NHD cache: its tokens are one strided run,
            # so its keys and values are a view (float32: no copy), (1, Hk, seq_len, D) each.
            kv = kv_cache.as_strided((2, 1, self.num_kv_heads, md.max_seq_len, self.head_size),
                                     (s_kv, 0, s_head, s_tok, s_dim), kv_cache.storage_offset() + first * s_block)
            k, v = (kv if kv.dtype == torch.float32 else kv.float()).unbind(0)
            q = query[:1].reshape(1, self.num_kv_heads, self.num_queries_per_kv, self.head_size).float()
            out = F.scaled_dot_product_attention(q, k, v, scale=self.scale)  # (1, Hk, G, D): 4-D (CPU flash kernel)
            output[0] = out.view(self.num_heads, self.head_size)
            return output
        B = md.decode_blocks.shape[0]
        k, v = self._read_blocks(kv_cache, md.decode_blocks, layer)
        # One query token per request: the G = H / Hk query heads of a KV head become G query rows
        # of that head (query head h reads KV head h // G), so SDPA needs no GQA expansion.
        q = query[:B].float().reshape(B, self.num_kv_heads, self.num_queries_per_kv, self.head_size)
        mask = None
        if B == 1 and self.window is None:
            k, v = k[:, :, : md.max_seq_len], v[:, :, : md.max_seq_len]
        else:
            valid = md.decode_key_valid  # (B, 1, 1, Lb)
            k, v = torch.where(valid.transpose(-1, -2), k, 0.0), torch.where(valid.transpose(-1, -2), v, 0.0)
            mask = valid
            if self.window is not None:
                pos = torch.arange(valid.shape[-1], device=q.device)
                last = md.seq_lens[:B].long()[:, None, None, None] - 1
                mask = mask & (pos > last - self.window)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)  # (B, Hk, G, D)
        output[:B] = out.reshape(B, self.num_heads, self.head_size).to(output.dtype)
        return output

    def _read_blocks(self, kv_cache: torch.Tensor, blocks: torch.Tensor,
                     layer: "Attention") -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values, (B, Hk, Lb, D) float32 each: every request's whole blocks
        (``blocks`` (B, nb)) of the (2, num_blocks, block_size, Hk, D) cache, in one copy."""
        B, nb = blocks.shape
        kv = kv_cache.index_select(1, blocks.reshape(-1))  # (2, B * nb, block_size, Hk, D): one gather
        kv = kv.view(2, B, nb * kv.shape[2], kv.shape[3], kv.shape[4]).transpose(2, 3).float()
        k, v = kv.unbind(0)
        if kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            k, v = k * layer._k_scale.float(), v * layer._v_scale.float()
        return k, v

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

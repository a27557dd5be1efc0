"""``MLACommonImpl``: what every MLA backend's impl does around its kernels.

Per step and layer (T tokens, H heads, L = kv_lora_rank, P = qk_rope_head_dim, N =
qk_nope_head_dim, V = v_head_dim; ``W = kv_b_proj.weight`` viewed as (H, N + V, L)):

1. store: the new tokens' latent rows ``cat(kv_c_normed, k_pe)`` go into the cache at
   ``slot_mapping`` (``vattn.ops.mla.store_latent``);
2. decodes (absorbed): ``q_nope`` becomes ``q_nope @ W_UK`` (H, L) per head (``W_UK =
   W[:, :N]``), the backend attends it and ``q_pe`` to the latent cache as multi-query
   attention (keys ``L + P`` wide, values the first ``L``), and the (H, L) result is mapped
   back with ``W_UV = W[:, N:]`` to (H, V);
3. prefills (up-projected): the new tokens' ``kv_c_normed`` becomes per-head keys (N, then
   the shared ``k_pe``) and values (V) through ``kv_b_proj``; the backend attends the new
   tokens causally, then every context chunk's latent rows are read from the cache,
   up-projected the same way and attended (no mask); the results merge by log-sum-exp.

A backend implements ``_forward_decode`` and ``_prefill_attend``. The absorbed weights are
views of ``kv_b_proj.weight`` taken at every step, so loading new weights needs no hook.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from vattn.core.enums import AttentionType
from vattn.core.interface import AttentionImpl
from vattn.backends.mla.common import MLACommonMetadata, MLADecodeMetadata, MLAPrefillMetadata, merge_attn_states
from vattn.ops.mla import store_latent

if TYPE_CHECKING:
    from torch import nn

__all__ = ["MLACommonImpl"]

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


class MLACommonImpl(AttentionImpl[MLACommonMetadata]):
    """The MLA forward (store, absorbed decode, chunked up-projected prefill) around a
    backend's two kernels. Constructed by ``vattn.MLAAttention`` (vLLM's ``MLACommonImpl``
    arguments: ``head_size`` is ``L + P``, ``num_kv_heads`` 1)."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None, *,
                 q_lora_rank: int | None, kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 qk_head_dim: int, v_head_dim: int, kv_b_proj: "nn.Module", indexer: Any = None) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                         logits_soft_cap, attn_type, kv_sharing_target_layer_name)
        name = type(self).__name__
        unsupported = {"alibi_slopes": alibi_slopes, "sliding_window": sliding_window,
                       "logits_soft_cap": logits_soft_cap or None, "kv_sharing_target_layer_name":
                       kv_sharing_target_layer_name, "indexer": indexer}
        for arg, value in unsupported.items():
            if value is not None:
                raise NotImplementedError(f"{name}: {arg}: MLA backends take None, got {value!r}; drop it (MLA "
                                          "layers attend the whole causal context, without KV sharing).")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"{name}: attn_type: expected {AttentionType.DECODER!r} (MLA is decoder "
                                      f"self-attention), got {attn_type!r}.")
        if self.num_kv_heads != 1 or head_size != kv_lora_rank + qk_rope_head_dim:
            raise ValueError(f"{name}: expected num_kv_heads 1 and head_size kv_lora_rank + qk_rope_head_dim = "
                             f"{kv_lora_rank + qk_rope_head_dim} (the latent row), got {self.num_kv_heads} and "
                             f"{head_size}.")
        if qk_head_dim != qk_nope_head_dim + qk_rope_head_dim:
            raise ValueError(f"{name}: qk_head_dim: expected qk_nope_head_dim + qk_rope_head_dim = "
                             f"{qk_nope_head_dim + qk_rope_head_dim}, got {qk_head_dim}.")
        weight = getattr(kv_b_proj, "weight", None)
        want = (num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank)
        if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != want:
            got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
            raise ValueError(f"{name}: kv_b_proj.weight: expected a (num_heads * (qk_nope_head_dim + v_head_dim), "
                             f"kv_lora_rank) = {want} tensor, got {got}; pass the layer's kv_b_proj "
                             "(an nn.Linear kv_lora_rank -> heads * (nope + v), without bias).")
        if getattr(kv_b_proj, "bias", None) is not None:
            raise ValueError(f"{name}: kv_b_proj: expected no bias (it is absorbed into the query and output), "
                             "got one; build it with bias=False.")
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.qk_head_dim = qk_head_dim
        self.v_head_dim = v_head_dim
        self.kv_b_proj = kv_b_proj

    # ---- weights ------------------------------------------------------------------------

    def _w(self) -> torch.Tensor:
        """``kv_b_proj.weight`` as (H, N + V, L) (a view)."""
        return self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)

    def up_project(self, kv_c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(S, L) latents -> per-head keys (S, H, N) and values (S, H, V)."""
        kv = F.linear(kv_c.to(self.kv_b_proj.weight.dtype), self.kv_b_proj.weight)
        kv = kv.view(kv_c.shape[0], self.num_heads, self.qk_nope_head_dim + self.v_head_dim)
        return kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)

    # ---- forward ------------------------------------------------------------------------

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
                kv_cache: torch.Tensor, attn_metadata: MLACommonMetadata | None, output: torch.Tensor | None = None,
                output_scale: torch.Tensor | None = None) -> torch.Tensor:
        """MLA of one layer. Shapes (T tokens):

        | tensor | shape |
        | --- | --- |
        | query | (T, H, N + P) |
        | key | (T, L): ``kv_c_normed`` |
        | value | (T, P): ``k_pe`` |
        | kv_cache | (num_blocks, block_size, L + P) |
        | output | (T, H, V), rows past ``num_actual_tokens`` left unspecified |

        Device work only (no host sync): pure-decode steps replay in CUDA graphs.
        """
        name = type(self).__name__
        if output is None:
            raise ValueError(f"{name}.forward: output must be a (T, H, v_head_dim) buffer (accept_output_buffer).")
        if output_scale is not None:
            raise NotImplementedError(f"{name} does not write quantized output; pass output_scale=None.")
        if attn_metadata is None:
            return output
        if key is None or value is None:
            raise ValueError(f"{name}.forward: kv_c_normed and k_pe are required (MLA stores every new token).")
        md = attn_metadata
        store_latent(key, value, kv_cache, md.slot_mapping, layer._k_scale)
        if md.decode is not None:
            rows = md.decode.num_decode_tokens
            self._decode(layer, query[:rows], kv_cache, md.decode, output[:rows])
        if md.prefill is not None:
            p = md.prefill
            rows = slice(p.start, p.start + p.num_tokens)
            out = self._prefill(layer, query[rows], key[rows], value[rows], kv_cache, p)
            output[rows] = out.to(output.dtype)
        return output

    def _decode(self, layer: Any, q: torch.Tensor, kv_cache: torch.Tensor, md: MLADecodeMetadata,
                output: torch.Tensor) -> None:
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        w = self._w()
        w_uk, w_uv = w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]
        ql_nope = torch.bmm(q_nope.transpose(0, 1), w_uk.to(q.dtype)).transpose(0, 1)  # (R, H, L)
        latent = self._forward_decode(ql_nope, q_pe, kv_cache, md, layer)  # (R, H, L)
        lat_t, w_uv_t = latent.transpose(0, 1), w_uv.to(latent.dtype).transpose(1, 2)  # (H, R, L), (H, L, V)
        tracked = torch.is_grad_enabled() and (lat_t.requires_grad or w_uv_t.requires_grad)  # out= has no autograd
        if output.dtype == latent.dtype and not tracked:  # the batched GEMM writes the (R, H, V) rows in place
            torch.bmm(lat_t, w_uv_t, out=output.transpose(0, 1))
        else:
            output.copy_(torch.bmm(lat_t, w_uv_t).transpose(0, 1))

    def _prefill(self, layer: Any, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                 md: MLAPrefillMetadata) -> torch.Tensor:
        """(Tp, H, V) float32: the new tokens causally, then each context chunk, merged."""
        k_nope, v = self.up_project(kv_c)
        out, lse = self._prefill_attend(q, k_nope, k_pe.to(q.dtype), v, md.query_start_loc, md.query_start_loc,
                                        md.max_query_len, md.max_query_len, True, md.plan)
        lora = self.kv_lora_rank
        bs = kv_cache.shape[1]
        for chunk in md.chunks:
            latent = kv_cache[chunk.slots // bs, chunk.slots % bs]  # (C, L + P)
            if latent.dtype in _FP8:
                latent = latent.float() * layer._k_scale.float()
            latent = latent.to(q.dtype)
            c_nope, c_v = self.up_project(latent[:, :lora])
            o2, lse2 = self._prefill_attend(q, c_nope, latent[:, lora:], c_v, md.query_start_loc, chunk.cu_seqlens,
                                            md.max_query_len, chunk.max_seqlen, False, chunk.plan)
            out, lse = merge_attn_states(out, lse, o2, lse2)
        return out

    # ---- the backend's kernels ----------------------------------------------------------

    def _forward_decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                        md: MLADecodeMetadata, layer: Any) -> torch.Tensor:
        """Multi-query attention of the absorbed queries over the latent cache: ``q_nope`` (R, H, L)
        and ``q_pe`` (R, H, P) against keys ``cache[..., :L + P]``, values ``cache[..., :L]``, with
        ``self.scale``; returns (R, H, L) in the query dtype."""
        raise NotImplementedError

    def _prefill_attend(self, q: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor,
                        cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                        max_seqlen_k: int, causal: bool, plan: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Ragged attention of ``q`` (T, H, N + P) over keys ``cat(k_nope (S, H, N), k_pe (S, P)
        broadcast)`` and values ``v`` (S, H, V), with ``self.scale``; ``causal`` bottom-right
        aligned. Returns (out (T, H, V), lse (T, H) float32; -inf or +inf where a row has no key)."""
        raise NotImplementedError

"""``FlexAttentionImpl``: store the new K/V, then one compiled FlexAttention launch per ``FlexCall``.

The layer's features become mods: the sliding window joins the mask (``MaskSpec``), the soft cap
and ALiBi are score mods applied before the user's ``score_mod``, and sinks rescale each row by
``sigmoid(lse - sink)`` (FlexAttention's log-sum-exp), which is what an extra key of logit
``sink`` and value zero does to the softmax.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from vattn.core.enums import AttentionType
from vattn.core.interface import AttentionImpl
from vattn.backends.flex_attention.compiled import default_kernel_options, run_flex
from vattn.backends.flex_attention.metadata import FlexAttentionMetadata
from vattn.backends.flex_attention.mods import MaskMod, ScoreMod, alibi, soft_cap
from vattn.backends.flex_attention.paging import CAUSAL, FULL, FlexCall, MaskSpec, logical_score, physical_score
from vattn.ops.kv_store import store_kv

if TYPE_CHECKING:
    from vattn.core.interface import AttentionLayerBase as Attention

__all__ = ["FlexAttentionImpl", "SUPPORTED_KV_CACHE_DTYPES"]

#: Cache dtypes FlexAttention reads (no fp8: query, key and value share one dtype).
SUPPORTED_KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32")


def _refuse(name: str, argument: str, expected: str, got: Any, fix: str) -> NotImplementedError:
    return NotImplementedError(f"{name} {argument}: expected {expected}, got {got!r}; {fix}")


class FlexAttentionImpl(AttentionImpl[FlexAttentionMetadata]):
    """FlexAttention over the paged cache, with the layer's ``mask_mod`` / ``score_mod``.

    Extra keyword arguments (``vattn.Attention(..., **extra_impl_args)``):

    | argument | meaning |
    | --- | --- |
    | ``mask_mod``, ``score_mod`` | FlexAttention mods over logical positions (``vattn.backends.flex_attention.mods``) |
    | ``mask_per_head`` | the mask_mod depends on ``h``: block masks are built per query head |
    | ``kernel_options`` | FlexAttention kernel options (override vattn's defaults) |
    | ``compiled`` | False: eager FlexAttention (the slow reference; materializes every score) |
    """

    #: The structural mask (TREE_ATTN's impl sets its own).
    base_mask: str = CAUSAL
    backend_name: str = "FLEX_ATTENTION"

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None,
                 sinks: Tensor | None = None, *, mask_mod: MaskMod | None = None, score_mod: ScoreMod | None = None,
                 mask_per_head: bool = False, kernel_options: dict[str, Any] | None = None,
                 compiled: bool = True) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                         kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks)
        name = self.backend_name
        if attn_type != AttentionType.DECODER:
            raise _refuse(name, "attn_type", f"{AttentionType.DECODER!r}", attn_type,
                          "use TORCH_SDPA for encoder and cross-attention.")
        if kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
            raise _refuse(name, "kv_cache_dtype", f"one of {SUPPORTED_KV_CACHE_DTYPES}", kv_cache_dtype,
                          "use TRITON_ATTN or TORCH_SDPA for fp8 caches.")
        for arg, fn, n in (("mask_mod", mask_mod, 4), ("score_mod", score_mod, 5)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} {arg}: expected a function of {n} tensors (FlexAttention's "
                                f"signature), got {fn!r}.")
        if kernel_options is not None and not isinstance(kernel_options, dict):
            raise TypeError(f"{name} kernel_options: expected a dict of FlexAttention kernel options, got "
                            f"{kernel_options!r}.")
        slopes = self.alibi_slopes
        self.mask_mod, self.score_mod = mask_mod, score_mod
        # A user mask replaces causality (TREE_ATTN's tree stays: the user mask narrows it).
        base = FULL if mask_mod is not None and self.base_mask == CAUSAL else self.base_mask
        self.mask_spec = MaskSpec(base, mask_mod, sliding_window, num_heads if mask_per_head else 1)
        self.kernel_options = kernel_options
        self.compiled = bool(compiled)
        # What the score mods are, by value: layers with equal features share compiled kernels.
        self._score_key = (self.logits_soft_cap, None if slopes is None else num_heads, score_mod)
        self._device_state: dict[torch.device, tuple[tuple[ScoreMod, ...], Tensor | None]] = {}

    def _score_mods(self, device: torch.device) -> tuple[tuple[ScoreMod, ...], Tensor | None]:
        """(score mods in order: soft cap, ALiBi, the user's; sinks as float32), on ``device``
        (copied there once, on the first forward)."""
        state = self._device_state.get(device)
        if state is None:
            mods: list[ScoreMod] = []
            if self.logits_soft_cap is not None:
                mods.append(soft_cap(self.logits_soft_cap))
            if self.alibi_slopes is not None:
                mods.append(alibi(self.alibi_slopes.to(device=device, dtype=torch.float32)))
            if self.score_mod is not None:
                mods.append(self.score_mod)
            sinks = None if self.sinks is None else self.sinks.to(device=device, dtype=torch.float32)
            state = self._device_state[device] = (tuple(mods), sinks)
        return state

    def forward(self, layer: "Attention", query: Tensor, key: Tensor | None, value: Tensor | None,
                kv_cache: Tensor, attn_metadata: FlexAttentionMetadata | None, output: Tensor | None = None,
                output_scale: Tensor | None = None) -> Tensor:
        """See ``AttentionImpl.forward``. Device work only (no host syncs)."""
        name = self.backend_name
        if attn_metadata is None:
            return output
        if query.dim() != 3 or query.shape[1:] != (self.num_heads, self.head_size):
            raise ValueError(f"query must be (T, num_heads={self.num_heads}, head_size={self.head_size}), "
                             f"got {tuple(query.shape)}.")
        md = attn_metadata
        key_cache, value_cache = kv_cache.unbind(0)
        if md.num_cache_blocks > key_cache.shape[0]:
            raise ValueError(f"{name}: the metadata reads {md.num_cache_blocks} cache blocks, the layer's cache "
                             f"has {key_cache.shape[0]}; build the metadata for this cache (kv.build_metadata).")
        if self.kv_sharing_target_layer_name is None and key is not None and value is not None:
            store_kv(key, value, key_cache, value_cache, md.slot_mapping, self.kv_cache_dtype,
                     layer._k_scale, layer._v_scale)
        nb = md.num_cache_blocks
        k, v = _as_sequence(key_cache, nb), _as_sequence(value_cache, nb)
        score_mods, sinks = self._score_mods(query.device)
        query = query.to(k.dtype)  # a float32 cache under a 16-bit model: attend in float32
        for call in md.calls:
            options = {**default_kernel_options(query.device, call.kv_block, gathered=call.gathered,
                                                dtype=query.dtype, lse=sinks is not None),
                       **(self.kernel_options or {})}
            if call.gathered:  # (Bq, Hk, Skv, D): the launch's keys in logical order
                assert call.kv_slots is not None
                hk = key_cache.shape[2]
                kc = key_cache[:nb].reshape(-1, hk, self.head_size)[call.kv_slots].transpose(1, 2)
                vc = value_cache[:nb].reshape(-1, hk, self.head_size)[call.kv_slots].transpose(1, 2)
                self._launch(query, kc, vc, md, call, score_mods, sinks, options or None, output)
            else:
                self._launch(query, k, v, md, call, score_mods, sinks, options or None, output)
        return output

    def _launch(self, query: Tensor, k: Tensor, v: Tensor, md: FlexAttentionMetadata, call: FlexCall,
                score_mods: tuple[ScoreMod, ...], sinks: Tensor | None, options: dict[str, Any] | None,
                output: Tensor) -> None:
        """One FlexAttention launch: gather its queries, attend, write its tokens' rows."""
        rows, lq = call.batch, call.query_len
        h, d = self.num_heads, self.head_size
        n, first = call.num_tokens, call.first_token
        if call.query_index is None:  # a decode launch: row b is token first_token + b
            q = query[first : first + call.num_reqs]
            if rows > q.shape[0]:
                q = torch.cat([q, q.new_zeros((rows - q.shape[0], h, d))])
            q = q.contiguous().unsqueeze(1)  # (Bq, 1, H, D)
        elif call.dense:  # the tokens are the (Bq, Lq) grid: a view
            q = query[first : first + n].view(rows, lq, h, d)
        else:
            q = query[call.query_index]  # (Bq, Lq, H, D)
        block_mask = md.block_mask(call, self.mask_spec)
        mods_key = (self.mask_spec.for_batch(md.causal), self._score_key, call.shape_key())
        score_mod = logical_score(call, score_mods) if call.gathered else physical_score(call, score_mods)
        out, lse = run_flex(q.transpose(1, 2), k, v, score_mod=score_mod, block_mask=block_mask, scale=self.scale,
                            kernel_options=options, return_lse=sinks is not None, compiled=self.compiled,
                            mods_key=mods_key)
        if sinks is not None:  # an extra key of logit `sink` and value 0 in every row's softmax
            assert lse is not None
            out = out * torch.sigmoid(lse - sinks[None, :, None]).unsqueeze(-1).to(out.dtype)
        out = out.transpose(1, 2)  # (Bq, Lq, H, D)
        if call.output_index is None:
            output[first : first + n] = out[:n, 0]
        elif call.dense:
            output[first : first + n] = out.reshape(n, h, d)
        else:
            output[first : first + n] = out.reshape(rows * lq, h, d)[call.output_index]


def _as_sequence(cache: Tensor, num_blocks: int) -> Tensor:
    """(num_blocks, block_size, Hk, D) -> (1, Hk, num_blocks * block_size, D): a view of an NHD
    cache (FLEX_ATTENTION allocates NHD); a copy of any other layout (correct, slow)."""
    c = cache[:num_blocks]
    hk, d = c.shape[2], c.shape[3]
    return c.reshape(-1, hk, d).permute(1, 0, 2).unsqueeze(0)

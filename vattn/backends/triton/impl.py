"""TRITON_ATTN's impl: store the step's new K/V, then one launch of the paged-attention kernel.

Decode configs store the new K/V inside the attention kernel (``VATTN_TRITON_FUSED_KV_STORE=0``
turns that off). Given rotary rows (``rope``), the kernels rotate q and the new keys as they
load them: the attention kernel q (and the keys it stores), the KV-store kernel the keys. On
CUDA the first layer of a step records its launches and the step's other layers repeat them
(``vattn.kernels.launch.LaunchPlan``).
"""

from __future__ import annotations

import dataclasses
import operator
import sys
from typing import TYPE_CHECKING, Any

import torch

from vattn import envs
from vattn.core.enums import AttentionType
from vattn.core.interface import AttentionImpl
from vattn.backends.triton.config import head_pad
from vattn.backends.triton.metadata import TritonAttentionMetadata
from vattn.ops.kv_store import layer_scales, store_kv

if TYPE_CHECKING:
    from vattn.core.interface import AttentionLayerBase as Attention

__all__ = ["SUPPORTED_ATTN_TYPES", "TritonAttentionImpl"]

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_NO_PLAN: Any = object()  # no plan recorded yet for a signature
#: The attention types the impl serves (``TritonAttentionBackend.supported_attn_types``).
SUPPORTED_ATTN_TYPES = (AttentionType.DECODER, AttentionType.ENCODER_DECODER)


def _launcher() -> Any:
    """The kernel launcher ``paged_attention`` (imported on first use: importing it imports
    Triton), looked up in ``sys.modules`` on every call: tests reload it for the Triton
    interpreter."""
    try:
        return sys.modules["vattn.backends.triton.paged_attention"].paged_attention
    except KeyError:
        from vattn.backends.triton.paged_attention import paged_attention

        return paged_attention


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
    (``vattn.kernels.launch.LaunchPlan``), skipping validation and Triton's argument
    handling: what an eager attention step between CUDA-graph pieces costs on the host."""

    fuses_rope = True

    backend_name = "TRITON_ATTN"
    attn_types = SUPPORTED_ATTN_TYPES

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """``AttentionImpl``'s arguments; head sizes up to 256."""
        super().__init__(*args, **kwargs)
        if self.head_size > 256:
            raise ValueError(f"TRITON_ATTN head_size: expected at most 256, got {self.head_size}; use TORCH_SDPA "
                             "for larger heads.")
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

    def forward(self, layer: "Attention", query: torch.Tensor, key: torch.Tensor | None,
                value: torch.Tensor | None, kv_cache: torch.Tensor, attn_metadata: TritonAttentionMetadata | None,
                output: torch.Tensor | None = None, output_scale: torch.Tensor | None = None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """See ``AttentionImpl.forward``; ``rope``: (T, D) cos / sin rows, q and key unrotated
        (``fuses_rope``). Device work only (no host syncs): CUDA-graph safe."""
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
        k_scale, v_scale, q_scale = layer_scales(layer)
        fixed = (kv_cache, k_scale, v_scale, q_scale, alibi, self.sinks)
        views = self._fixed
        if views is None or not all(map(operator.is_, views[0], fixed)):
            # Once per bound cache (and scales): the cache unbound into K / V, and the part of
            # the launch-plan signature that depends on these tensors only.
            key_cache, value_cache = kv_cache.unbind(0)
            views = self._fixed = (fixed, key_cache, value_cache, _fixed_signature(key_cache, value_cache, fixed[1:]))
        _, key_cache, value_cache, fixed_sig = views
        # Every layer of a step makes the same launches with its own tensors: the first one
        # records them (validated, specialized) and the others repeat them (LaunchPlan).
        cos, sin = rope if rope is not None else (None, None)
        roles = (query, key, value, output, key_cache, value_cache, k_scale, v_scale, q_scale, output_scale, alibi,
                 self.sinks, cos, sin)
        sig = self._plan_signature(query, key, value, output, output_scale, fixed_sig, rope)
        plan = md.launch_plans.get(sig, _NO_PLAN) if sig is not None else None
        if plan is _NO_PLAN:  # this step's first layer of this signature: record
            from vattn.kernels.launch import LaunchPlan, record_launches

            with record_launches() as launches:
                self._launch(layer, query, key, value, key_cache, value_cache, md, output, output_scale, rope)
            md.launch_plans[sig] = LaunchPlan.build(launches, roles, (
                md.query_start_loc, md.seq_lens, md.block_table, md.slot_mapping, md.partial_out, md.partial_lse,
                md.tree))
        elif plan is None or not plan.run(roles):  # no plan (or FastLaunch switched off since)
            self._launch(layer, query, key, value, key_cache, value_cache, md, output, output_scale, rope)
        return output

    def _plan_signature(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, o: torch.Tensor,
                        output_scale: torch.Tensor | None, fixed_sig: tuple[Any, ...] | None,
                        rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[Any, ...] | None:
        """What makes two calls of one step launch the same way, besides their tensors: the
        impl's settings, the tensors' shapes, strides and dtypes (all 16-byte aligned), and
        ``fixed_sig`` (``_fixed_signature`` of the layer's cache and scales, with their device).
        None: no plan (a misaligned tensor, or one not on CUDA: a plan passes bare addresses,
        which Triton does not check)."""
        if fixed_sig is None or not (q.is_cuda and o.is_cuda):
            return None
        ptrs = q.data_ptr() | o.data_ptr()
        for t in (k, v, output_scale, *(rope or ())):
            if t is not None:
                if not t.is_cuda:
                    return None
                ptrs |= t.data_ptr()
        if ptrs & 15:
            return None
        return (self._static_signature, fixed_sig, q.shape, q.stride(), q.dtype, o.shape, o.stride(), o.dtype,
                None if k is None else (k.shape, k.stride(), k.dtype), None if v is None else (v.shape, v.stride(), v.dtype),
                None if output_scale is None else output_scale.dtype,
                None if rope is None else (rope[0].shape, rope[0].stride(), rope[0].dtype, rope[1].stride(),
                                           rope[1].dtype))

    def _launch(self, layer: "Attention", query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
                key_cache: torch.Tensor, value_cache: torch.Tensor, md: TritonAttentionMetadata,
                output: torch.Tensor, output_scale: torch.Tensor | None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Store the new K/V, then attend (the validated, general path)."""
        paged_attention = _launcher()
        config = md.config
        store = self.kv_sharing_target_layer_name is None and key is not None and value is not None
        # Decode configs store the new K/V inside the attention kernel (one launch less).
        fuse = (store and config.one_loop and self.attn_type == AttentionType.DECODER and md.tree is None
                and envs.VATTN_TRITON_FUSED_KV_STORE)
        if store and not fuse:
            store_kv(key, value, key_cache, value_cache, md.slot_mapping,
                     self.kv_cache_dtype, layer._k_scale, layer._v_scale, rope)
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
        if md.tree is not None and not causal:
            raise ValueError("TRITON_ATTN: draft trees (CommonAttentionMetadata.tree_parents) need causal decoder "
                             f"attention; this layer is {self.attn_type!r} on a batch with causal={md.causal}.")
        window = None
        if self.sliding_window is not None and self.attn_type == AttentionType.DECODER:
            window = (self.sliding_window[0], 0 if causal else -1)
        paged_attention(
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
            slot_mapping=md.slot_mapping if fuse else None, tree=md.tree,
            rope_cos=None if rope is None else rope[0], rope_sin=None if rope is None else rope[1],
        )

"""vattn's unified paged attention in Triton: the launcher.

``paged_attention`` runs one mixed batch (decodes and chunked prefills with cached context)
in one kernel launch, over a paged KV cache, following FlashAttention's varlen conventions
(``cu_seqlens_q``, ``seqused_k``, ``block_table``, bottom-right aligned causal mask,
``window = (left, right)``). The kernels live in ``vattn.backends.triton.kernels``, the
launch configurations in ``vattn.backends.triton.config``.

CUDA graphs: the launcher never synchronizes; the grid depends only on ``q.shape[0]``,
``seqused_k.shape[0]`` and the ``UnifiedAttentionConfig``; scales are read on the device.
Pass a config (and the split scratch) chosen from static batch sizes and every replay of a
captured graph takes the same path.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton.language as tl

from vattn.backends.triton.config import (
    UnifiedAttentionConfig,
    device_num_sms,
    head_pad,
    select_unified_attention_config,
)
from vattn.backends.triton.kernels import _combine_splits_kernel, _unified_attention_kernel
from vattn.kernels.fp8 import FP8_DTYPES, fp8_round_fix
from vattn.kernels.launch import FastLaunch, pdl_supported

__all__ = ["paged_attention"]

ATTENTION_PDL: bool = True
"""Launch the attention kernel with programmatic dependent launch (sm_90+, inside captured
graphs): it reads the step's metadata (its request from ``cu_seqlens_q`` / ``seqused_k``, the
new tokens' slots, its first block-table entries) while the kernel before it (RoPE, a
projection) finishes, or as soon as that one lets it, then waits for it before reading q and
the new K/V. So no kernel of the captured forward may write the metadata: vattn's graph
runners write it into the graph's buffers before the replay."""

COMBINE_PDL: bool = True
"""Launch the split-KV combine with programmatic dependent launch (sm_90+): it is scheduled
while attention runs and waits (``gdc_wait``) for the partials, so its launch overlaps the
attention kernel (chosen with ``benchmarks/profile_step.py``)."""

COMBINE_EARLY_DEPENDENTS: bool = True
"""Let the kernel after the combine start (PDL) before the combine waits for attention, not after:
a GEMV for the output projection (``examples.gemv``) then loads its weights while attention still
runs (it waits for the combine's output itself). Chosen with ``benchmarks/profile_step.py``
(``benchmarks/results/profile-combine-early-*``)."""

FP8_V_ASM: bool = True
"""Convert fp8 value tiles with ``cvt.rn.f16x2.e4m3x2`` inline PTX (sm_89+, fp16 compute);
``benchmarks/sweep_triton_attn.py`` switches it to compare."""

FP8_KV_COMPUTE: torch.dtype | None = torch.float16
"""Matrix-operand dtype of fp8-KV attention with a 16-bit query (None: the query's dtype).

fp16, not bf16: e4m3 and e5m2 values are exact in fp16 and the GPU converts a pair of them
with one instruction (``cvt.rn.f16x2.e4m3x2``), against a detour through fp32 for bf16; the
query is clamped to the fp16 range first, softmax weights in [0, 1] gain precision.
``benchmarks/sweep_triton_attn.py`` switches it to compare."""

_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
_UNIFIED_ATTENTION = FastLaunch(_unified_attention_kernel)
_COMBINE_SPLITS = FastLaunch(_combine_splits_kernel)


@functools.lru_cache(maxsize=None)
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index if index is not None else torch.cuda.current_device())


def _as_scale(x: torch.Tensor | float | None, name: str, device: torch.device) -> torch.Tensor:
    if x is None:
        raise ValueError(f"{name} is required for this dtype combination (fp8); pass a 0-dim "
                         "float32 tensor on the device (e.g. layer._k_scale).")
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ValueError(f"{name} must be a per-tensor scale (1 element), got shape {tuple(x.shape)}.")
        return x
    return torch.full((), float(x), dtype=torch.float32, device=device)


def _check_fused_store(key: torch.Tensor | None, value: torch.Tensor | None, slot_mapping: torch.Tensor | None,
                       q: torch.Tensor, k_cache: torch.Tensor) -> None:
    """Arguments of the fused KV store (``paged_attention``'s key / value / slot_mapping)."""
    if key is None or value is None or slot_mapping is None:
        raise ValueError(
            "key, value and slot_mapping fuse the KV-cache store into attention and come together; got "
            f"key={'a tensor' if key is not None else None}, value={'a tensor' if value is not None else None}, "
            f"slot_mapping={'a tensor' if slot_mapping is not None else None}. Pass all three, or none and "
            "store with vattn.ops.kv_store.store_kv first.")
    _, _, hk, d = k_cache.shape
    t = q.shape[0]
    for name, x in (("key", key), ("value", value)):
        if (x.dim() != 3 or x.shape[0] < t or x.shape[1:] != (hk, d) or x.dtype != key.dtype
                or x.dtype not in _TL_DTYPES or x.device != q.device):
            raise ValueError(
                f"{name} must be (T >= {t}, Hk={hk}, D={d}), fp16 / bf16 / fp32 like key, on {q.device}; got "
                f"{tuple(x.shape)} {x.dtype} on {x.device}.")
    if not (slot_mapping.dim() == 1 and slot_mapping.shape[0] >= t and slot_mapping.dtype in (torch.int64, torch.int32)):
        raise ValueError(
            f"slot_mapping must be (T >= {t},) int64 (or int32), got {tuple(slot_mapping.shape)} {slot_mapping.dtype}.")


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor,
    block_table: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool = True,
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    q_scale: torch.Tensor | float | None = None,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
    output_scale: torch.Tensor | float | None = None,
    config: UnifiedAttentionConfig | None = None,
    num_splits: int | None = None,
    partial_out: torch.Tensor | None = None,
    partial_lse: torch.Tensor | None = None,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    tree: torch.Tensor | None = None,
    rope_cos: torch.Tensor | None = None,
    rope_sin: torch.Tensor | None = None,
) -> None:
    """Paged attention over a mixed batch, written into ``out`` (no host synchronization).

    | tensor | shape | dtype |
    | --- | --- | --- |
    | q | (T, H, D) | fp16 / bf16 / fp32, or fp8 with ``q_scale`` |
    | k_cache, v_cache | (num_blocks, block_size, Hk, D), any strides (NHD or HND) | q's, or fp8 with ``k_scale``/``v_scale`` |
    | out | (T, H, D) | fp16 / bf16 / fp32, or fp8 with ``output_scale`` |
    | cu_seqlens_q | (B + 1,) cumulative query lengths | int32 |
    | seqused_k | (B,) tokens of each request in the cache (context + new) | int32 |
    | block_table | (B, max_blocks) block ids of each request | int32 |
    | alibi_slopes, sinks | (H,) | float32 / any float |
    | key, value | (T, Hk, D), optional: the step's new K/V, stored by the kernel | fp16 / bf16 / fp32 |
    | slot_mapping | (T,) cache slot of each new token, < 0 = skip; with key / value | int64 (or int32) |
    | tree | (T, W), optional: draft trees, ``tree[t, j]`` token t sees its request's new token j | bool / uint8 / int8 |
    | rope_cos, rope_sin | (T, D), optional: each token's rotary rows; q and key are then unrotated | any float |

    ``key``/``value``/``slot_mapping`` (all or none) fuse the KV-cache store into the kernel:
    it writes what ``vattn.ops.kv_store.store_kv`` would (fp8 quantization included), and
    since no program may read back a slot this launch writes, every query attends to the
    cache for its context and to ``key``/``value`` (as the cache would hold them) for the
    step's own tokens: the same result wherever ``slot_mapping`` puts each new token at its
    position in ``block_table``, as it must. Meant for decode batches (a one-token query
    takes its own key from registers); longer queries read their step's keys in a masked
    loop, correct but slower than storing first.

    Query token ``i`` of request ``b`` sits at position ``seqused_k[b] - q_len_b + i``;
    ``causal`` hides later keys, ``window = (left, right)`` (-1 = unlimited; ``right`` is 0
    under ``causal``) keeps keys in ``[pos - left, pos + right]``, ``softcap`` applies
    ``softcap * tanh(s / softcap)`` to the scaled logits, ALiBi adds
    ``slope * (pos_k - pos_q)`` (vLLM's convention), a sink adds ``exp(sink)`` to the
    softmax denominator. ``tree`` (speculative decoding with draft trees, under ``causal``):
    a request's new keys are visible only where the query token's row says so (its ancestors
    and itself; ``W`` at least the longest query), its cached keys to all its tokens.
    Rows of tokens past ``cu_seqlens_q[B]`` (padding) are left untouched.

    The metadata tensors are not read on the host: where they are wrong the kernel still keeps
    every access inside ``q``/``out``, the caches and each request's block-table row (query rows
    clamped into ``[0, T)``, keys to the row's ``max_blocks * block_size``, block ids into
    ``[0, num_blocks)``; fused-store slots outside the cache are skipped): wrong output, no fault.

    ``rope_cos``/``rope_sin`` (both or neither) fuse rotary embedding (rotate-half form,
    ``vattn.ops.rotary.apply_rotary``): q, and with the fused store ``key``, are rotated as the
    kernel loads them. Keys already in the cache must be rotated (``store_kv(..., rope=...)``).

    ``max_seqlen_q`` only picks the config; ``max_seqlen_k`` is accepted for FlashAttention
    parity. ``config``/``num_splits`` override the choice; with ``num_splits > 1`` the fp32
    scratch ``partial_out`` (>= splits*T*H*head_pad(D) elements) and ``partial_lse``
    (>= splits*T*H) are used, or allocated when not given.
    """
    if not (q.dim() == 3 and out.shape == q.shape):
        raise ValueError(
            f"q and out must both be (T, H, D); got q {tuple(q.shape)}, out {tuple(out.shape)}.")
    if not (k_cache.dim() == 4 and v_cache.shape == k_cache.shape):
        raise ValueError(
            f"k_cache and v_cache must both be (num_blocks, block_size, Hk, D); got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}.")
    num_tokens, num_q_heads, head_size = q.shape
    _, page_size, num_kv_heads, kv_head_size = k_cache.shape
    if kv_head_size != head_size:
        raise ValueError(
            f"head size mismatch: q has D={head_size}, the cache {kv_head_size}.")
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads}).")
    num_seqs = seqused_k.shape[0]
    if not (cu_seqlens_q.dim() == 1 and cu_seqlens_q.shape[0] >= num_seqs + 1):
        raise ValueError(
            f"cu_seqlens_q must have at least B + 1 = {num_seqs + 1} entries, got {tuple(cu_seqlens_q.shape)}.")
    if not (block_table.dim() == 2 and block_table.shape[0] >= num_seqs and block_table.stride(1) == 1):
        raise ValueError(
            f"block_table must be (B >= {num_seqs}, max_blocks) with unit last stride, got "
            f"{tuple(block_table.shape)} strides {block_table.stride()}.")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("seqused_k", seqused_k), ("block_table", block_table)):
        if t.dtype != torch.int32:
            raise ValueError(
                f"{name} must be int32, got {t.dtype}.")
    if rope_cos is not None or rope_sin is not None:
        from vattn.ops.rotary import check_rope

        check_rope(rope_cos, rope_sin, q, head_size, "paged_attention")
        if q.dtype in FP8_DTYPES:
            raise ValueError("paged_attention: rope_cos / rope_sin rotate the query as it is loaded, which an fp8 "
                             "query cannot be; rotate before quantizing and pass no rotary rows.")
        assert rope_cos is not None and rope_sin is not None
        if rope_cos.stride(1) != 1 or rope_sin.stride() != rope_cos.stride():
            rope_cos, rope_sin = rope_cos.contiguous(), rope_sin.contiguous()
    if num_tokens == 0 or num_seqs == 0:
        return
    qpk = num_q_heads // num_kv_heads
    hp = head_pad(head_size)
    if config is None:
        config = select_unified_attention_config(
            num_tokens=num_tokens, num_seqs=num_seqs, num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads, head_size=head_size, max_seqlen_q=max_seqlen_q,
            num_sms=device_num_sms(q.device),
            max_split_rows=None if partial_out is None else partial_out.numel() // (num_q_heads * hp),
            kv_fp8=k_cache.dtype in FP8_DTYPES,
        )
    if num_splits is not None and num_splits != config.num_splits:
        config = dataclasses.replace(config, num_splits=num_splits)
    if config.block_m < qpk:
        raise ValueError(
            f"config.block_m ({config.block_m}) must be >= query heads per KV head ({qpk}).")

    q_fp8 = q.dtype in FP8_DTYPES
    kv_fp8 = k_cache.dtype in FP8_DTYPES
    out_fp8 = out.dtype in FP8_DTYPES
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) dtypes differ.")
    if not q_fp8:
        compute = q.dtype
    elif not kv_fp8:
        compute = k_cache.dtype
    else:
        compute = out.dtype if not out_fp8 else torch.bfloat16
    if kv_fp8 and compute in (torch.bfloat16, torch.float16) and FP8_KV_COMPUTE is not None:
        compute = FP8_KV_COMPUTE
    if compute not in _TL_DTYPES:
        raise TypeError(f"unsupported dtypes: q {q.dtype}, cache {k_cache.dtype}, out {out.dtype}; "
                        "use fp16/bf16/fp32 (fp8 for the cache, q and out with scales).")
    if not kv_fp8 and k_cache.dtype not in _TL_DTYPES:
        raise TypeError(f"unsupported KV cache dtype {k_cache.dtype}; use fp16/bf16/fp32 or fp8 "
                        "(float8_e4m3fn / float8_e5m2).")
    dummy = q  # stands in for absent optional pointers (never read)
    qs = _as_scale(q_scale, "q_scale", q.device) if q_fp8 else dummy
    ks = _as_scale(k_scale, "k_scale", q.device) if kv_fp8 else dummy
    vs = _as_scale(v_scale, "v_scale", q.device) if kv_fp8 else dummy
    os_ = _as_scale(output_scale, "output_scale", q.device) if out_fp8 else dummy
    fp8_out_max = float(torch.finfo(out.dtype).max) if out_fp8 else 0.0
    round_fix = fp8_round_fix(out.dtype, out.device)
    for name, t in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if t is not None:
            if t.shape != (num_q_heads,):
                raise ValueError(
                    f"{name} must have shape (H,) = ({num_q_heads},), got {tuple(t.shape)}.")

    left, right = (-1, -1) if window is None else (int(window[0]), int(window[1]))
    left = -1 if left is None or left < 0 else left
    right = -1 if right is None or right < 0 else right
    if causal:
        right = -1
    use_window = left >= 0 or right >= 0

    splits = config.num_splits
    block_q = config.block_q(qpk)
    if splits > 1:
        need_o, need_lse = splits * num_tokens * num_q_heads * hp, splits * num_tokens * num_q_heads
        if partial_out is None or partial_lse is None:
            partial_out = torch.empty(need_o, dtype=torch.float32, device=q.device)
            partial_lse = torch.empty(need_lse, dtype=torch.float32, device=q.device)
        if not (partial_out.numel() >= need_o and partial_lse.numel() >= need_lse
               and partial_out.dtype == torch.float32 and partial_lse.dtype == torch.float32):
            raise ValueError(
                f"split scratch too small for num_splits={splits}, T={num_tokens}: need fp32 "
                f"partial_out >= {need_o}, partial_lse >= {need_lse} elements, got "
                f"{partial_out.numel()} and {partial_lse.numel()}; size it with split_scratch_numel().")
    else:
        partial_out = partial_lse = dummy

    fuse = key is not None or value is not None or slot_mapping is not None
    if tree is not None:
        if not (tree.dim() == 2 and tree.shape[0] >= num_tokens and tree.shape[1] >= max_seqlen_q
                and tree.dtype in (torch.bool, torch.uint8, torch.int8) and tree.device == q.device
                and tree.stride(1) == 1):
            raise ValueError(
                f"tree must be (T >= {num_tokens}, W >= max_seqlen_q = {max_seqlen_q}) bool / uint8 on {q.device} with "
                f"unit last stride, got {tuple(tree.shape)} {tree.dtype} on {tree.device}; build it with "
                "vattn.backends.tree_attn.ancestors (one row per query token).")
        if fuse or not causal:
            raise ValueError("tree needs causal attention and the KV store outside the kernel (key / value / "
                             "slot_mapping None): store the step's K/V first (vattn.ops.kv_store.store_kv).")
        if tree.dtype != torch.uint8:
            tree = tree.view(torch.uint8)
        if tree.stride(0) != tree.shape[1]:  # the kernel reads a row's stride(0) bytes, no more
            tree = tree.contiguous()
    if fuse:
        _check_fused_store(key, value, slot_mapping, q, k_cache)
        assert key is not None and value is not None and slot_mapping is not None
        new_k, new_v, slots = key, value, slot_mapping
        new_strides = (*key.stride(), *value.stride())
    else:
        new_k = new_v = slots = dummy
        new_strides = (0,) * 6

    v_cvt = 0
    if (kv_fp8 and FP8_V_ASM and compute == torch.float16 and q.device.type == "cuda"
            and _capability(q.device.index) >= (8, 9)):
        v_cvt = 2 if k_cache.dtype == torch.float8_e5m2 else 1
    launch = dict(num_warps=config.num_warps, num_stages=config.num_stages)
    if config.maxnreg is not None and q.device.type == "cuda":
        launch["maxnreg"] = config.maxnreg

    # sm_90+: let a kernel launched with programmatic dependent launch after attention (vattn's
    # GEMV for the output projection) start early and load its weights while attention runs.
    pdl = pdl_supported(q.device)
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, splits)
    k_strides, v_strides = k_cache.stride(), v_cache.stride()
    _UNIFIED_ATTENTION[grid](
        q, k_cache, v_cache, out, partial_out, partial_lse,
        cu_seqlens_q, seqused_k, block_table,
        sinks if sinks is not None else dummy,
        alibi_slopes if alibi_slopes is not None else dummy,
        qs, ks, vs, os_, new_k, new_v, slots, tree if tree is not None else dummy,
        rope_cos if rope_cos is not None else dummy, rope_sin if rope_sin is not None else dummy,
        num_seqs, num_tokens, k_cache.shape[0], block_table.shape[1], float(softmax_scale), float(softcap) if softcap else 1.0, left, right,
        tree.stride(0) if tree is not None else 0, rope_cos.stride(0) if rope_cos is not None else 0,
        *q.stride(), *k_strides, *v_strides, *out.stride(), block_table.stride(0), *new_strides,
        NUM_Q_HEADS=num_q_heads, QPK=qpk, HEAD_SIZE=head_size, HEAD_PAD=hp, PAGE_SIZE=page_size,
        BLOCK_M=config.block_m, BLOCK_Q=block_q, TILE_N=config.tile_n, SPLIT_KV=splits > 1,
        COMPUTE_DTYPE=_TL_DTYPES[compute],
        DOT_FP32=q.device.type != "cuda" or compute == torch.float32,
        CAUSAL=bool(causal), USE_WINDOW=use_window, USE_SOFTCAP=bool(softcap),
        USE_ALIBI=alibi_slopes is not None, USE_SINKS=sinks is not None,
        Q_FP8=q_fp8, KV_FP8=kv_fp8, OUT_FP8=out_fp8, FP8_OUT_MAX=fp8_out_max,
        FP8_ROUND_FIX=round_fix, V_CVT=v_cvt, KV_SAME=k_strides == v_strides,
        ONE_LOOP=config.one_loop, LAUNCH_DEPENDENTS=pdl, FUSE_STORE=fuse,
        KV_FP8_MAX=float(torch.finfo(k_cache.dtype).max) if kv_fp8 else 0.0,
        KV_ROUND_FIX=fp8_round_fix(k_cache.dtype, k_cache.device),
        PDL_WAIT=pdl and ATTENTION_PDL, TREE=tree is not None, ROPE=rope_cos is not None,
        launch_pdl=pdl and ATTENTION_PDL, **launch,
    )
    if splits > 1:
        _COMBINE_SPLITS[(num_tokens, num_q_heads)](
            out, partial_out, partial_lse, cu_seqlens_q, os_,
            num_seqs, num_tokens, *out.stride(),
            NUM_Q_HEADS=num_q_heads, HEAD_SIZE=head_size, HEAD_PAD=hp, NUM_SPLITS=splits,
            OUT_FP8=out_fp8, FP8_OUT_MAX=fp8_out_max, FP8_ROUND_FIX=round_fix, LAUNCH_DEPENDENTS=pdl,
            WAIT=pdl and COMBINE_PDL, EARLY_DEPENDENTS=pdl and COMBINE_PDL and COMBINE_EARLY_DEPENDENTS,
            num_warps=4, launch_pdl=pdl and COMBINE_PDL,
        )

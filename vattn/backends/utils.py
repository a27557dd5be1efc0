"""Backend utilities (the seeds' ``vllm/v1/attention/backends/utils.py``).

Local-attention virtual batches, per-layer hyperparameters, fp8 scales, and the decode/prefill
split of a batch ordered decodes first. The contract's classes live in ``vattn.core``; the
KV-cache layout in ``vattn.core.layout``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch

from vattn.core.interface import AttentionImpl, AttentionLayerBase
from vattn.core.metadata import CommonAttentionMetadata

if TYPE_CHECKING:
    import numpy as np

    from vattn.core.config import VattnConfig

__all__ = [
    "PerLayerParameters",
    "get_per_layer_parameters",
    "infer_global_hyperparameters",
    "make_local_attention_virtual_batches",
    "split_decodes_and_prefills",
]

logger = logging.getLogger("vattn")


# ---- local (chunked) attention --------------------------------------------------------


def make_local_attention_virtual_batches(
    attn_chunk_size: int,
    query_start_loc_np: "np.ndarray",
    seq_lens_np: "np.ndarray",
    block_table: torch.Tensor,
    block_size: int,
) -> tuple["np.ndarray", "np.ndarray", "np.ndarray", torch.Tensor]:
    """Split each request into one "virtual request" per local-attention chunk it queries.

    With chunked local attention a token at position p attends only to keys in its chunk
    ``[p // C * C, p]`` (C = ``attn_chunk_size``). Every (request, chunk) pair that holds
    new tokens becomes a virtual request whose keys are the chunk's keys, so a plain
    causal kernel computes local attention.

    Args:
        attn_chunk_size: C, a multiple of ``block_size``.
        query_start_loc_np: (B + 1,) cumulative new-token counts.
        seq_lens_np: (B,) tokens per request after this step (>= its new tokens).
        block_table: (B, max_blocks) block ids of each request.
        block_size: tokens per KV-cache block.

    Returns:
        ``seqlens_q_local`` (V,) int32, ``cu_seqlens_q_local`` (V + 1,) int32,
        ``seqlens_k_local`` (V,) int32, ``block_table_local`` (V, C // block_size) with
        ``block_table``'s dtype and device. Block indices past the table's width are
        clipped to its last column (those entries are never read).

    Example (C = 4, block_size = 2, ``block_table[b] = [10b, 10b+1, ..., 10b+9]``):
    ``q_seqlens = [4, 10, 5]``, ``seq_lens = [6, 17, 9]`` give
    ``seqlens_q_local = [2, 2, 1, 4, 4, 1, 4, 1]``, ``seqlens_k_local = [4, 2, 4, 4, 4, 1, 4, 1]``
    (chunks starting at keys ``[0, 4, 4, 8, 12, 16, 4, 8]``) and ``block_table_local =
    [[0, 1], [2, 3], [12, 13], [14, 15], [16, 17], [18, 19], [22, 23], [24, 25]]``.
    """
    import numpy as np

    if block_size <= 0 or attn_chunk_size <= 0 or attn_chunk_size % block_size != 0:
        raise ValueError(
            f"make_local_attention_virtual_batches: attn_chunk_size ({attn_chunk_size}) must be a "
            f"positive multiple of block_size ({block_size})."
        )
    qsl = np.asarray(query_start_loc_np, dtype=np.int64)
    seq_lens = np.asarray(seq_lens_np, dtype=np.int64)
    q_lens = qsl[1:] - qsl[:-1]
    if q_lens.shape != seq_lens.shape or (q_lens < 0).any() or (seq_lens < q_lens).any():
        raise ValueError(
            "make_local_attention_virtual_batches: need len(query_start_loc_np) == "
            "len(seq_lens_np) + 1, non-decreasing query_start_loc_np and seq_lens_np >= query "
            f"lengths; got query lengths {q_lens.tolist()} and seq_lens {seq_lens.tolist()}."
        )
    chunk = attn_chunk_size
    context = seq_lens - q_lens
    last_chunk = np.maximum(seq_lens - 1, 0) // chunk
    # min(): a request with no new tokens still yields one (empty-query) virtual request.
    first_chunk = np.minimum(context // chunk, last_chunk)
    num_local = last_chunk - first_chunk + 1
    num_virtual = int(num_local.sum())

    req = np.repeat(np.arange(len(seq_lens)), num_local)  # owning request of each virtual one
    starts_of_req = np.cumsum(num_local) - num_local
    chunk_idx = first_chunk[req] + np.arange(num_virtual) - starts_of_req[req]
    k_start = chunk_idx * chunk
    k_end = np.minimum(seq_lens[req], k_start + chunk)
    seqlens_k_local = (k_end - k_start).astype(np.int32)
    seqlens_q_local = (k_end - np.maximum(context[req], k_start)).astype(np.int32)
    cu_seqlens_q_local = np.concatenate([[0], np.cumsum(seqlens_q_local)]).astype(np.int32)

    pages = chunk // block_size
    cols = (k_start // block_size)[:, None] + np.arange(pages)[None, :]
    cols = np.minimum(cols, block_table.shape[1] - 1)
    device = block_table.device
    rows_t = torch.from_numpy(req[:, None]).to(device)  # broadcasts against the columns
    block_table_local = block_table[rows_t, torch.from_numpy(cols).to(device)]
    return seqlens_q_local, cu_seqlens_q_local, seqlens_k_local, block_table_local


# ---- per-layer hyperparameters --------------------------------------------------------


@dataclass(frozen=True)
class PerLayerParameters:
    """Hyperparameters some backends (FlashInfer's plan) need to be equal across layers.

    ``window_left`` is the sliding window's left extent in tokens (-1: unlimited).
    """

    window_left: int
    logits_soft_cap: float | None
    sm_scale: float


def get_per_layer_parameters(
    vattn_config: "VattnConfig",
    impl_cls: type[AttentionImpl],
    layer_names: Sequence[str] | None = None,
) -> dict[str, PerLayerParameters]:
    """Each attention layer's ``PerLayerParameters``, read from its impl.

    Args:
        vattn_config: the config the model was built under (its static forward context).
        impl_cls: the impl class every selected layer must use.
        layer_names: restrict to these layers (e.g. a builder's KV-cache group); default all.

    Raises:
        TypeError: a layer's impl is not an ``impl_cls``.
        KeyError: a name in ``layer_names`` is not a registered layer.
    """
    context = vattn_config.compilation.static_forward_context
    if layer_names is None:
        layers = {k: v for k, v in context.items() if isinstance(v, AttentionLayerBase)}
    else:
        missing = [n for n in layer_names if n not in context]
        if missing:
            raise KeyError(f"layers {missing} are not in the config's static forward context.")
        layers = {n: context[n] for n in layer_names}
    params: dict[str, PerLayerParameters] = {}
    for name, layer in layers.items():
        impl = layer.impl
        if not isinstance(impl, impl_cls):
            raise TypeError(
                f"layer {name!r} uses {type(impl).__name__}, expected {impl_cls.__name__}; "
                "pass the layer_names of one backend's layers."
            )
        window_left = impl.sliding_window[0] if impl.sliding_window is not None else -1
        params[name] = PerLayerParameters(window_left, impl.logits_soft_cap, impl.scale)
    return params


def infer_global_hyperparameters(
    per_layer_params: dict[str, PerLayerParameters],
) -> PerLayerParameters:
    """The one ``PerLayerParameters`` all layers share.

    Raises:
        ValueError: no layers, or layers disagree; the message names each differing field
            with its values and the layers that have them.
    """
    if not per_layer_params:
        raise ValueError(
            "infer_global_hyperparameters: no attention layers found; build the model inside "
            "vattn.set_current_vattn_config(cfg) and pass that cfg."
        )
    first = next(iter(per_layer_params.values()))
    problems: list[str] = []
    for f in fields(PerLayerParameters):
        by_value: dict[Any, list[str]] = {}
        for name, params in per_layer_params.items():
            by_value.setdefault(getattr(params, f.name), []).append(name)
        if len(by_value) > 1:
            groups = "; ".join(f"{value!r} in {names}" for value, names in by_value.items())
            problems.append(f"{f.name}: {groups}")
    if problems:
        raise ValueError(
            "this backend needs every attention layer to share window_left, logits_soft_cap and "
            "sm_scale, but layers disagree on " + " | ".join(problems)
            + ". Use a backend without this restriction (e.g. TRITON_ATTN or FLASH_ATTN)."
        )
    return first


def split_decodes_and_prefills(
    common_attn_metadata: "CommonAttentionMetadata",
    decode_threshold: int = 1,
) -> tuple[int, int, int, int]:
    """Find the decode/prefill boundary of a batch ordered decodes first.

    A decode is a request with at most ``decode_threshold`` new tokens. The decodes are
    the leading run of such requests; every request from the first longer one on counts
    as a prefill (so CUDA-graph padding requests, which come last, join the prefills, and
    an unordered batch is never split wrongly, only less efficiently: a prefill path
    handles any query length). Host-only: reads ``query_start_loc_cpu``.

    Returns:
        ``(num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens)``.
    """
    num_reqs = common_attn_metadata.num_reqs
    num_tokens = common_attn_metadata.num_actual_tokens
    if common_attn_metadata.max_query_len <= decode_threshold:
        return num_reqs, 0, num_tokens, 0
    qsl = common_attn_metadata.query_start_loc_cpu[: num_reqs + 1]
    is_prefill = (qsl[1:] - qsl[:-1]) > decode_threshold
    if not bool(is_prefill.any()):
        return num_reqs, 0, num_tokens, 0
    first_prefill = int(is_prefill.int().argmax())
    num_decode_tokens = int(qsl[first_prefill] - qsl[0])
    return first_prefill, num_reqs - first_prefill, num_decode_tokens, num_tokens - num_decode_tokens

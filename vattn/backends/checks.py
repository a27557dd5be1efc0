"""Host-side checks of what users pass to the backend interface (no device sync).

Each failure raises ``ValueError`` naming the field, what was expected, what arrived, and
what to do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NoReturn

import torch

if TYPE_CHECKING:
    from vattn.backends.abstract import AttentionBackend, CommonAttentionMetadata

__all__ = ["check_common_metadata", "configuration_reasons", "fail", "feature_reasons"]


def fail(name: str, expected: str, got: object, fix: str) -> NoReturn:
    """Raise the ``ValueError`` every check here raises."""
    raise ValueError(f"{name}: expected {expected}, got {got}; {fix}")


def check_common_metadata(md: "CommonAttentionMetadata") -> None:
    """Dtypes, ranks and lengths of a ``CommonAttentionMetadata``'s tensors."""
    field = "CommonAttentionMetadata."
    if md.slot_mapping.dtype not in (torch.int64, torch.int32) or md.slot_mapping.dim() != 1:
        fail(field + "slot_mapping", "a 1-D int64 (or int32) tensor of cache slots",
             f"dtype={md.slot_mapping.dtype}, shape={tuple(md.slot_mapping.shape)}",
             "build it with vattn.build_common_attn_metadata or pass slot = block_id * block_size + offset.")
    if md.block_table_tensor.dtype != torch.int32 or md.block_table_tensor.dim() != 2:
        fail(field + "block_table_tensor", "a 2-D int32 tensor (num_reqs, max_blocks_per_req)",
             f"dtype={md.block_table_tensor.dtype}, shape={tuple(md.block_table_tensor.shape)}",
             "convert with .to(torch.int32) and stack the per-request block ids into rows.")
    for name in ("query_start_loc", "seq_lens"):
        t = getattr(md, name)
        if t.dtype != torch.int32 or t.dim() != 1:
            fail(field + name, "a 1-D int32 tensor", f"dtype={t.dtype}, shape={tuple(t.shape)}",
                 "convert with .to(torch.int32).")
    if md.query_start_loc.shape[0] < md.num_reqs + 1:
        fail(field + "query_start_loc", f"at least num_reqs + 1 = {md.num_reqs + 1} entries",
             md.query_start_loc.shape[0], "include the leading 0 and one end offset per request.")
    if md.seq_lens.shape[0] < md.num_reqs or md.block_table_tensor.shape[0] < md.num_reqs:
        fail(field + "seq_lens/block_table_tensor", f"at least num_reqs = {md.num_reqs} rows",
             (md.seq_lens.shape[0], md.block_table_tensor.shape[0]), "give one row per request.")
    if md.num_slot_tokens is None and md.slot_mapping.shape[0] < md.num_actual_tokens:
        fail(field + "slot_mapping", f"at least num_actual_tokens = {md.num_actual_tokens} entries",
             md.slot_mapping.shape[0], "give one slot per new token.")
    if md.num_slot_tokens is not None and not 0 <= md.num_slot_tokens <= md.slot_mapping.shape[0]:
        fail(field + "num_slot_tokens", f"between 0 and len(slot_mapping) = {md.slot_mapping.shape[0]}",
             md.num_slot_tokens, "give the number of K/V tokens this step writes (cross-attention: "
             "the encoder tokens), or None for num_actual_tokens.")


def configuration_reasons(cls: "type[AttentionBackend]", head_size: int, dtype: torch.dtype,
                          kv_cache_dtype: str | None, block_size: int, use_mla: bool = False,
                          has_sink: bool = False, use_sparse: bool = False) -> list[str]:
    """Every reason backend ``cls`` cannot serve a configuration, by its declarations and
    ``is_available`` (the default ``AttentionBackend.validate_configuration``)."""
    reasons: list[str] = []
    ok, why = cls.is_available()
    if not ok:
        reasons.append(why)
    elif cls.min_compute_capability is not None and torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        if cap < cls.min_compute_capability:
            need = ".".join(map(str, cls.min_compute_capability))
            reasons.append(f"GPU too old: compute capability {cap[0]}.{cap[1]} < {need}")
    head_sizes = cls.get_supported_head_sizes()
    if head_sizes is not None and head_size not in head_sizes:
        reasons.append(f"head_size {head_size} not in {list(head_sizes)}")
    if dtype not in cls.supported_dtypes:
        reasons.append(f"dtype {dtype} not in {[str(d) for d in cls.supported_dtypes]}")
    kv = kv_cache_dtype or "auto"
    if kv not in cls.supported_kv_cache_dtypes:
        reasons.append(f"kv_cache_dtype {kv!r} not in {list(cls.supported_kv_cache_dtypes)}")
    block_sizes = cls.get_supported_block_sizes()
    if block_sizes is not None and block_size not in block_sizes:
        reasons.append(f"block_size {block_size} not in {list(block_sizes)}")
    if use_mla and not cls.supports_mla:
        reasons.append("MLA not supported")
    if not use_mla and cls.supports_mla:
        reasons.append("only serves MLA models")
    if has_sink and not cls.supports_sink:
        reasons.append("attention sinks not supported")
    if use_sparse and not cls.supports_sparse:
        reasons.append("sparse attention not supported")
    return reasons


def feature_reasons(cls: "type[AttentionBackend]", attn_type: str, use_sliding_window: bool,
                    use_logits_soft_cap: bool, use_alibi: bool) -> list[str]:
    """Every layer feature backend ``cls`` declares it does not serve (the default
    ``AttentionBackend.feature_reasons``)."""
    reasons = []
    if attn_type not in cls.supported_attn_types:
        reasons.append(f"attn_type {attn_type!r} not in {list(cls.supported_attn_types)}")
    for wanted, served, what in ((use_sliding_window, cls.supports_sliding_window, "sliding window"),
                                 (use_logits_soft_cap, cls.supports_logits_soft_cap, "logits soft cap"),
                                 (use_alibi, cls.supports_alibi, "ALiBi")):
        if wanted and not served:
            reasons.append(f"{what} not supported")
    return reasons

"""Host-side checks of what users pass to the backend interface (no device sync).

Each failure raises ``ValueError`` (``TypeError`` for a wrong type) naming the field, what was
expected, what arrived, and what to do. What a batch must satisfy against a KV cache is in
``vattn.backends.batch_checks``; device-side checks (``VATTN_DEBUG_CHECKS=1``) in
``vattn.backends.debug_checks``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import inspect
import math
from typing import Any

import numpy as np
import torch

from vattn import envs
from vattn.backends.batch_checks import StepChecks, fail

if TYPE_CHECKING:
    from vattn.backends.abstract import AttentionBackend, CommonAttentionMetadata

__all__ = ["check_common_metadata", "check_layer_args", "check_mods", "configuration_reasons", "e4m3_cache_reasons",
           "fail", "feature_reasons", "triton_availability"]

_FIELD = "CommonAttentionMetadata."
_INTS = (torch.int32, torch.int64)


def _check_structure(md: "CommonAttentionMetadata") -> None:
    """Types, dtypes, ranks, lengths and devices."""
    for name in ("num_reqs", "num_actual_tokens", "max_query_len", "max_seq_len"):
        v = getattr(md, name)
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < (-1 if name == "max_seq_len" else 0):
            fail(_FIELD + name, "a non-negative int", repr(v), "pass a Python int (e.g. int(tensor.item()) on the host).")
    if md.slot_mapping.dtype not in _INTS or md.slot_mapping.dim() != 1:
        fail(_FIELD + "slot_mapping", "a 1-D int64 (or int32) tensor of cache slots",
             f"dtype={md.slot_mapping.dtype}, shape={tuple(md.slot_mapping.shape)}",
             "build it with vattn.build_common_attn_metadata or pass slot = block_id * block_size + offset.")
    if md.block_table_tensor.dtype != torch.int32 or md.block_table_tensor.dim() != 2:
        fail(_FIELD + "block_table_tensor", "a 2-D int32 tensor (num_reqs, max_blocks_per_req)",
             f"dtype={md.block_table_tensor.dtype}, shape={tuple(md.block_table_tensor.shape)}",
             "convert with .to(torch.int32) and stack the per-request block ids into rows.")
    for name in ("query_start_loc", "seq_lens", "query_start_loc_cpu", "seq_lens_cpu", "num_computed_tokens_cpu"):
        t = getattr(md, name)
        if not isinstance(t, torch.Tensor) or t.dtype not in _INTS or t.dim() != 1:
            got = f"dtype={t.dtype}, shape={tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            fail(_FIELD + name, "a 1-D int32 tensor", got, "convert with .to(torch.int32).")
    dev = md.query_start_loc.device
    for name in ("seq_lens", "block_table_tensor", "slot_mapping"):
        if getattr(md, name).device != dev:
            fail(_FIELD + name, f"a tensor on query_start_loc's device {dev}", f"one on {getattr(md, name).device}",
                 "put the metadata's device tensors on the model's device (build_common_attn_metadata(device=...)).")
    for name in ("query_start_loc_cpu", "seq_lens_cpu", "num_computed_tokens_cpu"):
        if getattr(md, name).device.type != "cpu":
            fail(_FIELD + name, "a CPU tensor (the host mirror)", f"one on {getattr(md, name).device}",
                 "pass the host copy (the kernels read the device tensors, host work reads these).")
    b = md.num_reqs
    if md.query_start_loc.shape[0] < b + 1 or md.query_start_loc_cpu.shape[0] < b + 1:
        fail(_FIELD + "query_start_loc", f"at least num_reqs + 1 = {b + 1} entries",
             (md.query_start_loc.shape[0], md.query_start_loc_cpu.shape[0]),
             "include the leading 0 and one end offset per request (device tensor and host mirror).")
    rows = (md.seq_lens.shape[0], md.seq_lens_cpu.shape[0], md.block_table_tensor.shape[0],
            md.num_computed_tokens_cpu.shape[0])
    if min(rows) < b:
        fail(_FIELD + "seq_lens/seq_lens_cpu/block_table_tensor/num_computed_tokens_cpu",
             f"at least num_reqs = {b} rows", rows, "give one row per request.")
    if md.num_slot_tokens is None and md.slot_mapping.shape[0] < md.num_actual_tokens:
        fail(_FIELD + "slot_mapping", f"at least num_actual_tokens = {md.num_actual_tokens} entries",
             md.slot_mapping.shape[0], "give one slot per new token.")
    if md.num_slot_tokens is not None and not 0 <= md.num_slot_tokens <= md.slot_mapping.shape[0]:
        fail(_FIELD + "num_slot_tokens", f"between 0 and len(slot_mapping) = {md.slot_mapping.shape[0]}",
             md.num_slot_tokens, "give the number of K/V tokens this step writes (cross-attention: "
             "the encoder tokens), or None for num_actual_tokens.")


def _check_mirrors(md: "CommonAttentionMetadata", qsl: np.ndarray, seq: np.ndarray) -> None:
    """What the host mirrors say: query_start_loc from 0, non-decreasing, covering the tokens;
    seq_lens >= 0 (and >= the query lengths of causal batches); the maxima."""
    b, n = md.num_reqs, md.num_actual_tokens
    if qsl[0] != 0 or (np.diff(qsl) < 0).any():
        fail(_FIELD + "query_start_loc", "offsets starting at 0 and non-decreasing (cumulative query lengths)",
             qsl.tolist()[:16], "pass [0, q0, q0 + q1, ...] (torch.cumsum of the query lengths with a leading 0).")
    if qsl[b] < n or (md.num_slot_tokens is None and qsl[b] > md.slot_mapping.shape[0]):
        fail(_FIELD + "query_start_loc", f"query_start_loc[num_reqs] between num_actual_tokens = {n} and "
             f"len(slot_mapping) = {md.slot_mapping.shape[0]}", int(qsl[b]),
             "make num_actual_tokens the number of real new tokens, which the requests' query lengths sum to.")
    qlen = np.diff(qsl)
    if (seq < 0).any() or (md.causal and (seq < qlen).any()):
        r = int(np.nonzero((seq < 0) | ((seq < qlen) if md.causal else False))[0][0])
        fail(_FIELD + "seq_lens", "each request's cached + new tokens (>= its query length "
             "query_start_loc[r + 1] - query_start_loc[r])", f"seq_lens[{r}] = {int(seq[r])} with query length "
             f"{int(qlen[r])}", "set seq_lens = num_computed_tokens + query_lens (device tensor and host mirror).")
    if b and qlen.max() > max(md.max_query_len, 1):
        fail(_FIELD + "max_query_len", f"at least the longest query length {int(qlen.max())}", md.max_query_len,
             "pass the maximum of the query lengths.")
    if b and md.max_seq_len >= 0 and seq.max() > md.max_seq_len:
        fail(_FIELD + "max_seq_len", f"at least the longest seq_len {int(seq.max())}", md.max_seq_len,
             "pass the maximum of seq_lens (or leave it at -1: it is computed).")
    if md.query_start_loc.device.type == "cpu":  # the "device" tensors are host tensors: compare, no sync
        for name, dev_t, host in (("query_start_loc", md.query_start_loc, qsl), ("seq_lens", md.seq_lens, seq)):
            if not np.array_equal(dev_t[: host.shape[0]].numpy(), host):
                fail(_FIELD + name, f"the same values as {name}_cpu {host.tolist()[:16]}",
                     dev_t[: host.shape[0]].tolist()[:16], "build both from the same numbers.")


def check_common_metadata(md: "CommonAttentionMetadata") -> StepChecks:
    """Check a ``CommonAttentionMetadata`` on the host (structure, then what its host mirrors
    say; the slot mapping and block table too where they are CPU tensors, against each cache
    the batch meets) and return its ``StepChecks``. Facts vattn's helpers computed for these
    very tensors (``md.host_checks``) are reused."""
    facts = md.host_checks
    if facts is not None and facts.describes(md):
        return facts
    _check_structure(md)
    b = md.num_reqs
    qsl = md.query_start_loc_cpu[: b + 1].numpy()
    seq = md.seq_lens_cpu[:b].numpy()
    _check_mirrors(md, qsl, seq)
    host_batch = None
    if md.slot_mapping.device.type == "cpu" and md.block_table_tensor.device.type == "cpu":
        host_batch = ((qsl, seq, md.block_table_tensor.numpy(), md.slot_mapping.numpy()),
                      dict(num_reqs=b, num_tokens=md.num_actual_tokens, num_slot_tokens=md.num_slot_tokens,
                           causal=md.causal))
    return StepChecks(
        refs=(md.query_start_loc_cpu, md.seq_lens_cpu, md.block_table_tensor, md.slot_mapping),
        device=md.query_start_loc.device, max_seq_len=int(seq.max()) if b else 0,
        table_width=md.block_table_tensor.shape[1], host_batch=host_batch,
    )


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


def check_layer_args(num_heads: Any, head_size: Any, scale: Any, num_kv_heads: Any, logits_soft_cap: Any,
                     sliding_window: Any, alibi_slopes: Any, where: str = "vattn.Attention") -> None:
    """The values ``vattn.Attention`` is constructed with: positive int head counts and sizes
    (``num_kv_heads`` dividing ``num_heads``), a finite positive ``scale``, a finite
    non-negative ``logits_soft_cap`` (0 or None: none), a positive int window (or None), one
    finite ALiBi slope per head. ``TypeError`` for a wrong type, ``ValueError`` for a wrong value."""
    for name, v in (("num_heads", num_heads), ("head_size", head_size), ("num_kv_heads", num_kv_heads)):
        if not _is_int(v):
            raise TypeError(f"{where}: {name}: expected a positive int, got {v!r} of type {type(v).__name__}; "
                            f"pass e.g. {name}={8 if name != 'head_size' else 128}.")
        if v <= 0:
            fail(f"{where}: {name}", "a positive int", v, "pass the model's value (from its config).")
    if num_heads % num_kv_heads:
        fail(f"{where}: num_kv_heads", f"a divisor of num_heads = {num_heads}", num_kv_heads,
             "choose num_kv_heads among the divisors of num_heads (1 for MQA, num_heads for MHA).")
    if isinstance(scale, torch.Tensor) and scale.numel() == 1 and scale.is_floating_point():
        scale = float(scale)  # a 0-dim tensor (construction time: no step pays for the read)
    if not _is_real(scale):
        raise TypeError(f"{where}: scale: expected a finite positive float (usually head_size ** -0.5), got "
                        f"{scale!r} of type {type(scale).__name__}; pass scale=head_size ** -0.5.")
    if not math.isfinite(scale) or scale <= 0:
        fail(f"{where}: scale", "a finite positive float (usually head_size ** -0.5)", scale,
             f"pass scale={head_size ** -0.5:.6g} (head_size ** -0.5) or the model's softmax scale.")
    if logits_soft_cap is not None:
        if not _is_real(logits_soft_cap):
            raise TypeError(f"{where}: logits_soft_cap: expected None or a finite float >= 0, got "
                            f"{logits_soft_cap!r}; pass the model's cap (e.g. 30.0) or None.")
        if not math.isfinite(logits_soft_cap) or logits_soft_cap < 0:
            fail(f"{where}: logits_soft_cap", "None (no cap), or a finite float >= 0 (scores become cap * "
                 "tanh(s / cap); 0 means none)", logits_soft_cap, "pass the model's cap (e.g. 30.0) or None.")
    if sliding_window is not None:
        if not _is_int(sliding_window):
            raise TypeError(f"{where}: per_layer_sliding_window: expected None or a positive int (tokens), got "
                            f"{sliding_window!r} of type {type(sliding_window).__name__}; pass an int or None.")
        if sliding_window <= 0:
            fail(f"{where}: per_layer_sliding_window (or CacheConfig.sliding_window)", "None (full attention) "
                 "or a positive number of tokens", sliding_window, "pass None for full attention.")
    if alibi_slopes is not None:
        try:
            slopes = [float(x) for x in alibi_slopes]
        except (TypeError, ValueError):
            raise TypeError(f"{where}: alibi_slopes: expected None or a sequence of {num_heads} floats, got "
                            f"{alibi_slopes!r}; pass one slope per query head.") from None
        if len(slopes) != num_heads or not all(map(math.isfinite, slopes)):
            fail(f"{where}: alibi_slopes", f"{num_heads} finite floats (one per query head)",
                 slopes[:8], "pass one finite slope per query head (e.g. from the model's ALiBi formula).")


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
                    use_logits_soft_cap: bool, use_alibi: bool, use_mask_mod: bool = False,
                    use_score_mod: bool = False) -> list[str]:
    """Every layer feature backend ``cls`` declares it does not serve (the default
    ``AttentionBackend.feature_reasons``)."""
    reasons = []
    if attn_type not in cls.supported_attn_types:
        reasons.append(f"attn_type {attn_type!r} not in {list(cls.supported_attn_types)}")
    for wanted, served, what in ((use_sliding_window, cls.supports_sliding_window, "sliding window"),
                                 (use_logits_soft_cap, cls.supports_logits_soft_cap, "logits soft cap"),
                                 (use_alibi, cls.supports_alibi, "ALiBi"),
                                 (use_mask_mod, cls.supports_mask_mod, "mask_mod"),
                                 (use_score_mod, cls.supports_score_mod, "score_mod")):
        if wanted and not served:
            reasons.append(f"{what} not supported")
    return reasons


def check_mods(mask_mod: Any, score_mod: Any, where: str = "vattn.Attention") -> None:
    """``mask_mod`` / ``score_mod``: None or a callable taking FlexAttention's 4 / 5 tensors."""
    for name, fn, n, names in (("mask_mod", mask_mod, 4, "b, h, q_idx, kv_idx"),
                               ("score_mod", score_mod, 5, "score, b, h, q_idx, kv_idx")):
        if fn is None:
            continue
        if not callable(fn):
            raise TypeError(f"{where}: {name}: expected None or a function ({names}) -> tensor, got {fn!r}; "
                            "see vattn.backends.flex_attention.mods.")
        try:
            inspect.signature(fn).bind(*range(n))
        except TypeError:
            fail(f"{where}: {name}", f"a function of {n} positional tensors ({names})", repr(fn),
                 "write it as FlexAttention defines it (vattn.backends.flex_attention.mods has examples).")
        except ValueError:  # no signature to inspect (a builtin): trust it
            continue
        _probe_mod(name, fn, n, where)


def _probe_mod(name: str, fn: Any, n: int, where: str) -> None:
    """Call ``fn`` once as FlexAttention will (0-d int32 indices; a 0-d float32 score first for a
    score_mod) and refuse what it cannot run: an exception, or a result that is not a 0-d tensor
    of the right kind (a bool tensor for a mask_mod, a floating one for a score_mod)."""
    idx = [torch.zeros((), dtype=torch.int32) for _ in range(4)]
    args = ([torch.zeros((), dtype=torch.float32)] if n == 5 else []) + idx
    want = "a bool tensor" if n == 4 else "a floating tensor (the new score)"
    try:
        out = fn(*args)
    except Exception as e:  # noqa: BLE001  (the user's code: any error is the answer)
        raise ValueError(f"{where}: {name} raised {type(e).__name__} ({e}) when called on 0-d int32 indices as "
                         "FlexAttention calls it; make it work on scalar tensors (index captured tensors by b / "
                         "q_idx / kv_idx; no Python control flow on tensor values).") from e
    if not isinstance(out, torch.Tensor):
        hint = " (a Python constant would attend to every key: return e.g. kv_idx <= q_idx)" if n == 4 else ""
        raise TypeError(f"{where}: {name}: expected it to return {want}, got {type(out).__name__} {out!r}{hint}.")
    ok = out.dtype == torch.bool if n == 4 else out.dtype.is_floating_point
    if not ok:
        raise TypeError(f"{where}: {name}: expected it to return {want}, got a {out.dtype} tensor; "
                        + ("compare positions (e.g. kv_idx <= q_idx) rather than returning numbers."
                           if n == 4 else "return the score as a float (e.g. score + bias), not a bool or int."))
    if out.dim() != 0:
        raise ValueError(f"{where}: {name}: expected a 0-d result for 0-d indices (one value per query/key pair), "
                         f"got shape {tuple(out.shape)}; do not stack or broadcast over captured tensors.")


def triton_availability(name: str) -> tuple[bool, str]:
    """``is_available`` of a backend built on vattn's Triton kernels: Triton installed, and a
    CUDA GPU or ``TRITON_INTERPRET=1`` (the CPU interpreter, for tests)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False, "triton is not installed; pip install 'vattn[triton]' (triton>=3.6)"
    if torch.cuda.is_available() or envs.TRITON_INTERPRET:
        return True, ""
    return False, (f"{name} needs a CUDA GPU, or TRITON_INTERPRET=1 to run its kernels on CPU through the "
                   "Triton interpreter (slow; for tests)")


def e4m3_cache_reasons(kv_cache_dtype: str | None) -> list[str]:
    """Why an e4m3 cache (``fp8`` / ``fp8_e4m3``) cannot be written on this GPU: vattn's Triton
    KV store needs compute capability 8.9 for e4m3 (empty elsewhere, and on CPU)."""
    if kv_cache_dtype not in ("fp8", "fp8_e4m3") or not torch.cuda.is_available():
        return []
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) >= (8, 9):
        return []
    return [f"kv_cache_dtype {kv_cache_dtype!r} needs compute capability 8.9 (Triton's e4m3), this GPU has "
            f"{major}.{minor}; use 'fp8_e5m2'"]


def validate_kv_sharing_target(layer_name: str, target: str, context: dict[str, Any]) -> None:
    """KV sharing: the target exists, was built earlier, and has the same attention type."""
    if target == layer_name or target not in context:
        raise ValueError(
            f"kv_sharing_target_layer_name={target!r} for layer {layer_name!r}: expected the prefix "
            f"of an attention layer built before this one (known: {list(context)[:8]}); build the "
            "target layer first and pass its exact prefix."
        )

"""Construction-time checks: what a layer and a backend configuration must satisfy (no device sync).

Each failure raises ``ValueError`` (``TypeError`` for a wrong type) naming the argument, what
was expected, what arrived, and what to do. Where validation lives, level by level:

| level | what is checked | where | when | cost |
| --- | --- | --- | --- | --- |
| layer | head counts, scale, soft cap, window, ALiBi slopes, KV sharing target, FlexAttention mods | here (``check_layer_args``, ``check_mods``, ``validate_kv_sharing_target``) | ``vattn.Attention(...)`` | once per layer |
| backend | dtype, cache dtype, head and block size, features, GPU generation, library | ``AttentionBackend.validate_configuration`` / ``feature_reasons`` (from ``Capabilities``) | selection | once per configuration (cached) |
| impl | attention type, cache dtype, ALiBi and sinks per head, KV heads | ``AttentionImpl.__init__`` (+ the impl's own) | construction | once per layer |
| batch | fields, host mirrors | ``vattn.core.metadata`` | ``CommonAttentionMetadata(...)`` | host, O(B) once per batch |
| batch x cache | slot mapping, block table, sequence lengths against the cache | ``vattn.core.batch_checks.StepChecks`` | ``PagedKVCache.build_metadata`` | once per step per cache geometry |
| call | metadata kind, token counts, the bound cache, output_scale | ``vattn.ops.attention.check_call`` / ``run_layer`` | every op call | host, a few attribute reads |
| device | contents of device tensors of hand-built metadata | ``vattn.core.debug_checks`` | ``VATTN_DEBUG_CHECKS=1`` | device syncs: debugging only |
"""

from __future__ import annotations

import importlib
import inspect
import math
from typing import Any

import numpy as np
import torch

from vattn import envs
from vattn.core.batch_checks import fail


__all__ = ["check_layer_args", "check_mods", "e4m3_cache_reasons", "library_availability",
           "fail", "triton_availability"]

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


def library_availability(name: str, module: str, install: str) -> tuple[bool, str]:
    """``(ok, reason)`` of backend ``name`` whose kernels come from ``module`` on a CUDA GPU
    (imported here: a broken install fails now, with its error, not at the first step)."""
    if not torch.cuda.is_available():
        return False, f"{name} needs a CUDA GPU and none is visible"
    try:
        importlib.import_module(module)
    except Exception as e:  # ImportError, or a broken CUDA/JIT setup raising at import
        return False, f"{module} is not importable ({type(e).__name__}: {e}); {install}"
    return True, ""


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

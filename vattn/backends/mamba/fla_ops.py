"""GDN prefills through fla's chunked gated-delta-rule kernels (fla-core, pure Triton), where installed.

``chunk_gated_delta_rule`` computes a whole prompt in chunks of 64 tokens (matrix products per
chunk) instead of one token after another: the CUDA path of ``GDN_ATTN`` hands it the batch's
prefill requests and keeps its own recurrent kernel for decodes. fla takes the varlen batch as
``cu_seqlens`` (its host copy too, so it plans without a sync), initial states (N, HV, Dk, Dv)
in vattn's layout, and key heads shared by value heads (HV a multiple of HK), as vattn's do.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

__all__ = ["chunked_prefill", "fla_chunk_fn"]


@functools.cache
def fla_chunk_fn() -> Callable[..., Any] | None:
    """fla's ``chunk_gated_delta_rule``, or None where fla-core is not installed."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # noqa: BLE001  (missing, or an install that cannot import here)
        return None
    return chunk_gated_delta_rule


def chunked_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    scale: float, use_qk_l2norm: bool, state: torch.Tensor, query_start_loc: torch.Tensor,
                    query_start_loc_cpu: torch.Tensor, state_indices: torch.Tensor, has_initial_state: torch.Tensor,
                    first: int, last: int, out: torch.Tensor) -> None:
    """The gated delta rule for requests ``first .. last-1`` (whose tokens are contiguous) with fla.

    Same tensors as ``triton_ops.gated_delta_rule`` (q, k (T, HK, Dk), v (T, HV, Dv), g, beta (T, HV),
    state (S, HV, Dk, Dv), slots already mapped into the state), plus the host mirror of
    ``query_start_loc``. Reads the requests' slots (zeros where ``has_initial_state`` is False)
    and writes their final states back."""
    fn = fla_chunk_fn()
    assert fn is not None, "chunked_prefill needs fla-core"
    t0, t1 = int(query_start_loc_cpu[first]), int(query_start_loc_cpu[last])
    cu = (query_start_loc[first:last + 1] - query_start_loc[first]).long()
    cu_cpu = (query_start_loc_cpu[first:last + 1] - t0).long()
    slots = state_indices[first:last].long()
    h0 = state[slots]  # selected, not multiplied: a fresh slot may hold anything (0 * nan is nan)
    h0 = torch.where(has_initial_state[first:last].view(-1, 1, 1, 1), h0, torch.zeros_like(h0))
    q, k, v = (x[t0:t1].contiguous()[None] for x in (q, k, v))  # fla reads [1, T, H, D] contiguous
    o, ht = fn(q, k, v, g[None, t0:t1].float(), beta[None, t0:t1].to(q.dtype),
               scale=scale, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm,
               cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
    out[t0:t1] = o[0].to(out.dtype)
    state[slots] = ht.to(state.dtype)

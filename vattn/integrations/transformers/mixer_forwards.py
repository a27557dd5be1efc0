"""The forwards of transformers' mixer modules around vattn's mixer layers (``mixers.py``).

Each ``<kind>(module, x)`` maps the step's tokens ``x`` (T, hidden) to (T, hidden) as the
module's own forward does: the same projections, splits, norms and gates with the module's
weights (transformers' code restated for flattened tokens); only the stateful core (causal conv,
scan, delta rule, linear attention) runs in ``module.mixer``, which reads each request's rows
and state slot from the step's metadata. What enters the layer, per kind:

| kind | into the vattn layer | left in the model |
| --- | --- | --- |
| gdn | q/k/v (conv input), conv weight, ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)`` (x2: OLMo) | in-projections, gated RMSNorm with z, out_proj |
| mamba2 | xBC, conv weight / bias, raw dt, ``A = -exp(A_log)``, D, dt_bias (softplus, dt_limit in the layer) | in_proj (Falcon-H1's multipliers), gated RMSNorm (or silu gate), out_proj |
| mamba1 | x (conv), then u, ``dt_proj.weight @ dt``, ``A = -exp(A_log)``, B, C, D, z, ``dt_proj.bias`` | in_proj, x_proj, dt/B/C norms (Falcon-Mamba, Jamba), out_proj |
| short_conv | ``B * x``, conv weight / bias (no activation) | in_proj, ``C * y``, out_proj |
| linear_attention | ``act(qkv_proj(x))`` split per head, ``slope_rate`` | RMSNorm, ``sigmoid(output_gate(x))``, out_proj |

``run`` is the module forward's frame: one flattened step (batch 1) inside
``vattn.set_forward_context``, or, during a wrapped model's ``generate()``, a padded batch whose
real tokens it gathers (``generate.py``'s cache builds the step's metadata).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import vattn
from vattn.forward_context import is_forward_context_available

__all__ = ["gdn", "lightning", "mamba1", "mamba2", "run", "short_conv"]

_USE = ("Generate with the model's generate() (wrap installs one that runs on vattn's cache), or run steps: call "
        "the VattnCausalLM as model(input_ids, positions) inside vattn.set_forward_context(kv.build_metadata(common), "
        "cfg), with state_indices= in kv.common_metadata.")


def run(module: nn.Module, core: Callable[[nn.Module, torch.Tensor], torch.Tensor], hidden_states: torch.Tensor,
        mask: torch.Tensor | None, cache: Any) -> torch.Tensor:
    """(B, q, hidden) -> (B, q, hidden): ``core`` over the real tokens of the step."""
    b, q = hidden_states.shape[0], hidden_states.shape[1]
    if cache is None:  # a VattnCausalLM step: batch 1, every token real
        if not torch.compiler.is_compiling():
            if b != 1:
                raise ValueError(f"{module._get_name()}: a wrapped model runs one flattened step (batch 1), got "
                                 f"hidden states {tuple(hidden_states.shape)}. {_USE}")
            if not is_forward_context_available():
                raise RuntimeError(f"{module._get_name()}: the model's mixer state lives on vattn, which reads each "
                                   "step's batch from vattn.set_forward_context; it was called without one (a plain "
                                   f"forward of the transformers model). {_USE}")
        return core(module, hidden_states.reshape(b * q, -1)).view(b, q, -1)
    from vattn.integrations.transformers.generate import generation_step

    md, rows, config = generation_step(cache, module, b, q, mask, hidden_states.device)
    flat = hidden_states.reshape(b * q, -1)
    with vattn.set_forward_context(md, config):
        if rows is None:  # every token real, in batch order
            return core(module, flat).view(b, q, -1)
        out = core(module, flat[rows])
    full = out.new_zeros(b * q, out.shape[-1])
    full[rows] = out
    return full.view(b, q, -1)


def gdn(m: Any, x: torch.Tensor) -> torch.Tensor:
    """Gated DeltaNet (``modeling_qwen3_next.Qwen3NextGatedDeltaNet.forward``; Qwen3.5 and OLMo-Hybrid
    project q/k/v/z/b/a apart, OLMo-Hybrid optionally doubles beta)."""
    t = x.shape[0]
    if hasattr(m, "in_proj_qkvz"):  # Qwen3-Next: q, k, v, z interleaved per key head
        q, k, v, z, b, a = m.fix_query_key_value_ordering(m.in_proj_qkvz(x)[None], m.in_proj_ba(x)[None])
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        z, b, a = z[0], b[0], a[0]
    elif hasattr(m, "in_proj_qkv"):  # Qwen3.5: one projection each
        mixed, z, b, a = m.in_proj_qkv(x), m.in_proj_z(x), m.in_proj_b(x), m.in_proj_a(x)
    else:  # OLMo-Hybrid: q, k, v, a, b and the output gate g projected apart
        mixed = torch.cat([m.q_proj(x), m.k_proj(x), m.v_proj(x)], dim=-1)
        z, b, a = m.g_proj(x), m.b_proj(x), m.a_proj(x)
    g = -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias)  # (T, HV) float32, the log decay
    beta = b.sigmoid() * 2.0 if getattr(m, "allow_neg_eigval", False) else b.sigmoid()  # OLMo-Hybrid: [0, 2]
    o = m.mixer(mixed, m.conv1d.weight, m.conv1d.bias, g, beta)  # (T, HV, Dv)
    dv = m.head_v_dim
    norm, out = (m.o_norm, m.o_proj) if hasattr(m, "o_norm") else (m.norm, m.out_proj)
    return out(norm(o.reshape(-1, dv), z.reshape(-1, dv)).reshape(t, -1))


def mamba2(m: Any, x: torch.Tensor) -> torch.Tensor:
    """Mamba-2's mixer (``modeling_mamba2.Mamba2Mixer.forward``; Bamba, Granite-4 and Nemotron-H
    have the same, Falcon-H1 adds its multipliers and an optional norm)."""
    dtype = x.dtype
    if hasattr(m, "ssm_in_multiplier"):  # Falcon-H1
        x = x * m.ssm_in_multiplier
    proj = m.in_proj(x)
    if hasattr(m, "mup_vector"):
        proj = proj * m.mup_vector.reshape(-1)
    gate, xbc, dt = proj.split([m.intermediate_size, m.conv_dim, m.num_heads], dim=-1)
    y = m.mixer(xbc, m.conv1d.weight, m.conv1d.bias, dt, -torch.exp(m.A_log.float()), m.D, m.dt_bias)
    y = y.reshape(x.shape[0], -1)
    y = m.norm(y, gate) if getattr(m, "mamba_rms_norm", True) else y * F.silu(gate)
    return m.out_proj(y.to(dtype))


def mamba1(m: Any, x: torch.Tensor) -> torch.Tensor:
    """Mamba's mixer (``modeling_mamba.MambaMixer.forward``; Falcon-Mamba and Jamba normalise dt, B, C)."""
    dtype = x.dtype
    xs, gate = m.in_proj(x).chunk(2, dim=-1)
    u = m.mixer.conv(xs, m.conv1d.weight, m.conv1d.bias)  # silu(conv(x)), (T, I)
    ts, b, c = m.x_proj(u).split([m.time_step_rank, m.ssm_state_size, m.ssm_state_size], dim=-1)
    if hasattr(m, "dt_layernorm"):
        ts, b, c = m.dt_layernorm(ts), m.b_layernorm(b), m.c_layernorm(c)
    bias = m.dt_proj.bias
    y = m.mixer.scan(u, F.linear(ts, m.dt_proj.weight), -torch.exp(m.A_log.float()), b, c, m.D.float(), gate,
                     None if bias is None else bias.float())
    return m.out_proj(y.to(dtype))


def short_conv(m: Any, x: torch.Tensor) -> torch.Tensor:
    """LFM2's gated short convolution (``modeling_lfm2.Lfm2ShortConv.forward``): ``out(C * conv(B * x))``."""
    b, c, xx = m.in_proj(x).chunk(3, dim=-1)
    return m.out_proj(c * m.mixer(b * xx, m.conv.weight, m.conv.bias))


def lightning(m: Any, x: torch.Tensor) -> torch.Tensor:
    """MiniMax's lightning attention (``modeling_minimax.MiniMaxLightningAttention.forward``)."""
    t, h, d = x.shape[0], m.num_attention_heads, m.head_dim
    q, k, v = m.act_fn(m.qkv_proj(x)).view(t, h, 3 * d).split(d, dim=-1)
    o = m.mixer(q, k, v, m.slope_rate.reshape(h))  # (T, H, D)
    return m.out_proj(torch.sigmoid(m.output_gate(x)) * m.norm(o.reshape(t, h * d)))

"""What every mixer (Mamba-family) backend shares: the state spec, the per-step metadata and its
builder, and the backend and impl base classes.

A mixer layer keeps a fixed-size state per request instead of K/V per token: each running
request owns a *state slot* (``CommonAttentionMetadata.state_indices``), and every state tensor
of a layer has ``num_state_slots + 1`` rows, the last one a scratch slot that padded requests
(index -1) read and write. A request whose ``num_computed_tokens`` is 0 starts from a zero state
whatever its slot holds, so a new or preempted request needs no explicit reset.

The kernels behind every backend share one varlen contract (``vattn.backends.mamba.torch_ops``
on the CPU, ``vattn.backends.mamba.triton_ops`` on CUDA): tokens flattened by
``query_start_loc``, one state slot and one ``has_initial_state`` flag per request.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from vattn.core.enums import AttentionCGSupport
from vattn.core.interface import AttentionMetadataBuilder
from vattn.core.mamba import MambaBackend, MambaMetadata
from vattn.core.metadata import CommonAttentionMetadata
from vattn.core.batch_checks import fail

if TYPE_CHECKING:
    from vattn.core.config import VattnConfig
    from vattn.mixers.base import MambaBase

__all__ = ["CommonMambaBackend", "MambaImpl", "MambaMetadataBuilder", "kernels_for"]


class MambaMetadataBuilder(AttentionMetadataBuilder[MambaMetadata]):
    """``CommonAttentionMetadata`` -> ``MambaMetadata``: device ops only (no host sync, no copy).

    Uniform single-token decode batches up to the largest capture size write into persistent
    buffers, so they replay from FULL CUDA graphs; other batches run eagerly or piecewise."""

    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vattn_config: "VattnConfig",
                 device: torch.device, num_state_slots: int = 0) -> None:
        super().__init__(kv_cache_spec, layer_names, vattn_config, device)
        self.num_state_slots = num_state_slots
        n = max(vattn_config.compilation.capture_sizes(), default=0)
        self._arange = torch.arange(n + 1, dtype=torch.int32, device=self.device)
        self._slots = torch.zeros(n, dtype=torch.int32, device=self.device)
        self._initial = torch.zeros(n, dtype=torch.bool, device=self.device)
        self._scratch = torch.tensor(num_state_slots, dtype=torch.int32, device=self.device)  # padding's slot

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> MambaMetadata:
        cm = common_attn_metadata
        b, t = cm.num_reqs, cm.num_actual_tokens
        if cm.state_indices is None:
            fail("CommonAttentionMetadata.state_indices", f"one state slot per request for the mixer layers "
                 f"{self.layer_names[:2]}...", None, "pass state_indices= to kv.common_metadata / "
                 "build_common_attn_metadata (InputBatch.prepare passes its rows)")
        qsl_cpu = cm.query_start_loc_cpu[: b + 1]
        initial_cpu = cm.num_computed_tokens_cpu[:b] > 0
        decode = cm.max_query_len <= 1
        if decode:
            nd = b
        else:
            qlens = (qsl_cpu[1:] - qsl_cpu[:-1]).numpy()
            nd = int(np.argmax(qlens > 1)) if b else 0
        qsl, seq, raw = cm.query_start_loc[: b + 1], cm.seq_lens[:b], cm.state_indices[:b]
        if decode and int(qsl_cpu[b]) == b and b <= self._slots.shape[0]:  # one token each, padding included
            # Persistent buffers (a FULL graph reads these addresses): uniform decode only.
            qsl, slots, initial = self._arange[: b + 1], self._slots[:b], self._initial[:b]
            torch.gt(seq, 1, out=initial)
        else:
            slots = torch.empty(b, dtype=torch.int32, device=raw.device)
            initial = (seq - (qsl[1:] - qsl[:-1])) > 0
        torch.where(raw < 0, self._scratch, raw, out=slots)
        return MambaMetadata(
            num_reqs=b, num_actual_tokens=t, num_decodes=nd, num_decode_tokens=nd if decode else int(qsl_cpu[nd]),
            num_prefills=b - nd, max_query_len=cm.max_query_len, query_start_loc=qsl, query_start_loc_cpu=qsl_cpu,
            state_indices=slots, has_initial_state=initial, has_initial_state_cpu=initial_cpu)


def kernels_for(device: torch.device) -> ModuleType:
    """The varlen state kernels for ``device``: Triton on CUDA, torch elsewhere."""
    if device.type == "cuda":
        from vattn.backends.mamba import triton_ops

        return triton_ops
    from vattn.backends.mamba import torch_ops

    return torch_ops


class MambaImpl:
    """Runs one mixer layer's step: ``forward(layer, inputs, output, state, metadata, part)``.

    ``inputs`` are the layer's per-token tensors and weights in the order its ``forward``
    documents; ``state`` the layer's state tensors (slots on dim 0); ``part`` selects the
    entry of layers with two (Mamba1: 0 = conv, 1 = scan)."""

    def __init__(self, layer: "MambaBase") -> None:
        self.layer_name = layer.layer_name

    def forward(self, layer: "MambaBase", inputs: list[torch.Tensor | None], output: torch.Tensor,
                state: tuple[torch.Tensor, ...], md: MambaMetadata, part: int = 0) -> None:
        raise NotImplementedError

    @staticmethod
    def common_args(md: MambaMetadata) -> tuple[Any, ...]:
        """The kernels' trailing batch arguments."""
        return md.query_start_loc, md.state_indices, md.has_initial_state, md.num_reqs

    @staticmethod
    def conv_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                  md: MambaMetadata) -> torch.Tensor:
        """The causal conv (silu) over each request's rows of ``x`` (T, C), continuing from and
        updating ``conv_state``: (T, C), as the layers' q/k/v or xBC before their split."""
        out = torch.empty_like(x)
        kernels_for(x.device).causal_conv1d(x, weight, bias, conv_state, *MambaImpl.common_args(md), "silu", out)
        return out


class CommonMambaBackend(MambaBackend):
    """A mixer backend on the shared metadata builder (every vattn mixer backend)."""

    builder_cls: ClassVar[type[MambaMetadataBuilder]] = MambaMetadataBuilder

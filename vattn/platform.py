"""The device vattn runs on, and which attention backends to try there, in what order.

``current_platform`` is decided on first use (``torch.cuda.is_available()``), not at import.

Backend priority (the selector tries these in order and takes the first whose
``validate_configuration`` finds no reason to refuse; a forced backend skips this table):

| platform | model | order |
| --- | --- | --- |
| cuda, sm_90 (Hopper) | standard attention, fp16/bf16 | TRITON_ATTN, FLASHINFER, FLASH_ATTN, TORCH_SDPA (by measurement: see ``CudaPlatform.hopper_priority``) |
| cuda, other | standard attention, fp16/bf16 | FLASH_ATTN (flash-attn-4 / FA3 / FA2), FLASHINFER, TRITON_ATTN, TORCH_SDPA |
| cuda | float32 | TORCH_SDPA, TRITON_ATTN (the libraries serve only fp16/bf16) |
| cuda | MLA (``use_mla``) | FLASHINFER_MLA, FLASH_ATTN_MLA, TRITON_MLA (sm_90: ``hopper_mla_priority``) |
| cpu | standard attention | CPU_ATTN (TORCH_SDPA's features; decodes read the paged cache in place), TORCH_SDPA |
| cpu | MLA | TRITON_MLA (under ``TRITON_INTERPRET=1`` only; otherwise it states why not) |

Why this order on CUDA: FlashAttention and FlashInfer are the fastest tuned kernels where
installed (each reports itself unavailable otherwise); vattn's Triton kernels need only
Triton; SDPA is the always-works reference. On Hopper the measured order differs (Triton
first, for decode; the numbers are in benchmarks/README.md). MLA: FlashInfer's and
FlashAttention's MLA kernels first, vattn's Triton MLA last (it also serves fp32 and fp8
latent caches); FLASHMLA, FLASHMLA_SPARSE and CUTLASS_MLA need kernel libraries vattn does not
ship: they stay in the registry and say why when forced, but are on no priority list; ``hopper_mla_priority`` is the order
``benchmarks/bench_mla.py`` measures on sm_90. On CPU, CPU_ATTN (TORCH_SDPA with decodes read in place) is the default;
TRITON_ATTN runs there only under ``TRITON_INTERPRET=1`` and only when forced
(``VATTN_ATTENTION_BACKEND=TRITON_ATTN`` or ``vattn.global_force_attn_backend``); no MLA
backend runs on CPU except TRITON_MLA under the interpreter (tests).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from vattn.core.registry import AttentionBackendEnum

__all__ = [
    "CpuPlatform",
    "CudaPlatform",
    "DeviceCapability",
    "Platform",
    "current_platform",
]

_B = AttentionBackendEnum


class DeviceCapability(NamedTuple):
    """CUDA compute capability, e.g. ``(9, 0)`` for Hopper (sm_90)."""

    major: int
    minor: int

    def to_int(self) -> int:
        """``90`` for ``(9, 0)``."""
        return self.major * 10 + self.minor

    def as_version_str(self) -> str:
        return f"{self.major}.{self.minor}"


class Platform:
    """Base platform: a device kind and its backend priority table.

    Subclasses fill ``device_type`` and the two priority tuples.
    """

    device_type: str = "cpu"
    #: Backends to try for standard (MHA / GQA / MQA) attention, best first.
    attention_priority: tuple[AttentionBackendEnum, ...] = ()
    #: Backends to try for MLA models, best first.
    mla_priority: tuple[AttentionBackendEnum, ...] = ()

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    @property
    def device_name(self) -> str:
        return self.device_type

    def is_cuda(self) -> bool:
        return self.device_type == "cuda"

    def is_cpu(self) -> bool:
        return self.device_type == "cpu"

    def opaque_attention_op(self) -> bool:
        """Whether ``vattn.Attention`` calls the backend through the opaque custom op.

        The opaque op is the graph split point for ``vattn.compile`` and hides the
        metadata from Dynamo; a platform may return ``False`` to call the impl directly.
        """
        return True

    def get_device_capability(self, device_id: int = 0) -> DeviceCapability | None:
        """The compute capability of ``device_id``, or ``None`` where it has no meaning (CPU)."""
        return None

    def get_attn_backend_priority(self, head_size: int, dtype: torch.dtype, kv_cache_dtype: str | None,
                                  block_size: int, use_mla: bool = False, has_sink: bool = False,
                                  use_sparse: bool = False) -> list[AttentionBackendEnum]:
        """The backends to try, best first (see the module docstring's table).

        The configuration arguments are accepted so a platform can reorder by them; the
        default table depends only on ``use_mla``. Whether a backend can actually serve
        the configuration is each backend's ``validate_configuration``.
        """
        return list(self.mla_priority if use_mla else self.attention_priority)


class CudaPlatform(Platform):
    """NVIDIA GPUs."""

    device_type = "cuda"
    attention_priority = (_B.FLASH_ATTN, _B.FLASHINFER, _B.TRITON_ATTN, _B.TORCH_SDPA)
    mla_priority = (_B.FLASHINFER_MLA, _B.FLASH_ATTN_MLA, _B.TRITON_MLA)

    #: Hopper (sm_90). Decode dominates generation, and there vattn's Triton kernel keeps pace
    #: with FlashInfer's on the bare kernel and is faster in a compiled full-graph decode step: it
    #: has no per-step plan, so it spends a fraction of FlashInfer's host time per step, and its
    #: fused fp8 step is faster too. flash-attn-4 has no split-KV on sm_90, so a decode of few
    #: long requests is far slower, though its prefill is the fastest; it stays behind FlashInfer.
    #: The measurements behind this order: benchmarks/README.md (from benchmarks/results/*.json).
    hopper_priority = (_B.TRITON_ATTN, _B.FLASHINFER, _B.FLASH_ATTN, _B.TORCH_SDPA)
    #: MLA on Hopper (sm_90), in the order ``benchmarks/bench_mla.py``'s decode and prefill results
    #: give (benchmarks/README.md): FLASHINFER_MLA before TRITON_MLA. Backends vattn cannot serve
    #: (FLASHMLA, FLASHMLA_SPARSE, CUTLASS_MLA) stay in the registry with their reasons, off the lists.
    hopper_mla_priority = (_B.FLASHINFER_MLA, _B.FLASH_ATTN_MLA, _B.TRITON_MLA)
    #: float32 models: the reference backend (exact float32 math, runs on CPU tensors too).
    float32_priority = (_B.TORCH_SDPA, _B.TRITON_ATTN)

    def get_attn_backend_priority(self, head_size: int, dtype: torch.dtype, kv_cache_dtype: str | None,
                                  block_size: int, use_mla: bool = False, has_sink: bool = False,
                                  use_sparse: bool = False) -> list[AttentionBackendEnum]:
        """CUDA order: float32 -> SDPA first; Hopper -> ``hopper_priority`` (MLA: ``hopper_mla_priority``);
        else the class table."""
        cap = self.get_device_capability()
        if use_mla:
            return list(self.hopper_mla_priority if cap is not None and cap.major == 9 else self.mla_priority)
        if dtype == torch.float32:
            return list(self.float32_priority)
        if cap is not None and cap.major == 9:
            return list(self.hopper_priority)
        return list(self.attention_priority)

    @property
    def device_name(self) -> str:
        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
        return "cuda"

    def get_device_capability(self, device_id: int = 0) -> DeviceCapability | None:
        if not torch.cuda.is_available():
            return None
        major, minor = torch.cuda.get_device_capability(device_id)
        return DeviceCapability(major, minor)


class CpuPlatform(Platform):
    """Host CPU (the development and CI machines)."""

    device_type = "cpu"
    attention_priority = (_B.CPU_ATTN, _B.TORCH_SDPA)
    mla_priority = (_B.TRITON_MLA,)


@functools.lru_cache(maxsize=1)
def _detect_platform() -> Platform:
    return CudaPlatform() if torch.cuda.is_available() else CpuPlatform()


class _LazyPlatform:
    """Forwards attribute access to the platform detected on first use."""

    def __getattr__(self, name: str):
        return getattr(_detect_platform(), name)

    def __repr__(self) -> str:
        return f"current_platform<{_detect_platform()!r}>"


#: The platform vattn is running on (``CudaPlatform`` when a CUDA device is visible, else ``CpuPlatform``).
current_platform: Platform = _LazyPlatform()  # type: ignore[assignment]

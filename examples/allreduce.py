"""``torch.ops.vattn_examples.all_reduce``: the tensor-parallel sum, its algorithm chosen by size.

A decoder step under tensor parallelism sums ``2 * layers + 1`` activations of (T, hidden) over
the ranks. For a decode step these messages are small (8 KiB for one bf16 token of hidden 4096)
and the all-reduce is latency-bound; for a prefill chunk they are megabytes and bandwidth-bound.
No single algorithm serves both, so, as vLLM's custom all-reduce does, one opaque op picks per
call by message size:

| algorithm | what it does | good for |
| --- | --- | --- |
| ``one_shot`` | ``symm_mem.one_shot_all_reduce_copy``: copy into this rank's symmetric buffer, one barrier, every rank reads every peer's whole buffer (P2P loads over NVLink) | small messages: one kernel, no ring |
| ``two_shot`` | ``symm_mem.two_shot_all_reduce_``: each rank reduces 1/n of the buffer from its peers, then gathers the others' parts | medium messages: 1/n of the reads of one-shot per rank |
| ``nccl`` | c10d's functional ``all_reduce`` (NCCL on GPUs, gloo on the CPU) | large messages, and everywhere symmetric memory is missing |

The op is opaque to Dynamo and Inductor (one node in the graph, like vattn's attention op), so the
choice is made when it runs: eagerly per call, and once per captured size when a CUDA graph
captures it. Without ``AllReduce.enable_symm_mem`` (the CPU, no peer access, an old torch) every
call is ``nccl``. NVLink multicast (``multimem_*``) is never used.

The size thresholds (``AllReducePolicy``) default to the crossovers
``benchmarks/bench_allreduce.py`` measured on H100 NVLink machines (its JSON is in
benchmarks/results/); measure and pass your own for other links.

``torch.ops.vattn_examples.all_reduce_add_rms_norm`` is the all-reduce a decoder layer ends with,
fused with what follows it: ``s = sum_ranks(x) + residual``, then ``rms_norm(s)``, in one
kernel. With ``enable_fused_norm`` it runs FlashInfer's TensorRT-LLM all-reduce fusion
(``flashinfer.comm``, pattern ``kARResidualRMSNorm``): for decode-sized messages each rank
writes its partial sums straight into every peer's buffer and polls its own (Lamport flags, no
barrier round trip), and the add and the norm happen on the reduced row in registers. Its
buffers are PyTorch symmetric memory (no multicast). Messages larger than the workspace, and
groups without it, take ``all_reduce`` above followed by the add and the norm in PyTorch.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.library import Library, infer_schema

__all__ = ["AllReducePolicy", "DEFAULT_POLICY", "FusedNormAllReduce", "SymmetricMemoryAllReduce", "all_reduce",
           "all_reduce_add_rms_norm", "disable_fused_norm", "disable_symm_mem", "enable_fused_norm", "enable_symm_mem",
           "fused_norm_all_reduce", "rms_norm", "symm_mem_all_reduce"]

logger = logging.getLogger("vattn.examples.allreduce")

Algorithm = Literal["one_shot", "two_shot", "nccl"]
_KIB, _MIB = 1 << 10, 1 << 20


@dataclass(frozen=True)
class AllReducePolicy:
    """Which algorithm serves a message of ``nbytes``: one-shot up to ``one_shot_max_bytes``,
    two-shot up to ``two_shot_max_bytes``, NCCL above (and wherever symmetric memory is off)."""

    one_shot_max_bytes: int
    two_shot_max_bytes: int

    def choose(self, nbytes: int) -> Algorithm:
        if nbytes <= self.one_shot_max_bytes:
            return "one_shot"
        return "two_shot" if nbytes <= self.two_shot_max_bytes else "nccl"


#: One-shot up to 128 KiB, two-shot up to 8 MiB, NCCL above: the crossovers ``bench_allreduce.py``
#: measured on H100 NVLink, the same for 2 and 4 ranks (the three meet near 16 MiB).
DEFAULT_POLICY = AllReducePolicy(one_shot_max_bytes=128 * _KIB, two_shot_max_bytes=8 * _MIB)


@dataclass(frozen=True)
class SymmetricMemoryAllReduce:
    """One group's symmetric buffer (uint8, the same size on every rank) and its size policy."""

    buffer: torch.Tensor
    policy: AllReducePolicy

    def choose(self, x: torch.Tensor) -> Algorithm:
        nbytes = x.numel() * x.element_size()
        if nbytes > self.buffer.numel() or nbytes % 16 or x.device != self.buffer.device:
            return "nccl"  # larger than the buffer, or not 16-byte granular (the kernels' vector width)
        if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return "nccl"
        return self.policy.choose(nbytes)

    def staged(self, x: torch.Tensor) -> torch.Tensor:
        """The buffer's first ``x.nbytes`` viewed as ``x``'s dtype and shape."""
        return self.buffer[: x.numel() * x.element_size()].view(x.dtype).view(x.shape)


_COMMS: dict[str, SymmetricMemoryAllReduce] = {}
_FUSED: dict[str, "FusedNormAllReduce"] = {}
_RETIRED: list[Any] = []


def symm_mem_all_reduce(group_name: str) -> SymmetricMemoryAllReduce | None:
    """The symmetric-memory state of ``group_name`` (None where it is off)."""
    return _COMMS.get(group_name)


def enable_symm_mem(group: dist.ProcessGroup, max_bytes: int, device: torch.device,
                    policy: AllReducePolicy | None = None) -> bool:
    """Give ``group`` a symmetric buffer of ``max_bytes`` for the one- and two-shot all-reduces.

    A collective: every rank of ``group`` calls it with the same ``max_bytes``. Returns False
    (every all-reduce stays NCCL) where CUDA peer access, the symmetric-memory ops or their
    backend are missing; the reason is logged.
    """
    name, world = group.group_name, dist.get_world_size(group)
    if world == 1 or torch.device(device).type != "cuda":
        return False
    try:
        import torch.distributed._symmetric_memory as symm_mem

        for op in ("one_shot_all_reduce_copy", "two_shot_all_reduce_"):
            if not hasattr(torch.ops.symm_mem, op):
                raise RuntimeError(f"torch.ops.symm_mem.{op} is missing in torch {torch.__version__}")
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # needed on older torch, deprecated (a no-op) on newer
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable(name)
        buf = symm_mem.empty(-(-max_bytes // 16) * 16, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(buf, name)
    except Exception as e:  # no P2P, no NVSHMEM/CUDA backend, old torch: keep NCCL
        logger.warning("symmetric-memory all-reduce unavailable (%s: %s); using NCCL", type(e).__name__, e)
        return False
    _COMMS[name] = SymmetricMemoryAllReduce(buf, policy or DEFAULT_POLICY)
    return True


def disable_symm_mem(group_name: str | None = None) -> None:
    """Every later all-reduce of ``group_name`` is NCCL. Its buffer stays allocated until every
    group's is dropped (``group_name=None``, before the process group goes, which drops the fused
    all-reduces' workspaces too): a peer may still read it from a graph this rank has not yet
    replayed."""
    if group_name is None:
        for state in [*_FUSED.values(), *_RETIRED]:
            if isinstance(state, FusedNormAllReduce):
                state.release()
        _COMMS.clear()
        _FUSED.clear()
        _RETIRED.clear()
    elif group_name in _COMMS:
        _RETIRED.append(_COMMS.pop(group_name))


def all_reduce(x: torch.Tensor, group_name: str, algorithm: str = "auto") -> torch.Tensor:
    """Sum of ``x`` over the ranks of ``group_name``, as a new tensor of ``x``'s shape and dtype.

    ``algorithm``: ``auto`` (by size, see the module docstring; FlashInfer's kernel for messages
    that fit the group's fused workspace, ``enable_fused_norm``), or ``one_shot`` / ``two_shot`` /
    ``nccl`` to force one (the symmetric ones need ``enable_symm_mem`` and fall back to NCCL
    where the message does not fit the buffer).
    """
    if algorithm not in ("auto", "one_shot", "two_shot", "nccl"):
        raise ValueError(f"vattn_examples::all_reduce: algorithm: expected auto, one_shot, two_shot or nccl, got "
                         f"{algorithm!r}; set TensorParallel.algorithm to one of them.")
    fused = _FUSED.get(group_name)
    if algorithm == "auto" and fused is not None and fused.fits(x):
        return fused.all_reduce(x)
    comm = _COMMS.get(group_name)
    algo = "nccl" if comm is None else comm.choose(x)
    if algo != "nccl" and algorithm != "auto":
        algo = algorithm
    if algo == "one_shot":
        return torch.ops.symm_mem.one_shot_all_reduce_copy(comm.staged(x), x.contiguous(), "sum", group_name)
    if algo == "two_shot":
        buf = comm.staged(x)
        buf.copy_(x)
        torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group_name)
        return buf.clone()
    c10d = torch.ops._c10d_functional  # the ops funcol wraps (same in torch 2.11 .. 2.13)
    return c10d.wait_tensor(c10d.all_reduce(x.contiguous(), "sum", group_name))


def _all_reduce_fake(x: torch.Tensor, group_name: str, algorithm: str = "auto") -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# ---- all-reduce + residual add + RMSNorm ------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of (T, hidden) ``x`` over its last dim, computed in float32 and applied to
    ``weight`` after the cast back, as ``transformers`` (and ``examples.model.RMSNorm``) do."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@dataclass(frozen=True)
class FusedNormAllReduce:
    """One group's FlashInfer all-reduce fusion workspace.

    ``workspace`` holds the device pointers FlashInfer's kernel reads (every peer's buffers and
    flags); ``handles`` keeps the symmetric buffers behind them alive. It serves (T, hidden_size)
    messages of ``dtype`` on ``device`` with 1 <= T <= ``max_tokens``: the fused all-reduce + add +
    RMSNorm (``__call__``), and a plain all-reduce (``all_reduce``, the same kernel without the
    norm), which ``all_reduce(..., "auto")`` prefers for such messages. ``pdl``: launch with
    programmatic dependent launch, so that the kernel's launch overlaps the end of the kernel
    before it (it waits for that kernel's results before it reads its input).
    """

    workspace: torch.Tensor
    handles: Any
    rank: int
    world: int
    max_tokens: int
    hidden_size: int
    dtype: torch.dtype
    device: torch.device
    pdl: bool
    run: Any  # flashinfer.comm.trtllm_ar.trtllm_allreduce_fusion
    patterns: tuple[int, int]  # AllReduceFusionPattern.kAllReduce, .kARResidualRMSNorm

    def fits(self, x: torch.Tensor) -> bool:
        return (x.dim() == 2 and 1 <= x.shape[0] <= self.max_tokens and x.shape[1] == self.hidden_size
                and x.dtype == self.dtype and x.device == self.device)

    def serves(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
        return self.fits(x) and residual.shape == x.shape and residual.dtype == weight.dtype == x.dtype

    def _launch(self, pattern: int, x: torch.Tensor, **outputs: Any) -> None:
        args = dict(allreduce_out=None, residual_in=None, residual_out=None, norm_out=None, rms_gamma=None,
                    rms_eps=None)
        args.update(outputs)
        self.run(allreduce_in=x, world_size=self.world, world_rank=self.rank, token_num=x.shape[0],
                 hidden_dim=self.hidden_size, workspace_ptrs=self.workspace, launch_with_pdl=self.pdl,
                 trigger_completion_at_end=True, fp32_acc=True, pattern_code=pattern, use_oneshot=None,
                 quant_out=None, scale_out=None, scale_factor=None, layout_code=None, **args)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.contiguous()
        normed, summed = torch.empty_like(x), torch.empty_like(x)
        self._launch(self.patterns[1], x, residual_in=residual.contiguous(), residual_out=summed, norm_out=normed,
                     rms_gamma=weight.contiguous(), rms_eps=eps)
        return normed, summed

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        self._launch(self.patterns[0], x, allreduce_out=out)
        return out

    def release(self) -> None:
        """Drop FlashInfer's references to the symmetric buffers (before the group goes)."""
        from flashinfer.comm import trtllm_ar

        inspect.unwrap(trtllm_ar.trtllm_destroy_ipc_workspace_for_all_reduce_fusion)(self.handles)


def fused_norm_all_reduce(group_name: str) -> FusedNormAllReduce | None:
    """The fused all-reduce workspace of ``group_name`` (None where it is off)."""
    return _FUSED.get(group_name)


def enable_fused_norm(group: dist.ProcessGroup, max_tokens: int, hidden_size: int, dtype: torch.dtype,
                      device: torch.device, pdl: bool | None = None) -> bool:
    """Give ``group`` FlashInfer's all-reduce + residual add + RMSNorm for up to ``max_tokens`` rows.

    ``pdl``: programmatic dependent launch (default: on Hopper and newer, where CUDA has it).

    A collective (every rank calls it with the same arguments). Returns False, logging why,
    where it cannot run: the CPU, FlashInfer or its ``comm`` module missing, no symmetric
    memory. The first use on a machine JIT-compiles FlashInfer's communication kernels
    (several minutes; cached afterwards).
    """
    name, world = group.group_name, dist.get_world_size(group)
    if world == 1 or torch.device(device).type != "cuda":
        return False
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        logger.warning("fused all-reduce + RMSNorm: dtype %s is not served; using the unfused all-reduce", dtype)
        return False
    try:
        from flashinfer.comm import trtllm_ar

        # The functions the unified flashinfer.comm API wraps, called directly so that the
        # buffers are PyTorch symmetric memory (the unified API allocates CUDA VMM memory
        # through cuda-python); inspect.unwrap drops their deprecation wrappers.
        create = inspect.unwrap(trtllm_ar.trtllm_create_ipc_workspace_for_all_reduce_fusion)
        handles, workspace, _ = create(
            tp_rank=dist.get_rank(group), tp_size=world, max_token_num=max_tokens, hidden_dim=hidden_size,
            use_fp32_lamport=dtype == torch.float32, group=group, create_metadata=True, use_symm_dev_mem=False)
    except Exception as e:  # no FlashInfer, no P2P, no symmetric memory: keep the unfused path
        logger.warning("fused all-reduce + RMSNorm unavailable (%s: %s); using the unfused all-reduce",
                       type(e).__name__, e)
        return False
    if pdl is None:
        pdl = torch.cuda.get_device_capability(device)[0] >= 9
    patterns = trtllm_ar.AllReduceFusionPattern
    disable_fused_norm(name)  # a workspace enabled before is retired (released with the others)
    _FUSED[name] = FusedNormAllReduce(
        workspace, handles, dist.get_rank(group), world, max_tokens, hidden_size, dtype, torch.device(device), pdl,
        inspect.unwrap(trtllm_ar.trtllm_allreduce_fusion), (int(patterns.kAllReduce), int(patterns.kARResidualRMSNorm)))
    return True


def disable_fused_norm(group_name: str) -> None:
    """Back to the unfused all-reduce for ``group_name`` (its workspace is kept until
    ``disable_symm_mem()``, for the same reason as the symmetric buffers)."""
    if group_name in _FUSED:
        _RETIRED.append(_FUSED.pop(group_name))


def all_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                            group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(s, weight, eps), s)`` with ``s = sum_ranks(x) + residual``; x, residual (T, hidden).

    One FlashInfer kernel where ``enable_fused_norm`` gave the group a workspace that fits the
    message; otherwise ``all_reduce`` (``auto``), the add and ``rms_norm``.
    """
    fused = _FUSED.get(group_name)
    if fused is not None and fused.serves(x, residual, weight):
        return fused(x, residual, weight, eps)
    summed = all_reduce(x, group_name) + residual
    return rms_norm(summed, weight, eps), summed


def _all_reduce_add_rms_norm_fake(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                                  group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    return out, torch.empty_like(out)


_lib = Library("vattn_examples", "FRAGMENT")
_lib.define("all_reduce" + infer_schema(all_reduce, mutates_args=[]))
_lib.impl("all_reduce", all_reduce, "CompositeExplicitAutograd")
torch.library.register_fake("vattn_examples::all_reduce", _all_reduce_fake, lib=_lib)
_lib.define("all_reduce_add_rms_norm" + infer_schema(all_reduce_add_rms_norm, mutates_args=[]))
_lib.impl("all_reduce_add_rms_norm", all_reduce_add_rms_norm, "CompositeExplicitAutograd")
torch.library.register_fake("vattn_examples::all_reduce_add_rms_norm", _all_reduce_add_rms_norm_fake, lib=_lib)

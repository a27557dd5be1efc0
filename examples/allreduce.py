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
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch.library import Library, infer_schema

__all__ = ["AllReducePolicy", "DEFAULT_POLICY", "SymmetricMemoryAllReduce", "all_reduce", "disable_symm_mem", "enable_symm_mem",
           "symm_mem_all_reduce"]

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
_RETIRED: list[SymmetricMemoryAllReduce] = []


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
    group's is dropped (``group_name=None``, before the process group goes): a peer may still
    read it from a graph this rank has not yet replayed."""
    if group_name is None:
        _COMMS.clear()
        _RETIRED.clear()
    elif group_name in _COMMS:
        _RETIRED.append(_COMMS.pop(group_name))


def all_reduce(x: torch.Tensor, group_name: str, algorithm: str = "auto") -> torch.Tensor:
    """Sum of ``x`` over the ranks of ``group_name``, as a new tensor of ``x``'s shape and dtype.

    ``algorithm``: ``auto`` (by size, see the module docstring), or ``one_shot`` / ``two_shot`` /
    ``nccl`` to force one (the symmetric ones need ``enable_symm_mem`` and fall back to NCCL
    where the message does not fit the buffer).
    """
    if algorithm not in ("auto", "one_shot", "two_shot", "nccl"):
        raise ValueError(f"vattn_examples::all_reduce: algorithm: expected auto, one_shot, two_shot or nccl, got "
                         f"{algorithm!r}; set TensorParallel.algorithm to one of them.")
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


_lib = Library("vattn_examples", "FRAGMENT")
_lib.define("all_reduce" + infer_schema(all_reduce, mutates_args=[]))
_lib.impl("all_reduce", all_reduce, "CompositeExplicitAutograd")
torch.library.register_fake("vattn_examples::all_reduce", _all_reduce_fake, lib=_lib)

"""Tensor parallelism for the example model, on PyTorch's own stack (``torch.distributed``).

Megatron-style sharding over ``n`` ranks (one process per rank, ``torchrun``); rank ``r``
holds:

| layer | its shard | forward (communication) |
| --- | --- | --- |
| ``ColumnParallelLinear`` (``qkv_proj``, ``gate_up_proj``) | the rows of each fused part that feed its heads / its slice of the MLP | local matmul (none) |
| ``RowParallelLinear`` (``o_proj``, ``down_proj``) | the matching input columns; the bias whole | local matmul, all-reduce (sum), + bias |
| ``VocabParallelEmbedding`` (``embed_tokens``) | vocab rows ``[r*Vp/n, (r+1)*Vp/n)``, ``Vp`` = V rounded up to a multiple of n | masked local lookup, all-reduce |
| ``ParallelLMHead`` (``lm_head``) | the same vocab rows (tied embeddings share them) | local logits, all-gather along the vocab, ``[:, :V]`` |
| norms, RoPE | everything (replicated) | none |

Heads: rank ``r`` attends with query heads ``[r*H/n, (r+1)*H/n)``. When ``n <= Hk`` it holds KV
heads ``[r*Hk/n, (r+1)*Hk/n)``; when ``n > Hk`` (``n`` a multiple of ``Hk``) each KV head is
replicated on ``n/Hk`` ranks and rank ``r`` holds KV head ``r // (n/Hk)``, which is the head its
query heads belong to. Each rank's ``vattn.Attention`` and paged KV cache see only its own heads.

Collectives: the all-reduce is one opaque op, ``torch.ops.vattn_examples.all_reduce``
(examples/allreduce.py), which picks PyTorch's one-shot or two-shot symmetric-memory all-reduce
(P2P loads over NVLink, no multicast) or NCCL by message size once ``enable_symm_mem`` gave the
group a buffer, and c10d's functional all-reduce (NCCL on GPUs, gloo on the CPU) otherwise. The
o_proj and down_proj all-reduces are not done by their layers (``reduce_results=False``): the
decoder layer hands the partial sums to ``TensorParallel.all_reduce_add_rms_norm``, which sums
them, adds the residual and applies the next RMSNorm, in one FlashInfer kernel once
``enable_fused_norm`` gave the group its workspace (``vattn_examples::all_reduce_add_rms_norm``).
The all-gather is ``_c10d_functional.all_gather_into_tensor``. Dynamo traces them all into the
graph with no break (``fullgraph=True``), and CUDA graphs capture them.

Leaving: ``tensor_parallel_run`` joins the group and leaves it cleanly. On success every rank
waits for the others, then the group is destroyed, so no process stays behind its last step;
captured CUDA graphs that hold NCCL kernels must be released before that, inside the block
(``CUDAGraphRunner.release``: NCCL's communicator destroy waits for them, pytorch/pytorch#115388).
A rank that raises prints its error and exits at once with status 1; ``torchrun`` then stops the
other ranks, which would otherwise wait in their next collective for the failed one.

Decisions:

* Scheduling: every rank runs the same deterministic scheduler (``examples.engine``) on the same
  requests, so the step's metadata needs no broadcast; each step rank 0's sampled tokens are
  broadcast (``TensorParallel.broadcast_from_first``, the engine's ``token_sync``) so that the
  ranks agree even on near-ties or with temperature sampling. One small broadcast per step, at
  the step's one host sync.
* Embedding and LM head are both vocab-parallel (one extra all-reduce of (T, hidden) per step;
  1/N of the table per rank) and share their shard when the embeddings are tied.
* gloo: ``_c10d_functional`` all_reduce / all_gather_into_tensor run on gloo CPU tensors in
  torch 2.13, eagerly and under ``torch.compile(fullgraph=True)`` (aot_eager, inductor and
  ``vattn.compile``, whose pieces then contain the all-reduces and are still compiled once per
  distinct layer), so the CPU tests exercise the same code as the GPUs.

Usage (``examples/generate.py --tp N`` does this)::

    tp, device = init_tensor_parallel(2, "cuda")       # inside `torchrun --nproc-per-node 2`
    model = DecoderForCausalLM(config, tp=tp)          # this rank's shard
    model.load_hf_state_dict(hf_state_dict)            # full checkpoint in, this rank's slices kept
"""

from __future__ import annotations

import faulthandler
import gc
import logging
import os
import sys
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import examples.gemv.op  # noqa: F401  (registers torch.ops.vattn_examples.gemv)
from examples.allreduce import (AllReducePolicy, FusedNormAllReduce, SymmetricMemoryAllReduce, disable_fused_norm,
                                disable_symm_mem, enable_fused_norm, enable_symm_mem, fused_norm_all_reduce,
                                symm_mem_all_reduce)

__all__ = [
    "ColumnParallelLinear",
    "ParallelLMHead",
    "RowParallelLinear",
    "RowSlice",
    "ShardedModule",
    "TensorParallel",
    "VocabParallelEmbedding",
    "attention_shards",
    "init_tensor_parallel",
    "leave_tensor_parallel",
    "split_rows",
    "tensor_parallel_run",
]

logger = logging.getLogger("vattn.examples.tp")


class TensorParallel:
    """This process's place in the tensor-parallel group, and the collectives the layers call.

    Args:
        rank: this rank's index in the group (0 .. size-1).
        size: ranks in the group; 1 = no parallelism (every collective is the identity).
        group: the ``ProcessGroup`` of the ranks (``init_tensor_parallel`` passes the world group).
            With ``group=None`` and ``size > 1`` layers can be *built* (to inspect shapes or shard
            weights in one process) but running them raises.
    """

    def __init__(self, rank: int = 0, size: int = 1, group: dist.ProcessGroup | None = None) -> None:
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"TensorParallel: expected 0 <= rank < size, got rank={rank}, size={size}.")
        self.rank, self.size, self.group = rank, size, group
        self.group_name: str | None = group.group_name if group is not None else None
        self.algorithm = "auto"  # or "one_shot" / "two_shot" / "nccl": see examples/allreduce.py

    def __repr__(self) -> str:
        mode = "symm_mem+c10d" if self.symm_mem is not None else "c10d"
        return f"TensorParallel(rank={self.rank}, size={self.size}, group={self.group_name!r}, all_reduce={mode})"

    def _check_group(self) -> str:
        if self.group_name is None:
            raise RuntimeError(
                f"{self!r} has no process group: a model built for a single-process shard "
                "inspection cannot run; build it with init_tensor_parallel() under torchrun.")
        return self.group_name

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the ranks (a new tensor; ``x`` itself is untouched).

        One opaque op (``vattn_examples::all_reduce``) that picks one-shot / two-shot
        symmetric memory or NCCL by message size when it runs (examples/allreduce.py);
        ``self.algorithm`` forces one.
        """
        if self.size == 1:
            return x
        return torch.ops.vattn_examples.all_reduce(x, self._check_group(), self.algorithm)

    def all_reduce_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module
                                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(s), s)`` with ``s = sum_ranks(x) + residual``: the end of a row-parallel
        projection, its residual add and the next RMSNorm. x, residual: (T, hidden).

        ``norm`` is an RMSNorm module (its ``weight`` and ``eps``). With ``enable_fused_norm``
        this is one opaque op (``vattn_examples::all_reduce_add_rms_norm``, FlashInfer's fused
        kernel); otherwise ``all_reduce``, the add and ``norm`` (which Inductor fuses).
        """
        if self.size > 1 and self.fused_norm is not None:
            return torch.ops.vattn_examples.all_reduce_add_rms_norm(x, residual, norm.weight, norm.eps,
                                                                    self._check_group())
        summed = self.all_reduce(x) + residual
        return norm(summed), summed

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """(N, d) on every rank -> (N, size*d), rank r's block at columns ``[r*d, (r+1)*d)``."""
        if self.size == 1:
            return x
        c10d = torch.ops._c10d_functional  # the ops funcol wraps (same in torch 2.11 .. 2.13)
        out = c10d.wait_tensor(c10d.all_gather_into_tensor(x.contiguous(), self.size, self._check_group()))
        n, d = x.shape
        return out.view(self.size, n, d).transpose(0, 1).reshape(n, self.size * d)

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` on every rank (in place; eager only, outside compiled code)."""
        if self.size > 1:
            self._check_group()
            dist.broadcast(x, src=dist.get_global_rank(self.group, 0), group=self.group)
        return x

    def subgroup(self, n: int) -> "TensorParallel":
        """This rank's place in the group of ``n`` consecutive ranks of this group (``n`` divides
        ``size``). A collective: every rank creates every group, as ``new_group`` requires."""
        if n == self.size:
            return self
        if n < 1 or self.size % n:
            raise ValueError(f"TensorParallel.subgroup: n must divide the group's {self.size} ranks, got {n}.")
        ranks = dist.get_process_group_ranks(self.group) if self.group is not None else list(range(self.size))
        mine = self
        for start in range(0, self.size, n):
            group = dist.new_group(ranks[start:start + n])
            if start <= self.rank < start + n:
                mine = TensorParallel(self.rank - start, n, group)
        return mine

    def enable_symm_mem(self, max_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device,
                        policy: AllReducePolicy | None = None) -> bool:
        """Give the group a symmetric buffer for all-reduces of up to ``max_tokens`` x ``hidden_size``.

        A collective (every rank calls it). Messages that fit go one-shot or two-shot by size
        (``policy``; ``examples.allreduce.DEFAULT_POLICY`` when None), larger ones NCCL. Returns False
        (and keeps NCCL) where CUDA peer access, the symmetric-memory ops or their backend are
        missing. Leaves NVLink multicast alone.
        """
        if self.size == 1:
            return False
        nbytes = max_tokens * hidden_size * torch.empty((), dtype=dtype).element_size()
        return enable_symm_mem(self.group, nbytes, torch.device(device), policy)

    def disable_symm_mem(self) -> None:
        """Back to NCCL for every all-reduce of this group (the fused one included)."""
        if self.group_name is not None:
            disable_symm_mem(self.group_name)
            disable_fused_norm(self.group_name)

    @property
    def symm_mem(self) -> SymmetricMemoryAllReduce | None:
        """The group's symmetric buffer and size policy (None: every all-reduce is NCCL)."""
        return symm_mem_all_reduce(self.group_name) if self.group_name is not None else None

    def enable_fused_norm(self, max_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device,
                          pdl: bool | None = None) -> bool:
        """Fuse the all-reduces that end a layer's attention and MLP with their residual add and the
        next RMSNorm (FlashInfer's kernel, ``examples.allreduce.enable_fused_norm``; ``pdl``:
        programmatic dependent launch, default on Hopper and newer) for steps of up to
        ``max_tokens`` tokens; the other all-reduces of such steps use its plain all-reduce. A
        collective. Returns False (and keeps the unfused path) where FlashInfer, CUDA peer access
        or symmetric memory is missing. Takes effect in models traced after it
        (``torch._dynamo.reset()`` before recompiling one).
        """
        if self.size == 1:
            return False
        return enable_fused_norm(self.group, max_tokens, hidden_size, dtype, torch.device(device), pdl)

    def disable_fused_norm(self) -> None:
        """Back to the unfused all-reduce + add + RMSNorm (for models traced after this)."""
        if self.group_name is not None:
            disable_fused_norm(self.group_name)

    @property
    def fused_norm(self) -> FusedNormAllReduce | None:
        """The group's fused all-reduce + RMSNorm workspace (None: unfused)."""
        return fused_norm_all_reduce(self.group_name) if self.group_name is not None else None


def init_tensor_parallel(tp_size: int | None, device: torch.device | str, timeout: timedelta | None = None
                         ) -> tuple[TensorParallel, torch.device]:
    """Join the ``torchrun`` job and return this rank's ``TensorParallel`` and device.

    The whole world is one tensor-parallel group (``tp_size`` must equal ``--nproc-per-node`` x
    nodes; None = whatever it is). On CUDA each rank uses ``cuda:LOCAL_RANK`` and NCCL; on the
    CPU, gloo. ``timeout``: how long a collective may wait for the other ranks (torch's default
    when None). ``tp_size == 1`` outside torchrun returns ``TensorParallel()`` and ``device``.
    """
    device = torch.device(device)
    launched = dist.is_available() and dist.is_torchelastic_launched()
    if tp_size in (1, None) and not launched:
        return TensorParallel(), device
    if not launched:
        raise ValueError(
            f"tensor parallelism {tp_size} needs one process per rank: launch with "
            f"`torchrun --nproc-per-node {tp_size} examples/generate.py --tp {tp_size} ...`.")
    if device.type == "cuda":
        device = torch.device("cuda", dist.get_node_local_rank())
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None, timeout=timeout)
    world = dist.get_world_size()
    if tp_size is not None and world != tp_size:
        raise ValueError(f"--tp {tp_size} must equal the number of processes torchrun started ({world}).")
    return TensorParallel(dist.get_rank(), world, dist.group.WORLD), device


@contextmanager
def tensor_parallel_run(tp_size: int | None, device: torch.device | str, timeout: timedelta | None = None,
                        leave_timeout_s: float = 60.0) -> Iterator[tuple[TensorParallel, torch.device]]:
    """``init_tensor_parallel`` for the ``with`` block, then leave the group cleanly.

    Yields ``(tp, device)``. Where this call created the process group (under ``torchrun``):

    * the block returns: every rank waits for the others (a barrier), symmetric buffers are
      dropped and the group is destroyed, so the process ends right after its last step.
      Release captured CUDA graphs inside the block (``CUDAGraphRunner.release``): NCCL's
      communicator destroy waits for graphs that hold its kernels. Should leaving still take
      over ``leave_timeout_s``, every thread's stack is dumped and the process exits with 1.
    * the block raises: the error and its traceback go to stderr and the process exits at once
      with status 1, without the collective teardown its peers could never join; ``torchrun``
      then stops them.

    Where the group existed already (or for one process outside ``torchrun``), nothing more.
    """
    had_group = dist.is_available() and dist.is_initialized()
    tp, device = init_tensor_parallel(tp_size, device, timeout)
    if had_group or not dist.is_initialized():
        yield tp, device
        return
    try:
        yield tp, device
    except BaseException as e:  # noqa: BLE001 -- any failure: this rank leaves now
        print(f"[rank {tp.rank}/{tp.size}] failed: {type(e).__name__}: {e}; exiting so that the other ranks stop "
              "too", file=sys.stderr)
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    leave_tensor_parallel(device, leave_timeout_s)


def leave_tensor_parallel(device: torch.device, timeout_s: float = 60.0) -> None:
    """Leave the default process group on every rank: a barrier, then its destroy.

    Captured CUDA graphs must be released first. Past ``timeout_s`` every thread's stack is
    dumped to stderr and the process exits with status 1 (a hang made visible, not waited out).
    """
    gc.collect()  # models, engines and graphs left in reference cycles, while the group is alive
    faulthandler.dump_traceback_later(timeout_s, exit=True)
    try:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        disable_symm_mem()
        dist.destroy_process_group()
    finally:
        faulthandler.cancel_dump_traceback_later()


# ---- sharding ----------------------------------------------------------------------------


@dataclass(frozen=True)
class RowSlice:
    """Rows ``[start, start + size)`` of a dimension of length ``full`` (zero rows past ``full``)."""

    full: int
    start: int
    size: int

    def take(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        stop = min(self.start + self.size, self.full)
        part = t.narrow(dim, self.start, max(stop - self.start, 0))
        if part.shape[dim] == self.size:
            return part
        pad = list(t.shape)
        pad[dim] = self.size - part.shape[dim]
        return torch.cat([part, t.new_zeros(pad)], dim=dim)


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) must be divisible by the tensor-parallel size ({d}); "
                         "pick --tp that divides it.")
    return n // d


def split_rows(n: int, tp: TensorParallel, what: str) -> RowSlice:
    """Rank ``tp.rank``'s equal share of ``n`` rows (``n`` divisible by ``tp.size``, else a ValueError naming ``what``)."""
    per = _divide(n, tp.size, what)
    return RowSlice(n, tp.rank * per, per)


def attention_shards(num_heads: int, num_kv_heads: int, head_dim: int, tp: TensorParallel
                     ) -> tuple[RowSlice, RowSlice]:
    """(query rows, key/value rows) of rank ``tp.rank`` in the flattened (heads*D) projections."""
    h = _divide(num_heads, tp.size, "num_attention_heads")
    if tp.size <= num_kv_heads:
        hk = _divide(num_kv_heads, tp.size, "num_key_value_heads")
        kv_start = tp.rank * hk
    else:  # replicate: rank r holds KV head r // (n / Hk), the head of its query heads' group
        replicas = _divide(tp.size, num_kv_heads, "the tensor-parallel size (more ranks than KV heads)")
        hk, kv_start = 1, tp.rank // replicas
    return (RowSlice(num_heads * head_dim, tp.rank * h * head_dim, h * head_dim),
            RowSlice(num_kv_heads * head_dim, kv_start * head_dim, hk * head_dim))


class ShardedModule(nn.Module):
    """A module whose parameters are slices of a full (single-process) tensor.

    ``full_shape(leaf)`` is the full tensor's shape for parameter ``leaf`` ("weight", "bias");
    ``shard(leaf, full)`` returns this rank's slice. Loading and random initialisation go through
    both, so every TP size gets the same full model.
    """

    def full_shape(self, leaf: str) -> tuple[int, ...]:
        raise NotImplementedError

    def shard(self, leaf: str, full: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class ColumnParallelLinear(ShardedModule):
    """``y = x W_r^T + b_r``: output features sharded, fused parts sharded one by one.

    Args:
        in_features: input features (whole on every rank).
        parts: one ``RowSlice`` per fused output part (q, k, v or gate, up), in order.

    ``forward(x (T, in)) -> (T, sum(part.size))``, no communication.
    """

    def __init__(self, in_features: int, parts: Sequence[RowSlice], bias: bool = False) -> None:
        super().__init__()
        self.parts = tuple(parts)
        self.in_features = in_features
        self.weight = nn.Parameter(torch.empty(sum(p.size for p in self.parts), in_features))
        self.bias = nn.Parameter(torch.empty(self.weight.shape[0])) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def full_shape(self, leaf: str) -> tuple[int, ...]:
        rows = sum(p.full for p in self.parts)
        return (rows, self.in_features) if leaf == "weight" else (rows,)

    def shard(self, leaf: str, full: torch.Tensor) -> torch.Tensor:
        chunks = full.split([p.full for p in self.parts], dim=0)
        return torch.cat([p.take(c) for p, c in zip(self.parts, chunks)], dim=0)


class RowParallelLinear(ShardedModule):
    """``y = all_reduce(x_r W_r^T) + b``: input features sharded (``cols``), bias added once.

    ``forward(x (T, cols.size)) -> (T, out_features)``: one all-reduce, or, with
    ``reduce_results=False``, this rank's partial sums (rank 0's with the bias), which the caller
    reduces (``TensorParallel.all_reduce_add_rms_norm``), as vLLM's layer of that name does.
    """

    def __init__(self, cols: RowSlice, out_features: int, tp: TensorParallel, bias: bool = False,
                 reduce_results: bool = True) -> None:
        super().__init__()
        self.cols, self.out_features, self.tp = cols, out_features, tp
        self.reduce_results = reduce_results
        self.weight = nn.Parameter(torch.empty(out_features, cols.size))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.reduce_results:  # the bias once in the sum: on rank 0 only
            return F.linear(x, self.weight, self.bias if self.tp.rank == 0 else None)
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias

    def full_shape(self, leaf: str) -> tuple[int, ...]:
        return (self.out_features, self.cols.full) if leaf == "weight" else (self.out_features,)

    def shard(self, leaf: str, full: torch.Tensor) -> torch.Tensor:
        return self.cols.take(full, dim=1) if leaf == "weight" else full


def _vocab_rows(vocab_size: int, tp: TensorParallel) -> RowSlice:
    per = -(-vocab_size // tp.size)
    return RowSlice(vocab_size, tp.rank * per, per)


class VocabParallelEmbedding(ShardedModule):
    """Token embedding with the vocabulary sharded over the ranks.

    ``forward(ids (T,)) -> (T, hidden)``: each rank looks up the ids in its row range (zeros
    elsewhere), then one all-reduce sums the ranks' rows.
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.rows, self.hidden_size, self.tp = _vocab_rows(vocab_size, tp), hidden_size, tp
        self.weight = nn.Parameter(torch.empty(self.rows.size, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.rows.start
        mine = (local >= 0) & (local < self.rows.size)
        out = F.embedding(torch.where(mine, local, torch.zeros_like(local)), self.weight)
        return self.tp.all_reduce(out * mine.unsqueeze(-1).to(out.dtype))

    def full_shape(self, leaf: str) -> tuple[int, ...]:
        return (self.rows.full, self.hidden_size)

    def shard(self, leaf: str, full: torch.Tensor) -> torch.Tensor:
        return self.rows.take(full)


class ParallelLMHead(ShardedModule):
    """LM head with the vocabulary sharded like ``VocabParallelEmbedding`` (so they can be tied).

    ``forward(hidden (N, hidden)) -> (N, vocab_size)`` full logits on every rank (one all-gather).
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.rows, self.hidden_size, self.tp = _vocab_rows(vocab_size, tp), hidden_size, tp
        self.weight = nn.Parameter(torch.empty(self.rows.size, hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            # one row on a GPU (a batch-1 decode step): the example Triton GEMV, which streams
            # this weight closer to the copy bandwidth than cuBLAS does; anything else: F.linear
            return torch.ops.vattn_examples.gemv(hidden, self.weight, False)
        logits = self.tp.all_gather_last(F.linear(hidden, self.weight))
        return logits[..., : self.rows.full] if self.tp.size > 1 else logits

    def full_shape(self, leaf: str) -> tuple[int, ...]:
        return (self.rows.full, self.hidden_size)

    def shard(self, leaf: str, full: torch.Tensor) -> torch.Tensor:
        return self.rows.take(full)

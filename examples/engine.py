"""A small continuous-batching engine over vattn's paged KV cache.

Three pieces, each a few dozen lines:

* ``BlockAllocator`` hands out KV-cache block ids (pages) and takes them back.
* ``Scheduler`` picks, every step, which requests run and how many new tokens each gets,
  under a token budget: running decodes first (one token each), then chunked prefills of
  running requests, then newly arrived requests. When the cache is full it preempts the
  most recently admitted request (its blocks are freed; it is recomputed later).
* ``Engine`` turns the schedule into ``input_ids``/``positions`` and vattn metadata
  (the scheduler's ``vattn.InputBatch`` rows -> ``kv.build_metadata``), runs the model in
  ``vattn.set_forward_context``, samples, and feeds the tokens back.

Async scheduling (the default, as vLLM's ``async_scheduling``): the host prepares and
launches step N+1 while the GPU still runs step N. Nothing the scheduler decides depends on a
sampled token's *value* (requests finish by count), so step N+1 is scheduled with step N's
samples still on the GPU: each request's newest output is ``PENDING`` on the host, and step
N+1 reads it on the device (its ``input_ids`` slot is filled from step N's sampled tensor).
Step N's tokens reach the host (a non-blocking copy, then an event wait that step N+1's
kernels do not delay) after step N+1 is launched. ``run`` (or ``flush``) leaves no token
pending. The tokens are the same as with ``async_scheduling=False``, which syncs every step.

A request's tokens are ``prompt + outputs``; ``num_computed_tokens`` of them have K/V in the
cache. The step gives it ``n`` new tokens; when that reaches its last token the logits of
that position sample its next token (a chunk that ends mid-prompt samples nothing).

Models with mixer layers (``vattn.GatedDeltaNet`` ...; ``examples/hybrid_model.py``) keep a
fixed-size state per request besides the K/V: a request's ``InputBatch`` row is its state slot
(``InputBatch.prepare`` passes the rows as ``state_indices``), so the cache needs
``allocate_kv_cache(..., num_state_slots=max_num_seqs)``. A request whose ``num_computed_tokens``
is 0 starts from a zero state, so a preempted request (recomputed from its first token) needs no
explicit reset; after a step that raised, the requests it ran are recomputed the same way
(``Scheduler.restart``), since their states may have advanced part-way.
"""

from __future__ import annotations

import functools
import logging
import math
import numbers
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

import vattn
from vattn.compile_passes.piecewise import capture_graph

__all__ = ["PENDING", "BlockAllocator", "Engine", "Request", "SamplingParams", "Scheduler", "sample"]

logger = logging.getLogger("vattn.examples.engine")

#: An output token sampled by the step in flight, not on the host yet (async scheduling).
PENDING = -1


@dataclass(frozen=True)
class SamplingParams:
    """``temperature == 0`` is greedy; otherwise softmax(logits / temperature) restricted to the top-p mass.

    Checked here, once: ``max_tokens`` an integer >= 0 (0: the request finishes at once, with no
    outputs), ``temperature`` a finite number >= 0, ``top_p`` a number in (0, 1].
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        n = self.max_tokens
        integral = isinstance(n, numbers.Integral) and not isinstance(n, bool)
        if not integral or n < 0:
            raise (ValueError if integral else TypeError)(
                f"SamplingParams: max_tokens must be an integer >= 0 (how many tokens to generate), got {n!r} "
                f"({type(n).__name__}); pass a whole number, e.g. max_tokens=16 (it is never rounded).")
        t = self.temperature
        if not _is_real(t) or not math.isfinite(t) or t < 0:
            raise (ValueError if _is_real(t) else TypeError)(
                f"SamplingParams: temperature must be a finite number >= 0 (0 = greedy), got {t!r}; pass "
                "temperature=0.0 for greedy decoding or a positive value to sample.")
        p = self.top_p
        if not _is_real(p) or not 0 < p <= 1:
            raise (ValueError if _is_real(p) else TypeError)(
                f"SamplingParams: top_p must be a number in (0, 1] (the probability mass sampled from), got "
                f"{p!r}; pass top_p=1.0 to sample from the whole distribution.")
        object.__setattr__(self, "max_tokens", int(n))
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_p", float(p))


def _is_real(x: object) -> bool:
    """A real number that is not a bool (True is an int in Python)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


@dataclass(eq=False)
class Request:
    req_id: int
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    arrival_step: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    #: The request's row in the scheduler's ``vattn.InputBatch`` while it holds blocks, else None.
    row: int | None = None
    #: Set when a step failed because of this request (``Engine.step``): it is finished, with
    #: the outputs it had, and its blocks are freed.
    error: Exception | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_remaining(self) -> int:
        """Tokens whose K/V are not in the cache yet (1 for a decoding request)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return len(self.output_token_ids) >= self.sampling.max_tokens or self.error is not None

    def token_ids(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        return (self.prompt_token_ids[start:end] if start < p else []) + self.output_token_ids[
            max(start - p, 0) : max(end - p, 0)]


class BlockAllocator:
    """Free list over ``num_blocks`` KV-cache blocks; remembers each block's owner to catch double use."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._owner: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int, owner: int) -> list[int] | None:
        """``n`` block ids for request ``owner``, or None (nothing taken) if fewer are free."""
        if n > len(self._free):
            return None
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            assert b not in self._owner, f"block {b} handed out twice"
            self._owner[b] = owner
        return blocks

    def allocate_each(self, owners: list[int]) -> list[int] | None:
        """One block id for each of ``owners`` (request ids), or None (nothing taken) if fewer are free."""
        if len(owners) > len(self._free):
            return None
        blocks = [self._free.popleft() for _ in owners]
        for b, owner in zip(blocks, owners):
            assert b not in self._owner, f"block {b} handed out twice"
            self._owner[b] = owner
        return blocks

    def free(self, blocks: list[int], owner: int) -> None:
        """Return ``blocks`` (all owned by ``owner``) to the free list."""
        for b in blocks:
            assert self._owner.get(b) == owner, f"request {owner} frees block {b} it does not own"
        for b in blocks:
            del self._owner[b]
            self._free.append(b)

    def check(self, requests: list[Request]) -> None:
        """Invariants: every block is free xor owned by exactly one of ``requests``."""
        owned = [b for r in requests for b in r.block_ids]
        assert len(owned) == len(set(owned)), "a block is owned by two requests"
        assert set(owned) == set(self._owner), "allocator and requests disagree on owned blocks"
        assert not set(owned) & set(self._free), "an owned block is also free"
        assert len(owned) + len(self._free) == self.num_blocks, "blocks leaked"


class Scheduler:
    """Continuous batching with chunked prefill under ``max_num_batched_tokens`` (decodes first)."""

    def __init__(self, allocator: BlockAllocator, block_size: int, *, max_num_batched_tokens: int = 512,
                 max_num_seqs: int = 64, chunked_prefill: bool = True, device: torch.device | str = "cpu",
                 max_model_len: int | None = None, pad_tokens_to: int = 1) -> None:
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) and max_num_seqs "
                             f"({max_num_seqs}) must be at least 1.")
        self.allocator = allocator
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.chunked_prefill = chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        max_blocks = allocator.num_blocks if max_model_len is None else -(-max_model_len // block_size)
        #: Rows of the running requests: block ids and computed tokens, kept across steps; each
        #: step's metadata is built from it (``InputBatch.prepare``).
        self.batch = vattn.InputBatch(max_num_reqs=max_num_seqs, max_blocks_per_req=max(min(max_blocks, allocator.num_blocks), 1),
                                      block_size=block_size, num_blocks=allocator.num_blocks, device=device,
                                      max_num_tokens=max_num_batched_tokens + pad_tokens_to - 1)
        # The last schedule when it was all decodes of every running request (``schedule``'s
        # steady state: the next one is the same requests, one token each), with its rows.
        self._steady: list[tuple[Request, int]] | None = None
        self._last: list[tuple[Request, int]] | None = None
        self._steady_reqs: list[Request] = []
        #: The steady schedule's requests' ``output_token_ids`` lists, in its order.
        self.steady_outputs: list[list[int]] = []
        self._outputs_left = np.zeros(0, dtype=np.int64)  # outputs each steady request has still to sample
        self._blocks_left = np.zeros(0, dtype=np.int64)  # blocks each steady request may still take
        self.rows = np.zeros(0, dtype=np.int64)  # the last schedule's rows, in its order
        self.query_lens = np.zeros(0, dtype=np.int64)  # ... and new tokens

    def add(self, req: Request) -> None:
        """Queue ``req`` (its token ids and sampling already checked: ``Engine.add_request``), or
        refuse it if it can never fit the cache or the token budget."""
        need = -(-(len(req.prompt_token_ids) + req.sampling.max_tokens) // self.block_size)
        if need > self.allocator.num_blocks:
            raise ValueError(
                f"request {req.req_id} needs {need} KV blocks (prompt {len(req.prompt_token_ids)} + "
                f"max_tokens {req.sampling.max_tokens}) but the cache has {self.allocator.num_blocks}; "
                "allocate more blocks or shorten the request.")
        total = len(req.prompt_token_ids) + req.sampling.max_tokens
        if not self.chunked_prefill and total > self.max_num_batched_tokens:
            raise ValueError(
                f"request {req.req_id} has up to {total} tokens to (re)compute but chunked_prefill=False and "
                f"max_num_batched_tokens={self.max_num_batched_tokens}; raise the budget or enable chunked prefill.")
        if req.sampling.max_tokens == 0:  # nothing to generate: finished as it arrives, no blocks taken
            self.finished.append(req)
            return
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _grow(self, req: Request, n: int) -> bool:
        need = -(-(req.num_computed_tokens + n) // self.block_size) - len(req.block_ids)
        if need <= 0:
            return True
        blocks = self.allocator.allocate(need, req.req_id)
        if blocks is None:
            return False
        if req.row is None:
            req.row = self.batch.add_row(blocks, req.num_computed_tokens)
        else:
            self.batch.append_blocks(req.row, blocks)
        req.block_ids += blocks
        return True

    def _release(self, req: Request) -> None:
        """Free ``req``'s blocks and row (finished, failed or preempted)."""
        self.allocator.free(req.block_ids, req.req_id)
        if req.row is not None:
            self.batch.free_row(req.row)
        req.block_ids, req.row = [], None
        self._steady = None

    def restart(self, req: Request) -> None:
        """Compute running request ``req`` again from its first token, keeping its blocks and row:
        for models with mixer layers, whose state a step that raised (or ``Engine._isolate``'s
        trials) may have advanced part-way. With ``num_computed_tokens`` 0 its next step starts the
        state from zeros; its K/V is rewritten with the same values."""
        req.num_computed_tokens = 0
        if req.row is not None:
            self.batch.num_computed_tokens[req.row] = 0
        self._steady = None

    def _preempt(self, req: Request) -> None:
        self._release(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.running.remove(req)
        self.waiting.appendleft(req)

    def schedule(self, step: int) -> list[tuple[Request, int]]:
        """``[(request, num_new_tokens)]`` for this step, decodes (1 token) first; ``rows`` and
        ``query_lens`` hold the same as arrays (the requests' ``InputBatch`` rows).

        Steady decoding (the last schedule was one token for every running request, and nothing
        has finished or may be admitted since) returns that same list again: only requests whose
        next token starts a new block are looked at (one vectorized test), not every request."""
        steady = self._steady
        if steady is not None and len(steady) == len(self.running) and not (
                self.waiting and self.waiting[0].arrival_step <= step and len(self.running) < self.max_num_seqs
                and self.max_num_batched_tokens > len(steady)):
            room = self.batch.capacity[self.rows] - self.batch.num_computed_tokens[self.rows]
            if room.min() > 0:  # every request's next token has a slot
                return steady
            if self._top_up(room):
                return steady
        out = self._schedule(step)
        self.rows = np.fromiter((r.row for r, _ in out), dtype=np.int64, count=len(out))
        self.rows.setflags(write=False)  # InputBatch.prepare checks a read-only rows array once
        self.query_lens = np.fromiter((n for _, n in out), dtype=np.int64, count=len(out))
        self._last = out
        decodes = len(out) == len(self.running) and all(n == 1 and r.num_remaining == 1 for r, n in out)
        self._steady = out if decodes and out else None
        if self._steady is not None:  # what ``update`` touches per request, gathered once
            reqs = [r for r, _ in out]
            self._steady_reqs = reqs
            self.steady_outputs = [r.output_token_ids for r in reqs]
            self._outputs_left = np.fromiter((r.sampling.max_tokens - len(r.output_token_ids) for r in reqs),
                                             dtype=np.int64, count=len(reqs))
            bs = self.block_size
            self._blocks_left = np.fromiter(  # blocks each may still take: up to its last token's
                (-(-(len(r.prompt_token_ids) + r.sampling.max_tokens) // bs) - len(r.block_ids) for r in reqs),
                dtype=np.int64, count=len(reqs))
        return out

    def _top_up(self, room: np.ndarray) -> bool:
        """A block more for each steady request that needs one within ``block_size`` steps (and
        may still grow), so that blocks are appended once per ``block_size`` steps for the whole
        batch rather than a few every step; where the free blocks do not reach, only for those
        that need one now. False (nothing taken) if even those do not fit: the full schedule then
        preempts. ``room``: (B,) free slots of each steady request's blocks."""
        for rows in (np.flatnonzero((room < self.block_size) & (self._blocks_left > 0)), np.flatnonzero(room <= 0)):
            reqs = [self._steady_reqs[i] for i in rows.tolist()]
            blocks = self.allocator.allocate_each([r.req_id for r in reqs])
            if blocks is not None:
                self.batch.append_block_each(self.rows[rows], np.array(blocks))
                self._blocks_left[rows] -= 1
                for r, b in zip(reqs, blocks):
                    r.block_ids.append(b)
                return True
        return False

    def _schedule(self, step: int) -> list[tuple[Request, int]]:
        budget = self.max_num_batched_tokens
        remaining = {r.req_id: r.num_remaining for r in self.running}  # read once: a property per call
        queue = [r for r in self.running if remaining[r.req_id] == 1] + [
            r for r in self.running if remaining[r.req_id] > 1]
        out: list[tuple[Request, int]] = []
        preempted = False
        i = 0
        while i < len(queue) and budget > 0:
            req = queue[i]
            n = min(remaining[req.req_id], budget)
            while not self._grow(req, n):
                victim = queue.pop()  # the lowest-priority request not scheduled yet (maybe req)
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                out.append((req, n))
                budget -= n
                i += 1
        while (not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
               and self.waiting[0].arrival_step <= step):
            req = self.waiting[0]
            n = min(req.num_remaining, budget)
            if (n < req.num_remaining and not self.chunked_prefill) or not self._grow(req, n):
                break
            self.waiting.popleft()
            self.running.append(req)
            out.append((req, n))
            budget -= n
        return out

    def fail(self, req: Request, error: Exception) -> None:
        """Finish running request ``req`` with ``error`` (``Engine.step``): its blocks are freed and
        it keeps the outputs it had."""
        req.error = error
        self._release(req)
        self.running.remove(req)
        self.finished.append(req)

    def update(self, scheduled: list[tuple[Request, int]], sampled: dict[int, int] | None = None) -> list[Request]:
        """Advance computed tokens, append sampled tokens (``req_id -> token``; None: every
        scheduled request samples ``PENDING``); returns the newly finished requests."""
        if sampled is None and scheduled is self._steady:  # one token and one output each
            self.batch.num_computed_tokens[self.rows] += 1
            for req in self._steady_reqs:
                req.num_computed_tokens += 1
            for out in self.steady_outputs:
                out.append(PENDING)
            self._outputs_left -= 1
            done = [self._steady_reqs[i] for i in np.flatnonzero(self._outputs_left <= 0).tolist()]
            for req in done:
                self._release(req)
                self.running.remove(req)
                self.finished.append(req)
            return done
        if scheduled is self._steady:  # its per-request counts are not kept below: schedule afresh
            self._steady = None
        if scheduled is self._last:  # the batch's rows are this schedule's: advance them at once
            self.batch.num_computed_tokens[self.rows] += self.query_lens
        else:
            for req, n in scheduled:
                self.batch.num_computed_tokens[req.row] += n
        done = []
        for req, n in scheduled:
            req.num_computed_tokens += n
            if sampled is None or req.req_id in sampled:
                out = req.output_token_ids
                out.append(PENDING if sampled is None else sampled[req.req_id])
                if len(out) >= req.sampling.max_tokens:
                    done.append(req)
        for req in done:
            self._release(req)
            self.running.remove(req)
            self.finished.append(req)
        return done


@functools.lru_cache(maxsize=None)
def _argmax_chunks(vocab: int) -> int:
    """How many chunks ``greedy`` splits a row of ``vocab`` logits into: the largest divisor of
    ``vocab`` that leaves chunks of at least 512 (1: a plain argmax)."""
    return next((c for c in range(vocab // 512, 1, -1) if vocab % c == 0), 1)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """(N, V) logits -> (N,) int64: ``logits.argmax(-1)`` (the first maximum), in two passes.

    torch reduces each row of an argmax in one thread block, which is slow for few rows (one
    row of a 128k vocabulary: 37 us on an H100). The maxima of ``C`` chunks of each row first
    (N * C blocks), then the argmax over them, give the same index (ties go to the first
    maximum in both passes, NaN wins as in ``argmax``); a batch-1 decode step of the 1B
    example model on an H100 takes 14 us less. On CUDA, vattn's Triton argmax does the same in
    two kernels instead of four (``examples.argmax``; ``profile-greedy``).
    """
    if logits.is_cuda and logits.dtype in (torch.float16, torch.bfloat16, torch.float32) and logits.stride(-1) == 1:
        from examples.argmax import argmax

        return argmax(logits)
    n, vocab = logits.shape
    chunks = _argmax_chunks(vocab)
    if chunks == 1:
        return logits.argmax(dim=-1)
    values, index = logits.reshape(n, chunks, vocab // chunks).max(dim=-1)
    best = values.argmax(dim=-1)
    # A tensor of its own, not a view: the next step may take it as its input_ids.
    return torch.add(index.gather(-1, best[:, None]).squeeze(-1), best, alpha=vocab // chunks)


def sample(logits: torch.Tensor, temperature: torch.Tensor | None = None, top_p: torch.Tensor | None = None,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """(N, V) logits, (N,) temperature and top_p -> (N,) int64 tokens.

    Greedy where ``temperature == 0`` (or everywhere when ``temperature`` is None).
    """
    top = greedy(logits)
    if temperature is None:
        return top
    if top_p is None:
        top_p = torch.ones_like(temperature)
    probs = torch.softmax(logits.float() / temperature.clamp_min(1e-5)[:, None], dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
    drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]
    choice = torch.multinomial(sorted_probs.masked_fill(drop, 0.0), 1, generator=generator)
    return torch.where(temperature > 0, order.gather(-1, choice).squeeze(-1), top)


@dataclass
class _InFlight:
    """A step's samples on their way to the host."""

    tokens: torch.Tensor  # (S,) int64 on the device: the next step's inputs read them there
    host: torch.Tensor  # (S,) int64 on the host (pinned on CUDA), written by a non-blocking copy
    done: torch.cuda.Event | None  # recorded after the copy (None on CPU: the copy is done)
    rows: dict[int, int]  # req_id -> row of ``tokens``
    outputs: list[list[int]]  # per row, the ``output_token_ids`` its token goes into ...
    index: list[int]  # ... at this index (its PENDING entry)
    scheduled: list[tuple[Request, int]]  # the step's schedule (the scheduler's list object)
    every: bool  # every scheduled request samples, in schedule order (rows 0..S-1)


def _prompt_ids(prompt: object, vocab_size: int | None) -> list[int]:
    """``prompt`` (a sequence, or a 1-D integer numpy array or tensor) as a list of int token ids,
    checked once, where the request arrives: non-empty, integers (a float or bool id is refused,
    never truncated), each in ``[0, vocab_size)`` (``>= 0`` when the model states no vocabulary)."""
    where = "add_request: prompt_token_ids"
    batch_hint = "one request's ids, 1-D; for several prompts call add_request once per prompt"
    if isinstance(prompt, (torch.Tensor, np.ndarray)):
        dtype, shape = prompt.dtype, tuple(prompt.shape)
        integer = (dtype.kind in "iu" if isinstance(prompt, np.ndarray)
                   else not (dtype == torch.bool or dtype.is_floating_point or dtype.is_complex))
        if not integer or len(shape) != 1:
            raise TypeError(f"{where} must be a 1-D integer array of token ids, got dtype {dtype} and shape {shape}; "
                            f"pass {batch_hint} (float and bool ids are refused, not converted).")
        ids = prompt.tolist()
    elif isinstance(prompt, Sequence) and not isinstance(prompt, (str, bytes)):
        ids = list(prompt)
    else:
        raise TypeError(f"{where} must be a sequence of integer token ids (e.g. a list of int), got "
                        f"{type(prompt).__name__}; tokenize text first and pass {batch_hint}.")
    if not ids:
        raise ValueError(f"{where} is empty; a request needs at least one prompt token (e.g. the BOS id).")
    if not all(type(t) is int for t in ids):  # the common case in one pass; else find what is wrong
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                raise TypeError(f"{where}[{i}] is {t!r} ({type(t).__name__}); token ids must be integers (float "
                                f"and bool ids are refused, not truncated); pass {batch_hint}.")
        ids = [int(t) for t in ids]  # numpy integers
    if min(ids) < 0 or (vocab_size is not None and max(ids) >= vocab_size):
        i, t = next((i, t) for i, t in enumerate(ids) if t < 0 or (vocab_size is not None and t >= vocab_size))
        valid = f"[0, {vocab_size}) (the model's config.vocab_size)" if vocab_size is not None else ">= 0"
        raise ValueError(f"{where}[{i}] is {t}, outside the vocabulary: token ids must be in {valid}; pass ids "
                         "from the model's own tokenizer (no padding or -1 entries: only the prompt's tokens).")
    return ids


@dataclass
class StepStats:
    num_prefill_tokens: int
    num_decode_tokens: int
    num_new_outputs: int
    seconds: float
    #: Requests this step finished with an error (``Request.error``); their tokens were not computed.
    num_failed: int = 0


class Engine:
    """Runs requests to completion over ``kv`` with ``model``.

    Args:
        model: ``examples.model.DecoderForCausalLM`` (or anything with ``forward(ids, pos)``
            and ``compute_logits``), built under ``vattn_config``.
        kv: the ``vattn.PagedKVCache`` bound to the model's layers (for a model with mixer layers,
            allocated with ``num_state_slots >= max_num_seqs``).
        forward_fn: what runs ``model.forward`` inside ``vattn.set_forward_context`` (e.g. a
            compiled model); default: the model.
        graph_runner: a ``vattn.CUDAGraphRunner`` (``runner(input_ids, positions, common)``); when
            given it replaces ``forward_fn``: it pads the batch, builds the metadata and sets the
            forward context itself.
        pad_tokens_to: pad each step's token count up to a multiple of this (an integer >= 1;
            padding has slot -1).
        record_logits: keep every sampled row of logits (on CPU) in ``self.logits[req_id]`` (tests).
        token_sync: called on each step's sampled tokens ((N,) int64 on ``device``) before they
            reach the scheduler; returns the tokens to use. Tensor parallelism passes
            ``TensorParallel.broadcast_from_first``: every rank runs this same deterministic
            scheduler, and rank 0's samples are the ones every rank keeps, so the ranks never
            diverge (not even on a near-tie or with temperature sampling).
        async_scheduling: prepare and launch each step before the previous one's tokens reach
            the host (see the module docstring); False syncs on every step's tokens.

    Requests are checked where they arrive (``add_request``): integer token ids inside the
    model's vocabulary, ``SamplingParams`` checked by itself. A request that still makes a step
    raise is finished with that error (``Request.error``) and the others go on (``step``).
    """

    def __init__(self, model: torch.nn.Module, vattn_config: vattn.VattnConfig, kv: "vattn.PagedKVCache", *,
                 device: torch.device | str, max_num_batched_tokens: int = 512, max_num_seqs: int = 64,
                 chunked_prefill: bool = True, forward_fn: Callable[..., torch.Tensor] | None = None,
                 graph_runner: Callable[..., torch.Tensor] | None = None, pad_tokens_to: int = 1,
                 seed: int = 0, record_logits: bool = False,
                 check_invariants: bool = False,
                 token_sync: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 async_scheduling: bool = True) -> None:
        self.model, self.cfg, self.kv = model, vattn_config, kv
        self.device = torch.device(device)
        self.forward_fn = forward_fn if forward_fn is not None else model
        self.graph_runner = graph_runner
        if isinstance(pad_tokens_to, bool) or not isinstance(pad_tokens_to, int) or pad_tokens_to < 1:
            raise (ValueError if isinstance(pad_tokens_to, int) and not isinstance(pad_tokens_to, bool) else TypeError)(
                f"Engine: pad_tokens_to must be an integer >= 1 (each step's token count is padded up to a "
                f"multiple of it), got {pad_tokens_to!r}; pass 1 for no padding.")
        if graph_runner is not None and pad_tokens_to != 1:
            raise ValueError("with graph_runner, leave pad_tokens_to at 1: the runner pads.")
        self.block_size = kv.block_size
        #: The model keeps mixer state per request (slot = the request's InputBatch row).
        self.stateful = bool(getattr(kv, "states", None))
        if self.stateful and kv.num_state_slots < max_num_seqs:
            raise ValueError(
                f"Engine: kv has {kv.num_state_slots} state slots for the model's mixer layers, expected at least "
                f"max_num_seqs = {max_num_seqs} (each running request uses the slot of its InputBatch row); "
                f"allocate the cache with vattn.allocate_kv_cache(..., num_state_slots={max_num_seqs}).")
        self.allocator = BlockAllocator(kv.num_blocks)
        limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        self.scheduler = Scheduler(self.allocator, self.block_size, max_num_batched_tokens=max_num_batched_tokens,
                                   max_num_seqs=max_num_seqs, chunked_prefill=chunked_prefill, device=self.device,
                                   max_model_len=limit if isinstance(limit, int) and limit > 0 else None,
                                   pad_tokens_to=pad_tokens_to)
        self.pad_tokens_to = pad_tokens_to
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.record_logits = record_logits
        self.logits: dict[int, list[torch.Tensor]] = {}
        self.check_invariants = check_invariants
        self.token_sync = token_sync
        self.async_scheduling = async_scheduling
        self._inflight: _InFlight | None = None
        self._pin = self.device.type == "cuda"
        self._host_ring: list[tuple[torch.Tensor, torch.cuda.Event]] | None = None  # see _send_to_host
        self._ring_turn = 0
        self.step_count = 0
        self._next_id = 0
        # Greedy sampling of one-row FULL-graph decode steps replayed from a CUDA graph of its own
        # (``_greedy_from_graph``): key -> (graph, its (1,) token), or None when seen once.
        self._head_graphs: dict[tuple[object, ...], tuple[torch.cuda.CUDAGraph, torch.Tensor] | None] = {}
        self._head_pool = None
        self._sampler_cache: tuple[object, list[Request], bool, bool, dict[int, int], int] | None = None
        self._sampler_step = -1

    def add_request(self, prompt_token_ids: Sequence[int] | np.ndarray | torch.Tensor,
                    sampling: SamplingParams | None = None, arrival_step: int = 0) -> Request:
        """Queue a request; returns it (its ``output_token_ids`` fill as steps run).

        Args:
            prompt_token_ids: a non-empty sequence of integer token ids in ``[0, vocab_size)``
                (the model's ``config.vocab_size``): a list, or a 1-D integer numpy array or tensor.
                Floats and bools are refused, not converted.
            sampling: ``SamplingParams`` (default: greedy, 16 tokens); ``max_tokens=0`` finishes
                the request at once, with no outputs.
            arrival_step: the first step that may schedule it (an integer >= 0).

        Raises ``TypeError`` / ``ValueError`` naming the argument, before anything is queued.
        """
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise TypeError(f"add_request: sampling must be a SamplingParams (or None for greedy, 16 tokens), got "
                            f"{type(sampling).__name__}; pass SamplingParams(max_tokens=..., temperature=..., "
                            "top_p=...).")
        if isinstance(arrival_step, bool) or not isinstance(arrival_step, numbers.Integral) or arrival_step < 0:
            raise ValueError(f"add_request: arrival_step must be an integer >= 0 (the first step that may run the "
                             f"request), got {arrival_step!r}.")
        vocab = getattr(getattr(self.model, "config", None), "vocab_size", None)
        ids = _prompt_ids(prompt_token_ids, vocab if isinstance(vocab, int) else None)
        req = Request(self._next_id, ids, sampling or SamplingParams(), int(arrival_step))
        limit = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        total = len(req.prompt_token_ids) + req.sampling.max_tokens
        if isinstance(limit, int) and total > limit:
            raise ValueError(
                f"request {req.req_id}: expected prompt + max_tokens <= max_position_embeddings = {limit}, got "
                f"{len(req.prompt_token_ids)} + {req.sampling.max_tokens} = {total}; shorten the prompt or "
                "lower max_tokens.")
        self._next_id += 1
        self.scheduler.add(req)
        return req

    def _prepare(self, scheduled: list[tuple[Request, int]]
                 ) -> tuple[torch.Tensor, torch.Tensor, vattn.CommonAttentionMetadata, torch.Tensor | slice]:
        """Device inputs for one step: (input_ids (T_pad,), positions (T_pad,), common metadata,
        the rows whose logits sample ((S,) indices, or a slice when every token samples)).

        The metadata comes from the scheduler's ``InputBatch`` (its rows, one copy). Steady
        decoding (the same requests as the step in flight, one token each) reads its input ids
        from that step's samples on the device and its positions from the batch's computed
        counts: no per-request work. Otherwise the host's lists go in one copy each, and a
        ``PENDING`` token is read from the in-flight step's samples on the device."""
        sch = self.scheduler
        flight = self._inflight
        if scheduled is sch._last:
            rows, qlens = sch.rows, sch.query_lens
        else:  # a part of the schedule (``_isolate``)
            rows = np.fromiter((r.row for r, _ in scheduled), dtype=np.int64, count=len(scheduled))
            qlens = np.fromiter((n for _, n in scheduled), dtype=np.int64, count=len(scheduled))
        if (flight is not None and scheduled is flight.scheduled and flight.every
                and self.pad_tokens_to == 1 and scheduled is sch._steady):
            common = sch.batch.prepare(rows)  # one token each
            positions = torch.from_numpy(sch.batch.num_computed_tokens[rows])
            if self._pin:
                positions = positions.pin_memory().to(self.device, non_blocking=True)
            return flight.tokens, positions, common, slice(0, len(scheduled))
        ids: list[int] = []
        pos: list[int] = []
        sample_rows: list[int] = []
        dst: list[int] = []  # positions in ids of PENDING tokens ...
        src: list[int] = []  # ... and their rows in the in-flight step's samples
        for req, n in scheduled:
            c = req.num_computed_tokens
            ids += req.token_ids(c, c + n)
            pos += range(c, c + n)
            if c + n == req.num_tokens:
                sample_rows.append(len(ids) - 1)
                if ids[-1] == PENDING:  # only a request's newest token can be pending
                    assert flight is not None
                    dst.append(len(ids) - 1)
                    src.append(flight.rows[req.req_id])
                    ids[-1] = 0
        t = len(ids)
        t_pad = -(-t // self.pad_tokens_to) * self.pad_tokens_to
        common = sch.batch.prepare(rows, qlens, num_tokens_padded=t_pad)
        pad = [0] * (t_pad - t)
        # Each input a tensor of its own (a compiled model guards on views and storage offsets).
        positions = torch.tensor(pos + pad, dtype=torch.long, pin_memory=self._pin).to(self.device, non_blocking=True)
        if flight is not None and t == t_pad == len(dst) == flight.tokens.shape[0] and dst == src == list(range(t)):
            return flight.tokens, positions, common, slice(0, t)  # decoding: the last step's samples in order
        input_ids = torch.tensor(ids + pad, dtype=torch.long, pin_memory=self._pin).to(self.device, non_blocking=True)
        every = len(sample_rows) == t  # every token samples (a decode batch): no gather of the rows
        rows_t: torch.Tensor | slice = slice(0, t)
        if dst or not every:
            aux = torch.tensor(([] if every else sample_rows) + dst + src, dtype=torch.long, pin_memory=self._pin)
            idx, dst_t, src_t = aux.to(self.device, non_blocking=True).split(
                [0 if every else len(sample_rows), len(dst), len(src)])
            rows_t = rows_t if every else idx
            if dst:
                assert flight is not None
                input_ids[dst_t] = flight.tokens[src_t]
        return input_ids, positions, common, rows_t

    @torch.no_grad()  # not inference_mode: mixing inference tensors in makes a compiled model retrace
    def step(self) -> StepStats:
        """Schedule, run and sample one step (fast-forwards over steps where nothing has arrived).

        With async scheduling this returns once the step is launched: the tokens it samples are
        ``PENDING`` in ``Request.output_token_ids`` until the next step (or ``flush``) writes them.

        If preparing, running or sampling the step raises, the step advances no request; the
        requests that make it raise on their own are found by running parts of the batch again
        (``_isolate``) and finished with their error (``Request.error``, blocks freed, logged);
        the others run again in the next step. The common path pays nothing for this (one
        ``try`` around the step). An error no single request causes is raised again, with the
        engine consistent (nothing advanced).
        """
        start = time.perf_counter()
        scheduled = self.scheduler.schedule(self.step_count)
        while not scheduled and self.scheduler.waiting and not self.scheduler.running:
            self.step_count = max(self.step_count + 1, self.scheduler.waiting[0].arrival_step)
            scheduled = self.scheduler.schedule(self.step_count)
        self.step_count += 1
        if not scheduled:
            return StepStats(0, 0, 0, 0.0)
        try:
            sampled, samplers = self._launch(scheduled)
        except Exception as error:  # noqa: BLE001  (attributed to requests by _isolate, else raised)
            failed = self._isolate(scheduled, error)
            if self.stateful:  # mixer states the step (or a trial) advanced part-way: recompute those requests
                running = set(map(id, self.scheduler.running))
                for req, _ in scheduled:
                    if id(req) in running:
                        self.scheduler.restart(req)
            if failed is None:
                raise
            if self.check_invariants:
                self.allocator.check(self.scheduler.running)
            return StepStats(0, 0, 0, time.perf_counter() - start, num_failed=len(failed))
        _, _, every, _, rows, decode = self._samplers(scheduled)
        host, done = self._send_to_host(sampled)
        self.scheduler.update(scheduled, None if every else {r.req_id: PENDING for r in samplers})
        steady = scheduled is self.scheduler._steady and every
        outputs = self.scheduler.steady_outputs if steady else [r.output_token_ids for r in samplers]
        flight = _InFlight(sampled, host, done, rows=rows, outputs=outputs, index=[n - 1 for n in map(len, outputs)],
                           scheduled=scheduled, every=every)
        self.flush()  # the previous step's tokens: done before this step's kernels started
        self._inflight = flight
        if not self.async_scheduling:
            self.flush()  # this step's tokens (waits for its kernels)
        if self.check_invariants:
            self.allocator.check(self.scheduler.running)
        tokens = int(self.scheduler.query_lens.sum()) if scheduled is self.scheduler._last else sum(n for _, n in scheduled)
        return StepStats(tokens - decode, decode, len(samplers),
                         time.perf_counter() - start)

    def _launch(self, scheduled: list[tuple[Request, int]], trial: bool = False
                ) -> tuple[torch.Tensor, list[Request]]:
        """Prepare, run and sample ``scheduled``: ((S,) int64 sampled tokens on the device, the S
        requests that sample, in row order). Changes no request; a ``trial`` (``_isolate``)
        records no logits."""
        input_ids, positions, common, rows = self._prepare(scheduled)
        if self.graph_runner is not None:
            hidden = self.graph_runner(input_ids, positions, common)
        else:
            with vattn.set_forward_context(self.kv.build_metadata(common), self.cfg):
                hidden = self.forward_fn(input_ids, positions)
        _, samplers, _, hot, _, _ = self._samplers(scheduled)
        temp = top_p = None
        if hot:
            temp = torch.tensor([r.sampling.temperature for r in samplers], device=self.device)
            top_p = torch.tensor([r.sampling.top_p for r in samplers], device=self.device)
        sampled = None
        if temp is None and not self.record_logits and self.token_sync is None and isinstance(rows, slice):
            sampled = self._greedy_from_graph(hidden)
        if sampled is None:
            logits = self.model.compute_logits(hidden[rows])
            sampled = sample(logits, temp, top_p, self.generator)
            if self.record_logits and not trial:
                for r, row in zip(samplers, logits.float().cpu()):
                    self.logits.setdefault(r.req_id, []).append(row)
        if self.token_sync is not None:
            sampled = self.token_sync(sampled)
        return sampled, samplers

    def _samplers(self, scheduled: list[tuple[Request, int]]
                  ) -> tuple[object, list[Request], bool, bool, dict[int, int], int]:
        """(``scheduled``, the requests that sample in row order, whether all do, whether any
        samples with temperature, req_id -> row, decode tokens). Kept while the scheduler
        returns the same steady schedule (its requests, all decoding, do not change)."""
        cached = self._sampler_cache
        if cached is not None and cached[0] is scheduled and scheduled is self.scheduler._steady:
            if self._sampler_step != self.step_count:  # a later step: its prompts are all cached by now
                cached = self._sampler_cache = cached[:5] + (len(scheduled),)
                self._sampler_step = self.step_count
            return cached
        samplers = [r for r, n in scheduled if r.num_computed_tokens + n == r.num_tokens]
        # A decode computes one generated token; everything else is (chunked) prefill or recompute.
        decode = sum(1 for r, n in scheduled if n == 1 and r.num_computed_tokens >= len(r.prompt_token_ids))
        out = (scheduled, samplers, len(samplers) == len(scheduled), any(r.sampling.temperature > 0 for r in samplers),
               {r.req_id: i for i, r in enumerate(samplers)}, decode)
        self._sampler_cache = out if scheduled is self.scheduler._steady else None
        self._sampler_step = self.step_count
        return out

    def _isolate(self, scheduled: list[tuple[Request, int]], error: Exception) -> list[Request] | None:
        """The requests of a step that raised ``error`` which make it raise on their own, each
        finished with its error (``Scheduler.fail``); None if there is none (only the whole batch
        fails). Bisects: each half that raises is split again, down to single requests, so one
        culprit among S requests costs about 2 log2(S) trial launches. Trials write K/V only at
        their requests' own new slots, which the step that computes those tokens writes again (a
        model's mixer states they advance are recomputed: ``step`` restarts the requests); their
        samples are dropped (with temperature they still draw from the engine's generator)."""
        culprits: list[tuple[Request, Exception]] = []

        def search(part: list[tuple[Request, int]], err: Exception) -> None:
            if len(part) == 1:
                culprits.append((part[0][0], err))
                return
            half = len(part) // 2
            for sub in (part[:half], part[half:]):
                try:
                    self._launch(sub, trial=True)
                except Exception as e:  # noqa: BLE001
                    search(sub, e)

        search(scheduled, error)
        if not culprits:
            logger.error("step %d failed and no single request makes it fail (%d scheduled); nothing advanced.",
                         self.step_count - 1, len(scheduled))
            return None
        for req, err in culprits:
            logger.warning("request %d is finished with an error raised in step %d (%d others scheduled go on): "
                           "%s: %s", req.req_id, self.step_count - 1, len(scheduled) - 1, type(err).__name__, err)
            self.scheduler.fail(req, err)
        return [r for r, _ in culprits]

    def _greedy_from_graph(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The greedy token of a one-row ``hidden`` ((1,) int64), replayed from a CUDA graph of
        the LM head and ``greedy``; None where that does not apply (the caller then runs them).

        Only for steps the graph runner replayed from a FULL graph, whose ``hidden`` is a slice
        of that graph's output at the same address every step, and without ``token_sync`` (a
        tensor-parallel LM head gathers across ranks). Eagerly the LM head and the argmax are
        about ten launches, 0.16 ms of host time a step on an H200 host, one graph replay
        instead: a batch-1 step, short enough for a slow host to bound it, then is not. One row
        only: at batch 64 the step is GPU-bound and the graph made it slower (1.565 - 1.570 ->
        1.587 ms, H200; ``profile-head-graph``). The first such step runs eagerly (which also
        compiles what it launches); the second captures the graph."""
        runner = self.graph_runner
        bd = getattr(runner, "last_batch_descriptor", None)
        if not (hidden.is_cuda and hidden.shape[0] == 1 and bd is not None and bd.mode is vattn.CUDAGraphMode.FULL):
            return None
        key = (hidden.data_ptr(), tuple(hidden.shape), hidden.stride(), hidden.dtype)
        entry = self._head_graphs.get(key, False)
        if entry is False:  # first sight: eager (warms up what the graph will launch)
            self._head_graphs[key] = None
            return None
        if entry is None:
            if self._head_pool is None:
                self._head_pool = torch.cuda.graph_pool_handle()
            # vattn's capture: the graph's GEMM gets a cuBLAS workspace of its own pool.
            graph, tokens = capture_graph(lambda: greedy(self.model.compute_logits(hidden)), self._head_pool)
            entry = self._head_graphs[key] = (graph, tokens)
        graph, tokens = entry
        graph.replay()
        return tokens

    def _send_to_host(self, sampled: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Start copying ``sampled`` to the host: (the host tensor, an event recorded after the
        copy; None on CPU, where the copy is done)."""
        if not self._pin:
            return sampled.cpu(), None
        # Two pinned buffers and events, used in turn: when a step sends its tokens, only the
        # step before it is unflushed (it holds the other pair). No pinned allocation and no new
        # event per step: host time, in a step the host bounds.
        n = sampled.shape[0]
        if self._host_ring is None or self._host_ring[0][0].shape[0] < n or self._host_ring[0][0].dtype != sampled.dtype:
            self._host_ring = [(torch.empty(max(n, self.scheduler.max_num_seqs), dtype=sampled.dtype, pin_memory=True),
                                torch.cuda.Event()) for _ in range(2)]
        self._ring_turn ^= 1
        buf, done = self._host_ring[self._ring_turn]
        host = buf[:n]
        host.copy_(sampled, non_blocking=True)
        done.record()
        return host, done

    def flush(self) -> None:
        """Wait for the step in flight and write its tokens into the requests (none stays ``PENDING``)."""
        flight, self._inflight = self._inflight, None
        if flight is None:
            return
        if flight.done is not None:
            flight.done.synchronize()
        for out, i, token in zip(flight.outputs, flight.index, flight.host.tolist()):
            out[i] = token

    def run(self, on_step: Callable[[StepStats], None] | None = None) -> list[StepStats]:
        """Step until every request has finished; returns the per-step stats."""
        stats = []
        while self.scheduler.has_unfinished():
            s = self.step()
            stats.append(s)
            if on_step is not None:
                on_step(s)
        self.flush()
        return stats

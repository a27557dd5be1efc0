"""Persistent host state of the requests an engine runs, and each step's
``CommonAttentionMetadata`` built from it incrementally (the role of vLLM's ``InputBatch`` and
``BlockTable``).

``build_common_attn_metadata`` takes a whole step's facts on every call and checks all of them.
An engine that runs the same requests step after step keeps them here instead, and pays per
step only for what a step changes:

- each request holds a *row*: its block ids (``block_table``, (R, W) int32) and its count of
  tokens already in the cache (``num_computed_tokens``, (R,) int64, the caller's to advance);
- block ids are checked once, where they enter (``add_row`` / ``append_blocks``): inside the
  cache, not twice in one row. A count per block of the rows that hold it catches, per step, a
  token written into a block another request holds (blocks shared read-only, as prefix caching
  shares them, are fine);
- ``prepare(rows, query_lens)`` checks what a step can change (the rows, the lengths, that each
  row's blocks cover its new tokens) with a few vectorized operations, gathers the rows into a
  staging buffer and makes one host-to-device copy, without a host sync.

Contract:

- The metadata ``prepare`` returns is valid for its step and the one after it: its tensors are
  views of a ring of two staging (pinned) and two device buffers, which the next-but-one
  ``prepare`` reuses. Before writing a staging buffer, ``prepare`` waits for the copy that last
  read it (an event recorded after that copy, two steps ago; with one step in flight it has long
  finished). So ``prepare`` for step N+1 may run while step N runs on the GPU.
- Rows and their blocks may change between steps (``append_blocks``, ``free_row``, edits of
  ``num_computed_tokens``); a step reads them when it is prepared, not when it runs.
- A CUDA-graph runner copies the metadata into its own persistent buffers
  (``vattn.CUDAGraphRunner``), so graphs never read these views.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from vattn.core.metadata import CommonAttentionMetadata
from vattn.core.batch_checks import StepChecks, fail
from vattn.metadata import _int_kind

__all__ = ["InputBatch"]

_ALIGN = 16  # bytes: each array in the staging buffer starts aligned (Triton specialises on it)


def _ids(name: str, values: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
    """``values`` as a flat int64 array, or ``TypeError`` naming ``name`` for anything but integers."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    return _int_kind(name, np.asarray(values), "pass a list of Python ints or an integer array.").reshape(-1)


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"InputBatch: {name}: expected an int >= 1, got {value!r}; pass the engine's limit.")
    return int(value)


class InputBatch:
    """Rows of requests (block ids, computed-token counts) kept across steps; one step's
    ``CommonAttentionMetadata`` per ``prepare`` call.

    Args:
        max_num_reqs: rows (requests that hold blocks at once).
        max_blocks_per_req: columns of the block table (the longest request's blocks).
        block_size / num_blocks: the KV cache's (``kv.block_size``, ``kv.num_blocks``).
        device: where the metadata's device tensors go (``kv.device``).
        max_num_tokens: the most tokens (padded) one step may hold.

    Example (the example engine's use)::

        batch = vattn.InputBatch(max_num_reqs=64, max_blocks_per_req=128, block_size=kv.block_size,
                                 num_blocks=kv.num_blocks, device=kv.device, max_num_tokens=512)
        row = batch.add_row(block_ids=[3, 4])                  # a new request's first blocks
        common = batch.prepare(np.array([row]), np.array([20]))
        batch.num_computed_tokens[row] += 20                   # after the step
        batch.append_blocks(row, [9])                          # as it grows
        batch.free_row(row)                                    # when it finishes
    """

    def __init__(self, *, max_num_reqs: int, max_blocks_per_req: int, block_size: int, num_blocks: int,
                 device: torch.device | str, max_num_tokens: int) -> None:
        self.max_num_reqs = _positive("max_num_reqs", max_num_reqs)
        self.max_blocks_per_req = _positive("max_blocks_per_req", max_blocks_per_req)
        self.block_size = _positive("block_size", block_size)
        self.num_blocks = _positive("num_blocks", num_blocks)
        self.max_num_tokens = _positive("max_num_tokens", max_num_tokens)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # as tensors report it: cuda:<current>
            self.device = torch.device("cuda", torch.cuda.current_device())
        #: (R, W) int32: row r's block ids in its first ``num_blocks_per_row[r]`` columns.
        self.block_table = np.zeros((self.max_num_reqs, self.max_blocks_per_req), dtype=np.int32)
        #: (R,) int32: block ids each row holds.
        self.num_blocks_per_row = np.zeros(self.max_num_reqs, dtype=np.int32)
        #: (R,) int64: tokens each row has in the cache before the next step (the caller advances it).
        self.num_computed_tokens = np.zeros(self.max_num_reqs, dtype=np.int64)
        self._live = np.zeros(self.max_num_reqs, dtype=np.int64)  # 1: the row is in use
        #: (R,) int64: tokens each row's blocks hold (``num_blocks_per_row * block_size``; read only).
        self.capacity = np.zeros(self.max_num_reqs, dtype=np.int64)
        self._holders = np.zeros(self.num_blocks, dtype=np.int32)  # rows holding each block
        self._free_rows = list(range(self.max_num_reqs - 1, -1, -1))
        self._max_block = -1  # the largest block id ever appended (a bound for StepChecks)
        self._epoch = 0  # rows added or freed so far
        self._rows_checked: np.ndarray | None = None  # a read-only rows array prepare checked ...
        self._rows_epoch = -1  # ... at this epoch
        self._arange = np.arange(self.max_num_reqs + 1, dtype=np.int32)
        # The staging layout: qsl (R+1) int32, seq (R) int32, slots (T) int64, table (R, W) int32,
        # rows (R) int32 (the state slots of mixer layers).
        r, t, w = self.max_num_reqs, self.max_num_tokens, self.max_blocks_per_req
        self._nbytes = sum(-(-n // _ALIGN) * _ALIGN for n in (4 * (r + 1), 4 * r, 8 * t, 4 * r * w, 4 * r))
        cuda = self.device.type == "cuda"
        self._staging = [torch.empty(self._nbytes, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
        self._dev = [torch.empty(self._nbytes, dtype=torch.uint8, device=self.device) for _ in range(2)] if cuda else None
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        # Views of a staging buffer and its device copy per (turn, B, T, W): a steady decode
        # step meets the same shapes step after step, and each tensor view costs the host.
        self._views_cache: dict[tuple[int, int, int, int], tuple[tuple[np.ndarray, ...], tuple[torch.Tensor, ...],
                                                                    int]] = {}

    # ---- rows ---------------------------------------------------------------------------------

    def add_row(self, block_ids: Sequence[int] | np.ndarray = (), num_computed_tokens: int = 0) -> int:
        """A row for a new request (its first ``block_ids``, ``num_computed_tokens`` cached); returns it."""
        if not self._free_rows:
            fail("InputBatch.add_row", f"at most max_num_reqs = {self.max_num_reqs} rows in use",
                 "a request more", "free the rows of finished requests (free_row) or raise max_num_reqs")
        if isinstance(num_computed_tokens, bool) or not isinstance(num_computed_tokens, (int, np.integer)) \
                or num_computed_tokens < 0:
            fail("InputBatch.add_row: num_computed_tokens", "an int >= 0", repr(num_computed_tokens),
                 "pass the tokens the request already has in the cache")
        row = self._free_rows.pop()
        self._epoch += 1
        self._live[row] = 1
        self.num_blocks_per_row[row] = 0
        self.capacity[row] = 0
        self.num_computed_tokens[row] = num_computed_tokens
        try:
            self.append_blocks(row, block_ids)
        except (TypeError, ValueError):
            self._live[row] = 0
            self._free_rows.append(row)
            raise
        return row

    def append_blocks(self, row: int, block_ids: Sequence[int] | np.ndarray) -> None:
        """Append ``block_ids`` to ``row``'s blocks, checked here once: ids in ``[0, num_blocks)``,
        none already in the row, the row within ``max_blocks_per_req``."""
        self._check_row(row)
        ids = _ids("InputBatch.append_blocks: block_ids", block_ids)
        if not ids.size:
            return
        start = int(self.num_blocks_per_row[row])
        end = start + ids.size
        if ids.min() < 0 or ids.max() >= self.num_blocks:
            bad = ids[(ids < 0) | (ids >= self.num_blocks)]
            fail("InputBatch.append_blocks: block_ids", f"block ids in [0, num_blocks = {self.num_blocks})",
                 bad[:4].tolist(), "use ids of blocks allocated in this cache (kv.num_blocks)")
        if end > self.max_blocks_per_req:
            fail("InputBatch.append_blocks", f"at most max_blocks_per_req = {self.max_blocks_per_req} blocks a row",
                 f"{end} for row {row}", "raise max_blocks_per_req to the longest request's blocks")
        # A block already in the row is held by some row: only those (usually none: fresh blocks
        # from a free list) are looked up in the row.
        shared = ids[self._holders[ids] > 0]
        if (ids.size > 1 and len(set(ids.tolist())) != ids.size) or (
                shared.size and np.isin(shared, self.block_table[row, :start]).any()):
            fail("InputBatch.append_blocks: block_ids", "ids not yet in the row (each block once per request)",
                 f"{ids.tolist()[:8]} for row {row}, which holds {self.block_table[row, :start].tolist()[:8]}",
                 "give every block_size positions of a request a block of their own")
        self.block_table[row, start:end] = ids
        self.num_blocks_per_row[row] = end
        self.capacity[row] = end * self.block_size
        self._holders[ids] += 1  # distinct ids: no repeated index
        self._max_block = max(self._max_block, int(ids.max()))

    def append_block_each(self, rows: np.ndarray, block_ids: np.ndarray) -> None:
        """Append one block to each of ``rows`` (``block_ids[i]`` to ``rows[i]``): the common case
        of decoding requests that start a new block, checked in one vectorized pass (ids in
        ``[0, num_blocks)``, distinct, fresh or not yet in their row, room in each row)."""
        rows = np.asarray(rows, dtype=np.int64)
        ids = _ids("InputBatch.append_block_each: block_ids", block_ids)
        if rows.shape != ids.shape:
            fail("InputBatch.append_block_each: rows / block_ids", "one block id per row", f"{rows.shape[0]} rows "
                 f"and {ids.shape[0]} ids", "pass one new block id for each row")
        if not ids.size:
            return
        if rows.min() < 0 or rows.max() >= self.max_num_reqs or not self._live[rows].all() or \
                len(set(rows.tolist())) != rows.size:
            fail("InputBatch.append_block_each: rows", "distinct rows in use (add_row's results)",
                 rows.tolist()[:16], "use the rows add_row returned, once each")
        if ids.min() < 0 or ids.max() >= self.num_blocks or len(set(ids.tolist())) != ids.size:
            fail("InputBatch.append_block_each: block_ids", f"distinct block ids in [0, num_blocks = "
                 f"{self.num_blocks})", ids.tolist()[:16], "use ids of blocks allocated in this cache, one per row")
        ends = self.num_blocks_per_row[rows].astype(np.int64)
        if ends.max() >= self.max_blocks_per_req:
            fail("InputBatch.append_block_each", f"at most max_blocks_per_req = {self.max_blocks_per_req} blocks a "
                 "row", f"{int(ends.max()) + 1} for row {int(rows[ends.argmax()])}",
                 "raise max_blocks_per_req to the longest request's blocks")
        for i in np.flatnonzero(self._holders[ids] > 0).tolist():  # held elsewhere (shared): not in its own row yet
            if (self.block_table[rows[i], : ends[i]] == ids[i]).any():
                fail("InputBatch.append_block_each: block_ids", "ids not yet in the row (each block once per request)",
                     f"block {int(ids[i])} for row {int(rows[i])}, which holds it already",
                     "give every block_size positions of a request a block of their own")
        self.block_table[rows, ends] = ids
        self.num_blocks_per_row[rows] = ends + 1
        self.capacity[rows] = (ends + 1) * self.block_size
        self._holders[ids] += 1
        self._max_block = max(self._max_block, int(ids.max()))

    def free_row(self, row: int) -> None:
        """Release ``row`` (its request finished or was preempted); its blocks leave the batch."""
        self._check_row(row)
        n = int(self.num_blocks_per_row[row])
        self._holders[self.block_table[row, :n]] -= 1  # distinct within a row
        self.num_blocks_per_row[row] = 0
        self.capacity[row] = 0
        self.num_computed_tokens[row] = 0
        self._live[row] = 0
        self._free_rows.append(row)
        self._epoch += 1

    def _check_row(self, row: object) -> None:
        if isinstance(row, bool) or not isinstance(row, (int, np.integer)) or not 0 <= row < self.max_num_reqs \
                or not self._live[row]:
            fail("InputBatch: row", f"a row in use (add_row's result, below {self.max_num_reqs})", repr(row),
                 "use the row add_row returned for the request, before free_row")

    # ---- a step ---------------------------------------------------------------------------------

    def prepare(self, rows: np.ndarray, query_lens: np.ndarray | None = None, *, num_tokens_padded: int | None = None,
                causal: bool = True) -> CommonAttentionMetadata:
        """One step's metadata for ``rows`` ((B,) int, distinct rows in use, decodes first) with
        ``query_lens`` ((B,) int >= 0; None: one each, a decode batch) new tokens each, at
        positions ``num_computed_tokens[row] ...``.

        Checks, vectorized: rows in use and distinct, lengths >= 0, each row's blocks cover its
        new tokens, and no token is written into a block another row holds. Nothing is written
        to the cache here. ``num_tokens_padded``: pad the tokens to this many (slot -1).

        A read-only ``rows`` array (``rows.setflags(write=False)``) checked by an earlier call is
        not checked again while no row was added or freed: an engine that runs the same requests
        step after step passes the same array. The rows are also the requests' state slots
        (``state_indices``) for models with mixer layers: ``allocate_kv_cache(num_state_slots=max_num_reqs)``."""
        rows = np.asarray(rows)
        decode = query_lens is None
        qlens = rows if decode else np.asarray(query_lens)  # (decode: only its dtype and shape are read)
        b = rows.shape[0]
        if rows.dtype.kind not in "iu" or qlens.dtype.kind not in "iu" or qlens.shape != (b,) or rows.ndim != 1:
            fail("InputBatch.prepare: rows / query_lens", "two 1-D integer arrays of one length",
                 f"{rows.dtype}{tuple(rows.shape)} and {qlens.dtype}{tuple(qlens.shape)}",
                 "pass one row (add_row's result) and one new-token count per request")
        if b and not (rows is self._rows_checked and self._rows_epoch == self._epoch):
            # One count per row covers range, use and distinctness (bincount refuses negatives).
            counts = np.bincount(rows, minlength=self.max_num_reqs) if rows.min() >= 0 else None
            if counts is None or counts.shape[0] != self.max_num_reqs or (counts > self._live).any():
                fail("InputBatch.prepare: rows", "distinct rows in use (add_row's results)", rows.tolist()[:16],
                     "schedule each request once, by the row add_row returned")
            if not rows.flags.writeable and rows.base is None:
                self._rows_checked, self._rows_epoch = rows, self._epoch
        if not decode:
            qlens = qlens.astype(np.int64, copy=False)
        computed = self.num_computed_tokens[rows]
        seq = computed + 1 if decode else computed + qlens
        # Counts >= 0 and blocks covering the new tokens, in one reduction: (x | y) < 0 iff either is.
        room = self.capacity[rows] - seq
        if b and (room | computed if decode else room | computed | qlens).min() < 0:
            self._explain(rows, np.ones(b, np.int64) if decode else qlens, computed, seq)
        num_tokens = b if decode else int(qlens.sum())
        t_pad = num_tokens if num_tokens_padded is None else int(num_tokens_padded)
        if not num_tokens <= t_pad <= self.max_num_tokens:
            fail("InputBatch.prepare: tokens", f"between the step's {num_tokens} tokens and max_num_tokens = "
                 f"{self.max_num_tokens}", t_pad, "schedule fewer tokens or raise max_num_tokens")
        max_seq = int(seq.max(initial=0))
        width = max(-(-max_seq // self.block_size), 1)
        (qsl, seq_v, slots, table, state), (qsl_d, seq_d, slot_d, table_d, state_d), end = self._buffers(b, t_pad, width)
        state[:] = rows
        seq_v[:] = seq
        if decode:
            qsl[:] = self._arange[: b + 1]
            max_q = min(b, 1)
        else:
            qsl[0] = 0
            np.cumsum(qlens, out=qsl[1:])
            max_q = int(qlens.max(initial=0))
        if max_q == 1 and num_tokens == b:  # decodes: one token each, at the computed count
            req, pos = rows, computed
        else:
            owner = np.repeat(np.arange(b), qlens)
            req = rows[owner]
            pos = np.arange(num_tokens) - qsl[:-1][owner] + computed[owner]
        written = self.block_table[req, pos // self.block_size]
        if written.size and self._holders[written].max() > 1:
            k = int(np.nonzero(self._holders[written] > 1)[0][0])
            fail("InputBatch.prepare", "every block written this step held by the row writing it only",
                 f"block {int(written[k])} written by row {int(req[k])} and held by {int(self._holders[written[k]])} "
                 "rows", "give each request blocks of its own to write (share only full, read-only prefix blocks)")
        np.multiply(written, self.block_size, out=slots[:num_tokens])
        slots[:num_tokens] += pos % self.block_size
        slots[num_tokens:] = -1
        self.block_table[:, :width].take(rows, axis=0, out=table)
        self._copy(end)
        qsl_c, seq_c = torch.from_numpy(qsl), torch.from_numpy(seq_v)
        checks = StepChecks(refs=(qsl_c, seq_c, table_d, slot_d), device=self.device, max_seq_len=max_seq,
                            table_width=width, block_size=self.block_size, max_block=max(self._max_block, 0))
        return CommonAttentionMetadata(
            query_start_loc=qsl_d, query_start_loc_cpu=qsl_c, seq_lens=seq_d, seq_lens_cpu=seq_c,
            num_computed_tokens_cpu=torch.from_numpy(computed.astype(np.int32)), num_reqs=b,
            num_actual_tokens=num_tokens, max_query_len=max_q, block_table_tensor=table_d, slot_mapping=slot_d,
            max_seq_len=max_seq, causal=causal, host_checks=checks, state_indices=state_d,
            state_indices_cpu=torch.from_numpy(state))

    def _explain(self, rows: np.ndarray, qlens: np.ndarray, computed: np.ndarray, seq: np.ndarray) -> None:
        """Raise the ``ValueError`` for the first request whose counts are negative or whose
        blocks do not cover its new tokens."""
        if qlens.min() < 0 or computed.min() < 0:
            fail("InputBatch.prepare: query_lens / num_computed_tokens", "counts >= 0",
                 f"{qlens.tolist()[:16]} / {computed.tolist()[:16]}", "pass one new-token count >= 0 per request")
        i = int(np.nonzero(seq > self.capacity[rows])[0][0])
        r = int(rows[i])
        fail(f"InputBatch.prepare: row {r}", f"ceil({int(seq[i])} / {self.block_size}) = "
             f"{-(-int(seq[i]) // self.block_size)} blocks for its {int(computed[i])} cached + {int(qlens[i])} new "
             "tokens", f"{int(self.num_blocks_per_row[r])} blocks", "append_blocks before scheduling the tokens")

    def _offsets(self, b: int, t: int, width: int) -> tuple[int, int, int, int, int, int]:
        """Byte offsets of (qsl, seq, slots, table, rows) in a staging buffer for this step, and its end."""
        o_seq = -(-4 * (b + 1) // _ALIGN) * _ALIGN
        o_slot = o_seq + -(-4 * b // _ALIGN) * _ALIGN
        o_table = o_slot + -(-8 * t // _ALIGN) * _ALIGN
        o_rows = o_table + -(-4 * b * width // _ALIGN) * _ALIGN
        return 0, o_seq, o_slot, o_table, o_rows, o_rows + 4 * b

    def _buffers(self, b: int, t: int, width: int) -> tuple[tuple[np.ndarray, ...], tuple[torch.Tensor, ...], int]:
        """(numpy views of the next staging buffer, the typed device views its copy lands in,
        bytes used) for a step of ``b`` requests, ``t`` tokens and ``width`` table columns, once
        the copy that last read that buffer is done."""
        self._turn ^= 1
        done = self._copied[self._turn]
        if done is not None:
            done.synchronize()  # the copy of two steps ago: finished unless the host ran ahead twice
        key = (self._turn, b, t, width)
        hit = self._views_cache.get(key)
        if hit is not None:
            return hit
        if len(self._views_cache) > 256:
            self._views_cache.clear()
        o_qsl, o_seq, o_slot, o_table, o_rows, end = self._offsets(b, t, width)
        buf = self._staging[self._turn].numpy()
        host = (buf[o_qsl:o_seq][: 4 * (b + 1)].view(np.int32), buf[o_seq:o_slot][: 4 * b].view(np.int32),
                buf[o_slot:o_table][: 8 * t].view(np.int64),
                buf[o_table:o_table + 4 * b * width].view(np.int32).reshape(b, width), buf[o_rows:end].view(np.int32))
        dev = self._staging[self._turn] if self._dev is None else self._dev[self._turn]
        i32, i64 = dev.view(torch.int32), dev.view(torch.int64)
        views = (i32[o_qsl // 4: o_qsl // 4 + b + 1], i32[o_seq // 4: o_seq // 4 + b],
                 i64[o_slot // 8: o_slot // 8 + t], i32[o_table // 4: o_table // 4 + b * width].view(b, width),
                 i32[o_rows // 4: o_rows // 4 + b])
        hit = self._views_cache[key] = (host, views, end)
        return hit

    def _copy(self, end: int) -> None:
        """Copy the first ``end`` staged bytes to the device (non-blocking; nothing on the CPU)."""
        if self._dev is None:
            return
        self._dev[self._turn][:end].copy_(self._staging[self._turn][:end], non_blocking=True)
        event = self._copied[self._turn] or torch.cuda.Event()
        event.record()
        self._copied[self._turn] = event

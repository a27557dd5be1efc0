"""``CommonAttentionMetadata`` from per-request facts: the block-table and slot-mapping arithmetic
a caller would otherwise write, vectorized on the host, with one host-to-device copy per step.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np
import torch

from vattn.core.metadata import CommonAttentionMetadata, to_device
from vattn.core.batch_checks import StepChecks, check_duplicate_blocks

__all__ = ["build_common_attn_metadata"]


def _int_kind(name: str, arr: np.ndarray, fix: str) -> np.ndarray:
    """``arr`` as int64, or a ``TypeError`` naming ``name`` when it holds anything but integers
    (floats would be truncated silently, booleans counted as 0 and 1)."""
    if arr.dtype.kind not in "iu" and arr.size:
        sample = arr.reshape(-1)[:6].tolist()
        raise TypeError(f"{name}: expected integers, got dtype {arr.dtype} ({sample}); {fix}")
    return arr.astype(np.int64, copy=False)


def _as_int_array(name: str, values: Sequence[int] | torch.Tensor | np.ndarray) -> np.ndarray:
    fix = "pass a list of Python ints or an integer tensor (e.g. [3, 1], torch.tensor([3, 1]))."
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name}: expected a flat sequence of ints, got {type(values).__name__} ({e}); {fix}") from None
    out = _int_kind(name, arr, fix).reshape(-1)
    if out.size and out.min() < 0:
        raise ValueError(f"{name}: expected non-negative counts, got {out.tolist()[:16]}; pass one count >= 0 per request.")
    return out


def _check_size(name: str, value: int | None, minimum: int) -> None:
    if value is None:
        return
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise TypeError(f"{name}: expected an int (or None), got {value!r} of type {type(value).__name__}; pass an int.")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}; pass a size of at least {minimum}.")


def _block_table_array(
    block_tables: Sequence[Sequence[int]] | torch.Tensor | np.ndarray, b: int, width: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """(table (b, width) int64, row lengths (b,)); tensor/array rows count as full width."""
    fix = "pass rows of int block ids (lists of ints, or an int32/int64 tensor)."
    if isinstance(block_tables, (torch.Tensor, np.ndarray)):
        arr = block_tables.detach().cpu().numpy() if isinstance(block_tables, torch.Tensor) else block_tables
        arr = _int_kind("block_tables", np.asarray(arr), fix)
        if arr.ndim != 2 or arr.shape[0] < b:
            raise ValueError(
                f"block_tables: expected a 2-D (num_reqs, max_blocks) tensor with at least {b} rows, "
                f"got shape {tuple(arr.shape)}; give one row of block ids per request."
            )
        arr = arr[:b]
        rows = np.full(b, arr.shape[1], dtype=np.int64)
    else:
        lists = list(block_tables)
        if len(lists) < b:
            raise ValueError(f"block_tables: expected a row per request ({b}), got {len(lists)} rows; "
                             "give one list of block ids per request.")
        lists = lists[:b]
        lens = [len(r) for r in lists]
        w = max(max(lens, default=1), 1)
        if b and all(n == w for n in lens):  # every row full: one conversion, no per-row copies
            arr = _int_kind("block_tables", np.array(lists).reshape(b, w), fix)
        else:  # ragged rows: one conversion of all ids, placed row-major into the padded table
            rows = np.array(lens, dtype=np.int64)
            flat = _int_kind("block_tables", np.array(list(itertools.chain.from_iterable(lists))), fix)
            arr = np.zeros((b, w), dtype=np.int64)
            arr[np.arange(w)[None, :] < rows[:, None]] = flat
        rows = np.array(lens, dtype=np.int64)
    if width is not None:
        if (rows > width).any() and not isinstance(block_tables, (torch.Tensor, np.ndarray)):
            raise ValueError(f"max_blocks_per_req: expected at least the longest block table row ({rows.max()}), "
                             f"got {width}; raise it or leave it None.")
        arr = np.pad(arr[:, :width], ((0, 0), (0, max(0, width - arr.shape[1]))))
        rows = np.minimum(rows, width)
    return arr, rows


def build_common_attn_metadata(
    query_lens: Sequence[int] | torch.Tensor,
    num_computed_tokens: Sequence[int] | torch.Tensor,
    block_tables: Sequence[Sequence[int]] | torch.Tensor | None,
    block_size: int,
    device: torch.device | str = "cpu",
    *,
    num_tokens_padded: int | None = None,
    num_reqs_padded: int | None = None,
    max_blocks_per_req: int | None = None,
    causal: bool = True,
    num_blocks: int | None = None,
    tree_parents: Sequence[int] | torch.Tensor | None = None,
    state_indices: Sequence[int] | torch.Tensor | None = None,
) -> CommonAttentionMetadata:
    """Turn per-request facts into ``CommonAttentionMetadata`` (vectorized host work, one copy each).

    Args:
        query_lens: (B,) new tokens of each request, decodes first.
        num_computed_tokens: (B,) tokens each request already has in the cache.
        block_tables: B rows of block ids (lists, or a (B, max_blocks) int tensor used as is);
            row r needs ``ceil(seq_len_r / block_size)`` ids. None for models without attention
            layers (only mixers): no K/V slot is written.
        block_size: tokens per block (the cache's).
        device: where the device tensors go (CPU mirrors are kept too).
        num_tokens_padded: pad the token dimension to this (padding slots are -1).
        num_reqs_padded: pad the request dimension to this (``num_reqs`` is then this). Padded
            requests take one padded token each while padded tokens remain (query length 1,
            sequence length 1 on block 0, never written), then query length 0: every kernel
            accepts them.
        max_blocks_per_req: width of ``block_table_tensor`` (default: the longest row).
        causal: False for encoder (bidirectional) attention.
        num_blocks: the cache's block count; block ids must be below it (checked when given).
        tree_parents: TREE_ATTN's draft trees: per new token, its parent's index among its request's
            new tokens (-1: the last cached token), flattened like the tokens; None: chains (causal).
        state_indices: (B,) the state slot of each request, for models with mixer layers
            (``vattn.GatedDeltaNet`` ...): distinct ids in ``[0, kv.num_state_slots)``, kept by a
            request from its first step to its last; a request whose ``num_computed_tokens`` is 0
            starts from a zero state whatever its slot holds. Padded requests get -1 (a scratch slot).

    New token ``i`` of request ``r`` sits at position ``num_computed_tokens[r] + i`` and goes to
    slot ``block_tables[r][pos // block_size] * block_size + pos % block_size``.
    """
    if not isinstance(block_size, (int, np.integer)) or isinstance(block_size, bool):
        raise TypeError(f"block_size: expected an int (the cache's tokens per block, kv.block_size), got "
                        f"{block_size!r} of type {type(block_size).__name__}; pass kv.block_size.")
    _check_size("block_size", block_size, 1)
    _check_size("num_tokens_padded", num_tokens_padded, 0)
    _check_size("num_reqs_padded", num_reqs_padded, 0)
    _check_size("max_blocks_per_req", max_blocks_per_req, 0)
    _check_size("num_blocks", num_blocks, 1)
    qlens = _as_int_array("query_lens", query_lens)
    computed = _as_int_array("num_computed_tokens", num_computed_tokens)
    b = qlens.shape[0]
    if computed.shape[0] != b:
        raise ValueError(
            f"query_lens / num_computed_tokens: expected one entry per request in each, got {b} and "
            f"{computed.shape[0]}; describe the same requests in both, in the same order."
        )
    no_cache = block_tables is None
    table, row_lens = (np.zeros((b, 1), np.int64), None) if no_cache else _block_table_array(
        block_tables, b, max_blocks_per_req)
    seq_lens = computed + qlens
    need = (seq_lens + (block_size - 1)) // block_size
    if no_cache:
        need = np.zeros_like(need)
    elif (row_lens < need).any():
        r = int(np.nonzero(row_lens < need)[0][0])
        raise ValueError(
            f"block_tables[{r}]: expected ceil(seq_len / block_size) = {need[r]} block ids for request {r}'s "
            f"{seq_lens[r]} tokens (num_computed_tokens {computed[r]} + query_len {qlens[r]}, block_size "
            f"{block_size}), got {row_lens[r]}; allocate more blocks for it."
        )
    # Block ids in use (each row's first ceil(seq_len / block_size)) must lie in [0, num_blocks),
    # and no block may be used twice by one request or written by one and used by another.
    full = bool(b) and int(need.min()) == table.shape[1]  # every column used (rows as long as needed)
    used = np.ones(table.shape, dtype=bool) if full else np.arange(table.shape[1])[None, :] < need[:, None]
    vals = table.reshape(-1) if full else table[used]
    max_block = int(vals.max()) if vals.size else None
    if vals.size and (vals.min() < 0 or (num_blocks is not None and max_block >= num_blocks)):
        bad = used & ((table < 0) | (table >= (num_blocks if num_blocks is not None else np.iinfo(np.int64).max)))
        r = int(np.nonzero(bad.any(1))[0][0])
        raise ValueError(
            f"block_tables[{r}]: expected block ids in [0, num_blocks = {num_blocks}), got "
            f"{table[r][bad[r]][:4].tolist()}; use ids of blocks allocated in this cache (kv.num_blocks)."
        )

    num_tokens, max_query_len = int(qlens.sum()), int(qlens.max(initial=0))
    t_pad = num_tokens if num_tokens_padded is None else num_tokens_padded
    b_pad = b if num_reqs_padded is None else num_reqs_padded
    if t_pad < num_tokens or b_pad < b:
        raise ValueError(
            f"num_tokens_padded / num_reqs_padded: expected at least the real {num_tokens} tokens / {b} requests, "
            f"got {num_tokens_padded} / {num_reqs_padded}; pad to a size at least the batch's (or pass None)."
        )
    # Padded requests: one padded token each while any remain, else none.
    all_q = qlens
    if b_pad > b:
        pad_q = (np.arange(b_pad - b) < t_pad - num_tokens).astype(np.int64)
        all_q = np.concatenate([qlens, pad_q])
    qsl = np.zeros(b_pad + 1, dtype=np.int32)
    np.cumsum(all_q, out=qsl[1:])
    if no_cache:  # no column: an attention layer given this batch fails the cache's reach check
        full_table = np.zeros((b_pad, 0), dtype=np.int32)
    elif b_pad == b and table.shape[1]:
        full_table = table.astype(np.int32)
    else:
        full_table = np.zeros((b_pad, max(table.shape[1], 1)), dtype=np.int32)
        full_table[:b, : table.shape[1]] = table

    slot = np.full(t_pad, -1, dtype=np.int64)
    if no_cache:
        pass
    elif max_query_len == 1 and num_tokens == b:  # one token each (decodes): at the computed count
        req = np.arange(b)
        written = table[req, computed // block_size]
        slot[:b] = written * block_size + computed % block_size
    else:
        req = np.repeat(np.arange(b), qlens)
        pos = np.arange(num_tokens) - qsl[:-1][req] + computed[req]
        written = table[req, pos // block_size]
        slot[:num_tokens] = written * block_size + pos % block_size
    if not no_cache:
        attending = used if num_tokens == b and max_query_len == 1 else used & (qlens > 0)[:, None]
        check_duplicate_blocks(table, attending, written, req, "block_tables", vals if attending is used else None)

    seq_all = (np.concatenate([seq_lens, pad_q]) if b_pad > b else seq_lens).astype(np.int32)
    qsl_dev, seq_dev, table_dev, slot_dev = to_device([qsl, seq_all, full_table, slot], torch.device(device))
    qsl_cpu, seq_cpu = torch.from_numpy(qsl), torch.from_numpy(seq_all)
    checks = StepChecks(refs=(qsl_cpu, seq_cpu, table_dev, slot_dev), device=qsl_dev.device,
                        max_seq_len=int(seq_all.max(initial=0)), table_width=full_table.shape[1],
                        block_size=int(block_size), max_block=max_block)
    return CommonAttentionMetadata(
        query_start_loc=qsl_dev,
        query_start_loc_cpu=qsl_cpu,
        seq_lens=seq_dev,
        seq_lens_cpu=seq_cpu,
        num_computed_tokens_cpu=torch.from_numpy(
            (np.concatenate([computed, np.zeros(b_pad - b, np.int64)]) if b_pad > b else computed).astype(np.int32)),
        num_reqs=b_pad,
        num_actual_tokens=num_tokens,
        max_query_len=max_query_len,
        block_table_tensor=table_dev,
        slot_mapping=slot_dev,
        max_seq_len=int(seq_lens.max(initial=0)),
        causal=causal,
        host_checks=checks,
        tree_parents=None if tree_parents is None else _tree_parents(tree_parents, qlens, device),
        **({} if state_indices is None else _state_indices(state_indices, b, b_pad, device)),
    )


def _state_indices(indices: Sequence[int] | torch.Tensor, b: int, b_pad: int,
                   device: torch.device | str) -> dict[str, torch.Tensor]:
    """``state_indices`` / ``state_indices_cpu`` (int32, padded requests -1) after checking one
    distinct slot >= 0 per request (the upper bound is checked against the cache)."""
    fix = "give each request the state slot it keeps for its lifetime (distinct, >= 0, below kv.num_state_slots)."
    arr = _int_kind("state_indices", np.asarray(indices.cpu() if isinstance(indices, torch.Tensor) else indices), fix)
    if arr.ndim != 1 or arr.shape[0] != b:
        raise ValueError(f"state_indices: expected one slot per request ({b}), got shape {arr.shape}; {fix}")
    if b and (arr.min() < 0 or np.unique(arr).shape[0] != b):
        raise ValueError(f"state_indices: expected distinct slots >= 0, got {arr.tolist()[:16]}; {fix}")
    full = np.full(b_pad, -1, dtype=np.int32)
    full[:b] = arr
    cpu = torch.from_numpy(full)
    return {"state_indices": cpu.to(device), "state_indices_cpu": cpu}


def _tree_parents(parents: Sequence[int] | torch.Tensor, qlens: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """``parents`` as an int32 device tensor, after checking each token's parent is -1 or an
    earlier token of its request (which makes every request's tokens a tree)."""
    fix = "give each new token its parent's index among its request's new tokens, or -1 for the cached context."
    arr = _int_kind("tree_parents", np.asarray(parents.cpu() if isinstance(parents, torch.Tensor) else parents), fix)
    n = int(qlens.sum())
    if arr.ndim != 1 or arr.shape[0] != n:
        raise ValueError(f"tree_parents: expected one entry per new token ({n}), got shape {arr.shape}; {fix}")
    index = np.arange(n) - np.repeat(np.cumsum(qlens) - qlens, qlens)  # each token's index in its request
    bad = (arr < -1) | (arr >= index)
    if bad.any():
        t = int(np.nonzero(bad)[0][0])
        raise ValueError(f"tree_parents[{t}]: expected -1 or an earlier token's index (< {index[t]}) within its "
                         f"request, got {arr[t]}; {fix}")
    return torch.from_numpy(arr.astype(np.int32)).to(device)

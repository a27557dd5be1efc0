"""A survey of bad inputs through vattn's public API, each in its own process.

Every case builds a small valid setup (one ``vattn.Attention`` layer, a paged cache with random
contents, valid metadata), then makes one bad call. The outcome is classified as

* ``clear_error``: an exception whose message names the argument (one of the case's names);
* ``unclear_error``: an exception whose message names none of them;
* ``silently_wrong``: no exception (every input here is invalid);
* ``crash``: the process died (a signal, a hang), or a CUDA error left the context unusable;
* ``rejected_cache_changed``: an exception, but some KV-cache tensor is no longer bit-identical.

Usage::

    python tools/bad_input_survey.py out.json                       # CPU: TORCH_SDPA + TRITON_ATTN (interpreter)
    python tools/bad_input_survey.py out.json --debug-checks        # with VATTN_DEBUG_CHECKS=1
    python tools/bad_input_survey.py out.json --device cuda --backends TRITON_ATTN,FLASHINFER,FLASH_ATTN,TORCH_SDPA

Cases that run a forward take the backends in turn (``--all-backends``: every case on every
backend, so more than 100 runs). ``-j`` runs that many processes at once. The counts are
printed and written, with every case's outcome and message, to the JSON path given.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
OUTCOMES = ("clear_error", "unclear_error", "silently_wrong", "crash", "rejected_cache_changed")
H, HK, D, BS, NB = 4, 2, 64, 16, 8
_CUDA_BROKEN = ("device-side assert", "illegal memory access", "CUDA error", "cudaError", "misaligned address")


# ---- the setup every case starts from ---------------------------------------------------


class Setup:
    """One layer ``l0`` (H=4, Hk=2, D=64, block 16) on ``backend``, a cache of 8 random blocks,
    and a valid step: two requests, a decode at position 7 (block 0) and a 5-token prefill (block 1)."""

    def __init__(self, backend: str, device: str, build: bool = True, **layer_kw: Any) -> None:
        import torch

        import vattn

        self.torch, self.vattn = torch, vattn
        self.backend, self.device = backend, torch.device(device)
        self.dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        self.cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=BS))
        self.gen = torch.Generator().manual_seed(0)
        self.kv: Any = None
        if build:
            self.layer = self.make_layer(**layer_kw)
            self.allocate()

    def make_layer(self, prefix: str = "l0", **kw: Any) -> Any:
        torch, vattn = self.torch, self.vattn
        args = dict(num_heads=H, head_size=D, scale=D**-0.5, num_kv_heads=HK, prefix=prefix, attn_backend=self.backend)
        args.update(kw)
        old = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with vattn.set_current_vattn_config(self.cfg):
                return vattn.Attention(**args)
        finally:
            torch.set_default_dtype(old)

    def allocate(self, num_blocks: int = NB) -> Any:
        self.kv = self.vattn.allocate_kv_cache(self.cfg, num_blocks=num_blocks, device=self.device, dtype=self.dtype)
        for t in self.kv.tensors.values():
            t.copy_(self.torch.randn(t.shape, generator=self.gen).to(t.dtype))
        return self.kv

    def common(self, query_lens=(1, 5), computed=(7, 0), tables=((0,), (1,)), **kw: Any) -> Any:
        return self.kv.common_metadata(list(query_lens), list(computed), [list(r) for r in tables], **kw)

    def hand(self, **over: Any) -> Any:
        """``CommonAttentionMetadata`` of the valid step, built by hand, with fields replaced."""
        torch, dev = self.torch, self.device
        qsl = over.pop("qsl", [0, 1, 6])
        seq = over.pop("seq", [8, 5])
        table = over.pop("table", [[0], [1]])
        slots = over.pop("slots", [7, 16, 17, 18, 19, 20])
        fields = dict(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            query_start_loc_cpu=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq, dtype=torch.int32, device=dev),
            seq_lens_cpu=torch.tensor(seq, dtype=torch.int32),
            num_computed_tokens_cpu=torch.tensor([s - (b - a) for s, a, b in zip(seq, qsl, qsl[1:])], dtype=torch.int32),
            num_reqs=len(seq), num_actual_tokens=qsl[-1], max_query_len=max(b - a for a, b in zip(qsl, qsl[1:])),
            block_table_tensor=torch.tensor(table, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        )
        fields.update(over)
        return self.vattn.CommonAttentionMetadata(**fields)

    def qkv(self, t: int = 6, tk: int | None = None) -> tuple[Any, Any, Any]:
        torch = self.torch
        tk = t if tk is None else tk

        def r(n: int, w: int) -> Any:
            return torch.randn(n, w, generator=self.gen).to(self.dtype).to(self.device)

        return r(t, H * D), r(tk, HK * D), r(tk, HK * D)

    def run(self, common: Any = None, q: Any = None, k: Any = None, v: Any = None, layer: Any = None,
            metadata: Any = None) -> Any:
        """One forward of ``layer`` (default l0) over ``common`` (default: the valid step)."""
        if common is None and metadata is None:
            common = self.common()
        if q is None:
            q, k, v = self.qkv(6 if common is None else common.num_actual_tokens)
        md = self.kv.build_metadata(common) if metadata is None else metadata
        with self.vattn.set_forward_context(md, self.cfg), self.torch.no_grad():
            out = (layer or self.layer)(q, k, v)
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()
        return out

    def compiled(self) -> Any:
        """``vattn.compile`` of a module around the layer, warmed up on the valid step."""
        torch, vattn = self.torch, self.vattn
        layer = self.layer

        class Tiny(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.attn = layer

            def forward(self, q: Any, k: Any, v: Any) -> Any:
                return self.attn(q, k, v)

        model = vattn.compile(Tiny(), self.cfg)
        q, k, v = self.qkv(6)
        with vattn.set_forward_context(self.kv.build_metadata(self.common()), self.cfg):
            model(q, k, v)
        CURRENT["before"] = self.snapshot()  # after the warm-up's valid writes
        return model

    def snapshot(self) -> dict[str, Any]:
        if self.kv is None:
            return {}
        return {n: t.detach().cpu().clone() for n, t in self.kv.tensors.items()}


def _bits(t: Any) -> Any:
    import torch

    return t.contiguous().view(torch.uint8)


# ---- the cases ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    category: str
    names: tuple[str, ...]  # the message must name one of these (case-insensitive)
    fn: Callable[[str, str], Any]  # (backend, device) -> Setup (or None); raises on rejection
    forward: bool = True  # runs a forward on a backend (else backend-independent)
    env: tuple[tuple[str, str], ...] = ()


CASES: list[Case] = []


def case(category: str, names: str, *, forward: bool = True, env: dict[str, str] | None = None) -> Callable:
    def wrap(fn: Callable) -> Callable:
        CASES.append(Case(fn.__name__, category, tuple(names.split("|")), fn, forward, tuple((env or {}).items())))
        return fn
    return wrap


# The Setup a case built is kept here, so a rejected call's cache can be compared.
CURRENT: dict[str, Any] = {}


def S(backend: str, device: str, **kw: Any) -> Setup:
    s = Setup(backend, device, **kw)
    CURRENT["setup"] = s
    CURRENT["before"] = s.snapshot()
    return s


# -- token counts of q/k/v against the metadata

@case("tokens", "query|num_actual_tokens|tokens")
def fewer_tokens(b, d):
    s = S(b, d); s.run(s.common(), *s.qkv(5))


@case("tokens", "query|num_actual_tokens|tokens")
def more_tokens(b, d):
    s = S(b, d); s.run(s.common(), *s.qkv(9))


@case("tokens", "query|num_actual_tokens|tokens")
def one_token_for_decode_batch(b, d):
    s = S(b, d); s.run(s.common([1, 1], [7, 3], [[0], [1]]), *s.qkv(1))


@case("tokens", "query|num_actual_tokens|tokens")
def zero_tokens(b, d):
    s = S(b, d); s.run(s.common(), *s.qkv(0))


@case("tokens", "key|value|tokens")
def kv_fewer_than_query(b, d):
    s = S(b, d); s.run(s.common(), *s.qkv(6, 5))


@case("tokens", "query|num_actual_tokens|tokens")
def query_fewer_than_kv(b, d):
    s = S(b, d); q, k, v = s.qkv(6); s.run(s.common(), q[:5], k, v)


@case("tokens", "query|num_actual_tokens|tokens")
def fewer_tokens_compiled(b, d):
    s = S(b, d); m = s.compiled(); q, k, v = s.qkv(5)
    with s.vattn.set_forward_context(s.kv.build_metadata(s.common()), s.cfg):
        m(q, k, v)


@case("tokens", "query|num_actual_tokens|tokens")
def more_tokens_compiled(b, d):
    s = S(b, d); m = s.compiled(); q, k, v = s.qkv(9)
    with s.vattn.set_forward_context(s.kv.build_metadata(s.common()), s.cfg):
        m(q, k, v)


@case("tokens", "query|num_heads|head")
def query_wrong_heads(b, d):
    s = S(b, d); q, k, v = s.qkv(6); s.run(s.common(), q.view(6, H, D)[:, :3], k, v)


@case("tokens", "dtype|key|cache")
def qkv_other_dtype(b, d):
    s = S(b, d); q, k, v = s.qkv(6); s.run(s.common(), q.half(), k.half(), v.half())


@case("tokens", "value|key")
def value_none_key_given(b, d):
    s = S(b, d); q, k, v = s.qkv(6); s.run(s.common(), q, k, None)


@case("tokens", "device|slot_mapping|metadata")
def metadata_on_meta_device(b, d):
    s = S(b, d); s.run(s.common(device="meta"))


# -- hand-built CommonAttentionMetadata

@case("metadata", "slot_mapping|slot")
def slot_past_cache(b, d):
    s = S(b, d); s.run(s.hand(slots=[7, 16, 17, 18, 19, NB * BS + 3]))


@case("metadata", "slot_mapping|slot")
def slot_far_past_cache(b, d):
    s = S(b, d); s.run(s.hand(slots=[2**40, 16, 17, 18, 19, 20]))


@case("metadata", "slot_mapping|slot")
def slot_negative_not_padding(b, d):
    s = S(b, d); s.run(s.hand(slots=[7, 16, 17, -2, 19, 20]))


@case("metadata", "block_table|block id|block_tables")
def block_id_past_num_blocks(b, d):
    s = S(b, d); s.run(s.hand(table=[[0], [NB + 1]], slots=[7] + [(NB + 1) * BS + i for i in range(5)]))


@case("metadata", "block_table|block id|block_tables")
def block_id_past_num_blocks_read_only(b, d):
    s = S(b, d); s.run(s.hand(seq=[8, 21], table=[[0, 5], [NB + 2, 1]], slots=[7, 16 + 0, 16 + 1, 16 + 2, 16 + 3, 16 + 4],
                              qsl=[0, 1, 6]))


@case("metadata", "block_table|block id|block_tables")
def block_id_negative(b, d):
    s = S(b, d); s.run(s.hand(table=[[-3], [1]]))


@case("metadata", "query_start_loc")
def query_start_loc_not_monotonic(b, d):
    s = S(b, d); s.run(s.hand(
        query_start_loc=s.torch.tensor([0, 4, 2], dtype=s.torch.int32, device=s.device),
        query_start_loc_cpu=s.torch.tensor([0, 4, 2], dtype=s.torch.int32), num_actual_tokens=6, max_query_len=4))


@case("metadata", "query_start_loc")
def query_start_loc_not_from_zero(b, d):
    s = S(b, d); s.run(s.hand(query_start_loc=s.torch.tensor([1, 2, 6], dtype=s.torch.int32, device=s.device),
                              query_start_loc_cpu=s.torch.tensor([1, 2, 6], dtype=s.torch.int32)))


@case("metadata", "query_start_loc|num_actual_tokens")
def query_start_loc_end_past_tokens(b, d):
    s = S(b, d); s.run(s.hand(query_start_loc=s.torch.tensor([0, 1, 9], dtype=s.torch.int32, device=s.device),
                              query_start_loc_cpu=s.torch.tensor([0, 1, 9], dtype=s.torch.int32), max_query_len=8))


@case("metadata", "query_start_loc|num_actual_tokens")
def num_actual_tokens_past_query_start_loc(b, d):
    s = S(b, d); s.run(s.hand(num_actual_tokens=6, qsl=[0, 1, 4], seq=[8, 3], slots=[7, 16, 17, 18, 19, 20]))


@case("metadata", "block_table|seq_lens")
def block_table_narrower_than_sequence(b, d):
    s = S(b, d); s.run(s.hand(seq=[8, 21], table=[[0], [1]], slots=[7, 16 + 16, 33, 34, 35, 36]))


@case("metadata", "seq_lens|query")
def seq_lens_below_query_lens(b, d):
    s = S(b, d); s.run(s.hand(seq=[8, 3]))


@case("metadata", "seq_lens|block_table")
def seq_lens_past_table_coverage(b, d):
    s = S(b, d); s.run(s.hand(seq=[8, 40], table=[[0, 2], [1, 3]],
                              slots=[7] + [1 * BS + 35 - 16 + i - 4 for i in range(5)]))


@case("metadata", "seq_lens|seq_lens_cpu")
def seq_lens_mirror_disagrees(b, d):
    s = S(b, d); s.run(s.hand(seq_lens=s.torch.tensor([8, 12], dtype=s.torch.int32, device=s.device)))


@case("metadata", "query_start_loc|query_start_loc_cpu")
def query_start_loc_mirror_disagrees(b, d):
    s = S(b, d); s.run(s.hand(query_start_loc=s.torch.tensor([0, 2, 6], dtype=s.torch.int32, device=s.device)))


@case("metadata", "max_query_len")
def max_query_len_too_small(b, d):
    s = S(b, d); s.run(s.hand(max_query_len=2))


@case("metadata", "max_seq_len")
def max_seq_len_too_small(b, d):
    s = S(b, d); s.run(s.hand(max_seq_len=3))


@case("metadata", "num_reqs")
def num_reqs_past_tensors(b, d):
    s = S(b, d); s.run(s.hand(num_reqs=3))


@case("metadata", "num_actual_tokens")
def num_actual_tokens_negative(b, d):
    s = S(b, d); s.run(s.hand(num_actual_tokens=-1))


@case("metadata", "slot_mapping")
def slot_mapping_float(b, d):
    s = S(b, d); s.run(s.hand(slot_mapping=s.torch.tensor([7, 16, 17, 18, 19, 20], dtype=s.torch.float32, device=s.device)))


@case("metadata", "block_table")
def block_table_float(b, d):
    s = S(b, d); s.run(s.hand(block_table_tensor=s.torch.tensor([[0.0], [1.0]], device=s.device)))


@case("metadata", "query_start_loc")
def query_start_loc_float(b, d):
    s = S(b, d); s.run(s.hand(query_start_loc=s.torch.tensor([0.0, 1.0, 6.0], device=s.device)))


@case("metadata", "slot_mapping")
def slot_mapping_2d(b, d):
    s = S(b, d); s.run(s.hand(slot_mapping=s.torch.tensor([[7, 16, 17], [18, 19, 20]], device=s.device)))


@case("metadata", "seq_lens")
def seq_lens_negative(b, d):
    s = S(b, d); s.run(s.hand(seq=[8, -5]))


@case("metadata", "slot_mapping|slot")
def slot_written_twice(b, d):
    s = S(b, d); s.run(s.hand(slots=[7, 16, 17, 17, 19, 20]))


@case("metadata", "slot_mapping|slot|block")
def slot_in_block_not_owned(b, d):
    s = S(b, d); s.run(s.hand(slots=[7, 16, 17, 18, 19, 5 * BS]))


@case("metadata", "slot_mapping|slot|block")
def slot_in_other_requests_block(b, d):
    s = S(b, d); s.run(s.hand(slots=[7, 16, 17, 18, 19, 3]))


@case("metadata", "block_table|device")
def block_table_on_meta(b, d):
    s = S(b, d); s.run(s.hand(block_table_tensor=s.torch.zeros(2, 1, dtype=s.torch.int32, device="meta")))


@case("metadata", "num_slot_tokens")
def num_slot_tokens_past_slots(b, d):
    s = S(b, d); s.run(s.hand(num_slot_tokens=9))


@case("metadata", "block|block_table")
def hand_block_in_two_requests(b, d):
    s = S(b, d); s.run(s.hand(table=[[0], [0]], slots=[7, 0, 1, 2, 3, 4]))


# -- metadata edited in place after a step ran on it (CommonAttentionMetadata is a public dataclass)

def _edited(b: str, d: str, edit: Callable[[Any], None], hand: bool = False) -> None:
    """A valid step on metadata (vattn's helper, or hand-built), then ``edit`` in place, then the next step."""
    s = S(b, d)
    cm = s.hand() if hand else s.common()
    s.run(cm)
    CURRENT["before"] = s.snapshot()  # after the valid step's writes
    edit(cm)
    s.run(cm)


def _mirrored(name: str, i: int, v: int) -> Callable[[Any], None]:
    def edit(cm: Any) -> None:
        getattr(cm, name)[i] = v
        getattr(cm, name + "_cpu")[i] = v
    return edit


@case("edited", "slot_mapping|slot")
def edited_slot_past_cache(b, d):
    _edited(b, d, lambda cm: cm.slot_mapping.__setitem__(5, NB * BS + 3))


@case("edited", "slot_mapping|slot")
def edited_slot_negative_not_padding(b, d):
    _edited(b, d, lambda cm: cm.slot_mapping.__setitem__(3, -2), hand=True)


@case("edited", "block_table|block id|block_tables")
def edited_block_id_past_num_blocks(b, d):
    _edited(b, d, lambda cm: cm.block_table_tensor.__setitem__((1, 0), NB + 1))


@case("edited", "query_start_loc")
def edited_query_start_loc_not_monotonic(b, d):
    _edited(b, d, _mirrored("query_start_loc", 1, 7))


@case("edited", "seq_lens|query")
def edited_seq_lens_below_query_lens(b, d):
    _edited(b, d, _mirrored("seq_lens", 1, 3), hand=True)


@case("edited", "seq_lens|block_table|max_seq_len")
def edited_seq_lens_past_table(b, d):
    def edit(cm: Any) -> None:
        _mirrored("seq_lens", 1, 40)(cm)
        cm.max_seq_len = 40
    _edited(b, d, edit)


@case("edited", "seq_lens|seq_lens_cpu")
def edited_mirror_alone(b, d):
    _edited(b, d, lambda cm: cm.seq_lens_cpu.__setitem__(1, 6), hand=True)


# -- semantics a backend cannot honour, a forgotten metadata, a device this build lacks

@case("semantics", "tree_parents", forward=False)
def tree_parents_on_sdpa(b, d):
    s = S("TORCH_SDPA", d); s.run(s.common(tree_parents=[-1, -1, 0, 0, 1, 2]))


@case("semantics", "attn_metadata|dummy_run")
def no_metadata_outside_warm_up(b, d):
    s = S(b, d); q, k, v = s.qkv(6)
    with s.vattn.set_forward_context(None, s.cfg), s.torch.no_grad():
        s.layer(q, k, v)


@case("semantics", "device", forward=False)
def allocate_on_missing_gpu(b, d):
    import torch
    s = S(b, d, build=False); s.layer = s.make_layer()
    s.allocate_device = "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count() + 7}"
    s.vattn.allocate_kv_cache(s.cfg, num_blocks=NB, device=s.allocate_device)


# -- metadata of another block size / cache

@case("block_size", "block_size")
def metadata_block_size_32(b, d):
    s = S(b, d); s.run(s.vattn.build_common_attn_metadata([1, 5], [7, 0], [[0], [1]], 32, device=s.device))


@case("block_size", "block_size")
def metadata_block_size_8(b, d):
    s = S(b, d); s.run(s.vattn.build_common_attn_metadata([1, 5], [7, 0], [[0], [1]], 8, device=s.device))


@case("block_size", "block_size")
def metadata_block_size_8_decode(b, d):
    s = S(b, d); s.run(s.vattn.build_common_attn_metadata([1, 1], [7, 3], [[0], [1]], 8, device=s.device))


@case("block_size", "num_blocks|block")
def metadata_blocks_past_cache(b, d):
    s = S(b, d); s.run(s.vattn.build_common_attn_metadata([1, 5], [7, 0], [[0], [NB + 4]], BS, device=s.device))


@case("block_size", "num_blocks|block")
def metadata_num_blocks_of_bigger_cache(b, d):
    s = S(b, d); s.run(s.vattn.build_common_attn_metadata([1, 5], [7, 0], [[0], [NB + 4]], BS, device=s.device,
                                                          num_blocks=4 * NB))


# -- a cache of another configuration bound to the layer

def _bind_other(b: str, d: str, **kw: Any) -> Setup:
    s = S(b, d)
    spec = dict(num_blocks=NB, block_size=BS, num_kv_heads=HK, head_size=D)
    spec.update(kw)
    shape = s.layer.attn_backend.get_kv_cache_shape(spec["num_blocks"], spec["block_size"], spec["num_kv_heads"],
                                                    spec["head_size"])
    other = s.torch.randn(shape, generator=s.gen).to(kw.get("dtype", s.dtype)).to(kw.get("device", s.device))
    s.vattn.bind_kv_cache({"l0": other}, s.cfg)
    s.kv.tensors["l0"] = other  # the cache the call may write
    CURRENT["before"] = s.snapshot()
    return s


@case("cache", "kv_cache|num_kv_heads|cache")
def cache_other_kv_heads(b, d):
    _bind_other(b, d, num_kv_heads=4).run()


@case("cache", "kv_cache|head_size|cache")
def cache_other_head_size(b, d):
    _bind_other(b, d, head_size=32).run()


@case("cache", "kv_cache|block_size|cache")
def cache_other_block_size(b, d):
    _bind_other(b, d, block_size=32, num_blocks=4).run()


@case("cache", "kv_cache|num_blocks|cache")
def cache_fewer_blocks(b, d):
    _bind_other(b, d, num_blocks=1).run()


@case("cache", "dtype|cache")
def cache_other_dtype(b, d):
    _bind_other(b, d, dtype=__import__("torch").float16).run()


@case("cache", "kv_cache|cache|shape")
def cache_wrong_rank(b, d):
    s = S(b, d)
    other = s.torch.zeros(NB, BS, HK, D, dtype=s.dtype, device=s.device)
    s.vattn.bind_kv_cache({"l0": other}, s.cfg); s.kv.tensors["l0"] = other; CURRENT["before"] = s.snapshot()
    s.run()


@case("cache", "kv_cache|cache|device")
def cache_on_meta(b, d):
    s = S(b, d)
    s.vattn.bind_kv_cache({"l0": s.torch.zeros(s.kv.tensors["l0"].shape, dtype=s.dtype, device="meta")}, s.cfg)
    s.run()


@case("cache", "kv_cache|cache")
def cache_assigned_directly_wrong_shape(b, d):
    s = S(b, d)
    s.layer.kv_cache = [s.torch.zeros(2, NB, BS, HK + 2, D, dtype=s.dtype, device=s.device)]
    s.kv.tensors["l0"] = s.layer.kv_cache[0]; CURRENT["before"] = s.snapshot()
    s.run()


# -- construction-time values

@case("construct", "per_layer_sliding_window|sliding_window")
def sliding_window_zero(b, d):
    S(b, d, per_layer_sliding_window=0).run()


@case("construct", "per_layer_sliding_window|sliding_window")
def sliding_window_negative(b, d):
    S(b, d, per_layer_sliding_window=-4).run()


@case("construct", "per_layer_sliding_window|sliding_window")
def sliding_window_float(b, d):
    S(b, d, per_layer_sliding_window=2.5).run()


@case("construct", "scale")
def scale_nan(b, d):
    S(b, d, scale=float("nan")).run()


@case("construct", "scale")
def scale_inf(b, d):
    S(b, d, scale=float("inf")).run()


@case("construct", "scale")
def scale_string(b, d):
    S(b, d, scale="abc").run()


@case("construct", "scale")
def scale_none(b, d):
    S(b, d, scale=None).run()


@case("construct", "scale")
def scale_zero(b, d):
    S(b, d, scale=0.0).run()


@case("construct", "logits_soft_cap")
def soft_cap_nan(b, d):
    S(b, d, logits_soft_cap=float("nan")).run()


@case("construct", "logits_soft_cap")
def soft_cap_negative(b, d):
    S(b, d, logits_soft_cap=-5.0).run()


@case("construct", "logits_soft_cap")
def soft_cap_inf(b, d):
    S(b, d, logits_soft_cap=float("inf")).run()


@case("construct", "num_heads")
def num_heads_string(b, d):
    S(b, d, num_heads="8").run()


@case("construct", "num_heads")
def num_heads_zero(b, d):
    S(b, d, num_heads=0).run()


@case("construct", "head_size")
def head_size_zero(b, d):
    S(b, d, head_size=0).run()


@case("construct", "num_kv_heads")
def num_kv_heads_not_divisor(b, d):
    S(b, d, num_kv_heads=3).run()


@case("construct", "num_kv_heads")
def num_kv_heads_negative(b, d):
    S(b, d, num_kv_heads=-2).run()


@case("construct", "alibi_slopes")
def alibi_wrong_length(b, d):
    S(b, d, alibi_slopes=[0.5, 0.25]).run()


@case("construct", "alibi_slopes")
def alibi_nan(b, d):
    S(b, d, alibi_slopes=[0.5, float("nan"), 0.25, 0.125]).run()


@case("construct", "sinks")
def sinks_wrong_shape(b, d):
    import torch
    S(b, d, sinks=torch.zeros(3)).run()


@case("construct", "attn_type")
def attn_type_bogus(b, d):
    S(b, d, attn_type="bogus").run()


@case("construct", "block_size", forward=False)
def cache_config_block_size_zero(b, d):
    import vattn
    vattn.CacheConfig(block_size=0)


@case("construct", "sliding_window", forward=False)
def cache_config_sliding_window_zero(b, d):
    import vattn
    vattn.CacheConfig(sliding_window=0)


@case("construct", "sliding_window", forward=False)
def cache_config_sliding_window_float(b, d):
    import vattn
    vattn.CacheConfig(sliding_window=8.5)


@case("construct", "cache_dtype", forward=False)
def cache_config_dtype_bogus(b, d):
    import vattn
    vattn.CacheConfig(cache_dtype="int8")


# -- duplicate blocks

@case("duplicates", "block_tables|block")
def block_twice_in_request_prefill(b, d):
    s = S(b, d); s.run(s.common([20], [0], [[2, 2]]), *s.qkv(20))


@case("duplicates", "block_tables|block")
def block_twice_in_request_decode(b, d):
    s = S(b, d); s.run(s.common([1], [16], [[2, 2]]), *s.qkv(1))


@case("duplicates", "block_tables|block")
def block_in_two_requests_both_write(b, d):
    s = S(b, d); s.run(s.common([1, 5], [7, 0], [[3], [3]]))


@case("duplicates", "block_tables|block")
def block_in_two_requests_decodes(b, d):
    s = S(b, d); s.run(s.common([1, 1], [3, 9], [[4], [4]]), *s.qkv(2))


# -- wrong types of per-request facts

@case("types", "query_lens")
def query_lens_float(b, d):
    s = S(b, d); s.run(s.common([1.5, 5], [7, 0], [[0], [1]]))


@case("types", "num_computed_tokens")
def num_computed_float(b, d):
    s = S(b, d); s.run(s.common([1, 5], [7.7, 0], [[0], [1]]))


@case("types", "block_tables")
def block_tables_float_list(b, d):
    s = S(b, d); s.run(s.common([1, 5], [7, 0], [[0.0], [1.9]]))


@case("types", "block_tables")
def block_tables_float_tensor(b, d):
    s = S(b, d); s.run(s.kv.common_metadata([1, 5], [7, 0], s.torch.tensor([[0.0], [1.6]])))


@case("types", "block_size")
def build_block_size_float(b, d):
    s = S(b, d); s.run(s.vattn.build_common_attn_metadata([1, 5], [7, 0], [[0], [1]], 16.0, device=s.device))


@case("types", "query_lens")
def query_lens_bool(b, d):
    s = S(b, d); s.run(s.common([True, True], [7, 3], [[0], [1]]), *s.qkv(2))


@case("types", "query_lens|num_computed_tokens")
def query_lens_length_mismatch(b, d):
    s = S(b, d); s.run(s.common([1, 5, 2], [7, 0], [[0], [1]]))


@case("types", "num_tokens_padded")
def num_tokens_padded_too_small(b, d):
    s = S(b, d); s.run(s.common(num_tokens_padded=4))


# -- variables and sizes

@case("env", "VATTN_Q_SCALE_CONSTANT", env={"VATTN_Q_SCALE_CONSTANT": "abc"})
def env_q_scale_constant(b, d):
    S(b, d).run()


@case("env", "VATTN_KV_CACHE_LAYOUT", env={"VATTN_KV_CACHE_LAYOUT": "XYZ"})
def env_kv_cache_layout(b, d):
    S(b, d).run()


@case("env", "VATTN_ATTENTION_BACKEND", forward=False, env={"VATTN_ATTENTION_BACKEND": "NOPE"})
def env_attention_backend(b, d):
    import vattn
    with vattn.set_current_vattn_config(vattn.VattnConfig()):
        vattn.Attention(H, D, 0.125, num_kv_heads=HK, prefix="x")


@case("env", "num_blocks")
def num_blocks_huge(b, d):
    s = S(b, d, build=False); s.layer = s.make_layer(); s.allocate(num_blocks=2**40)


@case("env", "num_blocks")
def num_blocks_zero(b, d):
    s = S(b, d, build=False); s.layer = s.make_layer(); s.allocate(num_blocks=0)


@case("env", "num_blocks")
def num_blocks_string(b, d):
    s = S(b, d, build=False); s.layer = s.make_layer(); s.allocate(num_blocks="8")


@case("env", "positions|max_position_embeddings", forward=False)
def positions_past_max_position_embeddings(b, d):
    """The example engine on a model whose RoPE table ends at 32 positions; a request of 40 tokens."""
    import torch

    import vattn
    from examples.engine import Engine, SamplingParams
    from examples.model import DecoderForCausalLM, ModelConfig, init_random_weights
    cfg = vattn.VattnConfig()
    mc = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=32, max_position_embeddings=32)
    dev = torch.device(d)
    with vattn.set_current_vattn_config(cfg), torch.device(dev):
        model = DecoderForCausalLM(mc, attn_backend="TORCH_SDPA")
    init_random_weights(model)
    kv = vattn.allocate_kv_cache(cfg, num_blocks=8, device=dev, dtype=torch.get_default_dtype())
    engine = Engine(model, cfg, kv, device=dev)
    engine.add_request(list(range(30)), SamplingParams(max_tokens=10))
    engine.run()


@case("env", "k_scale|v_scale")
def set_kv_scales_negative(b, d):
    s = S(b, d); s.layer.set_kv_scales(-1.0, 1.0)


@case("env", "slot_mapping|metadata|CommonAttentionMetadata")
def forward_context_with_common_metadata(b, d):
    s = S(b, d); s.run(metadata=s.common())


# ---- the child: run one case ------------------------------------------------------------


def run_case(index: int, backend: str, device: str) -> dict[str, Any]:
    c = CASES[index]
    err: BaseException | None = None
    try:
        c.fn(backend, device)
    except Exception as e:  # noqa: BLE001
        err = e
    msg = "" if err is None else f"{type(err).__name__}: {err}"
    s = CURRENT.get("setup")
    broken = any(m in msg for m in _CUDA_BROKEN)
    changed = False
    if s is not None and s.kv is not None:
        try:
            if device == "cuda":
                s.torch.cuda.synchronize()
            after = s.snapshot()
            before = CURRENT["before"]
            changed = any(n not in after or not s.torch.equal(_bits(before[n]), _bits(after[n])) for n in before)
        except Exception as e:  # noqa: BLE001  (a CUDA error surfacing late)
            broken, msg = True, msg + f" | after: {type(e).__name__}: {e}"
    if broken:
        outcome = "crash"
    elif err is None:
        outcome = "silently_wrong"
    elif changed:
        outcome = "rejected_cache_changed"
    elif any(n.lower() in str(err).lower() for n in c.names):
        outcome = "clear_error"
    else:
        outcome = "unclear_error"
    return {"outcome": outcome, "message": msg[:600], "cache_changed": changed,
            "traceback": "" if err is None else "".join(traceback.format_exception(err))[-1500:]}


# ---- the parent ---------------------------------------------------------------------------


def plan(backends: list[str], all_backends: bool) -> list[tuple[int, str]]:
    runs, k = [], 0
    for i, c in enumerate(CASES):
        if not c.forward:
            runs.append((i, backends[0]))
        elif all_backends:
            runs += [(i, b) for b in backends]
        else:
            runs.append((i, backends[k % len(backends)]))
            k += 1
    return runs


def _child(index: int, backend: str, args: argparse.Namespace) -> dict[str, Any]:
    c = CASES[index]
    env = dict(os.environ)
    env.pop("VATTN_DEBUG_CHECKS", None)
    if args.debug_checks:
        env["VATTN_DEBUG_CHECKS"] = "1"
    if args.device == "cpu" and backend == "TRITON_ATTN":
        env["TRITON_INTERPRET"] = "1"
    env["VATTN_DISABLE_COMPILE_CACHE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p)
    env.update(dict(c.env))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(index), "--device", args.device,
           "--backends", backend]
    t0 = time.perf_counter()
    row: dict[str, Any] = {"case": c.name, "category": c.category, "backend": backend if c.forward else None,
                           "names": list(c.names)}
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        row.update(outcome="crash", message=f"timed out after {args.timeout} s", returncode=None)
        return row
    row["seconds"] = round(time.perf_counter() - t0, 2)
    row["returncode"] = p.returncode
    line = next((ln for ln in reversed(p.stdout.splitlines()) if ln.startswith("RESULT:")), None)
    if line is None:
        row.update(outcome="crash", message=f"exit {p.returncode}: {p.stderr[-800:]}")
    else:
        row.update(json.loads(line[len("RESULT:"):]))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", help="where to write the JSON (counts and every case)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--backends", default=None, help="comma-separated (default: TORCH_SDPA,TRITON_ATTN on CPU, "
                                                     "TRITON_ATTN,FLASHINFER,FLASH_ATTN,TORCH_SDPA on CUDA)")
    ap.add_argument("--debug-checks", action="store_true", help="run every case with VATTN_DEBUG_CHECKS=1")
    ap.add_argument("--all-backends", action="store_true", help="every forward case on every backend")
    ap.add_argument("--only", default=None, help="comma-separated case names")
    ap.add_argument("-j", "--jobs", type=int, default=max(1, min(8, (os.cpu_count() or 2))))
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--list", action="store_true", help="print the cases and exit")
    args = ap.parse_args()
    if args.child is not None:
        sys.path.append(str(ROOT))  # after PYTHONPATH: a survey of another checkout imports that one
        res = run_case(args.child, args.backends, args.device)
        print("RESULT:" + json.dumps(res), flush=True)
        os._exit(0)  # no interpreter teardown (a broken CUDA context may hang it)
    if args.list:
        for c in CASES:
            print(f"{c.category:12s} {c.name:45s} names={'|'.join(c.names)}")
        print(len(CASES), "cases")
        return
    if not args.out:
        ap.error("give the JSON output path")
    default = "TORCH_SDPA,TRITON_ATTN" if args.device == "cpu" else "TRITON_ATTN,FLASHINFER,FLASH_ATTN,TORCH_SDPA"
    backends = (args.backends or default).split(",")
    runs = plan(backends, args.all_backends)
    if args.only:
        wanted = set(args.only.split(","))
        runs = [r for r in runs if CASES[r[0]].name in wanted]
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    with cf.ThreadPoolExecutor(args.jobs) as pool:
        futures = {pool.submit(_child, i, b, args): (i, b) for i, b in runs}
        for f in cf.as_completed(futures):
            row = f.result()
            rows.append(row)
            print(f"[{len(rows):3d}/{len(runs)}] {row['outcome']:22s} {row['case']} ({row.get('backend')}): "
                  f"{row.get('message', '')[:140]}", flush=True)
    rows.sort(key=lambda r: (r["category"], r["case"], str(r.get("backend"))))
    counts = {o: sum(r["outcome"] == o for r in rows) for o in OUTCOMES}
    summary = {"counts": counts, "total": len(rows), "device": args.device, "backends": backends,
               "debug_checks": args.debug_checks, "seconds": round(time.perf_counter() - t0, 1),
               "by_category": {cat: {o: sum(r["outcome"] == o and r["category"] == cat for r in rows) for o in OUTCOMES}
                               for cat in sorted({r["category"] for r in rows})}}
    try:
        import torch

        summary["torch"] = torch.__version__
        if args.device == "cuda" and torch.cuda.is_available():
            summary["device_name"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"summary": summary, "cases": rows}, indent=1))
    print(json.dumps(summary["counts"]), f"({len(rows)} cases, {summary['seconds']} s) -> {args.out}")
    for r in rows:
        if r["outcome"] != "clear_error":
            print(f"  {r['outcome']:22s} {r['category']:11s} {r['case']} ({r.get('backend')}): {r.get('message', '')[:200]}")


if __name__ == "__main__":
    main()

"""Bad input through the public API: every case is rejected with an exception of the expected type
whose message names the argument, and every KV-cache tensor is bit-identical after the call.

Backends: TORCH_SDPA on CPU, TRITON_ATTN on CPU under the Triton interpreter (rejected calls
never reach a kernel, so the cases stay fast), and on a GPU (``cuda`` / ``flashinfer`` /
``flash_attn`` markers) TRITON_ATTN, FLASHINFER, FLASH_ATTN and TORCH_SDPA. Metadata built by
hand with contents only on a GPU is checked only with ``VATTN_DEBUG_CHECKS=1``; those cases set it
on CUDA (on the CPU the same contents are checked without it). ``tools/bad_input_survey.py``
runs the same categories one process per case, where a crash would show.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import pytest
import torch
from torch import nn

import vattn
from benchmarks.common import default_dtype
from conftest import HAS_CUDA
from vattn.core import debug_checks

H, HK, D, BS, NB = 4, 2, 64, 16, 8
VALID_SLOTS = [7, 16, 17, 18, 19, 20]  # decode at position 7 (block 0), 5-token prefill (block 1)

BACKENDS = [
    pytest.param(("TORCH_SDPA", "cpu"), id="sdpa-cpu"),
    pytest.param(("TRITON_ATTN", "cpu"), id="triton-interp",
                 marks=pytest.mark.skipif(HAS_CUDA, reason="the Triton interpreter runs where no GPU is")),
    pytest.param(("TRITON_ATTN", "cuda"), id="triton-cuda", marks=pytest.mark.cuda),
    pytest.param(("FLASHINFER", "cuda"), id="flashinfer", marks=[pytest.mark.cuda, pytest.mark.flashinfer]),
    pytest.param(("FLASH_ATTN", "cuda"), id="flash-attn", marks=[pytest.mark.cuda, pytest.mark.flash_attn]),
    pytest.param(("TORCH_SDPA", "cuda"), id="sdpa-cuda", marks=pytest.mark.cuda),
]
CPU_ONLY = [BACKENDS[0]]


class Rig:
    """One layer ``l0`` (H=4, Hk=2, D=64) on a backend, a cache of 8 random 16-token blocks, and
    the valid step: a decode at position 7 (block 0) and a 5-token prefill (block 1)."""

    def __init__(self, backend: str, device: str, monkeypatch: pytest.MonkeyPatch, build: bool = True,
                 **layer_kw: Any) -> None:
        if backend == "TRITON_ATTN" and device == "cpu":
            monkeypatch.setenv("TRITON_INTERPRET", "1")
            import triton_modules

            triton_modules.load(("vattn.kernels.fp8", "vattn.backends.triton.kernels", "vattn.kernels.kv_store",
                                 "vattn.backends.triton.paged_attention"))
        self.backend, self.device, self.mp = backend, torch.device(device), monkeypatch
        self.dtype = torch.float32 if device == "cpu" else torch.bfloat16
        self.cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=BS))
        self.gen = torch.Generator().manual_seed(0)
        self.kv: Any = None
        if build:
            self.layer = self.make_layer(**layer_kw)
            self.allocate()

    def make_layer(self, prefix: str = "l0", **kw: Any) -> vattn.Attention:
        args: dict[str, Any] = dict(num_heads=H, head_size=D, scale=D**-0.5, num_kv_heads=HK, prefix=prefix,
                                    attn_backend=self.backend)
        args.update(kw)
        with vattn.set_current_vattn_config(self.cfg), default_dtype(self.dtype):
            return vattn.Attention(**args)

    def allocate(self, num_blocks: Any = NB) -> vattn.PagedKVCache:
        self.kv = vattn.allocate_kv_cache(self.cfg, num_blocks=num_blocks, device=self.device, dtype=self.dtype)
        for t in self.kv.tensors.values():
            t.copy_(torch.randn(t.shape, generator=self.gen).to(t.dtype))
        return self.kv

    def debug_on_gpu(self) -> None:
        """Contents of device-only metadata are checked in debug mode only."""
        if self.device.type == "cuda":
            self.mp.setenv("VATTN_DEBUG_CHECKS", "1")

    def common(self, query_lens=(1, 5), computed=(7, 0), tables=((0,), (1,)), **kw: Any) -> Any:
        return self.kv.common_metadata(list(query_lens), list(computed), [list(r) for r in tables], **kw)

    def hand(self, **over: Any) -> vattn.CommonAttentionMetadata:
        """The valid step's ``CommonAttentionMetadata`` built by hand, with fields replaced."""
        dev = self.device
        qsl, seq = over.pop("qsl", [0, 1, 6]), over.pop("seq", [8, 5])
        table, slots = over.pop("table", [[0], [1]]), over.pop("slots", VALID_SLOTS)
        fields: dict[str, Any] = dict(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            query_start_loc_cpu=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq, dtype=torch.int32, device=dev),
            seq_lens_cpu=torch.tensor(seq, dtype=torch.int32),
            num_computed_tokens_cpu=torch.tensor([max(s - (b - a), 0) for s, a, b in zip(seq, qsl, qsl[1:])],
                                                 dtype=torch.int32),
            num_reqs=len(seq), num_actual_tokens=qsl[-1],
            max_query_len=max(b - a for a, b in zip(qsl, qsl[1:])),
            block_table_tensor=torch.tensor(table, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        )
        fields.update(over)
        return vattn.CommonAttentionMetadata(**fields)

    def qkv(self, t: int = 6, tk: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tk = t if tk is None else tk

        def r(n: int, w: int) -> torch.Tensor:
            return torch.randn(n, w, generator=self.gen).to(self.dtype).to(self.device)

        return r(t, H * D), r(tk, HK * D), r(tk, HK * D)

    def run(self, common: Any = None, q: Any = None, k: Any = None, v: Any = None, metadata: Any = None) -> Any:
        """One forward of ``l0``; ``common`` goes through ``kv.build_metadata`` (default: the valid step)."""
        if common is None and metadata is None:
            common = self.common()
        if q is None:
            q, k, v = self.qkv(6 if common is None else common.num_actual_tokens)
        md = self.kv.build_metadata(common) if metadata is None else metadata
        with vattn.set_forward_context(md, self.cfg), torch.no_grad():
            out = self.layer(q, k, v)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return out

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {} if self.kv is None else {n: t.detach().clone() for n, t in self.kv.tensors.items()}

    def rejects(self, exc: type[BaseException], names: str, fn: Callable[[], Any]) -> str:
        """``fn()`` raises ``exc`` naming one of ``names`` ("a|b"), leaving the cache bit-identical."""
        before = self.snapshot()
        with pytest.raises(exc) as info:
            fn()
        msg = str(info.value)
        assert any(n in msg for n in names.split("|")), f"the message names none of {names}: {msg}"
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        for name, was in before.items():
            now = self.kv.tensors[name]
            assert torch.equal(was.view(torch.uint8), now.detach().view(torch.uint8)), f"cache {name} changed: {msg}"
        return msg


@pytest.fixture
def rig(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Rig:
    """(VATTN_DEBUG_CHECKS as the environment has it: every case passes with it on or off.)"""
    backend, device = request.param
    return Rig(backend, device, monkeypatch)


def hand_dev(rig: Rig, **kw: Any) -> dict[str, torch.Tensor]:
    return {k: torch.tensor(v, dtype=torch.int32, device=rig.device) for k, v in kw.items()}


# ---- the valid step still runs (the checks reject nothing valid) --------------------------


@pytest.mark.parametrize("rig", BACKENDS, indirect=True)
def test_valid_steps_still_run(rig: Rig) -> None:
    assert rig.run().shape == (6, H * D)
    assert rig.run(rig.hand()).shape == (6, H * D)
    padded = rig.common(num_tokens_padded=8, num_reqs_padded=4)  # CUDA-graph style padding: slot -1
    assert rig.run(padded, *rig.qkv(8)).shape == (8, H * D)
    shared = rig.common([1, 1], [17, 20], [[4, 2], [4, 3]])  # block 4 read by both: a shared prefix
    assert rig.run(shared, *rig.qkv(2)).shape == (2, H * D)
    from vattn.cudagraph import pad_common_attn_metadata

    assert rig.run(pad_common_attn_metadata(rig.common(), 8, 4), *rig.qkv(8)).shape == (8, H * D)


# ---- q/k/v against the metadata -----------------------------------------------------------

TOKEN_CASES: dict[str, tuple[type[BaseException], str, Callable[[Rig], Any]]] = {
    "fewer_tokens": (ValueError, "query", lambda r: r.run(r.common(), *r.qkv(5))),
    "more_tokens": (ValueError, "query", lambda r: r.run(r.common(), *r.qkv(9))),
    "zero_tokens": (ValueError, "query", lambda r: r.run(r.common(), *r.qkv(0))),
    "one_token_for_two_decodes": (ValueError, "query", lambda r: r.run(r.common([1, 1], [7, 3]), *r.qkv(1))),
    "kv_fewer_than_query": (ValueError, "key|value", lambda r: r.run(r.common(), *r.qkv(6, 5))),
    "query_fewer_than_kv": (ValueError, "query", lambda r: r.run(r.common(), *(lambda q, k, v: (q[:5], k, v))(*r.qkv()))),
    "value_none": (ValueError, "key/value", lambda r: r.run(r.common(), *(lambda q, k, v: (q, k, None))(*r.qkv()))),
    "key_none": (ValueError, "key/value", lambda r: r.run(r.common(), *(lambda q, k, v: (q, None, v))(*r.qkv()))),
    "query_wrong_heads": (ValueError, "query", lambda r: r.run(r.common(), *(lambda q, k, v: (
        q.view(6, H, D)[:, :3], k, v))(*r.qkv()))),
    "qkv_half_on_other_cache_dtype": (TypeError, "kv_cache dtype|dtype", lambda r: r.run(r.common(), *(
        lambda q, k, v: (q.to(torch.float16), k.to(torch.float16), v.to(torch.float16)))(*r.qkv()))),
    "metadata_on_meta_device": (ValueError, "device|slot_mapping", lambda r: r.run(r.common(device="meta"))),
}


@pytest.mark.parametrize("case", sorted(TOKEN_CASES))
@pytest.mark.parametrize("rig", BACKENDS, indirect=True)
def test_token_counts_and_inputs(rig: Rig, case: str) -> None:
    exc, names, fn = TOKEN_CASES[case]
    rig.rejects(exc, names, lambda: fn(rig))


LAYER_CASES: dict[str, tuple[type[BaseException], str, Callable[[Rig], Any]]] = {
    **{k: TOKEN_CASES[k] for k in ("kv_fewer_than_query", "value_none", "query_wrong_heads")},
    "key_dtype_differs": (TypeError, "differs from query dtype", lambda r: r.run(r.common(), *(
        lambda q, k, v: (q, k.to(torch.float16), v))(*r.qkv()))),
    "value_wider": (ValueError, "value last dim", lambda r: r.run(r.common(), *(
        lambda q, k, v: (q, k, torch.cat([v, v[:, :1]], 1)))(*r.qkv()))),
}


@pytest.mark.parametrize("case", sorted(LAYER_CASES))
@pytest.mark.parametrize("rig", [BACKENDS[0], *BACKENDS[2:5]], indirect=True)
def test_bad_inputs_after_valid_calls(rig: Rig, case: str) -> None:
    """Eager layer calls check q/k/v once per signature (shapes, dtypes, devices): a bad call
    after valid ones on the same layer is still caught, before anything is written."""
    rig.run()
    rig.run()
    exc, names, fn = LAYER_CASES[case]
    rig.rejects(exc, names, lambda: fn(rig))
    assert rig.run().shape == (6, H * D)  # and the layer still runs valid calls


@pytest.mark.parametrize("tokens", [5, 9])
@pytest.mark.parametrize("rig", [BACKENDS[0], BACKENDS[2]], indirect=True)
def test_token_count_mismatch_compiled(rig: Rig, tokens: int) -> None:
    """Under vattn.compile the op's real implementation checks the token count (host ints)."""
    layer = rig.layer

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = layer

        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return self.attn(q, k, v)

    model = vattn.compile(Tiny(), rig.cfg)
    with vattn.set_forward_context(rig.kv.build_metadata(rig.common()), rig.cfg):
        model(*rig.qkv(6))  # compiles; a valid step
    q, k, v = rig.qkv(tokens)

    def call() -> None:
        with vattn.set_forward_context(rig.kv.build_metadata(rig.common()), rig.cfg):
            model(q, k, v)

    rig.rejects(ValueError, "query", call)


# ---- hand-built CommonAttentionMetadata ---------------------------------------------------

def _tensor(rig: Rig, values: Any, dtype: torch.dtype = torch.int32, device: Any = None) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=rig.device if device is None else device)


HAND_CASES: dict[str, tuple[type[BaseException], str, Callable[[Rig], Any]]] = {
    "slot_past_cache": (ValueError, "slot_mapping", lambda r: r.hand(slots=[7, 16, 17, 18, 19, NB * BS + 3])),
    "slot_far_past_cache": (ValueError, "slot_mapping", lambda r: r.hand(slots=[2**40, 16, 17, 18, 19, 20])),
    "slot_negative_not_padding": (ValueError, "slot_mapping", lambda r: r.hand(slots=[7, 16, 17, -2, 19, 20])),
    "slot_very_negative": (ValueError, "slot_mapping", lambda r: r.hand(slots=[-100, 16, 17, 18, 19, 20])),
    "slot_written_twice": (ValueError, "slot_mapping", lambda r: r.hand(slots=[7, 16, 17, 17, 19, 20])),
    "slot_in_unowned_block": (ValueError, "slot_mapping", lambda r: r.hand(slots=[7, 16, 17, 18, 19, 5 * BS])),
    "slot_in_other_requests_block": (ValueError, "slot_mapping", lambda r: r.hand(slots=[7, 16, 17, 18, 19, 3])),
    "block_id_past_num_blocks": (ValueError, "block_table", lambda r: r.hand(
        table=[[0], [NB + 1]], slots=[7] + [(NB + 1) * BS + i for i in range(5)])),
    "block_id_past_num_blocks_read": (ValueError, "block_table", lambda r: r.hand(
        seq=[8, 21], table=[[0, 5], [NB + 2, 1]], slots=[7, 16, 17, 18, 19, 20])),
    "block_id_negative": (ValueError, "block_table", lambda r: r.hand(table=[[-3], [1]])),
    "block_in_two_requests": (ValueError, "block_table", lambda r: r.hand(table=[[0], [0]], slots=[7, 0, 1, 2, 3, 4])),
    "block_twice_in_request": (ValueError, "block_table", lambda r: r.hand(
        seq=[8, 21], table=[[0, 5], [1, 1]], slots=[7, 16, 17, 18, 19, 20])),
    "table_narrower_than_sequence": (ValueError, "block_table", lambda r: r.hand(
        seq=[8, 21], slots=[7, 32, 33, 34, 35, 36])),
    "seq_lens_past_table": (ValueError, "block_table|seq_lens", lambda r: r.hand(
        seq=[8, 40], table=[[0, 2], [1, 3]], slots=[7, 31, 32, 33, 34, 35])),
}

MIRROR_CASES: dict[str, tuple[type[BaseException], str, Callable[[Rig], Any]]] = {
    "query_start_loc_not_monotonic": (ValueError, "query_start_loc", lambda r: r.hand(
        query_start_loc=_tensor(r, [0, 4, 2]), query_start_loc_cpu=torch.tensor([0, 4, 2], dtype=torch.int32),
        max_query_len=4)),
    "query_start_loc_not_from_zero": (ValueError, "query_start_loc", lambda r: r.hand(
        query_start_loc=_tensor(r, [1, 2, 6]), query_start_loc_cpu=torch.tensor([1, 2, 6], dtype=torch.int32))),
    "query_start_loc_past_slots": (ValueError, "query_start_loc", lambda r: r.hand(
        query_start_loc=_tensor(r, [0, 1, 9]), query_start_loc_cpu=torch.tensor([0, 1, 9], dtype=torch.int32),
        max_query_len=8)),
    "num_actual_tokens_past_query_start_loc": (ValueError, "query_start_loc", lambda r: r.hand(
        num_actual_tokens=6, qsl=[0, 1, 4], seq=[8, 3])),
    "seq_lens_below_query_lens": (ValueError, "seq_lens", lambda r: r.hand(seq=[8, 3])),
    "seq_lens_negative": (ValueError, "seq_lens", lambda r: r.hand(seq=[8, -5])),
    "max_query_len_too_small": (ValueError, "max_query_len", lambda r: r.hand(max_query_len=2)),
    "max_seq_len_too_small": (ValueError, "max_seq_len", lambda r: r.hand(max_seq_len=3)),
    "num_reqs_past_tensors": (ValueError, "num_reqs|query_start_loc", lambda r: r.hand(num_reqs=3)),
    "num_actual_tokens_negative": (ValueError, "num_actual_tokens", lambda r: r.hand(num_actual_tokens=-1)),
    "num_actual_tokens_float": (ValueError, "num_actual_tokens", lambda r: r.hand(num_actual_tokens=6.0)),
    "slot_mapping_float": (ValueError, "slot_mapping", lambda r: r.hand(
        slot_mapping=_tensor(r, VALID_SLOTS, torch.float32))),
    "slot_mapping_int16": (ValueError, "slot_mapping", lambda r: r.hand(slot_mapping=_tensor(r, VALID_SLOTS, torch.int16))),
    "slot_mapping_2d": (ValueError, "slot_mapping", lambda r: r.hand(slot_mapping=_tensor(r, [[7, 16, 17], [18, 19, 20]],
                                                                                          torch.int64))),
    "block_table_float": (ValueError, "block_table_tensor", lambda r: r.hand(
        block_table_tensor=_tensor(r, [[0.0], [1.0]], torch.float32))),
    "block_table_1d": (ValueError, "block_table_tensor", lambda r: r.hand(block_table_tensor=_tensor(r, [0, 1]))),
    "query_start_loc_float": (ValueError, "query_start_loc", lambda r: r.hand(
        query_start_loc=_tensor(r, [0.0, 1.0, 6.0], torch.float32))),
    "block_table_on_other_device": (ValueError, "block_table_tensor", lambda r: r.hand(
        block_table_tensor=torch.zeros(2, 1, dtype=torch.int32, device="meta"))),
    "host_mirror_not_on_cpu": (ValueError, "query_start_loc_cpu", lambda r: r.hand(
        query_start_loc_cpu=torch.tensor([0, 1, 6], dtype=torch.int32, device="meta"))),
    "num_slot_tokens_past_slots": (ValueError, "num_slot_tokens", lambda r: r.hand(num_slot_tokens=9)),
    "num_computed_tokens_short": (ValueError, "num_computed_tokens_cpu", lambda r: r.hand(
        num_computed_tokens_cpu=torch.tensor([7], dtype=torch.int32))),
}


@pytest.mark.parametrize("case", sorted(MIRROR_CASES))
@pytest.mark.parametrize("rig", BACKENDS, indirect=True)
def test_hand_built_metadata_fields(rig: Rig, case: str) -> None:
    """Types, shapes, devices and what the host mirrors say: checked at construction, anywhere."""
    exc, names, fn = MIRROR_CASES[case]
    rig.rejects(exc, names, lambda: rig.run(fn(rig)))


@pytest.mark.parametrize("case", sorted(HAND_CASES))
@pytest.mark.parametrize("rig", BACKENDS, indirect=True)
def test_hand_built_metadata_contents(rig: Rig, case: str) -> None:
    """Slot and block contents: on the host for CPU tensors, with debug checks for device ones."""
    rig.debug_on_gpu()
    exc, names, fn = HAND_CASES[case]
    rig.rejects(exc, names, lambda: rig.run(fn(rig)))


@pytest.mark.parametrize("case", ["seq_lens", "query_start_loc"])
@pytest.mark.parametrize("rig", BACKENDS, indirect=True)
def test_device_tensor_disagrees_with_mirror(rig: Rig, case: str) -> None:
    rig.debug_on_gpu()
    bad = {"seq_lens": _tensor(rig, [8, 12]), "query_start_loc": _tensor(rig, [0, 2, 6])}[case]
    rig.rejects(ValueError, case, lambda: rig.run(rig.hand(**{case: bad})))


# ---- metadata of another block size or cache ------------------------------------------------

@pytest.mark.parametrize("case", ["bs32", "bs8", "bs8_decode", "blocks_past_cache", "num_blocks_of_bigger_cache"])
@pytest.mark.parametrize("rig", BACKENDS, indirect=True)
def test_metadata_for_another_cache(rig: Rig, case: str) -> None:
    build = vattn.build_common_attn_metadata
    common, names, t = {
        "bs32": (lambda: build([1, 5], [7, 0], [[0], [1]], 32, device=rig.device), "block_size", 6),
        "bs8": (lambda: build([1, 5], [7, 0], [[0], [1]], 8, device=rig.device), "block_size", 6),
        "bs8_decode": (lambda: build([1, 1], [7, 3], [[0], [1]], 8, device=rig.device), "block_size", 2),
        "blocks_past_cache": (lambda: build([1, 5], [7, 0], [[0], [NB + 4]], BS, device=rig.device), "num_blocks", 6),
        "num_blocks_of_bigger_cache": (lambda: build([1, 5], [7, 0], [[0], [NB + 4]], BS, device=rig.device,
                                                     num_blocks=4 * NB), "num_blocks", 6),
    }[case]
    rig.rejects(ValueError, names, lambda: rig.run(common(), *rig.qkv(t)))


def test_common_metadata_checks_block_ids_where_built(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = Rig("TORCH_SDPA", "cpu", monkeypatch)
    rig.rejects(ValueError, "block_tables", lambda: rig.common(tables=[[0], [NB]]))


# ---- a cache of another configuration bound to the layer -------------------------------------

def _other_cache(rig: Rig, **kw: Any) -> torch.Tensor:
    spec = dict(num_blocks=NB, block_size=BS, num_kv_heads=HK, head_size=D)
    spec.update({k: v for k, v in kw.items() if k in spec})
    shape = rig.layer.attn_backend.get_kv_cache_shape(spec["num_blocks"], spec["block_size"], spec["num_kv_heads"],
                                                      spec["head_size"])
    return torch.randn(shape, generator=rig.gen).to(kw.get("dtype", rig.dtype)).to(kw.get("device", rig.device))


@pytest.mark.parametrize("case", ["kv_heads", "head_size", "block_size", "rank"])
@pytest.mark.parametrize("rig", BACKENDS, indirect=True)
def test_bind_cache_of_another_configuration(rig: Rig, case: str) -> None:
    other = {"kv_heads": lambda: _other_cache(rig, num_kv_heads=4),
             "head_size": lambda: _other_cache(rig, head_size=32),
             "block_size": lambda: _other_cache(rig, block_size=32, num_blocks=4),
             "rank": lambda: torch.zeros(NB, BS, HK, D, dtype=rig.dtype, device=rig.device)}[case]()
    rig.rejects(ValueError, "kv_cache", lambda: vattn.bind_kv_cache({"l0": other}, rig.cfg))
    assert rig.layer.kv_cache[0] is rig.kv.tensors["l0"]  # nothing bound


@pytest.mark.parametrize("case", ["kv_heads", "head_size", "block_size"])
@pytest.mark.parametrize("rig", BACKENDS, indirect=True)
def test_cache_assigned_directly(rig: Rig, case: str) -> None:
    """A tensor put in ``layer.kv_cache`` by hand is checked by the op before it writes."""
    kw = {"kv_heads": dict(num_kv_heads=4), "head_size": dict(head_size=32),
          "block_size": dict(block_size=32, num_blocks=4)}[case]
    rig.layer.kv_cache = [_other_cache(rig, **kw)]
    rig.kv.tensors["l0"] = rig.layer.kv_cache[0]
    rig.rejects(ValueError, "kv_cache", rig.run)


@pytest.mark.parametrize("rig", BACKENDS, indirect=True)
def test_cache_with_fewer_blocks_than_the_metadata(rig: Rig) -> None:
    small = _other_cache(rig, num_blocks=1)
    vattn.bind_kv_cache({"l0": small}, rig.cfg)  # a valid cache, but the step uses block 1
    rig.kv.tensors["l0"] = small
    msg = rig.rejects(ValueError, "num_blocks", rig.run)
    assert "(layer 'l0''s KV cache)" in msg  # the layer's check names its cache


@pytest.mark.parametrize("rig", BACKENDS, indirect=True)
def test_cache_of_another_dtype(rig: Rig) -> None:
    other = _other_cache(rig, dtype=torch.float16)
    vattn.bind_kv_cache({"l0": other}, rig.cfg)
    rig.kv.tensors["l0"] = other
    rig.rejects(TypeError, "kv_cache dtype", rig.run)


@pytest.mark.parametrize("rig", CPU_ONLY, indirect=True)
def test_cache_on_another_device(rig: Rig) -> None:
    vattn.bind_kv_cache({"l0": torch.zeros(rig.kv.tensors["l0"].shape, dtype=rig.dtype, device="meta")}, rig.cfg)
    rig.rejects(ValueError, "kv_cache", rig.run)


@pytest.mark.parametrize("rig", CPU_ONLY, indirect=True)
def test_bind_something_else(rig: Rig) -> None:
    rig.rejects(TypeError, "tensors['l0']", lambda: vattn.bind_kv_cache({"l0": [1, 2]}, rig.cfg))
    rig.rejects(KeyError, "nope", lambda: vattn.bind_kv_cache({"nope": rig.kv.tensors["l0"]}, rig.cfg))


# ---- construction-time values --------------------------------------------------------------

CONSTRUCT_CASES: dict[str, tuple[type[BaseException], str, dict[str, Any]]] = {
    "window_zero": (ValueError, "per_layer_sliding_window", dict(per_layer_sliding_window=0)),
    "window_negative": (ValueError, "per_layer_sliding_window", dict(per_layer_sliding_window=-4)),
    "window_float": (TypeError, "per_layer_sliding_window", dict(per_layer_sliding_window=2.5)),
    "scale_nan": (ValueError, "scale", dict(scale=float("nan"))),
    "scale_inf": (ValueError, "scale", dict(scale=float("inf"))),
    "scale_string": (TypeError, "scale", dict(scale="abc")),
    "scale_none": (TypeError, "scale", dict(scale=None)),
    "scale_zero": (ValueError, "scale", dict(scale=0.0)),
    "scale_negative": (ValueError, "scale", dict(scale=-0.125)),
    "soft_cap_nan": (ValueError, "logits_soft_cap", dict(logits_soft_cap=float("nan"))),
    "soft_cap_negative": (ValueError, "logits_soft_cap", dict(logits_soft_cap=-5.0)),
    "soft_cap_inf": (ValueError, "logits_soft_cap", dict(logits_soft_cap=float("inf"))),
    "soft_cap_string": (TypeError, "logits_soft_cap", dict(logits_soft_cap="30")),
    "num_heads_string": (TypeError, "num_heads", dict(num_heads="8")),
    "num_heads_zero": (ValueError, "num_heads", dict(num_heads=0)),
    "num_heads_float": (TypeError, "num_heads", dict(num_heads=4.0)),
    "head_size_zero": (ValueError, "head_size", dict(head_size=0)),
    "head_size_string": (TypeError, "head_size", dict(head_size="64")),
    "num_kv_heads_not_divisor": (ValueError, "num_kv_heads", dict(num_kv_heads=3)),
    "num_kv_heads_negative": (ValueError, "num_kv_heads", dict(num_kv_heads=-2)),
    "alibi_wrong_length": (ValueError, "alibi_slopes", dict(alibi_slopes=[0.5, 0.25])),
    "alibi_nan": (ValueError, "alibi_slopes", dict(alibi_slopes=[0.5, float("nan"), 0.25, 0.125])),
    "alibi_strings": (TypeError, "alibi_slopes", dict(alibi_slopes=["a", "b", "c", "d"])),
    "attn_type_bogus": (ValueError, "attn_type", dict(attn_type="bogus")),
    "sinks_wrong_shape": (ValueError, "sinks", dict(sinks=torch.zeros(3))),
}


@pytest.mark.parametrize("case", sorted(CONSTRUCT_CASES))
def test_layer_construction(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    exc, names, kw = CONSTRUCT_CASES[case]
    rig = Rig("TORCH_SDPA", "cpu", monkeypatch, build=False)
    rig.rejects(exc, names, lambda: rig.make_layer(**kw))
    assert "l0" not in rig.cfg.compilation.static_forward_context  # nothing registered


@pytest.mark.parametrize("kw, names", [
    (dict(block_size=0), "block_size"), (dict(block_size="16"), "block_size"), (dict(block_size=True), "block_size"),
    (dict(sliding_window=0), "sliding_window"), (dict(sliding_window=8.5), "sliding_window"),
    (dict(cache_dtype="int8"), "cache_dtype"), (dict(calculate_kv_scales="yes"), "calculate_kv_scales"),
])
def test_cache_config(kw: dict[str, Any], names: str) -> None:
    with pytest.raises((ValueError, TypeError), match=names):
        vattn.CacheConfig(**kw)


# ---- blocks used twice ------------------------------------------------------------------------

DUP_CASES = {
    "block_twice_in_request_prefill": (([20], [0], [[2, 2]]), 20),
    "block_twice_in_request_decode": (([1], [16], [[2, 2]]), 1),
    "block_in_two_requests_both_write": (([1, 5], [7, 0], [[3], [3]]), 6),
    "block_written_and_read_by_another": (([1, 1], [3, 20], [[4], [4, 5]]), 2),
    "two_decodes_one_block": (([1, 1], [3, 9], [[4], [4]]), 2),
}


@pytest.mark.parametrize("case", sorted(DUP_CASES))
@pytest.mark.parametrize("rig", BACKENDS, indirect=True)
def test_blocks_used_twice(rig: Rig, case: str) -> None:
    (qlens, computed, tables), t = DUP_CASES[case]
    rig.rejects(ValueError, "block_tables", lambda: rig.run(rig.common(qlens, computed, tables), *rig.qkv(t)))


# ---- the per-request facts' types --------------------------------------------------------------

def _build(**over: Any) -> Callable[[], Any]:
    args: dict[str, Any] = dict(query_lens=[1, 5], num_computed_tokens=[7, 0], block_tables=[[0], [1]], block_size=BS)
    args.update(over)
    return lambda: vattn.build_common_attn_metadata(**args)


TYPE_CASES: dict[str, tuple[type[BaseException], str, Callable[[], Any]]] = {
    "query_lens_float": (TypeError, "query_lens", _build(query_lens=[1.5, 5])),
    "query_lens_float_tensor": (TypeError, "query_lens", _build(query_lens=torch.tensor([1.0, 5.7]))),
    "query_lens_bool": (TypeError, "query_lens", _build(query_lens=[True, True])),
    "query_lens_strings": (TypeError, "query_lens", _build(query_lens=["1", "5"])),
    "query_lens_negative": (ValueError, "query_lens", _build(query_lens=[-1, 5])),
    "num_computed_float": (TypeError, "num_computed_tokens", _build(num_computed_tokens=[7.7, 0])),
    "block_tables_float_list": (TypeError, "block_tables", _build(block_tables=[[0.0], [1.9]])),
    "block_tables_ragged_float": (TypeError, "block_tables", _build(query_lens=[1, 20],
                                                                   block_tables=[[0], [1, 2.5]])),
    "block_tables_float_tensor": (TypeError, "block_tables", _build(block_tables=torch.tensor([[0.0], [1.6]]))),
    "block_tables_too_few_rows": (ValueError, "block_tables", _build(block_tables=[[0]])),
    "block_size_float": (TypeError, "block_size", _build(block_size=16.0)),
    "block_size_zero": (ValueError, "block_size", _build(block_size=0)),
    "lengths_differ": (ValueError, "query_lens", _build(query_lens=[1, 5, 2])),
    "num_tokens_padded_too_small": (ValueError, "num_tokens_padded", _build(num_tokens_padded=4)),
    "max_blocks_per_req_string": (TypeError, "max_blocks_per_req", _build(max_blocks_per_req="2")),
    "max_blocks_per_req_too_small": (ValueError, "max_blocks_per_req", _build(block_tables=[[0], [1, 2]],
                                                                            max_blocks_per_req=1)),
    "num_blocks_string": (TypeError, "num_blocks", _build(num_blocks="8")),
}


@pytest.mark.parametrize("case", sorted(TYPE_CASES))
def test_per_request_facts(case: str) -> None:
    exc, names, fn = TYPE_CASES[case]
    with pytest.raises(exc) as info:
        fn()
    assert names in str(info.value), str(info.value)


# ---- variables, sizes and the forward context --------------------------------------------------

@pytest.mark.parametrize("var, value", [("VATTN_Q_SCALE_CONSTANT", "abc"), ("VATTN_K_SCALE_CONSTANT", "1.5"),
                                        ("VATTN_KV_CACHE_LAYOUT", "XYZ"), ("VATTN_ATTENTION_BACKEND", "NOPE")])
def test_bad_variables_name_themselves(var: str, value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(var, value)

    def build() -> None:
        cfg = vattn.VattnConfig()
        with vattn.set_current_vattn_config(cfg):
            vattn.Attention(H, D, 0.125, num_kv_heads=HK, prefix="x")
        vattn.allocate_kv_cache(cfg, num_blocks=2)

    with pytest.raises(ValueError, match=var):
        build()


@pytest.mark.parametrize("num_blocks, exc", [(2**40, ValueError), (0, ValueError), ("8", TypeError), (-1, ValueError),
                                             (2.0, TypeError)])
def test_num_blocks(num_blocks: Any, exc: type[BaseException], monkeypatch: pytest.MonkeyPatch) -> None:
    rig = Rig("TORCH_SDPA", "cpu", monkeypatch, build=False)
    rig.layer = rig.make_layer()
    with pytest.raises(exc, match="num_blocks"):
        rig.allocate(num_blocks)


@pytest.mark.parametrize("rig", CPU_ONLY, indirect=True)
def test_forward_context_holds_something_else(rig: Rig) -> None:
    rig.rejects(TypeError, "attn_metadata", lambda: rig.run(metadata="not metadata"))
    rig.rejects(TypeError, "kv.build_metadata", lambda: rig.run(metadata=rig.common()))
    rig.rejects(TypeError, "common", lambda: rig.kv.build_metadata("not metadata"))


@pytest.mark.parametrize("rig", CPU_ONLY, indirect=True)
def test_negative_kv_scale(rig: Rig) -> None:
    rig.rejects(ValueError, "k_scale", lambda: rig.layer.set_kv_scales(-1.0, 1.0))


def test_example_model_positions_past_the_table() -> None:
    from examples.engine import Engine, SamplingParams
    from examples.model import DecoderForCausalLM, ModelConfig, init_random_weights

    cfg = vattn.VattnConfig()
    mc = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=32, max_position_embeddings=32)
    with vattn.set_current_vattn_config(cfg):
        model = DecoderForCausalLM(mc, attn_backend="TORCH_SDPA")
    init_random_weights(model)
    kv = vattn.allocate_kv_cache(cfg, num_blocks=8, dtype=torch.float32)
    before = kv.tensors["model.layers.0.self_attn.attn"].clone()
    common = kv.common_metadata([2], [40], [[0, 1, 2, 3]])
    with vattn.set_forward_context(kv.build_metadata(common), cfg), pytest.raises(ValueError, match="positions"):
        model(torch.tensor([1, 2]), torch.tensor([40, 41]))
    assert torch.equal(before, kv.tensors["model.layers.0.self_attn.attn"])
    engine = Engine(model, cfg, kv, device="cpu")
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine.add_request(list(range(20)), SamplingParams(max_tokens=20))


# ---- debug checks (VATTN_DEBUG_CHECKS=1) -----------------------------------------------------

def _batch(**over: Any) -> dict[str, Any]:
    b: dict[str, Any] = dict(qsl=[0, 1, 6], seq=[8, 5], table=[[0], [1]], slots=VALID_SLOTS)
    b.update(over)
    return b


DEBUG_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "slot_past_cache": ("slot_mapping", _batch(slots=[7, 16, 17, 18, 19, NB * BS])),
    "slot_negative": ("slot_mapping", _batch(slots=[7, -5, 17, 18, 19, 20])),
    "slot_inconsistent": ("slot_mapping", _batch(slots=[7, 16, 17, 18, 19, 40])),
    "slot_twice": ("slot_mapping", _batch(slots=[7, 16, 16, 18, 19, 20])),
    "block_past_num_blocks": ("block_table_tensor", _batch(table=[[0], [NB]], slots=[7, -1, -1, -1, -1, -1])),
    "block_in_two_requests": ("block_table_tensor", _batch(table=[[0], [0]], slots=[7, 0, 1, 2, 3, 4])),
    "qsl_decreasing": ("query_start_loc", _batch(qsl=[0, 4, 2])),
    "seq_below_query": ("seq_lens", _batch(seq=[8, 2])),
    "table_too_narrow": ("block_table_tensor", _batch(seq=[8, 40])),
}


@pytest.mark.parametrize("case", sorted(DEBUG_CASES))
def test_device_batch_checks(case: str) -> None:
    """What ``VATTN_DEBUG_CHECKS=1`` runs on device tensors (here CPU ones: the same code path,
    minus the copy)."""
    names, b = DEBUG_CASES[case]
    t = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    with pytest.raises(ValueError, match=names):
        debug_checks.check_device_batch(t(b["qsl"]), t(b["seq"]), t(b["table"]), torch.tensor(b["slots"]),
                                        num_reqs=2, num_tokens=6, num_slot_tokens=None, causal=True, block_size=BS,
                                        num_blocks=NB)


@pytest.mark.parametrize("rig", BACKENDS, indirect=True)
def test_debug_checks_builder_called_directly(rig: Rig) -> None:
    """Metadata from a builder called directly (no PagedKVCache.build_metadata): with debug checks
    the op checks the backend metadata's tensors before the first kernel."""
    rig.mp.setenv("VATTN_DEBUG_CHECKS", "1")
    if rig.backend == "FLASHINFER":
        pytest.skip("FLASHINFER's metadata is planned wrappers: only its slots are checked")
    builder = rig.kv.groups[0].builder
    with torch.inference_mode(False):
        bad = vattn.CommonAttentionMetadata(**{**rig.hand().__dict__, "host_checks": None,
                                               "slot_mapping": _tensor(rig, [7, 16, 17, 18, 19, 40 * BS], torch.int64)})
    if rig.device.type == "cpu":  # host tensors: the checks of kv.build_metadata would catch it; skip them
        bad.host_checks.host_batch = None
    md = builder.build(0, bad)
    rig.rejects(ValueError, "slot_mapping", lambda: rig.run(metadata=md))


@pytest.mark.parametrize("rig", [BACKENDS[2], BACKENDS[3], BACKENDS[4]], indirect=True)
def test_debug_checks_on_device_metadata(rig: Rig) -> None:
    """A hand-built step whose slots lie past the cache: silently out of bounds on a GPU without
    debug checks (not run here), rejected before any kernel with them."""
    rig.mp.setenv("VATTN_DEBUG_CHECKS", "1")
    rig.rejects(ValueError, "slot_mapping", lambda: rig.run(rig.hand(slots=[7, 16, 17, 18, 19, 2**30])))


def test_unchecked_block_limit_only_for_tables_the_host_never_saw(monkeypatch: pytest.MonkeyPatch) -> None:
    """Builders clamp a block table only where the host never saw its ids (device-only hand-built
    metadata), to the bound cache's block count; tables vattn checked are used as they are."""
    rig = Rig("TORCH_SDPA", "cpu", monkeypatch)
    builder = rig.kv.groups[0].builder
    assert builder.unchecked_block_limit(rig.common()) is None  # kv.common_metadata: ids checked
    cm = rig.hand()  # CPU tensors: checked on the host against the cache it meets
    assert builder.unchecked_block_limit(cm) is None
    cm.host_checks.host_batch = None  # what device tensors leave: nothing known on the host
    assert builder.unchecked_block_limit(cm) == NB


@pytest.mark.parametrize("rig", [BACKENDS[2], BACKENDS[3], BACKENDS[4], BACKENDS[5]], indirect=True)
@pytest.mark.parametrize("bad", ["block_past_cache", "block_negative", "slot_past_cache"])
def test_device_metadata_without_debug_checks_never_faults(rig: Rig, bad: str) -> None:
    """Without debug checks a hand-built step's device-only block ids and slots are not read on
    the host; bad ones give wrong values but never fault the GPU: block tables of unchecked
    metadata are clamped into the cache (TORCH_SDPA, FLASHINFER and FLASH_ATTN's builders,
    TRITON_ATTN's kernels), the store skips slots past it. The CUDA context stays usable and the
    cache outside the step's valid slots is untouched (more cases: tests/test_bad_metadata.py)."""
    over = {"block_past_cache": dict(table=[[0], [1 << 20]]), "block_negative": dict(table=[[0], [-5]]),
            "slot_past_cache": dict(slots=[7, 16, 17, 18, 19, 1 << 40])}[bad]
    q, k, v = rig.qkv()
    before = rig.snapshot()
    # The same writes as a valid step (the slot past the cache as padding): nothing else changes.
    rig.run(rig.hand(slots=[7, 16, 17, 18, 19, -1]) if bad == "slot_past_cache" else rig.hand(), q, k, v)
    want = rig.snapshot()
    for name, t in before.items():
        rig.kv.tensors[name].copy_(t)
    rig.run(rig.hand(**over), q, k, v)
    assert all(torch.equal(rig.kv.tensors[n], t) for n, t in want.items())
    assert rig.run().isfinite().all()  # the context still works


def test_debug_checks_skip_valid_and_padded_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VATTN_DEBUG_CHECKS", "1")
    rig = Rig("TORCH_SDPA", "cpu", monkeypatch)
    from vattn.cudagraph import pad_common_attn_metadata

    rig.run()
    rig.run(pad_common_attn_metadata(rig.common(), 8, 4), *rig.qkv(8))
    rig.run(rig.common([1, 1], [17, 20], [[4, 2], [4, 3]]), *rig.qkv(2))  # read-only shared prefix block
    assert not math.isnan(float(rig.run().float().sum()))
    assert np.isfinite(rig.run(rig.hand()).float().numpy()).all()

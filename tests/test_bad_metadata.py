"""Metadata edited after it is built, draft trees a backend cannot honour, warm-up runs, and the
messages of a wrong dtype or device (issue 54, items 2, 3 and 7).

``CommonAttentionMetadata`` is a public dataclass: an engine may edit it after construction. Host
tensors (every tensor on a CPU device, the ``*_cpu`` mirrors always) are checked again every step
once edited (``StepChecks.describes``: version counters), before anything is written; device-only
metadata is not read without ``VATTN_DEBUG_CHECKS=1`` (no sync), so on a GPU the backends keep
every access inside the cache and the block table (the ``cuda`` tests at the end).
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

import vattn
from conftest import HAS_CUDA
from test_bad_inputs import BACKENDS, BS, CPU_ONLY, NB, Rig

CPU_BACKENDS = BACKENDS[:2]  # TORCH_SDPA, TRITON_ATTN under the interpreter
GPU_BACKENDS = BACKENDS[2:]


@pytest.fixture
def rig(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Rig:
    backend, device = request.param
    return Rig(backend, device, monkeypatch)


def _set(name: str, index: Any, value: int) -> Callable[[Any], None]:
    """Edit one entry of a tensor field in place."""
    return lambda cm: getattr(cm, name).__setitem__(index, value)


def _both(name: str, index: Any, value: int) -> Callable[[Any], None]:
    """Edit a device tensor and its host mirror alike."""
    def edit(cm: Any) -> None:
        getattr(cm, name)[index] = value
        getattr(cm, name + "_cpu")[index] = value
    return edit


def _seq_past_table(cm: Any) -> None:
    _both("seq_lens", 1, 40)(cm)
    cm.max_seq_len = 40


#: case -> (the edit, what the message names). The valid step: a decode at position 7 (block 0),
#: a 5-token prefill (block 1).
EDITS: dict[str, tuple[Callable[[Any], None], str]] = {
    "slot_past_cache": (_set("slot_mapping", 5, NB * BS + 3), "slot_mapping"),
    "slot_negative_not_padding": (_set("slot_mapping", 3, -2), "slot_mapping"),
    "slot_other_block": (_set("slot_mapping", 5, 5 * BS), "slot_mapping"),
    "block_past_num_blocks": (_set("block_table_tensor", (1, 0), NB + 1), "block_table"),
    "block_negative": (_set("block_table_tensor", (1, 0), -3), "block_table"),
    "query_start_loc_not_monotonic": (_both("query_start_loc", 1, 7), "query_start_loc"),
    "seq_lens_below_query_lens": (_both("seq_lens", 1, 3), "seq_lens"),
    "seq_lens_past_table": (_seq_past_table, "block_table_tensor"),
    "max_seq_len_too_small": (lambda cm: setattr(cm, "max_seq_len", 3), "max_seq_len"),
    "num_reqs_past_tensors": (lambda cm: setattr(cm, "num_reqs", 3), "num_reqs|query_start_loc"),
}


@pytest.mark.parametrize("built", ["helper", "hand"])
@pytest.mark.parametrize("case", sorted(EDITS))
@pytest.mark.parametrize("rig", CPU_BACKENDS, indirect=True)
def test_host_metadata_edited_after_a_step(rig: Rig, case: str, built: str) -> None:
    """A step runs on the metadata, then it is edited in place and run again: rejected with the
    field named, before anything is written (the checks of the first step are not reused).
    (Under the Triton interpreter the first step only builds the metadata, where its checks run.)"""
    edit, names = EDITS[case]
    cm = rig.common() if built == "helper" else rig.hand()
    q, k, v = rig.qkv()
    if rig.backend == "TORCH_SDPA":
        rig.run(cm, q, k, v)
    else:
        rig.kv.build_metadata(cm)
    edit(cm)
    rig.rejects(ValueError, names, lambda: rig.run(cm, *rig.qkv()))  # new K/V: a write would show


@pytest.mark.parametrize("rig", CPU_ONLY, indirect=True)
def test_mirror_edited_alone(rig: Rig) -> None:
    """A hand-built step's host mirror edited (the device tensor, here another CPU tensor, not)."""
    cm = rig.hand()
    rig.run(cm)
    cm.seq_lens_cpu[1] = 6
    rig.rejects(ValueError, "seq_lens", lambda: rig.run(cm))


@pytest.mark.parametrize("rig", CPU_ONLY, indirect=True)
def test_unedited_metadata_is_not_checked_again(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-step cost: metadata reused unedited keeps its facts (no host check runs again)."""
    import vattn.kv_cache as kv_cache

    cm = rig.hand()
    rig.run(cm)
    calls = []
    monkeypatch.setattr(kv_cache, "check_common_metadata", lambda md: calls.append(md))
    rig.run(cm)
    assert not calls


# ---- draft trees on a backend without them ------------------------------------------------


@pytest.mark.parametrize("rig", CPU_ONLY, indirect=True)
def test_tree_parents_refused_where_not_honoured(rig: Rig) -> None:
    cm = rig.common(tree_parents=[-1, -1, 0, 0, 1, 2])
    msg = rig.rejects(NotImplementedError, "tree_parents", lambda: rig.run(cm))
    assert "TORCH_SDPA" in msg and "TREE_ATTN" in msg
    # A batch of one token per request has no tree to honour: it runs.
    rig.run(rig.common([1, 1], [7, 3], [[0], [1]], tree_parents=[-1, -1]), *rig.qkv(2))


# ---- wrong dtype, device, and a forgotten metadata ----------------------------------------


@pytest.mark.parametrize("rig", CPU_BACKENDS, indirect=True)
def test_inputs_of_another_dtype_name_the_inputs(rig: Rig) -> None:
    q, k, v = rig.qkv()
    msg = rig.rejects(TypeError, "query/key/value dtype", lambda: rig.run(rig.common(), q.bfloat16(), k.bfloat16(),
                                                                          v.bfloat16()))
    assert "cast the inputs to torch.float32" in msg and "kv_cache dtype" not in msg


@pytest.mark.parametrize("rig", CPU_ONLY, indirect=True)
def test_cache_of_another_dtype_names_the_cache(rig: Rig) -> None:
    rig.kv = vattn.allocate_kv_cache(rig.cfg, num_blocks=NB, dtype=torch.bfloat16)  # the layer is float32
    msg = rig.rejects(TypeError, "kv_cache dtype", lambda: rig.run())
    assert "allocate_kv_cache(..., dtype=torch.float32)" in msg


@pytest.mark.skipif(HAS_CUDA, reason="needs a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_allocate_on_cuda_without_cuda(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    rig = Rig("TORCH_SDPA", "cpu", monkeypatch, build=False)
    rig.make_layer()
    with pytest.raises(ValueError, match="device: expected a device this machine has"):
        vattn.allocate_kv_cache(rig.cfg, num_blocks=NB, device=device)


@pytest.mark.parametrize("rig", CPU_BACKENDS, indirect=True)
def test_no_metadata_needs_a_warm_up_run(rig: Rig) -> None:
    q, k, v = rig.qkv()

    def step(**kw: Any) -> torch.Tensor:
        with vattn.set_forward_context(None, rig.cfg, **kw), torch.no_grad():
            return rig.layer(q, k, v)

    msg = rig.rejects(ValueError, "attn_metadata", step)
    assert "dummy_run=True" in msg
    before = rig.snapshot()
    assert not step(dummy_run=True).any()
    assert all(torch.equal(rig.kv.tensors[n], t) for n, t in before.items())


# ---- device-only metadata on a GPU: no check without a sync, no fault either --------------


def _no_fault_step(rig: Rig, over: dict[str, Any], valid_slots: list[int] | None = None) -> None:
    """A hand-built device step with ``over`` replaced writes what the valid step writes (no slot
    past the cache is written, nothing outside its slots changes) and leaves the context usable."""
    q, k, v = rig.qkv()
    before = rig.snapshot()
    rig.run(rig.hand(**({"slots": valid_slots} if valid_slots else {})), q, k, v)
    want = rig.snapshot()
    for name, t in before.items():
        rig.kv.tensors[name].copy_(t)
    cm = rig.hand(**over)
    rig.run(cm, q, k, v)
    assert all(torch.equal(rig.kv.tensors[n].view(torch.uint8), t.view(torch.uint8)) for n, t in want.items())
    assert rig.run().isfinite().all()  # the context still works


@pytest.mark.parametrize("rig", GPU_BACKENDS, indirect=True)
@pytest.mark.parametrize("bad", ["block_past_cache", "block_negative", "seq_lens_past_table", "qsl_past_tokens",
                                 "qsl_decreasing"])
def test_device_metadata_never_faults(rig: Rig, bad: str) -> None:
    """Device tensors that disagree with their (valid) host mirrors or hold ids past the cache:
    TRITON_ATTN's kernels, TORCH_SDPA's gathers, FLASHINFER's page gather and FLASH_ATTN's
    builder clamp them, so the GPU never reads outside the cache or the block table."""
    dev = rig.device
    t32 = lambda v: torch.tensor(v, dtype=torch.int32, device=dev)  # noqa: E731
    over = {"block_past_cache": dict(table=[[0], [1 << 20]]), "block_negative": dict(table=[[0], [-5]]),
            "seq_lens_past_table": dict(seq_lens=t32([8, 1 << 20])),
            "qsl_past_tokens": dict(query_start_loc=t32([0, 1, 1 << 20])),
            "qsl_decreasing": dict(query_start_loc=t32([0, 5, 2]))}[bad]
    _no_fault_step(rig, over)


@pytest.mark.parametrize("rig", GPU_BACKENDS, indirect=True)
def test_device_metadata_edited_in_place_is_clamped(rig: Rig) -> None:
    """Metadata vattn's helpers built (block ids checked on the host), then a device block id
    edited in place: its facts no longer hold (version counter), so the backends clamp it."""
    cm = rig.common()
    rig.run(cm)
    builder = rig.kv.groups[0].builder
    assert builder.unchecked_block_limit(cm) is None
    cm.block_table_tensor[1, 0] = 1 << 20
    rig.kv.check(cm)
    assert builder.unchecked_block_limit(cm) == NB
    assert rig.run(cm).isfinite().all()
    assert rig.run().isfinite().all()


@pytest.mark.parametrize("rig", [BACKENDS[2]], indirect=True)
def test_triton_fused_store_skips_slots_past_the_cache(rig: Rig) -> None:
    """A decode batch (TRITON_ATTN stores inside the attention kernel) with a device slot past
    the cache: that token writes nothing."""
    q, k, v = rig.qkv(2)
    before = rig.snapshot()
    cm = rig.hand(qsl=[0, 1, 2], seq=[8, 4], slots=[7, 16 + 3])
    rig.run(cm, q, k, v)
    want = rig.snapshot()
    for name, t in before.items():
        rig.kv.tensors[name].copy_(t)
    rig.run(rig.hand(qsl=[0, 1, 2], seq=[8, 4], slots=[7, 1 << 40]), q, k, v)
    for n, t in want.items():
        now = rig.kv.tensors[n]
        assert torch.equal(now[:, 0], t[:, 0]) and torch.equal(now[:, 1], before[n][:, 1])


# ---- the same guards in TRITON_ATTN's kernels, on the CPU (interpreter) --------------------


def _unchecked_run(rig: Rig, edit: Callable[[Any], None], **hand: Any) -> torch.Tensor:
    """The step built by hand, edited in place, then built by the builder directly and run: no
    host check sees the edit, as none reads device tensors on a GPU."""
    cm = rig.hand(**hand)
    edit(cm)
    md = rig.kv.groups[0].builder.build(0, cm)
    return rig.run(metadata=md, q=rig.q, k=rig.k, v=rig.v)


KERNEL_EDITS: dict[str, tuple[Callable[[Any], None], dict[str, Any]]] = {
    "block_past_cache": (_set("block_table_tensor", (1, 0), 1 << 20), {}),
    "block_negative": (_set("block_table_tensor", (1, 0), -(1 << 20)), {}),
    "seq_lens_past_table": (_set("seq_lens", 1, 1 << 20), {}),
    "qsl_past_tokens": (_set("query_start_loc", 2, 1 << 20), {}),
    "qsl_negative": (_set("query_start_loc", 1, -(1 << 20)), {}),
    "decode_slot_past_cache": (_set("slot_mapping", 1, 1 << 40), dict(qsl=[0, 1, 2], seq=[8, 4], slots=[7, 19])),
}


@pytest.mark.parametrize("case", sorted(KERNEL_EDITS))
@pytest.mark.parametrize("rig", [BACKENDS[1]], indirect=True)
def test_triton_kernels_stay_inside_the_tensors(rig: Rig, case: str) -> None:
    """Unchecked metadata with ids, lengths or offsets past the tensors: the kernels clamp (or, for
    a stored slot, skip) them. The interpreter reads raw memory, so an access outside would crash
    the process or read garbage; here the output is finite and the cache as the valid step left it."""
    edit, hand = KERNEL_EDITS[case]
    t = len(hand.get("slots", [0] * 6))
    rig.q, rig.k, rig.v = rig.qkv(t)
    before = rig.snapshot()
    valid = _unchecked_run(rig, lambda cm: None, **hand)
    want = rig.snapshot()
    for name, x in before.items():
        rig.kv.tensors[name].copy_(x)
    out = _unchecked_run(rig, edit, **hand)
    assert out.isfinite().all() and out.shape == valid.shape
    for name, x in want.items():
        now = rig.kv.tensors[name]
        if case == "decode_slot_past_cache":  # the second token writes nothing
            assert torch.equal(now[:, 0], x[:, 0]) and torch.equal(now[:, 1], before[name][:, 1])
        else:
            assert torch.equal(now, x)

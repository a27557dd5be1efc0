"""KV-cache allocation, binding and the per-request metadata arithmetic."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import vattn
from vattn.backends.torch_sdpa import TorchSDPABackend


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_slot_mapping_matches_per_token_reference(data):
    bs = data.draw(st.sampled_from([1, 4, 16]))
    n = data.draw(st.integers(1, 6))
    qlens = data.draw(st.lists(st.integers(0, 20), min_size=n, max_size=n))
    computed = data.draw(st.lists(st.integers(0, 40), min_size=n, max_size=n))
    pool = list(range(1000))
    data.draw(st.randoms()).shuffle(pool)
    tables, i = [], 0
    for q, c in zip(qlens, computed):
        need = math.ceil((q + c) / bs) + data.draw(st.integers(0, 2))
        tables.append(pool[i:i + need])
        i += need
    md = vattn.build_common_attn_metadata(qlens, computed, tables, bs)
    expect = [tables[r][p // bs] * bs + p % bs for r in range(n) for p in range(computed[r], computed[r] + qlens[r])]
    assert md.slot_mapping.tolist() == expect
    assert md.query_start_loc.tolist() == [0] + list(torch.tensor(qlens).cumsum(0).tolist())
    assert md.seq_lens.tolist() == [q + c for q, c in zip(qlens, computed)]
    assert md.num_actual_tokens == sum(qlens) and md.max_query_len == max(qlens)
    for r, row in enumerate(tables):
        assert md.block_table_tensor[r, : len(row)].tolist() == row


@pytest.mark.parametrize("qlens", [[1, 1, 1], [2, 0, 1], [0, 3, 0], [1, 2, 0]])
def test_slot_mapping_decode_shortcut(qlens):
    """One token per request takes a shortcut; lengths that merely sum to the request count do not."""
    computed, tables = [3, 5, 9], [[1, 4], [2], [3, 7]]
    md = vattn.build_common_attn_metadata(qlens, computed, tables, 8)
    expect = [tables[r][p // 8] * 8 + p % 8 for r in range(3) for p in range(computed[r], computed[r] + qlens[r])]
    assert md.slot_mapping.tolist() == expect and md.max_query_len == max(qlens)


def test_padding():
    md = vattn.build_common_attn_metadata([1, 1], [3, 7], [[0], [1]], 8, num_tokens_padded=5, num_reqs_padded=4)
    assert md.slot_mapping.tolist() == [3, 15, -1, -1, -1]
    assert md.num_reqs == 4 and md.num_actual_tokens == 2
    assert md.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert md.seq_lens.tolist() == [4, 8, 1, 1]


@pytest.mark.cuda
def test_metadata_on_cuda_is_one_copy_of_aligned_views():
    """On CUDA the device tensors are views of one host-to-device copy, each 16-byte aligned,
    with the values, dtypes and shapes of the CPU build."""
    args = ([3, 1, 0, 5], [0, 9, 4, 17], [[4, 2], [7, 5], [1], [8, 3, 6]], 8)
    cpu = vattn.build_common_attn_metadata(*args, num_tokens_padded=11, num_reqs_padded=6)
    dev = vattn.build_common_attn_metadata(*args, device="cuda", num_tokens_padded=11, num_reqs_padded=6)
    fields = ("query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping")
    for name in fields:
        a, b = getattr(cpu, name), getattr(dev, name)
        assert b.is_cuda and b.dtype == a.dtype and b.shape == a.shape and b.is_contiguous(), name
        assert b.data_ptr() % 16 == 0, name
        assert torch.equal(b.cpu(), a), name
    assert len({getattr(dev, n).untyped_storage().data_ptr() for n in fields}) == 1
    assert torch.equal(dev.query_start_loc_cpu, cpu.query_start_loc_cpu)
    assert torch.equal(dev.seq_lens_cpu, cpu.seq_lens_cpu)


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        (([3], [0], [[]], 4), {}, r"block_tables\[0\]: expected ceil\(seq_len / block_size\) = 1 block ids"),
        (([1, 1], [0], [[0], [1]], 4), {}, "same requests"),
        (([1], [0], [[9]], 4), {"num_blocks": 8}, r"block ids in \[0, num_blocks = 8\)"),
        (([1], [-1], [[0]], 4), {}, "non-negative"),
        (([2], [0], [[0]], 4), {"num_tokens_padded": 1}, "at least"),
    ],
)
def test_metadata_errors(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        vattn.build_common_attn_metadata(*args, **kwargs)


def test_common_metadata_validates_dtypes():
    md = vattn.build_common_attn_metadata([2], [0], [[0]], 4)
    with pytest.raises(ValueError, match="slot_mapping"):
        vattn.CommonAttentionMetadata(**{**md.__dict__, "slot_mapping": md.slot_mapping.float()})
    with pytest.raises(ValueError, match="block_table_tensor"):
        vattn.CommonAttentionMetadata(**{**md.__dict__, "block_table_tensor": md.block_table_tensor.long()})


def test_num_slot_tokens_keeps_cross_attention_slots():
    """Cross-attention writes one slot per encoder token, more than the decoder's query tokens:
    ``num_slot_tokens`` keeps them; by default only the first ``num_actual_tokens`` survive."""
    md = vattn.build_common_attn_metadata([2], [0], [[0, 1]], 4)
    slots = torch.tensor([4, 5, 6, 7, 2, 3], dtype=torch.int64)
    fields = {**md.__dict__, "slot_mapping": slots.clone()}
    assert vattn.CommonAttentionMetadata(**fields).slot_mapping.tolist() == [4, 5, -1, -1, -1, -1]
    cross = vattn.CommonAttentionMetadata(**{**fields, "slot_mapping": slots.clone(), "num_slot_tokens": 5})
    assert cross.slot_mapping.tolist() == [4, 5, 6, 7, 2, -1]
    with pytest.raises(ValueError, match="num_slot_tokens"):
        vattn.CommonAttentionMetadata(**{**fields, "slot_mapping": slots.clone(), "num_slot_tokens": 7})
    from vattn.cudagraph import pad_common_attn_metadata

    with pytest.raises(ValueError, match="cross-attention"):
        pad_common_attn_metadata(cross, 4)


def test_allocate_shapes_layout_and_groups(vattn_config, monkeypatch):
    vattn.Attention(4, 16, 0.25, num_kv_heads=2, prefix="a")
    vattn.Attention(4, 16, 0.25, num_kv_heads=2, prefix="b", per_layer_sliding_window=8)
    kv = vattn.allocate_kv_cache(vattn_config, num_blocks=6, dtype=torch.bfloat16)
    assert tuple(kv.tensors["a"].shape) == TorchSDPABackend.get_kv_cache_shape(6, 16, 2, 16)
    assert kv.tensors["a"].dtype == torch.bfloat16 and not kv.tensors["a"].any()
    assert len(kv.groups) == 2 and kv.tensors["a"].data_ptr() != kv.tensors["b"].data_ptr()
    layers = vattn_config.compilation.static_forward_context
    assert layers["a"].kv_cache[0] is kv.tensors["a"]
    with pytest.raises(ValueError, match="num_blocks"):
        vattn.allocate_kv_cache(vattn_config, num_blocks=0)
    with pytest.raises(ValueError, match="no attention layers"):
        vattn.allocate_kv_cache(vattn.VattnConfig(), num_blocks=4)

"""Backend utilities: decode/prefill split, local-attention virtual batches,
KV-cache layout, per-layer hyperparameters."""

from __future__ import annotations


import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vattn.backends.utils import (
    PerLayerParameters,
    get_per_layer_parameters,
    infer_global_hyperparameters,
    make_local_attention_virtual_batches,
    split_decodes_and_prefills,
)
from vattn.core.layout import get_kv_cache_layout, set_kv_cache_layout
from vattn.core.metadata import CommonAttentionMetadata
from vattn.core.config import VattnConfig, set_current_vattn_config

PROPS = settings(max_examples=150, deadline=None)


def common_md(query_lens: list[int], context_lens: list[int] | None = None) -> CommonAttentionMetadata:
    """CommonAttentionMetadata for the given query lengths (CPU, unpadded)."""
    n = len(query_lens)
    context_lens = context_lens if context_lens is not None else [3] * n
    qsl = torch.tensor([0, *np.cumsum(query_lens).tolist()], dtype=torch.int32)
    seq = torch.tensor([q + c for q, c in zip(query_lens, context_lens)], dtype=torch.int32)
    t = int(sum(query_lens))
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq, seq_lens_cpu=seq.clone(),
        num_computed_tokens_cpu=torch.tensor(context_lens, dtype=torch.int32), num_reqs=n,
        num_actual_tokens=t, max_query_len=max(query_lens, default=0),
        block_table_tensor=torch.zeros(n, 4, dtype=torch.int32),
        slot_mapping=torch.arange(t + 2, dtype=torch.int64),
    )


# ---- split_decodes_and_prefills -------------------------------------------------------


def split_reference(query_lens: list[int], threshold: int) -> tuple[int, int, int, int]:
    """Per request: decodes are the leading run of requests with <= threshold tokens."""
    num_decodes = 0
    for q in query_lens:
        if q > threshold:
            break
        num_decodes += 1
    dec_tokens = sum(query_lens[:num_decodes])
    return num_decodes, len(query_lens) - num_decodes, dec_tokens, sum(query_lens) - dec_tokens


def test_split_examples():
    assert split_decodes_and_prefills(common_md([1, 1, 1])) == (3, 0, 3, 0)
    assert split_decodes_and_prefills(common_md([1, 1, 5, 7])) == (2, 2, 2, 12)
    assert split_decodes_and_prefills(common_md([4, 7])) == (0, 2, 0, 11)
    assert split_decodes_and_prefills(common_md([2, 3, 1, 9]), decode_threshold=3) == (3, 1, 6, 9)
    # A decode after a prefill counts as a prefill (only less efficient, never wrong).
    assert split_decodes_and_prefills(common_md([1, 6, 1])) == (1, 2, 1, 7)
    md = common_md([1, 1, 5])
    assert (md.slot_mapping[md.num_actual_tokens:] == -1).all()


@PROPS
@given(
    query_lens=st.lists(st.integers(1, 40), min_size=1, max_size=24),
    threshold=st.integers(1, 8),
    ordered=st.booleans(),
)
def test_split_matches_reference(query_lens, threshold, ordered):
    if ordered:
        query_lens = sorted(query_lens, key=lambda q: q > threshold)
    got = split_decodes_and_prefills(common_md(query_lens), decode_threshold=threshold)
    assert got == split_reference(query_lens, threshold)


# ---- make_local_attention_virtual_batches -------------------------------------------------


def test_local_attention_worked_example():
    """The example in the seed's comments, exactly."""
    block_table = torch.arange(30, dtype=torch.int32).view(3, 10)
    q_lo, cu_q, k_lo, bt = make_local_attention_virtual_batches(
        4, np.array([0, 4, 14, 19]), np.array([6, 17, 9]), block_table, block_size=2
    )
    assert q_lo.tolist() == [2, 2, 1, 4, 4, 1, 4, 1]
    assert cu_q.tolist() == [0, 2, 4, 5, 9, 13, 14, 18, 19]
    assert k_lo.tolist() == [4, 2, 4, 4, 4, 1, 4, 1]
    assert bt.tolist() == [[0, 1], [2, 3], [12, 13], [14, 15], [16, 17], [18, 19], [22, 23], [24, 25]]
    assert q_lo.dtype == cu_q.dtype == k_lo.dtype == np.int32 and bt.dtype == torch.int32


def local_reference(chunk, q_lens, seq_lens, block_table, block_size):
    """Per request, per new token: group the tokens by chunk; one virtual request per chunk."""
    width = block_table.shape[1]
    q_lo, k_lo, rows = [], [], []
    for r, (q, s) in enumerate(zip(q_lens, seq_lens)):
        positions = range(s - q, s)
        for c in sorted({p // chunk for p in positions}):
            q_lo.append(sum(1 for p in positions if p // chunk == c))
            k_lo.append(min(s, (c + 1) * chunk) - c * chunk)
            first = c * chunk // block_size
            rows.append([int(block_table[r, min(first + j, width - 1)]) for j in range(chunk // block_size)])
    return q_lo, k_lo, rows


@PROPS
@given(
    data=st.data(),
    block_size=st.sampled_from([1, 2, 4]),
    pages=st.integers(1, 4),
    num_reqs=st.integers(1, 6),
)
def test_local_attention_matches_reference(data, block_size, pages, num_reqs):
    chunk = block_size * pages
    q_lens = data.draw(st.lists(st.integers(1, 20), min_size=num_reqs, max_size=num_reqs))
    ctx = data.draw(st.lists(st.integers(0, 20), min_size=num_reqs, max_size=num_reqs))
    seq_lens = [q + c for q, c in zip(q_lens, ctx)]
    width = data.draw(st.integers(1, max(seq_lens) // block_size + 2))  # may be narrower: clipping
    block_table = torch.randint(0, 1000, (num_reqs, width), dtype=torch.int32)
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    q_lo, cu_q, k_lo, bt = make_local_attention_virtual_batches(
        chunk, qsl, np.array(seq_lens), block_table, block_size
    )
    ref_q, ref_k, ref_rows = local_reference(chunk, q_lens, seq_lens, block_table, block_size)
    assert q_lo.tolist() == ref_q
    assert k_lo.tolist() == ref_k
    assert bt.tolist() == ref_rows
    assert cu_q.tolist() == [0, *np.cumsum(ref_q).tolist()]
    assert int(cu_q[-1]) == sum(q_lens)


def test_local_attention_edge_cases():
    bt = torch.arange(8, dtype=torch.int32).view(2, 4)
    # A request with no new tokens keeps one empty virtual request (as in the seed).
    q_lo, cu_q, k_lo, bt_lo = make_local_attention_virtual_batches(
        4, np.array([0, 0, 1]), np.array([8, 5]), bt, block_size=2
    )
    assert q_lo.tolist() == [0, 1] and k_lo.tolist() == [4, 1]
    assert bt_lo.tolist() == [[2, 3], [6, 7]]
    with pytest.raises(ValueError, match=r"attn_chunk_size \(6\) must be a positive multiple of block_size \(4\)"):
        make_local_attention_virtual_batches(6, np.array([0, 1]), np.array([3]), bt, block_size=4)
    with pytest.raises(ValueError, match="seq_lens_np >= query lengths"):
        make_local_attention_virtual_batches(4, np.array([0, 5]), np.array([3]), bt, block_size=2)


# ---- KV-cache layout ------------------------------------------------------------------------


@pytest.fixture
def no_layout_override(monkeypatch):
    monkeypatch.delenv("VATTN_KV_CACHE_LAYOUT", raising=False)
    set_kv_cache_layout(None)
    yield monkeypatch
    set_kv_cache_layout(None)


def test_kv_cache_layout(no_layout_override):
    mp = no_layout_override
    assert get_kv_cache_layout() == "NHD"
    mp.setenv("VATTN_KV_CACHE_LAYOUT", "HND")
    assert get_kv_cache_layout() == "HND"
    mp.setenv("VATTN_KV_CACHE_LAYOUT", "nhd")
    assert get_kv_cache_layout() == "NHD"
    set_kv_cache_layout("HND")  # the override wins over the env var
    assert get_kv_cache_layout() == "HND"
    set_kv_cache_layout(None)
    assert get_kv_cache_layout() == "NHD"
    mp.setenv("VATTN_KV_CACHE_LAYOUT", "NDH")
    with pytest.raises(ValueError, match=r"VATTN_KV_CACHE_LAYOUT must be one of \('NHD', 'HND'\).*got 'NDH'"):
        get_kv_cache_layout()
    with pytest.raises(ValueError, match=r"cache_layout must be one of \('NHD', 'HND'\).*got 'XYZ'"):
        set_kv_cache_layout("XYZ")


# ---- per-layer hyperparameters --------------------------------------------------------------


def build_layers(specs: dict[str, dict]) -> VattnConfig:
    import vattn

    cfg = VattnConfig()
    with set_current_vattn_config(cfg):
        for name, kw in specs.items():
            vattn.Attention(4, 16, kw.pop("scale", 0.25), num_kv_heads=2, prefix=name, **kw)
    return cfg


def test_per_layer_parameters_and_global_inference():
    cfg = build_layers({
        "l0": {}, "l1": {"per_layer_sliding_window": 8}, "l2": {"logits_soft_cap": 30.0, "scale": 0.5},
    })
    impl_cls = type(cfg.compilation.static_forward_context["l0"].impl)
    params = get_per_layer_parameters(cfg, impl_cls)
    assert params == {
        "l0": PerLayerParameters(-1, None, 0.25),
        "l1": PerLayerParameters(7, None, 0.25),
        "l2": PerLayerParameters(-1, 30.0, 0.5),
    }
    subset = get_per_layer_parameters(cfg, impl_cls, layer_names=["l0"])
    assert infer_global_hyperparameters(subset) == PerLayerParameters(-1, None, 0.25)
    with pytest.raises(ValueError) as ei:
        infer_global_hyperparameters(params)
    msg = str(ei.value)
    assert "window_left: -1 in ['l0', 'l2']; 7 in ['l1']" in msg
    assert "logits_soft_cap: None in ['l0', 'l1']; 30.0 in ['l2']" in msg
    assert "sm_scale: 0.25 in ['l0', 'l1']; 0.5 in ['l2']" in msg
    with pytest.raises(KeyError, match="nope"):
        get_per_layer_parameters(cfg, impl_cls, layer_names=["nope"])


def test_per_layer_parameters_errors():
    cfg = build_layers({"a": {}})

    class OtherImpl:
        pass

    with pytest.raises(TypeError, match=r"layer 'a' uses \w+, expected OtherImpl"):
        get_per_layer_parameters(cfg, OtherImpl)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no attention layers found"):
        infer_global_hyperparameters({})
    assert get_per_layer_parameters(VattnConfig(), OtherImpl) == {}  # type: ignore[arg-type]

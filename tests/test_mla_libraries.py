"""FLASHINFER_MLA and FLASH_ATTN_MLA on CPU against torch stand-ins of the libraries' documented
APIs: ``flashinfer.mla.BatchMLAPagedAttentionWrapper`` (plan / run over ``ckv_cache`` and
``kpe_cache``, CUDA-graph buffers given at construction), ``flashinfer.BatchPrefillWithRaggedKVCacheWrapper``
(``head_dim_qk`` / ``head_dim_vo``, a base-2 log-sum-exp) and FA3's ``flash_attn_with_kvcache``
(``qv``) / ``flash_attn_varlen_func`` (natural log-sum-exp, +inf for a row without keys).

They check what vattn controls: the builders' plans (CSR page layouts, row ranges, persistent
buffers), the impls' calls and the conversions around them, against the float32 reference.
The libraries themselves run in ``tests/test_mla.py``'s GPU tests.
"""

from __future__ import annotations

import math
import sys
import types
from typing import Any

import pytest
import torch

import vattn.backends.flashinfer.paging as fi_paging
from mla_harness import MLASpec, assert_close, check_latent_cache, dummy_decode_common, make_mla_batch
from vattn.backends.mla import flashattn_mla
from vattn.backends.mla.flashattn_mla import FlashAttnMLAImpl, MLAFlashAttnInterface
from vattn.backends.mla.flashinfer_mla import FlashInferMLAImpl, FlashInferMLAMetadataBuilder
from vattn.backends.mla.common import MLACommonMetadataBuilder
from vattn.core.config import CompilationConfig, VattnConfig

SIZES = dict(num_heads=3, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
MIXED = dict(context_lens=(0, 37, 100, 5, 40, 0), query_lens=(1, 1, 1, 9, 23, 11))


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
            causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q (Lq, H, Dk), keys (Lk, H, Dk), values (Lk, H, Dv) -> out (Lq, H, Dv), natural lse (Lq, H)."""
    s = torch.einsum("qhd,khd->hqk", q.float(), keys.float()) * scale
    lq, lk = q.shape[0], keys.shape[0]
    if causal:
        s = s.masked_fill(torch.arange(lk)[None, :] > (torch.arange(lq) + lk - lq)[:, None], float("-inf"))
    lse = s.logsumexp(-1)
    p = torch.where(lse[..., None] == float("-inf"), 0.0, (s - lse[..., None]).exp())
    return torch.einsum("hqk,khd->qhd", p, values.float()), lse.transpose(0, 1)


class _FakeMLAWrapper:
    """``BatchMLAPagedAttentionWrapper``: with ``use_cuda_graph`` its plan copies into the given buffers."""

    def __init__(self, float_workspace_buffer: torch.Tensor, use_cuda_graph: bool = False,
                 qo_indptr: torch.Tensor | None = None, kv_indptr: torch.Tensor | None = None,
                 kv_indices: torch.Tensor | None = None, kv_len_arr: torch.Tensor | None = None,
                 backend: str = "auto") -> None:
        self.graph = use_cuda_graph
        self.bufs = (qo_indptr, kv_indptr, kv_indices, kv_len_arr)
        self.plans = 0

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe,  # type: ignore[no-untyped-def]
             page_size, causal, sm_scale, q_data_type, kv_data_type, use_profiler=False):
        assert int(kv_indptr[-1]) <= kv_indices.numel()
        if self.graph:
            qo, kvp, idx, kvl = self.bufs
            assert qo.numel() == qo_indptr.numel() and kvl.numel() == kv_len_arr.numel(), "graph batch size is fixed"
            qo.copy_(qo_indptr), kvp.copy_(kv_indptr), idx[: kv_indices.numel()].copy_(kv_indices), kvl.copy_(kv_len_arr)
            self.qo, self.kvp, self.idx, self.kvl = qo, kvp, idx, kvl
        else:
            self.qo, self.kvp, self.idx, self.kvl = (t.clone() for t in (qo_indptr, kv_indptr, kv_indices, kv_len_arr))
        self.kw = dict(num_heads=num_heads, ckv=head_dim_ckv, kpe=head_dim_kpe, page_size=page_size, causal=causal,
                       sm_scale=sm_scale, dtypes=(q_data_type, kv_data_type))
        self.plans += 1

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False):  # type: ignore[no-untyped-def]
        kw = self.kw
        assert ckv_cache.shape[1:] == (kw["page_size"], kw["ckv"]) and kpe_cache.shape[1:] == (kw["page_size"], kw["kpe"])
        # FlashInfer's kernel takes the queries' token and head strides; the last dim must be dense
        assert q_nope.shape[1:] == (kw["num_heads"], kw["ckv"]) and q_nope.stride(-1) == 1 and q_pe.stride(-1) == 1
        qo, kvp, idx, kvl = (t.cpu().long() for t in (self.qo, self.kvp, self.idx, self.kvl))
        assert out is not None and out.shape == q_nope.shape and int(qo[-1]) <= q_nope.shape[0]
        for r in range(qo.numel() - 1):
            pages = idx[kvp[r] : kvp[r + 1]]
            c = ckv_cache[pages].reshape(-1, kw["ckv"])[: kvl[r]]
            kp = kpe_cache[pages].reshape(-1, kw["kpe"])[: kvl[r]]
            rows = slice(int(qo[r]), int(qo[r + 1]))
            keys = torch.cat([c, kp], -1)[:, None].expand(-1, kw["num_heads"], -1)
            o, _ = _attend(torch.cat([q_nope[rows], q_pe[rows]], -1), keys, c[:, None].expand(-1, kw["num_heads"], -1),
                           kw["sm_scale"], kw["causal"])
            out[rows] = o.to(out.dtype)
        return out


class _FakeRagged:
    """``BatchPrefillWithRaggedKVCacheWrapper``: ``run(..., return_lse=True)`` gives a base-2 lse."""

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", **kw: Any) -> None:
        assert kv_layout == "NHD"

    def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo=None,  # type: ignore[no-untyped-def]
             custom_mask=None, packed_custom_mask=None, causal=False, sm_scale=None, q_data_type="float16",
             kv_data_type=None, **kw):
        self.qo, self.kv = qo_indptr.cpu().long(), kv_indptr.cpu().long()
        self.dims = (num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo or head_dim_qk)
        self.causal, self.sm_scale = causal, sm_scale

    def run(self, q, k, v, out=None, lse=None, return_lse=False):  # type: ignore[no-untyped-def]
        hq, hk, dqk, dvo = self.dims
        assert q.shape[1:] == (hq, dqk) and k.shape[1:] == (hk, dqk) and v.shape[1:] == (hk, dvo)
        out = torch.zeros(q.shape[0], hq, dvo, dtype=q.dtype)
        lse = torch.full((q.shape[0], hq), float("-inf"))
        for r in range(self.qo.numel() - 1):
            rows, keys = slice(int(self.qo[r]), int(self.qo[r + 1])), slice(int(self.kv[r]), int(self.kv[r + 1]))
            o, l2 = _attend(q[rows], k[keys], v[keys], self.sm_scale, self.causal)
            out[rows], lse[rows] = o.to(q.dtype), l2 / math.log(2.0)
        return (out, lse) if return_lse else out


@pytest.fixture
def fake_flashinfer(monkeypatch: pytest.MonkeyPatch) -> None:
    mod, mla = types.ModuleType("flashinfer"), types.ModuleType("flashinfer.mla")
    mod.BatchPrefillWithRaggedKVCacheWrapper = _FakeRagged  # type: ignore[attr-defined]
    mla.BatchMLAPagedAttentionWrapper = _FakeMLAWrapper  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashinfer", mod)
    monkeypatch.setitem(sys.modules, "flashinfer.mla", mla)
    monkeypatch.setattr(fi_paging, "WORKSPACE_BYTES", 1024)
    monkeypatch.setattr(fi_paging, "_workspaces", {})


def _setup(impl_cls: type, builder_cls: type, spec: MLASpec, batch: Any, cfg: VattnConfig | None = None,
           chunk: int = 16) -> tuple[Any, MLACommonMetadataBuilder]:
    """The impl, registered (as the layer a builder reads) in ``cfg``, and its group's builder."""
    impl = impl_cls(spec.num_heads, spec.head_size, spec.scale, 1, **spec.impl_kwargs(batch.kv_b_proj))
    cfg = cfg or VattnConfig()
    cfg.compilation.static_forward_context["s.mla"] = types.SimpleNamespace(impl=impl, dtype=spec.dtype,
                                                                              kv_cache=[batch.kv_cache])
    builder = builder_cls(spec.kv_spec(), ["s.mla"], cfg, torch.device("cpu"))
    builder.prefill_chunk_tokens = chunk
    return impl, builder


def _run(impl_cls: type, builder_cls: type, spec: MLASpec, seed: int, factor: float = 2.0) -> Any:
    batch = make_mla_batch(spec, seed=seed)
    impl, builder = _setup(impl_cls, builder_cls, spec, batch)
    md = builder.build(0, batch.common)
    out = torch.zeros(batch.q.shape[0], spec.num_heads, spec.v_head_dim, dtype=spec.dtype)
    before = batch.kv_cache.clone()
    impl.forward(batch.layer, batch.q, batch.kv_c, batch.k_pe, batch.kv_cache, md, output=out)
    n = batch.num_actual_tokens
    assert_close(out[:n], batch.reference(), spec.dtype, factor=factor)
    check_latent_cache(batch, before)
    return md


@pytest.mark.parametrize("case", [MIXED, dict(context_lens=(3, 50), query_lens=(1, 1), num_pad_tokens=2),
                                  dict(context_lens=(0, 20), query_lens=(7, 30), block_size=4)],
                         ids=["mixed", "decode", "prefill-block4"])
def test_flashinfer_mla_with_a_torch_stand_in(fake_flashinfer: None, case: dict) -> None:
    spec = MLASpec(**{**SIZES, **case}, dtype=torch.bfloat16)
    md = _run(FlashInferMLAImpl, FlashInferMLAMetadataBuilder, spec, seed=1)
    if md.prefill is not None:
        assert len({id(c.plan) for c in md.prefill.chunks} | {id(md.prefill.plan)}) == len(md.prefill.chunks) + 1


def test_flashinfer_mla_graph_wrappers_replan_persistent_buffers(fake_flashinfer: None) -> None:
    """CPU: one CUDA-graph wrapper per batch size over shared buffers; padded requests read block 0."""
    from vattn.metadata import build_common_attn_metadata

    spec = MLASpec(context_lens=(9, 30, 2), query_lens=(1, 1, 1), **SIZES, dtype=torch.bfloat16)
    cfg = VattnConfig(compilation=CompilationConfig(cudagraph_capture_sizes=(4, 8)))
    impl, builder = _setup(FlashInferMLAImpl, FlashInferMLAMetadataBuilder, spec, make_mla_batch(spec), cfg)
    builder.use_persistent_buffers = True
    md0 = builder.build_for_cudagraph_capture(dummy_decode_common(8, 8))
    wrapper = md0.decode.plan
    assert wrapper.graph and wrapper.bufs[0].numel() == 9
    for seed in (2, 3):
        batch = make_mla_batch(spec, seed=seed)
        common = build_common_attn_metadata([1] * 3, list(spec.context_lens), batch.block_tables, 16,
                                            num_tokens_padded=8, num_reqs_padded=8, max_blocks_per_req=8)
        md = builder.build(0, common)
        assert md.decode.plan is wrapper and md.decode.cuda_graph and md.decode.num_decodes == 8
        assert wrapper.kvl.tolist() == [10, 31, 3] + [1] * 5  # padding requests: one token on block 0
        impl.kv_b_proj = batch.kv_b_proj
        q = torch.nn.functional.pad(batch.q, (0, 0, 0, 0, 0, 5))
        kv_c, k_pe = (torch.nn.functional.pad(t, (0, 0, 0, 5)) for t in (batch.kv_c, batch.k_pe))
        out = torch.zeros(8, spec.num_heads, spec.v_head_dim, dtype=spec.dtype)
        impl.forward(batch.layer, q, kv_c, k_pe, batch.kv_cache, md, output=out)
        assert_close(out[:3], batch.reference(), spec.dtype, factor=2.0)
    assert wrapper.plans == 3


def test_flashinfer_mla_refuses_other_latent_sizes(fake_flashinfer: None) -> None:
    spec = MLASpec(context_lens=(), query_lens=())
    batch = make_mla_batch(spec.with_(context_lens=(1,), query_lens=(1,)))
    with pytest.raises(ValueError, match="expected 512 / 64"):
        FlashInferMLAImpl(spec.num_heads, spec.head_size, spec.scale, 1, **spec.impl_kwargs(batch.kv_b_proj))


def test_selector_asks_mla_backends_about_the_layer_sizes() -> None:
    """Selection (forced here; automatic selection asks the same) sees an MLA layer's sizes, not
    only its 576-wide latent: FLASHINFER_MLA is refused for prefill head sizes its kernels lack."""
    import vattn
    from vattn.backends.mla.flashinfer_mla import FlashInferMLABackend

    assert FlashInferMLABackend.mla_dims_reasons(512, 64, 128, 128) == []
    with vattn.global_force_attn_backend_context_manager("FLASHINFER_MLA"):
        with pytest.raises(ValueError, match=r"got \(80, 16\)"):
            vattn.get_attn_backend(576, torch.bfloat16, None, 16, use_mla=True, mla_dims=(512, 64, 16, 16))


def test_flashinfer_mla_refuses_prefill_head_sizes_it_cannot_serve(fake_flashinfer: None) -> None:
    spec = MLASpec(context_lens=(1,), query_lens=(1,), **{**SIZES, "qk_nope_head_dim": 16, "v_head_dim": 16})
    batch = make_mla_batch(spec)
    with pytest.raises(ValueError, match=r"got \(80, 16\); use TRITON_MLA"):
        FlashInferMLAImpl(spec.num_heads, spec.head_size, spec.scale, 1, **spec.impl_kwargs(batch.kv_b_proj))


# ---- FLASH_ATTN_MLA ------------------------------------------------------------------------------


def _fa_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,  # type: ignore[no-untyped-def]
                     cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                     cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                     q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False, **kw):
    """FA3's paged decode with ``qv``: scores ``q . k + qv . v`` over the pages of ``page_table``."""
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and k is None and qv is not None
    assert k_cache.dim() == 4 and k_cache.shape[2] == 1 and v_cache.shape[:3] == k_cache.shape[:3]
    bs = k_cache.shape[1]
    cu, seq = cu_seqlens_q.cpu().long(), cache_seqlens.cpu().long()
    out = torch.zeros(q.shape[0], q.shape[1], v_cache.shape[-1], dtype=q.dtype)
    for r in range(seq.numel()):
        n = int(seq[r])
        pages = page_table[r, : -(-n // bs)].long()
        kk = k_cache[pages].reshape(-1, k_cache.shape[-1])[:n]
        vv = v_cache[pages].reshape(-1, v_cache.shape[-1])[:n]
        rows = slice(int(cu[r]), int(cu[r + 1]))
        h = q.shape[1]
        o, _ = _attend(torch.cat([q[rows], qv[rows]], -1), torch.cat([kk, vv], -1)[:, None].expand(-1, h, -1),
                       vv[:, None].expand(-1, h, -1), softmax_scale, causal)
        out[rows] = o.to(q.dtype)
    return out


def _fa_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None, seqused_k=None,  # type: ignore[no-untyped-def]
               softmax_scale=None, causal=False, return_attn_probs=False, **kw):
    """FA3's varlen: (out, lse (H, T)); a row without keys gets lse +inf (as FlashAttention writes it)."""
    cq, ck = cu_seqlens_q.cpu().long(), cu_seqlens_k.cpu().long()
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype)
    lse = torch.full((q.shape[1], q.shape[0]), float("inf"))
    for r in range(cq.numel() - 1):
        rows, keys = slice(int(cq[r]), int(cq[r + 1])), slice(int(ck[r]), int(ck[r + 1]))
        if keys.stop > keys.start:
            o, l_ = _attend(q[rows], k[keys], v[keys], softmax_scale, causal)
            out[rows], lse[:, rows] = o.to(q.dtype), l_.transpose(0, 1)
    return (out, lse) if return_attn_probs else out


@pytest.mark.parametrize("pad_v", [False, True], ids=["fa3", "fa2-padded-v"])
def test_flash_attn_mla_with_a_torch_stand_in(monkeypatch: pytest.MonkeyPatch, pad_v: bool) -> None:
    iface = MLAFlashAttnInterface("fa2" if pad_v else "fa3", _fa_with_kvcache, _fa_varlen, pad_v=pad_v)
    monkeypatch.setattr(flashattn_mla, "get_mla_interface", lambda: (iface, ""))
    spec = MLASpec(**{**SIZES, **MIXED}, dtype=torch.bfloat16, num_pad_tokens=2)
    _run(FlashAttnMLAImpl, MLACommonMetadataBuilder, spec, seed=4)


def test_flash_attn_mla_reasons_without_fa3(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill-only interface (FA2): the backend refuses, naming FA3's qv."""
    monkeypatch.setattr(flashattn_mla, "get_mla_interface",
                        lambda: (MLAFlashAttnInterface("fa2", None, _fa_varlen, pad_v=True),
                                 "FLASH_ATTN_MLA cannot run here: fa2 serves the up-projected prefill but not the "
                                 "absorbed decode: that needs FA3's flash_attn_with_kvcache with qv"))
    ok, why = flashattn_mla.FlashAttnMLABackend.is_available()
    assert not ok and "qv" in why and "prefill" in why


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_flash_attn_mla_and_flashinfer_mla_need_a_gpu() -> None:
    from vattn.backends.mla.flashinfer_mla import FlashInferMLABackend

    for cls in (flashattn_mla.FlashAttnMLABackend, FlashInferMLABackend):
        ok, why = cls.is_available()
        assert not ok and why == f"{cls.get_name()} needs a CUDA GPU and none is visible" or "CUDA GPU" in why

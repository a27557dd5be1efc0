"""Correctness harness of the MLA backends: random paged latent batches and a float32
reference of *unabsorbed* MLA (the textbook form), written independently of the kernels.

Typical use::

    spec = MLASpec(context_lens=(5, 0, 17), query_lens=(1, 9, 4))
    batch = make_mla_batch(spec, seed=0)
    impl.forward(batch.layer, batch.q, batch.kv_c, batch.k_pe, batch.kv_cache, metadata, output=out)
    assert_close(out[: batch.num_actual_tokens], batch.reference(), spec.dtype)
    check_latent_cache(batch, before)

Conventions: the latent cache is ``(num_blocks, block_size, L + P)``, row = ``cat(kv_c, k_pe)``;
``slot = block * block_size + offset``; fp8 caches store ``x / scale`` and read ``stored *
scale``. A decode's own new token is read back from the cache (it attends after the store); a
prefill's new tokens are used as given (vLLM's semantics), its cached context from the cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from attn_harness import (FakeLayer, assert_close, cache_torch_dtype, kv_round_trip, nonzero_randn,
                          shuffled_block_tables, slots_of)
from vattn.core.metadata import CommonAttentionMetadata
from vattn.core.metadata import MLAAttentionSpec
from vattn.metadata import build_common_attn_metadata

__all__ = ["MLABatch", "MLASpec", "assert_close", "check_latent_cache", "dummy_decode_common", "make_mla_batch",
           "mla_reference"]


@dataclass(frozen=True)
class MLASpec:
    """One random MLA step. Requests in the given order (decodes first)."""

    context_lens: tuple[int, ...]
    query_lens: tuple[int, ...]
    num_heads: int = 4
    kv_lora_rank: int = 32
    qk_rope_head_dim: int = 16
    qk_nope_head_dim: int = 16
    v_head_dim: int = 16
    block_size: int = 16
    dtype: torch.dtype = torch.float32
    kv_cache_dtype: str = "auto"
    kv_scale: float = 1.0
    num_pad_tokens: int = 0
    extra_blocks: int = 3
    device: str = "cpu"

    @property
    def head_size(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def scale(self) -> float:
        return self.qk_head_dim ** -0.5

    def with_(self, **kwargs: Any) -> "MLASpec":
        return replace(self, **kwargs)

    def kv_spec(self, dtype: torch.dtype | None = None) -> MLAAttentionSpec:
        stored = cache_torch_dtype(self.kv_cache_dtype, self.dtype) if dtype is None else dtype
        return MLAAttentionSpec(self.block_size, 1, self.head_size, stored, self.kv_cache_dtype,
                                kv_lora_rank=self.kv_lora_rank, qk_rope_head_dim=self.qk_rope_head_dim)

    def impl_kwargs(self, kv_b_proj: nn.Module) -> dict[str, Any]:
        return dict(q_lora_rank=None, kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
                    qk_rope_head_dim=self.qk_rope_head_dim, qk_head_dim=self.qk_head_dim,
                    v_head_dim=self.v_head_dim, kv_b_proj=kv_b_proj)


@dataclass
class MLABatch:
    """A random step: inputs, the latent cache, metadata, the latents each request attends to.

    | field | shape |
    | --- | --- |
    | q | (T + pad, H, N + P) |
    | kv_c, k_pe | (T + pad, L), (T + pad, P) |
    | kv_cache | (num_blocks, block_size, L + P) |
    | kv_b_proj | nn.Linear(L, H * (N + V), bias=False) in the model dtype |
    | latents[r] | (seq_len_r, L + P) float32: what request r attends to |
    """

    spec: MLASpec
    q: torch.Tensor
    kv_c: torch.Tensor
    k_pe: torch.Tensor
    kv_cache: torch.Tensor
    kv_b_proj: nn.Linear
    common: CommonAttentionMetadata
    block_tables: list[list[int]]
    latents: list[torch.Tensor]
    layer: FakeLayer = field(repr=False)

    @property
    def num_actual_tokens(self) -> int:
        return self.common.num_actual_tokens

    def reference(self) -> torch.Tensor:
        return mla_reference(self.q[: self.num_actual_tokens], self.latents, list(self.spec.query_lens),
                             self.kv_b_proj.weight, self.spec)


def mla_reference(q: torch.Tensor, latents: list[torch.Tensor], query_lens: list[int], w_kv_b: torch.Tensor,
                  spec: MLASpec) -> torch.Tensor:
    """Unabsorbed MLA in float32: per request, keys ``cat(C W_K^T, k_pe)`` and values ``C W_V^T``
    per head from its latents ``C``, causal with the queries at the sequence's end. (T, H, V)."""
    h, n, p, v, lora = spec.num_heads, spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim, spec.kv_lora_rank
    w = w_kv_b.detach().float().cpu().view(h, n + v, lora)
    w_k, w_v = w[:, :n], w[:, n:]
    outs, start = [], 0
    for lat, ql in zip(latents, query_lens):
        lat = lat.float().cpu()
        c, kpe = lat[:, :lora], lat[:, lora:]
        s_len = lat.shape[0]
        keys = torch.cat([torch.einsum("sl,hnl->hsn", c, w_k), kpe[None].expand(h, s_len, p)], dim=-1)
        vals = torch.einsum("sl,hvl->hsv", c, w_v)
        qr = q[start : start + ql].float().cpu().transpose(0, 1)  # (H, ql, N + P)
        scores = qr @ keys.transpose(1, 2) * spec.scale  # (H, ql, S)
        pos = torch.arange(s_len - ql, s_len)[:, None]
        scores = scores.masked_fill(torch.arange(s_len)[None, :] > pos, float("-inf"))
        outs.append((scores.softmax(-1) @ vals).transpose(0, 1))
        start += ql
    return torch.cat(outs) if outs else torch.zeros(0, h, v)


def make_mla_batch(spec: MLASpec, seed: int = 0, kv_b_proj: nn.Linear | None = None) -> MLABatch:
    """Random inputs, a random latent cache over shuffled blocks, ``kv_b_proj`` and metadata."""
    gen = torch.Generator().manual_seed(seed)
    bs, lora, rope = spec.block_size, spec.kv_lora_rank, spec.qk_rope_head_dim
    seq = [c + q for c, q in zip(spec.context_lens, spec.query_lens)]
    need = [max(1, math.ceil(s / bs)) for s in seq]
    tables, num_blocks = shuffled_block_tables(need, spec.extra_blocks, gen)
    cd = cache_torch_dtype(spec.kv_cache_dtype, spec.dtype)
    raw = nonzero_randn((num_blocks, bs, lora + rope), gen)
    if cd in (torch.float8_e4m3fn, torch.float8_e5m2):
        kv_cache = (raw / spec.kv_scale).clamp(torch.finfo(cd).min, torch.finfo(cd).max).to(cd)
    else:
        kv_cache = raw.to(cd)
    kv_cache = kv_cache.to(spec.device)
    t, pad = sum(spec.query_lens), spec.num_pad_tokens

    def rnd(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (std * torch.randn(shape, generator=gen)).to(spec.dtype).to(spec.device)

    q = rnd(t + pad, spec.num_heads, spec.qk_head_dim)
    kv_c, k_pe = rnd(t + pad, lora), rnd(t + pad, rope)
    if kv_b_proj is None:
        kv_b_proj = nn.Linear(lora, spec.num_heads * (spec.qk_nope_head_dim + spec.v_head_dim), bias=False)
        with torch.no_grad():
            kv_b_proj.weight.copy_(torch.randn(kv_b_proj.weight.shape, generator=gen) * lora ** -0.5)
        kv_b_proj = kv_b_proj.to(device=spec.device, dtype=spec.dtype)
    latents, tok = [], 0
    leading = next((i for i, ql in enumerate(spec.query_lens) if ql != 1), len(spec.query_lens))
    for r, (ctx, ql) in enumerate(zip(spec.context_lens, spec.query_lens)):
        old = torch.tensor(slots_of(tables[r], range(ctx), bs), dtype=torch.long)
        cached = kv_cache.cpu()[old // bs, old % bs].float()
        if cd in (torch.float8_e4m3fn, torch.float8_e5m2):
            cached = cached * spec.kv_scale
        new = torch.cat([kv_c[tok : tok + ql], k_pe[tok : tok + ql]], dim=-1).cpu()
        # The decodes (the leading run of 1-token requests) read their new row back from the cache.
        new = kv_round_trip(new, spec.kv_cache_dtype, spec.kv_scale) if r < leading else new.float()
        latents.append(torch.cat([cached, new]))
        tok += ql
    common = build_common_attn_metadata(list(spec.query_lens), list(spec.context_lens), tables, bs,
                                        device=spec.device, num_tokens_padded=t + pad)
    layer = FakeLayer(k_scale=spec.kv_scale, v_scale=1.0, device=spec.device, layer_name="fake.mla")
    return MLABatch(spec, q, kv_c, k_pe, kv_cache, kv_b_proj, common, tables, latents, layer)


def check_latent_cache(batch: MLABatch, before: torch.Tensor, cache: torch.Tensor | None = None) -> None:
    """Written slots hold ``cat(kv_c, k_pe)`` as the cache stores it (bit-exact); every other
    slot is bit-identical to ``before``."""
    cache = batch.kv_cache if cache is None else cache
    spec = batch.spec
    slots = batch.common.slot_mapping.cpu()
    written = slots[slots >= 0]
    now, was = cache.cpu().view(-1, spec.head_size), before.cpu().view(-1, spec.head_size)
    keep = torch.ones(now.shape[0], dtype=torch.bool)
    keep[written] = False
    assert torch.equal(now[keep].view(torch.uint8), was[keep].view(torch.uint8)), "a slot outside slot_mapping changed"
    n = written.shape[0]
    rows = torch.cat([batch.kv_c[:n], batch.k_pe[:n]], dim=-1).cpu()
    if cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        fi = torch.finfo(cache.dtype)
        want = (rows.float() / spec.kv_scale).clamp(fi.min, fi.max).to(cache.dtype)
    else:
        want = rows.to(cache.dtype)
    got = now[written]
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), "written latent rows differ"


def dummy_decode_common(n: int, width: int, device: str | torch.device = "cpu") -> CommonAttentionMetadata:
    """What ``vattn.CUDAGraphRunner`` captures with: ``n`` one-token decodes on block 0 (sequence
    length 1) that write nothing (slot -1), block tables ``width`` wide."""
    qsl, seq = torch.arange(n + 1, dtype=torch.int32), torch.ones(n, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl, seq_lens=seq.to(device), seq_lens_cpu=seq,
        num_computed_tokens_cpu=torch.zeros(n, dtype=torch.int32), num_reqs=n, num_actual_tokens=n, max_query_len=1,
        block_table_tensor=torch.zeros((n, width), dtype=torch.int32, device=device),
        slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=device), max_seq_len=1)


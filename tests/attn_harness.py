"""Shared correctness harness for every attention backend's tests.

Backend-independent: it builds random paged batches directly with torch and computes a
dense float32 reference per request, so TORCH_SDPA, Triton, FlashInfer and FlashAttention
tests all compare against the same thing.

Typical use::

    spec = BatchSpec(context_lens=(5, 0, 17), query_lens=(1, 9, 4), num_heads=8, num_kv_heads=2)
    batch = make_random_batch(spec, seed=0)
    before = batch.kv_cache.clone()
    impl.forward(layer, batch.query, batch.key, batch.value, batch.kv_cache, metadata, output=out)
    ref = batch.reference(scale=impl.scale)            # (num_actual_tokens, H, D) float32
    assert_close(out[: batch.num_actual_tokens], ref, spec.dtype)
    check_cache_untouched(before, batch.kv_cache, batch.common.slot_mapping)

With hypothesis: ``@given(spec=batch_specs())``.

Through the real layer and op, any backend (``check_layer_step``, ``check_graph_replays``)::

    check_layer_step("TRITON_ATTN", make_random_batch(spec), sliding_window=8)

Conventions (the contracts in notes/COMMON.md): the KV cache has logical shape
``(2, num_blocks, block_size, Hk, D)``, physical layout NHD or HND; ``slot = block *
block_size + offset``; slots < 0 are padding; query head ``h`` reads KV head
``h // (H // Hk)``; fp8 caches store ``x / scale`` (saturating) and read ``stored * scale``.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Sequence

import torch

from vattn.core.metadata import CommonAttentionMetadata

__all__ = [
    "BatchSpec",
    "DECODES",
    "FakeLayer",
    "LayerStep",
    "MIXED",
    "PAGED_ORDERS",
    "PREFILLS",
    "RandomBatch",
    "STAND_IN_STEPS",
    "STEPS",
    "TOLERANCES",
    "assert_close",
    "assert_no_host_sync",
    "attention_layer",
    "batch_specs",
    "cache_torch_dtype",
    "check_cache_untouched",
    "check_cache_written",
    "check_graph_replays",
    "check_layer_step",
    "harness_view",
    "kv_round_trip",
    "layer_features",
    "make_random_batch",
    "nonzero_randn",
    "padded_step",
    "reference_attention",
    "run_layer_step",
    "shuffled_block_tables",
    "skip_unless_served",
    "slots_of",
    "stride_orders",
    "tree_allowed",
]

DECODER, ENCODER, ENCODER_ONLY, ENCODER_DECODER = "decoder", "encoder", "encoder_only", "encoder_decoder"

_CACHE_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}

#: (atol, rtol) of a backend's output vs the float32 reference, by model dtype.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


#: Step shapes (``BatchSpec`` context_lens / query_lens): decodes first, then chunked prefills
#: with and without context; odd lengths, partial last blocks.
MIXED: dict[str, tuple[int, ...]] = dict(context_lens=(0, 37, 100, 5, 64, 0), query_lens=(1, 1, 1, 1, 23, 40))
DECODES: dict[str, tuple[int, ...]] = dict(context_lens=(15, 16, 17, 300, 1), query_lens=(1, 1, 1, 1, 1))
PREFILLS: dict[str, tuple[int, ...]] = dict(context_lens=(0, 0, 33), query_lens=(70, 5, 17))
#: Named variants of those steps, as ``BatchSpec`` keywords (the test gives the rest of the geometry).
STEPS: dict[str, dict[str, Any]] = {
    "mixed": dict(MIXED),
    "decode-padded": dict(**DECODES, num_pad_tokens=3),
    "prefill": dict(PREFILLS),
    "mixed-HND": dict(**MIXED, layout="HND"),
    "mixed-block1": dict(**MIXED, block_size=1),
    "mixed-block64-gqa4": dict(**MIXED, block_size=64, num_heads=32, num_kv_heads=8),
    "mixed-mha": dict(**MIXED, num_heads=8, num_kv_heads=8),
    "mixed-d64": dict(**MIXED, head_size=64),
    "mixed-d256": dict(**MIXED, head_size=256),
    "mixed-fp16": dict(**MIXED, dtype=torch.float16),
    "mixed-fp8": dict(**MIXED, kv_cache_dtype="fp8", k_scale=0.05, v_scale=0.03),
}
#: The steps that torch stand-ins of kernel libraries run on the CPU (test_flash_attn, test_flashinfer).
STAND_IN_STEPS = ("mixed", "decode-padded", "prefill", "mixed-HND", "mixed-block1", "mixed-fp8")


def layer_features(num_heads: int, device: str | torch.device = "cpu") -> dict[str, dict[str, Any]]:
    """The layer features by name, as ``reference_attention`` (and ``check_layer_step``) take
    them, for a layer of ``num_heads`` heads: each alone, window and ALiBi, and all together."""
    h = num_heads
    return {
        "window": dict(sliding_window=8),
        "window1": dict(sliding_window=1),
        "softcap": dict(logits_soft_cap=2.0),
        "alibi": dict(alibi_slopes=[2.0 ** -(i + 1) for i in range(h)]),
        "sinks": dict(sinks=torch.linspace(-2.0, 3.0, h, device=device)),
        "all": dict(sliding_window=5, logits_soft_cap=3.0, alibi_slopes=[0.1 * (i + 1) for i in range(h)],
                    sinks=torch.linspace(-1.0, 1.0, h, device=device)),
        "alibi+window": dict(sliding_window=6, alibi_slopes=[0.05 * (i + 1) for i in range(h)]),
    }


#: The standard cache's stride orders by physical layout: tokens before heads (NHD), heads first (HND).
PAGED_ORDERS = {"NHD": (0, 1, 2, 3, 4), "HND": (0, 1, 3, 2, 4)}


def stride_orders(backend: Any) -> dict[str, tuple[int, ...]]:
    """``backend.get_kv_cache_stride_order()`` under each physical layout (``set_kv_cache_layout``)."""
    from vattn.core.layout import KV_CACHE_LAYOUTS, set_kv_cache_layout

    orders = {}
    try:
        for layout in KV_CACHE_LAYOUTS:
            set_kv_cache_layout(layout)
            orders[layout] = tuple(backend.get_kv_cache_stride_order())
    finally:
        set_kv_cache_layout(None)
    return orders


def cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype stored by a cache of ``kv_cache_dtype`` (``"auto"`` = the model dtype)."""
    return model_dtype if kv_cache_dtype == "auto" else _CACHE_DTYPES[kv_cache_dtype]


def _is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def _to_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """What a KV store writes for ``x``: fp8 = saturating ``x / scale``, else a plain cast."""
    if _is_fp8(cache_dtype):
        fi = torch.finfo(cache_dtype)
        return (x.float() / scale).clamp(fi.min, fi.max).to(cache_dtype)
    return x.to(cache_dtype)


def _from_cache(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What a backend reads back, in float32."""
    return x.float() * scale if _is_fp8(x.dtype) else x.float()


def kv_round_trip(x: torch.Tensor, kv_cache_dtype: str, scale: float = 1.0) -> torch.Tensor:
    """``x`` as a backend sees it after writing it to and reading it from the cache (float32)."""
    cd = cache_torch_dtype(kv_cache_dtype, x.dtype)
    return _from_cache(_to_cache(x, cd, scale), scale)


# ---------------------------------------------------------------------------------------
# The stand-in layer
# ---------------------------------------------------------------------------------------


@dataclass
class FakeLayer:
    """The attributes of ``vattn.Attention`` that an ``AttentionImpl.forward`` reads.

    Scale tensors are 0-dim float32 on ``device``; ``*_float`` are their host copies.
    """

    k_scale: float = 1.0
    v_scale: float = 1.0
    q_scale: float = 1.0
    device: str | torch.device = "cpu"
    layer_name: str = "fake.attn"
    _k_scale: torch.Tensor = field(init=False)
    _v_scale: torch.Tensor = field(init=False)
    _q_scale: torch.Tensor = field(init=False)
    _prob_scale: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        def t(v: float) -> torch.Tensor:
            return torch.tensor(v, dtype=torch.float32, device=self.device)

        self._k_scale, self._v_scale, self._q_scale = t(self.k_scale), t(self.v_scale), t(self.q_scale)
        self._prob_scale = t(1.0)
        self._k_scale_float, self._v_scale_float = float(self.k_scale), float(self.v_scale)
        self._q_scale_float, self._prob_scale_float = float(self.q_scale), 1.0


# ---------------------------------------------------------------------------------------
# Random batches
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchSpec:
    """One random step's shape. Requests are ordered as given (put decodes first).

    Args:
        context_lens: per request, tokens already in the cache before this step.
            For ``encoder_decoder`` these are the encoder lengths (the K/V of the step).
        query_lens: per request, new tokens (decode = 1).
        attn_type: ``decoder`` (paged, causal), ``encoder``/``encoder_only`` (self-attention
            over the given K/V, non-causal, context must be 0) or ``encoder_decoder``
            (decoder queries over the cached encoder K/V, non-causal).
        layout: ``"NHD"`` or ``"HND"`` physical KV-cache layout.
        num_pad_tokens: extra token rows after the real ones, slot -1.
        extra_blocks: pool blocks owned by no request (must stay untouched).
        k_scale, v_scale: fp8 scales (ignored for non-fp8 caches).
    """

    context_lens: tuple[int, ...]
    query_lens: tuple[int, ...]
    num_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 64
    block_size: int = 16
    dtype: torch.dtype = torch.float32
    kv_cache_dtype: str = "auto"
    layout: str = "NHD"
    num_pad_tokens: int = 0
    extra_blocks: int = 3
    attn_type: str = DECODER
    k_scale: float = 1.0
    v_scale: float = 1.0
    device: str = "cpu"

    def __post_init__(self) -> None:
        if len(self.context_lens) != len(self.query_lens):
            raise ValueError("context_lens and query_lens must have one entry per request")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} not a multiple of {self.num_kv_heads}")
        if self.attn_type in (ENCODER, ENCODER_ONLY) and any(self.context_lens):
            raise ValueError("encoder self-attention has no prior context: context_lens must be 0")

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)

    @property
    def seq_lens(self) -> list[int]:
        """Keys each request attends to (cross-attention: the encoder length)."""
        if self.attn_type == ENCODER_DECODER:
            return list(self.context_lens)
        return [c + q for c, q in zip(self.context_lens, self.query_lens)]

    def with_(self, **kwargs: Any) -> "BatchSpec":
        return replace(self, **kwargs)


@dataclass
class RandomBatch:
    """A random step: inputs, cache, metadata and the K/V each request must attend to.

    | field | shape |
    | --- | --- |
    | query | (T + pad, H, D) model dtype |
    | key, value | (T + pad, Hk, D); cross-attention: (sum(encoder lens) + pad, Hk, D) |
    | kv_cache | (2, num_blocks, block_size, Hk, D), physical layout per ``spec.layout`` |
    | full_keys[r], full_values[r] | (seq_len_r, Hk, D) float32, as read back from the cache |
    | block_tables[r] | the request's block ids |
    """

    spec: BatchSpec
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor
    common: CommonAttentionMetadata
    block_tables: list[list[int]]
    full_keys: list[torch.Tensor]
    full_values: list[torch.Tensor]
    layer: FakeLayer

    @property
    def num_actual_tokens(self) -> int:
        return self.common.num_actual_tokens

    def reference(self, scale: float, **features: Any) -> torch.Tensor:
        """``reference_attention`` over this batch; ``features`` as that function takes."""
        causal = self.spec.attn_type == DECODER
        features.setdefault("causal", causal)
        return reference_attention(
            self.query[: self.num_actual_tokens],
            self.full_keys,
            self.full_values,
            list(self.spec.query_lens),
            scale=scale,
            **features,
        )


def _random_cache(spec: BatchSpec, num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    cd = cache_torch_dtype(spec.kv_cache_dtype, spec.dtype)
    logical = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
    order = (0, 1, 2, 3, 4) if spec.layout == "NHD" else (0, 1, 3, 2, 4)
    if spec.layout not in ("NHD", "HND"):
        raise ValueError(f"layout must be 'NHD' or 'HND', got {spec.layout!r}")
    physical = tuple(logical[i] for i in order)
    cache = nonzero_randn(physical, gen).to(cd).to(spec.device)
    inverse = [order.index(i) for i in range(5)]
    return cache.permute(*inverse)


def nonzero_randn(shape: Sequence[int], gen: torch.Generator) -> torch.Tensor:
    """Standard normal float32 values, none near zero (a kernel that reads zeros is caught)."""
    data = torch.randn(tuple(shape), generator=gen)
    return torch.where(data.abs() < 1e-3, torch.full_like(data, 0.5), data)


def shuffled_block_tables(blocks_per_request: Sequence[int], extra_blocks: int,
                          gen: torch.Generator) -> tuple[list[list[int]], int]:
    """(each request's block ids, the pool's size): distinct blocks of a shuffled pool of
    ``sum(blocks_per_request) + extra_blocks``, the extra ones owned by no request."""
    num_blocks = sum(blocks_per_request) + extra_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, start = [], 0
    for n in blocks_per_request:
        tables.append(perm[start : start + n])
        start += n
    return tables, num_blocks


def slots_of(table: Sequence[int], positions: range, block_size: int) -> list[int]:
    """The cache slots of a request's token ``positions`` under its block ``table``."""
    return [table[p // block_size] * block_size + p % block_size for p in positions]


def make_random_batch(spec: BatchSpec, seed: int = 0) -> RandomBatch:
    """Random q/k/v, a random cache, shuffled block tables over a shared pool, and metadata.

    Decoder: each request owns ``ceil((context + query) / block_size)`` blocks; its context
    K/V are the random cache contents at its first ``context`` slots; the new tokens go to
    the next ``query`` slots. Encoder types: ``slot_mapping`` still names fresh slots (an
    encoder backend must not write them). Cross-attention: key/value are the encoder
    tokens and ``slot_mapping`` has one slot per encoder token.
    """
    gen = torch.Generator().manual_seed(seed)
    H, Hk, D, bs = spec.num_heads, spec.num_kv_heads, spec.head_size, spec.block_size
    cross = spec.attn_type == ENCODER_DECODER
    seq_lens = spec.seq_lens
    n_blocks_req = [math.ceil(s / bs) for s in seq_lens]
    tables, num_blocks = shuffled_block_tables(n_blocks_req, spec.extra_blocks, gen)
    kv_cache = _random_cache(spec, num_blocks, gen)

    # Tokens written this step and the positions they occupy.
    if cross:
        kv_lens, kv_starts = list(spec.context_lens), [0] * spec.num_reqs
    else:
        kv_lens, kv_starts = list(spec.query_lens), list(spec.context_lens)
    slot_list: list[int] = []
    for r in range(spec.num_reqs):
        slot_list += slots_of(tables[r], range(kv_starts[r], kv_starts[r] + kv_lens[r]), bs)
    num_q = sum(spec.query_lens)
    num_kv = sum(kv_lens)
    pad = spec.num_pad_tokens

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(spec.dtype).to(spec.device)

    query = rnd(num_q + pad, H, D)
    key, value = rnd(num_kv + pad, Hk, D), rnd(num_kv + pad, Hk, D)

    # What each request must attend to, in float32 as read back from the cache.
    ks, vs = (spec.k_scale, spec.v_scale)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    full_keys, full_values, tok = [], [], 0
    for r in range(spec.num_reqs):
        new_k = key[tok : tok + kv_lens[r]]
        new_v = value[tok : tok + kv_lens[r]]
        tok += kv_lens[r]
        if spec.attn_type in (ENCODER, ENCODER_ONLY):  # no cache: the given K/V as they are
            full_keys.append(new_k.float())
            full_values.append(new_v.float())
            continue
        ctx = [] if cross else slots_of(tables[r], range(spec.context_lens[r]), bs)
        ctx_t = torch.tensor(ctx, dtype=torch.long, device=spec.device)
        old_k = _from_cache(k_cache[ctx_t // bs, ctx_t % bs], ks)
        old_v = _from_cache(v_cache[ctx_t // bs, ctx_t % bs], vs)
        full_keys.append(torch.cat([old_k, kv_round_trip(new_k, spec.kv_cache_dtype, ks)]))
        full_values.append(torch.cat([old_v, kv_round_trip(new_v, spec.kv_cache_dtype, vs)]))

    dev = spec.device
    qlens = torch.tensor(spec.query_lens, dtype=torch.int32)
    qsl = torch.zeros(spec.num_reqs + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(qlens, 0)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    max_blocks = max(n_blocks_req + [1])
    bt = torch.zeros(spec.num_reqs, max_blocks, dtype=torch.int32)
    for r, t in enumerate(tables):
        bt[r, : len(t)] = torch.tensor(t, dtype=torch.int32)
    slot_mapping = torch.tensor(slot_list + [-1] * pad, dtype=torch.int64)
    common = CommonAttentionMetadata(
        query_start_loc=qsl.to(dev),
        query_start_loc_cpu=qsl,
        seq_lens=seq_lens_t.to(dev),
        seq_lens_cpu=seq_lens_t,
        num_computed_tokens_cpu=torch.tensor(
            [0] * spec.num_reqs if cross else list(spec.context_lens), dtype=torch.int32
        ),
        num_reqs=spec.num_reqs,
        num_actual_tokens=num_q,
        max_query_len=max(spec.query_lens + (0,)),
        block_table_tensor=bt.to(dev),
        slot_mapping=slot_mapping.to(dev),
        max_seq_len=max(seq_lens + [0]),
        causal=spec.attn_type == DECODER,
        # Cross-attention writes one slot per encoder token, not per decoder query token.
        num_slot_tokens=num_kv if cross else None,
    )
    layer = FakeLayer(k_scale=ks, v_scale=vs, device=dev)
    return RandomBatch(spec, query, key, value, kv_cache, common, tables, full_keys, full_values, layer)


def batch_specs(
    *,
    max_reqs: int = 16,
    max_context: int = 40,
    max_query: int = 12,
    head_sizes: tuple[int, ...] = (64, 128),
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16),
    kv_cache_dtypes: tuple[str, ...] = ("auto",),
    layouts: tuple[str, ...] = ("NHD", "HND"),
    block_sizes: tuple[int, ...] = (1, 4, 16),
    gqa_ratios: tuple[int, ...] = (1, 2, 4, 8),
    device: str = "cpu",
) -> Any:
    """A hypothesis strategy of decoder ``BatchSpec``s: mixed decodes then (chunked) prefills."""
    from hypothesis import strategies as st

    @st.composite
    def _draw(draw: Any) -> BatchSpec:
        n = draw(st.integers(1, max_reqs))
        n_dec = draw(st.integers(0, n))
        ctx = draw(st.lists(st.integers(0, max_context), min_size=n, max_size=n))
        qlens = [1] * n_dec + draw(
            st.lists(st.integers(min(2, max_query), max_query), min_size=n - n_dec, max_size=n - n_dec)
        )
        hk = draw(st.sampled_from((1, 2)))
        ratio = draw(st.sampled_from(gqa_ratios))
        return BatchSpec(
            context_lens=tuple(ctx),
            query_lens=tuple(qlens),
            num_heads=hk * ratio,
            num_kv_heads=hk,
            head_size=draw(st.sampled_from(head_sizes)),
            block_size=draw(st.sampled_from(block_sizes)),
            dtype=draw(st.sampled_from(dtypes)),
            kv_cache_dtype=draw(st.sampled_from(kv_cache_dtypes)),
            layout=draw(st.sampled_from(layouts)),
            num_pad_tokens=draw(st.integers(0, 3)),
            extra_blocks=draw(st.integers(0, 4)),
            device=device,
        )

    return _draw()


# ---------------------------------------------------------------------------------------
# The reference
# ---------------------------------------------------------------------------------------


def reference_attention(
    query: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    query_lens: list[int],
    *,
    scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    alibi_slopes: torch.Tensor | list[float] | None = None,
    sinks: torch.Tensor | None = None,
    allowed: Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Dense float32 attention, one request at a time.

    Args:
        query: (sum(query_lens), H, D); cast to float32.
        keys, values: per request (S_r, Hk, D); the request's FULL K/V (context + new).
        query_lens: new tokens per request; query i of request r sits at absolute position
            ``S_r - query_lens[r] + i``.
        causal: query at position p sees keys at positions <= p.
        sliding_window: query at p sees keys in (p - window, p].
        logits_soft_cap: scores become ``cap * tanh(scores / cap)`` (after ``scale``).
        alibi_slopes: (H,), adds ``slope * (key_pos - query_pos)``.
        sinks: (H,) logits, each adds ``exp(sink)`` to the softmax denominator.
        allowed: per request, a (query_len, S_r) bool mask that replaces the causal one (e.g.
            ``tree_allowed``'s draft trees); the window still narrows it.

    Returns:
        (sum(query_lens), H, D) float32.
    """
    H = query.shape[1]
    out = torch.empty(query.shape, dtype=torch.float32, device=query.device)
    slopes = None if alibi_slopes is None else torch.as_tensor(alibi_slopes, dtype=torch.float32)
    start = 0
    for r, ql in enumerate(query_lens):
        k, v = keys[r].float(), values[r].float()
        S, Hk = k.shape[0], k.shape[1]
        g = H // Hk
        q = query[start : start + ql].float()  # (ql, H, D)
        k = k.repeat_interleave(g, dim=1)  # (S, H, D): head h uses kv head h // g
        v = v.repeat_interleave(g, dim=1)
        s = torch.einsum("qhd,khd->hqk", q, k) * scale
        if logits_soft_cap:
            s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
        qpos = torch.arange(S - ql, S, device=q.device)[:, None]
        kpos = torch.arange(S, device=q.device)[None, :]
        if slopes is not None:
            s = s + slopes.to(q.device)[:, None, None] * (kpos - qpos).float()
        mask = torch.ones(ql, S, dtype=torch.bool, device=q.device)
        if allowed is not None:
            mask &= allowed[r].to(q.device)
        elif causal:
            mask &= kpos <= qpos
        if sliding_window is not None:
            mask &= kpos > qpos - sliding_window
        s = s.masked_fill(~mask, float("-inf"))
        if sinks is not None:
            sink = sinks.float().to(q.device)[:, None, None].expand(H, ql, 1)
            p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
        else:
            p = torch.softmax(s, dim=-1)
        out[start : start + ql] = torch.einsum("hqk,khd->qhd", p, v)
        start += ql
    return out


# ---------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, *, factor: float = 1.0) -> None:
    """``actual`` (any dtype) vs the float32 reference at ``TOLERANCES[dtype]`` times ``factor``."""
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=atol * factor, rtol=rtol * factor)


def assert_no_host_sync(fn: Callable[[], Any]) -> None:
    """``fn()`` (a CUDA step already run once: compiled, planned, its constants on the device)
    raises if it synchronizes with the host."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _slot_bytes(cache: torch.Tensor) -> torch.Tensor:
    """(2, num_slots, bytes_per_slot) uint8 view of a logical (2, nb, bs, Hk, D) cache."""
    c = cache.detach().cpu().contiguous()
    two, nb, bs = c.shape[:3]
    return c.view(torch.uint8).reshape(two, nb * bs, -1)


def check_cache_untouched(before: torch.Tensor, after: torch.Tensor, slot_mapping: torch.Tensor | None) -> None:
    """Every slot not in ``slot_mapping`` (negative entries = none) is bit-identical.

    ``before``/``after``: logical (2, num_blocks, block_size, Hk, D) caches, any strides.
    ``slot_mapping=None``: nothing may have been written.
    """
    b, a = _slot_bytes(before), _slot_bytes(after)
    keep = torch.ones(b.shape[1], dtype=torch.bool)
    if slot_mapping is not None:
        s = slot_mapping.detach().cpu().long()
        keep[s[s >= 0]] = False
    changed = (b[:, keep] != a[:, keep]).any(-1).any(0)
    if changed.any():
        idx = keep.nonzero().flatten()[changed]
        raise AssertionError(f"{len(idx)} cache slots outside slot_mapping changed, e.g. {idx[:8].tolist()}")


def check_cache_written(batch: RandomBatch, kv_cache: torch.Tensor | None = None) -> None:
    """The slots in ``slot_mapping`` hold exactly the stored form of the step's key/value."""
    cache = batch.kv_cache if kv_cache is None else kv_cache
    spec = batch.spec
    cd = cache.dtype
    s = batch.common.slot_mapping.cpu().long()
    n = min(s.shape[0], batch.key.shape[0])
    rows = (s[:n] >= 0).nonzero().flatten()
    slots = s[rows]
    bs = spec.block_size
    for i, (x, scale) in enumerate(((batch.key, spec.k_scale), (batch.value, spec.v_scale))):
        want = _to_cache(x.cpu()[rows], cd, scale)
        got = cache[i].cpu()[slots // bs, slots % bs]
        if not torch.equal(want.view(torch.uint8), got.contiguous().view(torch.uint8)):
            raise AssertionError(f"kv_cache[{i}] at slot_mapping does not hold the new {'kv'[i]} rows")


def tree_allowed(context_lens: Sequence[int], parents: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Per request of a draft-tree step: (query_len, seq_len) bool, the cached context plus each
    new token's ancestors and itself (by walking ``parents``, never through vattn's code)."""
    allowed = []
    for ctx, ps in zip(context_lens, parents):
        a = torch.zeros(len(ps), ctx + len(ps), dtype=torch.bool)
        a[:, :ctx] = True
        for i in range(len(ps)):
            j = i
            while j >= 0:
                a[i, ctx + j] = True
                j = ps[j]
        allowed.append(a)
    return allowed


# ---------------------------------------------------------------------------------------
# Any backend through vattn.Attention and the attention op
# ---------------------------------------------------------------------------------------

#: ``reference_attention``'s feature names that ``vattn.Attention`` spells otherwise.
_LAYER_ARGS = {"sliding_window": "per_layer_sliding_window"}
_PREFIX = "harness.attn"
_MAX_CONTEXT = 200  # tokens cached before a graph step (padded_step)


def harness_view(backend: Any, cache: torch.Tensor) -> torch.Tensor:
    """The harness's logical ``(2, num_blocks, block_size, Hk, D)`` view of a cache tensor that
    ``backend`` allocated: the tensor itself for the standard shape, ``transpose(0, 1)`` for a
    ``(num_blocks, 2, ...)`` one (FLASHINFER's)."""
    probe = backend.get_kv_cache_shape(3, *cache.shape[2:])  # 3 blocks: never confused with the K/V dim
    if len(probe) == 5 and probe[:2] == (2, 3):
        return cache
    if len(probe) == 5 and probe[:2] == (3, 2):
        return cache.transpose(0, 1)
    raise NotImplementedError(f"{backend.get_name()}: KV-cache shape {probe} is neither (2, N, ...) nor (N, 2, ...)")


@contextlib.contextmanager
def _building(spec: BatchSpec) -> Iterator[None]:
    """Layers and caches made in the spec's model dtype, device and physical cache layout."""
    from vattn.core.layout import set_kv_cache_layout

    old = torch.get_default_dtype()
    torch.set_default_dtype(spec.dtype)
    set_kv_cache_layout(spec.layout)
    try:
        with torch.device(spec.device):
            yield
    finally:
        torch.set_default_dtype(old)
        set_kv_cache_layout(None)


def attention_layer(backend: Any, spec: BatchSpec, num_blocks: int, *, compilation: Any = None,
                    **features: Any) -> tuple[Any, Any, Any]:
    """A ``vattn.Attention`` of ``spec``'s geometry on ``backend`` (a name or a class) with the
    layer ``features`` (``reference_attention``'s names) and its allocated, bound cache of
    ``num_blocks`` blocks, under a fresh config (``compilation``: its ``CompilationConfig``):
    (layer, PagedKVCache, config). fp8 scales from ``spec``."""
    import vattn

    cache = vattn.CacheConfig(block_size=spec.block_size, cache_dtype=spec.kv_cache_dtype)
    cfg = vattn.VattnConfig(cache=cache, **({} if compilation is None else {"compilation": compilation}))
    kwargs = {_LAYER_ARGS.get(k, k): v for k, v in features.items()}
    with _building(spec), vattn.set_current_vattn_config(cfg):
        layer = vattn.Attention(spec.num_heads, spec.head_size, spec.head_size**-0.5, num_kv_heads=spec.num_kv_heads,
                                prefix=_PREFIX, attn_backend=backend, attn_type=spec.attn_type, **kwargs)
        kv = vattn.allocate_kv_cache(cfg, num_blocks=num_blocks, device=spec.device, dtype=spec.dtype)
    layer.set_kv_scales(spec.k_scale, spec.v_scale)
    return layer, kv, cfg


@dataclass
class LayerStep:
    """One step through ``vattn.Attention``: ``out`` (T, H, D); ``before`` / ``cache`` the
    layer's cache before and after (``harness_view``; None for attention types without one)."""

    out: torch.Tensor
    before: torch.Tensor | None
    cache: torch.Tensor | None
    layer: Any
    kv: Any


def run_layer_step(backend: Any, batch: RandomBatch, *, common: CommonAttentionMetadata | None = None,
                   builder_attrs: dict[str, Any] | None = None, **features: Any) -> LayerStep:
    """Run ``batch`` (or ``common`` over its cache) through a fresh layer on ``backend``: its cache
    holds the batch's random contents, its metadata comes from ``kv.build_metadata``.
    ``builder_attrs``: attributes set on the metadata builders first (e.g. a backend's switches)."""
    import vattn

    spec = batch.spec
    layer, kv, cfg = attention_layer(backend, spec, batch.kv_cache.shape[1], **features)
    for group in kv.groups:
        for name, value in (builder_attrs or {}).items():
            setattr(group.builder, name, value)
    cache = before = None
    if _PREFIX in kv.tensors:
        cache = harness_view(layer.attn_backend, kv.tensors[_PREFIX])
        cache.copy_(batch.kv_cache)
        before = cache.clone()
    q, k, v = (x.flatten(1) for x in (batch.query, batch.key, batch.value))
    with vattn.set_forward_context(kv.build_metadata(batch.common if common is None else common), cfg):
        out = layer(q, k, v)
    if out.is_cuda:
        torch.cuda.synchronize()
    return LayerStep(out.view(batch.query.shape), before, cache, layer, kv)


def skip_unless_served(backend: Any, spec: BatchSpec, **features: Any) -> None:
    """``pytest.skip`` with ``backend``'s own reasons (``validate_configuration``, ``feature_reasons``:
    its declared capabilities) where it does not serve ``spec`` with the layer ``features``."""
    import pytest

    from vattn.layer import _backend_class

    cls = _backend_class(backend)
    reasons = cls.validate_configuration(spec.head_size, spec.dtype, spec.kv_cache_dtype, spec.block_size,
                                         has_sink=features.get("sinks") is not None)
    reasons += cls.feature_reasons(spec.attn_type, use_sliding_window=features.get("sliding_window") is not None,
                                   use_logits_soft_cap=bool(features.get("logits_soft_cap")),
                                   use_alibi=features.get("alibi_slopes") is not None)
    if reasons:
        pytest.skip(f"{cls.get_name()} does not serve this case: {'; '.join(reasons)}")


def check_layer_step(backend: Any, batch: RandomBatch, *, factor: float = 1.0,
                     common: CommonAttentionMetadata | None = None, allowed: list[torch.Tensor] | None = None,
                     builder_attrs: dict[str, Any] | None = None, **features: Any) -> LayerStep:
    """``run_layer_step``, then: the output's real rows match the float32 reference (with
    ``features``; ``allowed``: explicit per-request masks instead, e.g. ``tree_allowed``), the
    step's K/V sit at their slots exactly, and every other cache slot is bit-identical. A layer
    that quantizes q for its fp8 cache is compared with the quantized q."""
    step = run_layer_step(backend, batch, common=common, builder_attrs=builder_attrs, **features)
    spec, n = batch.spec, batch.num_actual_tokens
    query = batch.query[:n]
    if step.layer.query_quant is not None:
        query = kv_round_trip(query, spec.kv_cache_dtype, float(step.layer._q_scale))
    ref = reference_attention(query, batch.full_keys, batch.full_values, list(spec.query_lens),
                              scale=spec.head_size**-0.5, causal=spec.attn_type == DECODER, allowed=allowed,
                              **features)
    assert_close(step.out[:n], ref, spec.dtype, factor=factor)
    if step.cache is not None:
        slots = (batch.common if common is None else common).slot_mapping
        check_cache_untouched(step.before, step.cache, slots)
        check_cache_written(batch, step.cache)
    return step


def padded_step(spec_kwargs: dict[str, Any], size: int, seed: int, *, mixed: bool,
                num_blocks: int) -> tuple[RandomBatch, CommonAttentionMetadata]:
    """A random step of at most ``size`` tokens over a pool of ``num_blocks`` blocks (decodes, or
    ``mixed``: ``size // 2`` decodes and one prefill, exactly ``size`` tokens) and its metadata
    padded to ``size`` tokens and requests, as a CUDA graph of that size replays it (every step of
    one ``size`` has block tables of one width: what fits the longest possible request)."""
    from vattn.metadata import build_common_attn_metadata

    g = torch.Generator().manual_seed(seed)
    if mixed:
        qlens = (1,) * (size // 2) + (size - size // 2,)
    else:
        qlens = (1,) * int(torch.randint(1, size + 1, (1,), generator=g))
    ctx = tuple(int(c) for c in torch.randint(0, _MAX_CONTEXT, (len(qlens),), generator=g))
    bs = spec_kwargs.get("block_size", 16)
    extra = num_blocks - sum(-(-(c + q) // bs) for c, q in zip(ctx, qlens))
    batch = make_random_batch(BatchSpec(context_lens=ctx, query_lens=qlens, extra_blocks=extra, **spec_kwargs),
                              seed=seed)
    common = build_common_attn_metadata(list(qlens), list(ctx), batch.block_tables, bs, device=batch.spec.device,
                                        num_tokens_padded=size, num_reqs_padded=size,
                                        max_blocks_per_req=-(-(_MAX_CONTEXT + size) // bs))
    return batch, common


def check_graph_replays(backend: Any, spec_kwargs: dict[str, Any], sizes: Sequence[int], *,
                        num_blocks: int = 600) -> None:
    """FULL CUDA graphs replay what eager runs, at every size of ``sizes``.

    Per size: capture the layer's step from capture metadata (``build_metadata_for_cudagraph_capture``)
    and a decode batch; then, for two new decode batches and (a builder of ``ALWAYS`` support) a
    mixed one, rebuild the metadata in place, copy the padded inputs, replay, and compare output
    and cache with a fresh eager layer's step, and the output with the float32 reference. On CPU
    (torch stand-ins of kernel libraries) the capture is emulated: each replay re-runs the step on
    the capture metadata, which must read what the rebuilds wrote into the persistent buffers."""
    import vattn
    from vattn.core.config import CompilationConfig, CUDAGraphMode
    from vattn.core.enums import AttentionCGSupport

    device = spec_kwargs["device"]
    for size in sizes:
        batch0, common0 = padded_step(spec_kwargs, size, seed=size, mixed=False, num_blocks=num_blocks)
        spec = batch0.spec
        graphs = CompilationConfig(cudagraph_mode=CUDAGraphMode.FULL, cudagraph_capture_sizes=tuple(sizes))
        layer, kv, cfg = attention_layer(backend, spec, num_blocks, compilation=graphs)
        cache = harness_view(layer.attn_backend, kv.tensors[_PREFIX])
        cache.copy_(batch0.kv_cache)
        q = torch.zeros(size, spec.num_heads * spec.head_size, dtype=spec.dtype, device=device)
        k = torch.zeros(size, spec.num_kv_heads * spec.head_size, dtype=spec.dtype, device=device)
        v = torch.zeros_like(k)
        md = kv.build_metadata_for_cudagraph_capture(common0)

        def step() -> torch.Tensor:
            with vattn.set_forward_context(md, cfg):
                return layer(q, k, v)

        graph = None
        out = step()  # eager warm-up (compiles / JITs outside the capture)
        if device == "cuda":
            step()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = step()
        replays = [(False, 100 + size), (False, 200 + size)]
        if layer.attn_backend.get_cudagraph_support() == AttentionCGSupport.ALWAYS and size >= 4:
            replays.append((True, 300 + size))  # a mixed batch replays the same graph
        for mixed, seed in replays:
            batch, common = padded_step(spec_kwargs, size, seed=seed, mixed=mixed, num_blocks=num_blocks)
            assert kv.can_run_in_cudagraph(common), f"size {size}, mixed={mixed}: the builder refuses the graph"
            cache.copy_(batch.kv_cache)
            kv.build_metadata(common)  # in place: the captured metadata now describes this batch
            n = batch.num_actual_tokens
            for buf, x in ((q, batch.query), (k, batch.key), (v, batch.value)):
                buf.zero_()
                buf[:n].copy_(x[:n].flatten(1))
            if graph is not None:
                graph.replay()
                torch.cuda.synchronize()
            else:
                out = step()
            eager = run_layer_step(backend, batch)
            assert_close(out[:n].view(n, spec.num_heads, spec.head_size), eager.out[:n].float(), spec.dtype)
            assert_close(out[:n].view(n, spec.num_heads, spec.head_size), batch.reference(scale=spec.head_size**-0.5),
                         spec.dtype, factor=2.0)
            assert eager.cache is not None
            torch.testing.assert_close(cache, eager.cache, atol=0, rtol=0)

"""CPU_ATTN: decodes read from the paged cache in place (runs of consecutive blocks merged by
their log-sum-exp), equal to TORCH_SDPA's gather and to a float32 reference; fragmented tables,
16-bit caches and layer features take TORCH_SDPA's path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import vattn
import numpy as np

from vattn.backends.cpu_attn import CPUAttentionMetadata, decode_runs

H, HK, D, BS = 8, 2, 32, 4


def test_decode_runs() -> None:
    blocks = np.array([[3, 4, 5, 6, 7, 8, 9, 10, 20, 21, 22, 23], [7] + [0] * 11, list(range(1, 12)) + [30]])
    assert decode_runs(blocks, np.array([47, 3, 45]), BS) == [[(3, 32), (20, 15)], [(7, 3)], [(1, 44), (30, 1)]]
    # 3 runs in 5 blocks: more than a quarter of the blocks, the gather serves the batch
    assert decode_runs(np.array([[3, 4, 9, 2, 3]]), np.array([20]), BS) is None


def _decode(backend: str, tables: list[list[int]], lens: list[int], dtype: torch.dtype, seed: int = 0,
            **layer_kw) -> tuple[torch.Tensor, vattn.AttentionMetadata, torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(seed)
    cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=BS))
    with vattn.set_current_vattn_config(cfg):
        attn = vattn.Attention(H, D, D**-0.5, num_kv_heads=HK, prefix="a", attn_backend=backend, **layer_kw)
    kv = vattn.allocate_kv_cache(cfg, num_blocks=64, dtype=dtype)
    kv.tensors["a"].normal_()
    common = kv.common_metadata([1] * len(lens), lens, tables)
    md = kv.build_metadata(common)
    q, k, v = (torch.randn(len(lens), n * D, dtype=dtype) for n in (H, HK, HK))
    with vattn.set_forward_context(md, cfg):
        out = attn(q, k, v)
    return out.view(len(lens), H, D), md["a"], q, [kv.tensors["a"].clone()]


def _reference(cache: torch.Tensor, q: torch.Tensor, tables: list[list[int]], lens: list[int]) -> torch.Tensor:
    outs = []
    for b, (table, n) in enumerate(zip(tables, lens)):
        k = cache[0].float()[table].flatten(0, 1)[: n + 1].permute(1, 0, 2)  # (Hk, L, D), the new token stored
        v = cache[1].float()[table].flatten(0, 1)[: n + 1].permute(1, 0, 2)
        qb = q[b].float().view(HK, H // HK, D)
        outs.append(F.scaled_dot_product_attention(qb, k, v, scale=D**-0.5).reshape(H, D))
    return torch.stack(outs)


CASES = {
    "one run": ([list(range(10, 20))], [37]),
    "runs": ([[1, 2, 3, 4, 5, 6, 7, 8, 30, 31, 32, 33], [40, 41, 42, 43, 44, 45, 46, 47, 48]], [45, 33]),
    "batch": ([[50, 51], [54, 55], [58, 59]], [5, 7, 1]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_in_place_matches_reference_and_sdpa(case: str, dtype: torch.dtype) -> None:
    tables, lens = CASES[case]
    out, md, q, (cache,) = _decode("CPU_ATTN", tables, lens, dtype)
    assert isinstance(md, CPUAttentionMetadata) and md.decode_runs is not None
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), _reference(cache, q, tables, lens), atol=tol, rtol=tol)
    sdpa, _, _, (sdpa_cache,) = _decode("TORCH_SDPA", tables, lens, dtype)
    assert torch.equal(sdpa_cache, cache)  # the same K/V stored, every other slot untouched
    torch.testing.assert_close(out.float(), sdpa.float(), atol=tol, rtol=tol)


def test_fragmented_table_takes_the_gather() -> None:
    tables, lens = [[9, 3, 17, 1, 25, 12, 40, 33]], [30]
    out, md, q, (cache,) = _decode("CPU_ATTN", tables, lens, torch.float32)
    assert md.decode_runs is None
    torch.testing.assert_close(out, _reference(cache, q, tables, lens), atol=1e-5, rtol=1e-5)


def test_cpu_is_the_default_on_cpu() -> None:
    assert vattn.get_attn_backend(64, torch.float32, "auto", 16).get_name() == "CPU_ATTN"
    assert vattn.get_attn_backend(64, torch.bfloat16, "fp8", 16).get_name() == "CPU_ATTN"

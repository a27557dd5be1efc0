"""FLEX_ATTENTION's extension points given what they cannot run: ``mask_mod`` / ``score_mod`` are
refused when the layer is made (their result kind and shape, or an error they raise), the mods'
per-request tensors when a step's metadata is built, before anything is written."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import vattn
from vattn.backends.flex_attention.mods import document, prefix_lm

H, HK, D = 4, 2, 16


def _layer(cfg: vattn.VattnConfig, prefix: str = "l0", **mods: Any) -> vattn.Attention:
    with vattn.set_current_vattn_config(cfg):
        return vattn.Attention(H, D, D**-0.5, num_kv_heads=HK, prefix=prefix, attn_backend="FLEX_ATTENTION", **mods)


BAD = {
    "mask_python_true": (dict(mask_mod=lambda b, h, q, kv: True), TypeError, "mask_mod.*Python constant"),
    "mask_float": (dict(mask_mod=lambda b, h, q, kv: (kv <= q).float()), TypeError, "mask_mod.*float32"),
    "mask_stacked": (dict(mask_mod=lambda b, h, q, kv: torch.stack([kv <= q, kv <= q])), ValueError, "mask_mod.*0-d"),
    "mask_raises": (dict(mask_mod=lambda b, h, q, kv: torch.zeros(2)[q + 5] > 0), ValueError, "mask_mod raised"),
    "score_bool": (dict(score_mod=lambda s, b, h, q, kv: s > 0), TypeError, "score_mod.*bool"),
    "score_int": (dict(score_mod=lambda s, b, h, q, kv: q - kv), TypeError, "score_mod.*int"),
    "score_shape": (dict(score_mod=lambda s, b, h, q, kv: s.expand(3)), ValueError, "score_mod.*0-d"),
    "score_raises": (dict(score_mod=lambda s, b, h, q, kv: s + torch.ones(3) @ torch.ones(2)), ValueError,
                     "score_mod raised"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_mods_refused_when_the_layer_is_made(case: str) -> None:
    mods, exc, match = BAD[case]
    with pytest.raises(exc, match=match):
        _layer(vattn.VattnConfig(), **mods)


@pytest.mark.parametrize("mod,match", [(lambda: prefix_lm(torch.zeros(1, dtype=torch.int32)), "prompt_lens"),
                                       (lambda: document(torch.zeros(2, 4, dtype=torch.int64)), "doc_ids")])
def test_mod_tensors_too_small_for_the_step_are_refused_before_writing(mod: Any, match: str) -> None:
    cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=16))
    layer = _layer(cfg, mask_mod=mod())
    kv = vattn.allocate_kv_cache(cfg, num_blocks=4, dtype=torch.float32)
    for t in kv.tensors.values():
        t.normal_()
    before = {n: t.clone() for n, t in kv.tensors.items()}
    common = kv.common_metadata([3, 5], [4, 0], [[0], [1]])  # 2 requests, the longest 7 positions
    with pytest.raises(ValueError, match=match):
        md = kv.build_metadata(common)
        with vattn.set_forward_context(md, cfg), torch.no_grad():
            layer(torch.randn(8, H * D), torch.randn(8, HK * D), torch.randn(8, HK * D))
    assert all(torch.equal(kv.tensors[n], t) for n, t in before.items())


def test_helpers_and_plain_mods_still_pass() -> None:
    cfg = vattn.VattnConfig()
    _layer(cfg, "a", mask_mod=prefix_lm(torch.zeros(4, dtype=torch.int32)))
    _layer(cfg, "b", mask_mod=lambda b, h, q, kv: kv <= q, score_mod=lambda s, b, h, q, kv: s * 0.5)

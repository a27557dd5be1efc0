"""Bad input to a transformers model on vattn (``VattnCausalLM``): each call is refused before the
step touches the KV cache, with an error that names the argument; every cache tensor stays
bit-identical."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import vattn  # noqa: E402
from examples.hf_model import random_model, tiny_config  # noqa: E402
from vattn.integrations import transformers as vt  # noqa: E402


@pytest.fixture(scope="module")
def rig() -> tuple[Any, vattn.VattnConfig, vattn.PagedKVCache]:
    cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=8))
    model = vt.wrap(random_model(tiny_config("llama"), seed=1), cfg)
    kv = vattn.allocate_kv_cache(cfg, num_blocks=8, device="cpu", dtype=torch.float32)
    for t in kv.tensors.values():
        t.normal_()
    return model, cfg, kv


def _step(rig: Any, ids: Any, positions: Any, computed: int = 8) -> torch.Tensor:
    model, cfg, kv = rig
    n = 6
    common = kv.common_metadata([n], [computed], [[0, 1]])
    with vattn.set_forward_context(kv.build_metadata(common), cfg), torch.no_grad():
        return model(ids, positions)


def _ids(n: int = 6) -> torch.Tensor:
    return torch.arange(3, 3 + n)


def _pos(start: int = 8, n: int = 6) -> torch.Tensor:
    return torch.arange(start, start + n)


CASES = {
    "id_past_vocab": (lambda v: (torch.tensor([3, 4, v, 5, 6, 7]), _pos()), ValueError, r"input_ids\[2\]"),
    "id_negative": (lambda v: (torch.tensor([3, 4, -1, 5, 6, 7]), _pos()), ValueError, r"input_ids\[2\]"),
    "lengths_differ": (lambda v: (_ids(), _pos(n=5)), ValueError, "positions"),
    "ids_2d": (lambda v: (_ids()[None], _pos()), ValueError, "input_ids"),
    "ids_float": (lambda v: (_ids().float(), _pos()), TypeError, "input_ids"),
    "ids_list": (lambda v: (list(range(6)), _pos()), TypeError, "input_ids"),
    "positions_float": (lambda v: (_ids(), _pos().float()), TypeError, "positions"),
    "positions_disagree": (lambda v: (_ids(), _pos(start=20)), ValueError, r"positions\[0\]: expected 8"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_step_inputs_refused_before_the_cache_is_written(rig: Any, case: str) -> None:
    make, exc, match = CASES[case]
    model, _, kv = rig
    before = {n: t.clone() for n, t in kv.tensors.items()}
    with pytest.raises(exc, match=match):
        _step(rig, *make(model._vocab_size))
    assert all(torch.equal(kv.tensors[n], t) for n, t in before.items())


def test_valid_step_runs(rig: Any) -> None:
    assert _step(rig, _ids(), _pos()).shape == (6, rig[0].config.hidden_size)


@pytest.mark.parametrize("hidden,exc", [(torch.zeros(2, 7), ValueError), (torch.zeros(2, 7, dtype=torch.long), TypeError),
                                        ("x", TypeError)])
def test_compute_logits_refuses_the_wrong_hidden(rig: Any, hidden: Any, exc: type) -> None:
    with pytest.raises(exc, match="hidden"):
        rig[0].compute_logits(hidden)


def test_generate_on_a_wrapped_model_says_what_to_use_instead(rig: Any) -> None:
    hf = rig[0].hf_model
    with pytest.raises(RuntimeError, match="generate\\(\\) does not run on a wrapped model yet"):
        hf.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=2, do_sample=False)


def _hf(kind: str) -> Any:
    import transformers

    if kind == "bert":
        cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=64)
        return transformers.BertForMaskedLM(cfg)
    if kind == "t5":
        cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=16, d_ff=64, num_layers=1, num_heads=2)
        return transformers.T5ForConditionalGeneration(cfg)
    cfg = transformers.Llama4TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64,
                                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                        num_local_experts=2)
    return transformers.Llama4ForCausalLM(cfg)


@pytest.mark.parametrize("kind,match", [("bert", "an encoder \\(bidirectional"), ("t5", "an encoder-decoder model"),
                                        ("llama4", "chunked local attention")])
def test_wrap_names_the_real_blocker(kind: str, match: str) -> None:
    pytest.importorskip("transformers", minversion="4.51")
    with pytest.raises(NotImplementedError, match=match):
        vt.wrap(_hf(kind), vattn.VattnConfig())

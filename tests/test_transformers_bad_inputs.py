"""Bad input to a transformers model on vattn (``VattnCausalLM``): each call is refused before the
step touches the KV cache, with an error that names the argument; every cache tensor stays
bit-identical. Models ``wrap`` cannot run are refused with the real reason, and transformers'
own ``generate()`` / forward on a wrapped model say what to use instead."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import vattn  # noqa: E402
from examples.hf_model import random_model, tiny_config  # noqa: E402
from vattn.integrations import transformers as vt  # noqa: E402

pytestmark = pytest.mark.usefixtures("hf_one_thread")


@pytest.fixture(scope="module")
def rig() -> tuple[Any, vattn.VattnConfig, vattn.PagedKVCache]:
    cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=8))
    model = vt.wrap(random_model(tiny_config("llama"), seed=1), cfg)
    kv = vattn.allocate_kv_cache(cfg, num_blocks=8, device="cpu", dtype=torch.float32)
    for t in kv.tensors.values():
        t.normal_()
    return model, cfg, kv


def _metadata(kv: vattn.PagedKVCache, query_lens: list[int], computed: list[int]) -> Any:
    tables = [[1 + 2 * r, 2 + 2 * r] for r in range(len(query_lens))]
    return kv.build_metadata(kv.common_metadata(query_lens, computed, tables))


def _step(rig: Any, ids: Any, positions: Any, computed: int = 8, n: int = 6) -> torch.Tensor:
    model, cfg, kv = rig
    with vattn.set_forward_context(_metadata(kv, [n], [computed]), cfg), torch.no_grad():
        return model(ids, positions)


def _ids(n: int = 6) -> torch.Tensor:
    return torch.arange(3, 3 + n)


def _pos(start: int = 8, n: int = 6) -> torch.Tensor:
    return torch.arange(start, start + n)


def _unchanged(kv: vattn.PagedKVCache, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(kv.tensors[n], t) for n, t in before.items())


CASES = {
    "id_past_vocab": (lambda v: (torch.tensor([3, 4, v, 5, 6, 7]), _pos()), ValueError, r"input_ids\[2\]"),
    "id_negative": (lambda v: (torch.tensor([3, 4, -1, 5, 6, 7]), _pos()), ValueError, r"input_ids\[2\]"),
    "id_negative_int32": (lambda v: (torch.tensor([3, 4, 5, 6, 7, -1], dtype=torch.int32), _pos()), ValueError,
                          r"input_ids\[5\]"),
    "lengths_differ": (lambda v: (_ids(), _pos(n=5)), ValueError, "positions"),
    "ids_2d": (lambda v: (_ids()[None], _pos()), ValueError, "input_ids"),
    "ids_float": (lambda v: (_ids().float(), _pos()), TypeError, "input_ids"),
    "ids_uint8": (lambda v: (_ids().to(torch.uint8), _pos()), TypeError, "input_ids: expected dtype torch.int64"),
    "ids_int16": (lambda v: (_ids().to(torch.int16), _pos()), TypeError, "input_ids: expected dtype torch.int64"),
    "ids_list": (lambda v: (list(range(6)), _pos()), TypeError, "input_ids"),
    "ids_empty": (lambda v: (_ids()[:0], _pos()[:0]), ValueError, "input_ids: expected at least one token"),
    "ids_fewer_than_metadata": (lambda v: (_ids(4), _pos(n=4)), ValueError, "input_ids: expected 6 tokens"),
    "ids_more_than_metadata": (lambda v: (_ids(8), _pos(n=8)), ValueError, "input_ids: expected 6 tokens"),
    "ids_other_device": (lambda v: (_ids().to("meta"), _pos()), ValueError, "input_ids: expected a tensor on"),
    "positions_float": (lambda v: (_ids(), _pos().float()), TypeError, "positions"),
    "positions_2d": (lambda v: (_ids(), _pos()[None]), ValueError, "positions"),
    "positions_disagree": (lambda v: (_ids(), _pos(start=20)), ValueError, r"positions\[0\]: expected 8"),
    "positions_one_off": (lambda v: (_ids(), torch.tensor([8, 9, 10, 12, 12, 13])), ValueError,
                          r"positions\[3\]: expected 11"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_step_inputs_refused_before_the_cache_is_written(rig: Any, case: str) -> None:
    make, exc, match = CASES[case]
    model, _, kv = rig
    before = {n: t.clone() for n, t in kv.tensors.items()}
    with pytest.raises(exc, match=match):
        _step(rig, *make(model._vocab_size))
    assert _unchanged(kv, before)


def test_valid_step_runs(rig: Any) -> None:
    assert _step(rig, _ids(), _pos()).shape == (6, rig[0].config.hidden_size)
    assert _step(rig, _ids().int(), _pos().int()).shape == (6, rig[0].config.hidden_size)  # int32 is fine too


# (query_lens, computed, positions with one wrong entry, its index and the expected value): decodes
# only (one token per request), and decodes with a prefill; a request with no new token in between.
BATCHES = {
    "decodes": ([1, 1, 1], [5, 9, 2], [5, 9, 3], 2, 2),
    "decodes_and_prefill": ([1, 1, 4], [5, 9, 0], [5, 9, 0, 1, 3, 3], 4, 2),
    "empty_request_between": ([1, 0, 2], [5, 3, 2], [5, 2, 4], 2, 3),
}


@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_positions_checked_per_request(rig: Any, batch: str) -> None:
    """Token j of request r must sit at num_computed[r] + j: the right positions run, one wrong
    position is named with its request's computed tokens, before the cache is written."""
    model, cfg, kv = rig
    query_lens, computed, wrong, at, want = BATCHES[batch]
    right = torch.cat([torch.arange(c, c + q) for q, c in zip(query_lens, computed)])
    ids = _ids(len(right))
    with vattn.set_forward_context(_metadata(kv, query_lens, computed), cfg), torch.no_grad():
        assert model(ids, right).shape[0] == len(right)
    before = {n: t.clone() for n, t in kv.tensors.items()}
    with vattn.set_forward_context(_metadata(kv, query_lens, computed), cfg), torch.no_grad():
        with pytest.raises(ValueError, match=rf"positions\[{at}\]: expected {want} \(request"):
            model(ids, torch.tensor(wrong))
    assert _unchanged(kv, before)


@pytest.mark.parametrize("hidden,exc,match", [
    (torch.zeros(2, 7), ValueError, r"hidden: expected shape \(N, 64\)"),
    (torch.zeros(64), ValueError, r"hidden: expected shape \(N, 64\)"),
    (torch.zeros(2, 7, dtype=torch.long), TypeError, "hidden: expected a floating"),
    ("x", TypeError, "hidden: expected a floating"),
    (torch.zeros(2, 64, dtype=torch.float64), TypeError, "hidden: expected dtype torch.float32"),
    (torch.zeros(2, 64, dtype=torch.bfloat16), TypeError, "hidden: expected dtype torch.float32"),
    (torch.zeros(2, 64, device="meta"), ValueError, "hidden: expected a tensor on the model's device"),
])
def test_compute_logits_refuses_the_wrong_hidden(rig: Any, hidden: Any, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        rig[0].compute_logits(hidden)


def test_step_outside_a_forward_context_says_how_to_set_one(rig: Any) -> None:
    model, _, kv = rig
    before = {n: t.clone() for n, t in kv.tensors.items()}
    with pytest.raises(RuntimeError, match=r"VattnCausalLM: called outside vattn.set_forward_context"):
        model(_ids(), _pos())
    assert _unchanged(kv, before)


def test_warm_up_is_explicit(rig: Any) -> None:
    """No metadata: refused naming attn_metadata unless the run is marked ``dummy_run`` (then it
    runs and writes nothing)."""
    model, cfg, kv = rig
    before = {n: t.clone() for n, t in kv.tensors.items()}
    with vattn.set_forward_context(None, cfg), torch.no_grad():
        with pytest.raises(ValueError, match="attn_metadata.*dummy_run=True"):
            model(_ids(), _pos())
    with vattn.set_forward_context(None, cfg, dummy_run=True), torch.no_grad():
        assert model(_ids(), _pos()).shape == (6, model.config.hidden_size)
    assert _unchanged(kv, before)


@pytest.mark.parametrize("context", ["none", "no_metadata", "dummy_run", "metadata"])
def test_generate_on_a_wrapped_model_leaves_the_engine_cache_alone(rig: Any, context: str) -> None:
    """transformers' generate() of a wrapped model runs on a paged cache of its own, in or out of
    a forward context: the engine's cache stays bit-identical and bound to the layers."""
    model, cfg, kv = rig
    before = {n: t.clone() for n, t in kv.tensors.items()}
    md = _metadata(kv, [3], [0]) if context == "metadata" else None
    prompt = torch.tensor([[3, 4, 5]])
    if context == "none":
        out = model.hf_model.generate(prompt, max_new_tokens=2, do_sample=False, pad_token_id=0)
    else:
        with vattn.set_forward_context(md, cfg, dummy_run=context == "dummy_run"):
            out = model.hf_model.generate(prompt, max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert out.shape[0] == 1 and torch.equal(out[:, :3], prompt) and _unchanged(kv, before)
    assert all(layer.kv_cache[0] is kv.tensors[name] for name, layer in model.attention_layers().items())


def test_transformers_forward_in_a_context_checks_its_positions(rig: Any) -> None:
    """The transformers model's own forward counts positions from 0: past a request's cached
    tokens that is refused naming position_ids (and runs where it is right)."""
    model, cfg, kv = rig
    with vattn.set_forward_context(_metadata(kv, [6], [0]), cfg), torch.no_grad():
        assert model.hf_model(_ids()[None]).logits.shape == (1, 6, model.config.vocab_size)
    before = {n: t.clone() for n, t in kv.tensors.items()}
    with vattn.set_forward_context(_metadata(kv, [6], [8]), cfg), torch.no_grad():
        with pytest.raises(ValueError, match=r"position_ids\[0\]: expected 8 .*got 0"):
            model.hf_model(_ids()[None])
    assert _unchanged(kv, before)


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
def test_transformers_own_cache_is_refused(rig: Any) -> None:
    """A decoding loop over the transformers model (its past_key_values): keys of more tokens than
    the query are refused naming key and generate(), not a shape error inside vattn."""
    model, cfg, kv = rig
    with vattn.set_forward_context(None, cfg, dummy_run=True), torch.no_grad():
        cache = model.hf_model(_ids()[None], use_cache=True).past_key_values
    before = {n: t.clone() for n, t in kv.tensors.items()}
    with vattn.set_forward_context(_metadata(kv, [1], [6]), cfg), torch.no_grad():
        with pytest.raises(NotImplementedError, match=r"key: expected as many tokens as the query \(1\), got 7: "
                                                      r"transformers' own KV cache"):
            model.hf_model(_ids(1)[None], position_ids=torch.tensor([[6]]), past_key_values=cache, use_cache=True)
    assert _unchanged(kv, before)


def _hf(kind: str) -> Any:
    import transformers

    bert = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    llama4 = dict(vocab_size=64, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_local_experts=2)
    if kind == "bert":
        return transformers.BertForMaskedLM(transformers.BertConfig(**bert))
    if kind == "bert_decoder":
        return transformers.BertLMHeadModel(transformers.BertConfig(**bert, is_decoder=True))
    if kind == "t5":
        cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=16, d_ff=64, num_layers=1, num_heads=2)
        return transformers.T5ForConditionalGeneration(cfg)
    if kind == "bart_causal":
        cfg = transformers.BartConfig(vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1,
                                      encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                                      decoder_ffn_dim=64)
        return transformers.BartForCausalLM(cfg)
    if kind == "llama_base":
        return transformers.LlamaModel(tiny_config("llama"))
    if kind == "llama4_full":
        return transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(**llama4, attention_chunk_size=None))
    return transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(**llama4))


@pytest.mark.parametrize("kind,exc,match", [
    ("bert", NotImplementedError, r"an encoder \(bidirectional.*runs decoder-only causal LMs.*ENCODER_ONLY"),
    ("t5", NotImplementedError, r"T5LayerSelfAttention\): an encoder-decoder model"),
    ("bart_causal", NotImplementedError, r"encoder_attn \(BartAttention\): cross-attention"),
    ("llama4", NotImplementedError, r"Llama4ForCausalLM is a model with chunked local attention"),
    ("llama_base", TypeError, r"model: expected a transformers causal LM.*got LlamaModel, which has no LM head"),
    ("bert_decoder", NotImplementedError, r"got BertLMHeadModel, whose LM head's output layer "
                                          r"\(cls.predictions.decoder\) is not a child module"),
])
def test_wrap_names_the_real_blocker(kind: str, exc: type, match: str) -> None:
    pytest.importorskip("transformers", minversion="4.51")
    with pytest.raises(exc, match=match):
        vt.wrap(_hf(kind), vattn.VattnConfig())


def test_wrap_refuses_what_is_not_a_model() -> None:
    with pytest.raises(TypeError, match="wrap: model: expected a transformers model"):
        vt.wrap("meta-llama/Llama-3.2-1B", vattn.VattnConfig())


def test_llama4_without_chunked_attention_matches_transformers() -> None:
    """Llama-4's text model names a base prefix it does not use; with full attention on every
    layer (no chunks) it wraps and gives transformers' own logits over two steps."""
    pytest.importorskip("transformers", minversion="4.51")
    torch.manual_seed(0)
    hf = _hf("llama4_full").eval()
    ids = torch.randint(3, 64, (12,))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=4))
    model = vt.wrap(hf, cfg)
    kv = vattn.allocate_kv_cache(cfg, num_blocks=4, device="cpu", dtype=torch.float32)
    got = []
    with torch.no_grad():
        for a, b in ((0, 7), (7, 12)):
            with vattn.set_forward_context(kv.build_metadata(kv.common_metadata([b - a], [a], [[0, 1, 2]])), cfg):
                got.append(model.compute_logits(model(ids[a:b], torch.arange(a, b))))
    torch.testing.assert_close(torch.cat(got), ref, atol=1e-5, rtol=0)

"""transformers' generate() on a wrapped model runs on vattn's paged cache (issue 56): the tokens
of transformers' own generate (greedy, left-padded batches, EOS, max_new_tokens) on every family,
sampling runs, the layers' own caches are bound again afterwards, and modes that reorder cache
rows are refused."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import vattn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.hf_model import FAMILIES, random_model, tiny_config  # noqa: E402
from vattn.integrations import transformers as vt  # noqa: E402


pytestmark = pytest.mark.usefixtures("hf_one_thread")


def _pair(family: str) -> tuple[torch.nn.Module, torch.nn.Module, vattn.VattnConfig]:
    torch.manual_seed(0)
    ref = random_model(tiny_config(family))
    hf = copy.deepcopy(ref)
    cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=16))
    vt.wrap(hf, cfg)
    return ref, hf, cfg


def _prompts(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Three left-padded prompts (7, 4 and 11 tokens), one longer than a block boundary after decoding."""
    g = torch.Generator().manual_seed(1)
    lens = [7, 4, 11]
    ids = torch.zeros(3, 11, dtype=torch.long)
    mask = torch.zeros(3, 11, dtype=torch.long)
    for r, n in enumerate(lens):
        ids[r, 11 - n:] = torch.randint(3, vocab, (n,), generator=g)
        mask[r, 11 - n:] = 1
    return ids, mask


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_generate_gives_transformers_tokens(family: str) -> None:
    ref, hf, _ = _pair(family)
    ids, mask = _prompts(ref.config.vocab_size)
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    want = ref.generate(ids, **kw)
    got = hf.generate(ids, **kw)
    assert torch.equal(got, want), (got[:, 11:].tolist(), want[:, 11:].tolist())


def test_eos_stops_rows_and_sampling_runs() -> None:
    ref, hf, _ = _pair("llama")
    ids, mask = _prompts(ref.config.vocab_size)
    first = ref.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    eos = int(first[1, -1])  # row 1's third token ends it there: later tokens of that row are padding
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=eos)
    want, got = ref.generate(ids, **kw), hf.generate(ids, **kw)
    assert torch.equal(got, want) and (got[1, 14:] == 0).all()
    torch.manual_seed(5)
    sampled = hf.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True, temperature=0.8, top_p=0.9,
                          pad_token_id=0)
    assert sampled.shape == (3, 17) and ((sampled >= 0) & (sampled < ref.config.vocab_size)).all()


def test_the_layers_own_cache_is_bound_again() -> None:
    """An engine's cache allocated before generate() is the layers' cache after it."""
    _, hf, cfg = _pair("qwen3")
    kv = vattn.allocate_kv_cache(cfg, num_blocks=8, dtype=torch.float32)
    layers = [m for m in hf.modules() if isinstance(m, vattn.Attention)]
    before = [layer.kv_cache[0] for layer in layers]
    hf.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert all(layer.kv_cache[0] is t for layer, t in zip(layers, before))
    assert kv.tensors[layers[0].layer_name] is before[0]


def test_modes_that_reorder_rows_are_refused() -> None:
    _, hf, _ = _pair("llama")
    ids = torch.tensor([[3, 4, 5]])
    with pytest.raises(NotImplementedError, match="num_beams=1"):
        hf.generate(ids, max_new_tokens=4, num_beams=2)
    with pytest.raises(ValueError, match="leave past_key_values unset"):
        hf.generate(ids, max_new_tokens=4, past_key_values=object())
    for kw in (dict(use_cache=False), dict(cache_implementation="static")):
        with pytest.raises(ValueError, match="leave use_cache and cache_implementation unset"):
            hf.generate(ids, max_new_tokens=4, **kw)
    with pytest.raises(ValueError, match=r"\(batch, prompt_len\) tensor"):
        hf.generate([3, 4, 5], max_new_tokens=4)

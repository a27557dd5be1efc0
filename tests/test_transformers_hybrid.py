"""transformers hybrids (Mamba, Gated DeltaNet, short-conv and lightning-attention mixers) on vattn
(``vattn.integrations.transformers.mixers``) match transformers itself.

For each family a tiny random config (float32, CPU) runs three prompts through
``examples.engine.Engine`` (chunked prefill under a token budget, a request joining while others
decode, two state slots for three requests: a slot is reused, its state reset by
``num_computed_tokens == 0``) and must give transformers' own greedy ``generate`` of each prompt
alone its tokens and, per step, its logits within float32 tolerance. The wrapped model's
``generate()`` on the three prompts left-padded into one batch gives the same tokens. Under
``vattn.compile`` (one graph, no recompile) for a few families by default, every family with
``-m slow``, and from a stored trace (``cache_dir``). Mixers the adapter does not serve are
refused by name.
"""

from __future__ import annotations

import copy
import functools
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import vattn  # noqa: E402
from examples.engine import Engine, Request, SamplingParams  # noqa: E402

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3NextConfig"):  # pragma: no cover - older transformers
    pytest.skip("the hybrid families need transformers >= 5", allow_module_level=True)

from examples.hf_model import random_model  # noqa: E402
from vattn.mixers import MambaBase  # noqa: E402
from vattn.integrations import transformers as vt  # noqa: E402
from engine_checks import assert_logits_match  # noqa: E402

pytestmark = pytest.mark.usefixtures("hf_one_thread")

_SMALL = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
_GDN = dict(num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
_SSD = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2)

#: family -> (transformers config class, overrides of ``_SMALL``), each a hybrid of its mixer and attention.
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    # Gated DeltaNet in 3 of 4 layers; gated attention (q_proj [query; gate]), partial RoPE, MoE with a shared expert.
    "qwen3_next": ("Qwen3NextConfig", dict(_GDN, **_MOE, shared_expert_intermediate_size=32)),
    "qwen3_5": ("Qwen3_5TextConfig", _GDN),  # q/k/v, z, b, a projected apart; mRoPE
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", dict(_GDN, **_MOE, shared_expert_intermediate_size=32)),
    "olmo_hybrid": ("OlmoHybridConfig", dict(_GDN, linear_allow_neg_eigval=True)),  # beta in [0, 2]
    # Mamba-2 mixers (two groups) beside attention; Nemotron-H clamps dt to (time_step_min, inf).
    "bamba": ("BambaConfig", dict(num_hidden_layers=2, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16,
                                  mamba_d_state=16, mamba_n_groups=2)),
    "granitemoehybrid": ("GraniteMoeHybridConfig", dict(num_hidden_layers=2, layer_types=["mamba", "attention"],
                                                        mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
                                                        num_local_experts=4, num_experts_per_tok=2,
                                                        shared_intermediate_size=64)),
    "nemotron_h": ("NemotronHConfig", dict(layers_block_type=["mamba", "attention", "mlp"], head_dim=16,
                                           ssm_state_size=16, mamba_num_heads=8, mamba_head_dim=16, n_groups=2)),
    "falcon_h1": ("FalconH1Config", dict(num_hidden_layers=2, head_dim=16, mamba_d_ssm=128, mamba_rms_norm=True,
                                         ssm_in_multiplier=0.5, key_multiplier=0.7, **_SSD)),
    "mamba2": ("Mamba2Config", dict(num_hidden_layers=2, num_heads=8, head_dim=16, state_size=16, n_groups=2)),
    # Mamba-1: Falcon-Mamba and Jamba normalise dt, B and C.
    "mamba": ("MambaConfig", dict(num_hidden_layers=2, state_size=8)),
    "falcon_mamba": ("FalconMambaConfig", dict(num_hidden_layers=2, state_size=8)),
    "jamba": ("JambaConfig", dict(num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                                  expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=8,
                                  use_mamba_kernels=False)),
    # LFM2's gated short convolutions; MiniMax's lightning attention (decay per head, MoE).
    "lfm2": ("Lfm2Config", dict(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"])),
    "lfm2_moe": ("Lfm2MoeConfig", dict(_MOE, num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"],
                                       num_dense_layers=1)),
    "minimax": ("MiniMaxConfig", dict(num_hidden_layers=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                      layer_types=["linear_attention", "full_attention"])),
}
COMPILED_BY_DEFAULT = ("mamba2", "falcon_mamba")  # and lfm2 from a stored trace; the rest under -m slow

# (prompt length, arrival step): the third prompt arrives at step 3 and waits for a state slot.
PROMPTS = ((7, 0), (29, 0), (23, 3))
MAX_TOKENS = 8
BUDGET = 16  # tokens per step: the long prompts are prefilled in chunks
SLOTS = 2  # state slots (engine rows): fewer than requests
WEIGHT_SEED, PROMPT_SEED = 1, 101
ATOL = 1e-4  # float32 logits
STD = 0.2  # weights ~ N(0, STD): logits of order 1, few near-ties


def hf_model(family: str, std: float | None = None, **kwargs: Any) -> Any:
    cls, overrides = FAMILIES[family]
    if not hasattr(transformers, cls):
        pytest.skip(f"transformers {transformers.__version__} has no {cls}")
    config = getattr(transformers, cls)(**{**_SMALL, **overrides})
    model = random_model(config, seed=WEIGHT_SEED, std=STD if std is None else std, **kwargs)
    if callable(getattr(model, "set_experts_implementation", None)):
        model.set_experts_implementation("batched_mm")  # no loop over the experts a batch hits: compiles
    return model


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(PROMPT_SEED)
    return [torch.randint(3, 320, (n,), generator=g).tolist() for n, _ in PROMPTS]


def greedy_config(model: Any) -> Any:
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = []  # the engine stops by count (None would mean "the model's EOS")
    config.update(max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
    return config


@functools.lru_cache(maxsize=None)
def reference(family: str) -> tuple[list[list[int]], list[torch.Tensor]]:
    """transformers' greedy ``generate`` of each prompt alone: (tokens, (MAX_TOKENS, V) logits)."""
    hf = hf_model(family)
    tokens, logits = [], []
    for p in prompts():
        ids = torch.tensor([p])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=greedy_config(hf),
                          output_logits=True, return_dict_in_generate=True)
        tokens.append(out.sequences[0, len(p):].tolist())
        logits.append(torch.cat(out.logits).float())
    return tokens, logits


def wrapped(family: str, compilation: vattn.CompilationConfig | None = None
            ) -> tuple[vt.VattnCausalLM, vattn.VattnConfig, vattn.PagedKVCache]:
    cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=8), compilation=compilation or vattn.CompilationConfig())
    model = vt.wrap(hf_model(family), cfg)
    return model, cfg, vattn.allocate_kv_cache(cfg, num_blocks=32, dtype=torch.float32, num_state_slots=SLOTS)


def run_engine(engine: Engine) -> list[Request]:
    reqs = [engine.add_request(p, SamplingParams(max_tokens=MAX_TOKENS), arrival_step=a + engine.step_count)
            for p, (_, a) in zip(prompts(), PROMPTS)]
    engine.run()
    return reqs


def assert_matches_reference(family: str, engine: Engine, reqs: list[Request]) -> None:
    assert_logits_match(engine, reqs, *reference(family), atol=ATOL, what=family)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_engine_matches_transformers(family: str) -> None:
    model, cfg, kv = wrapped(family)
    assert model.mixer_specs and all(isinstance(m, MambaBase) for m in model.mixer_layers().values())
    engine = Engine(model, cfg, kv, device="cpu", max_num_batched_tokens=BUDGET, max_num_seqs=SLOTS,
                    record_logits=True, check_invariants=True)
    assert_matches_reference(family, engine, run_engine(engine))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_generate_matches_transformers(family: str) -> None:
    """The wrapped model's ``generate()`` on a left-padded batch: each row gives the tokens of its
    prompt alone (padding never reaches a state: the real tokens are gathered)."""
    cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=16))
    hf = hf_model(family)
    vt.wrap(hf, cfg)
    ps = prompts()
    width = max(map(len, ps))
    ids = torch.zeros(len(ps), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(ps):
        ids[r, width - len(p):], mask[r, width - len(p):] = torch.tensor(p), 1
    got = hf.generate(ids, attention_mask=mask, generation_config=greedy_config(hf))
    assert got[:, width:].tolist() == reference(family)[0]


def _compiled(family: str) -> None:
    from torch._dynamo.utils import counters

    model, cfg, kv = wrapped(family, vattn.CompilationConfig(fuse_rope=True))
    torch._dynamo.reset()
    counters.clear()
    compiled = vattn.compile(model, cfg)
    warm = Engine(model, cfg, kv, device="cpu", max_num_batched_tokens=BUDGET, max_num_seqs=SLOTS, forward_fn=compiled)
    warm.add_request(list(range(3, 11)), SamplingParams(max_tokens=2))  # warm-up: one prefill, one decode
    warm.run()
    engine = Engine(model, cfg, kv, device="cpu", max_num_batched_tokens=BUDGET, max_num_seqs=SLOTS,
                    forward_fn=compiled, record_logits=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        reqs = run_engine(engine)
    assert compiled.backend.counter.num_graphs_seen == 1 and counters["stats"]["unique_graphs"] == 1
    assert_matches_reference(family, engine, reqs)


@pytest.mark.parametrize("family", COMPILED_BY_DEFAULT)
def test_compiled_matches_transformers(family: str) -> None:
    """``vattn.compile``: the mixer layers are opaque ops between compiled pieces; one graph for every
    batch composition and token count."""
    _compiled(family)


_MROPE = pytest.mark.xfail(strict=True, reason="transformers' Qwen3.5 mRoPE guards the token count >= 2 (dense "
                                              "Qwen3.5 too): one recompile for 1-token steps")


@pytest.mark.slow
@pytest.mark.parametrize("family", [pytest.param(f, marks=_MROPE) if f.startswith("qwen3_5") else f
                                    for f in sorted(set(FAMILIES) - set(COMPILED_BY_DEFAULT))])
def test_compiled_matches_transformers_all(family: str) -> None:
    _compiled(family)


@pytest.mark.parametrize("family", ["lfm2"])
def test_compiled_warm_start_from_cache_dir(family: str, tmp_path: Path) -> None:
    """``CompilationConfig.cache_dir``: the stored trace names the served mixer classes by their
    own names (``mixers.py``), so the compile of a fresh wrap loads it and gives the same tokens."""
    from vattn.compile_passes import aot_cache

    if aot_cache.aot_supported() is not None:
        pytest.skip(f"{aot_cache.aot_supported()}: cache_dir is ignored on this torch")
    for loaded in (False, True):
        torch._dynamo.reset()
        model, cfg, kv = wrapped(family, vattn.CompilationConfig(cache_dir=str(tmp_path)))
        compiled = vattn.compile(model, cfg)
        engine = Engine(model, cfg, kv, device="cpu", max_num_batched_tokens=BUDGET, max_num_seqs=SLOTS,
                        forward_fn=compiled, record_logits=True)
        assert_matches_reference(family, engine, run_engine(engine))
        assert compiled.trace_loaded == loaded


def test_layers_names_and_state_dict() -> None:
    """Each mixer module gets its layer at ``<path>.mixer``; the state dict is transformers'."""
    ref = hf_model("qwen3_next")
    model, _, kv = wrapped("qwen3_next")
    assert list(model.mixer_layers()) == [f"model.layers.{i}.linear_attn.mixer" for i in range(3)]
    assert [s.kind for s in model.mixer_specs] == ["gdn"] * 3 and list(model.attention_layers()) == [
        "model.layers.3.self_attn.attn"]
    assert model.hf_model.state_dict().keys() == ref.state_dict().keys()
    assert isinstance(model.hf_model.model.layers[0].linear_attn, type(ref.model.layers[0].linear_attn))
    assert kv.num_state_slots == SLOTS and len(kv.states) == 3


def test_direct_calls_are_refused() -> None:
    """A plain forward of the wrapped transformers model has no step metadata, and transformers'
    own cache cannot hold vattn's states: both are refused, saying what to do instead."""
    model, _, _ = wrapped("mamba")
    ids = torch.tensor([[3, 4, 5]])
    with pytest.raises(NotImplementedError, match="transformers' own cache"):
        model.hf_model(ids)  # use_cache=True: a DynamicCache
    with pytest.raises(RuntimeError, match="vattn.set_forward_context"):
        model.hf_model(ids, use_cache=False)


def test_unserved_mixers_are_refused() -> None:
    """A mixer whose recurrence was not checked (Zamba-2's), or a conv activation other than silu."""
    zamba = random_model(transformers.Zamba2Config(**{**_SMALL, "num_hidden_layers": 2, "mamba_d_state": 8,
                                                      "layers_block_type": ["mamba", "mamba"], "n_mamba_heads": 4}))
    cfg = vattn.VattnConfig()
    with pytest.raises(vt.UnsupportedAttentionError, match=r"model.layers.0.mamba \(Zamba2MambaMixer\): a stateful"):
        vt.wrap(zamba, cfg)
    bamba = random_model(transformers.BambaConfig(**{**_SMALL, **FAMILIES["bamba"][1], "hidden_act": "gelu"}))
    with pytest.raises(vt.UnsupportedAttentionError, match="conv activation 'gelu'"):
        vt.wrap(bamba, cfg)
    assert not cfg.compilation.static_forward_context  # nothing registered


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["qwen3_5", "bamba", "falcon_mamba", "lfm2", "minimax"])
def test_bf16_cudagraphs_match_eager_and_transformers_cuda(family: str) -> None:
    """bf16 on the GPU (the Triton state kernels): the eager engine gives transformers' float32
    ``generate`` tokens up to bf16 near-ties (transformers' own bf16 drifts further on these random
    hybrids), and ``vattn.compile`` + ``CUDAGraphRunner(FULL_AND_PIECEWISE)`` (padded requests on the
    scratch state slot) gives the eager run's. Weights ~ N(0, 0.05): bf16 rounding stays small."""
    from tests.test_transformers_integration import near_tie_or_equal

    ref = hf_model(family, std=0.05, device="cuda")
    ref_tokens, ref_logits = [], []
    for p in prompts():
        ids = torch.tensor([p], device="cuda")
        out = ref.generate(ids, attention_mask=torch.ones_like(ids), generation_config=greedy_config(ref),
                           output_logits=True, return_dict_in_generate=True)
        ref_tokens.append(out.sequences[0, len(p):].tolist())
        ref_logits.append(torch.cat(out.logits).float().cpu())
    cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=16))
    model = vt.wrap(hf_model(family, std=0.05, dtype=torch.bfloat16, device="cuda"), cfg)
    kv = vattn.allocate_kv_cache(cfg, num_blocks=64, device="cuda", dtype=torch.bfloat16, num_state_slots=8)
    eager = Engine(model, cfg, kv, device="cuda", max_num_batched_tokens=BUDGET, max_num_seqs=8, record_logits=True)
    eager_reqs = run_engine(eager)
    for r, tokens, want in zip(eager_reqs, ref_tokens, ref_logits):
        near_tie_or_equal(torch.stack(eager.logits[r.req_id]).float().cpu(), want, r.output_token_ids, tokens,
                          f"{family} eager vs transformers, request {r.req_id}")
    compiled = vattn.compile(model, cfg)
    runner = vattn.CUDAGraphRunner(compiled, cfg, kv, max_batch_size=8, max_model_len=128,
                                   mode=vattn.CUDAGraphMode.FULL_AND_PIECEWISE, show_progress=False)
    graphs = Engine(model, cfg, kv, device="cuda", max_num_batched_tokens=BUDGET, max_num_seqs=8, graph_runner=runner,
                    record_logits=True)
    reqs = run_engine(graphs)
    assert compiled.backend.counter.num_graphs_seen == 1
    for a, b in zip(eager_reqs, reqs):
        near_tie_or_equal(torch.stack(graphs.logits[b.req_id]).float().cpu(),
                          torch.stack(eager.logits[a.req_id]).float().cpu(), b.output_token_ids, a.output_token_ids,
                          f"{family} graphs vs eager, request {b.req_id}")

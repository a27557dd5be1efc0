"""transformers models on vattn (``vattn.integrations.transformers``) match transformers itself.

For each family of ``examples/hf_model.py`` (Llama, Mistral, Qwen2, Qwen3, Gemma-2, Gemma-3,
Phi-3, OLMo-2, gpt-oss: each a tiny random config that exercises its attention features) three
prompts of different lengths run through ``examples.engine.Engine`` (continuous batching, chunked
prefill under a token budget, the third request joining while the others decode, a paged KV cache)
and must give transformers' own ``generate`` (greedy, eager attention) its tokens and, per step,
its logits within float32 tolerance; then the same under ``vattn.compile`` with no recompile after
warm-up (a prefill and a 1-token decode). The ``cuda`` tests do the same in bf16 with CUDA graphs.
"""

from __future__ import annotations

import copy
import functools
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import vattn  # noqa: E402
from examples.engine import Engine, Request, SamplingParams  # noqa: E402

transformers = pytest.importorskip("transformers")

from examples.hf_model import FAMILIES, random_model, save_random_checkpoint, tiny_config  # noqa: E402
from vattn.integrations import transformers as vt  # noqa: E402
from engine_checks import assert_logits_match, run_with_graphs  # noqa: E402


pytestmark = pytest.mark.usefixtures("hf_one_thread")


# (prompt length, arrival step): the third prompt joins at step 3, while the others decode.
PROMPTS = ((7, 0), (29, 0), (41, 3))
MAX_TOKENS = 10  # the prefill's token + 9 decode steps
BUDGET = 16  # tokens per step: the long prompts are prefilled in chunks
BLOCK = 8
WEIGHT_SEED, PROMPT_SEED = 1, 101
ATOL = 1e-4  # float32 logits (observed differences are about 1e-6)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(PROMPT_SEED)
    return [torch.randint(3, 320, (n,), generator=g).tolist() for n, _ in PROMPTS]


def hf_model(family: str, **kwargs: Any) -> Any:
    return random_model(tiny_config(family), seed=WEIGHT_SEED, **kwargs)


@functools.lru_cache(maxsize=None)
def reference(family: str) -> tuple[list[list[int]], list[torch.Tensor]]:
    """transformers' greedy ``generate`` for each prompt alone: (tokens, (MAX_TOKENS, V) float32 logits)."""
    hf = hf_model(family)
    tokens, logits = [], []
    for p in prompts():
        t, lg = hf_greedy(hf, p)
        tokens.append(t)
        logits.append(lg)
    return tokens, logits


def hf_greedy(hf: Any, prompt: list[int], device: str = "cpu") -> tuple[list[int], torch.Tensor]:
    """transformers' greedy ``generate`` of ``MAX_TOKENS`` tokens for one prompt: (tokens, (MAX_TOKENS, V)
    float32 logits on the CPU). End of sequence is switched off, as the engine (which stops by count)
    has none: with ``min_new_tokens`` instead, transformers would mask the EOS logit that the raw
    logits it returns still show, and pick another token wherever EOS is the argmax."""
    config = copy.deepcopy(hf.generation_config)
    config.eos_token_id = None
    ids = torch.tensor([prompt], device=device)
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                      max_new_tokens=MAX_TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float().cpu()


def wrapped(family: str, compilation: vattn.CompilationConfig | None = None,
            **kwargs: Any) -> tuple[vt.VattnCausalLM, vattn.VattnConfig, vattn.PagedKVCache]:
    cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=BLOCK),
                            compilation=compilation or vattn.CompilationConfig())
    model = vt.wrap(hf_model(family), cfg, **kwargs)
    return model, cfg, vattn.allocate_kv_cache(cfg, num_blocks=32, device="cpu", dtype=torch.float32)


def run_engine(engine: Engine, step_offset: int = 0) -> tuple[list[Request], list[Any]]:
    reqs = [engine.add_request(p, SamplingParams(max_tokens=MAX_TOKENS), arrival_step=a + step_offset)
            for p, (_, a) in zip(prompts(), PROMPTS)]
    return reqs, engine.run()


def assert_matches_reference(family: str, engine: Engine, reqs: list[Request]) -> None:
    assert_logits_match(engine, reqs, *reference(family), atol=ATOL, what=family)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_matches_transformers_generate(family: str) -> None:
    model, cfg, kv = wrapped(family)
    engine = Engine(model, cfg, kv, device="cpu", max_num_batched_tokens=BUDGET, record_logits=True,
                    check_invariants=True)
    reqs, stats = run_engine(engine)
    assert any(s.num_decode_tokens and s.num_prefill_tokens for s in stats), "a step must mix decodes and prefill"
    assert max(s.num_prefill_tokens + s.num_decode_tokens for s in stats) == BUDGET  # chunked prefill
    assert_matches_reference(family, engine, reqs)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_compiled_matches_transformers_no_recompiles(family: str) -> None:
    """``vattn.compile`` (Inductor): one graph for every batch composition and token count, 1 included.
    With ``fuse_rope=True`` the attention op gets the unrotated q / k and the cos / sin rows
    (TORCH_SDPA rotates them in the op): the same tokens and logits."""
    from torch._dynamo.utils import counters

    model, cfg, kv = wrapped(family, vattn.CompilationConfig(fuse_rope=True))
    if getattr(model.config, "num_local_experts", None) and not hasattr(model.hf_model, "set_experts_implementation"):
        pytest.skip(f"transformers {transformers.__version__} runs {family}'s experts as a loop over the experts "
                    "a batch hits (data-dependent): no fullgraph compile; transformers >= 5 has batched experts")
    torch._dynamo.reset()
    counters.clear()
    compiled = vattn.compile(model, cfg)
    warm = Engine(model, cfg, kv, device="cpu", max_num_batched_tokens=BUDGET, forward_fn=compiled)
    warm.add_request(list(range(3, 11)), SamplingParams(max_tokens=2))  # warm-up: one prefill, one decode
    warm.run()
    assert compiled.backend.counter.num_graphs_seen == 1
    engine = Engine(model, cfg, kv, device="cpu", max_num_batched_tokens=BUDGET, forward_fn=compiled,
                    record_logits=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        reqs, stats = run_engine(engine, step_offset=engine.step_count)
    assert compiled.backend.counter.num_graphs_seen == 1 and counters["stats"]["unique_graphs"] == 1
    assert len({s.num_prefill_tokens + s.num_decode_tokens for s in stats}) > 3  # many different T
    assert_matches_reference(family, engine, reqs)
    # wrap packed the bias-free q/k/v and gate/up weights; compiled, each packed group is one GEMM
    assert (compiled.backend.counter.num_packed_linear_groups > 0) == (packed_groups(model.hf_model) > 0)
    assert compiled.backend.counter.num_rope_fusions == len(model.attention_layers())  # every family's RoPE form


@pytest.mark.parametrize("fuse_rope", [None, False])
def test_fuse_rope_off_for_backends_that_rotate_in_the_op(fuse_rope: bool | None) -> None:
    """``fuse_rope=None`` (default) rewrites only layers whose backend rotates in its kernels
    (TORCH_SDPA does not), ``False`` none: transformers' RoPE stays in the compiled pieces."""
    model, cfg, kv = wrapped("llama", vattn.CompilationConfig(fuse_rope=fuse_rope))
    compiled = vattn.compile(model, cfg)
    engine = Engine(model, cfg, kv, device="cpu", max_num_batched_tokens=BUDGET, forward_fn=compiled)
    engine.add_request(list(range(3, 11)), SamplingParams(max_tokens=2))
    engine.run()
    assert compiled.backend.counter.num_graphs_seen == 1 and compiled.backend.counter.num_rope_fusions == 0
    with pytest.raises(TypeError, match="fuse_rope must be None"):
        vattn.CompilationConfig(fuse_rope="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_compiled_warm_start_from_cache_dir(family: str, tmp_path: Path) -> None:
    """``CompilationConfig.cache_dir``: the first compile stores Dynamo's trace (transformers'
    forward decorators add guards on code objects that no file can hold: the trace leaves them
    out), the compile of a fresh wrap loads it, and both give transformers' tokens and logits.
    The stored trace has the RoPE rewrite (``fuse_rope``) in it."""
    from vattn.compile_passes import aot_cache

    if aot_cache.aot_supported() is not None:
        pytest.skip(f"{aot_cache.aot_supported()}: cache_dir is ignored on this torch")
    runs = []
    for _ in range(2):
        model, cfg, kv = wrapped(family, vattn.CompilationConfig(cache_dir=str(tmp_path), fuse_rope=True))
        compiled = vattn.compile(model, cfg)
        engine = Engine(model, cfg, kv, device="cpu", max_num_batched_tokens=BUDGET, forward_fn=compiled,
                        record_logits=True)
        reqs, _ = run_engine(engine)
        assert_matches_reference(family, engine, reqs)
        runs.append(compiled)
    first, second = runs
    assert not first.trace_loaded and second.trace_loaded and second.trace_path == first.trace_path
    assert first.backend.counter.num_rope_fusions == len(model.attention_layers())
    assert [Path(first.trace_path)] == sorted(tmp_path.glob("*.dynamo"))


_WARM_START_SCRIPT = """
import sys, torch, vattn
sys.path.insert(0, {root!r})
from examples.engine import Engine, SamplingParams
from examples.hf_model import random_model, tiny_config
from vattn.integrations import transformers as vt
torch.manual_seed(0)
cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=16), compilation=vattn.CompilationConfig(cache_dir={cache!r}))
model = vt.wrap(random_model(tiny_config({family!r})), cfg)
kv = vattn.allocate_kv_cache(cfg, num_blocks=32, dtype=torch.float32)
compiled = vattn.compile(model, cfg)
engine = Engine(model, cfg, kv, device="cpu", forward_fn=compiled)
for p in ([3, 4, 5, 6, 7], [9, 10]):
    engine.add_request(p, SamplingParams(max_tokens=4))
engine.run()
print("RESULT", compiled.trace_loaded, compiled.backend.counter.num_graphs_seen)
"""


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_warm_start_in_a_new_process_traces_nothing(family: str, tmp_path: Path) -> None:
    """The stored trace of a wrapped model holds in a later process: its guards on the RMSNorm
    modules (whose class ``wrap`` swaps at run time) name that class, found again by name, so the
    loaded trace serves every call, with no second trace and no warning about one."""
    from vattn.compile_passes import aot_cache

    if aot_cache.aot_supported() is not None:
        pytest.skip(f"{aot_cache.aot_supported()}: cache_dir is ignored on this torch")
    script = _WARM_START_SCRIPT.format(root=str(ROOT), cache=str(tmp_path), family=family)
    results = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        results.append((r.stdout.split("RESULT")[-1].split(), r.stderr))
    (first, _), (second, err) = results
    assert first == ["False", "1"] and second == ["True", "1"], results
    assert "a second time" not in err and "fails the guards" not in err


def test_wrap_packs_projections_in_place_unless_told_not_to() -> None:
    """The packed parameters are the model's own Parameter objects (an optimizer or a weight-sync
    map taken before ``wrap`` still reaches them); ``pack_projections=False`` leaves them alone."""
    model = hf_model("llama")
    params = dict(model.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=BLOCK))
    wrapped_model = vt.wrap(model, cfg)
    assert packed_groups(model) == 2 * model.config.num_hidden_layers
    assert all(p is params[n] and torch.equal(p, before[n]) for n, p in model.named_parameters())
    from vattn.compile_passes.packed_linears import PackedLinear  # eager inference runs each group as one GEMM

    attn = model.model.layers[0].self_attn
    assert all(type(getattr(attn, n)) is PackedLinear for n in ("q_proj", "k_proj", "v_proj"))
    assert wrapped_model.hf_model is model
    plain, _, _ = wrapped("llama", pack_projections=False)
    assert packed_groups(plain.hf_model) == 0


# Per family: the RMSNorm form of its modules (norms.py's table) and RMSNorms per decoder layer.
NORM_FORMS = {"llama": ("llama", 2), "mistral": ("llama", 2), "qwen2": ("llama", 2), "qwen3": ("llama", 4),
              "phi3": ("llama", 2), "olmo2": ("weight_first", 4), "gpt_oss": ("weight_first", 2),
              "gemma2": ("gemma", 4), "gemma3": ("gemma", 6)}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_wrap_fuses_rms_norms_with_the_same_arithmetic(family: str) -> None:
    """Every RMSNorm of the family is recognized and, in eager inference, gives transformers'
    output bit for bit (float32 and bf16 on the CPU, where ``F.rms_norm`` runs the same ops);
    with autograd on it runs transformers' own forward; pickled, it is the transformers class;
    ``fuse_norms=False`` leaves the modules alone."""
    import io

    from vattn.integrations.transformers.norms import norm_form

    form, per_layer = NORM_FORMS[family]
    model = hf_model(family)
    norms = {n: m for n, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")}
    assert norms and {norm_form(m) for m in norms.values()} == {form}
    assert len(norms) == per_layer * model.config.num_hidden_layers + 1
    classes = {n: type(m) for n, m in norms.items()}
    g = torch.Generator().manual_seed(3)
    for m in norms.values():
        m.weight.data.normal_(generator=g)
    inputs = {n: torch.randn(5, m.weight.shape[0], generator=g) for n, m in norms.items()}
    expect = {(n, dt): m(inputs[n].to(dt)) for n, m in norms.items() for dt in (torch.float32, torch.bfloat16)}
    vt.wrap(model, vattn.VattnConfig(cache=vattn.CacheConfig(block_size=BLOCK)))
    for n, m in norms.items():
        assert type(m) is not classes[n] and isinstance(m, classes[n]) and type(m).forward is not classes[n].forward
        for dt in (torch.float32, torch.bfloat16):
            with torch.no_grad():
                assert torch.equal(m(inputs[n].to(dt)), expect[(n, dt)]), (n, dt)
            assert torch.equal(m(inputs[n].to(dt)), expect[(n, dt)])  # autograd on: transformers' forward
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert all(type(m) is classes[n] for n, m in loaded.named_modules() if n in classes)
    plain, _, _ = wrapped(family, fuse_norms=False)
    assert all(type(m) is classes[n] for n, m in plain.hf_model.named_modules() if n in classes)


def test_rms_norms_of_another_form_are_left_alone() -> None:
    """A norm whose forward is not one of transformers' forms keeps its class."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from vattn.integrations.transformers.norms import fuse_rms_norms, norm_form

    class ScaledRMSNorm(LlamaRMSNorm):
        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(hidden_states)

    odd, plain = ScaledRMSNorm(8), LlamaRMSNorm(8)
    assert norm_form(odd) is None and norm_form(plain) == "llama"
    assert fuse_rms_norms(torch.nn.ModuleList([odd, plain])) == 1 and type(odd) is ScaledRMSNorm
    assert fuse_rms_norms(plain) == 0  # fused already
    x = torch.randn(3, 8, dtype=torch.float64)  # transformers computes in float32: the fused one too
    with torch.no_grad():
        assert torch.equal(plain(x), LlamaRMSNorm.forward(plain, x))


def packed_groups(model: torch.nn.Module) -> int:
    """Groups of q/k/v or gate/up projections whose weights share one packed buffer."""
    from vattn.compile_passes.packed_linears import packed_rows

    groups = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
    return sum(all(hasattr(m, n) for n in names) and packed_rows([getattr(m, n).weight for n in names])
               for m in model.modules() for names in groups)


# ---- what the adapter builds -------------------------------------------------------------------------


def test_layers_follow_the_models_config() -> None:
    """Layer names from the module paths; per-layer scale, window, soft cap and sinks from the model."""
    model, cfg, _ = wrapped("gemma3")
    names = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
    assert list(cfg.attention_layers()) == names == list(model.attention_layers())
    assert [s.sliding_window for s in model.layer_specs] == [16, None, 16]  # layer_types
    assert {s.scale for s in model.layer_specs} == {24**-0.5}  # query_pre_attn_scalar, not head_dim
    assert model.hf_model.config._attn_implementation == vt.ATTN_IMPLEMENTATION

    model, _, _ = wrapped("gemma2")
    assert [(s.sliding_window, s.logits_soft_cap) for s in model.layer_specs] == [(16, 0.5), (None, 0.5)]
    model, _, _ = wrapped("gpt_oss")
    attn = model.hf_model.model.layers[0].self_attn
    assert model.layer_specs[0].sinks is attn.sinks and attn.attn.has_sink
    model, _, _ = wrapped("mistral")
    assert {s.sliding_window for s in model.layer_specs} == {16}  # config.sliding_window, every layer
    model, _, _ = wrapped("qwen3")
    assert {(s.num_heads, s.num_kv_heads, s.head_size) for s in model.layer_specs} == {(4, 1, 32)}


def test_no_attention_mask_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers builds no mask for "vattn" (no mask function registered): every attention call gets None."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    assert vt.ATTN_IMPLEMENTATION not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    masks: list[Any] = []

    def recording(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
        masks.append(attention_mask)
        return vt.vattn_attention_forward(module, query, key, value, attention_mask, **kwargs)

    for family in ("llama", "gemma2", "gpt_oss"):  # one mask kind, sliding and full masks
        model, cfg, kv = wrapped(family)  # (wrap registers the implementation again: record after it)
        monkeypatch.setitem(transformers.AttentionInterface._global_mapping, vt.ATTN_IMPLEMENTATION, recording)
        engine = Engine(model, cfg, kv, device="cpu", max_num_batched_tokens=BUDGET)
        run_engine(engine)
    assert masks and all(m is None for m in masks)


def test_compute_logits_applies_the_final_soft_cap() -> None:
    model, _, _ = wrapped("gemma2")
    hidden = torch.randn(3, 64) * 10
    raw = model.hf_model.lm_head(hidden)
    torch.testing.assert_close(model.compute_logits(hidden), 2.0 * torch.tanh(raw / 2.0))


def test_from_pretrained_saved_checkpoint(tmp_path: Path) -> None:
    """A checkpoint saved with ``save_pretrained`` loads onto vattn and gives the original's logits."""
    path = save_random_checkpoint(tmp_path / "ckpt", "qwen2", seed=WEIGHT_SEED)
    cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=BLOCK))
    model = vt.from_pretrained(path, cfg, dtype=torch.float32, device="cpu")
    kv = vattn.allocate_kv_cache(cfg, num_blocks=8, device="cpu", dtype=torch.float32)
    ids = torch.tensor(prompts()[1])
    common = kv.common_metadata(query_lens=[len(ids)], num_computed_tokens=[0], block_tables=[[0, 1, 2, 3]])
    with torch.no_grad(), vattn.set_forward_context(kv.build_metadata(common), cfg):
        got = model.compute_logits(model(ids, torch.arange(len(ids))))
    with torch.no_grad():
        ref = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")(ids[None]).logits[0]
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


def test_two_models_in_one_config_with_a_prefix() -> None:
    """A second model (a draft, say) shares the config and cache under its own layer names; without
    a prefix its names collide and nothing of the failed wrap stays registered."""
    cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=BLOCK))
    target = vt.wrap(hf_model("llama"), cfg)
    with pytest.raises(ValueError, match="Duplicate layer name"):
        vt.wrap(hf_model("llama"), cfg)
    assert len(cfg.attention_layers()) == 2
    draft = vt.wrap(hf_model("llama"), cfg, prefix="draft.")
    assert list(draft.attention_layers()) == ["draft.model.layers.0.self_attn.attn", "draft.model.layers.1.self_attn.attn"]
    kv = vattn.allocate_kv_cache(cfg, num_blocks=8, device="cpu", dtype=torch.float32)
    assert len(kv.tensors) == 4
    ids = torch.tensor(prompts()[0])
    common = kv.common_metadata(query_lens=[len(ids)], num_computed_tokens=[0], block_tables=[[0]])
    with torch.no_grad(), vattn.set_forward_context(kv.build_metadata(common), cfg):
        a, b = target(ids, torch.arange(len(ids))), draft(ids, torch.arange(len(ids)))
    torch.testing.assert_close(a, b)  # the same weights, each model with its own cache


# ---- what it refuses ---------------------------------------------------------------------------------


def _deepseek_mla() -> Any:
    cfg = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2,
        first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=8, n_group=1, topk_group=1)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _bart() -> Any:
    return transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64))


def _llama_with(change: str) -> Any:
    model = hf_model("llama")
    if change == "non-causal":
        model.model.layers[1].self_attn.is_causal = False
    elif change == "layer type":
        model.config.layer_types = ["full_attention", "chunked_attention"]
    elif change == "eager-only":
        class EagerOnlyAttention(torch.nn.Module):  # computes its attention itself, not through the interface
            head_dim = 16

            def forward(self, hidden_states: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, None]:
                return hidden_states, None

        model.model.layers[1].self_attn = EagerOnlyAttention()
    return model


@pytest.mark.parametrize("build, path, reason", [
    (_deepseek_mla, "model.layers.0.self_attn", "multi-head latent attention"),
    (_bart, "model.encoder.layers.0.self_attn", "encoder-decoder"),
    (lambda: _llama_with("non-causal"), "model.layers.1.self_attn", "non-causal"),
    (lambda: _llama_with("layer type"), "model.layers.1.self_attn", "'chunked_attention'"),
    (lambda: _llama_with("eager-only"), "model.layers.1.self_attn", "AttentionInterface"),
], ids=["mla", "cross-attention", "non-causal", "layer-type", "no-interface"])
def test_unsupported_attention_names_module_and_reason(build: Any, path: str, reason: str) -> None:
    model = build()
    impl = model.config._attn_implementation
    cfg = vattn.VattnConfig()
    with pytest.raises(vt.UnsupportedAttentionError, match=reason) as info:
        vt.wrap(model, cfg)
    assert str(info.value).startswith(path + " (")
    assert isinstance(info.value, NotImplementedError)
    # Refused before anything changed: no layer built, no attribute added, attention implementation kept.
    assert not cfg.attention_layers() and model.config._attn_implementation == impl
    assert not any(isinstance(m, vattn.Attention) for m in model.modules())


def test_wrap_rejects_bad_arguments() -> None:
    model, cfg, _ = wrapped("llama")
    with pytest.raises(ValueError, match="already has vattn layers"):
        vt.wrap(model.hf_model, vattn.VattnConfig())
    with pytest.raises(TypeError, match="causal LM"):
        vt.wrap(hf_model("llama").model, vattn.VattnConfig())  # the base model: no LM head
    with pytest.raises(TypeError, match="VattnConfig"):
        vt.wrap(hf_model("llama"), None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one flattened step"):  # transformers' own batched call
        model.hf_model(torch.zeros(2, 3, dtype=torch.long))


# ---- other backends: TRITON_ATTN through the Triton interpreter ---------------------------------------


_TRITON_SCRIPT = """
import sys, copy, torch
sys.path.insert(0, {root!r})
import transformers, vattn
from vattn.integrations import transformers as vt
from examples.engine import Engine, SamplingParams
from examples.hf_model import tiny_config, random_model
transformers.logging.set_verbosity_error()
runs = (("gemma2", False), ("gemma3", False), ("gpt_oss", False), ("gemma3", True), ("gpt_oss", True))
for family, compiled in runs:
    hf = random_model(tiny_config(family), seed=1)
    ref = copy.deepcopy(hf)
    cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=16))
    model = vt.wrap(hf, cfg, attn_backend="TRITON_ATTN")
    kv = vattn.allocate_kv_cache(cfg, num_blocks=8, device="cpu", dtype=torch.float32)
    forward = vattn.compile(model, cfg) if compiled else None  # RoPE rotated in the Triton kernels
    engine = Engine(model, cfg, kv, device="cpu", max_num_batched_tokens=16, record_logits=True, forward_fn=forward)
    g = torch.Generator().manual_seed(7)
    reqs = [engine.add_request(torch.randint(3, 320, (n,), generator=g).tolist(), SamplingParams(max_tokens=4))
            for n in (5, 29)]
    engine.run()
    for r in reqs:
        seq = torch.tensor(r.prompt_token_ids + r.output_token_ids[:-1])[None]
        with torch.no_grad():
            want = ref(seq).logits[0, len(r.prompt_token_ids) - 1:]
        err = (torch.stack(engine.logits[r.req_id]) - want).abs().max().item()
        assert err < 1e-4, (family, err)
    if compiled:
        assert forward.backend.counter.num_rope_fusions == len(model.attention_layers())
print("ok")
"""


def test_triton_attn_backend_in_the_interpreter() -> None:
    """TRITON_ATTN on transformers' strided q/k/v (soft cap, sliding windows, sinks), eager and
    compiled (RoPE handed to the kernels), in the Triton interpreter (a process of its own:
    ``TRITON_INTERPRET`` is read when the kernels are defined)."""
    pytest.importorskip("triton")
    import os

    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    script = textwrap.dedent(_TRITON_SCRIPT).format(root=str(ROOT))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


# ---- GPU: bf16 with CUDA graphs ----------------------------------------------------------------------

GPU_SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 vocab_size=512)


def near_tie_or_equal(got: torch.Tensor, ref: torch.Tensor, got_tokens: list[int], ref_tokens: list[int],
                      what: str, rel: float = 0.05) -> None:
    """The bf16 policy. Up to the first token that differs, the logits are within ``rel`` of the
    reference's largest logit (max difference; the mean difference within a fifth of that), and
    that token must be a near-tie of ``ref`` (top-2 gap under twice the bound, which a rounding
    difference can flip); after it the sequences differ and are not compared."""
    n = next((i for i, (a, b) in enumerate(zip(got_tokens, ref_tokens)) if a != b), len(ref_tokens))
    rows = min(n + 1, got.shape[0], ref.shape[0])
    bound = rel * float(ref[:rows].abs().max())
    diff = (got[:rows] - ref[:rows]).abs()
    assert diff.max() < bound and diff.mean() < bound / 5, (
        f"{what}: max {diff.max():.4f}, mean {diff.mean():.4f}, bound {bound:.4f}")
    if n < min(len(got_tokens), len(ref_tokens)):
        top2 = ref[n].topk(2).values
        assert float(top2[0] - top2[1]) < 2 * bound, f"{what}: tokens diverge at step {n} without a near-tie"


@pytest.mark.cuda
@pytest.mark.parametrize("family, gemv", [("llama", False), ("qwen3", False), ("gemma3", False), ("llama", True)],
                         ids=["llama", "qwen3", "gemma3", "llama-gemv"])
def test_bf16_cudagraphs_match_eager_and_transformers_cuda(family: str, gemv: bool) -> None:
    """bf16 on the GPU: ``vattn.compile`` + ``CUDAGraphRunner(FULL_AND_PIECEWISE)`` gives the eager vattn
    run's tokens, and the eager run transformers' ``generate``'s, up to bf16 near-ties (policy:
    ``near_tie_or_equal``); decodes replay full graphs; nothing recompiles. ``gemv``: the benchmark's
    compile config (1-token pieces compiled apart, with ``examples.gemv.OneTokenGemv``)."""
    hf = random_model(tiny_config(family, **GPU_SHAPE), dtype=torch.bfloat16, device="cuda", seed=WEIGHT_SEED)
    ref_tokens, ref_logits = [], []
    for p in prompts():
        tokens, logits = hf_greedy(hf, p, "cuda")
        ref_tokens.append(tokens)
        ref_logits.append(logits)
    compilation = vattn.CompilationConfig()
    if gemv:
        from examples.gemv import OneTokenGemv

        compilation = vattn.CompilationConfig(compile_sizes=(1,), piece_passes=(OneTokenGemv(),))
    cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=16), compilation=compilation)
    model = vt.wrap(hf, cfg)
    kv = vattn.allocate_kv_cache(cfg, num_blocks=64, device="cuda", dtype=torch.bfloat16)
    eager = Engine(model, cfg, kv, device="cuda", max_num_batched_tokens=BUDGET, record_logits=True)
    eager_reqs, _ = run_engine(eager)
    for r, tokens, ref in zip(eager_reqs, ref_tokens, ref_logits):
        near_tie_or_equal(torch.stack(eager.logits[r.req_id]), ref, r.output_token_ids, tokens,
                          f"{family} eager vs transformers, request {r.req_id}")

    compiled = vattn.compile(model, cfg)
    graphs, reqs = run_with_graphs(model, compiled, cfg, kv, run_engine, BUDGET)
    assert compiled.backend.counter.num_graphs_seen == 1
    for a, b in zip(eager_reqs, reqs):
        near_tie_or_equal(torch.stack(graphs.logits[b.req_id]), torch.stack(eager.logits[a.req_id]),
                          b.output_token_ids, a.output_token_ids, f"{family} graphs vs eager, request {b.req_id}")

"""The MLA example model (examples/deepseek_model.py) matches transformers' DeepseekV3ForCausalLM.

Tiny configs whose layers are all dense (``first_k_dense_replace >= num_hidden_layers``), with
and without ``q_lora_rank``, YaRN and default RoPE, interleaved and half-split RoPE pairs. The
prompts run through ``examples.engine.Engine`` (continuous batching, chunked prefills beside
decodes, a paged latent cache); every sampled row of logits and the greedy tokens are compared
with transformers' ``generate`` (eager attention, end of sequence switched off). CPU: float32,
TRITON_MLA's kernels in the Triton interpreter. GPU (``cuda``): bf16 under ``vattn.compile``
with FULL CUDA graphs.
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

import triton_modules  # noqa: E402
import vattn  # noqa: E402
from benchmarks.common import default_dtype  # noqa: E402
from examples.deepseek_model import DeepseekConfig, DeepseekV3ForCausalLM, softmax_scale  # noqa: E402
from examples.engine import Engine, SamplingParams  # noqa: E402
from examples.model import init_random_weights  # noqa: E402

transformers = pytest.importorskip("transformers")
pytest.importorskip("triton")

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    triton_modules.load(("vattn.kernels.fp8", "vattn.kernels.mla_store", "vattn.backends.mla.triton_mla.kernels",
                         "vattn.backends.mla.triton_mla.launch"))

VOCAB = 256
# (prompt length, arrival step): the third prompt arrives while the first two decode.
PROMPTS = ((5, 0), (27, 0), (13, 2), (1, 4))
MAX_TOKENS = 8
BUDGET = 16  # the long prompt is prefilled in chunks beside decodes
BLOCK = 8
ATOL = 1e-4

SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4,
             kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=2,
             max_position_embeddings=128)
CONFIGS: dict[str, dict[str, Any]] = {
    # q LoRA, YaRN RoPE with sequences past its original context, mscale folded into the softmax scale.
    "qlora-yarn": dict(q_lora_rank=24, rope_interleave=True,
                       rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                        "original_max_position_embeddings": 32, "mscale": 1.0,
                                        "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}),
    # A full q projection, default RoPE on halves.
    "q-proj-default-rope": dict(q_lora_rank=None, rope_interleave=False,
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}


pytestmark = pytest.mark.usefixtures("hf_one_thread")


@pytest.fixture
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    if not HAS_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def hf_model(name: str, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Any:
    cfg = transformers.DeepseekV3Config(**SMALL, **CONFIGS[name], attn_implementation="eager")
    hf = transformers.DeepseekV3ForCausalLM(cfg).eval()
    init_random_weights(hf, seed=3, std=0.08)
    return hf.to(device=device, dtype=dtype)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n, _ in PROMPTS]


@functools.lru_cache(maxsize=None)
def reference(name: str) -> tuple[list[list[int]], list[torch.Tensor]]:
    """transformers' greedy ``generate`` of each prompt alone: (tokens, (MAX_TOKENS, V) float32 logits)."""
    hf = hf_model(name)
    config = copy.deepcopy(hf.generation_config)
    config.eos_token_id = None  # the engine stops by count only
    tokens, logits = [], []
    for p in prompts():
        ids = torch.tensor([p])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, max_new_tokens=MAX_TOKENS,
                          do_sample=False, output_logits=True, return_dict_in_generate=True)
        tokens.append(out.sequences[0, len(p):].tolist())
        logits.append(torch.cat(out.logits).float().cpu())
    return tokens, logits


def vattn_model(hf: Any, dtype: torch.dtype = torch.float32, device: str = "cpu",
                compilation: vattn.CompilationConfig | None = None) -> tuple[Any, vattn.VattnConfig, Any]:
    cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=BLOCK), compilation=compilation or vattn.CompilationConfig())
    with vattn.set_current_vattn_config(cfg), torch.device(device), default_dtype(dtype):
        model = DeepseekV3ForCausalLM.from_hf_config(hf.config)
    model.load_hf_state_dict(hf.state_dict())
    model.eval()
    return model, cfg, vattn.allocate_kv_cache(cfg, num_blocks=32, device=device, dtype=dtype)


def run_engine(engine: Engine) -> list[Any]:
    reqs = [engine.add_request(p, SamplingParams(max_tokens=MAX_TOKENS), arrival_step=a)
            for p, (_, a) in zip(prompts(), PROMPTS)]
    stats = engine.run()
    assert any(s.num_decode_tokens and s.num_prefill_tokens for s in stats)  # continuous batching happened
    return reqs


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_and_tokens_match_transformers_float32(interpret: None, name: str) -> None:
    hf = hf_model(name)
    model, cfg, kv = vattn_model(hf)
    assert all(layer.self_attn.attn.attn_backend.get_name() == "TRITON_MLA" for layer in model.model.layers)
    engine = Engine(model, cfg, kv, device="cpu", max_num_batched_tokens=BUDGET, record_logits=True,
                    check_invariants=True)
    reqs = run_engine(engine)
    ref_tokens, ref_logits = reference(name)
    for req, tokens, ref in zip(reqs, ref_tokens, ref_logits):
        got = torch.stack(engine.logits[req.req_id])
        assert got.shape == ref.shape == (MAX_TOKENS, VOCAB)
        top2 = ref.topk(2, dim=-1).values
        assert float((top2[:, 0] - top2[:, 1]).min()) > 10 * ATOL, "the reference has a near-tie: change the seeds"
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=0, msg=lambda m: f"{name} request {req.req_id}: {m}")
        assert req.output_token_ids == tokens


def test_config_and_scale() -> None:
    hf = hf_model("qlora-yarn")
    cfg = DeepseekConfig.from_hf(hf.config)
    attn = hf.model.layers[0].self_attn
    assert softmax_scale(cfg) == pytest.approx(attn.scaling) and softmax_scale(cfg) != cfg.qk_head_dim ** -0.5
    moe = transformers.DeepseekV3Config(**{**SMALL, "first_k_dense_replace": 1}, q_lora_rank=None)
    with pytest.raises(NotImplementedError, match="first_k_dense_replace = 1 < num_hidden_layers = 2"):
        DeepseekConfig.from_hf(moe)


def test_state_dict_names_are_transformers(interpret: None) -> None:
    hf = hf_model("q-proj-default-rope")
    model, _, _ = vattn_model(hf)
    assert set(model.state_dict()) == {k for k in hf.state_dict() if not k.endswith("inv_freq")}
    with pytest.raises(ValueError, match="missing keys"):
        model.load_hf_state_dict({k: v for k, v in hf.state_dict().items() if "kv_b_proj" not in k})


@pytest.mark.cuda
@pytest.mark.parametrize("backend,big", [("TRITON_MLA", False), ("TRITON_MLA", True),
                                         pytest.param("FLASHINFER_MLA", True, marks=pytest.mark.flashinfer)])
def test_bf16_compiled_full_graphs_match_transformers(backend: str, big: bool) -> None:
    """GPU, bf16: ``vattn.compile`` with FULL_AND_PIECEWISE CUDA graphs (decodes replay full graphs)
    gives transformers' greedy tokens; logits within bf16 tolerance. FLASHINFER_MLA needs
    DeepSeek's sizes (L 512, P 64; q/k 192 and v 128 in its prefill)."""
    from examples.generate import compile_model

    sizes = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128) if big else {}
    cfg_hf = transformers.DeepseekV3Config(**{**SMALL, **sizes}, **CONFIGS["qlora-yarn"], attn_implementation="eager")
    hf = transformers.DeepseekV3ForCausalLM(cfg_hf).eval()
    init_random_weights(hf, seed=3, std=0.08)
    hf = hf.to(device="cuda", dtype=torch.bfloat16)
    comp = vattn.CompilationConfig(cudagraph_mode=vattn.CUDAGraphMode.FULL_AND_PIECEWISE,
                                   cudagraph_capture_sizes=(1, 2, 4, 8, 16))
    with vattn.global_force_attn_backend_context_manager(backend):
        model, cfg, kv = vattn_model(hf, torch.bfloat16, "cuda", comp)
    runner = vattn.CUDAGraphRunner(compile_model(model, cfg), cfg, kv, max_batch_size=16, show_progress=False)
    engine = Engine(model, cfg, kv, device="cuda", max_num_batched_tokens=BUDGET, record_logits=True,
                    graph_runner=runner)
    reqs = run_engine(engine)
    config = copy.deepcopy(hf.generation_config)
    config.eos_token_id = None
    for req, p in zip(reqs, prompts()):
        ids = torch.tensor([p], device="cuda")
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                          max_new_tokens=MAX_TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True)
        ref = torch.cat(out.logits).float().cpu()
        got = torch.stack(engine.logits[req.req_id])
        want = out.sequences[0, len(p):].tolist()
        # bf16: the runs may part at a near-tie (then every later row has another context); up to
        # and including that step the logits agree within bf16 tolerance.
        k = next((j for j, (a, b) in enumerate(zip(req.output_token_ids, want)) if a != b), MAX_TOKENS)
        if k < MAX_TOKENS:
            top2 = ref[k].topk(2).values
            assert top2[0] - top2[1] < 0.25, (k, req.output_token_ids, want, top2)
        torch.testing.assert_close(got[: k + 1], ref[: k + 1], atol=0.15, rtol=0.05)


@pytest.mark.slow
def test_vattn_compile_splits_at_the_mla_op_and_matches(interpret: None) -> None:
    """``vattn.compile``: one piece per gap between MLA ops, middle pieces compiled once, same logits."""
    from examples.generate import compile_model

    hf = hf_model("q-proj-default-rope")
    model, cfg, kv = vattn_model(hf)
    forward = compile_model(model, cfg)
    engine = Engine(model, cfg, kv, device="cpu", max_num_batched_tokens=BUDGET, record_logits=True,
                    forward_fn=forward)
    reqs = run_engine(engine)
    counter = forward.backend.counter
    assert (counter.num_graphs_seen, counter.num_splitting_ops, counter.num_pieces) == (1, 2, 3)
    for req, ref in zip(reqs, reference("q-proj-default-rope")[1]):
        torch.testing.assert_close(torch.stack(engine.logits[req.req_id]), ref, atol=ATOL, rtol=0)

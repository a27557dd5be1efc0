"""The acceptance test of the main job: the example decoder on vattn matches ``transformers``.

Same seeded random weights in both; a batch of prompts of different lengths arrives at
different steps and runs through ``examples.engine.Engine`` (continuous batching, chunked
prefill under a token budget, decodes first, a paged KV cache). Every sampled row of
logits (the prefill's last position, then 32 greedy decode steps) is compared with the
HF model (eager attention) run on the whole sequence without a cache.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import vattn  # noqa: E402
from examples.engine import PENDING, BlockAllocator, Engine, Request, SamplingParams, greedy, sample  # noqa: E402
from examples.generate import compile_model  # noqa: E402
from examples.model import DecoderForCausalLM, ModelConfig, init_random_weights  # noqa: E402
from engine_checks import run_with_graphs  # noqa: E402

transformers = pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


VOCAB = 512
# (prompt length, arrival step): chunked prefills (budget 24) overlap with decodes of earlier requests.
PROMPTS = [(5, 0), (40, 0), (17, 3), (1, 5), (60, 9)]
MAX_TOKENS = 33  # the prefill's token + 32 decode steps
BUDGET = 24

CONFIGS: dict[str, ModelConfig] = {
    # Llama GQA with Llama-3 RoPE scaling whose original context (64) is shorter than the sequences.
    "llama-gqa": ModelConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=256, rope_theta=10000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}),
    # Llama MHA with q/k/v/o and MLP biases.
    "llama-mha": ModelConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, head_dim=32, max_position_embeddings=256, attention_bias=True, mlp_bias=True),
    # Qwen3 GQA (q/k RMSNorm per head), head_dim != hidden / heads.
    "qwen3-gqa": ModelConfig(
        arch="qwen3", vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=64, max_position_embeddings=256,
        rope_theta=1000000.0),
    # Qwen3 MHA with tied embeddings.
    "qwen3-mha": ModelConfig(
        arch="qwen3", vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=32, max_position_embeddings=256,
        tie_word_embeddings=True),
}


def make_hf(mcfg: ModelConfig, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0) -> Any:
    """The transformers model (eager attention) with seeded random weights (norms jittered too)."""
    hf_cfg = mcfg.to_hf(attn_implementation="eager")
    cls = transformers.LlamaForCausalLM if mcfg.arch == "llama" else transformers.Qwen3ForCausalLM
    hf = cls(hf_cfg).eval()
    init_random_weights(hf, seed=seed, std=0.05)
    return hf.to(device=device, dtype=dtype)


def make_vattn(hf: Any, dtype: torch.dtype = torch.float32, device: str = "cpu", num_blocks: int = 64,
               block_size: int = 16) -> tuple[DecoderForCausalLM, vattn.VattnConfig, vattn.PagedKVCache]:
    """The example model built from the HF config, loaded from the HF state dict, with its KV cache."""
    cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=block_size))
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with vattn.set_current_vattn_config(cfg), torch.device(device):
            model = DecoderForCausalLM.from_hf_config(hf.config)
    finally:
        torch.set_default_dtype(old)
    model.load_hf_state_dict(hf.state_dict())
    model.eval()
    kv = vattn.allocate_kv_cache(cfg, num_blocks=num_blocks, device=device, dtype=dtype)
    return model, cfg, kv


def prompts(seed: int = 1) -> list[tuple[list[int], int]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (n,), generator=g).tolist(), arrival) for n, arrival in PROMPTS]


def run_engine(engine: Engine, step_offset: int = 0) -> tuple[list[Request], list[Any]]:
    reqs = [engine.add_request(p, SamplingParams(max_tokens=MAX_TOKENS), arrival_step=a + step_offset)
            for p, a in prompts()]
    stats = engine.run()
    return reqs, stats


@torch.no_grad()
def hf_logits(hf: Any, req: Request, device: str = "cpu") -> torch.Tensor:
    """(MAX_TOKENS, V) float32: HF logits at the positions the engine sampled from (no cache, full sequence)."""
    seq = torch.tensor(req.prompt_token_ids + req.output_token_ids[:-1], device=device)[None]
    return hf(seq).logits[0, len(req.prompt_token_ids) - 1 :].float().cpu()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers_float32(name: str) -> None:
    hf = make_hf(CONFIGS[name])
    model, cfg, kv = make_vattn(hf)
    engine = Engine(model, cfg, kv, device="cpu", max_num_batched_tokens=BUDGET, record_logits=True,
                    check_invariants=True)
    reqs, stats = run_engine(engine)
    # The run really batched continuously: a step mixed decodes with a (chunked) prefill.
    assert any(s.num_decode_tokens and s.num_prefill_tokens for s in stats)
    assert max(s.num_prefill_tokens + s.num_decode_tokens for s in stats) == BUDGET
    for req in reqs:
        ref = hf_logits(hf, req)
        got = torch.stack(engine.logits[req.req_id])
        assert got.shape == ref.shape == (MAX_TOKENS, VOCAB)
        assert ref.abs().max() > 1.0  # logits large enough for 1e-4 to mean something
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=0, msg=lambda m: f"{name} request {req.req_id}: {m}")
        assert req.output_token_ids == ref.argmax(-1).tolist()


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow),
                                     pytest.param("vattn", marks=pytest.mark.slow)])
def test_compiled_same_tokens_no_recompiles(backend: str) -> None:
    """torch.compile(fullgraph=True, dynamic=True): one graph for every batch composition, same tokens.

    Recompiles are Dynamo's business, so aot_eager (functionalization included) shows them in a few
    seconds; Inductor and ``vattn.compile`` (each about a minute of C++ compiles on a CPU box) are slow.
    """
    import torch._dynamo
    from torch._dynamo.utils import counters

    hf = make_hf(CONFIGS["llama-gqa"])
    model, cfg, kv = make_vattn(hf)
    eager = Engine(model, cfg, kv, device="cpu", max_num_batched_tokens=BUDGET, record_logits=True)
    eager_reqs, _ = run_engine(eager)

    torch._dynamo.reset()
    counters.clear()
    compiled = compile_model(model, cfg, backend)  # torch backends: traced size-obliviously
    engine = Engine(model, cfg, kv, device="cpu", max_num_batched_tokens=BUDGET, forward_fn=compiled,
                    record_logits=True)
    engine.add_request(list(range(8)), SamplingParams(max_tokens=2))  # warm-up: one prefill, one decode
    engine.run()
    assert counters["stats"]["unique_graphs"] == 1
    with torch._dynamo.config.patch(error_on_recompile=True):
        reqs, stats = run_engine(engine, step_offset=engine.step_count)
    assert counters["stats"]["unique_graphs"] == 1
    assert len({s.num_prefill_tokens + s.num_decode_tokens for s in stats}) > 3  # many different T
    for a, b in zip(eager_reqs, reqs):
        assert a.output_token_ids == b.output_token_ids
        torch.testing.assert_close(torch.stack(engine.logits[b.req_id]), torch.stack(eager.logits[a.req_id]),
                                   atol=1e-4, rtol=0)


def assert_bf16_close(got: torch.Tensor, ref: torch.Tensor, tokens: list[int], what: str) -> None:
    """(N, V) logits within bf16 tolerance; greedy tokens equal wherever ``ref`` is not a near-tie."""
    diff = (got - ref).abs()
    assert diff.max() < 0.1 and diff.mean() < 0.02, f"{what}: max {diff.max():.4f}, mean {diff.mean():.4f}"
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.1
    same = ref.argmax(-1) == torch.tensor(tokens)
    assert bool(same[clear].all()), f"{what}: tokens differ at {(~same & clear).nonzero().flatten().tolist()}"


def assert_same_run_until_near_tie(got: torch.Tensor, ref: torch.Tensor, got_tokens: list[int],
                                   ref_tokens: list[int], what: str) -> None:
    """Two engine runs of one model: logits within bf16 tolerance up to the first token that
    differs, and that token must be a near-tie of ``ref`` (after it the sequences differ)."""
    n = next((i for i, (a, b) in enumerate(zip(got_tokens, ref_tokens)) if a != b), len(ref_tokens))
    rows = min(n + 1, got.shape[0], ref.shape[0])
    assert_bf16_close(got[:rows], ref[:rows], got_tokens[:rows], what)
    if n < min(len(got_tokens), len(ref_tokens)):
        top2 = ref[n].topk(2).values
        assert float(top2[0] - top2[1]) < 0.1, f"{what}: tokens diverge at step {n} without a near-tie"


def cuda_block_size(backend: str | None) -> int:
    """16, or the first block size the forced backend supports."""
    if backend is None:
        return 16
    enum = vattn.backend_name_to_enum(backend)
    assert enum is not None
    sizes = enum.get_class().get_supported_block_sizes()
    return 16 if not sizes or 16 in sizes else sizes[0]


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["llama-gqa", "qwen3-gqa"])
@pytest.mark.parametrize("backend", [
    None, "TRITON_ATTN", "TORCH_SDPA",
    pytest.param("FLASH_ATTN", marks=pytest.mark.flash_attn),
    pytest.param("FLASHINFER", marks=pytest.mark.flashinfer),
])
def test_logits_match_transformers_bf16_cuda(name: str, backend: str | None) -> None:
    """bf16 on the GPU: the same greedy tokens (except near-ties) and logits within bf16 tolerance."""
    hf = make_hf(CONFIGS[name], dtype=torch.bfloat16, device="cuda")
    with vattn.global_force_attn_backend_context_manager(backend):
        model, cfg, kv = make_vattn(hf, dtype=torch.bfloat16, device="cuda", block_size=cuda_block_size(backend))
    engine = Engine(model, cfg, kv, device="cuda", max_num_batched_tokens=BUDGET, record_logits=True)
    reqs, _ = run_engine(engine)
    for req in reqs:
        ref = hf_logits(hf, req, device="cuda")
        assert_bf16_close(torch.stack(engine.logits[req.req_id]), ref, req.output_token_ids,
                          f"{name}/{backend} request {req.req_id}")


@pytest.mark.cuda
@pytest.mark.parametrize("compile_model", [False, True])
def test_cudagraph_engine_matches_eager_cuda(compile_model: bool) -> None:
    """The engine through vattn.CUDAGraphRunner (full decode graphs; piecewise when vattn.compile'd)
    gives the eager engine's tokens and logits (bf16 tolerance), with decodes replayed from graphs."""
    hf = make_hf(CONFIGS["llama-gqa"], dtype=torch.bfloat16, device="cuda")
    model, cfg, kv = make_vattn(hf, dtype=torch.bfloat16, device="cuda")
    eager = Engine(model, cfg, kv, device="cuda", max_num_batched_tokens=BUDGET, record_logits=True)
    eager_reqs, _ = run_engine(eager)
    fn = vattn.compile(model, cfg) if compile_model else model
    graphs, reqs = run_with_graphs(model, fn, cfg, kv, run_engine, BUDGET)
    for a, b in zip(eager_reqs, reqs):
        assert_same_run_until_near_tie(torch.stack(graphs.logits[b.req_id]), torch.stack(eager.logits[a.req_id]),
                                       b.output_token_ids, a.output_token_ids, f"cudagraph request {b.req_id}")


@pytest.mark.cuda
def test_greedy_head_graphs_same_tokens_cuda() -> None:
    """Greedy one-request decode steps replayed from full graphs sample from a CUDA graph of the LM
    head and ``greedy`` (``Engine._greedy_from_graph``, captured on the second such step): the
    tokens equal those of the same engine sampling eagerly (``record_logits`` keeps it eager)."""
    hf = make_hf(CONFIGS["llama-gqa"], dtype=torch.bfloat16, device="cuda")
    model, cfg, kv = make_vattn(hf, dtype=torch.bfloat16, device="cuda")
    runner = vattn.CUDAGraphRunner(model, cfg, kv, max_batch_size=8, max_model_len=128,
                                   mode=vattn.CUDAGraphMode.FULL, show_progress=False)
    runs = {}
    for eager_head in (True, False):
        engine = Engine(model, cfg, kv, device="cuda", max_num_batched_tokens=BUDGET, graph_runner=runner,
                        record_logits=eager_head)
        reqs, _ = run_engine(engine)  # batches of several requests (eager sampling) ...
        reqs.append(engine.add_request(prompts()[0][0], SamplingParams(max_tokens=6)))
        engine.run()  # ... then one request alone: one-row steps
        runs[eager_head] = ([r.output_token_ids for r in reqs], engine._head_graphs)
    assert runs[False][0] == runs[True][0]
    assert not runs[True][1], "record_logits must keep sampling eager"
    assert any(v is not None for v in runs[False][1].values()), "no greedy head graph was captured"


# ---- the generation loop's own invariants ------------------------------------------------------


def test_scheduler_invariants_under_preemption() -> None:
    """Few KV blocks: requests get preempted and recomputed; no block is owned twice or leaked,
    decodes always come first, and greedy outputs equal those of a run with ample blocks."""
    hf = make_hf(CONFIGS["qwen3-gqa"])
    model, cfg, kv = make_vattn(hf, num_blocks=64, block_size=4)
    ample = Engine(model, cfg, kv, device="cpu", max_num_batched_tokens=BUDGET)
    ample_reqs, _ = run_engine(ample)

    small = vattn.allocate_kv_cache(cfg, num_blocks=30, device="cpu")  # longest request needs 24 blocks
    engine = Engine(model, cfg, small, device="cpu", max_num_batched_tokens=BUDGET, check_invariants=True)
    schedule = engine.scheduler.schedule

    def checked_schedule(step: int) -> list[tuple[Request, int]]:
        out = schedule(step)
        is_decode = [r.num_computed_tokens >= len(r.prompt_token_ids) and n == 1 for r, n in out]
        assert is_decode == sorted(is_decode, reverse=True), "decodes must come first"
        assert len({id(r) for r, _ in out}) == len(out)
        assert sum(n for _, n in out) <= BUDGET
        return out

    engine.scheduler.schedule = checked_schedule  # type: ignore[method-assign]
    reqs, _ = run_engine(engine)
    assert sum(r.num_preemptions for r in reqs) > 0
    assert engine.allocator.num_free == 30 and not engine.scheduler.running
    for a, b in zip(ample_reqs, reqs):
        assert len(b.output_token_ids) == MAX_TOKENS and not b.block_ids
        assert a.output_token_ids == b.output_token_ids


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_async_scheduling_same_tokens_as_sync(device: str) -> None:
    """Async scheduling (each step launched before the previous step's tokens reach the host,
    which reads them on the device) gives the tokens of a run that syncs every step: with
    preemption and recompute (few blocks), chunked prefill, arrivals, and temperature / top-p
    sampling from the engine's generator. Mid-run, only a request's newest token is pending.
    On CUDA the tokens come back through the engine's two pinned buffers, used in turn."""
    hf = make_hf(CONFIGS["llama-gqa"], device=device)
    model, cfg, _ = make_vattn(hf, device=device)

    def run(async_scheduling: bool) -> dict[str, Any]:
        small = vattn.allocate_kv_cache(cfg, num_blocks=12, device=device)
        engine = Engine(model, cfg, small, device=device, max_num_batched_tokens=BUDGET, check_invariants=True,
                        async_scheduling=async_scheduling, seed=3, record_logits=True)
        reqs = [engine.add_request(p, SamplingParams(max_tokens=MAX_TOKENS, temperature=t, top_p=0.9),
                                   arrival_step=a)
                for (p, a), t in zip(prompts(), [0.0, 1.0, 0.0, 0.7, 1.3])]
        pending_seen = 0
        while engine.scheduler.has_unfinished():
            engine.step()
            for r in reqs:
                assert PENDING not in r.output_token_ids[:-1], "only the newest token can be pending"
                pending_seen += bool(r.output_token_ids) and r.output_token_ids[-1] == PENDING
        engine.flush()
        assert all(PENDING not in r.output_token_ids for r in reqs)
        return {"tokens": [r.output_token_ids for r in reqs],
                "logits": [torch.stack(engine.logits[r.req_id]) for r in reqs],
                "preemptions": sum(r.num_preemptions for r in reqs), "pending_seen": pending_seen}

    sync, asyn = run(False), run(True)
    assert sync["preemptions"] > 0 and asyn["preemptions"] > 0, "the cache must be small enough to preempt"
    assert sync["pending_seen"] == 0 < asyn["pending_seen"], "async steps leave tokens pending, sync ones none"
    assert asyn["tokens"] == sync["tokens"]
    for a, b in zip(asyn["logits"], sync["logits"]):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert len({t for out in sync["tokens"] for t in out}) > 40  # sampling drew many different tokens


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_async_scheduling_fuzz(data: st.DataObject) -> None:
    """Random workloads (prompt and output lengths, arrivals, token budget, cache size, sampling):
    async scheduling samples exactly the tokens of synchronous steps, and leaves the cache's
    blocks all free."""
    model, cfg = _fuzz_model()
    n = data.draw(st.integers(1, 5), label="requests")
    reqs = [(data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20), label="prompt"),
             data.draw(st.integers(1, 8), label="max_tokens"), data.draw(st.integers(0, 6), label="arrival"),
             data.draw(st.sampled_from([0.0, 0.0, 1.0]), label="temperature")) for _ in range(n)]
    budget = data.draw(st.integers(1, 24), label="budget")
    need = max(-(-(len(p) + m) // 4) for p, m, _, _ in reqs)
    blocks = data.draw(st.integers(need, need + 8), label="blocks")  # few blocks: preemption

    def run(async_scheduling: bool) -> list[list[int]]:
        kv = vattn.allocate_kv_cache(cfg, num_blocks=blocks, device="cpu")
        engine = Engine(model, cfg, kv, device="cpu", max_num_batched_tokens=budget, seed=7,
                        async_scheduling=async_scheduling, check_invariants=True)
        out = [engine.add_request(p, SamplingParams(max_tokens=m, temperature=t), arrival_step=a)
               for p, m, a, t in reqs]
        engine.run()
        assert engine.allocator.num_free == blocks
        return [r.output_token_ids for r in out]

    assert run(True) == run(False)


@functools.lru_cache(maxsize=1)
def _fuzz_model() -> tuple[DecoderForCausalLM, vattn.VattnConfig]:
    """A 1-layer model (block size 4) shared by the fuzz examples."""
    cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=4))
    mcfg = ModelConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=64)
    with vattn.set_current_vattn_config(cfg):
        model = DecoderForCausalLM(mcfg).eval()
    init_random_weights(model, seed=5)
    return model, cfg


def test_negative_prompt_ids_rejected() -> None:
    """A prompt id below 0 would read as a PENDING token: the scheduler refuses it."""
    hf = make_hf(CONFIGS["llama-gqa"])
    model, cfg, kv = make_vattn(hf)
    engine = Engine(model, cfg, kv, device="cpu")
    with pytest.raises(ValueError, match=r"prompt_token_ids\[1\] is -1"):
        engine.add_request([3, PENDING, 5])


def test_block_allocator() -> None:
    alloc = BlockAllocator(4)
    a = alloc.allocate(3, owner=1)
    assert a is not None and len(set(a)) == 3 and alloc.num_free == 1
    assert alloc.allocate(2, owner=2) is None and alloc.num_free == 1  # all or nothing
    with pytest.raises(AssertionError):
        alloc.free(a[:1], owner=2)  # not the owner
    alloc.free(a, owner=1)
    with pytest.raises(AssertionError):
        alloc.free(a[:1], owner=1)  # double free
    assert alloc.num_free == 4


def test_sampling() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1], [0.1, 0.2, 0.7]])).repeat(200, 1)
    temp = torch.ones(400)
    assert sample(logits).tolist() == [0, 2] * 200
    # top_p 0.5: only the top token survives; top_p 1: all three appear.
    assert sample(logits, temp, torch.full((400,), 0.5), g).tolist() == [0, 2] * 200
    drawn = sample(logits, temp, torch.ones(400), g)
    assert set(drawn[::2].tolist()) == {0, 1, 2}
    # Per-row greedy where temperature == 0.
    temp[::2] = 0
    assert (sample(logits, temp, torch.ones(400), g)[::2] == 0).all()


@pytest.mark.parametrize("vocab", [128256, 151936, 1031, 700])
def test_greedy_equals_argmax(vocab: int) -> None:
    # Two passes (chunk maxima, then their argmax) give argmax's index: the first maximum on
    # ties (the row's maximum repeated across chunks), NaN first, bf16 rows.
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=g)
    logits[1, [5, vocab // 2, vocab - 1]] = 50.0  # ties in different chunks
    logits[2, vocab - 1] = 60.0  # the maximum in the last chunk
    logits[3, [vocab // 3, 7]] = float("nan")
    logits[4] = 0.0  # every entry ties
    for x in (logits, logits.bfloat16()):
        assert torch.equal(greedy(x), x.argmax(dim=-1))
    assert greedy(logits).tolist()[1:5] == [5, vocab - 1, 7, 0]


def test_load_hf_state_dict_errors() -> None:
    hf = make_hf(CONFIGS["llama-gqa"])
    model, _, _ = make_vattn(hf)
    sd = hf.state_dict()
    del sd["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match="model.layers.1.self_attn.k_proj.weight"):
        model.load_hf_state_dict(sd)
    sd = hf.state_dict()
    sd["model.layers.0.mlp.up_proj.weight"] = sd["model.layers.0.mlp.up_proj.weight"][:-1]
    with pytest.raises(ValueError, match="gate_up_proj"):
        model.load_hf_state_dict(sd)

"""examples/hybrid_model.py, the Qwen3-Next-style hybrid (Gated DeltaNet layers, gated attention in
every fourth), on the CPU through examples.engine.Engine.

The reference (``reference_logits``) recomputes a request's whole sequence from the model's weights
in float64 with plain torch: no cache, no vattn, the GDN recurrence as a per-token loop. The
engine's paged K/V + per-request state path must give the same logits and greedy tokens with
chunked prefills, decodes mixed into prefill steps, state slots reused by later requests,
preemption (recompute from a zero state) and a failing request in the batch. The model's
weights load from ``transformers``' Qwen3NextForCausalLM and give its logits.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import vattn  # noqa: E402
from examples import generate  # noqa: E402
from examples.engine import Engine, Request, SamplingParams  # noqa: E402
from examples.hybrid_model import HybridConfig, HybridForCausalLM, get_hybrid_preset, init_random_weights  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

VOCAB = 256
MCFG = get_hybrid_preset("qwen3-next-tiny", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                         linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                         max_position_embeddings=256)
# (prompt length, arrival step): more requests than rows (slots are reused), chunked prefills under a
# budget of 16 tokens beside the decodes of earlier requests.
PROMPTS = [(23, 0), (5, 0), (40, 2), (1, 4), (17, 6), (9, 9)]
MAX_TOKENS = 10


def build(mcfg: HybridConfig = MCFG, num_blocks: int = 64, block_size: int = 8, slots: int = 3,
          seed: int = 0) -> tuple[HybridForCausalLM, vattn.VattnConfig, vattn.PagedKVCache]:
    cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=block_size))
    with vattn.set_current_vattn_config(cfg):
        model = HybridForCausalLM(mcfg).eval()
    init_random_weights(model, seed=seed, std=0.1)
    kv = vattn.allocate_kv_cache(cfg, num_blocks=num_blocks, num_state_slots=slots)
    return model, cfg, kv


def prompts(seed: int = 1) -> list[tuple[list[int], int]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (n,), generator=g).tolist(), a) for n, a in PROMPTS]


def run(engine: Engine, todo: list[tuple[list[int], int]]) -> list[Request]:
    reqs = [engine.add_request(p, SamplingParams(max_tokens=MAX_TOKENS), arrival_step=a) for p, a in todo]
    engine.run()
    return reqs


@torch.no_grad()
def reference_logits(model: HybridForCausalLM, ids: list[int]) -> torch.Tensor:
    """(L, V) float64 logits of the whole sequence ``ids``, recomputed from the weights (no cache)."""
    c, w = model.config, {n: p.detach().double() for n, p in model.named_parameters()}
    n, eps = len(ids), c.rms_norm_eps
    h, hk, d, rot = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rotary_dim
    lk, lv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim

    def norm(x, weight, offset=True):
        y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return y * (1 + weight) if offset else y * weight

    angle = torch.arange(n, dtype=torch.float64)[:, None] / c.rope_theta ** (
        torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    cos, sin = torch.cat([angle.cos()] * 2, -1)[:, None], torch.cat([angle.sin()] * 2, -1)[:, None]

    def rope(x):  # (L, heads, D): the first rot dims rotated (rotate-half), the rest passed
        x1, x2, rest = x[..., : rot // 2], x[..., rot // 2 : rot], x[..., rot:]
        return torch.cat([x[..., :rot] * cos + torch.cat([-x2, x1], -1) * sin, rest], -1)

    def l2(x):
        return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)

    x = w["model.embed_tokens.weight"][torch.tensor(ids)]
    for i, kind in enumerate(c.layer_types):
        p = f"model.layers.{i}."
        y = norm(x, w[p + "input_layernorm.weight"])
        if kind == "full_attention":
            a = p + "self_attn."
            q, gate, k, v = (y @ w[a + "qkv_proj.weight"].T).split([h * d, h * d, hk * d, hk * d], -1)
            q = rope(norm(q.view(n, h, d), w[a + "q_norm.weight"]))
            k = rope(norm(k.view(n, hk, d), w[a + "k_norm.weight"])).repeat_interleave(h // hk, 1)
            v = v.reshape(n, hk, d).repeat_interleave(h // hk, 1)
            s = torch.einsum("qhd,khd->hqk", q, k) * d**-0.5
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(n, h * d)
            y = (o * torch.sigmoid(gate)) @ w[a + "o_proj.weight"].T
        else:
            a, conv_dim = p + "linear_attn.", 2 * lk * dk + lv * dv
            mixed, z, b, dt = (y @ w[a + "in_proj.weight"].T).split([conv_dim, lv * dv, lv, lv], -1)
            cw = w[a + "conv_weight"]  # (C, K): a depthwise causal conv, then silu
            xp = torch.cat([mixed.new_zeros(cw.shape[1] - 1, conv_dim), mixed])
            mixed = F.silu(torch.stack([(xp[t : t + cw.shape[1]].T * cw).sum(-1) for t in range(n)]))
            q, k, v = mixed.split([lk * dk, lk * dk, lv * dv], -1)
            q = l2(q.view(n, lk, dk)).repeat_interleave(lv // lk, 1) * dk**-0.5
            k = l2(k.view(n, lk, dk)).repeat_interleave(lv // lk, 1)
            v = v.view(n, lv, dv)
            g = -w[a + "A_log"].exp() * F.softplus(dt + w[a + "dt_bias"])
            beta, state, outs = torch.sigmoid(b), torch.zeros(lv, dk, dv, dtype=torch.float64), []
            for t in range(n):  # S = e^g S;  S += k (beta (v - S^T k))^T;  o = S^T q
                state = state * g[t].exp()[:, None, None]
                u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", state, k[t]))
                state = state + k[t][:, :, None] * u[:, None, :]
                outs.append(torch.einsum("hkv,hk->hv", state, q[t]))
            o = norm(torch.stack(outs), w[a + "norm.weight"], offset=False) * F.silu(z.view(n, lv, dv))
            y = o.reshape(n, lv * dv) @ w[a + "out_proj.weight"].T
        x = x + y
        gate_up = norm(x, w[p + "post_attention_layernorm.weight"]) @ w[p + "mlp.gate_up_proj.weight"].T
        gate, up = gate_up.chunk(2, -1)
        x = x + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return norm(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


def check_against_reference(model: HybridForCausalLM, engine: Engine, reqs: list[Request]) -> None:
    """Every sampled row of logits equals the full recompute's, and every greedy token its argmax."""
    for r in reqs:
        assert len(r.output_token_ids) == MAX_TOKENS and r.error is None
        ref = reference_logits(model, r.prompt_token_ids + r.output_token_ids[:-1])[len(r.prompt_token_ids) - 1 :]
        got = torch.stack(engine.logits[r.req_id]).double()
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
        assert r.output_token_ids == ref.argmax(-1).tolist()


def test_paged_state_equals_full_recompute() -> None:
    """Chunked prefills beside decodes, 6 requests through 3 state slots (a later request takes a
    finished one's slot and starts from zeros): token for token the no-cache recompute."""
    model, cfg, kv = build()
    engine = Engine(model, cfg, kv, device="cpu", max_num_batched_tokens=16, max_num_seqs=3, record_logits=True,
                    check_invariants=True)
    reqs = run(engine, prompts())
    check_against_reference(model, engine, reqs)
    assert sum(r.num_preemptions for r in reqs) == 0


def test_chunked_prefill_equals_one_shot() -> None:
    """A 40-token prompt in chunks of 7 (conv windows and states cross every chunk boundary) gives
    the one-shot prefill's logits and tokens."""
    prompt = prompts()[2][0]
    out = {}
    for budget in (64, 7):
        model, cfg, kv = build()
        engine = Engine(model, cfg, kv, device="cpu", max_num_batched_tokens=budget, max_num_seqs=3,
                        record_logits=True)
        (req,) = run(engine, [(prompt, 0)])
        out[budget] = (req.output_token_ids, torch.stack(engine.logits[req.req_id]))
    assert out[7][0] == out[64][0]
    torch.testing.assert_close(out[7][1], out[64][1], rtol=1e-5, atol=1e-5)


def test_preempted_requests_restart_from_a_zero_state() -> None:
    """Too few KV blocks: requests are preempted and recomputed from token 0 in the same slot or
    another (whatever it holds), with the recompute's tokens."""
    model, cfg, kv = build(num_blocks=16, block_size=4)
    engine = Engine(model, cfg, kv, device="cpu", max_num_batched_tokens=16, max_num_seqs=3, record_logits=True,
                    check_invariants=True)
    reqs = run(engine, prompts())
    assert sum(r.num_preemptions for r in reqs) > 0
    for r in reqs:  # a preempted request's logits rows start again: keep the last MAX_TOKENS
        engine.logits[r.req_id] = engine.logits[r.req_id][-MAX_TOKENS:]
    check_against_reference(model, engine, reqs)


def test_failing_request_leaves_the_others_states_intact() -> None:
    """A step that raises after the mixer layers ran (its states advanced) fails one request; the
    others, restarted from a zero state, give the tokens of a run without it."""
    todo = prompts()[:4]
    model, cfg, kv = build()
    base = [r.output_token_ids for r in run(Engine(model, cfg, kv, device="cpu", max_num_batched_tokens=16,
                                                   max_num_seqs=3), todo)]
    poison = next(t for t in range(VOCAB) if all(t not in p + o for (p, _), o in zip(todo, base)))

    def forward(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        hidden = model(ids, pos)  # every layer ran: states of every scheduled request advanced
        if bool((ids == poison).any()):
            raise ValueError("poisoned token")
        return hidden

    model, cfg, kv = build()
    engine = Engine(model, cfg, kv, device="cpu", max_num_batched_tokens=16, max_num_seqs=3, forward_fn=forward)
    reqs = run(engine, todo[:2] + [([poison] * 6, 1)] + todo[2:])
    assert isinstance(reqs[2].error, ValueError)
    assert [r.output_token_ids for r in reqs[:2] + reqs[3:]] == base


def test_engine_needs_a_state_slot_per_row() -> None:
    model, cfg, kv = build(slots=2)
    with pytest.raises(ValueError, match="num_state_slots=3"):
        Engine(model, cfg, kv, device="cpu", max_num_seqs=3)


def test_loads_transformers_qwen3_next() -> None:
    """Qwen3NextForCausalLM (dense MLPs) and this model on its state dict: the same logits, prefill
    and decodes through the engine."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.Qwen3NextForCausalLM(MCFG.to_hf(attn_implementation="eager")).eval()
    init_random_weights(hf, seed=2, std=0.1)
    assert HybridConfig.from_hf(hf.config) == MCFG
    model, cfg, kv = build()
    model.load_hf_state_dict(hf.state_dict())
    engine = Engine(model, cfg, kv, device="cpu", max_num_batched_tokens=16, max_num_seqs=3, record_logits=True)
    reqs = run(engine, prompts()[:3])
    for r in reqs:
        with torch.no_grad():
            ref = hf(torch.tensor([r.prompt_token_ids + r.output_token_ids[:-1]])).logits[0]
        torch.testing.assert_close(torch.stack(engine.logits[r.req_id]), ref[len(r.prompt_token_ids) - 1 :],
                                   rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="missing keys"):
        model.load_hf_state_dict({k: v for k, v in hf.state_dict().items() if "in_proj_ba" not in k})


def test_generate_hybrid_preset() -> None:
    """examples/generate.py --preset qwen3-next-tiny: chunked prefills and preemption give the
    tokens of an unconstrained run."""
    small = ["--device", "cpu", "--preset", "qwen3-next-tiny", "--num-requests", "3", "--prompt-len", "20",
             "--output-len", "6", "--fixed-lengths", "--no-progress"]
    base = generate.main(small)
    assert base["output_tokens"] == 3 * 6 and base["decode_tokens"] > 0
    tight = generate.main(small + ["--max-num-batched-tokens", "8", "--num-blocks", "8", "--block-size", "4"])
    assert tight["preemptions"] > 0
    assert tight["outputs"] == base["outputs"]


def test_bench_hybrid_cpu_smoke(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """benchmarks/bench_hybrid.py's decode part on the CPU (eager rows: no compile), JSON to $OUT."""
    pytest.importorskip("transformers")
    from benchmarks import bench_hybrid

    monkeypatch.setenv("OUT", str(tmp_path))
    out = bench_hybrid.main(["--only", "decode", "--device", "cpu", "--dtype", "float32", "--preset", "qwen3-next-tiny",
                             "--context", "8", "--new-tokens", "2", "--batches", "1", "--impls", "vattn-eager,hf-eager",
                             "--reps", "1"])
    assert [(r["impl"], r["batch"]) for r in out["rows"]] == [("vattn-eager", 1), ("hf-eager", 1)]
    assert all(r["tok_s"] > 0 and "error" not in r for r in out["rows"])
    assert out["summary"]["vattn_mixer_backend"] == "GDN_ATTN" and (tmp_path / out["path"].name).is_file()

"""Tensor parallelism of the example model (examples/tp.py) on the CPU: 2 processes with gloo.

One module-scoped launch of two worker processes (this file run as a script) loads a
``transformers`` state dict into the tensor-parallel model (each rank keeps its shard), runs the
continuous-batching engine eagerly and under ``torch.compile(fullgraph=True, dynamic=True)``
(aot_eager), and saves every rank's greedy tokens and sampled logits rows. The tests compare them
with the single-process model on the same state dict (float32, atol 1e-4).

Two configurations: Llama GQA (4 query / 2 KV heads, so 2 / 1 per rank; q/k/v/o and MLP biases; an
odd vocabulary, so the last vocab shard is padded) and Qwen3 with one KV head (tp 2 > 1 KV head:
the head is replicated) and tied embeddings. Rendezvous: a ``TCPStore`` this process hosts on
127.0.0.1, port chosen by the OS (no race for a free port); gloo over the loopback interface.

Also here: the sharding itself in one process (weights of every rank rebuild the TP=1 model's),
``torchrun ... examples/generate.py --tp 2`` and ``benchmarks/bench_tp.py`` on gloo, and the GPU
version of the parity test (``cuda`` marker, 2 GPUs: NCCL, bf16, CUDA-graph replay vs eager).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import vattn  # noqa: E402
from benchmarks.common import default_dtype  # noqa: E402
from examples.engine import Engine, SamplingParams  # noqa: E402
from examples.generate import compile_model  # noqa: E402
from examples.model import DecoderForCausalLM, ModelConfig, init_random_weights  # noqa: E402
from examples.tp import TensorParallel, attention_shards, leave_tensor_parallel  # noqa: E402

WORLD = 2
BUDGET = 16
MAX_TOKENS = 10
PROMPTS = [(5, 0), (23, 0), (12, 2), (1, 4)]  # (length, arrival step): chunked prefill beside decodes
CASES: dict[str, ModelConfig] = {
    "llama-gqa": ModelConfig(
        vocab_size=509, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=128, attention_bias=True, mlp_bias=True),
    "qwen3-kv-replicated": ModelConfig(
        arch="qwen3", vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=64, max_position_embeddings=128,
        tie_word_embeddings=True),
}


# ---- shared by the workers and the single-process reference ---------------------------------


def build(mcfg: ModelConfig, sd: dict[str, torch.Tensor], tp: TensorParallel | None, device: str = "cpu",
          dtype: torch.dtype = torch.float32) -> tuple[DecoderForCausalLM, vattn.VattnConfig, vattn.PagedKVCache]:
    cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=16 if device != "cpu" else 8))
    with vattn.set_current_vattn_config(cfg), torch.device(device), default_dtype(dtype):
        model = DecoderForCausalLM(mcfg, tp=tp)
    model.load_hf_state_dict(sd)
    model.eval()
    return model, cfg, vattn.allocate_kv_cache(cfg, num_blocks=32, device=device, dtype=dtype)


def prompts(vocab: int) -> list[tuple[list[int], int]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, vocab, (n,), generator=g).tolist(), a) for n, a in PROMPTS]


def generate(model: DecoderForCausalLM, cfg: vattn.VattnConfig, kv: Any, tp: TensorParallel | None,
             how: str = "eager") -> dict[str, Any]:
    """Greedy tokens and every sampled logits row ((MAX_TOKENS, V) per request, float32 on the CPU).

    ``how``: ``eager``; ``compiled`` (torch.compile fullgraph/dynamic, aot_eager: compile stats
    too); ``cudagraph`` / ``cudagraph-compiled`` (``vattn.CUDAGraphRunner`` over the eager /
    ``vattn.compile``d model: the runtime modes of the decode steps too).
    """
    from torch._dynamo.utils import counters

    device = next(iter(kv.tensors.values())).device
    sync = tp.broadcast_from_first if tp is not None else None
    kw: dict[str, Any] = dict(device=device, max_num_batched_tokens=BUDGET, record_logits=True, token_sync=sync)
    stats: dict[str, Any] = {}
    torch._dynamo.reset()
    counters.clear()
    if how == "compiled":
        kw.update(forward_fn=compile_model(model, cfg, "aot_eager"))
    elif how.startswith("cudagraph"):
        fn = vattn.compile(model, cfg) if how == "cudagraph-compiled" else model
        runner = vattn.CUDAGraphRunner(fn, cfg, kv, max_batch_size=8, max_model_len=64, show_progress=False,
                                       mode=vattn.CUDAGraphMode.FULL_AND_PIECEWISE)
        modes = stats.setdefault("modes", [])
        dispatch = runner.dispatch

        def counting_dispatch(common: Any) -> Any:
            bd, padded = dispatch(common)
            modes.append(bd.mode.name)
            return bd, padded

        runner.dispatch = counting_dispatch  # type: ignore[method-assign]
        kw.update(graph_runner=runner)
    if how == "compiled":
        warm = Engine(model, cfg, kv, **kw)
        warm.add_request(list(range(6)), SamplingParams(max_tokens=2))  # compile: one prefill, one decode
        warm.run()
    engine = Engine(model, cfg, kv, **kw)
    reqs = [engine.add_request(p, SamplingParams(max_tokens=MAX_TOKENS), a) for p, a in prompts(model.config.vocab_size)]
    with torch._dynamo.config.patch(error_on_recompile=how == "compiled"):
        engine.run()
    if how.startswith("cudagraph"):
        runner.release()  # before the group is destroyed: graphs holding NCCL kernels block it
    if how == "compiled":
        stats = {"unique_graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values())}
    return {"tokens": [r.output_token_ids for r in reqs],
            "logits": [torch.stack(engine.logits[r.req_id]).float() for r in reqs], **stats}


def worker(rank: int, world: int, port: int, folder: Path, device_type: str) -> None:
    """One rank: join the group (gloo on the CPU, NCCL on GPU ``rank``) through the parent's store,
    run every case, save the results, leave the group."""
    torch.set_num_threads(1)
    cuda = device_type == "cuda"
    device = f"cuda:{rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=120), device_id=torch.device(device) if cuda else None)
    tp = TensorParallel(rank, world, dist.group.WORLD)
    out: dict[str, Any] = {}
    sub = tp.subgroup(1)  # groups of one rank each: this rank alone
    out["subgroup"] = (sub.rank, sub.size, dist.get_process_group_ranks(sub.group), tp.subgroup(world) is tp)
    if cuda:
        out["ops"] = all_reduce_errors(tp, torch.device(device))
        out["fused_ops"] = fused_norm_errors(tp, torch.device(device))
    for name, mcfg in CASES.items():
        sd = torch.load(folder / f"{name}.pt")
        model, cfg, kv = build(mcfg, sd, tp, device, torch.bfloat16 if cuda else torch.float32)
        attn = model.model.layers[0].self_attn.attn
        out[name] = {"eager": generate(model, cfg, kv, tp), "heads": (attn.num_heads, attn.num_kv_heads),
                     "kv_shape": tuple(next(iter(kv.tensors.values())).shape)}
        for how in ("cudagraph", "cudagraph-compiled") if cuda else ("compiled",):
            out[name][how] = generate(model, cfg, kv, tp, how)
        if not cuda:  # the model through vattn_examples::all_reduce_add_rms_norm, which falls back in the op
            with fused_norm_declining(tp) as asked:
                out[name]["compiled-fused-op"] = generate(model, cfg, kv, tp, "compiled")
            out[name]["compiled-fused-op"]["op_calls"] = len(asked)
        if cuda and tp.enable_fused_norm(BUDGET, mcfg.hidden_size, torch.bfloat16, torch.device(device)):
            for how in ("cudagraph", "cudagraph-compiled"):
                out[name][f"fused {how}"] = generate(model, cfg, kv, tp, how)
            tp.disable_fused_norm()
        if cuda and tp.enable_symm_mem(BUDGET, mcfg.hidden_size, torch.bfloat16, torch.device(device)):
            for algo in ("one_shot", "two_shot"):  # every message of these steps fits either
                tp.algorithm = algo
                out[name][algo] = generate(model, cfg, kv, tp, "cudagraph")
            tp.algorithm = "auto"
            tp.disable_symm_mem()
    torch.save(out, folder / f"rank{rank}.pt")
    leave_tensor_parallel(torch.device(device))


def all_reduce_errors(tp: TensorParallel, device: torch.device) -> dict[str, Any]:
    """Max error of ``vattn_examples::all_reduce`` per algorithm and shape, eager and replayed from a
    CUDA graph, against the exact sum (each rank's values are small integers: bf16 sums are exact)."""
    shapes = [(1, 4096), (3, 4096), (64, 4096), (5, 136), (700, 4096)]
    if not tp.enable_symm_mem(max(s[0] for s in shapes), 4096, torch.bfloat16, device):
        return {"symm_mem": False}
    errors: dict[str, Any] = {"symm_mem": True, "chosen": {}}
    for algo in ("auto", "one_shot", "two_shot", "nccl"):
        tp.algorithm = algo
        for shape in shapes:
            g = torch.Generator(device="cpu").manual_seed(7)
            parts = torch.randint(-8, 8, (tp.size, *shape), generator=g).to(device, torch.bfloat16)
            x = parts[tp.rank].clone()
            eager = tp.all_reduce(x)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = tp.all_reduce(x)
            x.copy_(parts[tp.rank] * 2)
            graph.replay()
            torch.cuda.synchronize(device)
            want = parts.float().sum(0)
            errors[f"{algo} {shape}"] = max((eager.float() - want).abs().max().item(),
                                            (captured.float() - 2 * want).abs().max().item())
            del graph
            if algo == "auto":
                errors["chosen"][str(shape)] = tp.symm_mem.choose(x)
    tp.algorithm = "auto"
    tp.disable_symm_mem()
    return errors


@contextmanager
def fused_norm_declining(tp: TensorParallel) -> Iterator[list[int]]:
    """The group looks fused to the model (it calls ``vattn_examples::all_reduce_add_rms_norm``)
    but the workspace serves no message, so every call takes the op's own fallback. Yields the
    token count of every call the op made."""
    from examples import allreduce

    asked: list[int] = []

    class Declines:
        def fits(self, x: torch.Tensor) -> bool:  # the plain all-reduce (embedding, fallback)
            return False

        def serves(self, x: torch.Tensor, *args: Any) -> bool:
            asked.append(x.shape[0])
            return False

    allreduce._FUSED[tp.group_name] = Declines()  # type: ignore[assignment]
    try:
        yield asked
    finally:
        allreduce._FUSED.pop(tp.group_name)


def fused_norm_errors(tp: TensorParallel, device: torch.device) -> dict[str, Any]:
    """Max error of ``vattn_examples::all_reduce_add_rms_norm`` (FlashInfer's kernel where it is
    enabled, the fallback past its workspace) per shape, eager and replayed from a CUDA graph, against
    a float32 reference over every rank's random partial sums (bf16 in and out)."""
    hidden, max_tokens = 4096, 64
    if not tp.enable_fused_norm(max_tokens, hidden, torch.bfloat16, device):
        return {"fused": False}
    errors: dict[str, Any] = {"fused": True}
    eps = 1e-5
    for tokens in (1, 3, 64, 100):  # 100: past the workspace, the op's fallback
        g = torch.Generator(device="cpu").manual_seed(tokens)
        parts = torch.randn(tp.size, tokens, hidden, generator=g).to(device, torch.bfloat16)
        residual = torch.randn(tokens, hidden, generator=g).to(device, torch.bfloat16)
        weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(device, torch.bfloat16)
        x = parts[tp.rank].clone()

        def op() -> tuple[torch.Tensor, torch.Tensor]:
            return torch.ops.vattn_examples.all_reduce_add_rms_norm(x, residual, weight, eps, tp.group_name)

        eager, eager_sum = op(), tp.all_reduce(x)  # the plain one: FlashInfer's kernel up to 64 tokens
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured, captured_sum = op(), tp.all_reduce(x)
        x.copy_(-parts[tp.rank])
        graph.replay()
        torch.cuda.synchronize(device)
        for sign, (normed, summed), reduced in ((1, eager, eager_sum), (-1, captured, captured_sum)):
            total = sign * parts.float().sum(0)
            want = total + residual.float()
            want_norm = weight.float() * want * torch.rsqrt(want.pow(2).mean(-1, keepdim=True) + eps)
            errors[f"{tokens} sum {sign:+d}"] = ((summed.float() - want).abs().max() / want.abs().max()).item()
            errors[f"{tokens} norm {sign:+d}"] = ((normed.float() - want_norm).abs().max() / want_norm.abs().max()).item()
            errors[f"{tokens} all_reduce {sign:+d}"] = ((reduced.float() - total).abs().max() / total.abs().max()).item()
        del graph
    tp.disable_fused_norm()
    return errors


# ---- the tests ------------------------------------------------------------------------------


def make_hf_state_dict(mcfg: ModelConfig) -> dict[str, torch.Tensor]:
    transformers = pytest.importorskip("transformers")
    hf_cfg = mcfg.to_hf(attn_implementation="eager")
    cls = transformers.LlamaForCausalLM if mcfg.arch == "llama" else transformers.Qwen3ForCausalLM
    hf = cls(hf_cfg).eval()
    init_random_weights(hf, seed=0, std=0.05)
    return {k: v.clone() for k, v in hf.state_dict().items()}


def launch(folder: Path, device_type: str, world: int = WORLD) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Start the two workers, compute the single-process reference meanwhile, return (ref, per-rank results)."""
    sds = {name: make_hf_state_dict(mcfg) for name, mcfg in CASES.items()}
    for name, sd in sds.items():
        torch.save(sd, folder / f"{name}.pt")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(world), str(store.port), str(folder),
                               device_type], env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    device, dtype = ("cuda:0", torch.bfloat16) if device_type == "cuda" else ("cpu", torch.float32)
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:  # the reference runs while the workers do
        ref = {name: generate(*build(mcfg, sds[name], None, device, dtype), None) for name, mcfg in CASES.items()}
        logs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        torch.set_num_threads(old)
        for p in procs:
            p.kill()
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {r} failed (exit {p.returncode}):\n{log[-4000:]}"
    return ref, [torch.load(folder / f"rank{r}.pt") for r in range(world)]


def worker_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's pairs on 127.0.0.1, not the host's address
    return env


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every rank's results and the single-process reference, per case (CPU, gloo, float32)."""
    ref, ranks = launch(tmp_path_factory.mktemp("tp"), "cpu")
    return {"ref": ref, "ranks": ranks}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("mode", ["eager", "compiled", "compiled-fused-op"])
def test_tp2_matches_single_process(runs: dict[str, Any], name: str, mode: str) -> None:
    """Same greedy tokens and sampled logits (1e-4) as one process, on every rank; also through
    the fused all-reduce + RMSNorm op (its fallback: FlashInfer's kernel needs GPUs)."""
    ref = runs["ref"][name]
    assert ref["logits"][0].abs().max() > 1.0  # logits large enough for 1e-4 to mean something
    for rank, res in enumerate(runs["ranks"]):
        got = res[name][mode]
        assert got["tokens"] == ref["tokens"], f"rank {rank} {mode}: tokens differ"
        for i, (a, b) in enumerate(zip(got["logits"], ref["logits"])):
            assert a.shape == b.shape == (MAX_TOKENS, CASES[name].vocab_size)
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0, msg=lambda m: f"rank {rank} {mode} req {i}: {m}")
        if mode != "eager":
            assert got["graph_breaks"] == 0 and got["unique_graphs"] == 1, got
        if mode == "compiled-fused-op":  # 2 per layer a step: the op ran, not the unfused path
            assert got["op_calls"] >= 2 * CASES[name].num_hidden_layers * MAX_TOKENS, got["op_calls"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_tp2_heads_and_kv_cache_per_rank(runs: dict[str, Any], name: str) -> None:
    """Each rank's attention layer and KV cache hold its share of heads (KV replicated past Hk)."""
    mcfg = CASES[name]
    for res in runs["ranks"]:
        h, hk = res[name]["heads"]
        assert h == mcfg.num_attention_heads // WORLD
        assert hk == max(1, mcfg.num_key_value_heads // WORLD)
        assert hk in res[name]["kv_shape"] and res[name]["kv_shape"][-1] == mcfg.head_dim


def test_subgroups_of_consecutive_ranks(runs: dict[str, Any]) -> None:
    """``TensorParallel.subgroup(n)``: every rank in the group of n consecutive ranks holding it."""
    assert [r["subgroup"] for r in runs["ranks"]] == [(0, 1, [rank], True) for rank in range(WORLD)]


def assert_bf16_close_until_tie(got: dict[str, Any], ref: dict[str, Any], what: str) -> None:
    """bf16 parity of two runs: per request, tokens equal up to the first position where the
    reference's top-2 logits are a near-tie (gap < 0.25; the sequences diverge after it), and the
    logits rows up to there within bf16 tolerance (the summation order differs across TP sizes)."""
    for i, (gt, rt, gl, rl) in enumerate(zip(got["tokens"], ref["tokens"], got["logits"], ref["logits"])):
        k = next((j for j, (a, b) in enumerate(zip(gt, rt)) if a != b), len(rt))
        if k < len(rt):
            top2 = rl[k].topk(2).values
            assert top2[0] - top2[1] < 0.25, (
                f"{what} request {i}: token {k} is {gt[k]}, expected {rt[k]} (top-2 gap {top2[0] - top2[1]:.3f})")
        diff = (gl[: k + 1] - rl[: k + 1]).abs()
        assert diff.max() < 0.25 and diff.mean() < 0.03, f"{what} request {i}: max {diff.max():.3f}, mean {diff.mean():.4f}"


@pytest.mark.cuda
@pytest.mark.parametrize("world", [2, 4])
def test_tp_nccl_bf16_matches_tp1_and_graphs_match_eager(tmp_path: Path, world: int) -> None:
    """2 and 4 GPUs, NCCL, bf16: TP=n gives TP=1's greedy tokens (up to near-ties); CUDA-graph
    replay (full decode graphs containing the all-reduces; eager and vattn.compile'd model; the
    symmetric-memory one-shot and two-shot all-reduces where available; FlashInfer's fused
    all-reduce + RMSNorm where it is installed) gives the eager TP=n run's tokens and logits; the
    all-reduce op is exact on integer data for every algorithm, eagerly and replayed, and ``auto``
    picks one-shot for a decode token's message; the fused op matches a float32 reference."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs (device kind nvidia-h100-x{world} or nvidia-h200-x{world})")
    ref, ranks = launch(tmp_path, "cuda", world)
    for rank, res in enumerate(ranks):
        ops = res["ops"]
        if ops["symm_mem"]:
            bad = {k: v for k, v in ops.items() if isinstance(v, float) and v != 0.0}
            assert not bad, f"rank {rank}: all-reduce errors {bad}"
            assert ops["chosen"]["(1, 4096)"] == "one_shot" and ops["chosen"]["(5, 136)"] == "one_shot", ops["chosen"]
        fused = res["fused_ops"]
        if fused["fused"]:  # bf16 outputs of float32 math: within a few bf16 ulps of the largest value
            bad = {k: v for k, v in fused.items() if isinstance(v, float) and not v < 2e-2}
            assert not bad, f"rank {rank}: fused all-reduce + RMSNorm errors {bad}"
    for name in CASES:
        for rank, res in enumerate(ranks):
            r = res[name]
            assert_bf16_close_until_tie(r["eager"], ref[name], f"{name} rank {rank}: TP={world} eager vs TP=1")
            for how in ("cudagraph", "cudagraph-compiled", "one_shot", "two_shot", "fused cudagraph",
                        "fused cudagraph-compiled"):
                if how not in r:
                    if how.startswith("fused"):
                        assert not res["fused_ops"]["fused"], how
                        continue  # no FlashInfer (or no P2P) here: the unfused path only
                    assert how in ("one_shot", "two_shot") and not res["ops"]["symm_mem"], how
                    continue  # no P2P / symmetric memory on this machine: NCCL only
                assert "FULL" in r[how]["modes"], f"{name} {how}: no full-graph replay ({set(r[how]['modes'])})"
                assert_bf16_close_until_tie(r[how], r["eager"], f"{name} rank {rank}: {how} vs eager")
        assert all(res[name]["eager"]["tokens"] == ranks[0][name]["eager"]["tokens"] for res in ranks)


# ---- in one process: shapes, sharding, errors ------------------------------------------------


@pytest.mark.parametrize("tp_size", [2, 4])
def test_init_random_weights_is_tp_invariant(tp_size: int) -> None:
    """Rank models (built without a group) get exactly the TP=1 model's weights, sliced; concatenated
    over the ranks they rebuild the full q, o_proj, MLP and vocabulary; KV rows follow the heads."""
    mcfg = ModelConfig(vocab_size=101, num_attention_heads=8, num_key_value_heads=2, head_dim=16, hidden_size=64,
                       intermediate_size=96, attention_bias=True)

    def built(tp: TensorParallel | None) -> dict[str, torch.Tensor]:
        with vattn.set_current_vattn_config(vattn.VattnConfig()):
            model = DecoderForCausalLM(mcfg, tp=tp)
        init_random_weights(model, seed=3)
        return dict(model.named_parameters())

    full = built(None)
    ranks = [built(TensorParallel(r, tp_size, None)) for r in range(tp_size)]
    q, kv, d = 8 * 16, 2 * 16, 16
    qkv = full["model.layers.1.self_attn.qkv_proj.weight"]
    cat = lambda name, dim=0: torch.cat([p[name] for p in ranks], dim=dim)  # noqa: E731
    assert torch.equal(cat("model.layers.1.self_attn.o_proj.weight", 1), full["model.layers.1.self_attn.o_proj.weight"])
    assert torch.equal(cat("model.layers.0.mlp.down_proj.weight", 1), full["model.layers.0.mlp.down_proj.weight"])
    assert torch.equal(cat("model.embed_tokens.weight")[:101], full["model.embed_tokens.weight"])
    assert torch.equal(cat("lm_head.weight")[:101], full["lm_head.weight"])
    assert not cat("lm_head.weight")[101:].any()  # vocab padding rows are zero
    for r, p in enumerate(ranks):
        local = p["model.layers.1.self_attn.qkv_proj.weight"]
        qs = q // tp_size
        assert torch.equal(local[:qs], qkv[r * qs:(r + 1) * qs])
        kv_head = r * 2 // tp_size  # one KV head per rank: 2 ranks -> heads 0, 1; 4 ranks -> 0, 0, 1, 1
        assert torch.equal(local[qs:qs + d], qkv[q + kv_head * d:q + (kv_head + 1) * d])  # k
        assert torch.equal(local[qs + d:], qkv[q + kv + kv_head * d:q + kv + (kv_head + 1) * d])  # v
        assert torch.equal(p["model.layers.1.self_attn.o_proj.bias"], full["model.layers.1.self_attn.o_proj.bias"])
        assert torch.equal(p["model.norm.weight"], full["model.norm.weight"])


def test_attention_shards_and_errors() -> None:
    q, kv = attention_shards(8, 2, 4, TensorParallel(3, 4))
    assert (q.start, q.size, kv.start, kv.size) == (3 * 2 * 4, 2 * 4, 1 * 4, 4)  # rank 3 of 4: KV head 1
    with pytest.raises(ValueError, match="num_attention_heads"):
        attention_shards(4, 2, 4, TensorParallel(0, 3))
    with pytest.raises(ValueError, match="num_key_value_heads"):
        attention_shards(12, 6, 4, TensorParallel(0, 4))
    with pytest.raises(ValueError, match="more ranks than KV heads"):
        attention_shards(12, 3, 4, TensorParallel(0, 4))
    with pytest.raises(ValueError, match="intermediate_size"):
        with vattn.set_current_vattn_config(vattn.VattnConfig()):
            DecoderForCausalLM(ModelConfig(intermediate_size=100, num_attention_heads=8, num_key_value_heads=8),
                               tp=TensorParallel(0, 8))


def test_all_reduce_names_a_wrong_algorithm() -> None:
    from examples.allreduce import DEFAULT_POLICY as policy

    with pytest.raises(ValueError, match="algorithm: expected auto, one_shot, two_shot or nccl, got 'fast'"):
        torch.ops.vattn_examples.all_reduce(torch.zeros(2), "no-group", "fast")
    assert [policy.choose(n) for n in (8 << 10, 128 << 10, 512 << 10, 8 << 20, 16 << 20)] == [
        "one_shot", "one_shot", "two_shot", "two_shot", "nccl"]


def test_fused_norm_hands_flashinfer_its_buffers() -> None:
    """``FusedNormAllReduce`` calls FlashInfer's ``trtllm_allreduce_fusion`` with the arguments it
    takes (a stand-in with its keyword signature, one rank: the sum is ``x``) and returns what the
    kernel wrote: the fused op's (normed, summed) and ``all_reduce("auto")``'s sum for messages that
    fit; shapes, dtypes and sizes it does not serve are declined. Also opcheck of the fused op."""
    from examples import allreduce

    patterns: list[int] = []

    def run(*, allreduce_in: torch.Tensor, world_size: int, world_rank: int, token_num: int, hidden_dim: int,
            workspace_ptrs: torch.Tensor, launch_with_pdl: bool, trigger_completion_at_end: bool, fp32_acc: bool,
            pattern_code: int, use_oneshot: bool | None, allreduce_out: torch.Tensor | None,
            residual_in: torch.Tensor | None, residual_out: torch.Tensor | None, norm_out: torch.Tensor | None,
            quant_out: None, scale_out: None, rms_gamma: torch.Tensor | None, rms_eps: float | None,
            scale_factor: None, layout_code: None, metadata: dict | None = None,
            block_quant_group_size: int | None = None, weight_bias: float | None = None) -> None:
        assert (world_size, world_rank, hidden_dim, token_num) == (1, 0, 16, allreduce_in.shape[0])
        patterns.append(pattern_code)
        if pattern_code == 0:
            allreduce_out.copy_(allreduce_in)
            return
        s = allreduce_in.float() + residual_in.float()
        residual_out.copy_(s)
        norm_out.copy_(rms_gamma.float() * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + rms_eps))

    state = allreduce.FusedNormAllReduce(torch.zeros(1, dtype=torch.int64), None, 0, 1, 8, 16, torch.float32,
                                         torch.device("cpu"), False, run, (0, 1))
    name = "test-fused-norm"
    allreduce._FUSED[name] = state
    try:
        g = torch.Generator().manual_seed(0)
        x, res, w = torch.randn(5, 16, generator=g), torch.randn(5, 16, generator=g), torch.rand(16, generator=g) + 0.5
        normed, summed = torch.ops.vattn_examples.all_reduce_add_rms_norm(x, res, w, 1e-6, name)
        torch.testing.assert_close(summed, x + res)
        torch.testing.assert_close(normed, allreduce.rms_norm(x + res, w, 1e-6))
        assert torch.equal(torch.ops.vattn_examples.all_reduce(x, name, "auto"), x)
        assert patterns == [1, 0]
        assert not state.serves(torch.randn(9, 16), torch.randn(9, 16), w)  # past max_tokens
        assert not state.serves(x.double(), res.double(), w.double())  # not the workspace's dtype
        assert not state.serves(x, res[:4], w) and not state.fits(torch.randn(5, 8))
        torch.library.opcheck(torch.ops.vattn_examples.all_reduce_add_rms_norm.default, (x, res, w, 1e-6, name))
    finally:
        allreduce._FUSED.pop(name)


def test_shard_without_group_cannot_run() -> None:
    with vattn.set_current_vattn_config(vattn.VattnConfig()):
        model = DecoderForCausalLM(ModelConfig(), tp=TensorParallel(1, 2, None))
    with pytest.raises(RuntimeError, match="no process group"), vattn.set_forward_context(None, vattn.VattnConfig(), dummy_run=True):
        model(torch.zeros(3, dtype=torch.long), torch.arange(3))


def run_timed(cmd: list[str], timeout: float) -> tuple[int, str, float]:
    """Run ``cmd`` (output unbuffered, stderr into stdout); return its exit code, its output, and
    the seconds from its last line of output to its exit."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(worker_env(), PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines, last = [], time.monotonic()
    deadline = last + timeout
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            last = time.monotonic()
            if last > deadline:
                break
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        proc.kill()
    return proc.returncode, "".join(lines), time.monotonic() - last


GENERATE_ARGS = ["--device", "cpu", "--preset", "tiny", "--num-requests", "2", "--prompt-len", "12", "--output-len",
                 "8", "--max-num-batched-tokens", "16", "--no-progress", "--fixed-lengths", "--seed", "3"]
# --standalone: torchrun binds a free port itself (a port picked here first could be taken by a
# parallel test before torchrun binds it).
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def test_generate_cli_under_torchrun() -> None:
    """`torchrun --nproc-per-node 2 examples/generate.py --tp 2` on gloo: rank 0 prints the
    same request-0 tokens as `--tp 1` (same seeded weights, sliced), and torchrun exits 0 within
    10 s of the last line printed (every rank left the group and ended)."""
    from examples import generate

    rc, out, tail_s = run_timed([*TORCHRUN, "examples/generate.py", "--tp", "2", *GENERATE_ARGS], timeout=180)
    assert rc == 0, out[-4000:]
    assert tail_s < 10, f"the run ended {tail_s:.1f} s after its last output"
    assert out.count("decode:") == 1 and "tp=2" in out  # rank 0 alone prints
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = generate.main(GENERATE_ARGS)
    finally:
        torch.set_num_threads(old)
    printed = re.search(r"request 0: prompt \d+ tokens -> \[([\d, ]+)\]", out)
    assert printed is not None, out
    assert [int(t) for t in printed.group(1).split(",")] == single["outputs"][0]


FAILING_RANK = """
import os, sys
sys.path.insert(0, {root!r})
from examples import engine, generate

if os.environ["RANK"] == "1":  # rank 1 fails in its third step; rank 0 is then in a collective
    step, calls = engine.Engine.step, []

    def failing_step(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected failure in step 3")
        return step(self, *args, **kwargs)

    engine.Engine.step = failing_step
generate.main(sys.argv[1:])
"""


def test_failing_rank_stops_every_rank(tmp_path: Path) -> None:
    """A rank that raises mid-run exits with its error, and the run ends (non-zero) within a few
    seconds instead of leaving the other rank waiting in a collective."""
    script = tmp_path / "failing_rank.py"
    script.write_text(FAILING_RANK.format(root=str(ROOT)))
    rc, out, tail_s = run_timed([*TORCHRUN, str(script), "--tp", "2", *GENERATE_ARGS], timeout=120)
    assert rc != 0, out[-4000:]
    assert "[rank 1/2] failed: RuntimeError: injected failure in step 3" in out, out[-4000:]
    assert tail_s < 30, f"the run ended {tail_s:.1f} s after its last output"


def test_bench_tp_cpu_smoke(tmp_path: Path) -> None:
    """benchmarks/bench_tp.py runs end to end under torchrun on gloo (no CUDA graphs) and writes its
    JSON, so the GPU run is not the first time its code executes."""
    import json

    cmd = [*TORCHRUN, "benchmarks/bench_tp.py", "--device", "cpu", "--preset", "tiny", "--batches", "1,2",
           "--context", "16", "--reps", "3"]
    r = subprocess.run(cmd, cwd=ROOT, env=dict(worker_env(), OUT=str(tmp_path)), capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    (path,) = tmp_path.glob("tp-*.json")
    data = json.loads(path.read_text())
    rows = {(row["tp"], row["allreduce"], row["batch"]): row for row in data["rows"]}
    assert set(rows) == {(1, "-", 1), (1, "-", 2), *((2, impl, b) for impl in ("auto", "nccl", "none") for b in (1, 2))}
    assert "tp2 auto" in data["summary"]["skipped"]  # symmetric memory needs CUDA: NCCL (gloo) throughout
    assert all(row["graph_ms"] > 0 and row["step_ms"] > 0 for row in rows.values())
    assert rows[(2, "nccl", 1)]["allreduce_ms"] > 0 and "comm_in_situ_ms" in rows[(2, "nccl", 2)]
    target = data["summary"]["targets"][0]
    assert (target["tp"], target["batch"]) == (2, 1)
    assert target["ratio"] == min(rows[(2, impl, 1)]["x_tp1_graph"] for impl in ("auto", "nccl"))


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    worker(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]), sys.argv[6])

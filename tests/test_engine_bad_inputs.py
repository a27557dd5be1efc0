"""Bad input to the example engine, examples/generate.py, vattn.compile and CUDAGraphRunner (issue 54,
item 6): refused where it arrives with an error naming the argument, the KV cache untouched and the
engine still working; a request that fails inside a step is finished with its error, the others go on."""

from __future__ import annotations

import logging
import math
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

import vattn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples import generate  # noqa: E402
from examples.engine import Engine, Request, SamplingParams  # noqa: E402
from examples.model import DecoderForCausalLM, ModelConfig, init_random_weights  # noqa: E402
from vattn.cudagraph import resolve_capture_sizes  # noqa: E402

VOCAB = 64
BAD_TOKEN = 13  # the injected failure's token id (absent from PROMPTS)
PROMPTS = [([1, 2, 3, 4, 5], 0), ([7, 8, 9], 0), ([20, 21, 22, 23, 24, 25, 26], 1), ([30, 31], 2)]


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


class Tiny:
    """One-layer example model (vocabulary 64) on TORCH_SDPA with a 32-block paged cache."""

    def __init__(self) -> None:
        self.cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=4))
        mc = ModelConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=64)
        with vattn.set_current_vattn_config(self.cfg):
            self.model = DecoderForCausalLM(mc, attn_backend="TORCH_SDPA")
        init_random_weights(self.model)
        self.kv = vattn.allocate_kv_cache(self.cfg, num_blocks=32, dtype=torch.float32)

    def engine(self, **kw: Any) -> Engine:
        kw.setdefault("max_num_batched_tokens", 16)
        return Engine(self.model, self.cfg, self.kv, device="cpu", check_invariants=True, **kw)

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {name: t.clone() for name, t in self.kv.tensors.items()}

    def unchanged(self, before: dict[str, torch.Tensor]) -> bool:
        return all(torch.equal(before[name], t) for name, t in self.kv.tensors.items())


@pytest.fixture(scope="module")
def tiny() -> Tiny:
    return Tiny()


def run_all(engine: Engine, prompts: list[tuple[list[int], int]], max_tokens: int = 6) -> list[Request]:
    reqs = [engine.add_request(p, SamplingParams(max_tokens=max_tokens), arrival_step=a) for p, a in prompts]
    engine.run()
    return reqs


def all_blocks_free(engine: Engine) -> bool:
    engine.allocator.check([])
    return engine.allocator.num_free == engine.allocator.num_blocks and not engine.scheduler.running


# ---- SamplingParams ---------------------------------------------------------------------------

@pytest.mark.parametrize("kw, exc, name", [
    (dict(max_tokens=2.5), TypeError, "max_tokens"),  # was 3 tokens
    (dict(max_tokens=-1), ValueError, "max_tokens"),
    (dict(max_tokens=True), TypeError, "max_tokens"),
    (dict(max_tokens="4"), TypeError, "max_tokens"),
    (dict(temperature=-0.5), ValueError, "temperature"),  # was greedy
    (dict(temperature=math.nan), ValueError, "temperature"),  # was greedy
    (dict(temperature=math.inf), ValueError, "temperature"),
    (dict(temperature=None), TypeError, "temperature"),
    (dict(temperature=0.8, top_p=0.0), ValueError, "top_p"),  # was a raw error in every later step
    (dict(top_p=-0.1), ValueError, "top_p"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(top_p=math.nan), ValueError, "top_p"),
])
def test_sampling_params_refused(kw: dict[str, Any], exc: type[Exception], name: str) -> None:
    with pytest.raises(exc, match=name):
        SamplingParams(**kw)


def test_sampling_params_numpy_scalars() -> None:
    sp = SamplingParams(max_tokens=np.int64(3), temperature=np.float32(0.5), top_p=np.float64(0.9))
    assert (type(sp.max_tokens), type(sp.temperature), type(sp.top_p)) == (int, float, float)
    assert sp.max_tokens == 3 and sp.temperature == 0.5


# ---- add_request --------------------------------------------------------------------------------

BAD_REQUESTS: dict[str, tuple[Callable[[Engine], Any], type[Exception], str]] = {
    "out of vocabulary": (lambda e: e.add_request([1, VOCAB, 2]), ValueError, r"prompt_token_ids\[1\].*vocab_size"),
    "minus one": (lambda e: e.add_request([5, -1]), ValueError, r"prompt_token_ids\[1\]"),
    "float ids": (lambda e: e.add_request([1.0, 2.7]), TypeError, r"prompt_token_ids\[0\].*float"),
    "bool id": (lambda e: e.add_request([1, True]), TypeError, r"prompt_token_ids\[1\].*bool"),
    "empty": (lambda e: e.add_request([]), ValueError, "prompt_token_ids"),
    "text": (lambda e: e.add_request("hello"), TypeError, "prompt_token_ids"),
    "nested": (lambda e: e.add_request([[1, 2, 3]]), TypeError, r"prompt_token_ids\[0\]"),
    "2-D tensor": (lambda e: e.add_request(torch.tensor([[1, 2, 3]])), TypeError, "prompt_token_ids.*1-D"),
    "float tensor": (lambda e: e.add_request(torch.tensor([1.0, 2.0])), TypeError, "prompt_token_ids.*float32"),
    "bool array": (lambda e: e.add_request(np.array([True, False])), TypeError, "prompt_token_ids.*bool"),
    "sampling dict": (lambda e: e.add_request([1, 2], {"max_tokens": 4}), TypeError, "sampling"),
    "arrival step": (lambda e: e.add_request([1, 2], arrival_step=-1), ValueError, "arrival_step"),
    "too long": (lambda e: e.add_request([1] * 40, SamplingParams(max_tokens=30)), ValueError,
                 "max_position_embeddings"),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_add_request_refused(tiny: Tiny, case: str) -> None:
    """Refused at add_request (the request never reaches a step), the cache untouched, and the
    engine runs its other requests to the same tokens as an engine that never saw the bad one."""
    call, exc, match = BAD_REQUESTS[case]
    ref = [r.output_token_ids for r in run_all(tiny.engine(), PROMPTS[:2])]
    engine = tiny.engine()
    first = engine.add_request(PROMPTS[0][0], SamplingParams(max_tokens=6))
    before = tiny.snapshot()
    with pytest.raises(exc, match=match):
        call(engine)
    assert tiny.unchanged(before)
    assert list(engine.scheduler.waiting) == [first] and not engine.scheduler.finished
    second = engine.add_request(PROMPTS[1][0], SamplingParams(max_tokens=6))
    assert second.req_id == first.req_id + 1
    engine.run()
    assert [first.output_token_ids, second.output_token_ids] == ref and all_blocks_free(engine)


def test_add_request_takes_integer_arrays(tiny: Tiny) -> None:
    """Integer numpy arrays and tensors, tuples and numpy integers are token ids like a list of int."""
    ref = run_all(tiny.engine(), [([1, 2, 3], 0)])[0].output_token_ids
    for prompt in (np.array([1, 2, 3], dtype=np.int32), torch.tensor([1, 2, 3]), (1, 2, 3),
                   [np.int64(1), 2, np.uint8(3)], range(1, 4)):
        req = run_all(tiny.engine(), [(prompt, 0)])[0]  # type: ignore[list-item]
        assert req.prompt_token_ids == [1, 2, 3] and all(type(t) is int for t in req.prompt_token_ids)
        assert req.output_token_ids == ref


def test_max_tokens_zero_finishes_at_once(tiny: Tiny) -> None:
    engine = tiny.engine()
    empty = engine.add_request([1, 2, 3], SamplingParams(max_tokens=0))
    assert empty.finished and engine.scheduler.finished == [empty] and not engine.scheduler.waiting
    other = engine.add_request([4, 5], SamplingParams(max_tokens=2))
    engine.run()
    assert empty.output_token_ids == [] and not empty.block_ids and len(other.output_token_ids) == 2
    assert all_blocks_free(engine)


@pytest.mark.parametrize("value, exc", [(0, ValueError), (-2, ValueError), (1.5, TypeError), (True, TypeError)])
def test_pad_tokens_to(tiny: Tiny, value: Any, exc: type[Exception]) -> None:
    with pytest.raises(exc, match="pad_tokens_to"):
        tiny.engine(pad_tokens_to=value)


# ---- a request that fails inside a step ------------------------------------------------------------

def failing_forward(tiny: Tiny, fails: Callable[[torch.Tensor, torch.Tensor], bool]) -> Callable[..., torch.Tensor]:
    def forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if fails(input_ids, positions):
            raise RuntimeError("injected failure")
        return tiny.model(input_ids, positions)
    return forward


INJECTED = {
    # its prompt holds the token the model fails on: the failure is in its prefill
    "prefill": (([5, BAD_TOKEN, 6], 0), lambda ids, pos: bool((ids == BAD_TOKEN).any())),
    # only it reaches position 40 (12 + 30 tokens; the others at most 7 + 30): the failure is in a
    # decode step, with its newest token still pending under async scheduling
    "decode": ((list(range(40, 52)), 0), lambda ids, pos: bool((pos == 40).any())),
}


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("where", sorted(INJECTED))
def test_failing_request_is_finished_and_the_others_go_on(tiny: Tiny, where: str, async_scheduling: bool,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    culprit_prompt, fails = INJECTED[where]
    ref = [r.output_token_ids for r in run_all(tiny.engine(async_scheduling=async_scheduling), PROMPTS, 30)]
    engine = tiny.engine(async_scheduling=async_scheduling, forward_fn=failing_forward(tiny, fails))
    before = len(engine.scheduler.finished)
    with caplog.at_level(logging.WARNING, logger="vattn.examples.engine"):
        reqs = run_all(engine, [*PROMPTS[:2], culprit_prompt, *PROMPTS[2:]], max_tokens=30)
    culprit = reqs.pop(2)
    assert isinstance(culprit.error, RuntimeError) and culprit.finished and not culprit.block_ids
    assert f"request {culprit.req_id}" in caplog.text and "injected failure" in caplog.text
    if where == "decode":
        assert len(culprit.output_token_ids) == 40 - 12 + 1 and -1 not in culprit.output_token_ids  # none pending
    assert [r.error for r in reqs] == [None] * 4 and [r.output_token_ids for r in reqs] == ref
    assert len(engine.scheduler.finished) == before + 5 and all_blocks_free(engine)


def test_failure_of_the_whole_batch_is_raised_and_leaves_the_engine_consistent(tiny: Tiny) -> None:
    """A step that fails only with every request in it (each alone runs) is raised again, having
    advanced nothing; once the cause is gone the engine finishes every request as if it never failed."""
    ref = [r.output_token_ids for r in run_all(tiny.engine(), PROMPTS[:2])]
    broken = [True]
    engine = tiny.engine(forward_fn=failing_forward(tiny, lambda ids, pos: broken[0] and ids.shape[0] > 5))
    reqs = [engine.add_request(p, SamplingParams(max_tokens=6), arrival_step=a) for p, a in PROMPTS[:2]]
    for _ in range(2):  # raised every time the batch is scheduled together; nothing advanced
        with pytest.raises(RuntimeError, match="injected failure"):
            engine.step()
        assert [r.num_computed_tokens for r in reqs] == [0, 0] and [r.error for r in reqs] == [None, None]
        engine.allocator.check(engine.scheduler.running)
    broken[0] = False
    engine.run()
    assert [r.output_token_ids for r in reqs] == ref and all_blocks_free(engine)


# ---- examples/generate.py ------------------------------------------------------------------------

@pytest.mark.parametrize("flag, value", [("--prompt-len", "0"), ("--output-len", "-1"), ("--num-requests", "0"),
                                         ("--max-num-seqs", "0"), ("--block-size", "0"), ("--top-p", "0"),
                                         ("--temperature", "-1"), ("--temperature", "nan")])
def test_generate_flags_refused(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        generate.parse_args(["--device", "cpu", flag, value])
    assert flag in capsys.readouterr().err


def test_generate_output_len_zero() -> None:
    out = generate.main(["--device", "cpu", "--preset", "tiny", "--num-requests", "3", "--prompt-len", "8",
                         "--output-len", "0", "--no-progress"])
    assert out["outputs"] == [[], [], []] and out["output_tokens"] == 0


# ---- CUDAGraphRunner and vattn.compile -----------------------------------------------------------------

def test_capture_sizes_above_max_batch_size(caplog: pytest.LogCaptureFixture) -> None:
    cfg = vattn.VattnConfig()
    with pytest.raises(ValueError, match=r"capture size .*max_batch_size=8.*capture_sizes up to 8"):
        resolve_capture_sizes(cfg, 8, [16, 32])  # was (): nothing captured, silently
    with caplog.at_level(logging.WARNING, logger="vattn.cudagraph"):
        assert resolve_capture_sizes(cfg, 8, [4, 8, 16]) == (4, 8)
    assert "(16,)" in caplog.text and "max_batch_size=8" in caplog.text


@pytest.mark.parametrize("kw, exc, name", [
    (dict(max_batch_size=8.5), TypeError, "max_batch_size"),
    (dict(max_batch_size="8"), TypeError, "max_batch_size"),
    (dict(capture_sizes=[1.5, 4]), TypeError, "capture_sizes"),
    (dict(capture_sizes=[True]), TypeError, "capture_sizes"),
    (dict(capture_sizes=4), TypeError, "capture_sizes"),
    (dict(capture_sizes=[]), ValueError, "capture_sizes"),
    (dict(config=vattn.VattnConfig(compilation=vattn.CompilationConfig(cudagraph_capture_sizes=(0, 4)))),
     ValueError, "cudagraph_capture_sizes"),
    (dict(config=vattn.VattnConfig(compilation=vattn.CompilationConfig(max_capture_size=0))),
     ValueError, "max_capture_size"),  # was (): nothing captured, silently
    (dict(max_model_len=-5), ValueError, "max_model_len"),
    (dict(max_model_len=2.5), ValueError, "max_model_len"),
    (dict(kv_cache=None), TypeError, "kv_cache"),
    (dict(kv_cache={"layer": torch.zeros(1)}), TypeError, "kv_cache"),
])
def test_cudagraph_runner_arguments(tiny: Tiny, kw: dict[str, Any], exc: type[Exception], name: str) -> None:
    args = dict(config=tiny.cfg, kv_cache=tiny.kv, show_progress=False)
    args.update(kw)
    with pytest.raises(exc, match=name):
        vattn.CUDAGraphRunner(tiny.model, args.pop("config"), args.pop("kv_cache"), **args)


@pytest.mark.parametrize("kw, exc, name", [
    (dict(splitting_ops="vattn::unified_attention"), TypeError, "splitting_ops"),
    (dict(passes="noop_elimination"), TypeError, "passes"),
    (dict(passes=("no_such_pass",)), ValueError, "no_such_pass.*noop_elimination"),  # was Dynamo's BackendCompilerFailed
    (dict(use_inductor="no"), TypeError, "use_inductor"),
    (dict(merge_packed_linears="yes"), TypeError, "merge_packed_linears"),
    (dict(inductor_compile_config={"no_such_option": 1}), ValueError, "inductor_compile_config.*no_such_option"),
    (dict(debug_dump_path=5), TypeError, "debug_dump_path"),
    (dict(cache_dir=7), TypeError, "cache_dir"),
])
def test_compile_refuses_nonsense_compilation_config(tiny: Tiny, kw: dict[str, Any], exc: type[Exception],
                                                     name: str) -> None:
    cfg = vattn.VattnConfig(compilation=vattn.CompilationConfig(**kw))
    with pytest.raises(exc, match=name):
        vattn.compile(tiny.model, cfg)


@pytest.mark.parametrize("dims, exc, match", [
    ([0], TypeError, "dynamic_arg_dims must map"),
    ({"tokens": 0}, ValueError, r"'tokens'.*\['input_ids', 'positions'\]"),
    ({"input_ids": 0.5}, TypeError, r"dynamic_arg_dims\['input_ids'\]"),
])
def test_compile_refuses_bad_dynamic_arg_dims(tiny: Tiny, dims: Any, exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        vattn.compile(tiny.model, tiny.cfg, dynamic_arg_dims=dims)


def test_compile_dynamic_dim_out_of_range_refused_before_tracing(tiny: Tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dim past the tensor's rank was taken modulo the rank (dim 5 of a (T,) tensor marked dim 0)."""
    monkeypatch.setenv("VATTN_DISABLE_COMPILE_CACHE", "1")
    step = vattn.compile(tiny.model, tiny.cfg, dynamic_arg_dims={"input_ids": 5})
    common = tiny.kv.common_metadata([3], [0], [[0]])
    before = tiny.snapshot()
    with vattn.set_forward_context(tiny.kv.build_metadata(common), tiny.cfg):
        with pytest.raises(ValueError, match=r"dynamic_arg_dims\['input_ids'\] = 5.*shape \(3,\)"):
            step(torch.tensor([1, 2, 3]), torch.arange(3))
    assert tiny.unchanged(before) and step.backend.counter.num_graphs_seen == 0

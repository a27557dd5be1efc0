"""Direct dispatch of a ``vattn.compile``d model (``vattn/compile_passes/dispatch.py``): calls
of a signature Dynamo's guards accepted once skip Dynamo, give the same output, and a
guard failure (a second graph) sends every later call back through Dynamo. Attention ops
between pieces run their Python implementation without the dispatcher."""

from __future__ import annotations

import pytest
import torch

import vattn
from vattn.compile_passes.dispatch import call_signature

from test_compile import VOCAB, Batches, build, run


class CountingDynamo:
    """Wraps ``compiled._compiled`` (the ``torch.compile`` module) to count calls through Dynamo."""

    def __init__(self, compiled: vattn.VattnCompiledModel) -> None:
        self.inner = compiled._compiled
        self.calls = 0
        object.__setattr__(compiled, "_compiled", self)

    def __call__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.calls += 1
        return self.inner(*args, **kwargs)


def test_repeated_signatures_skip_dynamo_and_match() -> None:
    model, cfg, kv = build(3, use_inductor=False)
    compiled = vattn.compile(model, cfg)
    dynamo = CountingDynamo(compiled)
    batches = Batches(kv, seed=4)
    validated: set[int] = set()
    direct = 0
    for step in range(30):
        ids, positions, common = batches.step()
        n = ids.shape[0]
        saved = {k: t.clone() for k, t in kv.tensors.items()}
        before = dynamo.calls
        got = run(compiled, cfg, kv, ids, positions, common)
        # The first call compiles; every later token count goes through Dynamo once (its
        # guards pass: the signature is recorded), then never again.
        if step > 0 and n in validated:
            assert dynamo.calls == before, n
            direct += 1
        else:
            assert dynamo.calls == before + 1, n
            if step > 0:
                validated.add(n)
        for k, t in kv.tensors.items():
            t.copy_(saved[k])
        torch.testing.assert_close(got, run(model, cfg, kv, ids, positions, common))
    assert compiled.backend.counter.num_graphs_seen == 1
    assert direct > 10


def test_guard_failure_turns_direct_dispatch_off() -> None:
    """A strided reshape guards the backed token count on being 1: the 1-token step makes a
    second graph, and from then on every call goes through Dynamo (which picks the graph)."""
    model, cfg, kv = build(2, use_inductor=False, strided_reshape=True)
    compiled = vattn.compile(model, cfg)
    dynamo = CountingDynamo(compiled)
    for i, n in enumerate((5, 5, 5, 1, 5, 1, 5)):
        common = kv.common_metadata([n], [0], [[1, 2]])
        ids = torch.randint(0, VOCAB, (n,))
        before = dynamo.calls
        got = run(compiled, cfg, kv, ids, torch.arange(n), common)
        torch.testing.assert_close(got, run(model, cfg, kv, ids, torch.arange(n), common))
        if i == 2:
            assert dynamo.calls == before  # validated: direct
        if i >= 3:
            assert dynamo.calls == before + 1  # after the second graph: always Dynamo
    assert compiled.backend.counter.num_graphs_seen == 2
    assert compiled._direct.disabled


def test_check_guards_env_module_hooks_and_stances_keep_dynamo(monkeypatch: pytest.MonkeyPatch) -> None:
    model, cfg, kv = build(2, use_inductor=False)
    compiled = vattn.compile(model, cfg)
    dynamo = CountingDynamo(compiled)
    common = kv.common_metadata([3], [0], [[1]])
    ids = torch.randint(0, VOCAB, (3,))
    for _ in range(3):
        run(compiled, cfg, kv, ids, torch.arange(3), common)
    assert dynamo.calls == 2
    monkeypatch.setenv("VATTN_COMPILE_CHECK_GUARDS", "1")
    run(compiled, cfg, kv, ids, torch.arange(3), common)
    assert dynamo.calls == 3
    monkeypatch.delenv("VATTN_COMPILE_CHECK_GUARDS")
    calls = []
    handle = model.register_forward_hook(lambda *a: calls.append(1))
    run(compiled, cfg, kv, ids, torch.arange(3), common)
    assert dynamo.calls == 4 and calls == [1]  # hooks run in Module.__call__: Dynamo's path keeps them
    handle.remove()
    run(compiled, cfg, kv, ids, torch.arange(3), common)
    assert dynamo.calls == 4
    with torch.compiler.set_stance("force_eager"):
        run(compiled, cfg, kv, ids, torch.arange(3), common)
    assert dynamo.calls == 5


def test_signature_tells_apart_what_guards_check() -> None:
    a = torch.zeros(4, dtype=torch.long)
    base = call_signature((a, a), {})
    assert call_signature((torch.ones(4, dtype=torch.long), a), {}) == base  # values are not guarded
    for other in (torch.zeros(5, dtype=torch.long), torch.zeros(4, dtype=torch.int32), torch.zeros(4, 1, dtype=torch.long),
                  torch.zeros(8, dtype=torch.long)[::2], torch.zeros(4, dtype=torch.float, requires_grad=True)):
        assert call_signature((other, a), {}) != base
    with torch.inference_mode():
        inf = torch.zeros(4, dtype=torch.long)
    assert call_signature((inf, a), {}) != base
    assert call_signature((a, a), {"x": 1}) != call_signature((a, a), {"x": 2})
    with torch.autocast("cpu"):
        assert call_signature((a, a), {}) != base


def test_attention_ops_between_pieces_skip_the_dispatcher() -> None:
    model, cfg, kv = build(2, use_inductor=False)
    compiled = vattn.compile(model, cfg)
    ids, positions, common = Batches(kv, seed=5).step()
    run(compiled, cfg, kv, ids, positions, common)
    split = compiled.backend.split_gm
    for item in compiled.backend.items:
        shadow = split.__dict__.get(item.name)
        if item.is_splitting:
            assert shadow is not None and not isinstance(shadow, torch.nn.Module)
            assert "torch.ops" not in shadow.__self__.code  # the op's Python implementation
        else:
            assert shadow is not None  # the compiled piece

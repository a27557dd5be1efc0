"""``CompilationConfig.cache_dir``: one compile saves Dynamo's trace, the next loads it.

CPU: the loaded trace runs the same code as the compile that saved it (bitwise) and as eager
(within float32 rounding) over steps of changing batch composition, without Dynamo tracing
and without recompiles; a changed model source, a torn file or a torch without ahead-of-time
capture each fall back to tracing with the reason logged; a call the stored guards reject
runs through ``torch.compile``. CUDA: CUDA-graph replay of a loaded trace equals eager
(``test_cudagraph.py``'s scenario).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import vattn
from vattn.compile_passes import aot_cache

from test_compile import Batches, build, run

pytestmark = pytest.mark.skipif(aot_cache.aot_supported() is not None,
                                reason=f"{aot_cache.aot_supported()}: cache_dir is ignored on this torch")


def _dynamo_traces() -> int:
    """Frames Dynamo has traced in this process (the ahead-of-time capture included)."""
    from torch._dynamo.utils import compilation_time_metrics

    return len(compilation_time_metrics.get("bytecode_tracing", []))


def _steps(compiled, cfg, kv, n: int = 6) -> list[torch.Tensor]:
    batches = Batches(kv, seed=3)
    return [run(compiled, cfg, kv, *batches.step()) for _ in range(n)]


def _files(d: Path) -> list[Path]:
    return sorted(d.glob("*.dynamo"))


def test_second_compile_loads_the_trace_and_runs_the_same_code(tmp_path, monkeypatch) -> None:
    from vattn.compile_passes import pieces as backend_module

    model, cfg, kv = build(2, cache_dir=str(tmp_path))
    first = vattn.compile(model, cfg)
    saved = _steps(first, cfg, kv)
    assert not first.trace_loaded and [Path(first.trace_path)] == _files(tmp_path)

    eager_model, eager_cfg, eager_kv = build(2)
    for got, want in zip(saved, _steps(eager_model, eager_cfg, eager_kv)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

    # The file keeps the fake values at the split's boundaries only: every piece's outputs
    # must still be there (else the backend runs the piece on fake tensors to find them).
    traced_outputs, missing = backend_module._traced_outputs, []

    def checked(gm):
        out = traced_outputs(gm)
        if out is None:
            missing.append(gm)
        return out

    monkeypatch.setattr(backend_module, "_traced_outputs", checked)
    model, cfg, kv = build(2, cache_dir=str(tmp_path))
    second = vattn.compile(model, cfg)
    traces = _dynamo_traces()
    from torch._dynamo.utils import counters

    before = {k: dict(v) for k, v in counters.items()}
    loaded = _steps(second, cfg, kv)
    # Every piece of the loaded graph is found in AOTAutograd's and Inductor's caches, which
    # the first compile filled (a loaded graph whose cache keys differ compiles again).
    n = first.backend.counter.num_inductor_compiles
    new = {(g, k): v - before.get(g, {}).get(k, 0) for g in ("aot_autograd", "inductor") for k, v in counters[g].items()}
    assert new.get(("aot_autograd", "autograd_cache_hit")) == n, new
    assert not new.get(("aot_autograd", "autograd_cache_bypass")) and not new.get(("aot_autograd", "autograd_cache_miss"))
    assert second.trace_loaded and second.trace_path == first.trace_path
    assert not missing
    assert set(second.trace_load_seconds) == {"read", "deserialize", "backend"}
    assert _dynamo_traces() == traces, "the loaded trace must not run Dynamo"
    c = second.backend.counter
    assert (c.num_graphs_seen, c.num_inductor_compiles) == (1, first.backend.counter.num_inductor_compiles)
    for got, want in zip(loaded, saved):
        assert torch.equal(got, want)


def test_default_location_keeps_the_trace_unless_disabled(tmp_path, monkeypatch) -> None:
    """``cache_dir`` None keeps the trace in ``$VATTN_CACHE_ROOT/compile`` (as vLLM's compile
    cache), so a second start loads it; ``VATTN_DISABLE_COMPILE_CACHE=1`` keeps none."""
    monkeypatch.setenv("VATTN_CACHE_ROOT", str(tmp_path / "root"))
    monkeypatch.delenv("VATTN_DISABLE_COMPILE_CACHE", raising=False)
    model, cfg, kv = build(2, use_inductor=False)
    first = vattn.compile(model, cfg)
    saved = _steps(first, cfg, kv, n=2)
    assert first.cache_dir == str(tmp_path / "root" / "compile") and not first.trace_loaded
    assert [Path(first.trace_path)] == _files(tmp_path / "root" / "compile")
    model, cfg, kv = build(2, use_inductor=False)
    second = vattn.compile(model, cfg)
    for got, want in zip(_steps(second, cfg, kv, n=2), saved):
        assert torch.equal(got, want)
    assert second.trace_loaded and second.trace_path == first.trace_path

    monkeypatch.setenv("VATTN_DISABLE_COMPILE_CACHE", "1")
    model, cfg, kv = build(2, use_inductor=False)
    off = vattn.compile(model, cfg)
    _steps(off, cfg, kv, n=1)
    assert off.cache_dir is None and off.trace_path is None and not off.trace_loaded
    model, cfg, kv = build(2, cache_dir=str(tmp_path / "mine"), use_inductor=False)  # set in code: kept
    mine = vattn.compile(model, cfg)
    _steps(mine, cfg, kv, n=1)
    assert [Path(mine.trace_path)] == _files(tmp_path / "mine")


def test_key_separates_configs_and_inputs(tmp_path) -> None:
    model, cfg, _ = build(2, cache_dir=str(tmp_path))
    ids, pos = torch.zeros(3, dtype=torch.long), torch.arange(3)
    inputs = [("input_ids", ids, (0,)), ("positions", pos, (0,))]
    key = aot_cache.cache_key(model, cfg, dynamic="backed", inputs=inputs)
    assert key == aot_cache.cache_key(model, cfg, dynamic="backed", inputs=inputs)
    assert key != aot_cache.cache_key(model, cfg, dynamic="unbacked", inputs=inputs)
    assert key != aot_cache.cache_key(model, cfg, dynamic="backed", inputs=[inputs[0], ("positions", pos, ())])
    assert key != aot_cache.cache_key(model, cfg, dynamic="backed",
                                      inputs=[("input_ids", ids.int(), (0,)), inputs[1]])
    other, other_cfg, _ = build(2, cache_dir=str(tmp_path), compile_sizes=(1,))
    assert key != aot_cache.cache_key(other, other_cfg, dynamic="backed", inputs=inputs)
    deeper, deeper_cfg, _ = build(3, cache_dir=str(tmp_path))
    assert key != aot_cache.cache_key(deeper, deeper_cfg, dynamic="backed", inputs=inputs)
    # The same parameters in another submodule class (one wrapper class, VattnCausalLM, holds
    # every transformers family): another key.
    recast, recast_cfg, _ = build(2, cache_dir=str(tmp_path))
    recast.layers[0].__class__ = type("OtherLayer", (type(recast.layers[0]),), {})
    assert key != aot_cache.cache_key(recast, recast_cfg, dynamic="backed", inputs=inputs)


MODULE = '''
import torch
from torch import nn

from test_compile import TinyLayer


class CachedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.layers = nn.ModuleList([TinyLayer(0), TinyLayer(1)])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(positions, x)
        return x
'''


def test_changed_source_traces_again(tmp_path, monkeypatch, caplog) -> None:
    src = tmp_path / "vattn_cached_model.py"
    src.write_text(textwrap.dedent(MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "vattn_cached_model", raising=False)
    module = importlib.import_module("vattn_cached_model")
    cache = tmp_path / "cache"

    def start() -> vattn.compile_passes.compiler.VattnCompiledModel:
        cfg = vattn.VattnConfig(compilation=vattn.CompilationConfig(cache_dir=str(cache), use_inductor=False))
        torch.manual_seed(0)
        with vattn.set_current_vattn_config(cfg):
            model = module.CachedModel().eval()
        compiled = vattn.compile(model, cfg)
        with vattn.set_forward_context(None, cfg, dummy_run=True):
            compiled(torch.zeros(4, dtype=torch.long), torch.arange(4))
        return compiled

    assert not start().trace_loaded
    assert start().trace_loaded
    src.write_text(textwrap.dedent(MODULE) + "\n# edited\n")
    module = importlib.reload(module)
    with caplog.at_level(logging.INFO, logger="vattn.compile"):
        edited = start()
    assert not edited.trace_loaded
    assert "is stale (changed since: vattn_cached_model)" in caplog.text
    assert start().trace_loaded  # the fresh trace replaced the stale one
    assert len(_files(cache)) == 1


def test_torn_file_is_ignored_and_replaced(tmp_path, caplog) -> None:
    model, cfg, kv = build(2, cache_dir=str(tmp_path), use_inductor=False)
    first = vattn.compile(model, cfg)
    want = _steps(first, cfg, kv, n=2)
    path = Path(first.trace_path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    model, cfg, kv = build(2, cache_dir=str(tmp_path), use_inductor=False)
    second = vattn.compile(model, cfg)
    with caplog.at_level(logging.WARNING, logger="vattn.compile"):
        got = _steps(second, cfg, kv, n=2)
    assert not second.trace_loaded and "ignoring the stored trace" in caplog.text
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    model, cfg, kv = build(2, cache_dir=str(tmp_path), use_inductor=False)
    third = vattn.compile(model, cfg)
    _steps(third, cfg, kv, n=1)
    assert third.trace_loaded


def test_call_failing_the_stored_guards_runs_through_torch_compile(tmp_path, caplog) -> None:
    model, cfg, kv = build(2, cache_dir=str(tmp_path), use_inductor=False)
    _steps(vattn.compile(model, cfg), cfg, kv, n=1)
    model, cfg, kv = build(2, cache_dir=str(tmp_path), use_inductor=False)
    compiled = vattn.compile(model, cfg)
    _steps(compiled, cfg, kv, n=2)
    assert compiled.trace_loaded
    ids, pos = torch.tensor([5, 6, 7], dtype=torch.int32), torch.arange(3)
    with caplog.at_level(logging.WARNING, logger="vattn.compile"), vattn.set_forward_context(None, cfg, dummy_run=True):
        got = compiled(ids, pos)
        want = model(ids, pos)
    assert "fails the guards of the stored trace" in caplog.text
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert compiled.backend.counter.num_graphs_seen == 2  # the stored graph, and the int32 one


def test_torch_without_aot_capture_ignores_cache_dir(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setattr(aot_cache, "aot_supported", lambda: "torch 2.9 has no ahead-of-time Dynamo capture")
    model, cfg, kv = build(2, cache_dir=str(tmp_path), use_inductor=False)
    compiled = vattn.compile(model, cfg)
    with caplog.at_level(logging.WARNING, logger="vattn.compile"):
        _steps(compiled, cfg, kv, n=2)
    assert "cache_dir is ignored: torch 2.9 has no ahead-of-time Dynamo capture" in caplog.text
    assert compiled.trace_path is None and not os.listdir(tmp_path)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", [vattn.CUDAGraphMode.FULL_AND_PIECEWISE, vattn.CUDAGraphMode.PIECEWISE],
                         ids=lambda m: m.name)
def test_replay_of_a_loaded_trace_equals_eager(tmp_path, mode: vattn.CUDAGraphMode) -> None:
    from test_cudagraph import CUDA_MODEL, _backend, _scenario

    backend = _backend("TRITON_ATTN")

    def start() -> tuple:
        model, cfg, kv = build(2, attn_backend=backend, cache_dir=str(tmp_path), **CUDA_MODEL)  # type: ignore[arg-type]
        compiled = vattn.compile(model, cfg)
        common = kv.common_metadata([3], [0], [[1]])
        with vattn.set_forward_context(kv.build_metadata(common), cfg):
            compiled(torch.zeros(3, dtype=torch.long, device="cuda"), torch.arange(3, device="cuda"))
        return compiled, cfg, kv

    assert not start()[0].trace_loaded
    compiled, cfg, kv = start()
    assert compiled.trace_loaded
    _scenario("TRITON_ATTN", mode, compiled, cfg, kv, "cuda-loaded-trace")

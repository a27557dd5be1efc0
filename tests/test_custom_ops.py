"""Every vattn:: op passes torch.library.opcheck on CPU, and mutates exactly what it declares."""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

import vattn
from vattn.ops.kv_store import store_kv

H, HK, D = 4, 2, 16


def _setup(cfg):
    layer = vattn.Attention(H, D, D**-0.5, num_kv_heads=HK, prefix="op.attn")
    kv = vattn.allocate_kv_cache(cfg, num_blocks=8, dtype=torch.float32)
    md = kv.build_metadata(kv.common_metadata([1, 3], [4, 0], [[2], [5]]))
    return layer, kv, md


def test_schemas_declare_exact_mutations():
    ops = torch.ops.vattn
    mutated = {
        name: [a.name for a in getattr(ops, name).default._schema.arguments if a.alias_info and a.alias_info.is_write]
        for name in ("unified_attention_with_output", "unified_attention", "maybe_calc_kv_scales", "reshape_and_cache_flash")
    }
    assert mutated == {
        "unified_attention_with_output": ["output"],
        "unified_attention": [],
        "maybe_calc_kv_scales": ["q_scale", "k_scale", "v_scale"],
        "reshape_and_cache_flash": ["key_cache", "value_cache"],
    }
    assert str(ops.unified_attention_with_output.default._schema).endswith("-> ()")


def test_opcheck_attention_ops(vattn_config):
    layer, kv, md = _setup(vattn_config)
    q, k, v = torch.randn(4, H, D), torch.randn(4, HK, D), torch.randn(4, HK, D)
    with vattn.set_forward_context(md, vattn_config):
        opcheck(torch.ops.vattn.unified_attention_with_output.default, (q, k, v, torch.empty(4, H, D), "op.attn"))
        opcheck(torch.ops.vattn.unified_attention.default, (q, k, v, "op.attn"))
        out = torch.empty(4, H, D)
        torch.ops.vattn.unified_attention_with_output(q, k, v, out, "op.attn")
        assert torch.equal(torch.ops.vattn.unified_attention(q, k, v, "op.attn"), out)


def test_opcheck_calc_scales_and_cache_write(vattn_config):
    layer, kv, md = _setup(vattn_config)
    q, k, v = torch.randn(4, H, D), torch.randn(4, HK, D), torch.randn(4, HK, D)
    with vattn.set_forward_context(md, vattn_config):
        opcheck(
            torch.ops.vattn.maybe_calc_kv_scales.default,
            (q, k, v, torch.ones(()), torch.ones(()), torch.ones(()), "op.attn"),
        )
    cache = torch.randn(2, 8, 16, HK, D)
    slots = torch.tensor([3, -1, 17, 40])
    opcheck(torch.ops.vattn.reshape_and_cache_flash.default,
            (k, v, cache[0], cache[1], slots, "auto", torch.ones(()), torch.ones(())))


def test_store_kv_skips_padding_and_quantizes():
    k, v = torch.randn(4, HK, D), torch.randn(4, HK, D)
    cache = torch.randn(2, 4, 8, HK, D)
    before = cache.clone()
    slots = torch.tensor([3, -1, 9, -5])
    store_kv(k, v, cache[0], cache[1], slots, "auto", torch.ones(()), torch.ones(()))
    written = torch.zeros(2, 4, 8, dtype=torch.bool)
    written[:, 0, 3] = written[:, 1, 1] = True
    assert torch.equal(cache[0, 0, 3], k[0]) and torch.equal(cache[1, 1, 1], v[2])
    assert torch.equal(cache[~written], before[~written])

    fp8 = torch.zeros(2, 4, 8, HK, D, dtype=torch.float8_e4m3fn)
    store_kv(k * 100, v, fp8[0], fp8[1], slots, "fp8", torch.tensor(2.0), torch.tensor(0.5))
    back = fp8[0, 0, 3].float() * 2.0
    torch.testing.assert_close(back, (k[0] * 100).clamp(-896, 896), rtol=0.07, atol=0.05)
    # HND physical layout: a permuted view receives the same values.
    hnd = torch.zeros(2, 4, HK, 8, D).permute(0, 1, 3, 2, 4)
    store_kv(k, v, hnd[0], hnd[1], slots, "auto", torch.ones(()), torch.ones(()))
    assert torch.equal(hnd[0, 0, 3], k[0])


def test_compiled_graph_keeps_op_opaque(vattn_config):
    layer, kv, md = _setup(vattn_config)
    seen = []

    def backend(gm, inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    fn = torch.compile(layer, backend=backend, fullgraph=True)
    with vattn.set_forward_context(md, vattn_config):
        fn(torch.randn(4, H * D), torch.randn(4, HK * D), torch.randn(4, HK * D))
    assert "vattn.unified_attention_with_output" in seen


def test_eager_calls_skip_the_dispatcher_only_where_nothing_traces(vattn_config):
    """An eager call in inference runs the op's implementation directly, with the op's result; a
    tracer (make_fx's dispatch mode) still records the one opaque op, and inputs that need grad
    take the op too."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from vattn.ops.library import eager_direct_ok

    layer, kv, md = _setup(vattn_config)
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(4, H * D, generator=g), torch.randn(4, HK * D, generator=g), torch.randn(4, HK * D, generator=g)
    seen = []

    def probe(q, k, v):
        seen.append(eager_direct_ok(q, k, v))
        return layer(q, k, v)

    with vattn.set_forward_context(md, vattn_config):
        cache = kv.tensors["op.attn"].clone()
        with torch.no_grad():
            direct = probe(q, k, v)
        kv.tensors["op.attn"].copy_(cache)
        out = torch.empty(4, H, D)
        torch.ops.vattn.unified_attention_with_output(q.view(4, H, D), k.view(4, HK, D), v.view(4, HK, D), out,
                                                      "op.attn")
        assert torch.equal(direct, out.view(4, H * D))
        gm = make_fx(probe)(q, k, v)
        assert [str(n.target) for n in gm.graph.nodes if "vattn" in str(n.target)] == [
            "vattn.unified_attention_with_output.default"]
        with torch.enable_grad():
            probe(q.clone().requires_grad_(), k, v)
    assert seen == [True, False, False]


def test_op_refuses_output_scale_before_writing(vattn_config):
    """The op, not each impl, refuses ``output_scale`` for a backend that declares no quantized
    output (``Capabilities.output_quant``): before the cache or the output is touched."""
    layer, kv, md = _setup(vattn_config)
    assert not layer.attn_backend.capabilities.output_quant
    q, k, v = torch.randn(4, H, D), torch.randn(4, HK, D), torch.randn(4, HK, D)
    out = torch.full((4, H, D), 7.0)
    before = [t.clone() for t in layer.kv_cache]
    with vattn.set_forward_context(md, vattn_config):
        with pytest.raises(NotImplementedError, match=r"op.attn: \w+ does not write quantized output.*output_scale=None"):
            torch.ops.vattn.unified_attention_with_output(q, k, v, out, "op.attn", output_scale=torch.tensor(1.0))
    assert torch.equal(out, torch.full((4, H, D), 7.0))
    assert all(torch.equal(a, b) for a, b in zip(before, layer.kv_cache))

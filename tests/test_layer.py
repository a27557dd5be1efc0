"""vattn.Attention: construction, registration, errors, forward through the op, compile."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vattn
from vattn.core.enums import AttentionType

H, HK, D, BS = 4, 2, 16, 4


def _layer(prefix: str = "l0", **kw) -> vattn.Attention:
    return vattn.Attention(H, D, D**-0.5, num_kv_heads=HK, prefix=prefix, **kw)


def _reference(q, k_all, v_all, q_pos):
    """Causal GQA attention of queries at absolute positions q_pos over k_all/v_all (float64)."""
    qh = q.view(-1, H, D).double()
    k = k_all.view(-1, HK, D).double().repeat_interleave(H // HK, dim=1)
    v = v_all.view(-1, HK, D).double().repeat_interleave(H // HK, dim=1)
    s = torch.einsum("thd,shd->hts", qh, k) * D**-0.5
    mask = torch.arange(k.shape[0])[None, :] > q_pos[:, None]
    s = s.masked_fill(mask[None], float("-inf"))
    return torch.einsum("hts,shd->thd", s.softmax(-1), v).reshape(-1, H * D)


def test_registers_and_repr(vattn_config):
    a = _layer("model.layers.0.attn")
    assert vattn_config.compilation.static_forward_context["model.layers.0.attn"] is a
    assert "num_kv_heads=2" in repr(a) and a.backend.name == "CPU_ATTN"
    assert a.use_output and not a.use_direct_call


def test_layer_scales_follow_the_module(vattn_config):
    """Impls read a layer's fp8 scales through ``layer_scales`` (from ``_buffers``): the tensors
    the module holds now, after ``set_kv_scales`` and after ``.to()`` replaced them; another
    layer object's by attribute."""
    from types import SimpleNamespace

    from vattn.ops.kv_store import layer_scales

    a = _layer()
    a.set_kv_scales(0.5, 0.25, q_scale=2.0)
    assert [t.item() for t in layer_scales(a)] == [0.5, 0.25, 2.0]
    a.to(torch.float64)  # buffers replaced by new tensors
    k, v, q = layer_scales(a)
    assert k is a._k_scale and v is a._v_scale and q is a._q_scale and k.dtype == torch.float64
    other = SimpleNamespace(_k_scale=torch.tensor(3.0), _v_scale=torch.tensor(4.0), _q_scale=torch.tensor(5.0))
    assert [t.item() for t in layer_scales(other)] == [3.0, 4.0, 5.0]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_kv_heads=3), "num_kv_heads: expected a divisor"),
        (dict(attn_type="bogus"), "attn_type must be one of"),
        (dict(prefix=""), "prefix must be"),
        (dict(attn_backend="NOPE"), "NOPE"),
        (dict(kv_sharing_target_layer_name="later"), "kv_sharing_target_layer_name"),
    ],
)
def test_constructor_errors(vattn_config, kwargs, match):
    args = dict(num_kv_heads=HK, prefix="x")
    args.update(kwargs)
    with pytest.raises((ValueError, KeyError)) as e:
        vattn.Attention(H, D, 1.0, **args)
    assert match.split()[0] in str(e.value)


@pytest.mark.parametrize("name", ["TORCH_SDPA", "TRITON_ATTN", "FLASHINFER", "FLASH_ATTN", "FLEX_ATTENTION"])
def test_impl_rejects_num_kv_heads_not_dividing(name):
    """Impls built directly (not through vattn.Attention) refuse GQA groups of unequal size."""
    impl_cls = vattn.AttentionBackendEnum[name].get_class().get_impl_cls()
    with pytest.raises(ValueError, match="num_kv_heads: expected a divisor of num_heads = 8, got 3"):
        impl_cls(8, 64, 0.125, 3)


def test_duplicate_name_and_kv_sharing(vattn_config):
    _layer("a")
    with pytest.raises(ValueError, match="Duplicate layer name: 'a'"):
        _layer("a")
    shared = _layer("b", kv_sharing_target_layer_name="a")
    assert shared.kv_sharing_target_layer_name == "a"
    _layer("enc", attn_type=AttentionType.ENCODER_ONLY)
    with pytest.raises(ValueError, match="same attention type"):
        _layer("c", kv_sharing_target_layer_name="enc")
    kv = vattn.allocate_kv_cache(vattn_config, num_blocks=4, dtype=torch.float32)
    assert shared.kv_cache[0] is vattn_config.compilation.static_forward_context["a"].kv_cache[0]
    assert "enc" not in kv.tensors


def test_unsupported_cache_dtype_and_e5m2_checkpoint(vattn_config):
    with pytest.raises(ValueError, match="cache_dtype"):
        vattn.CacheConfig(cache_dtype="int4")

    class _Method:
        def create_weights(self, layer):
            layer.k_scale = nn.Parameter(torch.tensor(1.0))

        def process_weights_after_loading(self, layer):
            layer.set_kv_scales(float(layer.k_scale), float(layer.k_scale))

    class _QuantConfig:
        def get_quant_method(self, layer, prefix):
            return _Method()

    cc = vattn.CacheConfig(cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="fp8_e5m2"):
        vattn.Attention(H, D, 1.0, num_kv_heads=HK, prefix="q", cache_config=cc, quant_config=_QuantConfig())
    ok = vattn.Attention(H, D, 1.0, num_kv_heads=HK, prefix="q2",
                         cache_config=vattn.CacheConfig(cache_dtype="fp8"), quant_config=_QuantConfig())
    ok.k_scale.data.fill_(0.5)
    ok.process_weights_after_loading(torch.float32)
    assert ok._k_scale_float == 0.5 and float(ok._v_scale) == 0.5


def _run_steps(layers, kv, cfg, steps, seed=0):
    """Feed prefill then decodes; returns outputs per step and the full K/V history per request."""
    g = torch.Generator().manual_seed(seed)
    outs = []
    for query_lens, computed, tables in steps:
        common = kv.common_metadata(query_lens, computed, tables)
        md = kv.build_metadata(common)
        t = sum(query_lens)
        q = torch.randn(t, H * D, generator=g)
        k = torch.randn(t, HK * D, generator=g)
        v = torch.randn(t, HK * D, generator=g)
        with vattn.set_forward_context(md, cfg):
            outs.append((q, k, v, [layer(q, k, v) for layer in layers]))
    return outs


def test_forward_matches_dense_reference_over_steps(vattn_config):
    layer = _layer("a")
    kv = vattn.allocate_kv_cache(vattn_config, num_blocks=16, dtype=torch.float32)
    tables = [[3, 7, 1], [5, 2]]
    steps = [([5, 3], [0, 0], tables), ([1, 1], [5, 3], tables), ([1, 4], [6, 4], tables)]
    hist_k = {0: [], 1: []}
    hist_v = {0: [], 1: []}
    for query_lens, computed, _tables in steps:
        (q, k, v, (out,)) = _run_steps([layer], kv, vattn_config, [(query_lens, computed, _tables)],
                                       seed=sum(computed))[0]
        start = 0
        for r, n in enumerate(query_lens):
            hist_k[r].append(k[start:start + n])
            hist_v[r].append(v[start:start + n])
            ref = _reference(q[start:start + n], torch.cat(hist_k[r]), torch.cat(hist_v[r]),
                             torch.arange(computed[r], computed[r] + n))
            torch.testing.assert_close(out[start:start + n].double(), ref, atol=1e-5, rtol=1e-5)
            start += n


def test_rope_rows_rotate_q_and_k(vattn_config):
    """``layer(q, k, v, rope=(cos, sin))`` with unrotated q / k equals the layer over q / k rotated
    first (``vattn.ops.rotary.apply_rotary``): output and cache, over a prefill and decodes
    (TORCH_SDPA, which rotates in the op); bad rows are refused before anything is written."""
    from vattn.ops.rotary import apply_rotary

    layers = [_layer("plain"), _layer("rope")]
    kv = vattn.allocate_kv_cache(vattn_config, num_blocks=16, dtype=torch.float32)
    tables = [[3, 7, 1], [5, 2]]
    g = torch.Generator().manual_seed(5)
    for query_lens, computed in (([5, 3], [0, 0]), ([1, 1], [5, 3])):
        md = kv.build_metadata(kv.common_metadata(query_lens, computed, tables))
        t = sum(query_lens)
        q, k = torch.randn(t, H * D, generator=g), torch.randn(t, HK * D, generator=g)
        v = torch.randn(t, HK * D, generator=g)
        angle = torch.rand(t, D // 2, generator=g) * 30
        cos, sin = torch.cat((angle, angle), -1).cos(), torch.cat((angle, angle), -1).sin()
        with vattn.set_forward_context(md, vattn_config):
            want = layers[0](apply_rotary(q.view(t, H, D), cos, sin), apply_rotary(k.view(t, HK, D), cos, sin), v)
            got = layers[1](q, k, v, rope=(cos, sin))
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert torch.equal(layers[0].kv_cache[0], layers[1].kv_cache[0])
    before = layers[1].kv_cache[0].clone()
    with vattn.set_forward_context(md, vattn_config):
        with pytest.raises(ValueError, match=r"rope_cos must be \(T >= 2, head_size = 16\)"):
            layers[1](q, k, v, rope=(cos[:, :8], sin[:, :8]))
        with pytest.raises(ValueError, match="rope_cos and rope_sin come together"):
            layers[1](q, k, v, rope=(cos, None))
    assert torch.equal(layers[1].kv_cache[0], before)


def test_input_errors(vattn_config):
    layer = _layer("a")
    with pytest.raises(RuntimeError, match="no vattn forward context"):
        layer(torch.randn(2, H * D), torch.randn(2, HK * D), torch.randn(2, HK * D))
    common = vattn.build_common_attn_metadata([2], [0], [[0]], BS)
    with vattn.set_forward_context({}, vattn_config):
        with pytest.raises(KeyError, match="no attention metadata for layer 'a'"):
            layer(torch.randn(2, H * D), torch.randn(2, HK * D), torch.randn(2, HK * D))
    with vattn.set_forward_context(common, vattn_config):
        with pytest.raises(ValueError, match="query last dim"):
            layer(torch.randn(2, H * D + 1), torch.randn(2, HK * D), torch.randn(2, HK * D))
        with pytest.raises(ValueError, match="key last dim"):
            layer(torch.randn(2, H * D), torch.randn(2, H * D), torch.randn(2, HK * D))
        with pytest.raises(TypeError, match="dtype"):
            layer(torch.randn(2, H * D), torch.randn(2, HK * D).half(), torch.randn(2, HK * D))
        with pytest.raises(ValueError, match="value has 1 tokens but query has 2"):
            layer(torch.randn(2, H * D), torch.randn(2, HK * D), torch.randn(1, HK * D))
    # cache not bound: metadata present but allocate_kv_cache never called
    from vattn.backends.torch_sdpa import TorchSDPABackend
    from vattn.core.metadata import AttentionSpec

    builder = TorchSDPABackend.get_builder_cls()(AttentionSpec(BS, HK, D, torch.float32), ["a"], vattn_config, "cpu")
    with vattn.set_forward_context(builder.build(0, common), vattn_config):
        with pytest.raises(RuntimeError, match="KV cache not allocated"):
            layer(torch.randn(2, H * D), torch.randn(2, HK * D), torch.randn(2, HK * D))


def test_input_errors_under_compile(vattn_config):
    """Under torch.compile the checks run at trace time (the attention op's fake implementation,
    not traced Python), with the same messages; a wrong 2-D width fails the view."""
    torch._dynamo.reset()
    layer = _layer("a")
    kv = vattn.allocate_kv_cache(vattn_config, num_blocks=4)
    md = kv.build_metadata(kv.common_metadata([3], [0], [[0]]))
    fn = torch.compile(lambda q, k, v: layer(q, k, v), fullgraph=True, dynamic=True)
    with vattn.set_forward_context(md, vattn_config):
        with pytest.raises(Exception, match="query last dim"):
            fn(torch.randn(3, H + 1, D), torch.randn(3, HK, D), torch.randn(3, HK, D))
        with pytest.raises(Exception, match="key last dim"):
            fn(torch.randn(3, H, D), torch.randn(3, H, D), torch.randn(3, HK, D))
        with pytest.raises(Exception, match="key dtype"):
            fn(torch.randn(3, H, D), torch.randn(3, HK, D).half(), torch.randn(3, HK, D))
        short_v = torch.compile(lambda x: layer(x[:, :H], x[:, H:H + HK], x[1:, H + HK:]), fullgraph=True, dynamic=True)
        with pytest.raises(Exception, match="value has"):
            short_v(torch.randn(3, H + 2 * HK, D))
        with pytest.raises(Exception, match="invalid for input of size"):  # 2 * (H * D): not two query tokens
            fn(torch.randn(3, 2 * H * D), torch.randn(3, HK * D), torch.randn(3, HK * D))
        out = fn(torch.randn(3, H * D), torch.randn(3, HK * D), torch.randn(3, HK * D))
    assert out.shape == (3, H * D)
    torch._dynamo.reset()


def test_cache_dtype_mismatch_is_an_error(vattn_config):
    layer = _layer("a")
    kv = vattn.allocate_kv_cache(vattn_config, num_blocks=4, dtype=torch.float16)
    md = kv.build_metadata(kv.common_metadata([2], [0], [[0]]))
    with vattn.set_forward_context(md, vattn_config), pytest.raises(TypeError, match="kv_cache dtype"):
        layer(torch.randn(2, H * D), torch.randn(2, HK * D), torch.randn(2, HK * D))


def test_warmup_run_leaves_cache_untouched(vattn_config):
    layer = _layer("a")
    kv = vattn.allocate_kv_cache(vattn_config, num_blocks=4, dtype=torch.float32)
    kv.tensors["a"].normal_()
    before = kv.tensors["a"].clone()
    with vattn.set_forward_context(None, vattn_config, dummy_run=True):
        out = layer(torch.randn(3, H * D), torch.randn(3, HK * D), torch.randn(3, HK * D))
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(kv.tensors["a"], before)


def test_calc_kv_scales_once(vattn_config):
    cc = vattn.CacheConfig(cache_dtype="fp8", calculate_kv_scales=True)
    layer = vattn.Attention(H, D, D**-0.5, num_kv_heads=HK, prefix="a", cache_config=cc)
    kv = vattn.allocate_kv_cache(vattn_config, num_blocks=4, dtype=torch.float32)
    md = kv.build_metadata(kv.common_metadata([3], [0], [[1]]))
    k = torch.randn(3, HK * D) * 7
    with vattn.set_forward_context(md, vattn_config):
        layer(torch.randn(3, H * D), k, torch.randn(3, HK * D))
    assert not layer.calculate_kv_scales
    assert layer._k_scale_float == pytest.approx(k.abs().max().item() / layer.k_range)
    assert kv.tensors["a"].dtype == torch.float8_e4m3fn


class _TinyModel(nn.Module):
    def __init__(self, n_layers: int = 2) -> None:
        super().__init__()
        self.qkv = nn.ModuleList(nn.Linear(H * D, (H + 2 * HK) * D) for _ in range(n_layers))
        self.attn = nn.ModuleList(_layer(f"layers.{i}.attn") for i in range(n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for qkv, attn in zip(self.qkv, self.attn):
            q, k, v = qkv(x).split([H * D, HK * D, HK * D], dim=-1)
            x = x + attn(q, k, v)
        return x


def test_compile_fullgraph_no_recompiles(vattn_config):
    torch.manual_seed(0)
    model = _TinyModel()
    kv = vattn.allocate_kv_cache(vattn_config, num_blocks=64, dtype=torch.float32)
    counts = {"graphs": 0}

    def counting_backend(gm, example_inputs):
        counts["graphs"] += 1
        targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
        assert sum("unified_attention_with_output" in t for t in targets) == 2  # opaque op in graph
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=counting_backend, fullgraph=True, dynamic=True)
    g = torch.Generator().manual_seed(1)
    lens = {r: 0 for r in range(4)}
    tables = [[4 * r + i for i in range(4)] for r in range(4)]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(20):
            reqs = [r for r in range(4) if (step + r) % 3 != 0 or lens[r] == 0][: 1 + step % 4]
            qlens = [1 if lens[r] else 1 + (r + step) % 5 for r in reqs]
            qlens = [q if lens[r] + q <= 16 else 0 for r, q in zip(reqs, qlens)]
            order = sorted(range(len(reqs)), key=lambda i: qlens[i] != 1)
            reqs, qlens = [reqs[i] for i in order], [qlens[i] for i in order]
            common = kv.common_metadata(qlens, [lens[r] for r in reqs], [tables[r] for r in reqs])
            x = torch.randn(max(sum(qlens), 1), H * D, generator=g)[: sum(qlens)]
            if x.shape[0] == 0:
                continue
            md = kv.build_metadata(common)
            torch._dynamo.decorators.mark_unbacked(x, 0)  # no 0/1 specialization of the token dim
            snapshot = {n: t.clone() for n, t in kv.tensors.items()}
            with vattn.set_forward_context(md, vattn_config):
                out = compiled(x)
            new_cache = {n: t.clone() for n, t in kv.tensors.items()}
            for n, t in kv.tensors.items():
                t.copy_(snapshot[n])
            with vattn.set_forward_context(md, vattn_config):
                ref = model(x)
            torch.testing.assert_close(out, ref)
            for n, t in kv.tensors.items():
                assert torch.equal(t, new_cache[n])
            for r, q in zip(reqs, qlens):
                lens[r] += q
    assert counts["graphs"] == 1

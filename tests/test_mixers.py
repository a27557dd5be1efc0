"""The mixer layers (vattn.GatedDeltaNet, Mamba2Mixer, Mamba1Mixer, ShortConv, LinearAttention) end
to end: state slots, chunked prefills, mixed batches, CUDA-graph-style padding, compile, errors.

Each case's reference runs a request's whole sequence at once in float64, from scratch, written
from the layers' recurrences (plain loops); vattn runs it in steps over a paged state."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

import vattn
from vattn.cudagraph.policy import pad_common_attn_metadata

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


# ---- float64 references over one request's whole sequence ---------------------------------------------


def ref_conv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, act: str | None) -> torch.Tensor:
    k = w.shape[1]
    xp = torch.cat([x.new_zeros(k - 1, x.shape[1]), x])
    y = torch.stack([(w * xp[t:t + k].T).sum(1) for t in range(x.shape[0])])
    y = y + (b if b is not None else 0)
    return F.silu(y) if act == "silu" else y


def ref_gdn(q, k, v, g, beta, scale):  # q, k (L, HV, Dk) (already repeated), v (L, HV, Dv)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    s = q.new_zeros(q.shape[1], q.shape[2], v.shape[2])
    out = []
    for t in range(q.shape[0]):
        s = s * torch.exp(g[t])[:, None, None]
        u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", s, k[t]))
        s = s + k[t][:, :, None] * u[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", s, q[t] * scale))
    return torch.stack(out)


def ref_ssd(x, dt, a, b, c, d):  # x (L, H, P), dt (L, H) after softplus, b/c (L, H, N) per head
    h = x.new_zeros(x.shape[1], x.shape[2], b.shape[2])
    out = []
    for t in range(x.shape[0]):
        h = torch.exp(dt[t] * a)[:, None, None] * h + (dt[t][:, None] * x[t])[:, :, None] * b[t][:, None, :]
        out.append((h * c[t][:, None, :]).sum(-1) + d[:, None] * x[t])
    return torch.stack(out)


def ref_scan(u, dt, a, b, c, d, z):  # u (L, D), dt (L, D) after softplus, a (D, N), b/c (L, N)
    h = u.new_zeros(a.shape)
    out = []
    for t in range(u.shape[0]):
        h = torch.exp(dt[t][:, None] * a) * h + (dt[t] * u[t])[:, None] * b[t][None, :]
        out.append(((h * c[t][None, :]).sum(-1) + d * u[t]) * F.silu(z[t]))
    return torch.stack(out)


def ref_linear(q, k, v, slope):
    s = q.new_zeros(q.shape[1], q.shape[2], v.shape[2])
    out = []
    for t in range(q.shape[0]):
        s = torch.exp(-slope)[:, None, None] * s + k[t][:, :, None] * v[t][:, None, :]
        out.append(torch.einsum("hkv,hk->hv", s, q[t]))
    return torch.stack(out)


# ---- the cases: a layer, its weights, how a step feeds it, and the reference ------------------------------


@dataclass
class Case:
    name: str
    width: int  # features of the random per-token input x
    build: Callable[[str], torch.nn.Module]
    step: Callable[[torch.nn.Module, dict, torch.Tensor], torch.Tensor]
    ref: Callable[[dict, torch.Tensor], torch.Tensor]
    weights: Callable[[], dict]


def _w(*shape: int, scale: float = 0.5) -> torch.Tensor:
    return torch.randn(*shape) * scale


HK, HV, DK, DV, K = 2, 4, 8, 6, 4


def _gdn_weights():
    return {"w": _w(2 * HK * DK + HV * DV, K), "b": _w(2 * HK * DK + HV * DV, scale=0.1)}


def _gdn_step(layer, w, x):
    n = 2 * HK * DK + HV * DV
    mixed, graw, braw = x[:, :n], x[:, n:n + HV], x[:, n + HV:]
    return layer(mixed, w["w"], w["b"], -F.softplus(graw.float()), torch.sigmoid(braw.float()))


def _gdn_ref(w, x):
    n = 2 * HK * DK + HV * DV
    conv = ref_conv(x[:, :n], w["w"].double(), w["b"].double(), "silu")
    q, k, v = conv.split([HK * DK, HK * DK, HV * DV], -1)
    rep = HV // HK
    q = q.view(-1, HK, DK).repeat_interleave(rep, 1)
    k = k.view(-1, HK, DK).repeat_interleave(rep, 1)
    return ref_gdn(q, k, v.view(-1, HV, DV), -F.softplus(x[:, n:n + HV]), torch.sigmoid(x[:, n + HV:]), DK ** -0.5)


H2, P2, N2, G2 = 4, 4, 6, 2
C2 = H2 * P2 + 2 * G2 * N2


def _m2_weights():
    return {"w": _w(C2, K), "b": _w(C2, scale=0.1), "A": -torch.rand(H2) - 0.5, "D": _w(H2), "dt_bias": _w(H2)}


def _m2_step(layer, w, x):
    return layer(x[:, :C2], w["w"], w["b"], x[:, C2:], w["A"], w["D"], w["dt_bias"])


def _m2_ref(w, x):
    conv = ref_conv(x[:, :C2], w["w"].double(), w["b"].double(), "silu")
    xs, b, c = conv.split([H2 * P2, G2 * N2, G2 * N2], -1)
    rep = H2 // G2
    b = b.view(-1, G2, N2).repeat_interleave(rep, 1)
    c = c.view(-1, G2, N2).repeat_interleave(rep, 1)
    dt = F.softplus(x[:, C2:] + w["dt_bias"].double())
    return ref_ssd(xs.view(-1, H2, P2), dt, w["A"].double(), b, c, w["D"].double())


D1, N1 = 6, 4


def _m1_weights():
    return {"w": _w(D1, K), "b": _w(D1, scale=0.1), "proj": _w(D1, D1 + 2 * N1), "A": -torch.rand(D1, N1) - 0.5,
            "D": _w(D1), "dt_bias": _w(D1)}


def _m1_step(layer, w, x):
    u = layer.conv(x[:, :D1], w["w"], w["b"])
    delta, b, c = (u @ w["proj"]).split([D1, N1, N1], -1)
    return layer.scan(u, delta, w["A"], b, c, w["D"], x[:, D1:], w["dt_bias"])


def _m1_ref(w, x):
    u = ref_conv(x[:, :D1], w["w"].double(), w["b"].double(), "silu")
    delta, b, c = (u @ w["proj"].double()).split([D1, N1, N1], -1)
    return ref_scan(u, F.softplus(delta + w["dt_bias"].double()), w["A"].double(), b, c, w["D"].double(), x[:, D1:])


DS = 10


def _sc_weights():
    return {"w": _w(DS, 3), "b": _w(DS, scale=0.1)}


HL, DL, DVL = 3, 4, 5


def _lin_weights():
    return {"slope": torch.rand(HL) * 0.5 + 0.05}


def _lin_step(layer, w, x):
    q, k, v = x.split([HL * DL, HL * DL, HL * DVL], -1)
    return layer(q * 0.5, k * 0.5, v, w["slope"])


def _lin_ref(w, x):
    q, k, v = x.split([HL * DL, HL * DL, HL * DVL], -1)
    return ref_linear(q.view(-1, HL, DL) * 0.5, k.view(-1, HL, DL) * 0.5, v.view(-1, HL, DVL), w["slope"].double())


CASES = [
    Case("gdn", 2 * HK * DK + HV * DV + 2 * HV, lambda p: vattn.GatedDeltaNet(HK, HV, DK, DV, K, prefix=p),
         _gdn_step, _gdn_ref, _gdn_weights),
    Case("mamba2", C2 + H2, lambda p: vattn.Mamba2Mixer(H2, P2, N2, G2, K, prefix=p), _m2_step, _m2_ref, _m2_weights),
    Case("mamba1", 2 * D1, lambda p: vattn.Mamba1Mixer(D1, N1, K, prefix=p), _m1_step, _m1_ref, _m1_weights),
    Case("short_conv", DS, lambda p: vattn.ShortConv(DS, 3, prefix=p), lambda layer, w, x: layer(x, w["w"], w["b"]),
         lambda w, x: ref_conv(x, w["w"].double(), w["b"].double(), None), _sc_weights),
    Case("linear", HL * (2 * DL + DVL), lambda p: vattn.LinearAttention(HL, DL, value_head_size=DVL, prefix=p),
         _lin_step, _lin_ref, _lin_weights),
]


def _setup(case: Case, slots: int = 8, device: str = "cpu", cfg: vattn.VattnConfig | None = None):
    cfg = cfg or vattn.VattnConfig()
    with vattn.set_current_vattn_config(cfg):
        layer = case.build("model.layers.0.mixer")
    kv = vattn.allocate_kv_cache(cfg, num_blocks=4, device=device, num_state_slots=slots)
    return cfg, layer, kv


def _weights(case: Case, device: str = "cpu") -> dict:
    return {k: v.to(device) for k, v in case.weights().items()}


def _run_steps(case: Case, layer, w, cfg, kv, seqs: dict[int, torch.Tensor], schedule: list[list[tuple[int, int]]],
               pad_reqs: int = 0) -> dict[int, torch.Tensor]:
    """Run ``schedule``: each step a list of (request, new tokens); requests keep their slot (the key)."""
    done = {r: 0 for r in seqs}
    outs: dict[int, list[torch.Tensor]] = {r: [] for r in seqs}
    for step in schedule:
        x = torch.cat([seqs[r][done[r]:done[r] + n] for r, n in step]).float().to(kv.device)
        common = kv.common_metadata([n for _, n in step], [done[r] for r, _ in step], None,
                                    state_indices=[r for r, _ in step])
        if pad_reqs:
            common = pad_common_attn_metadata(common, common.num_actual_tokens + pad_reqs,
                                              common.num_reqs + pad_reqs)
            x = torch.cat([x, torch.randn(pad_reqs, x.shape[1], device=x.device)])
        with vattn.set_forward_context(kv.build_metadata(common), cfg):
            y = case.step(layer, w, x)
        at = 0
        for r, n in step:
            outs[r].append(y[at:at + n].reshape(n, -1).cpu())
            done[r] += n
            at += n
    return {r: torch.cat(o) for r, o in outs.items()}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_steps_over_state_slots_equal_the_whole_sequence(case, device, monkeypatch):
    """Chunked prefills, decodes and mixed batches over permuted slots equal one pass over each whole
    sequence; slots no request names stay bit-identical (vattn's own kernels: fla's, which compute
    in tf32 / bf16, have their own test)."""
    monkeypatch.setattr("vattn.backends.mamba.gdn_attn.fla_chunk_fn", lambda: None)
    torch.manual_seed(0)
    cfg, layer, kv = _setup(case, device=device)
    w = _weights(case, device)
    seqs = {5: torch.randn(9, case.width, dtype=torch.float64), 2: torch.randn(14, case.width, dtype=torch.float64),
            7: torch.randn(3, case.width, dtype=torch.float64)}
    for states in kv.states.values():
        for s in states:
            s[0].normal_()  # slot 0 is never named: it must survive bit-identical
    before = [s[0].clone() for states in kv.states.values() for s in states]
    schedule = [[(5, 4), (2, 5)], [(5, 1), (2, 6), (7, 2)], [(5, 1), (7, 1), (2, 3)], [(5, 3)]]
    got = _run_steps(case, layer, w, cfg, kv, seqs, schedule, pad_reqs=2)
    w = {k: v.cpu() for k, v in w.items()}
    for r, seq in seqs.items():
        want = case.ref(w, seq).reshape(seq.shape[0], -1)
        torch.testing.assert_close(got[r].double(), want, rtol=2e-4, atol=2e-4, msg=f"request {r}")
    after = [s[0] for states in kv.states.values() for s in states]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_a_request_that_starts_again_resets_its_slot(case):
    """A slot reused by a new (or preempted and restarted) request starts from a zero state."""
    torch.manual_seed(1)
    cfg, layer, kv = _setup(case)
    w = case.weights()
    seq = torch.randn(6, case.width, dtype=torch.float64)
    first = _run_steps(case, layer, w, cfg, kv, {3: torch.randn(5, case.width, dtype=torch.float64)}, [[(3, 5)]])
    assert first[3].abs().sum() > 0
    again = _run_steps(case, layer, w, cfg, kv, {3: seq}, [[(3, 4)], [(3, 2)]])
    torch.testing.assert_close(again[3].double(), case.ref(w, seq).reshape(6, -1), rtol=2e-4, atol=2e-4)


def test_state_shapes_and_cache():
    cfg = vattn.VattnConfig()
    with vattn.set_current_vattn_config(cfg):
        gdn = vattn.GatedDeltaNet(2, 4, 8, 6, 4, prefix="l.0")
        attn = vattn.Attention(4, 8, 8 ** -0.5, 2, prefix="l.1")
    kv = vattn.allocate_kv_cache(cfg, num_blocks=8, num_state_slots=3)
    conv, rec = gdn.kv_cache[0]
    assert conv.shape == (4, 2 * 2 * 8 + 4 * 6, 3) and rec.shape == (4, 4, 8, 6) and rec.dtype == torch.float32
    assert attn.kv_cache[0].shape == kv.tensors["l.1"].shape and kv.tensors["l.1"].shape[1] == 8  # 8 blocks
    assert kv.num_state_slots == 3 and set(kv.states) == {"l.0"} and "mixer_layers=1" in repr(kv)
    assert list(cfg.attention_layers()) == ["l.1"]
    with pytest.raises(ValueError, match="num_state_slots: expected a positive int"):
        vattn.allocate_kv_cache(cfg, num_blocks=8)


def test_bad_state_indices_are_refused_before_anything_runs():
    cfg, layer, kv = _setup(CASES[3], slots=4)
    with pytest.raises(ValueError, match="state_indices: expected distinct slots"):
        kv.common_metadata([1, 1], [0, 0], None, state_indices=[1, 1])
    with pytest.raises(ValueError, match="state_indices: expected one slot per request"):
        kv.common_metadata([1, 1], [0, 0], None, state_indices=[1])
    with pytest.raises(ValueError, match="below kv.num_state_slots = 4"):
        kv.build_metadata(kv.common_metadata([1], [0], None, state_indices=[4]))
    with pytest.raises(ValueError, match="state_indices: expected one state slot per request"):
        kv.build_metadata(kv.common_metadata([1], [0], [[0]]))


def test_mixer_op_passes_opcheck_and_compiles_without_recompiles():
    case = CASES[0]
    torch.manual_seed(2)
    cfg, layer, kv = _setup(case)
    w = case.weights()

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mixer = layer

        def forward(self, x):
            return case.step(self.mixer, w, x * 1.5).sum(-1)

    model = Step()
    x = torch.randn(5, case.width)
    common = kv.common_metadata([3, 2], [0, 0], None, state_indices=[1, 2])
    md = kv.build_metadata(common)
    with vattn.set_forward_context(md, cfg):
        conv = case.step(layer, w, x)  # fills the slots, so the op sees initial states too
        out = torch.zeros(5, HV, DV)
        mixed = x[:, :2 * HK * DK + HV * DV].contiguous()
        torch.library.opcheck(torch.ops.vattn.mixer_with_output.default,
                              ([mixed, w["w"], w["b"], -torch.rand(5, HV), torch.rand(5, HV)], out, layer.layer_name, 0),
                              test_utils=("test_schema", "test_faketensor"))
    assert conv.shape == (5, HV, DV)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    for query_lens, computed in (([3, 2], [0, 0]), ([1, 1], [3, 2]), ([4], [4])):
        n = sum(query_lens)
        x = torch.randn(n, case.width)
        common = kv.common_metadata(query_lens, computed, None,
                                    state_indices=[1, 2][:len(query_lens)])
        saved = [s.clone() for s in layer.kv_cache[0]]
        with vattn.set_forward_context(kv.build_metadata(common), cfg):
            want = model(x)
            for s, v in zip(layer.kv_cache[0], saved):
                s.copy_(v)
            with torch._dynamo.config.patch(error_on_recompile=n != 5):
                got = compiled(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_warm_up_run_writes_no_state():
    cfg, layer, kv = _setup(CASES[3])
    before = [s.clone() for s in layer.kv_cache[0]]
    with vattn.set_forward_context(None, cfg, dummy_run=True):
        y = layer(torch.randn(3, DS), torch.randn(DS, 3))
    assert not y.any() and all(torch.equal(a, b) for a, b in zip(before, layer.kv_cache[0]))


def test_selector_and_overrides():
    assert vattn.get_mamba_backend("gdn_attention").get_name() == "GDN_ATTN"
    assert vattn.get_mamba_backend("mamba2", torch.bfloat16).get_name() == "MAMBA2"
    with pytest.raises(ValueError, match="mamba_type: expected one of"):
        vattn.get_mamba_backend("mamba3")
    with pytest.raises(ValueError, match="cannot serve a 'mamba1' layer"):
        vattn.get_mamba_backend("mamba1", mamba_backend="SHORT_CONV")
    from vattn.backends.mamba.short_conv_attn import ShortConvAttentionBackend

    @vattn.register_backend(vattn.MambaAttentionBackendEnum.CUSTOM, is_mamba=True)
    class MyConv(ShortConvAttentionBackend):
        name = "CUSTOM"

    try:
        cfg = vattn.VattnConfig()
        with vattn.set_current_vattn_config(cfg):
            layer = vattn.ShortConv(4, 3, prefix="c", mamba_backend="CUSTOM")
        assert layer.attn_backend is MyConv
    finally:
        vattn.MambaAttentionBackendEnum.CUSTOM.clear_override()


def test_attention_free_models_get_the_placeholder():
    backend = vattn.get_attn_backend(64, torch.float32, None, 16, is_attention_free=True)
    assert backend.get_name() == "NO_ATTENTION" and backend.validate_configuration(64)


@pytest.mark.cuda
def test_gdn_prefills_through_fla_equal_the_recurrent_kernel(monkeypatch):
    """With fla-core installed, GDN prompts run fla's chunked kernels (bf16): same outputs and states
    as vattn's recurrent kernel, within bf16 tolerance, on a batch of decodes and prompts."""
    from vattn.backends.mamba.fla_ops import fla_chunk_fn

    if fla_chunk_fn() is None:
        pytest.skip("fla-core is not installed (pip install fla-core)")
    torch.manual_seed(4)
    results = []
    for use_fla in (True, False):
        if not use_fla:
            monkeypatch.setattr("vattn.backends.mamba.gdn_attn.fla_chunk_fn", lambda: None)
        with _dtype(torch.bfloat16):
            cfg, layer, kv = _setup(CASES[0], device="cuda")
        torch.manual_seed(5)
        w = {k: v.to("cuda", torch.bfloat16) for k, v in CASES[0].weights().items()}
        outs = []
        for lens, done in (([7, 70, 33], [0, 0, 0]), ([1, 1, 5], [7, 70, 33])):
            x = torch.randn(sum(lens), CASES[0].width, device="cuda", dtype=torch.bfloat16)
            common = kv.common_metadata(lens, done, None, state_indices=[3, 0, 5])
            with vattn.set_forward_context(kv.build_metadata(common), cfg):
                outs.append(CASES[0].step(layer, w, x).float())
        results.append((outs, [t.float() for t in layer.kv_cache[0]]))
    (a, sa), (b, sb) = results
    for x, y in zip(a + sa, b + sb):
        torch.testing.assert_close(x, y, rtol=3e-2, atol=3e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_full_graph_replay_equals_eager(case):
    """Uniform decode steps replayed from FULL CUDA graphs (padded to a captured size) give the eager
    outputs and states."""
    torch.manual_seed(3)
    cfg = vattn.VattnConfig(compilation=vattn.CompilationConfig(cudagraph_mode=vattn.CUDAGraphMode.FULL,
                                                               cudagraph_capture_sizes=(1, 2, 4, 8)))
    cfg, layer, kv = _setup(case, slots=8, device="cuda", cfg=cfg)
    w = _weights(case, "cuda")

    def step(x):
        return case.step(layer, w, x)

    graphs = vattn.CUDAGraphRunner(step, cfg, kv, inputs=[vattn.GraphInput(torch.float32, (case.width,))],
                                   show_progress=False)
    slots, done = [6, 1, 3], [0, 0, 0]
    prompt = [5, 2, 7]
    x = torch.randn(sum(prompt), case.width, device="cuda")
    common = kv.common_metadata(prompt, done, None, state_indices=slots)
    graphs(x, common)  # prefill: eager
    done = prompt
    for i in range(4):
        x = torch.randn(3, case.width, device="cuda")
        common = kv.common_metadata([1, 1, 1], done, None, state_indices=slots)
        saved = [t.clone() for t in layer.kv_cache[0]]
        got = graphs(x, common).clone()
        assert graphs.last_batch_descriptor.mode is vattn.CUDAGraphMode.FULL
        replayed = [t.clone() for t in layer.kv_cache[0]]
        for t, v in zip(layer.kv_cache[0], saved):
            t.copy_(v)
        with vattn.set_forward_context(kv.build_metadata(common), cfg):
            want = step(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for a, b in zip(replayed, layer.kv_cache[0]):
            torch.testing.assert_close(a[:8], b[:8], rtol=1e-5, atol=1e-5)  # the scratch slot may differ
        done = [d + 1 for d in done]


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_fuzz_1000_mixed_batches_with_graph_replay(case):
    """1,000 random steps (new requests, chunked prefills, decodes, finished and preempted requests,
    slots reused) on CUDA with FULL graphs for uniform decodes, each checked against the same steps
    on the CPU's torch path in float64."""
    import random

    rng = random.Random(7)
    torch.manual_seed(7)
    slots = 16
    cfg_gpu = vattn.VattnConfig(compilation=vattn.CompilationConfig(cudagraph_mode=vattn.CUDAGraphMode.FULL,
                                                                   cudagraph_capture_sizes=(1, 2, 4, 8, 16)))
    cfg_gpu, gpu, kv_gpu = _setup(case, slots=slots, device="cuda", cfg=cfg_gpu)
    with _dtype(torch.float64):
        cfg_cpu, cpu, kv_cpu = _setup(case, slots=slots)
    w_cpu = {k: v.double() for k, v in case.weights().items()}
    w_gpu = {k: v.float().cuda() for k, v in w_cpu.items()}
    graphs = vattn.CUDAGraphRunner(lambda x: case.step(gpu, w_gpu, x), cfg_gpu, kv_gpu,
                                   inputs=[vattn.GraphInput(torch.float32, (case.width,))], show_progress=False)
    done: dict[int, int] = {}  # slot -> tokens computed
    replays = 0
    for it in range(1000):
        free = [s for s in range(slots) if s not in done]
        for s in list(done):
            if rng.random() < 0.05:
                del done[s]  # finished
            elif rng.random() < 0.02:
                done[s] = 0  # preempted: recomputed from its first token
        if free and (not done or rng.random() < 0.3):
            done[rng.choice(free)] = 0
        decodes = [s for s in done if done[s] > 0 and rng.random() < 0.9]
        prefills = [s for s in done if s not in decodes][:3]
        step = [(s, 1) for s in decodes] + [(s, rng.randint(1, 24)) for s in prefills]
        if not step:
            continue
        x = torch.randn(sum(n for _, n in step), case.width, dtype=torch.float64)
        args = ([n for _, n in step], [done[s] for s, _ in step], None)
        got = graphs(x.float().cuda(), kv_gpu.common_metadata(*args, state_indices=[s for s, _ in step]))
        replays += graphs.last_batch_descriptor.mode is vattn.CUDAGraphMode.FULL
        with vattn.set_forward_context(kv_cpu.build_metadata(kv_cpu.common_metadata(
                *args, state_indices=[s for s, _ in step])), cfg_cpu):
            want = case.step(cpu, w_cpu, x)
        torch.testing.assert_close(got.double().cpu(), want, rtol=2e-3, atol=2e-3, msg=f"step {it}: {step}")
        for s, n in step:
            done[s] += n
    assert replays > 100


@contextlib.contextmanager
def _dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def test_state_dtypes_follow_the_cache_config():
    """CacheConfig.mamba_cache_dtype / mamba_ssm_cache_dtype choose the conv and recurrent state dtypes
    (vLLM's names); a bf16 recurrent state stays within bf16 rounding of the float32 one."""
    torch.manual_seed(6)
    case = CASES[0]
    outs = []
    for ssm in ("float32", "auto"):
        cfg = vattn.VattnConfig(cache=vattn.CacheConfig(mamba_ssm_cache_dtype=ssm))
        with _dtype(torch.bfloat16):
            cfg, layer, kv = _setup(case, cfg=cfg)
        assert [t.dtype for t in layer.kv_cache[0]] == [torch.bfloat16, torch.float32 if ssm == "float32" else
                                                         torch.bfloat16]
        torch.manual_seed(7)
        w = {k: v.bfloat16() for k, v in case.weights().items()}
        seqs = {1: torch.randn(12, case.width, dtype=torch.float64)}
        got = _run_steps(case, layer, w, cfg, kv, {1: seqs[1].bfloat16()}, [[(1, 6)], [(1, 1)], [(1, 5)]])
        outs.append(got[1].float())
    torch.testing.assert_close(outs[1], outs[0], rtol=5e-2, atol=5e-2)
    with pytest.raises(ValueError, match="mamba_ssm_cache_dtype must be one of"):
        vattn.CacheConfig(mamba_ssm_cache_dtype="fp8")

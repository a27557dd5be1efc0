#!/usr/bin/env python
"""What each mixer layer costs on top of the bare kernel calls it wraps, and how fast GDN decode
reads its recurrent state.

Layers at the widths of the models that use them (bf16, states as the layers declare them):

| kind | model widths |
| --- | --- |
| gdn | Qwen3-Next: 16 key heads, 32 value heads, head dims 128, conv 4 |
| mamba2 | Nemotron-H: 128 heads of 64, state 128, 8 groups, conv 4 |
| mamba1 | Falcon-Mamba-7B: 8192 channels, state 16, conv 4 |
| short_conv | LFM2: 2048 channels, conv 3 |
| linear | MiniMax-01: 64 heads of 128 |

Cases: ``decode-1`` and ``decode-64`` (one new token per request, every request continuing from
its slot), ``prefill-4x1024`` (four new requests of 1024 tokens). Both columns time one step with the same
metadata and inputs: decodes as CUDA-graph replays (``benchmarks.common.bench_cuda_graph``),
prompts eagerly (``bench``; the layer's host work is not in the GPU timeline):

* ``layer_ms``: the vattn layer's call (output allocation, the opaque op, the impl);
* ``bare_ms``: the same kernels called directly (``vattn.backends.mamba.triton_ops``; GDN prompts
  through fla's chunked kernel where fla-core is installed, as the layer does) into preallocated
  outputs: what a user of the kernels alone would launch.

``ratio = layer_ms / bare_ms`` (target <= 1.05). For GDN decode, ``state_tb_s`` is the recurrent
state read and written by the delta-rule kernel alone over its time, and ``copy_frac`` that over
a device-to-device copy of the same bytes measured in the same run (target >= 0.7 at batch 64).

    PYTHONPATH=$PWD python benchmarks/bench_mixers.py [--quick] [--kinds gdn,mamba2]

Writes ``mixers-<device>-<date>.json`` to $OUT (if set) or benchmarks/results/.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import vattn  # noqa: E402
from benchmarks.common import Table, bench, bench_cuda_graph, env_info, write_results  # noqa: E402

DT = torch.bfloat16


class Setup:
    """One layer of ``kind`` on CUDA with its state, weights, a batch and both call paths."""

    def __init__(self, kind: str, batch: int, qlen: int, slots: int, ssm_dtype: str = "float32") -> None:
        self.kind = kind
        cfg = vattn.VattnConfig(cache=vattn.CacheConfig(mamba_ssm_cache_dtype=ssm_dtype))
        dev = "cuda"
        g = torch.Generator(device=dev).manual_seed(0)

        def rnd(*shape: int, scale: float = 0.5, dtype: torch.dtype = DT) -> torch.Tensor:
            return (torch.randn(*shape, generator=g, device=dev, dtype=torch.float32) * scale).to(dtype)

        with vattn.set_current_vattn_config(cfg), torch.device(dev):
            if kind == "gdn":
                hk, hv, d = 16, 32, 128
                self.layer: Any = vattn.GatedDeltaNet(hk, hv, d, d, 4, prefix="m")
                n = self.layer.conv_dim
                self.w = {"w": rnd(n, 4), "b": None}
                self.inputs = [rnd(batch * qlen, n), -F.softplus(rnd(batch * qlen, hv, dtype=torch.float32)),
                               torch.sigmoid(rnd(batch * qlen, hv, dtype=torch.float32))]
            elif kind == "mamba2":
                self.layer = vattn.Mamba2Mixer(128, 64, 128, 8, 4, prefix="m")
                n = self.layer.conv_dim
                self.w = {"w": rnd(n, 4), "b": rnd(n, scale=0.1), "A": -torch.rand(128, device=dev) - 0.5,
                          "D": rnd(128, dtype=torch.float32), "dt_bias": rnd(128, dtype=torch.float32)}
                self.inputs = [rnd(batch * qlen, n), rnd(batch * qlen, 128)]
            elif kind == "mamba1":
                d, s = 8192, 16
                self.layer = vattn.Mamba1Mixer(d, s, 4, prefix="m")
                self.w = {"w": rnd(d, 4), "b": rnd(d, scale=0.1), "A": -torch.rand(d, s, device=dev) - 0.5,
                          "D": rnd(d, dtype=torch.float32), "dt_bias": rnd(d, dtype=torch.float32)}
                t = batch * qlen
                self.inputs = [rnd(t, d), rnd(t, d), rnd(t, s), rnd(t, s), rnd(t, d)]
            elif kind == "short_conv":
                self.layer = vattn.ShortConv(2048, 3, prefix="m")
                self.w = {"w": rnd(2048, 3), "b": None}
                self.inputs = [rnd(batch * qlen, 2048)]
            elif kind == "linear":
                self.layer = vattn.LinearAttention(64, 128, prefix="m")
                self.w = {"slope": torch.rand(64, device=dev) * 0.5 + 0.05}
                t = batch * qlen
                self.inputs = [rnd(t, 64, 128, scale=0.1), rnd(t, 64, 128, scale=0.1), rnd(t, 64, 128)]
            else:
                raise ValueError(f"--kinds: unknown kind {kind!r}")
        self.kv = vattn.allocate_kv_cache(cfg, num_blocks=1, device=dev, num_state_slots=slots)
        for t in self.layer.kv_cache[0]:
            t.normal_().mul_(0.1)
        computed = [4096 if qlen == 1 else 0] * batch
        slots_used = torch.randperm(slots)[:batch].tolist()
        common = self.kv.common_metadata([qlen] * batch, computed, None, state_indices=slots_used)
        self.cfg, self.md = cfg, self.kv.build_metadata(common)
        self.mmd = self.md[self.layer.layer_name]

    def layer_call(self) -> torch.Tensor:
        x, w, lay = self.inputs, self.w, self.layer
        with vattn.set_forward_context(self.md, self.cfg):
            if self.kind == "gdn":
                return lay(x[0], w["w"], w["b"], x[1], x[2])
            if self.kind == "mamba2":
                return lay(x[0], w["w"], w["b"], x[1], w["A"], w["D"], w["dt_bias"])
            if self.kind == "mamba1":
                u = lay.conv(x[0], w["w"], w["b"])
                return lay.scan(u, x[1], w["A"], x[2], x[3], w["D"], x[4], w["dt_bias"])
            if self.kind == "short_conv":
                return lay(x[0], w["w"], w["b"])
            return lay(x[0], x[1], x[2], w["slope"])

    def bare(self) -> Callable[[], None]:
        """The kernels alone, into preallocated buffers (the kernel arguments prepared once)."""
        from vattn.backends.mamba import triton_ops as k

        lay, x, w, md = self.layer, self.inputs, self.w, self.mmd
        batch = (md.query_start_loc, md.state_indices, md.has_initial_state, md.num_reqs)
        state = lay.kv_cache[0]
        t = x[0].shape[0]
        if self.kind in ("gdn", "mamba2"):
            conv = torch.empty_like(x[0])
            if self.kind == "gdn":
                hk, hv, dk, dv = lay.num_k_heads, lay.num_v_heads, lay.head_k_dim, lay.head_v_dim
                q, kk, v = conv.split([hk * dk, hk * dk, hv * dv], -1)
                out = torch.empty(t, hv, dv, device=conv.device, dtype=DT)

                from vattn.backends.mamba.fla_ops import chunked_prefill, fla_chunk_fn

                qs, ks, vs = q.view(t, hk, dk), kk.view(t, hk, dk), v.view(t, hv, dv)
                chunked = md.num_prefills > 0 and md.num_decodes == 0 and fla_chunk_fn() is not None

                def run() -> None:
                    k.causal_conv1d(x[0], w["w"], w["b"], state[0], *batch, "silu", conv)
                    if chunked:  # the layer hands prompts to fla where it is installed
                        chunked_prefill(qs, ks, vs, x[1], x[2], lay.scale, True, state[1], md.query_start_loc,
                                        md.query_start_loc_cpu, md.state_indices, md.has_initial_state, 0,
                                        md.num_reqs, out)
                    else:
                        k.gated_delta_rule(qs, ks, vs, x[1], x[2], lay.scale, True, state[1], *batch, out)
                return run
            h, p, gr, n = lay.num_heads, lay.head_dim, lay.n_groups, lay.state_size
            xs, b, c = conv.split([h * p, gr * n, gr * n], -1)
            out = torch.empty(t, h, p, device=conv.device, dtype=DT)

            def run() -> None:
                k.causal_conv1d(x[0], w["w"], w["b"], state[0], *batch, "silu", conv)
                k.ssd_scan(xs.view(t, h, p), x[1], w["A"], b.view(t, gr, n), c.view(t, gr, n), w["D"], w["dt_bias"],
                           True, lay.dt_limit, state[1], *batch, out)
            return run
        if self.kind == "mamba1":
            u, out = torch.empty_like(x[0]), torch.empty_like(x[0])

            def run() -> None:
                k.causal_conv1d(x[0], w["w"], w["b"], state[0], *batch, "silu", u)
                k.selective_scan(u, x[1], w["A"], x[2], x[3], w["D"], x[4], w["dt_bias"], True, state[1], *batch, out)
            return run
        if self.kind == "short_conv":
            out = torch.empty_like(x[0])
            return lambda: k.causal_conv1d(x[0], w["w"], w["b"], state[0], *batch, None, out)
        out = torch.empty_like(x[2])
        return lambda: k.linear_attention(x[0], x[1], x[2], w["slope"], state[0], *batch, out)

    def delta_rule_only(self) -> tuple[Callable[[], None], int]:
        """GDN: the delta-rule kernel alone, and the recurrent-state bytes it reads and writes."""
        from vattn.backends.mamba import triton_ops as k

        lay, x, md = self.layer, self.inputs, self.mmd
        t = x[0].shape[0]
        hk, hv, dk, dv = lay.num_k_heads, lay.num_v_heads, lay.head_k_dim, lay.head_v_dim
        q, kk, v = x[0].split([hk * dk, hk * dk, hv * dv], -1)
        out = torch.empty(t, hv, dv, device=x[0].device, dtype=DT)
        state = lay.kv_cache[0][1]
        nbytes = 2 * md.num_reqs * state[0].numel() * state.element_size()

        def run() -> None:
            k.gated_delta_rule(q.reshape(t, hk, dk), kk.reshape(t, hk, dk), v.reshape(t, hv, dv), x[1], x[2],
                               lay.scale, True, state, md.query_start_loc, md.state_indices, md.has_initial_state,
                               md.num_reqs, out)
        return run, nbytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kinds", default="gdn,mamba2,mamba1,short_conv,linear")
    p.add_argument("--quick", action="store_true", help="shorter timing")
    p.add_argument("--cases", default="decode-1,decode-64,prefill-4x1024")
    p.add_argument("--ssm-dtype", default="float32", help="CacheConfig.mamba_ssm_cache_dtype (auto: bf16 here)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_mixers needs a CUDA GPU (the layers' Triton kernels and CUDA graphs).")
    rep = 30 if args.quick else 100
    cases = [c for c in (("decode-1", 1, 1), ("decode-64", 64, 1), ("prefill-4x1024", 4, 1024))
             if c[0] in args.cases.split(",")]
    rows: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    table = Table(["kind", "case", "layer_ms", "bare_ms", "ratio", "state_tb_s", "copy_frac"])
    for kind in args.kinds.split(","):
        for case, batch, qlen in cases:
            s = Setup(kind, batch, qlen, slots=max(batch, 8) * 2, ssm_dtype=args.ssm_dtype)
            # Decodes replay from graphs; prompts run eagerly (a mixer op runs between piecewise graphs,
            # and fla's chunked prefill plans on the host).
            timer = bench_cuda_graph if qlen == 1 else bench
            layer = timer(s.layer_call, rep=rep)["median_ms"]
            bare = timer(s.bare(), rep=rep)["median_ms"]
            row: dict[str, Any] = {"kind": kind, "case": case, "layer_ms": layer, "bare_ms": bare, "ratio": layer / bare,
                                   "ssm_state": str(s.layer.kv_cache[0][-1].dtype).removeprefix("torch.")}
            if kind == "gdn" and qlen > 1:
                from vattn.backends.mamba.fla_ops import fla_chunk_fn

                row["prefill_kernel"] = "fla chunked" if fla_chunk_fn() is not None else "vattn recurrent"
            if kind == "gdn" and qlen == 1:
                run, nbytes = s.delta_rule_only()
                ms = bench_cuda_graph(run, rep=rep)["median_ms"]
                src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
                dst = torch.empty_like(src)
                copy_ms = bench(lambda: dst.copy_(src), rep=rep)["median_ms"]
                row.update(delta_rule_ms=ms, state_tb_s=nbytes / ms / 1e9, copy_tb_s=nbytes / copy_ms / 1e9,
                           copy_frac=copy_ms / ms)
            rows.append(row)
            table.add(row)
            del s
            torch.cuda.empty_cache()
    table.print()
    worst = max(r["ratio"] for r in rows)
    summary.update(worst_ratio=worst, target_ratio=1.05)
    gdn64 = [r for r in rows if r["kind"] == "gdn" and r["case"] == "decode-64"]
    if gdn64:
        summary.update(gdn_decode64_copy_frac=gdn64[0]["copy_frac"], target_copy_frac=0.7)
    payload = {"rows": rows, "summary": summary, "env": env_info("cuda")}
    if args.ssm_dtype == "float32":
        path = write_results("mixers", payload)
    else:  # the state-dtype variant: a kind of its own
        path = write_results(f"mixers-ssm-{args.ssm_dtype}", payload)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""End-to-end decode on the GPU: vattn beside transformers, and the physical floor.

Model: the Llama-3.2-1B shape (16 layers, hidden 2048, 32 q / 8 KV heads, head dim 64,
vocab 128256, tied embeddings), random weights, bf16. For each batch size and context
(prompt length) it measures ms per decode step and tokens/s for:

| impl | what runs |
| --- | --- |
| vattn-eager | ``examples.engine.Engine`` over the paged KV cache, eager model |
| vattn-compile | the same, model through ``vattn.compile`` (split at attention, Inductor per piece) |
| vattn-cudagraph-full | ``vattn.compile`` + ``vattn.CUDAGraphRunner(mode=FULL_DECODE_ONLY)``: each decode step replays one full graph, attention included |
| vattn-cudagraph-piecewise | ``vattn.compile`` + ``CUDAGraphRunner(mode=PIECEWISE)``: compiled pieces replayed, attention eager between them |
| vattn-torch-compile | (opt-in) ``torch.compile(model, fullgraph=True, dynamic=True)`` |
| hf-eager | ``transformers`` ``generate`` with its dynamic cache (sdpa attention) |
| hf-static-compile | ``generate`` with a ``StaticCache`` (which auto-compiles the decode forward, reduce-overhead) |

vattn step times are the engine's own (schedule + metadata + forward + logits + sampling):
the period from one step's start to the next one's (what a step adds to a run), median over
the steps where every request decodes, with the engine's async scheduling (each
step prepared and launched while the GPU runs the previous one, whose tokens the next step
reads on the device; ``--sync-scheduling``: one host sync per step instead). Each vattn impl
also gets an ``<impl>/loop`` row: ``DecodeLoop`` continues the same requests with
device-resident inputs and no per-step sync (what a tuned engine does in steady-state
decode), so host work overlaps the GPU. Graph rows carry ``graph_mode``, the mode the
runner's dispatcher actually used for the last decode step (FULL / PIECEWISE / NONE).
``/loop`` rows also say why a loop is slower than its GPU work: ``host_ms`` (time to issue a
step; near ``ms_per_step`` when host-bound or waiting), ``syncs_per_step`` and ``sync_sites``
(host synchronizations of two warm-up steps, ``torch.cuda.set_sync_debug_mode``), and for
compiled impls ``dynamo_graphs`` (1 unless something recompiled) and ``direct_dispatch``
(whether calls still skip Dynamo's guards).
transformers step times are ``(t(generate N+1 tokens) - t(generate 1 token)) / N``,
medians over repeats (one reused, reset ``StaticCache`` per shape). All greedy, same weights.
The rows do not compare tokens across impls: with random bf16 weights the top logits are
near-ties that reduction order flips, and one flip changes the rest of a sequence (so an
earlier ``tokens_agree_with_eager`` column read about 0 for every impl). Correctness is
``tests/test_model_parity.py``'s (transformers parity, graph replay equals eager).

The floor of a step (``floor_ms``): (bytes of weights read + bytes of KV read at the row's mean
sequence length) / the copy bandwidth ``benchmarks/roofline.py`` measures in the same run
(2 * bytes / time of a large device-to-device copy); the embedding table counts only as the
tied LM head. Rows carry ``x_floor`` = ms_per_step / floor_ms, the achieved TB/s and TFLOP/s
and their roofline fractions (``frac_*``), and ``speedup_vs_hf_static`` / ``speedup_vs_hf_eager``
(tokens/s over the transformers row of the same shape). ``summary.targets`` (one line each;
``summary.target_checks`` has the rows compared) checks issue 4's and issue 7's targets: vattn >= 3x (batch 1) and >= 4x (batch 64) the static-cache tokens/s; FULL
graphs at batch 1 within 1.3x of the floor; PIECEWISE within 1.25x of FULL (prompt 512).

    PYTHONPATH=$PWD python benchmarks/bench_e2e.py            # batch 1 and 64, contexts 512 and 4096 (< 9 min)
    PYTHONPATH=$PWD python benchmarks/bench_e2e.py --quick    # batch 1 and 64, context 512 (< 3 min)

Order of work: every vattn impl at every shape first (prompt 512 before 4096), then
transformers at prompt 512 (the targets' shape; static cache before eager), then transformers
at the other contexts.
``--time-budget-s`` (default 480, quick 160, counted from process start) skips a job when the
time already used plus its estimate (the slowest earlier job of the same impl, else a default)
would pass the budget; the row says so. Writes ``e2e-<device>-<date>.json``
(``benchmarks.common.write_results``) and ``e2e-<device>-<date>.png`` (ms per decode step vs
batch per impl, engine steps and decode loop apart, the floor as a line) to $OUT (if set) or
benchmarks/results/ after every job, so a run cut short keeps what it measured (``summary.partial``).
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()  # the time budget counts from process start, imports included

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

if __package__ in (None, ""):  # run as a script: make `benchmarks`, `examples` and `vattn` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import vattn  # noqa: E402
from benchmarks import common, roofline  # noqa: E402
from examples.engine import Engine, SamplingParams, greedy  # noqa: E402
from examples.gemv import OneTokenGemv  # noqa: E402
from examples.generate import compile_model  # noqa: E402
from examples.model import DecoderForCausalLM, ModelConfig, get_preset, init_random_weights  # noqa: E402

BLOCK = 16
VATTN_IMPLS = ("vattn-eager", "vattn-compile", "vattn-cudagraph-full", "vattn-cudagraph-piecewise")
HF_IMPLS = ("hf-eager", "hf-static-compile")
ALL_IMPLS = (*VATTN_IMPLS, "vattn-torch-compile", *HF_IMPLS)
GRAPH_MODES = {"vattn-cudagraph-full": "FULL_DECODE_ONLY", "vattn-cudagraph-piecewise": "PIECEWISE"}
#: Engine-row figures a ``/loop`` row does not have.
ENGINE_ONLY = ("ms_p10", "ms_p90", "prefill_tok_s", "setup_s")
#: Seconds a job of each impl is assumed to take before one has run (compile / capture included).
#: vattn's are low on purpose: its rows come first and matter most, so only a spent budget skips them.
DEFAULT_ESTIMATE_S = {"vattn-eager": 10.0, "vattn-compile": 60.0, "vattn-cudagraph-full": 15.0,
                      "vattn-cudagraph-piecewise": 15.0, "vattn-torch-compile": 90.0, "hf-eager": 20.0,
                      "hf-static-compile": 45.0}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def say(message: str) -> None:
    """A line on stderr that does not break the progress bar."""
    try:
        from tqdm.auto import tqdm

        tqdm.write(message, file=sys.stderr)
    except ImportError:
        print(message, file=sys.stderr, flush=True)


def weight_bytes_per_step(model: DecoderForCausalLM) -> int:
    """Bytes of parameters one decode step reads (the embedding table only if tied to the LM head)."""
    seen: dict[int, int] = {}
    for name, p in model.named_parameters():
        if name.endswith("embed_tokens.weight") and not model.config.tie_word_embeddings:
            continue
        seen[p.data_ptr()] = p.numel() * p.element_size()
    return sum(seen.values())


def kv_bytes_per_step(mcfg: ModelConfig, batch: int, kv_len: float, elem: int) -> float:
    """Bytes of K and V one decode step reads: ``batch`` sequences of ``kv_len`` tokens, every layer."""
    return batch * kv_len * mcfg.num_hidden_layers * 2 * mcfg.num_key_value_heads * mcfg.head_dim * elem


def flops_per_step(mcfg: ModelConfig, weight_elems: int, batch: int, kv_len: float) -> float:
    """Matmul flops of a decode step: 2 per weight per token, plus QK^T and PV over ``kv_len`` tokens."""
    attn = 4 * mcfg.num_hidden_layers * mcfg.num_attention_heads * mcfg.head_dim * kv_len
    return batch * (2 * weight_elems + attn)


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# ---- vattn -------------------------------------------------------------------------------------


def kv_device(kv: Any) -> torch.device:
    return next(iter(kv.tensors.values())).device


def vattn_decode(model: DecoderForCausalLM, cfg: vattn.VattnConfig, kv: Any, runner: dict[str, Any],
                 batch: int, context: int, new_tokens: int, budget: int,
                 seed: int, async_scheduling: bool = True) -> tuple[dict[str, Any], Engine]:
    """Prefill ``batch`` prompts of ``context`` tokens, then time ``new_tokens`` engine steps where all decode.

    ``runner``: Engine keyword arguments (forward_fn / graph_runner). Returns the
    figures (``kv_len``: mean sequence length over the timed steps) and the engine, whose
    requests are all still decoding.
    """
    engine = Engine(model, cfg, kv, device=kv_device(kv), max_num_batched_tokens=budget,
                    max_num_seqs=batch, seed=seed, async_scheduling=async_scheduling, **runner)
    g = torch.Generator().manual_seed(seed)
    extra = math.ceil(batch * context / budget) + 2  # decodes that overlap the prefill steps
    for _ in range(batch):
        prompt = torch.randint(0, model.config.vocab_size, (context,), generator=g).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=new_tokens + extra + 1))  # + the step closing the last period
    # A decode step's time is the period from its start to the next step's start. With async
    # scheduling a call returns once the step is launched and the one before it is done, so
    # its own duration leaves out whatever the caller does between calls (here: bookkeeping)
    # while the GPU keeps running; the period is the rate tokens come out at.
    decode, lens, prefill_s, prefill_tok = [], [], 0.0, 0
    pending: tuple[float, float] | None = None  # (start, mean sequence length) of the last decode step
    while len(decode) < new_tokens and engine.scheduler.has_unfinished():
        running = engine.scheduler.running
        seq_len = statistics.mean(r.num_computed_tokens for r in running) + 1 if running else 0.0
        start = time.perf_counter()
        if pending is not None:
            decode.append(start - pending[0])
            lens.append(pending[1])
            pending = None
        s = engine.step()
        if s.num_prefill_tokens:
            prefill_s += s.seconds
            prefill_tok += s.num_prefill_tokens
        elif s.num_decode_tokens == batch:
            pending = (start, seq_len)
    engine.flush()
    ms = 1e3 * statistics.median(decode)
    return {"ms_per_step": ms, "tok_s": batch * 1e3 / ms, "ms_p10": 1e3 * quantile(decode, 0.1),
            "ms_p90": 1e3 * quantile(decode, 0.9), "decode_steps": len(decode), "kv_len": statistics.mean(lens),
            "prefill_tok_s": prefill_tok / prefill_s if prefill_s else 0.0}, engine


def advance_inputs(block_table: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor,
                   block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode step's device inputs from the positions ``pos`` (B,) int64 of its new tokens:
    (slot mapping (B,) int64, sequence lengths (B,) int32, the next step's positions)."""
    slot = block_table[rows, pos // block_size].long() * block_size + pos % block_size
    return slot, (pos + 1).int(), pos + 1


@functools.cache
def _advance_fn(device_type: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``advance_inputs``, on CUDA compiled into one kernel (eager it is eight), as vLLM's
    ``advance_step`` does in one kernel between its multi-step decodes."""
    return torch.compile(advance_inputs, fullgraph=True) if device_type == "cuda" else advance_inputs


class DecodeLoop:
    """Steady-state decode of an engine's running requests with device-resident inputs.

    What a tuned engine does between scheduler events: positions, sequence lengths and slot
    mapping advance on the device (``advance_inputs``, one compiled kernel on CUDA), the
    sampled token feeds the next step on the device, and nothing syncs until the end. The
    host only builds ``CommonAttentionMetadata`` and the backend metadata (or the CUDA-graph
    runner pads and dispatches), so host work overlaps the GPU. Blocks for every step are
    allocated up front.
    """

    def __init__(self, engine: Engine, runner: dict[str, Any], steps: int) -> None:
        engine.flush()  # the last engine step's tokens (async scheduling leaves them in flight)
        reqs = list(engine.scheduler.running)
        assert reqs and all(r.num_remaining == 1 for r in reqs), "every request must be decoding"
        for r in reqs:
            assert engine.scheduler._grow(r, steps + 1), "KV cache too small for the decode loop"
        self.engine, self.steps = engine, steps
        self.forward_fn = runner.get("forward_fn", engine.model)
        self.graph_runner = runner.get("graph_runner")
        dev, b, bs = engine.device, len(reqs), engine.block_size
        width = max(len(r.block_ids) for r in reqs)
        table = torch.zeros(b, width, dtype=torch.int32)
        for i, r in enumerate(reqs):
            table[i, : len(r.block_ids)] = torch.tensor(r.block_ids, dtype=torch.int32)
        self.block_table, self.bs, self.rows = table.to(dev), bs, torch.arange(b, device=dev)
        self.pos_cpu = torch.tensor([r.num_computed_tokens for r in reqs], dtype=torch.int32)
        self.pos = self.pos_cpu.to(dev, torch.long)
        self.tokens = torch.tensor([r.output_token_ids[-1] for r in reqs], device=dev)
        self.qsl_cpu = torch.arange(b + 1, dtype=torch.int32)
        self.qsl = self.qsl_cpu.to(dev)

    def step(self) -> torch.Tensor:
        e, b = self.engine, self.rows.shape[0]
        slot, seq_lens, pos_next = _advance_fn(e.device.type)(self.block_table, self.rows, self.pos, self.bs)
        seq_cpu = self.pos_cpu + 1
        common = vattn.CommonAttentionMetadata(
            query_start_loc=self.qsl, query_start_loc_cpu=self.qsl_cpu, seq_lens=seq_lens,
            seq_lens_cpu=seq_cpu, num_computed_tokens_cpu=self.pos_cpu, num_reqs=b, num_actual_tokens=b,
            max_query_len=1, block_table_tensor=self.block_table, slot_mapping=slot,
            max_seq_len=int(seq_cpu.max()))
        if self.graph_runner is not None:
            hidden = self.graph_runner(self.tokens, self.pos, common)
        else:
            with vattn.set_forward_context(e.kv.build_metadata(common), e.cfg):
                hidden = self.forward_fn(self.tokens, self.pos)
        self.tokens = greedy(e.model.compute_logits(hidden))
        self.pos, self.pos_cpu = pos_next, seq_cpu
        return self.tokens

    @torch.no_grad()
    def run(self, warmup: int = 4) -> tuple[dict[str, Any], torch.Tensor]:
        """Figures of ``steps - warmup`` timed steps, and the (steps, B) tokens.

        Besides the wall time: ``host_ms``, the time the host takes to issue a step (about
        ``ms_per_step`` when the loop is host-bound, or when a step waits for the GPU), and
        on CUDA ``syncs_per_step`` / ``sync_sites``: the host synchronizations of the last
        two warm-up steps (``torch.cuda.set_sync_debug_mode``), which stop host work from
        overlapping the GPU.
        """
        start_len = float(self.pos_cpu.float().mean())
        probe = 2 if self.engine.device.type == "cuda" and warmup >= 2 else 0
        out = [self.step() for _ in range(warmup - probe)]
        syncs = self._count_syncs(out, probe) if probe else {}
        sync(self.engine.device)
        t0 = time.perf_counter()
        out += [self.step() for _ in range(self.steps - warmup)]
        host_s = time.perf_counter() - t0
        sync(self.engine.device)
        n = self.steps - warmup
        ms = 1e3 * (time.perf_counter() - t0) / n
        b = self.rows.shape[0]
        kv_len = start_len + (warmup + self.steps - 1) / 2 + 1  # mean sequence length of the timed steps
        return ({"ms_per_step": ms, "tok_s": b * 1e3 / ms, "decode_steps": n, "kv_len": kv_len,
                 "host_ms": 1e3 * host_s / n, **syncs}, torch.stack(out))

    def _count_syncs(self, out: list[torch.Tensor], steps: int) -> dict[str, Any]:
        """Run ``steps`` steps (appended to ``out``) under CUDA sync debugging; the syncs per
        step and where they came from (``file:line message``, most frequent first)."""
        import warnings

        sites: dict[str, int] = {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out += [self.step() for _ in range(steps)]
            finally:
                torch.cuda.set_sync_debug_mode("default")
        for w in caught:
            if "synchroniz" in str(w.message).lower():
                site = f"{Path(w.filename).name}:{w.lineno} {str(w.message).splitlines()[0][:80]}"
                sites[site] = sites.get(site, 0) + 1
        return {"syncs_per_step": sum(sites.values()) / steps,
                "sync_sites": "; ".join(f"{k} (x{v})" for k, v in sorted(sites.items(), key=lambda kv: -kv[1])[:3])}


# ---- transformers ------------------------------------------------------------------------------


def hf_decode(hf: Any, batch: int, context: int, new_tokens: int, static: bool, reps: int,
              seed: int) -> dict[str, float]:
    """ms per decode step of ``hf.generate``: (t(N+1 tokens) - t(1 token)) / N, medians over ``reps``.

    With ``static`` one ``StaticCache`` of ``context + new_tokens + 1`` tokens is reused (reset
    before every call), so the compiled decode forward and its CUDA graphs see the same buffers.
    """
    import transformers

    device = hf.device
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.randint(0, hf.config.vocab_size, (batch, context), device=device, generator=g)
    mask = torch.ones_like(ids)
    max_len = context + new_tokens + 1
    cache = None
    if static:
        try:  # transformers 5.x
            cache = transformers.StaticCache(config=hf.config, max_cache_len=max_len)
        except TypeError:  # 4.x
            cache = transformers.StaticCache(config=hf.config, max_batch_size=batch, max_cache_len=max_len,
                                             device=device, dtype=hf.dtype)

    def run(n: int) -> float:
        kwargs: dict[str, Any] = {}
        if cache is not None:
            cache.reset()
            kwargs["past_key_values"] = cache
        sync(device)
        t0 = time.perf_counter()
        hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                    pad_token_id=0, **kwargs)
        sync(device)
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    run(1), run(new_tokens + 1)  # warm-up (compiles the decode forward for the static cache)
    warmup_s = time.perf_counter() - t0
    for attempt in range(4):  # a difference of two noisy timings: more repeats while it is not positive
        short = statistics.median(run(1) for _ in range(reps << attempt))
        long = statistics.median(run(new_tokens + 1) for _ in range(reps << attempt))
        if long > short:
            break
    else:
        raise RuntimeError(f"generate of {new_tokens + 1} tokens timed no slower than of 1 token over "
                           f"{reps << 3} repeats (timing noise); raise --new-tokens or --reps.")
    ms = 1e3 * (long - short) / new_tokens
    return {"ms_per_step": ms, "tok_s": batch * 1e3 / ms, "warmup_s": warmup_s,
            "kv_len": context + new_tokens / 2 + 1.5}


def build_hf(mcfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int) -> Any:
    import transformers

    hf_cfg = mcfg.to_hf(attn_implementation="sdpa")
    cls = transformers.LlamaForCausalLM if mcfg.arch == "llama" else transformers.Qwen3ForCausalLM
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            hf = cls(hf_cfg)
    finally:
        torch.set_default_dtype(old)
    init_random_weights(hf, seed=seed)
    return hf.eval()


# ---- results -----------------------------------------------------------------------------------


def annotate(rows: list[dict[str, Any]]) -> None:
    """Add ``speedup_vs_hf_static`` / ``speedup_vs_hf_eager`` (tokens/s ratios, same shape) to every row."""
    base = {(r["impl"], r["batch"], r["context"]): r["tok_s"] for r in rows if r.get("tok_s")}
    for r in rows:
        for impl, col in (("hf-static-compile", "speedup_vs_hf_static"), ("hf-eager", "speedup_vs_hf_eager")):
            ref = base.get((impl, r["batch"], r["context"]))
            if r.get("tok_s") and ref and not r["impl"].startswith("hf-"):
                r[col] = r["tok_s"] / ref


def _best(rows: list[dict[str, Any]], batch: int, context: int, loop: bool) -> dict[str, Any] | None:
    """The fastest vattn row (engine rows, or ``/loop`` rows) at a shape."""
    cands = [r for r in rows if r["impl"].startswith("vattn-") and r["impl"].endswith("/loop") == loop
             and r["batch"] == batch and r["context"] == context and r.get("ms_per_step")]
    return min(cands, key=lambda r: r["ms_per_step"]) if cands else None


def _find(rows: list[dict[str, Any]], impl: str, batch: int, context: int) -> dict[str, Any] | None:
    return next((r for r in rows if r["impl"] == impl and r["batch"] == batch and r["context"] == context
                 and r.get("ms_per_step")), None)


def targets(rows: list[dict[str, Any]], context: int, batches: list[int]) -> list[dict[str, Any]]:
    """Issue 4's and issue 7's targets at prompt ``context``, for engine rows and ``/loop`` rows.

    Each entry: ``target``, ``issue``, ``basis`` (engine steps, or the device-resident loop),
    ``value`` (None when a row is missing), ``goal``, ``met``, and the ``rows`` it compares.
    """
    out: list[dict[str, Any]] = []

    def add(name: str, issue: int, basis: str, value: float | None, goal: str, met: bool | None, used: str) -> None:
        out.append({"target": name, "issue": issue, "basis": basis, "value": value, "goal": goal, "met": met,
                    "rows": used, "short": SHORT.sub(lambda m: ABBREV[m.group(0)], name)})

    for loop, basis in ((False, "engine step"), (True, "decode loop")):
        suffix = "/loop" if loop else ""
        for batch, goal in ((1, 3.0), (64, 4.0)):
            if batch not in batches:
                continue
            best, hf = _best(rows, batch, context, loop), _find(rows, "hf-static-compile", batch, context)
            value = best["tok_s"] / hf["tok_s"] if best and hf else None
            add(f"vattn tok/s over hf-static-compile, batch {batch}, prompt {context}", 4, basis, value,
                f">= {goal}", None if value is None else value >= goal,
                f"{best['impl'] if best else 'vattn (none)'} vs hf-static-compile")
        if 1 in batches:
            full = _find(rows, "vattn-cudagraph-full" + suffix, 1, context)
            value = full["x_floor"] if full else None
            add(f"FULL graphs ms/step over the floor, batch 1, prompt {context}", 7, basis, value, "<= 1.3",
                None if value is None else value <= 1.3, "vattn-cudagraph-full" + suffix)
        for batch in batches:
            full = _find(rows, "vattn-cudagraph-full" + suffix, batch, context)
            pw = _find(rows, "vattn-cudagraph-piecewise" + suffix, batch, context)
            value = pw["ms_per_step"] / full["ms_per_step"] if full and pw else None
            add(f"PIECEWISE ms/step over FULL, batch {batch}, prompt {context}", 7, basis, value, "<= 1.25",
                None if value is None else value <= 1.25,
                f"vattn-cudagraph-piecewise{suffix} vs vattn-cudagraph-full{suffix}")
    return out


ABBREV = {"vattn tok/s over hf-static-compile": "vattn/hf-static tok/s", "FULL graphs ms/step over the floor":
          "FULL/floor", "PIECEWISE ms/step over FULL": "PIECEWISE/FULL", ", batch ": " b", ", prompt ": " p"}
SHORT = re.compile("|".join(re.escape(k) for k in ABBREV))


def targets_digest(checks: list[dict[str, Any]]) -> dict[str, str]:
    """``targets()`` as one short line each, e.g. ``"FULL/floor b1 p512 (engine step)": "1.21 (<= 1.3: met)"``."""
    def verdict(c: dict[str, Any]) -> str:
        if c["value"] is None:
            return f"not measured ({c['goal']})"
        return f"{c['value']:.3g} ({c['goal']}: {'met' if c['met'] else 'NOT met'})"

    return {f"{c['short']} ({c['basis']})": verdict(c) for c in checks}


def plot(path: Path, rows: list[dict[str, Any]], floors: list[dict[str, Any]], title: str) -> Path | None:
    """ms per decode step vs batch, per impl, the floor as a line: per context one panel of engine
    steps (vattn impls and transformers) and one of the device-resident decode loop (``/loop``
    rows beside transformers' static cache)."""
    panels = []
    for context in sorted({f["context"] for f in floors}):
        fl = sorted((f["batch"], f["floor_ms"]) for f in floors if f["context"] == context)
        for loop in (False, True):
            series: dict[str, tuple[list[float], list[float]]] = {}
            for r in rows:
                keep = r["impl"].endswith("/loop") if loop else not r["impl"].endswith("/loop")
                if loop and r["impl"] == "hf-static-compile":
                    keep = True
                if keep and r["context"] == context and r.get("ms_per_step"):
                    xs, ys = series.setdefault(r["impl"], ([], []))
                    xs.append(r["batch"])
                    ys.append(r["ms_per_step"])
            if series:
                series["floor: (weights + KV) / copy BW"] = ([b for b, _ in fl], [f for _, f in fl])
            what = "device-resident decode loop" if loop else "engine step"
            panels.append({"title": f"prompt {context}: ms per decode step ({what})", "xlabel": "batch",
                           "ylabel": "ms/step", "logx": True, "series": series})
    return common.plot_panels(path, panels, title=title, ncols=2)


def step_figures(mcfg: ModelConfig, weight_bytes: int, elem: int, roof: roofline.Roofline, batch: int,
                 kv_len: float, ms: float) -> dict[str, Any]:
    """A row's floor (``floor_ms``, ``x_floor``), achieved TB/s and TFLOP/s and their roofline fractions."""
    nbytes = weight_bytes + kv_bytes_per_step(mcfg, batch, kv_len, elem)
    floor_ms = 1e3 * nbytes / (roof.copy_tbps * 1e12)
    tbps = nbytes / (ms * 1e-3) / 1e12
    tflops = flops_per_step(mcfg, weight_bytes // elem, batch, kv_len) / (ms * 1e-3) / 1e12
    return {"floor_ms": floor_ms, "x_floor": ms / floor_ms, "tb_per_s": tbps, "tflop_per_s": tflops,
            **roof.fractions(tbps=tbps, tflops=tflops)}


# ---- main --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="context 512 only, 2 repeats, 160 s budget")
    p.add_argument("--preset", default="llama-3.2-1b")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--contexts", default=None, help="prompt lengths (default 512,4096; --quick 512)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--backend", default=None, help="force a vattn backend by name")
    p.add_argument("--compile-sizes", default="1", help="CompilationConfig.compile_sizes, comma-separated token counts (\"\" for none): pieces also compiled for exactly these sizes (Inductor GEMV at 1)")
    p.add_argument("--impls", default=",".join((*VATTN_IMPLS, *HF_IMPLS)),
                   help=f"comma-separated, of {', '.join(ALL_IMPLS)}")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--reps", type=int, default=None, help="transformers repeats per timing (default 3; --quick 2)")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="skip jobs that would end past this many seconds from process start (default 480; --quick 160)")
    p.add_argument("--sync-scheduling", action="store_true",
                   help="engine rows sync on every step's tokens (Engine(async_scheduling=False))")
    p.add_argument("--no-loop", action="store_true", help="skip the device-resident decode loop rows")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda", help="cuda (the benchmark); cpu only to smoke-test the script")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = p.parse_args(argv)
    args.batches = [int(x) for x in args.batches.split(",")]
    args.contexts = [int(x) for x in (args.contexts or ("512" if args.quick else "512,4096")).split(",")]
    args.impls = [i for i in args.impls.split(",") if i]
    unknown = [i for i in args.impls if i not in ALL_IMPLS]
    if unknown:
        p.error(f"--impls: unknown {unknown}; choose from {list(ALL_IMPLS)}")
    if args.reps is None:
        args.reps = 2 if args.quick else 3
    if args.time_budget_s is None:
        args.time_budget_s = 160.0 if args.quick else 480.0
    if args.reps < 1 or args.new_tokens < 1:
        p.error(f"--reps and --new-tokens must be >= 1, got {args.reps} and {args.new_tokens}")
    return args


def job_order(args: argparse.Namespace) -> list[tuple[int, int, str]]:
    """(batch, context, impl): vattn at every shape first, then transformers at the first context
    (the static cache first: the targets compare with it), then transformers at the other contexts."""
    shapes = [(b, c) for c in args.contexts for b in args.batches]
    vattn_impls = [i for i in args.impls if i.startswith("vattn-")]
    hf_impls = sorted((i for i in args.impls if i.startswith("hf-")), key=lambda i: i != "hf-static-compile")
    jobs = [(b, c, i) for b, c in shapes for i in vattn_impls]
    jobs += [(b, c, i) for b, c in shapes if c == args.contexts[0] for i in hf_impls]
    jobs += [(b, c, i) for b, c in shapes if c != args.contexts[0] for i in hf_impls]
    return jobs


class VattnImpls:
    """Builds each vattn impl once (compile, capture) and measures it at a shape.

    ``runner(impl)`` is the ``Engine`` keyword arguments (``forward_fn`` / ``graph_runner``);
    an impl whose build or run raised stays disabled (compile and capture
    errors repeat), and its later rows say why.
    """

    def __init__(self, model: DecoderForCausalLM, cfg: vattn.VattnConfig, kv: Any, args: argparse.Namespace,
                 max_model_len: int, report: dict[str, Any]) -> None:
        self.model, self.cfg, self.kv, self.args = model, cfg, kv, args
        self.max_model_len, self.report = max_model_len, report
        self.runners: dict[str, dict[str, Any]] = {}
        self.failed: dict[str, str] = {}

    def _decode(self, r: dict[str, Any], batch: int, context: int, new_tokens: int) -> tuple[dict[str, Any], Engine]:
        a = self.args
        return vattn_decode(self.model, self.cfg, self.kv, r, batch, context, new_tokens,
                            a.max_num_batched_tokens, a.seed, not a.sync_scheduling)

    def runner(self, impl: str) -> tuple[dict[str, Any], float]:
        """(Engine kwargs, seconds spent building them now: 0 when built earlier)."""
        if impl in self.failed:
            raise RuntimeError(f"disabled after an earlier error: {self.failed[impl]}")
        if impl in self.runners:
            return self.runners[impl], 0.0
        t0 = time.perf_counter()
        try:
            r = self._build(impl)
            if impl != "vattn-eager":  # compile / capture now, outside the timings
                for b in (1, 2):  # token counts 1 and >1 (Dynamo specialises a size-1 dim)
                    DecodeLoop(self._decode(r, b, 32, 4)[1], r, 6).run()
                if "graph_runner" in r:
                    self.report["cudagraph"][impl]["stats"] = r["graph_runner"].stats
        except Exception as e:
            self.failed[impl] = f"{type(e).__name__}: {e}"[:800]
            raise
        self.runners[impl] = r
        return r, time.perf_counter() - t0

    def _build(self, impl: str) -> dict[str, Any]:
        if impl == "vattn-eager":
            return {"forward_fn": self.model}
        if impl == "vattn-compile":
            return {"forward_fn": compile_model(self.model, self.cfg, "vattn")}
        if impl == "vattn-torch-compile":
            return {"forward_fn": compile_model(self.model, self.cfg, "inductor")}
        if impl in GRAPH_MODES:
            base = self.runner("vattn-compile")[0]
            graphs = vattn.CUDAGraphRunner(
                base["forward_fn"], self.cfg, self.kv, capture_sizes=sorted(set(self.args.batches)),
                max_model_len=self.max_model_len, mode=vattn.CUDAGraphMode[GRAPH_MODES[impl]], show_progress=False)
            self.report["cudagraph"][impl] = {"requested": GRAPH_MODES[impl], "mode": graphs.mode.name,
                                              "downgrades": graphs.downgrade_reasons,
                                              "capture_sizes": list(graphs.sizes)}
            return {"graph_runner": graphs}
        raise ValueError(f"unknown vattn impl {impl!r}; choose from {list(VATTN_IMPLS)} or vattn-torch-compile")

    def measure(self, impl: str, batch: int, context: int) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """(engine-step figures, ``/loop`` row figures or None with ``--no-loop``)."""
        r, setup_s = self.runner(impl)
        try:
            figures, engine = self._decode(r, batch, context, self.args.new_tokens)
            if "graph_runner" in r:
                figures["graph_mode"] = graph_mode(r)
            if self.args.no_loop:
                return {**figures, "setup_s": setup_s}, None
            loop, _ = DecodeLoop(engine, r, self.args.new_tokens + 4).run()
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as e:
            self.failed[impl] = f"{type(e).__name__}: {e}"[:800]
            raise
        if "graph_runner" in r:
            loop["graph_mode"] = graph_mode(r)
        loop.update(self._compile_state(impl))
        return {**figures, "setup_s": setup_s}, loop

    def _compile_state(self, impl: str) -> dict[str, Any]:
        """For impls on the ``vattn.compile``d model: the graphs Dynamo has made so far (1 when
        nothing recompiled) and whether calls still skip Dynamo's guards (``DirectDispatch``)."""
        compiled = self.runners.get("vattn-compile", {}).get("forward_fn")
        if impl == "vattn-eager" or not hasattr(compiled, "backend"):
            return {}
        direct = getattr(compiled, "_direct", None)
        return {"dynamo_graphs": compiled.backend.counter.num_graphs_seen,
                "direct_dispatch": direct is not None and not direct.disabled and direct.fn is not None}


def graph_mode(r: dict[str, Any]) -> str | None:
    """The runtime mode (FULL / PIECEWISE / NONE) the graph runner used for its last step."""
    bd = getattr(r.get("graph_runner"), "last_batch_descriptor", None)
    return bd.mode.name if bd is not None else None


def build_models(args: argparse.Namespace, mcfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                 cfg: vattn.VattnConfig) -> tuple[DecoderForCausalLM, Any]:
    """The vattn model and the transformers model (None when transformers or the hf impls are
    absent), with the same random weights."""
    hf = None
    if any(i.startswith("hf-") for i in args.impls):
        try:
            hf = build_hf(mcfg, dtype, device, args.seed)
        except ImportError:
            say("transformers is not installed on this machine: skipping the hf-* baselines.")
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with vattn.global_force_attn_backend_context_manager(args.backend), vattn.set_current_vattn_config(cfg), \
                torch.device(device):
            model = DecoderForCausalLM(mcfg)
    finally:
        torch.set_default_dtype(old)
    if hf is not None:
        model.load_hf_state_dict(hf.state_dict())  # the same weights on both sides
    else:
        init_random_weights(model, seed=args.seed)
    return model.eval(), hf


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_e2e.py needs a CUDA GPU (run it on the device machine), or --device cpu to smoke-test.")
    env = common.env_info(device)
    path = common.result_path("e2e", env)
    mcfg = get_preset(args.preset, max_position_embeddings=max(args.contexts) + 4 * args.new_tokens + 1024)
    cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=BLOCK),
                            compilation=vattn.CompilationConfig(compile_sizes=common.token_counts(args.compile_sizes),
                                                                piece_passes=(OneTokenGemv(),)))
    model, hf = build_models(args, mcfg, device, dtype, cfg)

    budget = args.max_num_batched_tokens
    # engine steps (prefill overlap + new tokens), then the decode loop (new tokens + warm-up)
    per_req = max(c + 2 * args.new_tokens + math.ceil(max(args.batches) * c / budget) + 16 for c in args.contexts)
    num_blocks = max(args.batches) * math.ceil(per_req / BLOCK) + 16
    kv = vattn.allocate_kv_cache(cfg, num_blocks=num_blocks, device=device, dtype=dtype)

    roof = roofline.measure(device, quick=args.quick, tiny=device.type != "cuda")
    wbytes = weight_bytes_per_step(model)
    elem = torch.tensor([], dtype=dtype).element_size()
    target_context = 512 if 512 in args.contexts else args.contexts[0]
    floors = [{"batch": b, "context": c,
               "floor_ms": step_figures(mcfg, wbytes, elem, roof, b, c + args.new_tokens / 2, 1.0)["floor_ms"]}
              for c in args.contexts for b in args.batches]
    rows: list[dict[str, Any]] = []
    plots: list[str] = []
    report: dict[str, Any] = {
        "compile_sizes": list(cfg.compilation.compile_sizes),
        "preset": args.preset, "model": {**mcfg.__dict__, "rope_scaling": mcfg.rope_scaling},
        "dtype": str(dtype), "vattn_backend": model.model.layers[0].self_attn.attn.attn_backend.get_name(),
        "block_size": BLOCK, "max_num_batched_tokens": budget, "new_tokens": args.new_tokens, "quick": args.quick,
        "async_scheduling": not args.sync_scheduling,
        "time_budget_s": args.time_budget_s, "roofline": roof.to_dict(), "weight_bytes_per_step": wbytes,
        "floor": floors, "targets": {}, "target_checks": [], "cudagraph": {}, "skipped": {}, "partial": True,
        "notes": [
            "impl rows: examples.engine.Engine steps (schedule + metadata + forward + logits + sampling), "
            "median over steps where every request decodes; async_scheduling: whether each step was launched "
            "before the previous step's tokens reached the host (else one host sync per step)",
            "impl/loop rows: DecodeLoop, device-resident decode (no per-step sync; host work overlaps the GPU)",
            "hf rows: (t(generate N+1) - t(generate 1)) / N, medians over --reps",
            "floor_ms: (weight bytes + KV bytes at the row's mean sequence length kv_len) / roofline copy_tbps "
            "(2 * bytes / time of a device copy); summary.floor: at context + new_tokens / 2",
            "targets: vattn = the fastest vattn impl at the shape; 'engine step' and 'decode loop' bases",
        ],
    }
    impls = VattnImpls(model, cfg, kv, args, per_req + 16, report)

    def write(redraw: bool = True) -> None:
        annotate(rows)
        report["target_checks"] = targets(rows, target_context, args.batches)
        report["targets"] = targets_digest(report["target_checks"])
        if redraw and not args.no_plot:
            png = plot(path.with_suffix(".png"), rows, floors,
                       f"{args.preset} {args.dtype} decode, {args.new_tokens} new tokens ({env['device_name']})")
            plots[:] = [png.name] if png is not None else []
        common.write_results("e2e", {"env": env, "summary": report, "rows": rows, "plots": plots}, path=path)

    job_seconds: dict[str, float] = {}  # impl -> slowest job so far (one-off compile / capture excluded)
    for batch, context, impl in common.progress(job_order(args), desc="e2e", unit="job"):
        row: dict[str, Any] = {"impl": impl, "batch": batch, "context": context, "new_tokens": args.new_tokens}
        loop: dict[str, Any] | None = None
        elapsed = time.perf_counter() - _T0
        estimate = job_seconds.get(impl, DEFAULT_ESTIMATE_S.get(impl, 60.0))
        t_job = time.perf_counter()
        try:
            if elapsed + estimate > args.time_budget_s:
                row["skipped"] = (f"time budget: {elapsed:.0f} s used + about {estimate:.0f} s for this job > "
                                  f"{args.time_budget_s:.0f} s (--time-budget-s)")
            elif impl.startswith("vattn-"):
                figures, loop = impls.measure(impl, batch, context)
                row.update(figures)
            elif hf is None:
                row["skipped"] = "transformers is not installed"
            else:
                row.update(hf_decode(hf, batch, context, args.new_tokens, impl == "hf-static-compile",
                                     args.reps, args.seed))
        except torch.cuda.OutOfMemoryError as e:
            row["skipped"] = f"out of memory: {str(e).splitlines()[0]}"
        except Exception as e:  # keep measuring the other rows; the error is in the JSON
            traceback.print_exc()
            row["error"] = f"{type(e).__name__}: {e}"[:800]
        if "ms_per_step" in row:
            spent = time.perf_counter() - t_job - row.get("setup_s", 0.0)
            job_seconds[impl] = max(job_seconds.get(impl, 0.0), spent)
        if "skipped" in row or "error" in row:
            report["skipped"][f"{impl}/b{batch}/c{context}"] = row.get("skipped") or row.get("error")
        common.free_memory()
        if loop is not None:  # the shape's keys, not the engine-only figures
            loop = {**{k: v for k, v in row.items() if k not in ENGINE_ONLY}, "impl": impl + "/loop", **loop}
        new_rows = [row] if loop is None else [row, loop]
        for rr in new_rows:
            if "ms_per_step" in rr:
                rr.update(step_figures(mcfg, wbytes, elem, roof, batch, rr["kv_len"], rr["ms_per_step"]))
            rows.append(rr)
            say(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rr.items()}))
        write(redraw="ms_per_step" in row)

    report["wall_s"], report["partial"] = time.perf_counter() - _T0, False
    write()
    print(f"wrote {path}" + (f" and {plots[0]}" if plots else ""))
    print_table(rows, report["target_checks"])
    return {"env": env, "summary": report, "rows": rows}


def print_table(rows: list[dict[str, Any]], checks: list[dict[str, Any]]) -> None:
    """The rows, then the targets, as markdown tables on stdout."""
    table = common.Table(["impl", "batch", "context", "ms_per_step", "tok_s", "floor_ms", "x_floor",
                          "speedup_vs_hf_static", "graph_mode", "host_ms", "syncs_per_step", "skipped", "error"],
                         title="e2e decode")
    table.extend(rows)
    table.print()
    tt = common.Table(["target", "issue", "basis", "value", "goal", "met", "rows"], title="targets")
    tt.extend(checks)
    tt.print()


if __name__ == "__main__":
    main()

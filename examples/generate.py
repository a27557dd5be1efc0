#!/usr/bin/env python
"""Generate with a Llama-style model on vattn: continuous batching over a paged KV cache.

Random weights (no downloads), random prompts; requests arrive at different steps and
finish at different lengths. Prints prefill and decode tokens/s.

    python examples/generate.py                                   # CPU, tiny preset, a few seconds
    python examples/generate.py --device cuda --preset llama-3.2-1b --compile --cudagraph \\
        --num-requests 64 --prompt-len 512 --output-len 64
    python examples/generate.py --preset qwen3-next-tiny          # hybrid: Gated DeltaNet + attention, CPU
    python examples/generate.py --device cuda --preset qwen3-next-16l --compile --cudagraph   # Qwen3-Next widths
    torchrun --nproc-per-node 2 examples/generate.py --tp 2 --device cpu      # tensor parallel, gloo
    torchrun --nproc-per-node 2 examples/generate.py --tp 2 --preset llama-3-8b --compile --cudagraph
    python examples/generate.py --hf /path/to/checkpoint --prompt "The capital of France is"   # transformers model

The ``qwen3-next-*`` presets are ``examples/hybrid_model.py``'s Qwen3-Next-style hybrid (Gated
DeltaNet layers with a state per request, attention in every fourth layer; one device, no ``--tp``):
its cache gets a state slot per engine row (``num_state_slots=--max-num-seqs``).

``--hf PATH`` runs a local transformers checkpoint directory (config.json and safetensors) through
``vattn.integrations.transformers`` (its attention on vattn, the rest transformers' own code). With
a tokenizer in the directory ``--prompt`` (repeatable) takes text and the decoded completions are
printed; without one the prompts are random token ids and the outputs are printed as ids
(``python examples/hf_model.py DIR --tokenizer`` saves a tiny random checkpoint to try it).

Tensor parallelism (``--tp N`` under ``torchrun --nproc-per-node N``; see examples/tp.py): rank r
runs on ``cuda:LOCAL_RANK`` with NCCL (gloo on the CPU) and holds 1/N of the heads, the MLP and
the vocabulary, and its own paged KV cache. Every rank runs the same deterministic scheduler on
the same requests; rank 0's sampled tokens are broadcast each step, so the ranks stay in
lockstep. Only rank 0 prints. The weights are the same as with ``--tp 1`` (the seeded full
tensors, sliced), so greedy outputs match up to float rounding.

Throughput: prefill tokens/s = prompt tokens computed / time of the steps that had any
prefill; decode tokens/s = generated tokens computed / time of the decode-only steps.
With ``--compile`` a warm-up request runs first and its time is reported separately.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):  # `python examples/generate.py` from anywhere
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from tqdm import tqdm

import vattn
from examples.engine import Engine, SamplingParams
from examples.gemv import OneTokenGemv, gemv_lm_head
from examples.hybrid_model import HYBRID_PRESETS, HybridForCausalLM, get_hybrid_preset
from examples.hybrid_model import init_random_weights as init_hybrid_weights
from examples.model import PRESETS, DecoderForCausalLM, get_preset, init_random_weights
from examples.tp import TensorParallel, tensor_parallel_run

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def compile_model(model: torch.nn.Module, cfg: vattn.VattnConfig,
                  backend: str = "vattn") -> Callable[..., torch.Tensor]:
    """The compiled forward: ``vattn.compile`` (split at attention, Inductor per piece), or
    ``torch.compile(fullgraph=True, dynamic=True)`` with the named torch backend.

    PyTorch specialises a dynamic dimension of size 1: a model traced on several tokens compiles
    again for its first 1-token step. With the token dimension of the inputs marked unbacked
    (``torch._dynamo.decorators.mark_unbacked``), one graph serves every token count; that is what the torch
    backends' calls do here (``vattn.compile`` needs no marking).
    """
    if backend == "vattn":
        return vattn.compile(model, cfg)
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=backend)

    def forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        torch._dynamo.decorators.mark_unbacked(input_ids, 0)
        torch._dynamo.decorators.mark_unbacked(positions, 0)
        return compiled(input_ids, positions)

    return forward


def make_cudagraph_runner(forward_fn: Callable[..., torch.Tensor], cfg: vattn.VattnConfig, kv: Any,
                          max_batch_size: int, max_model_len: int, show_progress: bool = True) -> Any | None:
    """A ``vattn.CUDAGraphRunner`` (full graphs for decodes, piecewise for the rest where the model
    is ``vattn.compile``d), or None with a message where this vattn has none."""
    try:
        runner_cls = vattn.CUDAGraphRunner
    except (ImportError, AttributeError) as e:
        print(f"--cudagraph: vattn.CUDAGraphRunner is not available ({e}); running without CUDA graphs.",
              file=sys.stderr)
        return None
    # The runner downgrades what the backends / model cannot serve and logs why (runner.downgrade_reasons).
    return runner_cls(forward_fn, cfg, kv, max_batch_size=max_batch_size, max_model_len=max_model_len,
                      mode=vattn.CUDAGraphMode.FULL_AND_PIECEWISE, show_progress=show_progress)


def kv_device(kv: Any) -> torch.device:
    return next(iter(kv.tensors.values())).device


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--preset", default=None, choices=sorted(PRESETS) + sorted(HYBRID_PRESETS),
                   help="model shape (default: tiny on CPU, llama-3.2-1b on CUDA); qwen3-next-*: the Qwen3-Next-style "
                        "hybrid of examples/hybrid_model.py (Gated DeltaNet, attention every fourth layer)")
    p.add_argument("--hf", default=None, metavar="PATH",
                   help="run a local transformers checkpoint directory (config.json + safetensors) instead of a preset")
    p.add_argument("--prompt", action="append", default=None,
                   help="with --hf and a tokenizer in PATH: a prompt text (repeat for several requests)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                   help="model dtype (default: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--backend", default=None,
                   help="force a vattn attention backend by name (TORCH_SDPA, TRITON_ATTN, FLASH_ATTN, FLASHINFER)")
    p.add_argument("--kv-cache-dtype", default="auto", help="CacheConfig.cache_dtype (auto, fp8, ...)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (fullgraph, dynamic)")
    p.add_argument("--compile-backend", default="vattn",
                   help="vattn = vattn.compile; inductor / aot_eager / eager = torch.compile(fullgraph, dynamic)")
    p.add_argument("--compile-sizes", default="",
                   help="with --compile: token counts to also compile for exactly (CompilationConfig.compile_sizes), "
                        "e.g. 1 for batch-1 decode (Inductor fuses matrix-vector products); costs a compile per size")
    p.add_argument("--compile-cache-dir", default=None,
                   help="with --compile: save Dynamo's trace here and load it on later runs instead of tracing "
                        "(CompilationConfig.cache_dir; default ~/.cache/vattn/compile, none with "
                        "VATTN_DISABLE_COMPILE_CACHE=1; Inductor's cache serves the kernels)")
    p.add_argument("--cudagraph", action="store_true", help="replay decode steps from CUDA graphs")
    p.add_argument("--sync-scheduling", action="store_true",
                   help="sync on every step's tokens instead of preparing the next step while the GPU runs "
                        "(Engine(async_scheduling=False); the tokens are the same)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (run under torchrun --nproc-per-node N)")
    p.add_argument("--allreduce", default="auto", choices=["auto", "symm_mem", "nccl"],
                   help="with --tp on GPUs: auto = FlashInfer's all-reduce fused with the residual add and RMSNorm "
                        "where FlashInfer is installed, and symm_mem for the rest; symm_mem = symmetric-memory "
                        "one-/two-shot all-reduce by message size where the GPUs have peer access, NCCL for large "
                        "messages (examples/allreduce.py); nccl = NCCL only")
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64, help="longest prompt (prompts are in [len/2, len])")
    p.add_argument("--output-len", type=int, default=32, help="longest output (outputs are in [len/2, len])")
    p.add_argument("--fixed-lengths", action="store_true", help="every prompt/output has exactly these lengths")
    p.add_argument("--arrival-every", type=int, default=1, help="request i arrives at step i * this")
    p.add_argument("--max-num-batched-tokens", type=int, default=256, help="token budget per step")
    p.add_argument("--max-num-seqs", type=int, default=64, help="most requests running at once")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None, help="KV-cache blocks (default: enough for all requests)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (torch.set_num_threads)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = p.parse_args(argv)
    on_cuda = torch.device(args.device).type == "cuda"
    args.preset = args.preset or ("llama-3.2-1b" if on_cuda else "tiny")
    args.dtype = args.dtype or ("bfloat16" if on_cuda else "float32")
    if args.tp < 1:
        p.error(f"--tp must be at least 1, got {args.tp}.")
    for flag, least in (("num_requests", 1), ("prompt_len", 1), ("output_len", 0), ("max_num_batched_tokens", 1),
                        ("max_num_seqs", 1), ("block_size", 1), ("num_blocks", 1), ("arrival_every", 0),
                        ("threads", 1)):
        value = getattr(args, flag)
        if value is not None and value < least:
            what = {"prompt_len": " (a prompt needs a token)", "output_len": " (0: requests finish with no output)"}
            p.error(f"--{flag.replace('_', '-')} must be at least {least}{what.get(flag, '')}, got {value}.")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        p.error(f"--temperature must be a finite number >= 0 (0 = greedy), got {args.temperature}.")
    if not 0 < args.top_p <= 1:
        p.error(f"--top-p must be in (0, 1], got {args.top_p}; 1 samples from the whole distribution.")
    if args.preset in HYBRID_PRESETS and args.tp != 1:
        p.error(f"--preset {args.preset} (a hybrid model) runs on one device; leave out --tp.")
    if args.hf is not None and args.tp != 1:
        p.error("--hf runs on one device; tensor parallelism (--tp) is for the example model's presets.")
    if args.prompt and args.hf is None:
        p.error("--prompt needs --hf PATH (a checkpoint with a tokenizer); the presets take random token ids.")
    if args.backend is not None and vattn.backend_name_to_enum(args.backend) is None:
        p.error(f"--backend {args.backend!r} is not a vattn backend; valid: "
                f"{[m.name for m in vattn.AttentionBackendEnum]}")
    return args


def make_requests(args: argparse.Namespace, vocab_size: int) -> list[tuple[list[int], SamplingParams, int]]:
    """Seeded random (prompt, sampling, arrival_step) triples."""
    g = torch.Generator().manual_seed(args.seed)

    def length(hi: int) -> int:  # in [hi/2, hi], at least 1 unless hi is 0 (--output-len 0)
        return hi if args.fixed_lengths or hi == 0 else int(torch.randint(max(1, hi // 2), hi + 1, (1,), generator=g))

    out = []
    for i in range(args.num_requests):
        prompt = torch.randint(0, vocab_size, (length(args.prompt_len),), generator=g).tolist()
        sp = SamplingParams(max_tokens=length(args.output_len), temperature=args.temperature, top_p=args.top_p)
        out.append((prompt, sp, i * args.arrival_every))
    return out


def _tokenizer(path: str) -> Any | None:
    """The tokenizer saved in checkpoint directory ``path``, or None when it holds none."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((Path(path) / n).is_file() for n in names):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def completion_text(tokenizer: Any, tokens: list[int]) -> str:
    """A request's output as text, up to its first end-of-sequence token (requests finish by count)."""
    eos = tokenizer.eos_token_id
    if eos is not None and eos in tokens:
        tokens = tokens[: tokens.index(eos)]
    return tokenizer.decode(tokens, skip_special_tokens=True)


def build_hf(args: argparse.Namespace) -> tuple[Any, vattn.VattnConfig, Any, Any, list[list[int]] | None]:
    """``--hf``: the transformers checkpoint on vattn (``vattn.integrations.transformers``), its
    config and KV cache, its tokenizer (or None) and the tokenized ``--prompt`` texts (or None)."""
    from vattn.integrations import transformers as vt

    if not (Path(args.hf) / "config.json").is_file():
        raise SystemExit(f"--hf {args.hf}: expected a checkpoint directory with config.json (and safetensors).")
    tokenizer = _tokenizer(args.hf)
    if args.prompt and tokenizer is None:
        raise SystemExit(f"--prompt needs a tokenizer, and {args.hf} has none; leave --prompt out to run random "
                         "token ids.")
    prompts = [tokenizer(text)["input_ids"] for text in args.prompt] if args.prompt else None
    if prompts is not None:
        args.num_requests, args.prompt_len = len(prompts), max(len(p) for p in prompts)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    sizes = tuple(int(x) for x in args.compile_sizes.split(",") if x.strip())
    cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=args.block_size, cache_dtype=args.kv_cache_dtype),
                            compilation=vattn.CompilationConfig(compile_sizes=sizes, cache_dir=args.compile_cache_dir,
                                                                piece_passes=(OneTokenGemv(),)))
    if args.no_progress:
        import transformers

        transformers.utils.logging.disable_progress_bar()
    with vattn.global_force_attn_backend_context_manager(args.backend):
        model = vt.from_pretrained(args.hf, cfg, dtype=dtype, device=device, local_files_only=True)
    gemv_lm_head(model)  # one-row LM heads on the example GEMV, as examples/model.py's
    per_req = -(-(args.prompt_len + args.output_len) // args.block_size)
    num_blocks = args.num_blocks or per_req * min(args.num_requests, args.max_num_seqs) + per_req
    # Hybrid checkpoints' mixer layers: a state slot per engine row (ignored without mixers).
    kv = vattn.allocate_kv_cache(cfg, num_blocks=num_blocks, device=device, dtype=dtype,
                                 num_state_slots=args.max_num_seqs)
    return model, cfg, kv, tokenizer, prompts


def build(args: argparse.Namespace, tp: TensorParallel | None = None
          ) -> tuple[DecoderForCausalLM | HybridForCausalLM, vattn.VattnConfig, Any]:
    """The model (random weights on ``args.device``; this rank's shard under ``tp``) and its vattn
    config and paged KV cache (this rank's KV heads; for a hybrid preset also a state slot per
    engine row: the scheduler's ``InputBatch`` rows are the state slots)."""
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    hybrid = args.preset in HYBRID_PRESETS
    presets, get = (HYBRID_PRESETS, get_hybrid_preset) if hybrid else (PRESETS, get_preset)
    mcfg: Any = get(args.preset, max_position_embeddings=min(
        presets[args.preset].max_position_embeddings, max(4096, args.prompt_len + args.output_len)))
    sizes = tuple(int(x) for x in args.compile_sizes.split(",") if x.strip())
    cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=args.block_size, cache_dtype=args.kv_cache_dtype),
                            compilation=vattn.CompilationConfig(compile_sizes=sizes, cache_dir=args.compile_cache_dir,
                                                                piece_passes=(OneTokenGemv(),)))
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with vattn.global_force_attn_backend_context_manager(args.backend), \
                vattn.set_current_vattn_config(cfg), torch.device(device):
            model = HybridForCausalLM(mcfg) if hybrid else DecoderForCausalLM(mcfg, tp=tp)
    finally:
        torch.set_default_dtype(old_dtype)
    (init_hybrid_weights if hybrid else init_random_weights)(model, seed=args.seed)
    model.eval()
    per_req = -(-(args.prompt_len + args.output_len) // args.block_size)
    num_blocks = args.num_blocks or per_req * min(args.num_requests, args.max_num_seqs) + per_req
    kv = vattn.allocate_kv_cache(cfg, num_blocks=num_blocks, device=device, dtype=dtype,
                                 num_state_slots=args.max_num_seqs)  # (ignored by a model without mixer layers)
    return model, cfg, kv


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the generation; returns the measured figures (also printed) and ``outputs`` (token ids per request)."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    # Under torchrun: a clean leave after the last step, and a failing rank exits with its error
    # (torchrun then stops the others) instead of leaving them waiting in a collective.
    # `graphs` releases the CUDA graphs before the group goes (NCCL's destroy waits on graphs that hold
    # its kernels): context managers exit in reverse order.
    with tensor_parallel_run(args.tp, args.device) as (tp, device), contextlib.ExitStack() as graphs:
        args.device = str(device)
        return _run(args, tp, graphs)


def _run(args: argparse.Namespace, tp: TensorParallel, graphs: contextlib.ExitStack) -> dict[str, Any]:
    lead = tp.rank == 0  # the rank that prints
    args.no_progress = args.no_progress or not lead
    tokenizer, prompts = None, None
    if args.hf is not None:
        model, cfg, kv, tokenizer, prompts = build_hf(args)
    else:
        model, cfg, kv = build(args, tp)
    if tp.size > 1 and args.allreduce != "nccl" and kv_device(kv).type == "cuda":
        tokens, hidden = max(args.max_num_batched_tokens, args.max_num_seqs), model.config.hidden_size
        tp.enable_symm_mem(tokens, hidden, DTYPES[args.dtype], kv_device(kv))  # False (logged): NCCL throughout
        if args.allreduce == "auto":  # decode-sized steps; larger ones are bandwidth-bound and go symm_mem / NCCL
            fused_tokens = max(args.max_num_seqs, min(tokens, 1024))
            tp.enable_fused_norm(fused_tokens, hidden, DTYPES[args.dtype], kv_device(kv))  # False (logged): unfused
    backend = next(iter(cfg.attention_layers().values())).attn_backend.get_name()
    forward_fn: Callable[..., torch.Tensor] = model
    if args.compile:
        forward_fn = compile_model(model, cfg, args.compile_backend)
    runner = None
    if args.cudagraph:
        runner = make_cudagraph_runner(forward_fn, cfg, kv, args.max_num_seqs, args.prompt_len + args.output_len,
                                       not args.no_progress)
        graphs.callback(runner.release)

    def new_engine() -> Engine:
        return Engine(model, cfg, kv, device=args.device, max_num_batched_tokens=args.max_num_batched_tokens,
                      max_num_seqs=args.max_num_seqs, forward_fn=forward_fn, graph_runner=runner,
                      seed=args.seed, async_scheduling=not args.sync_scheduling,
                      token_sync=tp.broadcast_from_first if tp.size > 1 else None)

    warmup_s = 0.0
    if args.compile or args.cudagraph:  # compile (and capture) outside the measured run
        t0 = time.perf_counter()
        warm = new_engine()
        warm.add_request(list(range(min(8, args.prompt_len) or 1)), SamplingParams(max_tokens=3))
        warm.run()
        warmup_s = time.perf_counter() - t0

    engine = new_engine()
    todo = make_requests(args, model.config.vocab_size)
    if prompts is not None:  # --prompt texts: every request generates --output-len tokens
        todo = [(p, SamplingParams(max_tokens=args.output_len, temperature=args.temperature, top_p=args.top_p), a)
                for p, (_, _, a) in zip(prompts, todo)]
    requests = [engine.add_request(p, sp, a) for p, sp, a in todo]
    total_out = sum(r.sampling.max_tokens for r in requests)
    bar = tqdm(total=total_out, unit="tok", desc="generate", disable=args.no_progress, file=sys.stdout)
    t0 = time.perf_counter()
    stats = engine.run(on_step=lambda s: bar.update(s.num_new_outputs))
    wall = time.perf_counter() - t0
    bar.close()

    prefill_steps = [s for s in stats if s.num_prefill_tokens]
    decode_steps = [s for s in stats if not s.num_prefill_tokens and s.num_decode_tokens]
    prefill_tok = sum(s.num_prefill_tokens for s in stats)
    decode_tok = sum(s.num_decode_tokens for s in stats)
    prefill_s = sum(s.seconds for s in prefill_steps)
    decode_s = sum(s.seconds for s in decode_steps)
    result: dict[str, Any] = {
        "steps": float(len(stats)),
        "prefill_tokens": float(prefill_tok),
        "decode_tokens": float(decode_tok),
        "output_tokens": float(sum(len(r.output_token_ids) for r in requests)),
        "prefill_tok_s": prefill_tok / prefill_s if prefill_s else 0.0,
        "decode_tok_s": sum(s.num_decode_tokens for s in decode_steps) / decode_s if decode_s else 0.0,
        "ms_per_decode_step": 1e3 * decode_s / len(decode_steps) if decode_steps else 0.0,
        "wall_s": wall,
        "warmup_s": warmup_s,
        "preemptions": float(sum(r.num_preemptions for r in requests)),
        "cudagraph_mode": runner.mode.name if runner is not None else "off",
        "tp": float(tp.size),
        "outputs": [r.output_token_ids for r in requests],
    }
    if tokenizer is not None:
        result["texts"] = [completion_text(tokenizer, r.output_token_ids) for r in requests]
    if not lead:
        return result
    tp_note = ""
    if tp.size > 1:
        kinds = [k for k, on in (("fused + RMSNorm", tp.fused_norm), ("symmetric-memory", tp.symm_mem)) if on is not None]
        tp_note = f" with {' + '.join([*kinds, 'c10d'])} all-reduce"
    print(f"model {args.hf or args.preset} ({args.dtype}, {args.device}, tp={tp.size}{tp_note}), backend {backend}, "
          f"compile={args.compile}, scheduling={'sync' if args.sync_scheduling else 'async'}, "
          f"cudagraph={result['cudagraph_mode']}; {len(requests)} requests, {len(stats)} steps in {wall:.2f} s"
          + (f" (+{warmup_s:.1f} s warm-up)" if warmup_s else ""))
    print(f"prefill: {prefill_tok} tokens, {result['prefill_tok_s']:.1f} tok/s | decode: {decode_tok} tokens, "
          f"{result['decode_tok_s']:.1f} tok/s, {result['ms_per_decode_step']:.2f} ms/step (decode-only steps)")
    if args.hf is not None:  # every completion: decoded text with a tokenizer, else token ids
        for i, r in enumerate(requests):
            shown = repr(result["texts"][i]) if tokenizer is not None else r.output_token_ids
            print(f"request {i}: prompt {len(r.prompt_token_ids)} tokens -> {shown}")
        return result
    print(f"request 0: prompt {len(requests[0].prompt_token_ids)} tokens -> {requests[0].output_token_ids[:16]}"
          + (" ..." if len(requests[0].output_token_ids) > 16 else ""))
    return result


if __name__ == "__main__":
    main()

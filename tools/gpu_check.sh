#!/usr/bin/env bash
# Runs on a GPU machine with the kernel libraries installed:
#   bash tools/gpu_check.sh PHASE [PHASE...]
# Phases: env, sdpa, triton, flashinfer, flash_attn, compile, compile-cache, cudagraph, model, all-tests (every test,
#         GPU ones included, 4 workers), gpu-tests (the GPU-marked ones), profile (profile_step.py),
#         recompiles (generate.py --compile --cudagraph with TORCH_LOGS=recompiles), bench-triton,
#         bench-overhead, bench-e2e, bench-compile-decode, bench-compile (cold start), bench-fp8,
#         bench-kernels.
# Logs and JSON go to $OUT (or ./gpu-out); each phase is bounded by PHASE_TIMEOUT seconds.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
T=${PHASE_TIMEOUT:-300}
pt() { timeout "$T" python3 -m pytest -q -p no:cacheprovider -rs -x --timeout "$T" "$@"; }
for phase in "$@"; do
  echo "=== $phase ($(date -u +%H:%M:%S))"
  case "$phase" in
    env) nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv;
         python3 -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.get_device_name())";;
    sdpa) pt -m "cuda and not slow" tests/test_torch_sdpa.py tests/test_layer.py tests/test_custom_ops.py 2>&1 | tee "$OUT/sdpa.log" | tail -25;;
    triton) pt -m "not slow" tests/test_triton_attn.py 2>&1 | tee "$OUT/triton.log" | tail -30;;
    flashinfer) pt -m "not slow" tests/test_flashinfer.py 2>&1 | tee "$OUT/flashinfer.log" | tail -30;;
    flash_attn) pt -m "not slow" tests/test_flash_attn.py 2>&1 | tee "$OUT/flash_attn.log" | tail -30;;
    compile) pt -m "not slow" tests/test_compile.py 2>&1 | tee "$OUT/compile.log" | tail -20;;
    compile-cache) pt -m "not slow" tests/test_compile_cache.py 2>&1 | tee "$OUT/compile_cache.log" | tail -20;;
    cudagraph) pt -m "not slow" tests/test_cudagraph.py 2>&1 | tee "$OUT/cudagraph.log" | tail -30;;
    model) pt -m "not slow" tests/test_model_parity.py tests/test_generate.py 2>&1 | tee "$OUT/model.log" | tail -20;;
    all-tests) timeout "$T" python3 -m pytest -q -p no:cacheprovider -rs -n 4 --dist loadfile --timeout "$T" \
                 -m "not slow" tests 2>&1 | tee "$OUT/all.log" | grep -v Warning | tail -40;;
    gpu-tests) timeout "$T" python3 -m pytest -q -p no:cacheprovider -rs -n 4 --dist loadfile --timeout "$T" \
                 -m "(cuda or flashinfer or flash_attn) and not slow" tests 2>&1 | tee "$OUT/gpu_tests.log" | grep -v Warning | tail -40;;
    profile) timeout "$T" python3 benchmarks/profile_step.py 2>&1 | tee "$OUT/profile.log" | tail -16;;
    recompiles) TORCH_LOGS=recompiles timeout "$T" python3 examples/generate.py --device cuda --dtype bfloat16 \
                 --preset llama-3.2-1b --compile --cudagraph --no-progress 2>&1 | tee "$OUT/recompiles.log" | grep -v Warning | tail -12;;
    bench-triton) timeout "$T" python3 benchmarks/bench_triton_attn.py 2>&1 | tee "$OUT/bench_triton.log" | tail -30;;
    bench-overhead) timeout "$T" python3 benchmarks/bench_layer_overhead.py 2>&1 | tee "$OUT/bench_overhead.log" | tail -30;;
    bench-e2e) timeout "$T" python3 benchmarks/bench_e2e.py 2>&1 | tee "$OUT/bench_e2e.log" | tail -30;;
    bench-compile-decode) timeout "$T" python3 benchmarks/bench_compile.py --only decode 2>&1 | tee "$OUT/bench_compile_decode.log" | tail -30;;
    bench-compile) timeout "$T" python3 benchmarks/bench_compile.py --only coldstart --layers 4 32 2>&1 | tee "$OUT/bench_compile.log" | tail -30;;
    bench-fp8) timeout "$T" python3 benchmarks/bench_fp8.py 2>&1 | tee "$OUT/bench_fp8.log" | tail -30;;
    bench-kernels) timeout "$T" python3 benchmarks/bench_kernels.py --quick 2>&1 | tee "$OUT/bench_kernels.log" | tail -30;;
    *) echo "unknown phase $phase";;
  esac
done
echo "=== done ($(date -u +%H:%M:%S))"

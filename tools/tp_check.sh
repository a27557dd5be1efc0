#!/usr/bin/env bash
# Runs on a 2-GPU device machine (kind nvidia-h200-x2): the TP tests, bench_tp (eager and
# compiled, FULL CUDA graphs with the all-reduces inside), and generate.py --tp 2.
# NVLink multicast stays off (the machine's NCCL_NVLS_ENABLE=0 is left as set).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
echo "=== env $(date -u +%H:%M:%S)"; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; env | grep -E "^NCCL_" || true
echo "=== tests $(date -u +%H:%M:%S)"
timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/test_tp.py 2>&1 | tee "$OUT/tp_tests.log" | tail -8
echo "=== bench_tp $(date -u +%H:%M:%S)"
timeout 170 torchrun --nproc-per-node 2 benchmarks/bench_tp.py 2>&1 | tee "$OUT/bench_tp.log" | grep -v Warning | tail -22
for f in "$OUT"/tp-*.json; do [ -f "$f" ] && mv "$f" "${f%.json}-eager.json"; done
echo "=== bench_tp --compile $(date -u +%H:%M:%S)"
timeout 150 torchrun --nproc-per-node 2 benchmarks/bench_tp.py --compile --allreduce functional,none 2>&1 | tee "$OUT/bench_tp_compile.log" | grep -v Warning | tail -16
echo "=== generate --tp 2 $(date -u +%H:%M:%S)"
timeout 90 torchrun --nproc-per-node 2 examples/generate.py --tp 2 --device cuda --dtype bfloat16 --preset llama-3.2-1b \
  --compile --cudagraph --no-progress 2>&1 | tee "$OUT/generate_tp2.log" | grep -v Warning | tail -8
echo "=== done $(date -u +%H:%M:%S)"

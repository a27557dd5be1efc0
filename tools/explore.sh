export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python -c "import inspect, torch; print('mark_unbacked', inspect.signature(torch._dynamo.decorators.mark_unbacked))"
run() { tag=$1; shift; timeout 150 python benchmarks/profile_step.py "$@" 2>&1 | grep -E "^\| [aFT]|Error|error" | tail -6; mv $OUT/profile-*.json $OUT/p-$tag.json; }
run unb --backends TRITON_ATTN auto
run hint --backends TRITON_ATTN --size-hint 64
run backed --backends TRITON_ATTN auto --dynamic backed
timeout 80 python benchmarks/bench_fp8.py --quick --layers 2 --backends TRITON_ATTN 2>&1 | grep -E "^\| TRI|removed"

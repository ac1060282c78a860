#!/bin/bash
# device call 23 (nvidia-h200-x2), carrying .gpu/whl and .gpu/old (018191b's scheduler.py and
# slots.py): GPU tests at 018191b's CUDA path, then serial against pipelined at 16/32 clients
# with the new admission and prompt order, 018191b's scheduler in the same call (A/B), the new
# one again, and the decode window at 1 client
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
(time python3 -m strata.model.mkmodel llama3-8b /tmp/l8b.gguf --weight-type BF16 --fast) > $OUT/mk8.log 2>&1 &
MK=$!
timeout 200 python3 -m pytest tests/test_skinny.py tests/test_fused_kernels.py tests/test_gpu.py \
  tests/test_attention_triton.py tests/test_attention_chunk.py -q -rs -p no:cacheprovider 2>&1 \
  | tee $OUT/gpu_tests.log | tail -4
wait $MK; tail -3 $OUT/mk8.log
sweep() {  # $1: a name for the files
  timeout 110 python3 -m strata.launch.bench sweep --model /tmp/l8b.gguf --devices cuda:0,cuda:1 \
    --layer-split 16 --modes serial,pipelined --clients 16,32 --tokens 128 --ctx-size 512 \
    --trace-dir /tmp/tr_$1 --json-out $OUT/sweep_$1.json 2>&1 | grep -v Warn | tee $OUT/sweep_$1.log
}
sweep new1
mkdir -p /tmp/keep && cp strata/coordinator/scheduler.py strata/coordinator/slots.py /tmp/keep/
cp .gpu/old/scheduler.py .gpu/old/slots.py strata/coordinator/
sweep old
cp /tmp/keep/scheduler.py /tmp/keep/slots.py strata/coordinator/
sweep new2
timeout 70 python3 -m strata.launch.windowbench --model /tmp/l8b.gguf --layouts "cuda:0,cuda:1" \
  --what pipeline --live 1 --iters 40 --graph-caches 8 2>&1 | grep -v Warn | tee $OUT/window.log

#!/bin/bash
# device call 19 (nvidia-h200-x2), carrying .gpu/whl and .gpu/model/smollm2.part00 (call 20,
# call2-smollm2.sh, follows while the machine is warm): GPU tests, the head folded
# (tools/gpu/bench_fold.py head, and the last stage's replay with each fold), the llama3-8b-shape
# decode window at 1 client (traced, twice) and the 16/32-client sweep (traced)
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
mkdir -p /tmp/strata && cp .gpu/model/smollm2.part00 /tmp/strata/ &
(time python3 -m strata.model.mkmodel llama3-8b /tmp/l8b.gguf --weight-type BF16 --fast) > $OUT/mk8.log 2>&1 &
MK=$!
timeout 200 python3 -m pytest tests/test_skinny.py tests/test_fused_kernels.py tests/test_gpu.py \
  tests/test_attention_triton.py tests/test_attention_chunk.py -q -rs -p no:cacheprovider 2>&1 \
  | tee $OUT/gpu_tests.log | tail -4
timeout 60 python3 tools/gpu/bench_fold.py head 2>&1 | grep -v Warn | tee $OUT/fold_head.log
wait $MK; tail -3 $OUT/mk8.log
timeout 60 python3 tools/gpu/bench_fold.py /tmp/l8b.gguf 16:32 2>&1 | grep -v Warn | tee $OUT/fold_stage1.log
for run in 1 2; do
  timeout 70 python3 -m strata.launch.windowbench --model /tmp/l8b.gguf --layouts "cuda:0,cuda:1" \
    --what pipeline --live 1 --iters 40 --graph-caches 8 --trace-dir /tmp/tr19_$run \
    2>&1 | grep -v Warn | tee $OUT/window$run.log
  for d in /tmp/tr19_$run/*; do python3 tools/gpu/host_marks.py "$d"; done 2>&1 | tee -a $OUT/window$run.log
done
timeout 110 python3 -m strata.launch.bench sweep --model /tmp/l8b.gguf --devices cuda:0,cuda:1 \
  --layer-split 16 --modes serial,pipelined --clients 16,32 --tokens 128 --ctx-size 512 \
  --trace-dir /tmp/tr19s --json-out $OUT/sweep_l8b.json 2>&1 | grep -v Warn | tee $OUT/sweep.log

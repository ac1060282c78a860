#!/bin/bash
# device call 16 (nvidia-h200-x2), needs only .gpu/whl: GPU tests of the folded kernels and the
# one-copy first stage, folds side by side (tools/gpu/bench_fold.py), the llama3-8b-shape
# decode window at 1 client with its host marks, and the 16/32-client sweep at splits 16 and 17
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
(time python3 -m strata.model.mkmodel llama3-8b /tmp/l8b.gguf --weight-type BF16 --fast) > $OUT/mk.log 2>&1 &
MK=$!
timeout 120 python3 -m pytest tests/test_skinny.py tests/test_fused_kernels.py tests/test_gpu.py \
  -k "not chunk_alignment" -q -rs -p no:cacheprovider 2>&1 | tee $OUT/gpu_tests.log | tail -4
timeout 100 python3 tools/gpu/bench_fold.py 2>&1 | grep -v Warn | tee $OUT/fold_kernels.log
wait $MK; tail -3 $OUT/mk.log
timeout 60 python3 tools/gpu/bench_fold.py /tmp/l8b.gguf 0:16 2>&1 | grep -v Warn | tee $OUT/fold_stages.log
timeout 70 python3 -m strata.launch.windowbench --model /tmp/l8b.gguf --layouts "cuda:0,cuda:1" \
  --what pipeline --live 1 --iters 40 --graph-caches 8 --trace-dir /tmp/tr16 2>&1 | grep -v Warn | tee $OUT/window.log
for d in /tmp/tr16/*; do python3 tools/gpu/host_marks.py "$d"; done | tee -a $OUT/window.log
for split in 16 17; do
  timeout 110 python3 -m strata.launch.bench sweep --model /tmp/l8b.gguf --devices cuda:0,cuda:1 \
    --layer-split $split --modes serial,pipelined --clients 16,32 --tokens 128 --ctx-size 512 \
    --json-out $OUT/sweep_l8b_split$split.json 2>&1 | grep -v Warn | tee $OUT/sweep_split$split.log
done

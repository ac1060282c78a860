#!/bin/bash
# device call 17 (nvidia-h200-x2), needs only .gpu/whl: the host steps of a first stage's
# window (tools/gpu/host_steps.py), GPU tests, the folds side by side with their final blocks,
# the llama3-8b-shape decode window at 1 client (traced) and the 16/32-client sweep
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
models
(time python3 -m strata.model.mkmodel llama3-8b /tmp/l8b.gguf --weight-type BF16 --fast) > $OUT/mk8.log 2>&1 &
MK=$!
timeout 60 python3 tools/gpu/host_steps.py /tmp/smol.gguf 2>&1 | grep -v Warn | tee $OUT/host_steps.log
timeout 150 python3 -m pytest tests/test_skinny.py tests/test_fused_kernels.py tests/test_gpu.py \
  -q -rs -p no:cacheprovider 2>&1 | tee $OUT/gpu_tests.log | tail -4
wait $MK; tail -3 $OUT/mk8.log
timeout 60 python3 tools/gpu/bench_fold.py /tmp/l8b.gguf 0:16 2>&1 | grep -v Warn | tee $OUT/fold_stages.log
timeout 70 python3 -m strata.launch.windowbench --model /tmp/l8b.gguf --layouts "cuda:0,cuda:1" \
  --what pipeline --live 1 --iters 40 --graph-caches 8 --trace-dir /tmp/tr17 \
  --json-out $OUT/window_l8b.json 2>&1 | grep -v Warn | tee $OUT/window.log
for d in /tmp/tr17/*; do python3 tools/gpu/host_marks.py "$d"; done 2>&1 | tee -a $OUT/window.log
timeout 110 python3 -m strata.launch.bench sweep --model /tmp/l8b.gguf --devices cuda:0,cuda:1 \
  --layer-split 16 --modes serial,pipelined --clients 16,32 --tokens 128 --ctx-size 512 \
  --trace-dir /tmp/tr17s --json-out $OUT/sweep_l8b.json 2>&1 | grep -v Warn | tee $OUT/sweep.log

#!/bin/bash
# device call 8 (nvidia-h200-x2), needs only .gpu/whl: a stage's kernels profiled (llama3-8b
# shape), then decode windows and the 16-client sweep again (coordinator spin, trace spans
# from the replay's launch)
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
models; wait
timeout 120 python3 tools/gpu/profile_layer.py /tmp/l8b.gguf 0:16 2>&1 | grep -v Warn | tee $OUT/profile.log
B="python3 -m strata.launch.bench"
L8="--model /tmp/l8b.gguf --devices cuda:0,cuda:1 --layer-split 16"
timeout 120 python3 -m strata.launch.windowbench --model /tmp/l8b.gguf --layouts "cuda:0,cuda:1" \
  --what pipeline --live 1,8 --iters 50 --graph-caches 8 --json-out $OUT/l8b_window.json 2>&1 \
  | grep -v Warn | tee $OUT/l8b_window.log
timeout 150 $B sweep $L8 --modes serial,pipelined --clients 16,32 --tokens 128 --ctx-size 512 \
  --trace-dir /tmp/tr8 --json-out $OUT/sweep_l8b.json 2>&1 | grep -v Warn | tee $OUT/sweep_l8b.log

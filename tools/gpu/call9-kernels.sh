#!/bin/bash
# device call 9 (nvidia-h200-x2), needs only .gpu/whl: decode kernels side by side (cuBLAS vs
# the skinny Triton matmul, attention configurations), then the 16/32-client sweep and decode
# windows with the last stage taking windows while its device works
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
models
timeout 240 python3 tools/gpu/bench_kernels.py 2>&1 | grep -v Warn | tee $OUT/kernels.log
wait
B="python3 -m strata.launch.bench"
L8="--model /tmp/l8b.gguf --devices cuda:0,cuda:1 --layer-split 16"
timeout 150 $B sweep $L8 --modes serial,pipelined --clients 16,32 --tokens 128 --ctx-size 512 \
  --trace-dir /tmp/tr9 --json-out $OUT/sweep_l8b.json 2>&1 | grep -v Warn | tee $OUT/sweep_l8b.log
timeout 100 python3 -m strata.launch.windowbench --model /tmp/l8b.gguf --layouts "cuda:0,cuda:1" \
  --what pipeline --live 1 --iters 50 --graph-caches 8 2>&1 | grep -v Warn | tee $OUT/l8b_window.log

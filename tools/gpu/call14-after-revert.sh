#!/bin/bash
# device call 14 (nvidia-h200-x2), needs only .gpu/whl: the llama3-8b-shape decode window
# and the 16-client sweep again after reverting the gated down projection
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
[ -f /tmp/l8b.gguf ] || python3 -m strata.model.mkmodel llama3-8b /tmp/l8b.gguf --weight-type BF16 --fast > $OUT/mk.log 2>&1
timeout 70 python3 -m strata.launch.windowbench --model /tmp/l8b.gguf --layouts "cuda:0,cuda:1" \
  --what pipeline --live 1 --iters 40 --graph-caches 8 2>&1 | grep -v Warn | tee $OUT/window.log
timeout 100 python3 -m strata.launch.bench sweep --model /tmp/l8b.gguf --devices cuda:0,cuda:1 \
  --layer-split 16 --modes serial,pipelined --clients 16,32 --tokens 128 --ctx-size 512 \
  --trace-dir /tmp/tr14 --json-out $OUT/sweep_l8b.json 2>&1 | grep -v Warn | tee $OUT/sweep.log

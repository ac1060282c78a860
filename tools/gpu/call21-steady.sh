#!/bin/bash
# device call 21 (nvidia-h200-x2), needs only .gpu/whl: at the final tree, the llama3-8b-shape
# decode window at 1 client once more, and serial against pipelined at 16/32 clients with 128
# and with 256 tokens per client (how much of the ratio the prompt phase takes)
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
python3 -m strata.model.mkmodel llama3-8b /tmp/l8b.gguf --weight-type BF16 --fast > $OUT/mk8.log 2>&1
timeout 70 python3 -m strata.launch.windowbench --model /tmp/l8b.gguf --layouts "cuda:0,cuda:1" \
  --what pipeline --live 1 --iters 40 --graph-caches 8 2>&1 | grep -v Warn | tee $OUT/window.log
for tokens in 128 256; do
  timeout 150 python3 -m strata.launch.bench sweep --model /tmp/l8b.gguf --devices cuda:0,cuda:1 \
    --layer-split 16 --modes serial,pipelined --clients 16,32 --tokens $tokens --ctx-size 512 \
    --trace-dir /tmp/tr21_$tokens --json-out $OUT/sweep_l8b_t$tokens.json 2>&1 | grep -v Warn \
    | tee $OUT/sweep_t$tokens.log
done

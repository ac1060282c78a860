#!/bin/bash
# device call 22 (nvidia-h200-x2), needs only .gpu/whl: at the final tree, prompt reading of the
# llama3-8b shape (4096 tokens, 512-row chunks, serial against pipelined) and one more decode
# window at 1 client
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
python3 -m strata.model.mkmodel llama3-8b /tmp/l8b.gguf --weight-type BF16 --fast > $OUT/mk8.log 2>&1
timeout 100 python3 -m strata.launch.bench prompt --model /tmp/l8b.gguf --devices cuda:0,cuda:1 \
  --layer-split 16 --ctx-size 4160 --prompt-tokens 4096 --chunk-rows 512 --repeats 3 \
  --json-out $OUT/prompt_c512.json 2>&1 | grep -v Warn | tee $OUT/prompt_c512.log
timeout 70 python3 -m strata.launch.windowbench --model /tmp/l8b.gguf --layouts "cuda:0,cuda:1" \
  --what pipeline --live 1 --iters 40 --graph-caches 8 2>&1 | grep -v Warn | tee $OUT/window.log

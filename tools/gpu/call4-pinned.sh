#!/bin/bash
# device call 4: host inputs of graphed windows through pinned staging buffers (no stream sync
# per window): GPU tests, exactness on a SmolLM2-shaped model, llama3-8b prompt reading, decode
# windows and serial vs pipelined at 16 and 32 clients
source "$(dirname "$0")/env.sh"
models
timeout 120 python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider -x 2>&1 | tail -2
B="python3 -m strata.launch.bench"
timeout 60 $B exact --model /tmp/smol.gguf --devices cuda:0,cuda:1 --layer-split 15 --batch 8 --batch-groups 2 2>&1 | tail -1
wait
L8="--model /tmp/l8b.gguf --devices cuda:0,cuda:1 --layer-split 16"
timeout 70 $B prompt $L8 --ctx-size 4160 --prompt-tokens 4096 --chunk-rows 512 --repeats 3 \
  --json-out $OUT/prompt_c512.json 2>&1 | grep -v Warn | tee $OUT/prompt_c512.log
timeout 90 python3 -m strata.launch.windowbench --model /tmp/l8b.gguf --layouts "cuda:0,cuda:1" \
  --what pipeline --live 1,8 --iters 50 --graph-caches 8 --json-out $OUT/l8b_window.json 2>&1 \
  | grep -v Warn | tee $OUT/l8b_window.log
timeout 100 $B sweep $L8 --modes serial,pipelined --clients 16,32 --tokens 32 --ctx-size 512 \
  --json-out $OUT/sweep_l8b.json 2>&1 | grep -v Warn | tee $OUT/sweep_l8b.log

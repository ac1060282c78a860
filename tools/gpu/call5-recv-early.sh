#!/bin/bash
# device call 5: the link's receive is posted before the checks and waited for just before use:
# GPU tests, exactness on a SmolLM2-shaped model, llama3-8b prompt reading (split 16 and 12)
source "$(dirname "$0")/env.sh"
models
timeout 100 python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider -x 2>&1 | tail -2
B="python3 -m strata.launch.bench"
timeout 50 $B exact --model /tmp/smol.gguf --devices cuda:0,cuda:1 --layer-split 15 --batch 8 --batch-groups 2 2>&1 | tail -1
wait
for split in 16 12; do
  timeout 60 $B prompt --model /tmp/l8b.gguf --devices cuda:0,cuda:1 --layer-split $split --ctx-size 4160 \
    --prompt-tokens 4096 --chunk-rows 512 --repeats 3 --json-out $OUT/prompt_s$split.json 2>&1 | grep -v Warn | tail -3
done

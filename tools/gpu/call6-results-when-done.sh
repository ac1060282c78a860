#!/bin/bash
# device call 6: a last-stage Result is sent once its window is computed (the next window
# enqueued first), so one chunk in flight is truly serial: GPU tests, exactness, prompt reading
source "$(dirname "$0")/env.sh"
models
timeout 60 python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider -x -k "two_gpu or graph" 2>&1 | tail -1
B="python3 -m strata.launch.bench"
for g in 1 2; do
  timeout 40 $B exact --model /tmp/smol.gguf --devices cuda:0,cuda:1 --layer-split 15 --batch 8 --batch-groups $g 2>&1 | tail -1
done
wait
timeout 60 $B prompt --model /tmp/l8b.gguf --devices cuda:0,cuda:1 --layer-split 16 --ctx-size 4160 \
  --prompt-tokens 4096 --chunk-rows 512 --repeats 3 --json-out $OUT/prompt_c512.json 2>&1 | grep -v Warn | tee $OUT/prompt_c512.log

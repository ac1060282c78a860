#!/bin/bash
# device call 27 (nvidia-h200-x2), carrying .gpu/whl and .gpu/model/smollm2.part00 (call 28,
# call28-drafts-smollm2.sh, follows while the machine is warm): serial against pipelined at
# 16/32 clients with the scheduler's review fixes (at most window_rows chunks first), the
# decode window at 1 client, and draft tokens on the llama3-8b shape (random weights)
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
mkdir -p /tmp/strata && cp .gpu/model/smollm2.part00 /tmp/strata/ &
python3 -m strata.model.mkmodel llama3-8b /tmp/l8b.gguf --weight-type BF16 --fast > $OUT/mk8.log 2>&1
B="python3 -m strata.launch.bench"
L8="--model /tmp/l8b.gguf --devices cuda:0,cuda:1 --layer-split 16"
timeout 110 $B sweep $L8 --modes serial,pipelined --clients 16,32 --tokens 128 --ctx-size 512 \
  --trace-dir /tmp/tr27 --json-out $OUT/sweep_capped.json 2>&1 | grep -v Warn | tee $OUT/sweep_capped.log
timeout 70 python3 -m strata.launch.windowbench --model /tmp/l8b.gguf --layouts "cuda:0,cuda:1" \
  --what pipeline --live 1 --iters 40 --graph-caches 8 2>&1 | grep -v Warn | tee $OUT/window.log
timeout 120 $B drafts $L8 --clients 1 --tokens 128 --draft-tokens 7 --ctx-size 512 \
  --json-out $OUT/drafts_l8b.json 2>&1 | grep -v Warn | tee $OUT/drafts_l8b.log

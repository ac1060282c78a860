#!/bin/bash
# device call 29 (nvidia-h200-x2), carrying .gpu/whl and .gpu/model/smollm2.part00: the
# capped scheduler's sweep again; then call 28's script (call28-drafts-smollm2.sh, carrying
# part01) measures draft tokens on SmolLM2 with the KV trim that zeroes nothing
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
mkdir -p /tmp/strata && cp .gpu/model/smollm2.part00 /tmp/strata/ &
python3 -m strata.model.mkmodel llama3-8b /tmp/l8b.gguf --weight-type BF16 --fast > $OUT/mk8.log 2>&1
timeout 110 python3 -m strata.launch.bench sweep --model /tmp/l8b.gguf --devices cuda:0,cuda:1 \
  --layer-split 16 --modes serial,pipelined --clients 16,32 --tokens 128 --ctx-size 512 \
  --json-out $OUT/sweep_capped2.json 2>&1 | grep -v Warn | tee $OUT/sweep_capped2.log
wait

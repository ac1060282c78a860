#!/bin/bash
# device call 2 (right after call 1, machine warm): llama3-8b shape prompt reading with the next
# chunk waiting at stage 0; SmolLM2 exactness over the NCCL link, the clients sweep (JSON + plot),
# the HF peer arm; llama3-8b shape serial vs pipelined at 16, 32 clients
cd "$(dirname "$0")/../.." || exit 1
export PYTHONUNBUFFERED=1
[ -f /tmp/strata/smollm2.part00 ] || { echo "part00 missing: machine was not warm"; exit 3; }
cat /tmp/strata/smollm2.part00 .gpu/model/smollm2.part01 > /tmp/strata/SmolLM2-135M-Instruct.Q4_1.gguf
echo "$(cat .gpu/model/sha256)  /tmp/strata/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c || exit 1
[ -d /tmp/site/zmq ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD STRATA_CACHE=/tmp/strata
B="python3 -m strata.launch.bench"
L8="--model /tmp/l8b.gguf --devices cuda:0,cuda:1 --layer-split 16"
[ -f /tmp/l8b.gguf ] && timeout 100 $B prompt $L8 --ctx-size 4160 --prompt-tokens 4096 --chunk-rows 512 \
  --repeats 3 --json-out $OUT/prompt_c512.json 2>&1 | grep -v Warn | tee $OUT/prompt_c512.log
[ -f /tmp/l8b.gguf ] && timeout 90 $B prompt $L8 --ctx-size 4160 --prompt-tokens 4096 --chunk-rows 512 \
  --repeats 2 --depth 8 2>&1 | grep -v Warn | tail -1
for g in 1 2; do
  timeout 70 $B exact --devices cuda:0,cuda:1 --layer-split 15 --batch 8 --batch-groups $g 2>&1 | tee $OUT/exact_g$g.log | tail -1
done
timeout 150 $B sweep --devices cuda:0,cuda:1 --layer-split 15 --clients 1,2,4,8,16,32 --tokens 64 \
  --json-out $OUT/sweep_smollm2.json --plot $OUT/sweep_smollm2.png 2>&1 | tee $OUT/sweep_smollm2.log
timeout 70 $B peer --device cuda:0 --batch 8 --tokens 64 2>&1 | grep -v Warn | tee $OUT/peer.log | tail -2
[ -f /tmp/l8b.gguf ] && timeout 100 $B sweep $L8 --modes serial,pipelined --clients 16,32 --tokens 32 \
  --ctx-size 512 --json-out $OUT/sweep_l8b.json 2>&1 | grep -v Warn | tee $OUT/sweep_l8b.log

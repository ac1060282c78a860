#!/bin/bash
# device call 2 (right after call 1, machine warm): SmolLM2 exactness over the NCCL link, the
# clients sweep (JSON + plot), the HF peer arm
cd "$(dirname "$0")/../.." || exit 1
export PYTHONUNBUFFERED=1
[ -f /tmp/strata/smollm2.part00 ] || { echo "part00 missing: machine was not warm"; exit 3; }
cat /tmp/strata/smollm2.part00 .gpu/model/smollm2.part01 > /tmp/strata/SmolLM2-135M-Instruct.Q4_1.gguf
echo "$(cat .gpu/model/sha256)  /tmp/strata/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c || exit 1
[ -d /tmp/site/zmq ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD STRATA_CACHE=/tmp/strata
B="python3 -m strata.launch.bench"
for g in 1 2; do
  timeout 70 $B exact --devices cuda:0,cuda:1 --layer-split 15 --batch 8 --batch-groups $g 2>&1 | tee $OUT/exact_g$g.log | tail -1
done
timeout 170 $B sweep --devices cuda:0,cuda:1 --layer-split 15 --clients 1,2,4,8,16,32 --tokens 64 \
  --trace-dir /tmp/tr_smol --json-out $OUT/sweep_smollm2.json --plot $OUT/sweep_smollm2.png 2>&1 \
  | tee $OUT/sweep_smollm2.log
timeout 70 $B peer --device cuda:0 --batch 8 --tokens 64 2>&1 | grep -v Warn | tee $OUT/peer.log | tail -2

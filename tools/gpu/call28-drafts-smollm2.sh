#!/bin/bash
# device call 28 (right after call 27, machine warm), carrying .gpu/whl,
# .gpu/model/smollm2.part01 and .gpu/model/sha256: draft tokens on SmolLM2 over two GPUs,
# exactness (draft tokens together against plain decoding alone) and the gain at 1 and 4 clients
cd "$(dirname "$0")/../.." || exit 1
export PYTHONUNBUFFERED=1
[ -f /tmp/strata/smollm2.part00 ] || { echo "part00 missing: machine was not warm"; exit 3; }
cat /tmp/strata/smollm2.part00 .gpu/model/smollm2.part01 > /tmp/strata/SmolLM2-135M-Instruct.Q4_1.gguf
echo "$(cat .gpu/model/sha256)  /tmp/strata/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c || exit 1
[ -d /tmp/site/zmq ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD STRATA_CACHE=/tmp/strata
B="python3 -m strata.launch.bench"
S="--devices cuda:0,cuda:1 --layer-split 15"
timeout 90 $B exact $S --batch 4 --batch-groups 2 --draft-tokens 3 2>&1 | tee $OUT/exact_drafts.log | tail -1
timeout 90 $B exact $S --batch 1 --draft-tokens 7 2>&1 | tee $OUT/exact_drafts1.log | tail -1
timeout 90 $B drafts $S --clients 1 --tokens 128 --draft-tokens 7 --repeats 3 \
  --json-out $OUT/drafts_c1.json 2>&1 | grep -v Warn | tee $OUT/drafts_c1.log
timeout 90 $B drafts $S --clients 4 --batch 4 --tokens 128 --draft-tokens 3 --repeats 3 \
  --json-out $OUT/drafts_c4.json 2>&1 | grep -v Warn | tee $OUT/drafts_c4.log

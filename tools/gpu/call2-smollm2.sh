#!/bin/bash
# device call 2 (right after call 1, machine warm): SmolLM2 exactness and benchmarks; llama3-8b shape pipeline
cd "$(dirname "$0")/../.." || exit 1
export PYTHONUNBUFFERED=1
[ -f /tmp/strata/smollm2.part00 ] || { echo "part00 missing: machine was not warm"; exit 3; }
cat /tmp/strata/smollm2.part00 .gpu/model/smollm2.part01 > /tmp/strata/SmolLM2-135M-Instruct.Q4_1.gguf
echo "$(cat .gpu/model/sha256)  /tmp/strata/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c || exit 1
[ -d /tmp/site/zmq ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD STRATA_CACHE=/tmp/strata
python3 -m strata.model.mkmodel llama3-8b /tmp/l8b.gguf --weight-type BF16 --fast > $OUT/mkmodel.log 2>&1 &
MK=$!
B="python3 -m strata.launch.bench"; W="python3 -m strata.launch.windowbench"
for g in 1 2; do
  timeout 120 $B exact --devices cuda:0,cuda:1 --layer-split 15 --batch 8 --batch-groups $g 2>&1 | tee $OUT/exact_g$g.log | tail -2
done
timeout 200 $W --layouts "cuda:0;cuda:0,cuda:1" --live 1,8 --iters 200 --graph-caches 0,8 \
  --json-out $OUT/smol.json 2>&1 | tee $OUT/smol.log
timeout 60 $B decode --devices cuda:0 --splits auto --tokens 128 2>&1 | tee $OUT/decode1.log | tail -2
timeout 60 $B decode --devices cuda:0,cuda:1 --splits "auto;15" --tokens 128 2>&1 | tee $OUT/decode2.log | tail -3
timeout 90 $B throughput --devices cuda:0,cuda:1 --layer-split 15 --batches 8,16 --tokens 64 2>&1 | tee $OUT/tput.log
wait $MK
timeout 100 $W --model /tmp/l8b.gguf --layouts "cuda:0,cuda:1" --what pipeline --live 1,8 --iters 50 \
  --graph-caches 8 --json-out $OUT/l8b.json 2>&1 | grep -v Warn | tee $OUT/l8b.log

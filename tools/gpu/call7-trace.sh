#!/bin/bash
# device call 7 (nvidia-h200-x2), needs only .gpu/whl: GPU tests, then the llama3-8b shape's
# decode windows and 16/32-client sweeps with every process traced (strata/trace.py), so the
# logs say where a window's time goes per stage
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
{ nvidia-smi -L; python3 -c "import torch,triton;print(torch.__version__, triton.__version__)"; } 2>&1 | tee $OUT/env.txt
models
[ -n "$SKIP_TESTS" ] || timeout 200 python3 -m pytest tests/test_gpu.py -q -rs -p no:cacheprovider -x \
  --durations=5 2>&1 | tee $OUT/gpu_tests.log | tail -8
wait
B="python3 -m strata.launch.bench"
L8="--model /tmp/l8b.gguf --devices cuda:0,cuda:1 --layer-split 16"
timeout 150 python3 -m strata.launch.windowbench --model /tmp/l8b.gguf --layouts "cuda:0,cuda:1" \
  --what both --live 1,8 --iters 50 --graph-caches 8 --json-out $OUT/l8b_window.json 2>&1 \
  | grep -v Warn | tee $OUT/l8b_window.log
timeout 170 $B sweep $L8 --modes serial,pipelined --clients 16,32 --tokens 128 --ctx-size 512 \
  --trace-dir /tmp/tr_sweep --json-out $OUT/sweep_l8b.json 2>&1 | grep -v Warn | tee $OUT/sweep_l8b.log
timeout 100 $B sweep $L8 --modes pipelined --batch-groups 4 --clients 32 --tokens 128 --ctx-size 512 \
  --trace-dir /tmp/tr_g4 --json-out $OUT/sweep_l8b_g4.json 2>&1 | grep -v Warn | tee $OUT/sweep_l8b_g4.log
python3 -m strata.launch.tracereport /tmp/tr_sweep/launch0 --chrome-out $OUT/sweep_l8b_trace.json | tee $OUT/tracereport.log
python3 -m strata.launch.tracereport /tmp/tr_g4/launch0 --chrome-out $OUT/sweep_l8b_g4_trace.json | tee -a $OUT/tracereport.log
cp -r /tmp/tr_sweep $OUT/tr_sweep 2>/dev/null
grep -h "activations over\|Error\|error" /tmp/strata-*/stage*.log 2>/dev/null | sort | uniq -c | head -8

#!/bin/bash
# device call 1 (nvidia-h200-x2): wheels, model part 0, GPU tests (2 GPU stages over the NCCL
# link, the Triton kernels on CUDA; SKIP_TESTS=1 skips them), llama3-8b shape (fast GGUF):
# prompt reading serial vs pipelined chunks, decode windows at 1 and 8 clients with their
# traced breakdown, serial vs pipelined at 16 and 32 clients (traced)
cd "$(dirname "$0")/../.." || exit 1
export PYTHONUNBUFFERED=1
mkdir -p /tmp/strata && cp .gpu/model/smollm2.part00 /tmp/strata/ &
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
{ nvidia-smi -L; nproc; python3 -c "import torch,triton;print(torch.__version__, triton.__version__)"; } 2>&1 | tee $OUT/env.txt
(time python3 -m strata.model.mkmodel llama3-8b /tmp/l8b.gguf --weight-type BF16 --fast) > $OUT/mkmodel.log 2>&1 &
MK=$!
[ -n "$SKIP_TESTS" ] || timeout 200 python3 -m pytest tests/test_gpu.py tests/test_skinny.py \
  tests/test_attention_triton.py tests/test_attention_chunk.py tests/test_fused_kernels.py \
  -q -rs -p no:cacheprovider -x --durations=5 2>&1 | tee $OUT/gpu_tests.log | tail -12
wait $MK; tail -3 $OUT/mkmodel.log
B="python3 -m strata.launch.bench"
L8="--model /tmp/l8b.gguf --devices cuda:0,cuda:1 --layer-split 16"
timeout 150 python3 -m strata.launch.windowbench --model /tmp/l8b.gguf --layouts "cuda:0,cuda:1" \
  --what both --live 1,8 --iters 50 --graph-caches 8 --transports unix,zmq \
  --json-out $OUT/l8b_window.json --trace-dir /tmp/tr_window 2>&1 | grep -v Warn | tee $OUT/l8b_window.log
for d in /tmp/tr_window/*; do echo "$d"; python3 tools/gpu/host_marks.py "$d"; done | tee -a $OUT/l8b_window.log
timeout 170 $B sweep $L8 --modes serial,pipelined --clients 16,32 --tokens 128 --ctx-size 512 \
  --trace-dir /tmp/tr_sweep --json-out $OUT/sweep_l8b.json 2>&1 | grep -v Warn | tee $OUT/sweep_l8b.log
[ -n "$SKIP_PROMPT" ] || timeout 100 $B prompt $L8 --ctx-size 4160 --prompt-tokens 4096 --chunk-rows 512 --repeats 3 \
  --json-out $OUT/prompt_c512.json 2>&1 | grep -v Warn | tee $OUT/prompt_c512.log
grep -h "activations over\|Error\|error" /tmp/strata-*/stage*.log 2>/dev/null | sort | uniq -c | head -8

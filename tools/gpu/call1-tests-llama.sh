#!/bin/bash
# device call 1: wheels, model part 1, GPU tests, llama3-8b shape (fast GGUF) step + pipeline
cd "$(dirname "$0")/../.." || exit 1
export PYTHONUNBUFFERED=1
mkdir -p /tmp/strata && cp .gpu/model/smollm2.part00 /tmp/strata/ &
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
{ nvidia-smi -L; nproc; free -g | head -2
  python3 -c "import torch,triton;print(torch.__version__, triton.__version__, torch.cuda.device_count())"; } 2>&1 | tee $OUT/env.txt
(time python3 -m strata.model.mkmodel llama3-8b /tmp/l8b.gguf --weight-type BF16 --fast) > $OUT/mkmodel.log 2>&1 &
MK=$!
timeout 300 python3 -m pytest tests/test_gpu.py tests/test_attention_triton.py tests/test_fused_kernels.py \
  -q -rs -p no:cacheprovider -x --durations=8 2>&1 | tee $OUT/gpu_tests.log | tail -45
wait $MK; tail -4 $OUT/mkmodel.log | tr '\r' '\n' | tail -4
timeout 270 python3 -m strata.launch.windowbench --model /tmp/l8b.gguf --layouts "cuda:0;cuda:0,cuda:1" \
  --live 1,8 --iters 50 --graph-caches 8 --json-out $OUT/l8b.json 2>&1 | tee $OUT/l8b.log | grep -v Warn
wait
ls -la /tmp/strata

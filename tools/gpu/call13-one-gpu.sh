#!/bin/bash
# device call 13 (nvidia-h200, one GPU), needs only .gpu/whl: the GPU tests that need one
# GPU, then llama3-8b-shape decode windows of one stage over ZeroMQ and over Unix sockets,
# traced (the two-GPU machine was not lent at the time)
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
[ -f /tmp/l8b.gguf ] || python3 -m strata.model.mkmodel llama3-8b /tmp/l8b.gguf --weight-type BF16 --fast > $OUT/mk.log 2>&1 &
timeout 200 python3 -m pytest tests/test_gpu.py tests/test_skinny.py tests/test_attention_triton.py \
  tests/test_fused_kernels.py tests/test_unixsock.py -q -rs -p no:cacheprovider -x 2>&1 | tee $OUT/gpu_tests.log | tail -6
wait
timeout 200 python3 -m strata.launch.windowbench --model /tmp/l8b.gguf --layouts "cuda:0" \
  --what pipeline --live 1 --iters 50 --graph-caches 8 --transports zmq,unix \
  --trace-dir /tmp/tr13 --json-out $OUT/window.json 2>&1 | grep -v Warn | tee $OUT/window.log
for d in /tmp/tr13/*; do echo "$d"; python3 tools/gpu/host_marks.py "$d"; done | tee -a $OUT/window.log
timeout 60 python3 -m strata.launch.windowbench --what zmq 2>&1 | tail -4 | tee -a $OUT/window.log

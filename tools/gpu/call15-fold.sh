#!/bin/bash
# device call 15 (nvidia-h200-x2), needs only .gpu/whl: the GPU tests with the folded kernels,
# folded against apart and PDL (tools/gpu/bench_fold.py: kernels, then each stage's replay),
# and the llama3-8b-shape decode window at 1 client
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
(time python3 -m strata.model.mkmodel llama3-8b /tmp/l8b.gguf --weight-type BF16 --fast) > $OUT/mk.log 2>&1 &
MK=$!
timeout 200 python3 -m pytest tests/test_skinny.py tests/test_gpu.py tests/test_fused_kernels.py \
  tests/test_attention_triton.py tests/test_attention_chunk.py -q -rs -p no:cacheprovider \
  --durations=5 2>&1 | tee $OUT/gpu_tests.log | tail -12
timeout 150 python3 tools/gpu/bench_fold.py 2>&1 | grep -v Warn | tee $OUT/fold_kernels.log
wait $MK; tail -3 $OUT/mk.log
for span in 0:16 16:32; do
  timeout 80 python3 tools/gpu/bench_fold.py /tmp/l8b.gguf $span 2>&1 | grep -v Warn | tee -a $OUT/fold_stages.log
done
timeout 70 python3 -m strata.launch.windowbench --model /tmp/l8b.gguf --layouts "cuda:0,cuda:1" \
  --what pipeline --live 1 --iters 40 --graph-caches 8 --trace-dir /tmp/tr15 2>&1 | grep -v Warn | tee $OUT/window.log
for d in /tmp/tr15/*; do python3 tools/gpu/host_marks.py "$d"; done | tee -a $OUT/window.log

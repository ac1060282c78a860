#!/bin/bash
# device call 24 (nvidia-h200), needs only .gpu/whl: split-K for the qkv, o and down
# projections of a decode window (tools/gpu/bench_split.py), kernels and stage replays, and
# the skinny kernels' tests on CUDA
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
python3 -m strata.model.mkmodel llama3-8b /tmp/l8b.gguf --weight-type BF16 --fast > $OUT/mk8.log 2>&1 &
MK=$!
timeout 120 python3 -m pytest tests/test_skinny.py -q -p no:cacheprovider 2>&1 | tail -3 | tee $OUT/skinny_tests.log
wait $MK
timeout 400 python3 tools/gpu/bench_split.py /tmp/l8b.gguf 2>&1 | grep -v Warn | tee $OUT/split.log

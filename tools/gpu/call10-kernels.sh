#!/bin/bash
# device call 10 (nvidia-h200-x2), needs only .gpu/whl: decode kernels side by side, timed
# from CUDA graphs with the weights rotating past L2
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
timeout 400 python3 tools/gpu/bench_kernels.py 2>&1 | grep -v Warn | tee $OUT/kernels.log

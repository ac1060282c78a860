#!/bin/bash
# device call 3: why pipelined prompt chunks gain less than 2x: the same llama3-8b prompt bench
# over ZeroMQ frames, over NCCL as is, with one NCCL channel, and with NCCL's copy-engine P2P
cd "$(dirname "$0")/../.." || exit 1
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
[ -f /tmp/l8b.gguf ] || python3 -m strata.model.mkmodel llama3-8b /tmp/l8b.gguf --weight-type BF16 --fast > $OUT/mk.log 2>&1
B="python3 -m strata.launch.bench prompt --model /tmp/l8b.gguf --devices cuda:0,cuda:1 --layer-split 16 --ctx-size 4160 --prompt-tokens 4096 --chunk-rows 512 --repeats 3"
echo "== zmq frames"; timeout 80 $B --stage-link zmq 2>&1 | grep -v Warn | tail -2
echo "== nccl";       timeout 70 $B 2>&1 | grep -v Warn | tail -2
echo "== nccl, NCCL_MAX_NCHANNELS=1"; NCCL_MAX_NCHANNELS=1 timeout 70 $B 2>&1 | grep -v Warn | tail -2
echo "== nccl, NCCL_P2P_USE_CUDA_MEMCPY=1"; NCCL_P2P_USE_CUDA_MEMCPY=1 timeout 70 $B 2>&1 | grep -v Warn | tail -2
echo "== nccl, 1 channel, chunk 256"; NCCL_MAX_NCHANNELS=1 timeout 70 ${B/--chunk-rows 512/--chunk-rows 256} 2>&1 | grep -v Warn | tail -2

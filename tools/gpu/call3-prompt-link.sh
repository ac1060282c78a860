#!/bin/bash
# device call 3: why pipelined prompt chunks gain less than 2x: the same llama3-8b prompt bench
# over ZeroMQ frames, over NCCL as is, with one NCCL channel, and with NCCL's copy-engine P2P
source "$(dirname "$0")/env.sh"
models; wait
B="python3 -m strata.launch.bench prompt --model /tmp/l8b.gguf --devices cuda:0,cuda:1 --layer-split 16 --ctx-size 4160 --prompt-tokens 4096 --chunk-rows 512 --repeats 3"
echo "== zmq frames"; timeout 80 $B --stage-link zmq 2>&1 | grep -v Warn | tail -2
echo "== nccl";       timeout 70 $B 2>&1 | grep -v Warn | tail -2
echo "== nccl, NCCL_MAX_NCHANNELS=1"; NCCL_MAX_NCHANNELS=1 timeout 70 $B 2>&1 | grep -v Warn | tail -2
echo "== nccl, NCCL_P2P_USE_CUDA_MEMCPY=1"; NCCL_P2P_USE_CUDA_MEMCPY=1 timeout 70 $B 2>&1 | grep -v Warn | tail -2
echo "== nccl, 1 channel, chunk 256"; NCCL_MAX_NCHANNELS=1 timeout 70 ${B/--chunk-rows 512/--chunk-rows 256} 2>&1 | grep -v Warn | tail -2

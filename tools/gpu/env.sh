# sourced by the device calls (bash tools/gpu/callN-*.sh): the wheels the GPU machine lacks
# (pyzmq, gguf) into /tmp/site, and the random-weight models the experiments time
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
models() {  # llama3-8b shape in the background, SmolLM2 shape now (each a few seconds)
  [ -f /tmp/l8b.gguf ] || python3 -m strata.model.mkmodel llama3-8b /tmp/l8b.gguf --weight-type BF16 --fast > $OUT/mk.log 2>&1 &
  [ -f /tmp/smol.gguf ] || python3 -m strata.model.mkmodel smollm2-135m /tmp/smol.gguf --weight-type BF16 --fast >> $OUT/mk.log 2>&1
}

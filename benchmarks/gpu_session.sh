#!/usr/bin/env bash
# The GPU checks and kernel timings that CPU CI cannot do, in one command (a lent GPU's time is
# scarce: one call, in priority order, each step bounded). From the checkout root:
#
#   OUT=/tmp/gpu bash benchmarks/gpu_session.sh            # compiled kernel tests, then attention timings
#   OUT=/tmp/gpu bash benchmarks/gpu_session.sh tests      # only the compiled kernel tests
#   OUT=/tmp/gpu bash benchmarks/gpu_session.sh train      # only the ~0.5B train-step MFU runs
#
# Needs jax with a CUDA plugin (`pip install -e .[gpu]`); wheels missing on the machine (grain)
# go in .whl/ and are installed to /tmp/site first. Logs and JSON land in $OUT.
set -o pipefail
OUT=${OUT:-/tmp/gpu}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
quiet() { grep -v "^W0\|^I0\|^\*\*\*\|slow_op\|Compiling"; }

STAGE=${1:-all}
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/device.txt"
python3 -c "import jax; print(jax.__version__, jax.devices())" | tee -a "$OUT/device.txt"

# 3. (own call: about 4 min) MFU of the ~0.5B model, bf16 compute, doc-attention kernel:
#    4 micro-batches (the best so far) against the whole batch with the LM head in 1 GiB
#    chunks (train.logits_chunk_mib), fp32 and bf16 parameters
if [ "$STAGE" = train ]; then
  for args in "--micro-batch 4" "--micro-batch 0 --logits-chunk-mib 1024" \
              "--micro-batch 4 --logits-chunk-mib 1024 --param-dtype bfloat16" \
              "--micro-batch 0 --logits-chunk-mib 1024 --param-dtype bfloat16"; do
    echo "== $args" | tee -a "$OUT/train_step.log"
    timeout 150 python3 benchmarks/train_step.py --gpu --attention-backend doc $args 2>&1 | quiet | tail -3 | tee -a "$OUT/train_step.log"
  done
  exit 0
fi

# 1. every kernel compiled against its float64 reference (NSA: selected, window, compressed;
#    document attention), forward and gradients
timeout 240 python3 -m pytest -q -m gpu -k "not mosaic" -p no:cacheprovider tests/pallas_kernels 2>&1 | quiet | tee "$OUT/gpu_tests.log"
#    the Mosaic GPU (Hopper) kernels have never run on hardware: alone, so a fault stops nothing else
timeout 180 python3 -m pytest -q -m gpu -k mosaic -p no:cacheprovider tests/pallas_kernels 2>&1 | quiet | tee "$OUT/gpu_tests_mosaic.log"
[ "$STAGE" = tests ] && exit 0

# 2. NSA vs dense at 8k-64k: each branch's kernel vs XLA/cuDNN, the layer with one and with all
#    three kernels, decode (benchmarks/attention.py; results go to docs/benchmarks.md)
timeout 300 python3 benchmarks/attention.py --seq 8192 16384 32768 65536 --heads 16 --kv-heads 1 \
  --head-dim 128 --out "$OUT/attention.json" 2>&1 | quiet | tee "$OUT/attention.log"

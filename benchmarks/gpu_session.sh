#!/usr/bin/env bash
# The GPU checks and kernel timings that CPU CI cannot do, in one command (a lent GPU's time is
# scarce: one call, in priority order, each step bounded). From the checkout root:
#
#   OUT=/tmp/gpu bash benchmarks/gpu_session.sh            # compiled kernel tests, then attention timings
#   OUT=/tmp/gpu bash benchmarks/gpu_session.sh tests      # only the compiled kernel tests
#   OUT=/tmp/gpu bash benchmarks/gpu_session.sh train      # only the ~0.5B train-step MFU runs
#   OUT=/tmp/gpu bash benchmarks/gpu_session.sh rl         # sampler and GRPO step vs Tunix, MFU
#   OUT=/tmp/gpu bash benchmarks/gpu_session.sh backends   # attention backends: cuDNN test, timings
#
# Needs jax with a CUDA plugin (`pip install -e .[gpu]`); wheels missing on the machine (grain,
# google-tunix and the four of its imports the lent machines lack: clu, google-metrax, perfetto,
# tensorboardX) go in .whl/ and are installed to /tmp/site first. Logs and JSON land in $OUT.
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
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
python3 -c "import jax, flax; print(jax.__version__, flax.__version__, jax.devices())" | tee -a "$OUT/device.txt"
START=$SECONDS
# seconds left until $1 seconds after the start (at least 10): a step that ends early leaves its
# time to the next, and none runs past its mark
budget() { local left=$(( $1 - (SECONDS - START) )); echo $(( left > 10 ? left : 10 )); }

# Real-size RL (9 min, one call): the sampler at the Qwen2.5-0.5B shape against Tunix and the
# bandwidth limit (`sampler.py --gpu --sizes qwen2.5-1.5b` for the larger one), one GRPO step
# against Tunix's GRPOLearner, and train-step MFU. Every result is
# a JSON line in $OUT/rl.jsonl as soon as it exists, so a step cut short keeps the rest. Each
# process takes at most 45% of the GPU's memory, so ours and Tunix's worker fit side by side.
if [ "$STAGE" = rl ]; then
  export XLA_PYTHON_CLIENT_MEM_FRACTION=.45
  # 2026-11-26 (H200): Tunix's sampler worker needs over 50 s before its first setting, and
  # one compile per setting costs ~15 s on either side, so the 0.5B settings get the time.
  t=$(budget 200)
  echo "== sampler qwen2.5-0.5b (${t}s)" | tee -a "$OUT/rl.log"
  timeout $t python3 benchmarks/sampler.py --gpu --sizes qwen2.5-0.5b --repeats 2 \
    --settings '[[1,512,128],[16,512,128],[64,512,128],[16,512,1024]]' --tunix-python python3 \
    --ours-timeout $(( t * 35 / 100 )) --tunix-timeout $(( t * 55 / 100 )) \
    --jsonl "$OUT/rl.jsonl" 2>&1 | quiet | tee -a "$OUT/rl.log"
  t=$(budget 450)
  echo "== grpo step (${t}s)" | tee -a "$OUT/rl.log"
  timeout $t python3 benchmarks/grpo_step.py --size qwen2.5-0.5b --prompts 8 --group 8 \
    --prompt-len 256 --new-tokens 256 --dtype bfloat16 --warmup 1 --steps 3 \
    --tunix-python python3 --tunix-timeout $(( t * 55 / 100 )) --out "$OUT/grpo_step.json" 2>&1 \
    | quiet | tee -a "$OUT/rl.log"
  t=$(budget 520)
  echo "== train step (${t}s)" | tee -a "$OUT/rl.log"
  timeout $t python3 benchmarks/train_step.py --gpu --attention-backend pallas --steps 5 --micro-batch 0 \
    --logits-chunk-mib 1024 --param-dtype bfloat16 2>&1 | quiet | tail -3 | tee -a "$OUT/rl.log"
  exit 0
fi

# NSA on hardware (5 min; NSA_SECONDS for longer): the Mosaic GPU (Hopper) kernels against
# their float64 references (2026-11-26, H200: the compressed one failed at head dim 128; -v
# names each result as it comes, in case the step is cut), then every branch and the whole layer at 16k and 64k,
# Triton vs Mosaic vs XLA vs cuDNN dense, forward and forward + backward.
if [ "$STAGE" = nsa ]; then
  JAX_PLATFORMS=cuda timeout $(budget 150) python3 -m pytest -v --tb=short -m gpu -k mosaic -p no:cacheprovider tests/pallas_kernels 2>&1 \
    | quiet | tee "$OUT/gpu_tests_mosaic.log"
  timeout $(budget ${NSA_SECONDS:-300}) python3 benchmarks/attention.py --seq 16384 65536 --heads 16 --kv-heads 1 \
    --head-dim 128 --repeats 3 --out "$OUT/attention.json" 2>&1 | quiet | tee "$OUT/attention.log"
  exit 0
fi

# Attention backends on causal rows (about 2 min): the cuDNN backend against XLA (gpu tests),
# then xla vs cudnn vs pallas at 4k-32k tokens, Qwen2.5-0.5B heads, forward and fwd+bwd.
if [ "$STAGE" = backends ]; then
  JAX_PLATFORMS=cuda timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/pallas_kernels/test_attention.py 2>&1 \
    | quiet | tee "$OUT/gpu_tests_backends.log"
  timeout 150 python3 benchmarks/attention_backends.py --out "$OUT/attention_backends.jsonl" 2>&1 \
    | quiet | tee "$OUT/attention_backends.log"
  exit 0
fi

# 3. (own call: about 4 min) MFU of the ~0.5B model, bf16 compute, doc-attention kernel:
#    4 micro-batches (the best so far) against the whole batch with the LM head in 1 GiB
#    chunks (train.logits_chunk_mib), fp32 and bf16 parameters
if [ "$STAGE" = train ]; then
  for args in "--micro-batch 4" "--micro-batch 0 --logits-chunk-mib 1024" \
              "--micro-batch 4 --logits-chunk-mib 1024 --param-dtype bfloat16" \
              "--micro-batch 0 --logits-chunk-mib 1024 --param-dtype bfloat16"; do
    echo "== $args" | tee -a "$OUT/train_step.log"
    timeout 150 python3 benchmarks/train_step.py --gpu --attention-backend pallas $args 2>&1 | quiet | tail -3 | tee -a "$OUT/train_step.log"
  done
  exit 0
fi

# 1. every kernel compiled against its float64 reference (NSA: selected, window, compressed;
#    document attention), forward and gradients
JAX_PLATFORMS=cuda timeout 240 python3 -m pytest -q -m gpu -k "not mosaic" -p no:cacheprovider tests/pallas_kernels 2>&1 | quiet | tee "$OUT/gpu_tests.log"
#    the Mosaic GPU (Hopper) kernels have never run on hardware: alone, so a fault stops nothing else
JAX_PLATFORMS=cuda timeout 180 python3 -m pytest -q -m gpu -k mosaic -p no:cacheprovider tests/pallas_kernels 2>&1 | quiet | tee "$OUT/gpu_tests_mosaic.log"
[ "$STAGE" = tests ] && exit 0

# 2. NSA vs dense at 8k-64k: each branch's kernel vs XLA/cuDNN, the layer with one and with all
#    three kernels, decode (benchmarks/attention.py; results go to docs/benchmarks.md)
timeout 300 python3 benchmarks/attention.py --seq 8192 16384 32768 65536 --heads 16 --kv-heads 1 \
  --head-dim 128 --out "$OUT/attention.json" 2>&1 | quiet | tee "$OUT/attention.log"

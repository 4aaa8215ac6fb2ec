#!/usr/bin/env bash
# Set up and run the test suite (CPU, a few minutes on 2 cores). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest tests -q --timeout=900 "$@"

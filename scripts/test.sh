#!/usr/bin/env bash
# Set up and run the test suite (CPU: about 20 minutes on 2 cores, see docs/results.md). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup_vllm.sh  # the live vLLM-server tests need it
# The viewer's browser test needs a headless Chromium: install Debian's where we can (root and apt).
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "Installing chromium for the browser test (apt-get)..."
  apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null \
    || echo "chromium could not be installed: the browser test will skip (and fail on CI)"
fi
# Several pytest-xdist workers (MTGRPO_TEST_WORKERS; default one per core, at most 4), each test file on one of
# them: a file's module fixtures (a vLLM server) start once, and its tests run in their order. The files of
# conftest.LONG_FILES start first (--no-loadscope-reorder: xdist would start the files with the most tests first).
# Most of a test's time is one thread (a subprocess's imports, a server's start-up): 2 cores run 2 files at once.
# --durations: the slowest tests at the end of every run, to keep the suite short.
workers="${MTGRPO_TEST_WORKERS:-$(.venv/bin/python -c 'import os; print(min(4, len(os.sched_getaffinity(0))))')}"
exec .venv/bin/python -m pytest tests -q --timeout=900 --durations=25 -n "$workers" --dist loadfile --no-loadscope-reorder "$@"

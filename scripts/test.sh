#!/usr/bin/env bash
# Set up (first time only) and run the whole test suite, vLLM tests included.
# Two pytest-xdist workers: a vLLM CPU engine serves on one thread and each process pays its own `import vllm`, so
# two workers keep two cores busy. A module's tests run on one worker (conftest's scheduler); arguments given here
# follow these, so `-n 0` runs in one process.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
unset PYTHONDONTWRITEBYTECODE  # set-up compiles only what every run imports; the rest is kept on first import
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"

#!/usr/bin/env bash
# Set up (first time only) and run the whole test suite, vLLM tests included.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"

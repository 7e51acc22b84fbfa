#!/usr/bin/env bash
# Set up (first time only) and run `compare` on the built-in default model with the shipped sample prompts, with its
# noise floor (each stack against itself under a batch and a kernel change) beside the mismatch.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
unset PYTHONDONTWRITEBYTECODE  # set-up compiles only what every run imports; the rest is kept on first import
exec .venv/bin/divergence-probe compare --report --batch-invariance "$@"

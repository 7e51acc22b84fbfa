#!/usr/bin/env bash
# Set up (first time only) and run `compare` on the built-in default model with the shipped sample prompts.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/divergence-probe compare --report "$@"

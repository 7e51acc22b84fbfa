#!/usr/bin/env bash
# Regenerate docs/example_report/: run `ablate --report` (every combination of aligned regions; its `none`
# combination is the plain compare) on the built-in default model with the shipped sample prompts, then
# copy the rendered report (report.md + figures/*.png|pdf) and a self-contained report.html into the docs.
# It runs on the first 32 sample prompts; extra arguments go to `ablate` (e.g. `--device cpu`).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
.venv/bin/divergence-probe ablate --report --batch-invariance --num-prompts 32 --out "$tmp/run" "$@"
.venv/bin/divergence-probe report "$tmp/run" --format html --out "$tmp/html"

rm -rf docs/example_report
mkdir -p docs/example_report
cp -R "$tmp/run/report/." docs/example_report/
cp "$tmp/html/report.html" docs/example_report/report.html
# The replace-on-rerender marker of the report folder means nothing inside the docs.
rm -f docs/example_report/.divergence-probe
echo "wrote docs/example_report/ (report.md, report.html, figures/)"

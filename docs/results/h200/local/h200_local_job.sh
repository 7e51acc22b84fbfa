#!/usr/bin/env bash
# On the lent H200, after ../shared/gpu's install.sh: the grafting runs for one preset (compare --graft, --depth,
# ablate --graft, the graft-vs-taps cost check), packed into $OUT/PRESET-local.tgz even when cut short.
# usage: bash docs/results/h200/local/h200_local_job.sh PRESET [SECONDS] [h200_local.py options...]
#   e.g. bash docs/results/h200/local/h200_local_job.sh qwen2.5-1.5b 900 --num-prompts 16; then the same for qwen3-1.7b
# Results: /tmp/local/PRESET/{graft,depth,ablate-graft}/ and timings.json, then $OUT/PRESET-local.tgz; copy them to
# docs/results/h200/local/PRESET/ and render each with `divergence-probe report`.
set -u
export PYTHONPATH=$HOME/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_LOGGING_LEVEL=ERROR
preset=$1; budget=${2:-900}; out=/tmp/local/$preset
mkdir -p "$out"
start=$(date +%s)
timeout "$budget" python3 docs/results/h200/local/h200_local.py --preset "$preset" --out "$out" "${@:3}" > "$out/run.log" 2>&1
echo "== exit $? after $(( $(date +%s) - start )) s"; grep -v "it/s\]\|dump_input" "$out/run.log" | tail -70
tar czf "${OUT:-/tmp}/$preset-local.tgz" -C /tmp/local "$preset"
echo "results: $out; packed: ${OUT:-/tmp}/$preset-local.tgz"

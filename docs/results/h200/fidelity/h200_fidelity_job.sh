#!/usr/bin/env bash
# On the lent H200, after ../shared/gpu's install.sh: the fidelity runs for one preset (eager and compiled engine,
# one process each, then the summary), packed into $OUT/PRESET-fidelity.tgz even when a part is cut short.
# usage: bash docs/results/h200/fidelity/h200_fidelity_job.sh PRESET [SECONDS_PER_ENGINE] [h200_fidelity.py options...]
set -u
export PYTHONPATH=$HOME/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_LOGGING_LEVEL=ERROR
preset=$1; budget=${2:-280}; out=/tmp/fid/$preset
mkdir -p "$out"
for engine in eager compiled; do
  start=$(date +%s)
  timeout "$budget" python3 docs/results/h200/fidelity/h200_fidelity.py --preset "$preset" --engine "$engine" --out "$out" "${@:3}" \
    > "$out/$engine.log" 2>&1
  echo "== $engine: exit $? after $(( $(date +%s) - start )) s"; grep -v "it/s\]\|dump_input" "$out/$engine.log" | tail -25
done
python3 docs/results/h200/fidelity/h200_fidelity.py --preset "$preset" --summarize --out "$out" "${@:3}" 2>&1 | tail -70
tar czf "$OUT/$preset-fidelity.tgz" -C /tmp/fid "$preset"

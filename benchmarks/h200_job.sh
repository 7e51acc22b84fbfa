#!/usr/bin/env bash
# On a GPU machine, after benchmarks/h200_install.sh: run benchmarks/h200.py for one preset and pack the
# results into $OUT/PRESET.tgz (packed even when the run is cut short, so partial results come back).
# usage: bash benchmarks/h200_job.sh PRESET [NUM_PROMPTS] [SECONDS] [PART] [h200.py options...]   (PART: prefill | rollout | perf)
set -u
export PYTHONPATH=$HOME/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_LOGGING_LEVEL=ERROR
preset=$1; n=${2:-32}; budget=${3:-500}; part=${4:-prefill}; name=$preset-$part
mkdir -p /tmp/res
timeout "$budget" python3 benchmarks/h200.py --preset "$preset" --part "$part" --num-prompts "$n" --out "/tmp/res/$name" "${@:5}" 2>&1 \
  | grep -v "it/s\]\|dump_input" | tail -60
tar czf "$OUT/$name.tgz" -C /tmp/res "$name"

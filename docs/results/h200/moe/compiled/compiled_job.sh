#!/usr/bin/env bash
# On the lent H200, after ../shared/gpu's install.sh: compiled_job.py's two engines (tapped, untapped), each in its
# own process, on the tiny Qwen3-MoE; then the summary. usage: bash docs/results/h200/moe/compiled/compiled_job.sh OUTDIR
set -u
export PYTHONPATH=$HOME/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_LOGGING_LEVEL=ERROR VLLM_ENABLE_V1_MULTIPROCESSING=0
out=$1; m=/tmp/dp-models/qwen3-moe-tiny; job=docs/results/h200/moe/compiled/compiled_job.py; mkdir -p $out
python3 -m divergence_probe make-model $m --arch qwen3_moe --preset tiny > /dev/null
for taps in all none; do
  python3 $job run $m $taps $out/$taps.json > $out/$taps.log 2>&1; echo "--taps $taps: rc=$?"; tail -3 $out/$taps.log
done
python3 $job summary $out/all.json $out/none.json | tee $out/summary.json

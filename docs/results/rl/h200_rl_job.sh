#!/usr/bin/env bash
# On the lent H200, after ../shared/gpu's install.sh: the rl experiment on the built-in model with vLLM's CUDA engine,
# started in the background beside the other GPU work (its engine takes 8% of the GPU's memory).
# usage: setsid nohup bash docs/results/rl/h200_rl_job.sh > /tmp/rl-job.log 2>&1 < /dev/null &
# Rows are flushed per step into /tmp/rl-gpu/SIDE/rl.csv; collect that folder into $OUT from a later call.
set -u
export PYTHONPATH=$HOME/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_LOGGING_LEVEL=ERROR
for side in train both; do
  settings="--setting none --setting rope --setting rope,swiglu,rmsnorm"
  [ "$side" = both ] && settings="--setting rope --setting rope,swiglu,rmsnorm"
  python3 -m divergence_probe rl $settings --side "$side" --seeds 3 --steps 200 --device cuda \
    --engine-args '{"gpu_memory_utilization": 0.08}' --out "/tmp/rl-gpu/$side"
  echo "== rl --side $side: exit $?"
done

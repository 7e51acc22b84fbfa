#!/usr/bin/env bash
# On the lent H200, after ../shared/gpu's staging and install: the runs of 2026-12-02 that need no new code.
# usage: bash docs/results/h200/jobs/2026-12-02-a.sh rl-and-moe | 14b
#   rl-and-moe: issue 30's verification benchmark at the Qwen2.5-1.5B shape (bench_rl.py, the dense `letters` task,
#               eager engine), then issue 28's MoE tap cost (moe/tap_cost_job.py, 8 layers of Qwen3-30B-A3B).
#   14b:        issue 29's re-run of the 14B compiled compare with --batch-invariance (the floor's trainer in
#               micro-batches since d0a1ef7), every shipped prompt uncut, as the OOM run was.
# Results land in $OUT (copied to docs/results/h200/... by hand, with this script's name beside them).
set -u
export PYTHONPATH=$HOME/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_LOGGING_LEVEL=ERROR
M=/tmp/dp-models; mkdir -p $M /tmp/res
case "$1" in
  rl-and-moe)
    [ -f $M/1.5b/config.json ] || python3 docs/results/h200/scale/gpu_build.py qwen2.5-1.5b $M/1.5b
    timeout -k 10 260 python3 benchmarks/bench_rl.py --model $M/1.5b --device cuda --reward letters --steps 12 \
      --rounds 2 --align rope --engine-args '{"gpu_memory_utilization": 0.3}' --out $OUT/bench_rl_qwen2.5-1.5b.json \
      2>&1 | grep -v "it/s\]" | tail -25
    timeout -k 10 240 python3 docs/results/h200/moe/tap_cost_job.py 8 7 $OUT/moe_tap_cost_8l.json 2>&1 | tail -8
    ;;
  14b)
    [ -f $M/14b/config.json ] || python3 docs/results/h200/scale/gpu_build.py qwen2.5-14b $M/14b
    s=$(date +%s)
    timeout -k 10 480 python3 -m divergence_probe compare --model $M/14b --device cuda --engine compiled \
      --batch-invariance --out /tmp/res/qwen2.5-14b-compiled-bi > /tmp/res/14b-bi.stdout 2> /tmp/res/14b-bi.stderr
    echo "rc=$? wall=$(( $(date +%s) - s )) s" | tee -a /tmp/res/14b-bi.stdout
    tail -30 /tmp/res/14b-bi.stdout; tail -3 /tmp/res/14b-bi.stderr
    nvidia-smi --query-gpu=memory.used,memory.total --format=csv
    tar czf $OUT/qwen2.5-14b-compiled-bi.tgz --exclude=tokens.csv -C /tmp/res qwen2.5-14b-compiled-bi 14b-bi.stdout 14b-bi.stderr
    ;;
esac

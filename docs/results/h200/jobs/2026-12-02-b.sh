#!/usr/bin/env bash
# On the lent H200, after ../shared/gpu's staging and install: the runs of 2026-12-02 that need this session's code.
# usage: bash docs/results/h200/jobs/2026-12-02-b.sh timing | rl-start | moe | rl-collect
# Ran in the seventeenth session (2026-12-02, from main at dfe6aae): timing, then `rl-start; sleep 60; moe` in one
# call (the rl processes load first, so that the MoE compare's memory plan sees what they hold), then rl-collect.
#   timing:     issue 30's verification benchmark at the Qwen2.5-1.5B shape after the batched weight check, and
#               issue 28's MoE tap cost after the batched routing comparison (the GPU quiet: run first).
#   rl-start:   issue 30's experiment in the background (setsid): the Qwen2.5-0.5B shape, compiled engine, dense
#               `letters` reward, 3 seeds x 100 steps per setting, one process per setting; the tiny Qwen3-MoE with and
#               without routing replay; and the floors at the starting checkpoint (compare --mode generate).
#   moe:        issue 28's compiled-engine MoE runs: Qwen3-30B-A3B's layer shape at 16 layers (two stacks beside the
#               rl processes), compare with the floors and with R3 replay, against the compiled engine (CUDA graphs),
#               in batches of at most 2048 prompt tokens (with 16 prompts in one batch the tiny MoE's compiled CUDA
#               engine left a prompt to a second step: docs/results/h200/moe/compiled/README.md).
#   rl-collect: wait for the rl processes, pack their folders.
set -u
export PYTHONPATH=$HOME/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_LOGGING_LEVEL=ERROR
M=/tmp/dp-models; R=/tmp/res; mkdir -p $M $R
DP="python3 -m divergence_probe"
case "$1" in
  timing)
    [ -f $M/1.5b/config.json ] || python3 docs/results/h200/scale/gpu_build.py qwen2.5-1.5b $M/1.5b
    timeout -k 10 200 python3 benchmarks/bench_rl.py --model $M/1.5b --device cuda --reward letters --steps 12 \
      --rounds 2 --align rope --engine-args '{"gpu_memory_utilization": 0.3}' --out $OUT/bench_rl_qwen2.5-1.5b.json \
      2>&1 | grep "^| \|Targets"
    timeout -k 10 200 python3 docs/results/h200/moe/tap_cost_job.py 8 7 $OUT/moe_tap_cost_8l.json 2>&1 | tail -1
    ;;
  rl-start)
    [ -f $M/0.5b/config.json ] || python3 docs/results/h200/scale/gpu_build.py qwen2.5-0.5b $M/0.5b
    [ -f $M/moe-tiny/config.json ] || $DP make-model $M/moe-tiny --arch qwen3_moe --preset tiny --seed 0
    RL="$DP rl --device cuda --reward letters --seeds 3 --steps 100 --engine-args '{\"gpu_memory_utilization\": 0.05}'"
    mkdir -p $R/rl
    start() { name=$1; shift; setsid nohup bash -c "$* --out $R/rl/$name > $R/rl/$name.log 2>&1; echo rc=\$? >> $R/rl/$name.log" \
                < /dev/null > /dev/null 2>&1 & }
    start train-none      $RL --model $M/0.5b --engine compiled --side train --setting none
    start train-rope      $RL --model $M/0.5b --engine compiled --side train --setting rope
    start train-all3      $RL --model $M/0.5b --engine compiled --side train --setting rope,swiglu,rmsnorm
    # side both patches the engine, which a compiled rl engine cannot take (rl/spec.py): that arm runs eager, and so
    # does MoE (rl records the rollout's routes with hooks, which a compiled engine does not run)
    start both-all3       $RL --model $M/0.5b --engine eager    --side both  --setting rope,swiglu,rmsnorm
    start moe-tiny        $RL --model $M/moe-tiny --engine eager --side train --setting none --setting routing
    start floors $DP compare --model $M/0.5b --device cuda --engine compiled --mode generate --batch-invariance \
      --engine-noise --taps none
    sleep 5; ls $R/rl
    ;;
  moe)
    [ -f $M/moe16/config.json ] || python3 docs/results/h200/moe/routing_job.py build 16 $M/moe16
    mkdir -p $R/moe
    for args in "--engine compiled --batch-invariance --engine-noise:compiled" "--engine compiled --align routing:compiled-r3"; do
      name=${args##*:}; s=$(date +%s)
      timeout -k 10 240 $DP compare --model $M/moe16 --device cuda --num-prompts 16 --max-prompt-tokens 512 --taps all \
        --batch-tokens 2048 \
        ${args%%:*} --out $R/moe/$name > $R/moe-$name.log 2>&1
      echo "== moe $name rc=$? $(( $(date +%s) - s )) s"; tail -25 $R/moe-$name.log | grep -v "it/s"
    done
    tar czf $OUT/moe-compiled.tgz -C $R moe moe-compiled.log moe-compiled-r3.log
    ;;
  rl-collect)
    for i in $(seq 1 ${2:-500}); do [ $(grep -l "^rc=" $R/rl/*.log 2>/dev/null | wc -l) -ge 6 ] && break; sleep 1; done
    grep -H "^rc=" $R/rl/*.log; tail -n 3 $R/rl/*.log
    tar czf $OUT/rl-h200.tgz -C $R rl
    ;;
esac

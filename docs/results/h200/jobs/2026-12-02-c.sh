#!/usr/bin/env bash
# On the lent H200, after 2026-12-02-b.sh (same machine: its models in /tmp/dp-models): what ran after b's rl-start
# failed (seventeenth session, main at dfe6aae). Each case is one device call, as it ran.
# usage: bash docs/results/h200/jobs/2026-12-02-c.sh rl-rerun | rl-all3-and-moe-floors | rl-floor
#   rl-rerun:               b's rl-start gave each engine gpu_memory_utilization 0.05, too little for the compiled
#                           0.5B engine (vLLM found no room for KV blocks); this reruns the side-train arms at 0.15
#                           and the tiny MoE at 0.1, four processes started at once. train-all3 failed again at start
#                           (vLLM counts the other processes' memory, allocated meanwhile, against its share), and the
#                           tiny MoE stopped at its first weight check (docs/results/rl/h200/README.md).
#   rl-all3-and-moe-floors: train-all3 alone at 0.2, then (after 50 s, its engine up) b's MoE compare with the floors,
#                           which had timed out at 240 s beside five rl processes.
#   rl-floor:               the noise floors of the rl runs' starting checkpoint, generate mode as rl samples (eager
#                           engine: the compiled generate-mode floor stopped, see README).
set -u
export PYTHONPATH=$HOME/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_LOGGING_LEVEL=ERROR
M=/tmp/dp-models
DP="python3 -m divergence_probe"
rl() { name=$1; out=$2; shift 2
       setsid nohup bash -c "$DP rl --device cuda --reward letters --seeds 3 --steps 100 $* --out $out/$name > $out/$name.log 2>&1; echo rc=\$? >> $out/$name.log" \
         < /dev/null > /dev/null 2>&1 & }
case "$1" in
  rl-rerun)
    R=/tmp/res/rl2; mkdir -p $R; s=$(date +%s)
    E15="--engine-args '{\"gpu_memory_utilization\": 0.15}'"
    rl train-none $R --model $M/0.5b --engine compiled --side train --setting none "$E15"
    rl train-rope $R --model $M/0.5b --engine compiled --side train --setting rope "$E15"
    rl train-all3 $R --model $M/0.5b --engine compiled --side train --setting rope,swiglu,rmsnorm "$E15"
    rl moe-tiny $R --model $M/moe-tiny --engine eager --side train --setting none --setting routing \
       "--engine-args '{\"gpu_memory_utilization\": 0.1}'"
    while [ $(( $(date +%s) - s )) -lt 535 ] && [ $(grep -l "^rc=" $R/*.log 2>/dev/null | wc -l) -lt 4 ]; do sleep 5; done
    tar czf $OUT/rl2-h200.tgz -C /tmp/res rl2
    ;;
  rl-all3-and-moe-floors)
    R=/tmp/res/rl3; mkdir -p $R /tmp/res/moe2; s=$(date +%s)
    rl train-all3 $R --model $M/0.5b --engine compiled --side train --setting rope,swiglu,rmsnorm \
       "--engine-args '{\"gpu_memory_utilization\": 0.2}'"
    sleep 50
    timeout -k 10 400 $DP compare --model $M/moe16 --device cuda --num-prompts 16 --max-prompt-tokens 512 --taps all \
      --batch-tokens 2048 --engine compiled --batch-invariance --engine-noise --out /tmp/res/moe2/compiled \
      > /tmp/res/moe2/compiled.log 2>&1
    while [ $(( $(date +%s) - s )) -lt 500 ] && ! grep -q "^rc=" $R/train-all3.log; do sleep 3; done
    tar czf $OUT/rl3-moe2.tgz -C /tmp/res rl3 moe2
    ;;
  rl-floor)
    mkdir -p /tmp/res/fl
    timeout -k 5 170 $DP compare --model $M/0.5b --device cuda --mode generate --num-prompts 4 --samples-per-prompt 8 \
      --max-new-tokens 24 --batch-invariance --taps none --out /tmp/res/fl/eager-generate > /tmp/res/fl/eager-generate.log 2>&1
    tar czf $OUT/floors.tgz -C /tmp/res fl
    ;;
esac

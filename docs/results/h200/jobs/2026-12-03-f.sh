#!/usr/bin/env bash
# Written at the end of the eighteenth session (2026-12-02), NOT run: the next session's H200 plan, on
# ../shared/gpu's staging and install. Lessons of 2026-12-02-e.sh, built in here:
#   - one call carries at most 64 MiB with the working tree (~39 MiB): stage the last part (.gpu/p10) alone, then
#     carry .gpu/deps + .gpu/bin in the install call;
#   - the device brings back only a few files a call: every case writes its run folders under /tmp/res and one tar per
#     run under $OUT;
#   - the machine and all it holds go 30 s after a call ends: anything left running (the reference model's training)
#     must finish inside the calls that follow back to back.
# usage (in this order, back to back): bash docs/results/h200/jobs/2026-12-03-f.sh setup | moe-rl | refmodel-runs |
#        refmodel-both | qwen3-precision   (all commands dry-run on the CPU at tiny sizes, 2026-12-02)
#   setup:          the models (Qwen3-1.7B shape, tiny Qwen3-MoE), then the reference model starts training (10 min).
#   moe-rl:         issue 30's MoE arm (tiny Qwen3-MoE, shipped vs routing replay, 3 seeds x 100 steps), compiled
#                   engine, then the eager engine, staggered; the compiled one stopped on 2026-12-02 at the row vLLM's
#                   async scheduling feeds after an EOS (the eager engine schedules asynchronously too), which the
#                   recorder now drops (rows with `eos_frac` > 0 show it met that row).
#   refmodel-runs:  issue 34's remaining runs on the reference model once trained: graft (local error by family),
#                   and rl from it (the built-in bracket task: it was trained on Python), shipped
#                   vs the three regions in the trainer.
#   refmodel-both:  ablate --side both on it (a compiled engine build per combination).
#   qwen3-precision: issue 32's arms on the second dense shape (Qwen3-1.7B), as 2026-12-02-e.sh ran them at 1.5B.
set -u
export PYTHONPATH=$HOME/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_LOGGING_LEVEL=ERROR
M=/tmp/dp-models; R=/tmp/res; mkdir -p $M $R
DP="python3 -m divergence_probe"
pack() { tar czf $OUT/$1.tgz -C $R $1.log $(cd $R && ls -d $1 2>/dev/null); }
run() { name=$1; limit=$2; shift 2; s=$(date +%s)
        timeout -k 10 $limit $DP "$@" --out $R/$name > $R/$name.log 2>&1
        echo "== $name rc=$? $(( $(date +%s) - s )) s"; grep -v "it/s" $R/$name.log | tail -14; pack $name; }
background() { name=$1; limit=$2; shift 2
               setsid nohup bash -c "timeout -k 10 $limit $DP $* --out $R/$name > $R/$name.log 2>&1; echo rc=\$? >> $R/$name.log" \
                 < /dev/null > /dev/null 2>&1 & }
wait_for() { for i in $(seq 1 $2); do grep -q "^rc=" $R/$1.log 2>/dev/null && break; sleep 1; done; grep -v "it/s" $R/$1.log | tail -12; pack $1; }
case "$1" in
  setup)
    [ -f $M/1.7b/config.json ] || python3 docs/results/h200/scale/gpu_build.py qwen3-1.7b $M/1.7b
    [ -f $M/moe-tiny/config.json ] || $DP make-model $M/moe-tiny --arch qwen3_moe --preset tiny --seed 0
    setsid nohup bash -c "python3 scripts/train_reference_model.py --device cuda --minutes 10 --out $R/reference-model \
      > $R/refmodel.log 2>&1; echo rc=\$? >> $R/refmodel.log" < /dev/null > /dev/null 2>&1 &
    sleep 60; tail -3 $R/refmodel.log
    ;;
  moe-rl)
    E="--engine-args '{\"gpu_memory_utilization\": 0.1}'"
    background moe-rl-compiled 520 rl --model $M/moe-tiny --device cuda --reward letters --seeds 3 --steps 100 \
      --engine compiled --side train --setting none --setting routing "$E"
    sleep 75  # its engine profiled before the next one profiles
    background moe-rl-eager 440 rl --model $M/moe-tiny --device cuda --reward letters --seeds 3 --steps 100 \
      --engine eager --side train --setting none --setting routing "$E"
    wait_for moe-rl-compiled 520; wait_for moe-rl-eager 120
    ;;
  refmodel-runs)
    for i in $(seq 1 300); do grep -q "^rc=" $R/refmodel.log && break; sleep 1; done
    tail -16 $R/refmodel.log; cp $R/refmodel.log $R/reference-model/training.json $OUT/ 2>/dev/null
    background refmodel-rl 420 rl --model $R/reference-model --device cuda --seeds 3 --steps 40 --engine compiled \
      --side train --setting none --setting rope,swiglu,rmsnorm "--engine-args '{\"gpu_memory_utilization\": 0.15}'"
    sleep 75
    run refmodel-graft 150 compare --model $R/reference-model --device cuda --graft --depth --num-prompts 16
    wait_for refmodel-rl 300
    ;;
  refmodel-both)  # one compiled engine build per combination (8; on the CPU this took 406 s at 2 prompts)
    run refmodel-ablate-both 540 ablate --model $R/reference-model --device cuda --engine compiled --side both \
      --taps none --engine-noise --num-prompts 16
    ;;
  qwen3-precision)
    run qwen3-precision-ablate 240 ablate --model $M/1.7b --device cuda --engine compiled --regions rope,lm_head,residual \
      --side train --num-prompts 16 --max-prompt-tokens 512 --engine-noise --taps none
    run qwen3-precision-amp 120 compare --model $M/1.7b --device cuda --engine compiled --train-precision amp --taps none \
      --num-prompts 16 --max-prompt-tokens 512 --batch-invariance --engine-noise
    ;;
esac

#!/usr/bin/env bash
# The eighteenth session's H200 plan (2026-12-02), on ../shared/gpu's staging and install; 2026-12-02-d.sh (not run)
# trimmed to one session's 30 minutes. Three device calls, in this order, back to back on one machine:
# usage: bash docs/results/h200/jobs/2026-12-02-e.sh setup-bench | concurrent | finish
#   setup-bench: the models (random weights of the Qwen2.5-1.5B shape, the tiny Qwen3-MoE), then issue 30's weight-check
#                benchmark at the 1.5B shape on a quiet GPU (benchmarks/bench_rl.py, as 2026-12-02-a/b.sh ran it), then
#                issue 34's reference model starts training in the background (10 minutes).
#   concurrent:  beside the training, staggered so that no two vLLM engines profile memory at once: issue 30's MoE arm
#                (tiny Qwen3-MoE, compiled engine, shipped vs routing replay, 3 seeds x 100 steps; cut by the call's
#                time, rows flushed as they go), then issue 32's arms at the 1.5B shape against the compiled engine
#                (ablate rope, lm_head, residual --side train with the floors; AMP trainer vs BF16 with the floors) and
#                the prefill/decode split in generate mode on the eager engine.
#   finish:      the split on the compiled engine (the compiled generate mode that stopped in 2026-12-02-c.sh), then the
#                reference model's training result, compare on it against the compiled engine with the floors, and
#                ablate --side train with the three shipped regions.
# As it ran: setup-bench and concurrent in the first machine session; the device brings back at most a few files a
# call, so concurrent's run folders stayed behind (only its logs, rl.csv and ablate's two tables came back) and the
# machine was released with the reference model half trained. The second machine session: stage and install again,
# then `second` (the benchmark with the stale-cache probe riding the rollout, the reference model trained for 6
# minutes, the split on both engines, each run as one tar) and `finish2`, then this command, typed in the same session:
#   timeout -k 5 200 python3 -m divergence_probe ablate --model /tmp/res/reference-model --device cuda --engine compiled \
#     --side train --taps none --engine-noise --num-prompts 16 --out /tmp/res/refmodel-ablate   (then one tar of it)
set -u
export PYTHONPATH=$HOME/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_LOGGING_LEVEL=ERROR
M=/tmp/dp-models; R=/tmp/res; mkdir -p $M $R
DP="python3 -m divergence_probe"
run() { name=$1; limit=$2; shift 2; s=$(date +%s)
        timeout -k 10 $limit $DP "$@" --out $OUT/$name > $OUT/$name.log 2>&1
        echo "== $name rc=$? $(( $(date +%s) - s )) s"; grep -v "it/s" $OUT/$name.log | tail -12; }
case "$1" in
  setup-bench)
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
    [ -f $M/1.5b/config.json ] || python3 docs/results/h200/scale/gpu_build.py qwen2.5-1.5b $M/1.5b
    [ -f $M/moe-tiny/config.json ] || $DP make-model $M/moe-tiny --arch qwen3_moe --preset tiny --seed 0
    s=$(date +%s)
    timeout -k 10 240 python3 benchmarks/bench_rl.py --model $M/1.5b --device cuda --reward letters --steps 12 \
      --rounds 2 --align rope --engine-args '{"gpu_memory_utilization": 0.3}' --out $OUT/bench_rl_qwen2.5-1.5b.json \
      > $OUT/bench_rl.log 2>&1
    echo "== bench_rl rc=$? $(( $(date +%s) - s )) s"; grep -v "it/s" $OUT/bench_rl.log | tail -8
    setsid nohup bash -c "python3 scripts/train_reference_model.py --device cuda --minutes 10 --out $R/reference-model \
      > $R/refmodel.log 2>&1; echo rc=\$? >> $R/refmodel.log" < /dev/null > /dev/null 2>&1 &
    sleep 20; tail -3 $R/refmodel.log
    ;;
  concurrent)
    s0=$(date +%s)
    setsid nohup bash -c "timeout -k 10 540 $DP rl --model $M/moe-tiny --device cuda --reward letters --seeds 3 \
      --steps 100 --engine compiled --side train --setting none --setting routing \
      --engine-args '{\"gpu_memory_utilization\": 0.1}' --out $OUT/moe-rl-compiled > $OUT/moe-rl-compiled.log 2>&1; \
      echo rc=\$? >> $OUT/moe-rl-compiled.log" < /dev/null > /dev/null 2>&1 &
    sleep 75  # its engine built and profiled before the next one profiles
    run precision-ablate 240 ablate --model $M/1.5b --device cuda --engine compiled --regions rope,lm_head,residual \
      --side train --num-prompts 16 --max-prompt-tokens 512 --engine-noise --taps none
    run precision-amp 120 compare --model $M/1.5b --device cuda --engine compiled --train-precision amp --taps none \
      --num-prompts 16 --max-prompt-tokens 512 --batch-invariance --engine-noise
    run split-eager 90 compare --model $M/1.5b --device cuda --engine eager --mode generate --num-prompts 8 \
      --samples-per-prompt 4 --max-new-tokens 64 --batch-invariance --taps none
    while [ $(( $(date +%s) - s0 )) -lt 560 ] && ! grep -q "^rc=" $OUT/moe-rl-compiled.log; do sleep 3; done
    echo "== moe-rl-compiled $(( $(date +%s) - s0 )) s"; grep -v "it/s" $OUT/moe-rl-compiled.log | tail -12
    tail -4 $R/refmodel.log
    ;;
  finish)
    run split-compiled 170 compare --model $M/1.5b --device cuda --engine compiled --mode generate --num-prompts 8 \
      --samples-per-prompt 4 --max-new-tokens 64 --batch-invariance --taps none
    for i in $(seq 1 ${2:-240}); do grep -q "^rc=" $R/refmodel.log && break; sleep 1; done
    mkdir -p $OUT/refmodel; cp $R/refmodel.log $R/reference-model/training.json $R/reference-model/config.json \
      $OUT/refmodel/ 2>/dev/null; tail -20 $R/refmodel.log
    run refmodel-compare 150 compare --model $R/reference-model --device cuda --engine compiled --engine-noise \
      --batch-invariance --taps none
    run refmodel-ablate 150 ablate --model $R/reference-model --device cuda --engine compiled --side train --taps none \
      --engine-noise
    ;;
  second)
    [ -f $M/1.5b/config.json ] || python3 docs/results/h200/scale/gpu_build.py qwen2.5-1.5b $M/1.5b
    s=$(date +%s)
    timeout -k 10 240 python3 benchmarks/bench_rl.py --model $M/1.5b --device cuda --reward letters --steps 12 \
      --rounds 2 --align rope --engine-args '{"gpu_memory_utilization": 0.3}' --out $OUT/bench_rl_qwen2.5-1.5b_ride.json \
      > $OUT/bench_rl_ride.log 2>&1
    echo "== bench_rl rc=$? $(( $(date +%s) - s )) s"; grep -v "it/s" $OUT/bench_rl_ride.log | tail -6
    setsid nohup bash -c "python3 scripts/train_reference_model.py --device cuda --minutes 6 --out $R/reference-model \
      > $R/refmodel.log 2>&1; echo rc=\$? >> $R/refmodel.log" < /dev/null > /dev/null 2>&1 &
    sleep 45  # its allocations settled before an engine profiles memory
    for engine in eager compiled; do
      name=split-$engine; s=$(date +%s)
      timeout -k 10 170 $DP compare --model $M/1.5b --device cuda --engine $engine --mode generate --num-prompts 8 \
        --samples-per-prompt 4 --max-new-tokens 64 --batch-invariance --taps none --out $R/$name > $R/$name.log 2>&1
      echo "== $name rc=$? $(( $(date +%s) - s )) s"; grep -v "it/s" $R/$name.log | tail -4
      tar czf $OUT/$name.tgz -C $R $name.log $(cd $R && ls -d $name 2>/dev/null)
    done
    tail -3 $R/refmodel.log
    ;;
  finish2)
    for i in $(seq 1 ${2:-300}); do grep -q "^rc=" $R/refmodel.log && break; sleep 1; done
    tail -22 $R/refmodel.log
    run() { name=$1; limit=$2; shift 2; s=$(date +%s)
            timeout -k 10 $limit $DP "$@" --out $R/$name > $R/$name.log 2>&1
            echo "== $name rc=$? $(( $(date +%s) - s )) s"; grep -v "it/s" $R/$name.log | tail -25
            tar czf $OUT/$name.tgz -C $R $name.log $(cd $R && ls -d $name 2>/dev/null); }
    cp $R/refmodel.log $R/reference-model/training.json $R/reference-model/config.json $OUT/ 2>/dev/null
    run refmodel-compare 160 compare --model $R/reference-model --device cuda --engine compiled --engine-noise \
      --batch-invariance --taps none
    ;;
esac

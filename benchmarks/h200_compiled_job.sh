#!/usr/bin/env bash
# On a lent GPU machine, after ../shared/gpu's install.sh: parts of issue 13's compiled-engine runs, side by side,
# job i on GPU i modulo the GPU count; each job's results packed into $OUT/PART-PRESET.tgz even when cut short.
# usage: bash benchmarks/h200_compiled_job.sh SECONDS PART:PRESET [PART:PRESET ...]
#   e.g. bash benchmarks/h200_compiled_job.sh 560 ablate:qwen2.5-1.5b ablate:qwen3-1.7b   (nvidia-h200-x2)
#   ablate: ablate --regions rope,swiglu,rmsnorm --side both --engine-noise (ABLATE_OPTS=--no-engine-noise: none) against vLLM's default compiled engine,
#           the seven aligned engines built together (--build-ahead 7), 16 prompts <= 1024 tokens, bootstrap 200
#   cgtaps: layer taps under CUDA graphs (benchmarks/h200_cgtaps.py: plain, tapped, nographs side by side; summary)
#   tapcost: what taps cost and where it goes (benchmarks/h200_tap_cost.py: plain, then tapped, then summary)
# Results: /tmp/compiled/PRESET/...; copy them to docs/results/h200/compiled/PRESET/ (render with `divergence-probe report`).
set -u
export PYTHONPATH=$HOME/site:$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_LOGGING_LEVEL=ERROR
export VLLM_ENABLE_V1_MULTIPROCESSING=0
budget=$1; shift
python3 - <<'PY'
from pathlib import Path
from divergence_probe.modelzoo import make_model
for preset in ("qwen2.5-1.5b", "qwen3-1.7b"):  # made once, before the parallel jobs read them
    if not (Path("/tmp/dp-models") / preset / "config.json").exists():
        make_model(Path("/tmp/dp-models") / preset, preset=preset, seed=0)
PY
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
i=0
for job in "$@"; do
  part=${job%%:*}; preset=${job#*:}; out=/tmp/compiled/$preset; mkdir -p "$out"
  (
    export CUDA_VISIBLE_DEVICES=$(( i % gpus ))
    start=$(date +%s)
    if [ "$part" = ablate ]; then
      timeout "$budget" python3 benchmarks/h200_compiled.py --preset "$preset" --part ablate \
        --regions rope,swiglu,rmsnorm --build-ahead 7 --num-prompts 16 --bootstrap 200 --out "$out" ${ABLATE_OPTS:-}
    elif [ "$part" = tapcost ]; then
      o=$out/tap-cost; mkdir -p "$o"
      for p in plain tapped summary; do  # one after the other, within the job's budget
        timeout $(( start + budget - $(date +%s) )) python3 benchmarks/h200_tap_cost.py --preset "$preset" --part $p --out "$o" > "$o/$p.log" 2>&1
      done
      tail -c 3000 "$o/summary.log"
    else
      o=$out/cgtaps; mkdir -p "$o"
      for p in plain tapped nographs; do
        timeout "$budget" python3 benchmarks/h200_cgtaps.py --preset "$preset" --part $p --out "$o" > "$o/$p.log" 2>&1 &
      done
      wait
      python3 benchmarks/h200_cgtaps.py --preset "$preset" --part summary --out "$o"
    fi
    echo "== $part $preset: exit $? after $(( $(date +%s) - start )) s"
  ) > "$out/$part.log" 2>&1 &
  i=$(( i + 1 ))
done
wait
for job in "$@"; do
  part=${job%%:*}; preset=${job#*:}
  grep -v "it/s\]\|dump_input" "/tmp/compiled/$preset/$part.log" | tail -30
  tar czf "${OUT:-/tmp}/$part-$preset.tgz" --exclude='*.pt' -C /tmp/compiled "$preset"  # .pt: the summary's inputs
done

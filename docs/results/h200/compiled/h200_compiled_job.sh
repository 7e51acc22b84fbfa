#!/usr/bin/env bash
# On a lent GPU machine, after ../shared/gpu's install.sh: parts of issue 13's compiled-engine runs, side by side,
# job i on GPU i modulo the GPU count; each job's results packed into $OUT/PART-PRESET.tgz every 20 s and at the end,
# so a run cut short still brings back what it wrote.
# usage: bash docs/results/h200/compiled/h200_compiled_job.sh SECONDS PART:PRESET [PART:PRESET ...]
#   SECONDS: every process of every job is stopped this long after the script starts (packing takes a few more)
#   e.g. bash docs/results/h200/compiled/h200_compiled_job.sh 560 ablate:qwen2.5-1.5b ablate:qwen3-1.7b   (nvidia-h200-x2)
#   ablate: ablate --regions rope,swiglu,rmsnorm --side both --engine-noise (ABLATE_OPTS=--no-engine-noise: none) against vLLM's default compiled engine,
#           the seven aligned engines built together (--build-ahead 7), 16 prompts <= 1024 tokens, bootstrap 200
#   cgtaps: layer taps under CUDA graphs (docs/results/h200/compiled/h200_cgtaps.py: plain, tapped, nographs side by side; summary)
#   tapcost: what taps cost and where it goes (docs/results/h200/compiled/h200_tap_cost.py: the engines without and with tap points,
#            alive together, their calls interleaved; TAPCOST_OPTS: more options, e.g. --reps 5 or --parts tapped)
# Results: /tmp/compiled/PRESET/...; copy them to docs/results/h200/compiled/PRESET/ (render with `divergence-probe report`).
set -u
export PYTHONPATH=$HOME/site:$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_LOGGING_LEVEL=ERROR
export VLLM_ENABLE_V1_MULTIPROCESSING=0
deadline=$(( $(date +%s) + $1 )); shift
left() { echo $(( deadline - $(date +%s) > 1 ? deadline - $(date +%s) : 1 )); }  # seconds to the deadline
pack() {
  for job in "$@"; do
    part=${job%%:*}; preset=${job#*:}
    [ -d "/tmp/compiled/$preset" ] && tar czf "${OUT:-/tmp}/tmp-$part-$preset.tgz" --exclude='*.pt' -C /tmp/compiled "$preset" \
      && mv "${OUT:-/tmp}/tmp-$part-$preset.tgz" "${OUT:-/tmp}/$part-$preset.tgz"  # .pt: the summary's inputs
  done
}
python3 - "$@" <<'PY'
import sys
from pathlib import Path
from divergence_probe.modelzoo import make_model
for preset in sorted({job.split(":", 1)[1] for job in sys.argv[1:]}):  # made once, before the parallel jobs read them
    if not (Path("/tmp/dp-models") / preset / "config.json").exists():
        make_model(Path("/tmp/dp-models") / preset, preset=preset, seed=0)
PY
gpus=$(python3 -c "import torch; print(max(1, torch.cuda.device_count()))")  # (1 on a CPU dry run)
i=0
pids=()
for job in "$@"; do
  part=${job%%:*}; preset=${job#*:}; out=/tmp/compiled/$preset; mkdir -p "$out"
  (
    export CUDA_VISIBLE_DEVICES=$(( i % gpus ))
    share=$(( $(nproc) / $# )); taskset -pc $(( i * share ))-$(( (i + 1) * share - 1 )) $BASHPID > /dev/null  # own cores
    start=$(date +%s)
    if [ "$part" = ablate ]; then
      timeout -k 10 $(left) python3 docs/results/h200/compiled/h200_compiled.py --preset "$preset" --part ablate \
        --regions rope,swiglu,rmsnorm --build-ahead 7 --num-prompts 16 --bootstrap 200 --out "$out" ${ABLATE_OPTS:-}
    elif [ "$part" = tapcost ]; then
      o=$out/tap-cost; mkdir -p "$o"
      timeout -k 10 $(left) python3 docs/results/h200/compiled/h200_tap_cost.py --preset "$preset" --out "$o" ${TAPCOST_OPTS:-} \
        > "$o/drive.log" 2>&1  # both engines in one run, their timed calls interleaved
      echo "tap cost: exit $? at $(( $(date +%s) - start )) s"
      tail -c 3000 "$o/drive.log"
    else
      o=$out/cgtaps; mkdir -p "$o"
      for p in plain tapped nographs; do
        timeout -k 10 $(left) python3 docs/results/h200/compiled/h200_cgtaps.py --preset "$preset" --part $p --out "$o" > "$o/$p.log" 2>&1 &
      done
      wait
      python3 docs/results/h200/compiled/h200_cgtaps.py --preset "$preset" --part summary --out "$o"
    fi
    echo "== $part $preset: exit $? after $(( $(date +%s) - start )) s"
  ) > "$out/$part.log" 2>&1 &
  pids+=($!)
  i=$(( i + 1 ))
done
while kill -0 "${pids[@]}" 2>/dev/null; do sleep 20; pack "$@"; done  # until every job has ended
wait
pack "$@"
for job in "$@"; do
  part=${job%%:*}; preset=${job#*:}
  grep -v "it/s\]\|dump_input" "/tmp/compiled/$preset/$part.log" | tail -30
done

#!/usr/bin/env bash
# On the lent H200, after ../shared/gpu's staging and benchmarks/h200_install.sh: issue 29's memory-plan runs, the
# README's default compare at a published shape on one GPU, with and without an 80 GB cap.
# usage: bash docs/results/h200/scale/h200_scale_job.sh SECONDS SHAPE [SHAPE ...]     SHAPE: qwen2.5-7b or qwen2.5-14b
# Results: $OUT/scale-SHAPE.tgz (run folders without tokens.csv, each run's stderr and exit code, timings); copy them
# to docs/results/h200/scale/SHAPE/.
set -u
export PYTHONPATH=$HOME/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
deadline=$(( $(date +%s) + $1 )); shift
left() { echo $(( deadline - $(date +%s) > 1 ? deadline - $(date +%s) : 1 )); }
C="python3 -m divergence_probe compare --num-prompts 32 --max-prompt-tokens 1024 --device cuda"
for shape in "$@"; do
  m=/tmp/dp-models/$shape; r=/tmp/scale/$shape; mkdir -p "$r"
  t0=$(date +%s)
  [ -f "$m/config.json" ] || python3 -m divergence_probe make-model "$m" --preset "$shape" --seed 0
  echo "== $shape: built in $(( $(date +%s) - t0 )) s" | tee -a "$r/times.txt"
  run() {  # run NAME [ENV=VALUE ...] -- [compare options]: stderr, exit code and wall time kept per run
    name=$1; shift; envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
    s=$(date +%s.%N)
    env "${envs[@]}" timeout -k 10 $(left) $C --model "$m" --out "$r/$name" "$@" > "$r/$name.stdout" 2> "$r/$name.stderr"
    rc=$?
    echo "== $shape $name: rc=$rc wall=$(python3 -c "import time; print(round(time.time() - $s, 1))") s" | tee -a "$r/times.txt"
    tail -n 3 "$r/$name.stderr"
  }
  if [ "$shape" = qwen2.5-7b ]; then
    run default --
    run cap80 DIVERGENCE_PROBE_DEVICE_MEMORY=80GB --
    run chunked DIVERGENCE_PROBE_DEVICE_MEMORY=100GB --
    for f in layers.csv tokens.csv; do cmp "$r/default/$f" "$r/chunked/$f" && echo "chunked $f: identical to default" | tee -a "$r/times.txt"; done
    run compiled -- --engine compiled
  else
    run default --
    run cap80 DIVERGENCE_PROBE_DEVICE_MEMORY=80GB --
    run cap80-taps-none DIVERGENCE_PROBE_DEVICE_MEMORY=80GB -- --taps none
  fi
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv >> "$r/times.txt"
  tar czf "${OUT:-/tmp}/scale-$shape.tgz" --exclude=tokens.csv -C /tmp/scale "$shape"
done

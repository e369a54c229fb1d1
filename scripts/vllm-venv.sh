#!/usr/bin/env bash
# Makes (or reuses) the virtual environment the vLLM tests run in, outside
# the clone so that CI and later clones reuse it: vLLM and Mooncake's wheel
# at the pinned versions. Prints the environment's python on its last line.
# Usage: scripts/vllm-venv.sh VLLM_VERSION MOONCAKE_VERSION
set -euo pipefail
vllm=${1:?vLLM version}
mooncake=${2:?Mooncake wheel version}
cache=${MCGUARD_CACHE:-$HOME/.cache/mcguard}
venv=$cache/venv-vllm-$vllm-mooncake-$mooncake
# The marker is written last: a venv without it is an interrupted install.
if [ ! -f "$venv/.complete" ]; then
  rm -rf "$venv"
  mkdir -p "$cache"
  echo "installing vLLM $vllm and Mooncake $mooncake into $venv (about 5 minutes, 10 GB)" >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --progress-bar off "vllm==$vllm" "mooncake-transfer-engine-non-cuda==$mooncake" pytest >&2
  touch "$venv/.complete"
fi
echo "$venv/bin/python"

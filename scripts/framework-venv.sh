#!/usr/bin/env bash
# Makes (or reuses) the virtual environment a serving framework's tests run
# in (vLLM's, SGLang's), outside the clone so that CI and later clones
# reuse it: the framework and Mooncake's wheel at the pinned versions.
# Prints the environment's python on its last line.
# Usage: scripts/framework-venv.sh vllm|sglang VERSION MOONCAKE_VERSION
set -euo pipefail
name=${1:?framework: vllm or sglang}
version=${2:?framework version}
mooncake=${3:?Mooncake wheel version}
case $name in
  vllm) size="about 5 minutes, 10 GB" ;;
  sglang) size="about 3 minutes, 11 GB" ;;
  *) echo "framework-venv.sh: unknown framework '$name' (vllm or sglang)" >&2; exit 2 ;;
esac
cache=${MCGUARD_CACHE:-$HOME/.cache/mcguard}
venv=$cache/venv-$name-$version-mooncake-$mooncake
# The marker is written last: a venv without it is an interrupted install.
if [ ! -f "$venv/.complete" ]; then
  rm -rf "$venv"
  mkdir -p "$cache"
  echo "installing $name $version and Mooncake $mooncake into $venv ($size)" >&2
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --progress-bar off "$name==$version" \
    "mooncake-transfer-engine-non-cuda==$mooncake" pytest >&2
  touch "$venv/.complete"
fi
echo "$venv/bin/python"

#!/usr/bin/env bash
# Makes (or reuses) the virtual environment a serving framework's tests run
# in (vLLM's, SGLang's), outside the clone so that CI and later clones
# reuse it: the framework and Mooncake's wheel at the pinned versions.
# Packages named after the versions go in with --no-deps (NIXL's wheels:
# their pins would pull another torch), each set once, under its own
# marker, so an environment made before a set was added gets it too.
# Prints the environment's python on its last line.
# Usage: scripts/framework-venv.sh vllm|sglang VERSION MOONCAKE_VERSION [NO_DEPS_PACKAGE...]
set -euo pipefail
name=${1:?framework: vllm or sglang}
version=${2:?framework version}
mooncake=${3:?Mooncake wheel version}
shift 3
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
if [ $# -gt 0 ]; then
  marker="$venv/.no-deps-$(echo "$*" | sha256sum | cut -c1-16)"
  if [ ! -f "$marker" ]; then
    echo "installing $* into $venv (--no-deps)" >&2
    "$venv/bin/python" -m pip install -q --progress-bar off --no-deps "$@" >&2
    touch "$marker"
  fi
fi
echo "$venv/bin/python"

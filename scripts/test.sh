#!/usr/bin/env bash
# Install everything the tests need, then run them (the README's test command).
#   - the package with its test extra (pytest, jinja2, torch==2.13.0 CPU)
#   - .ci/install-interop.sh: llama-cpp-python==0.3.36 built from source (the Oct-2026 llama.cpp), llama.cpp b12211
#     as WebAssembly (@wllama/wllama 3.13.0) and Node.js 26 into .interop/, and llama.cpp's converter from the sdist
#   - the numba kernels built once (scripts/build_kernels.py), the test suite on both cores (pytest-xdist),
#     then kimi-verify end to end on 8-layer K3 and K3.1 fixture checkpoints
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --progress-bar off -e '.[test]'
bash .ci/install-interop.sh
python scripts/build_kernels.py             # every numba kernel once, on both cores (not twice, once per worker)
python -m pytest -q -n 2 --dist worksteal --durations=15   # both cores, the idle worker takes queued tests; the 15 slowest shown
bash scripts/verify_fixtures.sh

#!/usr/bin/env bash
# Everything a fresh CPU machine needs to build kdtree and run its tests, into the active Python
# environment (use a virtual environment). Needs nvcc (CUDA 12.8+ for sm_120) on PATH or in
# /usr/local/cuda; no GPU. Order matters: torch first, so nothing below can pull a CUDA torch.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# --no-cache-dir: no second copy of each wheel in pip's cache (triton alone is ~1 GB installed, and a runner's disk can
# run out while pip downloads it)
pip_install() { python -m pip install --disable-pip-version-check --no-cache-dir "$@"; }
step() { echo "== ci/install.sh: $* (${SECONDS}s)"; }

df -h . | tail -n 1 | awk '{print "== ci/install.sh: disk free here: " $4 " of " $2}'
step "torch 2.13.0 (CPU)"
pip_install torch==2.13.0

step "SGLang CPU test set (--no-deps, pinned: requirements/sglang-cpu.txt)"
pip_install --no-deps -r requirements/sglang-cpu.txt

step "test tools (requirements/test.txt)"
pip_install -r requirements/test.txt

step "kdtree: pip install . (CMake + nvcc build of the CUDA library and the Cython module)"
build_start=$SECONDS
pip_install ".[test]"   # (tests/test_ptxas.py fails on a register spill, per kernel and architecture)
echo "== ci/install.sh: kdtree built and installed in $((SECONDS - build_start))s"

python -c "import kdtree._verify as v; print('kdtree._verify', v.__file__, 'archs', v.compiled_archs())"
step "done"

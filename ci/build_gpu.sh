#!/usr/bin/env bash
# Build and install kdtree on a GPU machine for its own GPU only (one architecture: a fast build).
# The GPU machine has no network: the build uses the installed scikit-build-core, cython, cmake,
# ninja and torch (--no-build-isolation), installs no dependency, and never reaches an index.
#   KDTREE_CUDA_ARCHS=90a bash ci/build_gpu.sh    # override the detected architecture
#   KDTREE_PTXAS_VERBOSE=ON bash ci/build_gpu.sh  # print registers / shared memory per kernel
# The CMake build tree stays in build/gpu (git-ignored), so a second run rebuilds incrementally.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python=${PYTHON:-python3}

if [ -z "${KDTREE_CUDA_ARCHS:-}" ]; then
  # "9.0" -> 90, "12.0" -> 120; several GPUs of different kinds -> "90;120".
  caps=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader)
  KDTREE_CUDA_ARCHS=$(echo "$caps" | tr -d ' .' | grep -E '^[0-9]+$' | sort -un | paste -sd ';' -)
  if [ -z "$KDTREE_CUDA_ARCHS" ]; then
    echo "ci/build_gpu.sh: could not read a compute capability from nvidia-smi: '$caps'" >&2
    exit 1
  fi
fi
echo "== ci/build_gpu.sh: KDTREE_CUDA_ARCHS=$KDTREE_CUDA_ARCHS, $($python --version), nvcc: $(nvcc --version | tail -1)"

# A build tree configured from another checkout path makes CMake refuse to run: start it afresh.
cache=build/gpu/CMakeCache.txt
if [ -f "$cache" ] && ! grep -qx "CMAKE_HOME_DIRECTORY:INTERNAL=$PWD" "$cache"; then
  rm -rf build/gpu
fi

start=$SECONDS
"$python" -m pip install --no-build-isolation --no-deps --no-index -v . \
  -C build-dir=build/gpu \
  -C "cmake.define.KDTREE_CUDA_ARCHS=$KDTREE_CUDA_ARCHS" \
  -C "cmake.define.KDTREE_PTXAS_VERBOSE=${KDTREE_PTXAS_VERBOSE:-OFF}"
echo "== ci/build_gpu.sh: built and installed in $((SECONDS - start))s"
(cd /tmp && "$python" -c "import kdtree._verify as v; print('kdtree._verify archs', v.compiled_archs())")

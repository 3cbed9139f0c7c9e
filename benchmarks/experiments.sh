#!/usr/bin/env bash
# Profiling aid: rebuild with one stage of the split kernel removed at a time and time H16 N9 P131072.
# (KDTREE_EXP_* macros in verify_kernel.cuh; never set in a normal build.)
set -uo pipefail
export PYTHONUNBUFFERED=1
arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '.')
# each variant: NONE, a KDTREE_EXP_* knock-out name, SKELETON (all three), or PF<n> (L2 prefetch distance n)
for v in ${KDTREE_EXPERIMENTS:-NONE NO_GATHER NO_SCORE_MMA NO_PV_MMA SKELETON}; do
  flags=""; [ "$v" != NONE ] && flags="-DKDTREE_EXP_$v"
  [ "$v" = SKELETON ] && flags="-DKDTREE_EXP_NO_GATHER -DKDTREE_EXP_NO_SCORE_MMA -DKDTREE_EXP_NO_PV_MMA"
  [[ "$v" == PF* ]] && flags="-DKDTREE_PREFETCH_TILES=${v#PF}"
  python3 -m pip install -q --no-build-isolation --no-deps . -C cmake.define.KDTREE_CUDA_ARCHS="$arch" \
      -C "cmake.define.CMAKE_CUDA_FLAGS=$flags" > /tmp/exp_build.log 2>&1 || { tail -20 /tmp/exp_build.log; exit 1; }
  echo "== $v"; python3 benchmarks/bench.py --no-sglang --quick --only "P131072" --out /tmp/exp.json 2>&1 | grep -v "^\[" 
done

#!/usr/bin/env bash
# Profiling aid: rebuild with compile-time variants of the split kernel and time them.
#   KDTREE_EXPERIMENTS="NONE NO_SCORE_MMA NO_SCORE_MMA+NO_PV_MMA" KDTREE_EXP_ONLY=P131072 KDTREE_EXP_TESTS=1 bash benchmarks/experiments.sh
# A variant is NONE or names joined by "+": a KDTREE_EXP_* knock-out (NO_GATHER, NO_SCORE_MMA, NO_PV_MMA,
# TRACE, TIMELINE; never set in a normal build) or D:NAME=VALUE for any other macro.
# TRACE (-DKDTREE_EXP_TRACE) runs benchmarks/trace_case.py on KDTREE_TRACE_SHAPES instead of the benchmark;
# TIMELINE (-DKDTREE_EXP_TIMELINE) runs benchmarks/timeline_case.py on KDTREE_TIMELINE_CASES (prefix N pairs).
# KDTREE_EXP_TESTS=1 also runs the kernel's GPU tests on each variant; KDTREE_EXP_QUICK=0 lets
# KDTREE_EXP_ONLY pick from the whole shape set (default: the --quick three).
set -uo pipefail
export PYTHONUNBUFFERED=1
arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '.')
for v in ${KDTREE_EXPERIMENTS:-NONE NO_GATHER NO_SCORE_MMA NO_PV_MMA}; do
  flags=""
  if [ "$v" != NONE ]; then
    for part in ${v//+/ }; do
      case "$part" in
        D:*) flags="$flags -D${part#D:}" ;;   # any macro, e.g. D:KDTREE_DUAL_LAZY_RESCALE=0
        *) flags="$flags -DKDTREE_EXP_$part" ;;
      esac
    done
  fi
  python3 -m pip install -q --no-build-isolation --no-deps . -C build-dir=build/exp -C cmake.define.KDTREE_CUDA_ARCHS="$arch" \
      -C "cmake.define.CMAKE_CUDA_FLAGS=$flags" > /tmp/exp_build.log 2>&1 || { tail -20 /tmp/exp_build.log; exit 1; }
  echo "== $v ($flags)"
  [ "$arch" = 90 ] && bash benchmarks/wgmma_check.sh $flags   # a serialised wgmma makes the variant's times not the kernel's
  if [[ "$v" == *TRACE* ]]; then   # clock64 stamps per tile (printed after each call): the last call's lines only
    for shape in ${KDTREE_TRACE_SHAPES:-131072:9 131072:1}; do
      python3 benchmarks/trace_case.py ${shape/:/ } 2>&1 | sed -n '/=== call 2/,$p' | grep -E "===|TRACE block 0" | head -${KDTREE_TRACE_LINES:-70}
    done
    continue
  fi
  if [[ "$v" == *TIMELINE* ]]; then   # per-kernel start / wait / end of graph replays (printf)
    python3 benchmarks/timeline_case.py ${KDTREE_TIMELINE_CASES:-131072 1 8192 9 131072 9} 2>&1 | grep -E "===|TIMELINE"
    continue
  fi
  quick=--quick; [ "${KDTREE_EXP_QUICK:-1}" = 0 ] && quick=""   # 0: --only picks from the whole shape set
  python3 benchmarks/bench.py --no-sglang $quick --only "${KDTREE_EXP_ONLY:-P131072}" --out /tmp/exp.json 2>&1 | grep -v "^\["
  if [ "${KDTREE_EXP_TESTS:-0}" = 1 ] && [[ "$v" != *NO_* ]]; then   # knock-outs fail the tests by design
    python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernel_gpu.py 2>&1 | tail -3
  fi
done

#!/usr/bin/env bash
# Everything a GPU machine run needs, in one script: build for the GPU at hand, then the stages asked for, logs
# under $OUT (the benchmark's JSON for benchmarks/report.py among them).
#   bash tools/device_session.sh build test sanitize bench [quick] [smallrows] [ncu] [ncusrc] [sglang] [layer] [sm120path] [fp8] [mmatests]
# - build: ci/build_gpu.sh (this GPU's architecture), then `python -m kdtree info`
# - test: the GPU tests (ci/test_gpu.sh)
# - sanitize: compute-sanitizer memcheck / racecheck / synccheck on tools/sanitize_case.py's cases, and synccheck on
#   every other split kernel
# - bench: benchmarks/bench.py (quick: three shapes; smallrows: the <= 16-row shapes too; sglang: SGLang's Triton
#   kernel beside it; layer: benchmarks/bench_sglang_layer.py; sm120path: the mma.sync 2-stage code path again;
#   fp8: the same shapes on an e4m3 pool, bench_e4m3.json; fp8 with sm120path: the e4m3 pool on the sm_120 code path
#   too, bench_e4m3_2stage.json)
# - fp8 without bench: the kernel tests on an e4m3 pool (KDTREE_TEST_KV=e4m3), on the device's FP8 kernel and on the
#   sm_120 one (KDTREE_SPLIT_STAGES=2); with sanitize, the FP8 kernel's cases
# - mmatests: the kernel tests on the non-default split kernels (mma.sync 2 / 3 stages, the skinny kernel for every
#   call, the dual kernel for small calls)
# - ncu / ncusrc: Nsight Compute of one call's kernels / per-instruction stall samples of the split kernel
# Needs on that machine: nvcc, cmake, ninja, cython, scikit-build-core, torch, triton (it has no network); carry
# .carry (the SGLang bundle, activated if present) and .whl (pytest wheels, used only if pytest is missing).
# Stages that write many logs archive them into one file: the device tool brings back only a few files from $OUT.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/kdtree-out}
mkdir -p "$OUT"
stages=" $* "
has() { [[ "$stages" == *" $1 "* ]]; }
log() { echo "[device $(date +%H:%M:%S)] $*"; }

nvidia-smi --query-gpu=name,driver_version,compute_cap,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
if ! python3 -c "import pytest" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if [ -f .carry/sglang/activate ]; then source .carry/sglang/activate; fi

if has build; then
  log "build (ci/build_gpu.sh)"
  KDTREE_PTXAS_VERBOSE=ON bash ci/build_gpu.sh > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
  grep -E "built and installed|registers|spill" "$OUT/build.log" | sort -u | head -20
  (cd /tmp && python3 -m kdtree info) || log "kdtree info failed"
fi
if has test; then
  log "gpu tests (ci/test_gpu.sh)"
  bash ci/test_gpu.sh -q -p no:cacheprovider ${KDTREE_PYTEST_ARGS:-} 2>&1 | tail -25
fi
if has bench; then
  log bench
  extra=""; has quick && extra="--quick"; has sglang || extra="$extra --no-sglang"
  has smallrows && extra="$extra --small-rows"
  python3 benchmarks/bench.py --out "$OUT/bench.json" $extra 2>&1 | tee "$OUT/bench.log"
  if has layer; then python3 benchmarks/bench_sglang_layer.py --out "$OUT/layer.json" 2>&1 | tee "$OUT/layer.log"; fi
  if has fp8; then
    log "bench: e4m3 pool"
    extra8=""; has quick && extra8="--quick"; has sglang || extra8="$extra8 --no-sglang"
    python3 benchmarks/bench.py --kv e4m3 --out "$OUT/bench_e4m3.json" $extra8 2>&1 | tee "$OUT/bench_e4m3.log"
    if has sm120path; then
      log "bench: e4m3 pool, the sm_120 code path (the FP8 mma.sync kernel with its sm_90 stand-in MMA)"
      KDTREE_SPLIT_STAGES=2 python3 benchmarks/bench.py --kv e4m3 --no-sglang $( has quick && echo --quick ) \
        --out "$OUT/bench_e4m3_2stage.json" 2>&1 | tee "$OUT/bench_e4m3_2stage.log"
    fi
  fi
  if has sm120path; then
    log "bench: the sm_120 pipeline (mma.sync, 2 stages) on this GPU"
    KDTREE_SPLIT_STAGES=2 python3 benchmarks/bench.py --no-sglang $( has quick && echo --quick ) --out "$OUT/bench_2stage.json" 2>&1 | tee "$OUT/bench_2stage.log"
  fi
fi
if has fp8 && ! has bench; then
  log "kernel tests on an e4m3 pool (the device's FP8 kernel: the dual kernel's FP8 form on sm_90a)"
  KDTREE_TEST_KV=e4m3 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernel_gpu.py 2>&1 | tail -3
  log "kernel tests on an e4m3 pool, KDTREE_SPLIT_STAGES=2 (the sm_120 FP8 kernel, its stand-in MMA here)"
  KDTREE_SPLIT_STAGES=2 KDTREE_TEST_KV=e4m3 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernel_gpu.py tests/test_fp8_gpu.py 2>&1 | tail -3
fi
if has mmatests; then   # the kernel tests on the other code paths (mma.sync: the sm_120 one and the 3-stage one)
  log "kernel tests, KDTREE_SPLIT_STAGES=2 (the sm_120 pipeline)"
  KDTREE_SPLIT_STAGES=2 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernel_gpu.py 2>&1 | tail -3
  log "kernel tests, KDTREE_SPLIT_KERNEL=mma (mma.sync, 3 stages)"
  KDTREE_SPLIT_KERNEL=mma python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernel_gpu.py 2>&1 | tail -3
  log "kernel tests, KDTREE_SPLIT_KERNEL=skinny (sm_90a, 16-row items, for every call)"
  KDTREE_SPLIT_KERNEL=skinny python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernel_gpu.py 2>&1 | tail -3
  log "kernel tests, KDTREE_SKINNY=0 (small calls on the dual kernel)"
  KDTREE_SKINNY=0 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernel_gpu.py 2>&1 | tail -3
fi
if has sanitize; then
  for tool in memcheck racecheck synccheck; do
    for c in small split many reuse n1; do
      log "compute-sanitizer $tool $c"
      compute-sanitizer --tool $tool --error-exitcode 9 python3 tools/sanitize_case.py $c > "/tmp/sanitize_${tool}_${c}.log" 2>&1
      echo "rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|rel err' "/tmp/sanitize_${tool}_${c}.log" | tr '\n' ' ')"
      grep -E "Error|hazard|Race|at 0x" "/tmp/sanitize_${tool}_${c}.log" | head -6   # the first findings, if any
    done
  done
  if has fp8; then   # the FP8 kernels (their own barriers and layouts) on an e4m3 pool with KV scales (n1: skinny FP8)
    for tc in "memcheck split" "racecheck split" "racecheck small" "synccheck split" "memcheck n1" "racecheck n1" \
              "synccheck n1"; do
      set -- $tc
      log "compute-sanitizer $1 $2, e4m3 pool"
      KDTREE_TEST_KV=e4m3 compute-sanitizer --tool $1 --error-exitcode 9 python3 tools/sanitize_case.py $2 \
        > "/tmp/sanitize_${1}_e4m3_$2.log" 2>&1
      echo "rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|rel err' "/tmp/sanitize_${1}_e4m3_$2.log" | tr '\n' ' ')"
    done
  fi
  # synccheck on every other split kernel: each kernel uses its barriers its own way, and synccheck is what finds a
  # named barrier that two roles wait on from different instructions
  for k in STAGES=2 KERNEL=mma KERNEL=skinny; do
    log "compute-sanitizer synccheck split, KDTREE_SPLIT_$k"
    var=KDTREE_SPLIT_$k
    env "$var" compute-sanitizer --tool synccheck --error-exitcode 9 python3 tools/sanitize_case.py split \
      > "/tmp/sanitize_synccheck_${k/=/_}.log" 2>&1
    echo "rc=$? $(grep -E 'ERROR SUMMARY|rel err' "/tmp/sanitize_synccheck_${k/=/_}.log" | tr '\n' ' ')"
  done
  tar czf "$OUT/sanitize_logs.tgz" -C /tmp $(cd /tmp && ls sanitize_*_*.log)   # one file back, not ten
fi
if has ncu; then
  log ncu
  ncu --clock-control none --kernel-name regex:kdtree_verify_ --launch-skip 6 --launch-count 3 \
      --section SpeedOfLight --section Occupancy --section WarpStateStats \
      --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,sm__cycles_elapsed.avg \
      python3 benchmarks/bench.py --no-sglang --quick --only P131072 --out /tmp/ncu_bench.json > "$OUT/ncu.txt" 2>&1
  grep -E "kdtree_verify_[a-z_]*kernel|Duration|Issue Slots|stalled|inst_executed|hmma|wavefronts|cycles_elapsed" "$OUT/ncu.txt" \
    | awk '$NF+0 > 0.05 || /kernel|Duration|inst|hmma|wave|cycles/' | sed 's/(kdtree::Params).*//' | head -80
fi
if has ncusrc; then   # per-instruction warp-stall samples of the split kernel at H16 N9 P131072
  log "ncu source counters"
  ncu --clock-control none --set full --import-source no --kernel-name regex:split --launch-skip 3 --launch-count 1 \
      -o /tmp/kdtree_split -f python3 benchmarks/bench.py --no-sglang --only "H16 N9 tree P131072" --out /tmp/ncu_bench.json \
      > "$OUT/ncusrc.log" 2>&1
  ncu -i /tmp/kdtree_split.ncu-rep --page source --csv --print-source sass > /tmp/split_source.csv 2>> "$OUT/ncusrc.log"
  ncu -i /tmp/kdtree_split.ncu-rep --page details > "$OUT/ncusrc_details.txt" 2>&1
  python3 tools/ncu_source.py /tmp/split_source.csv 40 | tee "$OUT/ncusrc.txt"
  gzip -c /tmp/split_source.csv > "$OUT/split_source.csv.gz"
fi
log done
